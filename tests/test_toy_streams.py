"""The toy world's measure of clips streamed past the trained length (distill/toy/stream_score.py) reads
the world's own right streams as right, and catches what a stream can get wrong: motion spread thin,
a shape that vanishes inside the picture, a colour that changes after the trained span."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from distill.toy.evaluation import eval_prompts
from distill.toy.render import render_clip
from distill.toy.score import read, score_clips
from distill.toy.stream_score import LONG_FRAMES, read_stream, render_stream, score_stream, stream_track
from distill.toy.world import BACKGROUNDS, CLIP_FRAMES, COLOURS, Scene, scene_for

PROMPTS = eval_prompts(18, clips=True)  # every motion twice
FRAMES = LONG_FRAMES  # 33: 3x the trained clip's latent frames


@pytest.fixture(scope="module")
def scenes() -> list[Scene]:
    rng = np.random.default_rng(5)  # other draws than the scorer's reference
    return [scene_for(p, rng) for p in PROMPTS]


def test_a_stream_continues_the_worlds_clip_at_its_speed_per_frame(scenes: list[Scene]) -> None:
    for scene in scenes:
        np.testing.assert_array_equal(render_stream(scene, FRAMES)[:CLIP_FRAMES], render_clip(scene))
        steps = np.diff(stream_track(scene, FRAMES), axis=0)
        np.testing.assert_allclose(steps, steps[:1].repeat(len(steps), axis=0), atol=1e-12)


def test_the_worlds_streams_score_right_and_the_clip_scorer_could_not_read_them(scenes) -> None:
    right = [render_stream(scene, FRAMES) for scene in scenes]
    scored = score_stream(right, PROMPTS)
    assert scored["accuracy"] == 1.0 and scored["identity"] == 1.0
    assert 0.9 <= scored["motion_ratio"] <= 1.1
    # Many right streams leave the picture: the clip scorer then reads wrong motion and identity.
    assert scored["world_frames_shown"] < 0.8 * FRAMES
    clip_scored = score_clips(right, PROMPTS)
    assert clip_scored["accuracy"] < 0.6 and clip_scored["motion_ratio"] > 2.0
    # The clip's travel spread over 3x the frames is a quarter of the speed per frame.
    spread = score_stream([render_clip(scene, 32, FRAMES) for scene in scenes], PROMPTS)
    assert spread["motion_ratio"] < 0.4


def test_a_shape_that_vanishes_or_changes_colour_loses_its_identity(scenes) -> None:
    """From frame `change` on, the shape is gone (bare background) or another colour: a stream whose
    shape the world still shows there (a vanished one) or shows whole there or later (a recoloured
    one) loses its identity, and only those."""
    change = CLIP_FRAMES + 1
    for scene in scenes:
        stream = render_stream(scene, FRAMES)
        still_shown = read_stream(stream)["shown"] > change  # shapes leave once, and for good
        gone = stream.copy()
        gone[change:] = BACKGROUNDS[scene.background]
        other = next(name for name in COLOURS if name != scene.colour)
        recoloured = np.concatenate(
            [stream[:change], render_stream(replace(scene, colour=other), FRAMES)[change:]]
        )
        assert read_stream(gone)["identity"] is (read(stream[change]).centre is None), scene
        assert read_stream(recoloured)["identity"] is not still_shown, scene
