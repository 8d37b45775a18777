"""Read toy-world pictures back and score a set of samples against their prompts.

`read` looks only at the picture: the background is the median colour of the border, the shape is
every pixel that differs from it (weighted by how much of the way it is from the background to the
shape's colour), and from that shape it reads the colour (nearest named colour), the position
(quadrant of the centroid), the shape (the aspect ratio of its extent: bar wide, column tall,
square in between) and the unnamed variation (centroid inside the quadrant, size, hue shift).

`score` compares readings with the prompts:

- `accuracy`: the fraction of samples whose four attributes are all right (chance: 1/216);
  `per_attribute`: the fraction right for each attribute (chance: 1/6, 1/3, 1/4, 1/3).
- `diversity_gap`: for each variation, the 1-D Wasserstein distance between the samples' values
  and the world's own values for the same prompts (pictures drawn by `render`, read the same way),
  divided by the world's standard deviation; averaged over the variations (None when no
  sample shows a shape). 0 = the world's
  spread; about 0.8 = every sample identical (collapsed); larger = off the world entirely.
  Finite sets of true pictures land near 0.1-0.2, not 0.

`score_clips` does the same for clips (F, H, W, 3), reading every frame and the shape's track:

- attributes: colour, shape and background by majority over the frames, position from the track's
  middle, `direction` from the track's net displacement (a straight line fitted to the centroids;
  under STILL_BELOW of the picture = still) and `speed` from its length (SLOW_BELOW splits slowly
  from fast; None for a still clip). `accuracy` counts a clip right only if all six are.
- `motion_ratio`: per speed class, the samples' mean travel over the world's own mean travel for the
  same prompts, averaged over the classes (`motion_ratio_per_speed`): 1.0 = the right amount of
  motion, < 1 = slow motion, 0 = frozen.
- `still_leak`: the fraction of still prompts whose clip moved.
- `jitter`: mean RMS distance (pixels) of the centroids from their fitted line (0 = smooth).
- `identity`: the fraction of clips showing the same colour and shape in every frame.
- `diversity_gap` as for pictures, over CLIP_VARIATIONS (`pace`: travel relative to the speed's).
"""

from __future__ import annotations

import colorsys
import functools
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from distill.toy.render import render, render_clip
from distill.toy.world import (
    ATTRIBUTES,
    BACKGROUNDS,
    CLIP_ATTRIBUTES,
    CLIP_VARIATIONS,
    COLOURS,
    DIRECTIONS,
    MOTIONS,
    PACE_SPREAD,
    POSITIONS,
    SHAPES,
    SPEEDS,
    STILL,
    VARIATIONS,
    parse_prompt,
    scene_for,
)

CHANCE = {
    "colour": 1 / len(COLOURS),
    "shape": 1 / len(SHAPES),
    "position": 1 / len(POSITIONS),
    "background": 1 / len(BACKGROUNDS),
}
CHANCE["all"] = float(np.prod(list(CHANCE.values())))
# A clip's motion is one of len(MOTIONS) (direction and speed together).
CLIP_CHANCE = dict(CHANCE) | {
    "direction": 1 / (len(DIRECTIONS) + 1),
    "speed": 1 / (len(SPEEDS) + 1),
    "all": CHANCE["all"] / len(MOTIONS),
}
# Net travel (fraction of the picture) below which a clip reads as still: half the slowest travel
# the world draws (slowly at the lowest pace).
STILL_BELOW = 0.5 * min(SPEEDS.values()) * (1.0 - PACE_SPREAD)
# Between the slowest "fast" travel and the fastest "slowly" one.
SLOW_BELOW = 0.5 * (SPEEDS["slowly"] * (1.0 + PACE_SPREAD) + SPEEDS["fast"] * (1.0 - PACE_SPREAD))
_REFERENCE_CLIPS = 288  # world clips read for the clip reference (at least one per prompt)

