"""The image-to-video input surfaces (issue 49, classes 1 and 2), on the tiny I2V teacher.

1. The captioned-media folder the README and the image-to-video pages list is taken by every command
   that takes prompts (training, `generate --prompts_file`, `evaluate --prompts`), not refused by a
   path check that knows files only; a member without a caption, a damaged one or a folder without
   media is named by file, with a fix the program then accepts.
2. Every command reads an image one way (distill/data/image_files.py): an animated file, a video, a
   wide or small picture, a picture too large to decode, a link to itself and every Pillow mode give
   the same picture, refusal or note in training as in `generate --image`.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import numpy as np
import PIL.Image
import pytest
from conftest import REPO, train_args

from distill import evaluate, generate
from distill.data.image_files import ImageFileError, read_image_file, to_rgb
from distill.data.images import ImagePreprocessor, read_image_prompts
from distill.data.samples import read_training_samples
from distill.models.teacher_kind import I2V_A14B, T2V_A14B
from distill.models.tiny import write_tiny_teacher
from distill.ops.errors import DistillError, Stage
from distill.sample.media import write_frames
from train_distillation import main as train

pytestmark = pytest.mark.usefixtures("one_thread")

SIZE = 16


def clip(path: Path, seed: int = 0) -> Path:
    frames = np.random.default_rng(seed).random((5, SIZE, SIZE, 3))
    return write_frames(frames, path)


def captioned_videos(folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for seed, name in enumerate(("a", "b")):
        clip(folder / f"{name}.mp4", seed)
        (folder / f"{name}.txt").write_text(f"clip {name} drifts to the right\n")
    return folder


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The tiny I2V teacher, a folder of captioned videos, and a student trained on that folder (the
    README's third data format, class 1's first member)."""
    root = tmp_path_factory.mktemp("image_inputs")
    teacher = write_tiny_teacher(root / "teacher", seed=0, kind=I2V_A14B)
    videos = captioned_videos(root / "videos")
    out = root / "run"
    args = train_args(
        teacher,
        out,
        root / "cache",
        student_config=REPO / "config" / "student_tiny_i2v.json",
        data_path=videos,
        height=SIZE,
        width=SIZE,
        num_frames=5,
        num_steps=1,
        batch_size=1,
    )
    assert train(args) == 0
    return {"root": root, "teacher": teacher, "videos": videos, "student": out / "student", "args": args}


def banner(capsys: pytest.CaptureFixture[str]) -> tuple[str, str]:
    """(the ERROR title line, the whole stderr) of a refused command; never a traceback."""
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.count("ERROR (") == 1, err
    return next(line for line in err.splitlines() if line.startswith("ERROR (")), err


def first_fix(err: str) -> str:
    return err.split("How to fix:")[1].splitlines()[1].split("1. ", 1)[1]


# ---------------------------------------------------------------------------------------------
# 1. A documented data format is taken by every command
# ---------------------------------------------------------------------------------------------


def test_training_takes_a_folder_of_captioned_videos(world):
    # Each video's first frame was encoded once (one entry per image, beside the folder's settings).
    latents = sorted((world["root"] / "cache" / "image_latents").glob("*.safetensors"))
    assert len(latents) == 2
    assert (world["student"] / "config.json").is_file()


def test_generate_and_evaluate_take_the_same_folder(world, tmp_path, capsys):
    out = tmp_path / "clips"
    code = generate.main(
        ["--student", str(world["student"]), "--prompts_file", str(world["videos"]), "--output", str(out)]
        + ["--steps", "1", "--device", "cpu"]
    )
    assert code == 0, capsys.readouterr().err
    assert sorted(p.name for p in out.glob("prompt_*.mp4")) == ["prompt_00.mp4", "prompt_01.mp4"]
    code = evaluate.main(
        [
            "--student",
            str(world["student"]),
            "--prompts",
            str(world["videos"]),
            "--output_dir",
            str(tmp_path / "e"),
        ]
        + ["--steps", "1", "--device", "cpu"]
    )
    assert code == 0, capsys.readouterr().err
    assert json.loads((tmp_path / "e" / "eval.json").read_text())["num_prompts"] == 2


