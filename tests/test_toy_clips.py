"""The moving toy world: clip grammar, renderer and motion scorer (numpy only, fast), and the
motion figures the trainer logs on clips."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch

from distill.toy.render import EDGE, TRACK_GAP, half_sizes, render_clip, render_clips, track, travel
from distill.toy.score import CLIP_CHANCE, SLOW_BELOW, STILL_BELOW, score_clips
from distill.toy.world import (
    CLIP_ATTRIBUTES,
    CLIP_FRAMES,
    DIRECTIONS,
    POSITIONS,
    SPEEDS,
    STILL,
    VARIATIONS,
    all_clip_prompts,
    all_prompts,
    is_clip_prompt,
    parse_prompt,
    sample_scenes,
    scene_for,
)


def test_clip_grammar_names_motion_without_reusing_position_words() -> None:
    prompts = all_clip_prompts()
    assert len(prompts) == len(set(prompts)) == len(all_prompts()) * (len(DIRECTIONS) * len(SPEEDS) + 1)
    position_words = {word for position in POSITIONS for word in position.split()}
    motion_words = {word for p in prompts for word in p.split()} - {
        w for p in all_prompts() for w in p.split()
    }
    assert motion_words and not motion_words & position_words, motion_words & position_words
    for prompt in prompts[::37]:
        attributes = parse_prompt(prompt)
        assert attributes is not None and set(attributes) == set(CLIP_ATTRIBUTES)
        assert is_clip_prompt(prompt)
        assert scene_for(prompt, np.random.default_rng(0)).prompt == prompt
    still = parse_prompt("a red bar standing still in the top left on a black background")
    assert still is not None and still["direction"] == STILL and still["speed"] is None
    assert parse_prompt("a red bar moving sideways fast in the top left on a black background") is None
    assert parse_prompt("a red bar moving leftward quickly in the top left on a black background") is None
    assert not is_clip_prompt(all_prompts()[0])


def test_picture_scenes_draw_what_they_always_drew() -> None:
    # Clips draw a fifth number (pace); pictures must keep their four, or every picture fixture,
    # cache and calibration of the world would change.
    rng, expected = np.random.default_rng(9), np.random.default_rng(9)
    for prompt in all_prompts()[:20]:
        scene = scene_for(prompt, rng)
        assert [getattr(scene, name) for name in VARIATIONS] == expected.uniform(-1.0, 1.0, 4).tolist()
        assert scene.direction is None and not scene.is_clip


def test_tracks_move_as_named_and_stay_in_the_picture() -> None:
    for scene in sample_scenes(3000, seed=4, clips=True):
        path = track(scene)
        assert path.shape == (CLIP_FRAMES, 2)
        half = np.asarray(half_sizes(scene))
        assert (path - half >= 0).all() and (path + half <= 1).all()
        middle = path.mean(axis=0)
        quadrant = f"{'top' if middle[1] < 0.5 else 'bottom'} {'left' if middle[0] < 0.5 else 'right'}"
        assert quadrant == scene.position
        net = path[-1] - path[0]
        if scene.direction == STILL:
            assert np.allclose(net, 0.0)
            continue
        # Along its motion the shape keeps EDGE from the border on every frame, and the track's middle
        # keeps TRACK_GAP from its quadrant's inner edge, so the position reads unambiguously.
        step = np.asarray(DIRECTIONS[scene.direction])
        axis = int(np.argmax(np.abs(step)))
        assert (path[:, axis] - half[axis] >= EDGE - 1e-9).all()
        assert (path[:, axis] + half[axis] <= 1 - EDGE + 1e-9).all()
        assert abs(middle[axis] - 0.5) >= TRACK_GAP - 1e-9
        assert np.isclose(net @ step, travel(scene)) and np.allclose(net * (1 - np.abs(step)), 0.0)
        assert (
            STILL_BELOW < travel(scene) < SLOW_BELOW
            if scene.speed == "slowly"
            else travel(scene) > SLOW_BELOW
        )


def _clips(count: int, seed: int) -> tuple[list[np.ndarray], list[str], list]:
    scenes = sample_scenes(count, seed=seed, clips=True)
    return list(render_clips(scenes)), [s.prompt for s in scenes], scenes


def test_true_clips_score_one_and_noise_scores_chance() -> None:
    clips, prompts, _ = _clips(270, seed=11)
    truth = score_clips(clips, prompts)
    assert truth["accuracy"] == 1.0
    assert all(value == 1.0 for value in truth["per_attribute"].values()), truth["per_attribute"]
    assert 0.95 <= truth["motion_ratio"] <= 1.05
    assert truth["still_leak"] == 0.0 and truth["identity"] == 1.0
    assert truth["diversity_gap"] < 0.25
    assert truth["jitter"] < 0.3  # pixels: a straight track reads straight

    noise = np.random.default_rng(0).uniform(0.0, 1.0, (270, CLIP_FRAMES, 32, 32, 3)).astype(np.float32)
    result = score_clips(list(noise), prompts)
    assert result["accuracy"] < 0.01
    for name in ("colour", "shape", "position", "background"):
        assert abs(result["per_attribute"][name] - CLIP_CHANCE[name]) < 0.1, (name, result["per_attribute"])
    assert result["motion_ratio"] < 0.3
    assert result["identity"] < 0.1


def test_lost_motion_shows_in_the_motion_figures_only() -> None:
    clips, prompts, scenes = _clips(180, seed=3)
    frozen = [np.repeat(clip[:1], CLIP_FRAMES, axis=0) for clip in clips]
    result = score_clips(frozen, prompts)
    moving = np.mean([s.direction != STILL for s in scenes])
    assert result["motion_ratio"] < 0.05
    assert result["per_attribute"]["direction"] == pytest.approx(1.0 - moving)
    assert result["per_attribute"]["colour"] == result["per_attribute"]["shape"] == 1.0

    # Half the travel: slow motion. The ratio reads it, and fast prompts now read "slowly".
    slowed = [render_clip(s) if s.speed is None else _slower(s) for s in scenes]
    result = score_clips(slowed, prompts)
    assert 0.4 < result["motion_ratio"] < 0.6
    assert result["motion_ratio_per_speed"]["fast"] == pytest.approx(0.5, abs=0.06)
    assert result["per_attribute"]["direction"] > 0.95
    assert result["per_attribute"]["speed"] < 0.75

    # Played backwards: every moving clip goes the wrong way; still ones stay right.
    reversed_ = score_clips([clip[::-1] for clip in clips], prompts)
    assert reversed_["per_attribute"]["direction"] == pytest.approx(1.0 - moving)
    assert reversed_["motion_ratio"] == pytest.approx(1.0, abs=0.05)


def _slower(scene) -> np.ndarray:
    """The clip of `scene` with half its travel (the track's middle where it was)."""
    frames = render_clip(scene)
    path = track(scene)
    middle = CLIP_FRAMES // 2
    # Frames 2..6 cover half the travel around the middle; stretch them over the clip.
    picks = np.round(np.linspace(middle - 2, middle + 2, CLIP_FRAMES)).astype(int)
    assert np.allclose(path[picks[-1]] - path[picks[0]], (path[-1] - path[0]) / 2)
    return frames[picks]


def test_a_moving_shape_that_changes_colour_loses_identity() -> None:
    clips, prompts, _ = _clips(20, seed=8)
    swapped = []
    for clip, prompt in zip(clips, prompts):
        scene = scene_for(prompt, np.random.default_rng(0))
        other = render_clip(replace(scene, colour="green" if scene.colour != "green" else "red"))
        swapped.append(np.concatenate([clip[:5], other[5:]]))
    assert score_clips(swapped, prompts)["identity"] == 0.0
    assert score_clips(clips, prompts)["identity"] == 1.0


def test_motion_figures_of_latents() -> None:
    from distill.models.flow_matching import frame_change, motion_extras
    from distill.train.methods.base import motion_ratio

    picture = torch.randn(2, 16, 1, 4, 4)
    assert frame_change(picture) is None and motion_extras(picture, picture) == {}
    clip = torch.randn(2, 16, 3, 4, 4)
    still = clip[:, :, :1].expand(-1, -1, 3, -1, -1)
    assert torch.equal(frame_change(still), torch.zeros(2))
    half = clip[:, :, :1] + 0.5 * (clip - clip[:, :, :1])  # the same motion, half as far
    extras = motion_extras(half, clip)
    metrics = {name: float(value.mean()) for name, value in extras.items()}
    assert motion_ratio({f"critic_{k}": v for k, v in metrics.items()})[
        "latent_motion_ratio"
    ] == pytest.approx(0.5, rel=1e-5)


def test_dmd_counts_the_motion_of_the_students_final_samples_only() -> None:
    from distill.train.methods.base import motion_ratio
    from distill.train.methods.dmd import final_step_motion

    teacher = torch.randn(2, 16, 3, 4, 4)
    final = teacher[:, :, :1] + 0.8 * (teacher - teacher[:, :, :1])  # 0.8 of the teacher's motion
    blurred = teacher[:, :, :1] + 0.1 * (teacher - teacher[:, :, :1])  # an early step's mean
    rows = [final_step_motion(final, teacher, final=True), final_step_motion(blurred, teacher, final=False)]
    # The loop averages every logged row: the early step's estimate must not pull the ratio down.
    metrics = {f"critic_{name}": float(torch.cat([r[name] for r in rows]).mean()) for name in rows[0]}
    assert motion_ratio(metrics)["latent_motion_ratio"] == pytest.approx(0.8, rel=1e-5)
    # A logging window of early steps only: nothing to report, rather than a false slow motion.
    early = final_step_motion(blurred, teacher, final=False)
    assert "latent_motion_ratio" not in motion_ratio(
        {f"critic_{k}": float(v.mean()) for k, v in early.items()}
    )


def test_a_built_teacher_folder_names_no_path_of_the_machine_it_was_built_on(tmp_path):
    from diffusers import WanTransformer3DModel

    from distill.toy.build import forget_source_paths

    folder = tmp_path / "teacher"
    WanTransformer3DModel(
        num_layers=1, num_attention_heads=1, attention_head_dim=8, ffn_dim=8
    ).save_pretrained(folder / "transformer")
    config = folder / "transformer" / "config.json"
    config.write_text(config.read_text().replace("{", '{"_name_or_path": "/home/someone/build/teacher",', 1))
    forget_source_paths(folder)
    assert "/home/someone" not in config.read_text() and "_name_or_path" not in config.read_text()
    assert WanTransformer3DModel.from_pretrained(folder / "transformer").config.num_layers == 1


def test_the_teacher_build_stops_when_its_vae_loses_the_motion(tmp_path):
    from distill.ops.errors import DistillError
    from distill.toy.build import train
    from distill.toy.recipe import Recipe

    # An unfitted VAE (vae_steps 0): its reconstructed clips show no motion, so no expert may train
    # on its latents, and nothing is written.
    with pytest.raises(DistillError, match="loses the clips' motion") as caught:
        train(Recipe(vae_steps=0, expert_steps=1), tmp_path / "teacher", log=lambda line: None)
    assert "--vae_steps" in str(caught.value.fixes)
    assert not list(tmp_path.iterdir())


def test_a_teacher_samples_clips_at_its_own_clip_guidance() -> None:
    from distill.toy.world import guidance_of

    description = {"guidance_scale": 4.0, "guidance_scale_2": 3.0}
    assert guidance_of(description) == guidance_of(description, clips=True) == (4.0, 3.0)  # an older teacher
    description |= {"clip_guidance_scale": 3.0, "clip_guidance_scale_2": 1.5}
    assert guidance_of(description) == (4.0, 3.0)
    assert guidance_of(description, clips=True) == (3.0, 1.5)