# A pixel belongs to the shape when it is at least this far (fraction of the way) from the
# background towards the shape's colour.
_INSIDE = 0.5
_MIN_PIXELS = 4  # fewer shape pixels than this: nothing was drawn
# Width / height above which a shape reads as a bar (below its inverse: a column). Between the
# square's 1 and the drawn ASPECT 2.5, nearer 1 because blur adds the same to both sides.
_WIDE = 1.5
_REFERENCE_TOTAL = 1024  # world pictures read for the reference (at least one per prompt)
_NAMED = {name: np.array(rgb, dtype=np.float32) for name, rgb in COLOURS.items()}
_BACKDROPS = {name: np.array(rgb, dtype=np.float32) for name, rgb in BACKGROUNDS.items()}


@dataclass
class Reading:
    """What one picture shows. Attributes are None when no shape was found."""

    attributes: dict[str, str | None]
    variations: dict[str, float] = field(default_factory=dict)
    """offset_x/offset_y: centroid minus the quadrant's centre (picture fractions); size:
    sqrt(area) / width; hue: hue minus the named colour's hue (turns). Empty without a shape."""
    centre: tuple[float, float] | None = None
    """The shape's centroid (x, y) in picture fractions; None without a shape."""
    extent: tuple[float, float] | None = None
    """The shape's soft width and height in picture fractions; None without a shape."""


def _nearest(value: np.ndarray, table: dict[str, np.ndarray]) -> str:
    return min(table, key=lambda name: float(np.sum((table[name] - value) ** 2)))


def _hue(rgb: np.ndarray) -> float:
    return colorsys.rgb_to_hsv(*np.clip(rgb, 0.0, 1.0).tolist())[0]


def read(image: np.ndarray) -> Reading:
    """Read one picture (H, W, 3) in [0, 1] (uint8 is accepted too)."""
    image = np.asarray(image, dtype=np.float32)
    if image.max() > 1.5:
        image = image / 255.0
    height, width = image.shape[:2]
    border = np.concatenate([image[0], image[-1], image[:, 0], image[:, -1]])
    backdrop = np.median(border, axis=0)
    background = _nearest(backdrop, _BACKDROPS)
    distance = np.linalg.norm(image - backdrop, axis=-1)
    if np.count_nonzero(distance > 0.25) < _MIN_PIXELS:
        return Reading({"background": background, "colour": None, "shape": None, "position": None})
    # The shape's colour: the median of its most distinct pixels (its core, not the blurred edge).
    core = distance >= np.quantile(distance[distance > 0.25], 0.5)
    colour_rgb = np.median(image[core & (distance > 0.25)], axis=0)
    colour = _nearest(colour_rgb, _NAMED)
    direction = colour_rgb - backdrop
    alpha = np.clip((image - backdrop) @ direction / max(float(direction @ direction), 1e-6), 0.0, 1.0)
    mask = alpha >= _INSIDE
    if np.count_nonzero(mask) < _MIN_PIXELS:
        return Reading({"background": background, "colour": colour, "shape": None, "position": None})
    weights = alpha * mask
    # Soft extent: a column (row) half covered counts as half a pixel of width (height), so small
    # anti-aliased shapes measure like large ones.
    soft_width, soft_height = float(weights.max(axis=0).sum()), float(weights.max(axis=1).sum())
    aspect = soft_width / soft_height
    shape = "bar" if aspect > _WIDE else "column" if aspect < 1.0 / _WIDE else "square"
    grid_y, grid_x = np.mgrid[0:height, 0:width]
    cx = float((weights * (grid_x + 0.5)).sum() / weights.sum()) / width
    cy = float((weights * (grid_y + 0.5)).sum() / weights.sum()) / height
    position = f"{'top' if cy < 0.5 else 'bottom'} {'left' if cx < 0.5 else 'right'}"
    hue_shift = (_hue(colour_rgb) - _hue(_NAMED[colour]) + 0.5) % 1.0 - 0.5
    return Reading(
        {"background": background, "colour": colour, "shape": shape, "position": position},
        {
            "offset_x": cx - (0.75 if cx >= 0.5 else 0.25),
            "offset_y": cy - (0.75 if cy >= 0.5 else 0.25),
            "size": float(np.sqrt(weights.sum())) / width,
            "hue": hue_shift,
        },
        (cx, cy),
        (soft_width / width, soft_height / height),
    )


