"""Draw scenes of the toy world as pictures (H, W, 3) in [0, 1].

Geometry in fractions of the picture, so any size works (the teacher is trained at 32 x 32):
a quadrant is half the picture wide and high; the shape's long side is 55-80% of the quadrant
(`size`), a bar is ASPECT times wider than high, a column ASPECT times higher than wide; its
centre moves inside the quadrant by up to 90% of the free margin (`offset_x/y`), its hue by up
to HUE_SHIFT of a turn (`hue`). Edges are anti-aliased (4 x 4 supersampling), as a
camera would blur them.
"""

from __future__ import annotations

import colorsys
from collections.abc import Sequence

import numpy as np

from distill.toy.world import BACKGROUNDS, COLOURS, Scene

HUE_SHIFT = 0.04  # of a full turn; small enough that the colour's name never changes
MIN_EXTENT, MAX_EXTENT = 0.55, 0.8  # of the quadrant
ASPECT = 2.5  # long side / short side of a bar or a column
MAX_SHIFT = 0.9  # of the free margin around the shape inside its quadrant
_SUPERSAMPLE = 4


def extent(scene: Scene) -> float:
    """The shape's long side as a fraction of the quadrant."""
    return MIN_EXTENT + (MAX_EXTENT - MIN_EXTENT) * (scene.size + 1.0) / 2.0


def centre(scene: Scene) -> tuple[float, float]:
    """Centre (x, y) of the shape's bounding box as fractions of the picture."""
    margin = (1.0 - extent(scene)) / 2.0  # free space on each side, in quadrants
    qx = 0.5 if scene.position.endswith("right") else 0.0
    qy = 0.5 if scene.position.startswith("bottom") else 0.0
    x = qx + 0.25 + 0.5 * margin * MAX_SHIFT * scene.offset_x
    y = qy + 0.25 + 0.5 * margin * MAX_SHIFT * scene.offset_y
    return x, y


def object_colour(scene: Scene) -> np.ndarray:
    """The shape's RGB: the named colour with its hue shifted by `scene.hue * HUE_SHIFT`."""
    h, s, v = colorsys.rgb_to_hsv(*COLOURS[scene.colour])
    return np.array(colorsys.hsv_to_rgb((h + HUE_SHIFT * scene.hue) % 1.0, s, v), dtype=np.float32)


def coverage(scene: Scene, size: int) -> np.ndarray:
    """How much of each pixel (size, size) the shape covers, in [0, 1]."""
    n = size * _SUPERSAMPLE
    grid = (np.arange(n, dtype=np.float32) + 0.5) / n
    x, y = np.meshgrid(grid, grid)
    cx, cy = centre(scene)
    half = 0.25 * extent(scene)  # half the extent, in picture fractions (a quadrant is 0.5)
    half_w, half_h = {
        "square": (half, half),
        "bar": (half, half / ASPECT),
        "column": (half / ASPECT, half),
    }.get(scene.shape, (None, None))
    if half_w is None:
        raise ValueError(f"unknown shape {scene.shape!r}")
    inside = (np.abs(x - cx) <= half_w) & (np.abs(y - cy) <= half_h)
    return inside.reshape(size, _SUPERSAMPLE, size, _SUPERSAMPLE).mean(axis=(1, 3)).astype(np.float32)


def render(scene: Scene, size: int = 32) -> np.ndarray:
    """The picture of `scene`, (size, size, 3) float32 in [0, 1]."""
    alpha = coverage(scene, size)[..., None]
    background = np.array(BACKGROUNDS[scene.background], dtype=np.float32)
    return (1.0 - alpha) * background + alpha * object_colour(scene)


def render_batch(scenes: Sequence[Scene], size: int = 32) -> np.ndarray:
    """Pictures (N, size, size, 3) of several scenes."""
    return np.stack([render(scene, size) for scene in scenes])
