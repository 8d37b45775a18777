"""Score clips streamed longer than the world's CLIP_FRAMES: what a right long clip is, and how far a
student's stream is from it.

    from distill.toy.stream_score import render_stream, score_stream
    truth = render_stream(scene, frames=33)          # the world's own 3x clip
    score_stream(clips, prompts)["identity"]         # clips: (F, H, W, 3) each, F >= CLIP_FRAMES

The world defines a clip's motion over CLIP_FRAMES frames only: its travel (the speed's fraction of the
picture, times the pace) and the track's middle in the named quadrant. A stream continues the clip, so
its right continuation is the same motion at the same speed PER FRAME: frames 0..CLIP_FRAMES-1 are the
world's clip exactly, and every later frame moves on by travel / (CLIP_FRAMES - 1) (`stream_track`).
At 33 frames (3x) a shape then travels 4x its clip's travel: 0.6 of the picture slowly, 1.2 fast, so
most moving shapes leave their quadrant and many leave the picture (a right stream may end on the
bare background). `score_clips` cannot judge such clips: it spreads the clip's travel over all the
frames (`render_clip` of 33 frames moves the shape a quarter as fast per frame), reads direction and
speed from the whole track's length, and wants a shape in every frame. Here, instead:

- a frame SHOWS the shape when one is read in it and it is whole: its centroid at least half the
  shape's width and height (read over the first CLIP_FRAMES frames, which the world always shows
  whole) inside the picture (a shape cut by the border changes its aspect and size);
- `identity`: the fraction of streams whose shape keeps its identity: every frame that shows it
  reads the colour and shape of the first CLIP_FRAMES frames (their majority) and a size within
  SIZE_TOLERANCE of theirs (median), and no frame loses the shape before it has touched the border
  (a shape may leave the picture, not vanish inside it);
- `motion_ratio`: per speed class, the mean speed per frame (a straight line fitted to the centroids
  of the frames that show the shape) over the world's own streams' mean for the same prompts, read the
  same way, averaged over the classes; `late_motion_ratio` the same over the frames after the trained
  span only, for the streams whose shape shows in 3 of them (a stream that stalls once past what it
  was trained on reads low there);
- `accuracy`: colour, shape and background (majority of the frames that show the shape), position
  (the quadrant of the first CLIP_FRAMES frames' track middle, as `score_clips` reads it), direction and
  speed (from the per-frame velocity, the world's thresholds divided by CLIP_FRAMES - 1) all right.

Streams whose shape shows in fewer than 3 frames have no track: their speed counts as 0.

What a decoded stream can score is bounded by the VAE that decodes it: the shipped toy VAE was fitted
on CLIP_FRAMES-frame clips, and its round trip of the world's own right 33-frame streams reads 0.07
accuracy and 0.00 identity (docs/streaming.md), so a student's 3x stream decoded by it is judged
against that floor, not against these right streams alone.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import numpy as np

from distill.toy.render import render_track, track
from distill.toy.score import SLOW_BELOW, STILL_BELOW, Reading, read, read_clip
from distill.toy.world import CLIP_FRAMES, DIRECTIONS, SPEEDS, STILL, Scene, parse_prompt, scene_for

LONG_FRAMES = 4 * (3 * ((CLIP_FRAMES - 1) // 4 + 1) - 1) + 1
"""A stream 3x the trained clip: 33 frames, 9 latent frames (the VAE packs 4 frames a latent frame after
the first) against the clip's 3, so 3x its chunks. (25 frames would be 3x its frame steps only: 7
latent frames.)"""
SIZE_TOLERANCE = 0.2
"""Largest relative change of the read size (sqrt of the area) from the trained span's median that
still counts as the same shape: the world's whole size range is +-18% around its middle, and a whole
moving shape's read size varies by up to 11% within the world's own clips (72 read: it depends on
the shape's place on the pixel grid)."""
CUT_TOLERANCE = 0.5
"""Pixels a shape may reach past the picture's border and still count as whole (see `_whole`)."""
_STREAM_REFERENCE = 288  # world streams read for the motion reference (at least one per prompt)
_PER_FRAME = CLIP_FRAMES - 1  # the world's travel is over this many frame steps


def stream_track(scene: Scene, frames: int) -> np.ndarray:
    """The shape's centre (x, y) on each of `frames` frames: the world's clip, its motion continued
    at the same velocity per frame. (frames, 2) in picture fractions; may leave [0, 1]."""
    clip = track(scene, CLIP_FRAMES)
    velocity = (clip[-1] - clip[0]) / _PER_FRAME
    return clip[0][None, :] + np.arange(frames, dtype=np.float64)[:, None] * velocity[None, :]


def render_stream(scene: Scene, frames: int, size: int = 32) -> np.ndarray:
    """The world's right stream of `scene`, (frames, size, size, 3) float32 in [0, 1]."""
    return render_track(scene, stream_track(scene, frames), size)


def _whole(reading: Reading, half: np.ndarray, width: int) -> bool:
    """Whether the shape read is whole: its centroid at least `half` (its trained half width and
    height) inside the picture, give or take CUT_TOLERANCE pixels. A shape cut by the border by d
    reads its centroid d / 2 inward, so cuts over 2 x CUT_TOLERANCE are caught; smaller ones change
    no reading (aspect class, size by under 10%)."""
    if reading.centre is None:
        return False
    slack = CUT_TOLERANCE / width
    centre = np.asarray(reading.centre)
    return bool(np.all(centre - half >= -slack) and np.all(centre + half <= 1.0 + slack))


def _fit_velocity(times: Sequence[int], centres: Sequence[tuple[float, float]]) -> np.ndarray | None:
    """Per-frame velocity (dx, dy) of a straight line fitted to the centroids; None under 3 points."""
    if len(times) < 3:
        return None
    design = np.stack([np.ones(len(times)), np.asarray(times, dtype=np.float64)], axis=1)
    coefficients, *_ = np.linalg.lstsq(design, np.asarray(centres, dtype=np.float64), rcond=None)
    return coefficients[1]


def _motion_of(velocity: np.ndarray | None) -> tuple[str | None, str | None, float]:
    """Direction, speed class and speed per frame of a per-frame velocity (the world's thresholds
    over its clip, per frame)."""
    if velocity is None:
        return None, None, 0.0
    speed = float(np.hypot(*velocity))
    if speed * _PER_FRAME < STILL_BELOW:
        return STILL, None, speed
    axis = int(np.argmax(np.abs(velocity)))
    sign = int(np.sign(velocity[axis]))
    direction = next(name for name, step in DIRECTIONS.items() if step[axis] == sign)
    return direction, "slowly" if speed * _PER_FRAME < SLOW_BELOW else "fast", speed


def read_stream(frames: np.ndarray) -> dict[str, Any]:
    """What one stream (F, H, W, 3) in [0, 1] shows: its attributes, `identity` (held or not),
    `speed` and `late_speed` (per frame; 0 without a track) and `shown` (frames showing the shape)."""
    frames = np.asarray(frames, dtype=np.float32)
    if frames.max() > 1.5:
        frames = frames / 255.0
    readings: list[Reading] = [read(frame) for frame in frames]
    trained = read_clip(frames[:CLIP_FRAMES])
    colour, shape = trained.attributes["colour"], trained.attributes["shape"]
    # The world's trained span always shows the whole shape: its size and extent are the shape's.
    span = [r for r in readings[:CLIP_FRAMES] if r.extent is not None]
    size = float(np.median([r.variations["size"] for r in span])) if span else None
    half = np.median([r.extent for r in span], axis=0) / 2.0 if span else np.zeros(2)
    shows = [span != [] and _whole(r, half, frames.shape[2]) for r in readings]
    held = size is not None
    touched = False
    for reading, whole in zip(readings, shows):
        if reading.centre is None and not touched:
            held = False  # lost inside the picture
        touched = touched or (reading.centre is not None and not whole)
        if whole and held:
            attributes = reading.attributes
            held = (
                attributes["colour"] == colour
                and attributes["shape"] == shape
                and abs(reading.variations["size"] / size - 1.0) <= SIZE_TOLERANCE
            )
    times = [t for t, s in enumerate(shows) if s]
    centres = [readings[t].centre for t in times]
    velocity = _fit_velocity(times, centres)
    direction, speed_class, speed = _motion_of(velocity)
    late = [(t, c) for t, c in zip(times, centres) if t >= _PER_FRAME]
    late_velocity = _fit_velocity([t for t, _ in late], [c for _, c in late])
    shown = [r for r, s in zip(readings, shows) if s]

    def majority(name: str) -> str | None:
        values = [r.attributes[name] for r in shown if r.attributes[name] is not None]
        return max(set(values), key=values.count) if values else None

    return {
        "attributes": {
            "colour": majority("colour"),
            "shape": majority("shape"),
            "background": majority("background") or trained.attributes["background"],
            "position": trained.attributes["position"],
            "direction": direction,
            "speed": speed_class,
        },
        "identity": held,
        "speed": speed if velocity is not None else None,
        "late_speed": float(np.hypot(*late_velocity)) if late_velocity is not None else None,
        "shown": len(times),
    }


@functools.lru_cache(maxsize=8)
def _reference(prompts: tuple[str, ...], size: int, frames: int, seed: int) -> tuple[dict[str, Any], ...]:
    rng = np.random.default_rng(seed)
    per_prompt = -(-_STREAM_REFERENCE // max(len(set(prompts)), 1))
    return tuple(
        {"prompt": prompt} | read_stream(render_stream(scene_for(prompt, rng), frames, size))
        for prompt in sorted(set(prompts))
        for _ in range(per_prompt)
    )


def score_stream(clips: Sequence[np.ndarray], prompts: Sequence[str], seed: int = 0) -> dict[str, Any]:
    """Accuracy, identity and motion of streamed `clips` (each (F, H, W, 3), F > CLIP_FRAMES) for clip
    `prompts`, against the world's right streams (`render_stream`) of the same prompts."""
    if len(clips) != len(prompts) or not len(clips):
        raise ValueError(f"need one prompt per clip, got {len(clips)} clips and {len(prompts)} prompts")
    expected = [parse_prompt(p) for p in prompts]
    if any(e is None or "direction" not in e for e in expected):
        raise ValueError("score_stream needs toy-world clip prompts")
    first = np.asarray(clips[0])
    readings = [read_stream(clip) for clip in clips]
    reference = _reference(tuple(prompts), int(first.shape[2]), int(first.shape[0]), seed)
    reference_speed = {e["prompt"]: parse_prompt(e["prompt"])["speed"] for e in reference}
    right = {
        name: [r["attributes"][name] == e[name] for r, e in zip(readings, expected)] for name in expected[0]
    }

    def ratio(key: str) -> tuple[float | None, dict[str, float]]:
        per_speed = {}
        for speed in SPEEDS:
            # No track over the whole stream moved nowhere (0); none after the trained span is a
            # shape that has left the picture, as the world's may: not counted.
            ours = [
                r[key] if r[key] is not None else 0.0
                for r, e in zip(readings, expected)
                if e["speed"] == speed and (key == "speed" or r[key] is not None)
            ]
            theirs = [
                r[key] for r in reference if reference_speed[r["prompt"]] == speed and r[key] is not None
            ]
            if ours and theirs:
                per_speed[speed] = float(np.mean(ours) / np.mean(theirs))
        return (float(np.mean(list(per_speed.values()))) if per_speed else None), per_speed

    motion, motion_per_speed = ratio("speed")
    late, _ = ratio("late_speed")
    correct = [all(right[n][i] for n in right) for i in range(len(readings))]
    return {
        "accuracy": float(np.mean(correct)),
        "per_attribute": {name: float(np.mean(values)) for name, values in right.items()},
        "identity": float(np.mean([r["identity"] for r in readings])),
        "motion_ratio": motion,
        "motion_ratio_per_speed": motion_per_speed,
        "late_motion_ratio": late,
        "frames_shown": float(np.mean([r["shown"] for r in readings])),
        "world_frames_shown": float(np.mean([r["shown"] for r in reference])),
        "count": len(readings),
        # Per stream, in the prompts' order: every attribute right, its identity held, and its speed
        # per frame (picture fractions; 0 without a track).
        "correct": correct,
        "held": [bool(r["identity"]) for r in readings],
        "speeds": [float(r["speed"] or 0.0) for r in readings],
    }