@dataclass
class ClipReading:
    """What one clip shows. Attributes are None where no shape was found (in at least 3 frames)."""

    attributes: dict[str, str | None]
    variations: dict[str, float] = field(default_factory=dict)
    """As a picture's (offsets from the track's middle, medians of size and hue), plus `travel`:
    the length of the fitted net displacement (picture fractions). Empty without a track."""
    jitter: float | None = None
    """RMS distance of the centroids from their fitted line, in pixels."""
    same_identity: bool = False
    """The same colour and shape read in every frame."""


def _majority(values: Sequence[str | None]) -> str | None:
    seen = [v for v in values if v is not None]
    return max(set(seen), key=seen.count) if seen else None


def read_clip(frames: np.ndarray) -> ClipReading:
    """Read one clip (F, H, W, 3) in [0, 1] (uint8 accepted)."""
    frames = np.asarray(frames, dtype=np.float32)
    if frames.max() > 1.5:
        frames = frames / 255.0
    readings = [read(frame) for frame in frames]
    width = frames.shape[2]
    colour = _majority([r.attributes["colour"] for r in readings])
    shape = _majority([r.attributes["shape"] for r in readings])
    attributes: dict[str, str | None] = {
        "colour": colour,
        "shape": shape,
        "background": _majority([r.attributes["background"] for r in readings]),
        "position": None,
        "direction": None,
        "speed": None,
    }
    found = [(t, r) for t, r in enumerate(readings) if r.centre is not None]
    same = len(found) == len(readings) and all(
        r.attributes["colour"] == colour and r.attributes["shape"] == shape for r in readings
    )
    if len(found) < 3:
        return ClipReading(attributes, same_identity=same)
    times = np.array([t for t, _ in found], dtype=np.float64)
    centres = np.array([r.centre for _, r in found], dtype=np.float64)
    # A straight line through the centroids, per axis: slope = velocity per frame.
    design = np.stack([np.ones_like(times), times], axis=1)
    coefficients, *_ = np.linalg.lstsq(design, centres, rcond=None)
    fitted = design @ coefficients
    net = coefficients[1] * (len(frames) - 1)  # (dx, dy) over the whole clip
    middle = coefficients[0] + coefficients[1] * (len(frames) - 1) / 2.0
    distance = float(np.hypot(*net))
    if distance < STILL_BELOW:
        direction, speed = STILL, None
    else:
        axis = int(np.argmax(np.abs(net)))
        sign = int(np.sign(net[axis]))
        direction = next(name for name, step in DIRECTIONS.items() if step[axis] == sign)
        speed = "slowly" if distance < SLOW_BELOW else "fast"
    cx, cy = float(middle[0]), float(middle[1])
    attributes |= {
        "position": f"{'top' if cy < 0.5 else 'bottom'} {'left' if cx < 0.5 else 'right'}",
        "direction": direction,
        "speed": speed,
    }
    found_readings = [r for _, r in found]
    variations = {
        "offset_x": cx - (0.75 if cx >= 0.5 else 0.25),
        "offset_y": cy - (0.75 if cy >= 0.5 else 0.25),
        "size": float(np.median([r.variations["size"] for r in found_readings])),
        "hue": float(np.median([r.variations["hue"] for r in found_readings])),
        "travel": distance,
    }
    jitter = float(np.sqrt(np.mean(np.sum((centres - fitted) ** 2, axis=1)))) * width
    return ClipReading(attributes, variations, jitter, same)


def wasserstein_1d(a: Sequence[float], b: Sequence[float]) -> float:
    """The 1-D Wasserstein-1 distance between two samples (any sizes): the mean gap between
    their quantile functions."""
    if len(a) == 0 or len(b) == 0:
        return float("nan")
    levels = (np.arange(512) + 0.5) / 512
    return float(np.mean(np.abs(np.quantile(np.asarray(a), levels) - np.quantile(np.asarray(b), levels))))


def reference_variations(prompts: Sequence[str], size: int, seed: int = 0) -> dict[str, list[float]]:
    """The world's own variation values for `prompts`: true pictures drawn and read back (the same
    every time: kept for the process, as every score of the same prompts draws them again)."""
    return _reference_variations(tuple(prompts), size, seed)