def test_a_folder_of_captioned_pictures_pairs_them_too(tmp_path):
    folder = tmp_path / "stills"
    folder.mkdir()
    PIL.Image.new("RGB", (SIZE, SIZE), (200, 10, 10)).save(folder / "red.png")
    (folder / "red.txt").write_text("a red field")
    (pair,) = read_image_prompts(folder)
    assert (pair.prompt, pair.image, pair.source) == ("a red field", folder / "red.png", folder / "red.txt")


def test_a_member_without_its_caption_is_named_and_the_fix_is_taken(world, tmp_path, capsys):
    folder = captioned_videos(tmp_path / "videos")
    clip(folder / "c.mp4")
    code = train([*world["args"], "--data_path", str(folder), "--output_dir", str(tmp_path / "o")])
    title, err = banner(capsys)
    assert code == 6 and f"--data_path {folder}: c.mp4 has no caption file c.txt" in title
    assert not (tmp_path / "o").exists()  # refused before anything was written
    assert first_fix(err).startswith(f"write the caption of c.mp4 in {folder / 'c.txt'}")
    (folder / "c.txt").write_text("clip c")  # the fix
    assert len(read_image_prompts(folder)) == 3


def test_a_damaged_member_is_named_by_file_and_a_complete_copy_is_taken(tmp_path):
    folder = captioned_videos(tmp_path / "videos")
    complete = (folder / "b.mp4").read_bytes()
    (folder / "b.mp4").write_bytes(complete[:300])
    pairs = read_image_prompts(folder)  # a video is decoded when it is used
    preprocess = ImagePreprocessor(SIZE, SIZE)
    with pytest.raises(DistillError) as error:
        [preprocess(pair) for pair in pairs]
    assert error.value.stage == Stage.DATA
    assert f"image {folder / 'b.mp4'} cannot be decoded" in error.value.title
    assert str(folder / "b.txt") in error.value.title
    assert (
        error.value.fixes[0]
        == "replace the image with a complete copy, or move b.mp4 and b.txt out of the folder"
    )
    (folder / "b.mp4").write_bytes(complete)
    assert preprocess(read_image_prompts(folder)[1]).shape == (1, 3, SIZE, SIZE)


def test_a_folder_without_media_offers_a_prompts_file_that_is_then_taken(world, tmp_path, capsys):
    folder = tmp_path / "data"
    folder.mkdir()
    PIL.Image.new("RGB", (SIZE, SIZE)).save(tmp_path / "first.png")
    (folder / "pairs.jsonl").write_text('{"prompt": "a cat", "image": "../first.png"}\n')
    (folder / "notes.txt").write_text("not a prompt\n")
    out = tmp_path / "o"
    code = train([*world["args"], "--data_path", str(folder), "--output_dir", str(out), "--dry_run"])
    title, err = banner(capsys)
    assert code == 6 and f"--data_path {folder}: is a folder without videos or pictures" in title
    fix = first_fix(err)
    assert fix == f"pass the prompts file itself, e.g. --data_path {folder / 'pairs.jsonl'}"
    assert (
        train([*world["args"], "--data_path", fix.rsplit(" ", 1)[1], "--output_dir", str(out), "--dry_run"])
        == 0
    )


def test_a_text_to_video_teacher_refuses_the_folder_and_takes_the_text_the_fix_names(tiny_teacher, tmp_path):
    folder = captioned_videos(tmp_path / "videos")
    with pytest.raises(DistillError) as error:
        read_training_samples(folder, T2V_A14B)
    assert error.value.stage == Stage.DATA and "which generates from text only" in error.value.title
    assert "pass a .txt file of the captions" in error.value.fixes[1]
    (tmp_path / "captions.txt").write_text("clip a drifts\nclip b drifts\n")
    assert len(read_training_samples(tmp_path / "captions.txt", T2V_A14B)) == 2
    # A folder without media offers the prompts file inside that this teacher takes: text, not pairs.
    data = tmp_path / "data"
    data.mkdir()
    (data / "a_pairs.jsonl").write_text('{"prompt": "a cat", "image": "cat.png"}\n')
    (data / "prompts.txt").write_text("a cat\n")
    with pytest.raises(DistillError) as error:
        read_training_samples(data, T2V_A14B)
    assert error.value.fixes[0] == f"pass the prompts file itself, e.g. --data_path {data / 'prompts.txt'}"
    assert len(read_training_samples(data / "prompts.txt", T2V_A14B)) == 1


