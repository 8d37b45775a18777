"""The image-to-video score of the toy world (numpy only, fast): it passes the world's own clips and
sees both failures of few-step I2V students, the image ignored and the motion lost."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from distill.toy.image_score import (
    IDENTITY_CHANCE,
    STATIC_BELOW,
    _box_blur,
    frame_threshold,
    image_adherence,
    main,
    motion_of,
    motion_prompts,
    opposite,
    reference_clips,
    score_image_clips,
    shuffled,
    slide,
)
from distill.toy.render import render_clip, travel
from distill.toy.world import BACKGROUNDS, COLOURS, POSITIONS, SHAPES, STILL, motions


def test_motion_prompts_name_only_the_motion_and_pair_each_with_its_first_frame() -> None:
    cases = motion_prompts(18, seed=11)
    again = motion_prompts(18, seed=11)
    assert [c.prompt for c in cases] == [c.prompt for c in again]
    assert all(np.array_equal(a.image, b.image) and a.scene == b.scene for a, b in zip(cases, again))
    image_words = {*COLOURS, *SHAPES, *BACKGROUNDS, *(w for p in POSITIONS for w in p.split())}
    for i, case in enumerate(cases):
        assert not set(case.prompt.split()) & image_words, case.prompt
        assert (
            motion_of(case.prompt)
            == (case.scene.direction, case.scene.speed)
            == motions()[i % len(motions())]
        )
        assert np.array_equal(case.image, render_clip(case.scene)[0])
    named = motion_prompts(18, seed=11, named=True)
    assert [c.prompt for c in named] == [c.scene.prompt for c in cases]
    assert motion_prompts(18, seed=12)[0].scene != cases[0].scene
    with pytest.raises(ValueError):
        motion_of("the shape moving sideways fast")


@pytest.mark.parametrize("seed", [1, 2])
def test_the_worlds_own_clips_adhere_and_move_at_the_right_speed(seed: int) -> None:
    cases = motion_prompts(36, seed=seed)
    truth = reference_clips(cases)
    for clips in (truth, _box_blur(truth)):  # the blur: about the toy VAE's own frame-0 error
        scored = score_image_clips(clips, cases)
        assert scored["adherence"] >= 0.9, scored["parts"]
        assert 0.9 <= scored["motion_ratio"] <= 1.1
        assert scored["static_rate"] == 0.0 and scored["still_leak"] == 0.0
    named = motion_prompts(36, seed=seed, named=True)
    assert score_image_clips(truth, named)["adherence"] >= 0.9


@pytest.mark.parametrize("seed", [5, 6, 7])
def test_a_shuffled_image_scores_near_chance(seed: int) -> None:
    # Each world clip scored against the next case's image, its own motion prompt kept: the motion
    # is right, so only the image parts can fail. Another image of the world keeps the image's named
    # colour, shape and background with chance 1/54 (IDENTITY_CHANCE); adherence also needs its
    # place within a pixel and frame 0 under the threshold, so it lands at or under that.
    cases = motion_prompts(54, seed=seed)
    others = [cases[j].image for j in shuffled(len(cases))]
    scored = score_image_clips(reference_clips(cases), cases, images=others)
    assert scored["parts"]["motion"] >= 0.9
    assert scored["adherence"] <= IDENTITY_CHANCE + 0.04
    assert scored["parts"]["identity"] <= IDENTITY_CHANCE + 0.04
    assert scored["parts"]["first_frame"] <= 0.1  # the threshold is half the control's 5% quantile


def test_uniform_noise_adheres_to_nothing() -> None:
    cases = motion_prompts(18, seed=3)
    noise = np.random.default_rng(3).uniform(0.0, 1.0, reference_clips(cases).shape).astype(np.float32)
    scored = score_image_clips(noise, cases)
    assert scored["adherence"] == 0.0 and scored["parts"]["first_frame"] == 0.0
    assert scored["frame_error"] > 4 * frame_threshold()


def test_an_object_that_changes_colour_after_frame_zero_fails() -> None:
    cases = motion_prompts(18, seed=4)
    names = list(COLOURS)
    for case, clip in zip(cases, reference_clips(cases)):
        other = names[(names.index(case.scene.colour) + 3) % len(names)]
        changed = np.concatenate([clip[:1], render_clip(replace(case.scene, colour=other))[1:]])
        kept = image_adherence(clip, case.image, case.prompt)
        result = image_adherence(changed, case.image, case.prompt)
        assert kept.adheres and kept.identity
        # frame 0 and the motion are still right: it is the identity part that sees the change
        assert result.first_frame and result.motion
        assert not result.identity and not result.adheres


def test_an_object_that_grows_after_frame_zero_fails() -> None:
    # The smallest objects of the world (size <= -0.6: extent <= 0.58 of the quadrant) redrawn at the
    # largest (0.8) from frame 1 on: a third larger, over SIZE_TOLERANCE.
    cases = [case for case in motion_prompts(72, seed=14) if case.scene.size <= -0.6]
    assert len(cases) >= 5
    for case in cases:
        clip = render_clip(case.scene)
        grown = np.concatenate([clip[:1], render_clip(replace(case.scene, size=1.0))[1:]])
        assert image_adherence(clip, case.image, case.prompt).identity
        result = image_adherence(grown, case.image, case.prompt)
        assert result.first_frame and not result.identity and not result.adheres


def test_a_static_clip_counts_as_static() -> None:
    cases = motion_prompts(27, seed=8)
    frozen = np.stack([slide(case.image, STILL, 0.0) for case in cases])
    scored = score_image_clips(frozen, cases)
    assert scored["static_rate"] == 1.0 and scored["motion_ratio"] < 0.01
    for case, clip in zip(cases, frozen):
        result = image_adherence(clip, case.image, case.prompt)
        assert result.first_frame and result.identity and result.start
        # standing still is what a still prompt asks for; a moving prompt's frozen clip is static
        assert result.static == (case.scene.direction != STILL)
        assert result.adheres == (case.scene.direction == STILL)
    truth = score_image_clips(reference_clips(cases), cases)
    assert truth["static_rate"] == 0.0
    # the line: a slide just over it is not static, one just under is
    moving = next(case for case in cases if case.scene.speed == "slowly")
    size = moving.image.shape[0]
    over = slide(moving.image, moving.scene.direction, STATIC_BELOW + 2 / size)
    under = slide(moving.image, moving.scene.direction, STATIC_BELOW - 1 / size)
    assert not image_adherence(over, moving.image, moving.prompt).static
    assert image_adherence(under, moving.image, moving.prompt).static


def test_a_clip_moving_the_wrong_way_fails_the_motion_part() -> None:
    cases = [case for case in motion_prompts(36, seed=9) if case.scene.speed is not None]
    for case in cases:
        right = slide(case.image, case.scene.direction, travel(case.scene))
        wrong = slide(case.image, opposite(case.scene.direction), travel(case.scene))
        assert image_adherence(right, case.image, case.prompt).direction
        result = image_adherence(wrong, case.image, case.prompt)
        assert not result.direction and not result.motion and not result.adheres
        # frame 0 is still the image: only the motion is wrong
        assert result.first_frame and result.start


def test_half_the_motion_shows_in_the_motion_ratio() -> None:
    cases = [case for case in motion_prompts(36, seed=10) if case.scene.speed is not None]
    half = np.stack([slide(c.image, c.scene.direction, 0.5 * travel(c.scene)) for c in cases])
    ratio = score_image_clips(half, cases)["motion_ratio"]
    assert 0.35 <= ratio <= 0.65
    for case, clip in zip(cases, half):
        if case.scene.speed == "fast":  # half a fast travel is a slow one: the speed part fails
            result = image_adherence(clip, case.image, case.prompt)
            assert result.direction and not result.speed and not result.adheres


def test_an_object_that_jumps_after_frame_zero_fails_the_start() -> None:
    # Frame 0 is the image, then the object jumps 3 pixels across its motion: the track the later
    # frames draw does not start where the image put it.
    cases = motion_prompts(18, seed=15)
    for case, clip in zip(cases, reference_clips(cases)):
        across = "downward" if case.scene.direction in ("leftward", "rightward") else "rightward"
        size = case.image.shape[0]
        jumped = np.stack([clip[0], *(slide(frame, across, 3 / size, 2)[1] for frame in clip[1:])])
        result = image_adherence(jumped, case.image, case.prompt)
        assert result.first_frame and not result.start and not result.adheres


def test_the_calibration_command_prints_its_table(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--calibrate", "--count", "18", "--seed", "1"]) == 0
    out = capsys.readouterr().out
    rows = {line.split(" | ")[0].strip("| "): line for line in out.splitlines() if line.startswith("| ")}
    assert "world's own clips (from the image)" in rows and "shuffled image (another case's)" in rows
    assert f"threshold {frame_threshold():.3f}" in out
    own = [float(x) for x in rows["world's own clips (from the image)"].split(" | ")[1:3]]
    shuffled_row = [float(x) for x in rows["shuffled image (another case's)"].split(" | ")[1:3]]
    assert own[0] >= 0.9 and shuffled_row[0] <= IDENTITY_CHANCE + 0.06


def test_the_toy_vaes_own_first_frames_pass_the_frame_threshold() -> None:
    # The threshold must let through what any model decoding through the toy VAE shows at best: the
    # world's own clips encoded and decoded. (Its identity part is not asserted: the toy VAE
    # misreads a thin shape in some later frames; the calibration's VAE row shows how often.)
    from conftest import REPO

    from distill.toy.image_score import vae_round_trip

    cases = motion_prompts(18, seed=13)
    decoded = vae_round_trip(reference_clips(cases), REPO / "assets" / "toy_teacher")
    scored = score_image_clips(decoded, cases)
    assert scored["parts"]["first_frame"] == 1.0 and scored["parts"]["start"] >= 0.9
    assert scored["parts"]["motion"] >= 0.9 and 0.9 <= scored["motion_ratio"] <= 1.1
    assert scored["static_rate"] == 0.0