@functools.lru_cache(maxsize=16)
def _reference_variations(prompts: tuple[str, ...], size: int, seed: int) -> dict[str, list[float]]:
    rng = np.random.default_rng(seed)
    values: dict[str, list[float]] = {name: [] for name in VARIATIONS}
    per_prompt = -(-_REFERENCE_TOTAL // max(len(prompts), 1))
    for prompt in prompts:
        for _ in range(per_prompt):
            reading = read(render(scene_for(prompt, rng), size))
            for name in VARIATIONS:
                values[name].append(reading.variations[name])
    return values


def score(images: Sequence[np.ndarray], prompts: Sequence[str], seed: int = 0) -> dict[str, Any]:
    """Accuracy and diversity gap of `images` (each (H, W, 3)) drawn for `prompts` (grammar prompts).

    Returns `accuracy`, `correct` (one character per sample: 1 when all its attributes are right),
    `per_attribute`, `diversity_gap`, `wasserstein` (per variation, normalised), `count`, `found`
    (samples in which a shape was found) and `chance`.
    """
    if len(images) != len(prompts) or not len(images):
        raise ValueError(f"need one prompt per image, got {len(images)} images and {len(prompts)} prompts")
    expected = [parse_prompt(p) for p in prompts]
    if any(e is None for e in expected):
        bad = next(p for p, e in zip(prompts, expected) if e is None)
        raise ValueError(f"not a toy-world prompt: {bad!r}")
    readings = [read(image) for image in images]
    right = {name: [r.attributes[name] == e[name] for r, e in zip(readings, expected)] for name in ATTRIBUTES}
    all_right = [all(right[name][i] for name in ATTRIBUTES) for i in range(len(readings))]
    found = [r for r in readings if r.variations]
    reference = reference_variations(prompts, int(np.asarray(images[0]).shape[1]), seed)
    # None (JSON null) when no sample shows a shape at all: there is no spread to compare.
    distances: dict[str, float | None] = {name: None for name in VARIATIONS}
    gap = None
    if found:
        for name in VARIATIONS:
            spread = float(np.std(reference[name])) or 1.0
            distances[name] = wasserstein_1d([r.variations[name] for r in found], reference[name]) / spread
        gap = float(np.mean(list(distances.values())))
    return {
        "accuracy": float(np.mean(all_right)),
        "correct": "".join("1" if ok else "0" for ok in all_right),
        "per_attribute": {name: float(np.mean(right[name])) for name in ATTRIBUTES},
        "diversity_gap": gap,
        "wasserstein": distances,
        "count": len(readings),
        "found": len(found),
        "chance": dict(CHANCE),
    }


def reference_clips(prompts: Sequence[str], size: int, frames: int, seed: int = 0) -> list[ClipReading]:
    """The world's own clips for `prompts` (at least one each), drawn and read back (kept for the
    process, as reference_variations)."""
    return list(_reference_clips(tuple(prompts), size, frames, seed))


@functools.lru_cache(maxsize=16)
def _reference_clips(prompts: tuple[str, ...], size: int, frames: int, seed: int) -> tuple[ClipReading, ...]:
    rng = np.random.default_rng(seed)
    per_prompt = -(-_REFERENCE_CLIPS // max(len(set(prompts)), 1))
    return tuple(
        read_clip(render_clip(scene_for(prompt, rng), size, frames))
        for prompt in sorted(set(prompts))
        for _ in range(per_prompt)
    )


def _clip_variations(reading: ClipReading, expected: dict[str, str | None]) -> dict[str, float]:
    """A reading's CLIP_VARIATIONS; `pace` only for a prompt that moves (its travel against the
    prompt's speed, on the world's [-1, 1] scale)."""
    values = {name: reading.variations[name] for name in VARIATIONS}
    if expected["speed"] is not None:
        values["pace"] = (reading.variations["travel"] / SPEEDS[expected["speed"]] - 1.0) / PACE_SPREAD
    return values


def score_clips(clips: Sequence[np.ndarray], prompts: Sequence[str], seed: int = 0) -> dict[str, Any]:
    """Accuracy, motion and diversity of `clips` (each (F, H, W, 3)) drawn for clip `prompts`.

    Returns what `score` does (over CLIP_ATTRIBUTES and CLIP_VARIATIONS) plus `motion_ratio`,
    `motion_ratio_per_speed`, `still_leak`, `jitter` and `identity`.
    """
    if len(clips) != len(prompts) or not len(clips):
        raise ValueError(f"need one prompt per clip, got {len(clips)} clips and {len(prompts)} prompts")
    expected = [parse_prompt(p) for p in prompts]
    bad = next((p for p, e in zip(prompts, expected) if e is None or "direction" not in e), None)
    if bad is not None:
        raise ValueError(f"not a toy-world clip prompt: {bad!r}")
    first = np.asarray(clips[0])
    readings = [read_clip(clip) for clip in clips]
    right = {
        name: [r.attributes[name] == e[name] for r, e in zip(readings, expected)] for name in CLIP_ATTRIBUTES
    }
    all_right = [all(right[name][i] for name in CLIP_ATTRIBUTES) for i in range(len(readings))]
    reference = reference_clips(prompts, int(first.shape[2]), int(first.shape[0]), seed)
    reference_expected = [
        parse_prompt(p) for p in sorted(set(prompts)) for _ in range(len(reference) // len(set(prompts)))
    ]

    def travels(pairs: Sequence[tuple[ClipReading, dict[str, str | None]]], speed: str) -> list[float]:
        return [r.variations["travel"] for r, e in pairs if e["speed"] == speed and r.variations]

    ratios: dict[str, float | None] = {}
    for speed in SPEEDS:
        ours = travels(list(zip(readings, expected)), speed)
        world_travel = travels(list(zip(reference, reference_expected)), speed)
        present = any(e["speed"] == speed for e in expected)
        # A clip with no track moved nowhere: it counts as 0 travel, not as missing.
        missing = sum(1 for r, e in zip(readings, expected) if e["speed"] == speed and not r.variations)
        if present and world_travel:
            ratios[speed] = float(np.mean([*ours, *[0.0] * missing]) / np.mean(world_travel))
    still = [
        r.attributes["direction"] == STILL for r, e in zip(readings, expected) if e["direction"] == STILL
    ]
    distances: dict[str, float | None] = {name: None for name in CLIP_VARIATIONS}
    gap = None
    sample_values = [_clip_variations(r, e) for r, e in zip(readings, expected) if r.variations]
    if sample_values:
        world_values = [_clip_variations(r, e) for r, e in zip(reference, reference_expected) if r.variations]
        for name in CLIP_VARIATIONS:
            ours = [v[name] for v in sample_values if name in v]
            theirs = [v[name] for v in world_values if name in v]
            if ours and theirs:
                distances[name] = wasserstein_1d(ours, theirs) / (float(np.std(theirs)) or 1.0)
        present_gaps = [d for d in distances.values() if d is not None]
        gap = float(np.mean(present_gaps)) if present_gaps else None
    jitters = [r.jitter for r in readings if r.jitter is not None]
    return {
        "accuracy": float(np.mean(all_right)),
        "correct": "".join("1" if ok else "0" for ok in all_right),
        "per_attribute": {name: float(np.mean(right[name])) for name in CLIP_ATTRIBUTES},
        "diversity_gap": gap,
        "wasserstein": distances,
        "motion_ratio": float(np.mean(list(ratios.values()))) if ratios else None,
        "motion_ratio_per_speed": ratios,
        "still_leak": None if not still else 1.0 - float(np.mean(still)),
        "jitter": float(np.mean(jitters)) if jitters else None,
        "identity": float(np.mean([r.same_identity for r in readings])),
        "count": len(readings),
        "found": sum(1 for r in readings if r.variations),
        "chance": dict(CLIP_CHANCE),
    }


def score_any(samples: Sequence[np.ndarray], prompts: Sequence[str], seed: int = 0) -> dict[str, Any]:
    """`score` for pictures (H, W, 3), `score_clips` for clips (F, H, W, 3)."""
    if np.asarray(samples[0]).ndim == 4:
        return score_clips(samples, prompts, seed)
    return score(samples, prompts, seed)