def test_a_caption_without_a_medium_is_said(tmp_path, caplog):
    folder = captioned_videos(tmp_path / "videos")
    (folder / "c.txt").write_text("its video was renamed")
    with caplog.at_level(logging.WARNING, logger="distill.data.captioned_folder"):
        assert len(read_image_prompts(folder)) == 2
    assert any(
        "1 caption file(s) without a video or picture" in r.getMessage() and "c.txt" in r.getMessage()
        for r in caplog.records
    )


# ---------------------------------------------------------------------------------------------
# 2. One image reader for every command
# ---------------------------------------------------------------------------------------------


def gen_image(world: dict, image: Path, tmp_path: Path) -> int:
    return generate.main(
        [
            "--teacher_only",
            "--teacher_path",
            str(world["teacher"]),
            "--image",
            str(image),
            "--prompt",
            "a cat",
        ]
        + [
            "--output",
            str(tmp_path / "g.mp4"),
            "--height",
            str(SIZE),
            "--width",
            str(SIZE),
            "--num_frames",
            "5",
        ]
        + ["--steps", "1", "--device", "cpu"]
    )


def bomb(path: Path) -> Path:
    PIL.Image.new("1", (14000, 14000)).save(path)  # a few KB that claim 196 million pixels
    return path


def test_a_picture_too_large_to_decode_is_refused_in_training_and_in_generate(world, tmp_path, capsys):
    image = bomb(tmp_path / "huge.png")
    assert image.stat().st_size < 100_000
    (tmp_path / "p.jsonl").write_text('{"prompt": "a cat", "image": "huge.png"}\n')
    code = train(
        [*world["args"], "--data_path", str(tmp_path / "p.jsonl"), "--output_dir", str(tmp_path / "o")]
    )
    title, err = banner(capsys)
    assert code == 6 and f"line 1: image {image} is too large to decode" in title
    assert "scale it down" in first_fix(err)
    assert gen_image(world, image, tmp_path) == 6
    title, err = banner(capsys)
    assert f"--image {image}: is too large to decode" in title and "scale it down" in first_fix(err)
    PIL.Image.new("RGB", (64, 64)).save(image)  # the fix
    assert gen_image(world, image, tmp_path) == 0


def test_a_link_to_itself_is_said_to_be_one_and_the_fix_is_taken(world, tmp_path, capsys):
    link = tmp_path / "loop.png"
    os.symlink(link.name, link)
    assert gen_image(world, link, tmp_path) == 2
    title, err = banner(capsys)
    assert f"--image {link}: is a link that points back to itself" in title
    assert first_fix(err).startswith(f"point the link at the image file (ln -sf IMAGE {link})")
    PIL.Image.new("RGB", (SIZE, SIZE)).save(tmp_path / "real.png")
    link.unlink()
    os.symlink("real.png", link)  # the fix
    assert gen_image(world, link, tmp_path) == 0


def test_generate_takes_a_videos_first_frame_and_says_what_it_did(world, tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="distill.data.images"):
        assert gen_image(world, world["videos"] / "a.mp4", tmp_path) == 0
        wide = tmp_path / "wide.png"
        PIL.Image.new("RGB", (2000, 4)).save(wide)
        assert gen_image(world, wide, tmp_path) == 0
    said = [r.getMessage() for r in caplog.records]
    assert any("a.mp4 (--image) is a video: its first frame is used" in s for s in said)
    assert any("wide.png (--image) is 2000x4, another aspect ratio than the run's 16x16" in s for s in said)
    assert any("wide.png (--image) is 2000x4, smaller than the run's 16x16" in s for s in said)
    video_frame, _ = read_image_file(world["videos"] / "a.mp4")
    assert video_frame.size == (SIZE, SIZE) and video_frame.mode == "RGB"


@pytest.mark.parametrize("suffix", [".gif", ".png"])
def test_an_animated_file_gives_its_first_frame_and_says_so(tmp_path, suffix):
    frames = [PIL.Image.new("RGB", (8, 8), (60 * i, 0, 0)) for i in range(3)]
    path = tmp_path / f"anim{suffix}"
    frames[0].save(path, save_all=True, append_images=frames[1:])
    image, notes = read_image_file(path)
    assert np.asarray(image)[0, 0].tolist() == [0, 0, 0]
    assert [n.kind for n in notes] == ["frames"] and "of 3 frames: its first frame is used" in notes[0].text


