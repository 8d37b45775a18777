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
"""

from __future__ import annotations

import colorsys
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from distill.toy.render import render
from distill.toy.world import (
    ATTRIBUTES,
    BACKGROUNDS,
    COLOURS,
    POSITIONS,
    SHAPES,
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
    aspect = float(weights.max(axis=0).sum() / weights.max(axis=1).sum())
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
    )


def wasserstein_1d(a: Sequence[float], b: Sequence[float]) -> float:
    """The 1-D Wasserstein-1 distance between two samples (any sizes): the mean gap between
    their quantile functions."""
    if len(a) == 0 or len(b) == 0:
        return float("nan")
    levels = (np.arange(512) + 0.5) / 512
    return float(np.mean(np.abs(np.quantile(np.asarray(a), levels) - np.quantile(np.asarray(b), levels))))


def reference_variations(prompts: Sequence[str], size: int, seed: int = 0) -> dict[str, list[float]]:
    """The world's own variation values for `prompts`: true pictures drawn and read back."""
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

    Returns `accuracy`, `per_attribute`, `diversity_gap`, `wasserstein` (per variation, normalised),
    `count`, `found` (samples in which a shape was found) and `chance`.
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
        "per_attribute": {name: float(np.mean(right[name])) for name in ATTRIBUTES},
        "diversity_gap": gap,
        "wasserstein": distances,
        "count": len(readings),
        "found": len(found),
        "chance": dict(CHANCE),
    }
