"""Clips made visible to a person: all frames read back from MP4, frame strips that show motion in a
still picture, wide strips in the sample grid, and the animated teacher/student GIF. Real files,
synthetic clips (a bright square moving right), no mocks."""

import numpy as np
import pytest
from PIL import Image

from distill.sample.media import (
    GIF_GUTTER,
    frame_strip,
    label_margin,
    plot_sample_grid,
    read_first_frame,
    read_frames,
    strips,
    write_frames,
    write_side_by_side_gif,
)

FRAMES, SIZE, SQUARE = 9, 32, 8


def moving_square(step: int = 2, brightness: float = 1.0) -> np.ndarray:
    """(9, 32, 32, 3) floats in [0, 1]: a bright square on black moving `step` pixels right a frame."""
    clip = np.zeros((FRAMES, SIZE, SIZE, 3))
    for t in range(FRAMES):
        left = 2 + step * t
        clip[t, 12 : 12 + SQUARE, left : left + SQUARE] = brightness
    return clip


def centroid_x(frame: np.ndarray) -> float:
    """x of the centre of the bright pixels (MP4 blurs edges: threshold at half brightness)."""
    bright = frame.astype(float).mean(axis=-1) > 127
    assert bright.any(), "no bright square left in the frame"
    return float(np.nonzero(bright)[1].mean())


@pytest.fixture
def clip_file(tmp_path):
    return write_frames(moving_square(), tmp_path / "clip")


@pytest.fixture
def picture_file(tmp_path):
    return write_frames(moving_square()[:1], tmp_path / "picture")


def test_read_frames_gives_every_frame_of_an_mp4_with_the_motion(clip_file):
    assert clip_file.suffix == ".mp4"
    frames = read_frames(clip_file)
    assert frames.shape == (FRAMES, SIZE, SIZE, 3)
    assert frames.dtype == np.uint8
    xs = [centroid_x(f) for f in frames]
    expected = [2 + 2 * t + (SQUARE - 1) / 2 for t in range(FRAMES)]
    np.testing.assert_allclose(xs, expected, atol=1.0)  # lossy codec: about a pixel
    assert all(b > a for a, b in zip(xs, xs[1:])), xs
    # The first frame agrees with the existing reader.
    np.testing.assert_array_equal(frames[0], read_first_frame(clip_file))


def test_read_frames_of_a_png_is_one_frame(picture_file):
    assert picture_file.suffix == ".png"
    frames = read_frames(picture_file)
    assert frames.shape == (1, SIZE, SIZE, 3)
    np.testing.assert_array_equal(frames[0], (moving_square()[0] * 255).astype(np.uint8))


def test_frame_strip_of_a_clip_spans_first_to_last_frame():
    clip = moving_square()
    strip = frame_strip(clip, count=5)
    assert strip.shape == (SIZE, 5 * SIZE + 4, 3)
    assert strip.dtype == clip.dtype
    np.testing.assert_array_equal(strip[:, :SIZE], clip[0])
    np.testing.assert_array_equal(strip[:, -SIZE:], clip[-1])
    # Evenly spaced: the middle tile is the middle frame; gutters are light gray.
    middle = 2 * (SIZE + 1)
    np.testing.assert_array_equal(strip[:, middle : middle + SIZE], clip[4])
    gutters = strip[:, SIZE :: SIZE + 1]
    assert gutters.shape == (SIZE, 4, 3)
    assert np.all(gutters > 0.5) and np.all(gutters < 1.0)


def test_frame_strip_keeps_uint8_and_read_clip(clip_file):
    frames = read_frames(clip_file)
    strip = frame_strip(frames, count=3)
    assert strip.dtype == np.uint8
    assert strip.shape == (SIZE, 3 * SIZE + 2, 3)
    np.testing.assert_array_equal(strip[:, SIZE + 1 : 2 * SIZE + 1], frames[4])


def test_frame_strip_of_a_picture_is_the_picture():
    picture = moving_square()[:1]
    np.testing.assert_array_equal(frame_strip(picture), picture[0])
    assert frame_strip(picture).shape == (SIZE, SIZE, 3)


def test_strips_show_clips_as_strips_and_pictures_as_pictures(clip_file, picture_file):
    clip_strip, picture = strips([clip_file, picture_file])
    assert clip_strip.shape == (SIZE, 5 * SIZE + 4, 3)
    assert picture.shape == (SIZE, SIZE, 3)


def test_grid_of_strips_is_wider_than_grid_of_pictures(tmp_path, clip_file, picture_file):
    def ratio(images, name):
        out = plot_sample_grid(
            [("teacher", images), ("student", images)], tmp_path / name, prompts=["a", "b"], title="t"
        )
        with Image.open(out) as image:
            return image.width / image.height

    square = ratio([read_first_frame(clip_file)] * 2, "square.png")
    wide = ratio(strips([clip_file, clip_file]), "wide.png")
    assert wide > 2.5 * square, (wide, square)
    # A grid of pictures is unchanged by going through strips.
    assert ratio(strips([picture_file, picture_file]), "pictures.png") == pytest.approx(square)


def test_side_by_side_gif_plays_teacher_above_student(tmp_path):
    teacher = [moving_square(step=2), moving_square(step=2)[:1], moving_square(step=1)]
    student = [moving_square(step=0), moving_square(step=2)[:1], moving_square(step=1)]
    rows = [("teacher", teacher), ("student", student)]
    scale = 4
    out = write_side_by_side_gif(rows, tmp_path / "side_by_side.mp4", scale=scale)
    assert out == tmp_path / "side_by_side.gif"
    assert not [p for p in tmp_path.iterdir() if p != out], "temporary file left behind"

    tile = SIZE * scale
    margin = label_margin(["teacher", "student"])
    assert margin > label_margin(["s"]) > 0
    with Image.open(out) as gif:
        assert gif.n_frames == FRAMES
        assert gif.info.get("loop") == 0
        assert gif.size == (margin + 3 * tile + 2 * GIF_GUTTER, 2 * tile + GIF_GUTTER)
        frames = []
        for t in range(gif.n_frames):
            gif.seek(t)
            frames.append(np.asarray(gif.convert("RGB")).astype(int))

    top = slice(0, tile)
    bottom = slice(tile + GIF_GUTTER, 2 * tile + GIF_GUTTER)

    def column(c):
        return slice(margin + c * (tile + GIF_GUTTER), margin + c * (tile + GIF_GUTTER) + tile)

    last = frames[-1]
    # Column 0: the teacher's square moved, the student's stayed: the rows differ.
    assert np.abs(last[top, column(0)] - last[bottom, column(0)]).max() > 128
    # Columns 1 and 2: same clips in both rows, same pixels (up to the GIF palette).
    for c in (1, 2):
        assert np.abs(last[top, column(c)] - last[bottom, column(c)]).max() < 16
    # The picture (F=1) is held on every frame; the clip moves across frames.
    assert np.abs(frames[0][top, column(1)] - last[top, column(1)]).max() < 16
    assert np.abs(frames[0][top, column(0)] - last[top, column(0)]).max() > 128
    # Nearest-neighbour upscaling: the square is SQUARE * scale pixels wide in the GIF.
    bright_columns = (frames[0][top, column(0)].mean(axis=-1) > 127).any(axis=0)
    assert bright_columns.sum() == SQUARE * scale
    # The label margin is not empty: text was drawn there.
    assert frames[0][top, :margin].max() > 128