# Every Pillow mode, made from one colour, and the 8-bit RGB it must read as.
COLOUR = (200, 100, 50)
GREY = round(0.299 * 200 + 0.587 * 100 + 0.114 * 50)  # 124, Pillow's L


def mode_image(mode: str) -> PIL.Image.Image:
    if mode.startswith("I;16"):  # made from bytes: Pillow's convert into these modes clips to 255
        order = ">u2" if mode == "I;16B" else "<u2"
        return PIL.Image.frombytes(mode, (4, 4), np.full((4, 4), GREY * 257, np.dtype(order)).tobytes())
    if mode == "I":
        return PIL.Image.fromarray(np.full((4, 4), GREY * 257, np.int32))
    if mode == "F":
        return PIL.Image.fromarray(np.full((4, 4), GREY / 255, np.float32))
    return PIL.Image.new("RGB", (4, 4), COLOUR).convert(mode)


@pytest.mark.parametrize(
    "mode, expected",
    [
        *((m, COLOUR) for m in ("RGB", "RGBA", "RGBX", "RGBa", "CMYK", "HSV")),
        *((m, (GREY,) * 3) for m in ("L", "LA", "La", "I", "F", "I;16", "I;16B", "I;16L", "I;16N")),
        ("P", (204, 102, 51)),  # the web palette's nearest colour
        ("PA", (204, 102, 51)),
        ("YCbCr", (199, 99, 49)),  # rounding of the colour space, as Pillow converts it
        ("LAB", (199, 100, 50)),
        ("1", (0, 0, 0)),  # 124 < 128: black in a one-bit picture
    ],
)
def test_every_pillow_mode_reads_as_the_picture_it_holds(mode, expected):
    image = mode_image(mode)
    assert image.mode == mode
    rgb, notes = to_rgb(image)
    assert rgb.mode == "RGB" and tuple(np.asarray(rgb)[0, 0].tolist()) == expected
    if mode in ("I", "F") or mode.startswith("I;16"):
        assert [n.kind for n in notes] == ["depth"] and "scaled to 8 bits" in notes[0].text


def test_transparency_is_dropped_as_the_stock_pipeline_drops_it_and_said(tmp_path):
    from diffusers.utils import load_image

    image = PIL.Image.new("RGBA", (4, 4), (10, 20, 30, 0))
    image.save(tmp_path / "clear.png")
    rgb, notes = read_image_file(tmp_path / "clear.png")
    assert np.array_equal(np.asarray(rgb), np.asarray(load_image(str(tmp_path / "clear.png"))))
    assert [n.kind for n in notes] == ["alpha"]


def test_a_file_no_format_recognises_is_refused(tmp_path):
    (tmp_path / "x.png").write_text("not a picture")
    with pytest.raises(ImageFileError) as error:
        read_image_file(tmp_path / "x.png")
    assert "is not an image" in error.value.problem and not error.value.path_wrong


def test_a_dry_run_decodes_every_image_so_the_real_run_can_read_what_it_passed(world, tmp_path, capsys):
    """Class 3's last member: a header check passes an image cut short, which the real run would only
    find after the teacher loads; the dry run decodes it and names the file, and the complete copy
    then passes (exit 0)."""
    picture = tmp_path / "start.png"
    PIL.Image.fromarray(np.full((SIZE, SIZE, 3), 120, dtype=np.uint8)).save(picture)
    complete = picture.read_bytes()
    picture.write_bytes(complete[:60])  # the header survives, the pixels do not
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text(json.dumps({"prompt": "a grey clip", "image": "start.png"}) + "\n")
    args = [*world["args"], "--data_path", str(pairs), "--output_dir", str(tmp_path / "out"), "--dry_run"]
    assert train(args) == 6
    title, err = banner(capsys)
    assert f"--data_path {pairs}: line 1: image {picture} cannot be decoded" in title
    assert "replace the image with a complete copy, or remove the line" in err
    assert not (tmp_path / "out").exists()  # a dry run writes nothing
    picture.write_bytes(complete)
    assert train(args) == 0
