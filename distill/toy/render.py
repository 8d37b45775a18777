"""Draw scenes of the toy world as pictures (H, W, 3) in [0, 1].

Geometry in fractions of the picture, so any size works (the teacher is trained at 32 x 32):
a quadrant is half the picture wide and high; the shape's long side is 55-80% of the quadrant
(`size`), a bar is ASPECT times wider than high, a column ASPECT times higher than wide; its
centre moves inside the quadrant by up to 90% of the free margin (`offset_x/y`), its hue by up
to HUE_SHIFT of a turn (`hue`). Edges are anti-aliased (4 x 4 supersampling), as a
camera would blur them.

A clip moves the shape at constant velocity: its travel over the clip is the speed's (times
1 +- PACE_SPREAD), and the middle of its track sits in the named quadrant, at least TRACK_GAP from
the quadrant's inner edge, with the shape at least EDGE from the picture's border on every frame
(along the motion). `offset` along the motion's axis places the middle within that room; across it,
and for still clips, offsets act as in a picture.
"""

from __future__ import annotations

import colorsys
from collections.abc import Sequence

import numpy as np

from distill.toy.world import BACKGROUNDS, CLIP_FRAMES, COLOURS, DIRECTIONS, PACE_SPREAD, SPEEDS, Scene

HUE_SHIFT = 0.04  # of a full turn; small enough that the colour's name never changes
MIN_EXTENT, MAX_EXTENT = 0.55, 0.8  # of the quadrant
ASPECT = 2.5  # long side / short side of a bar or a column
MAX_SHIFT = 0.9  # of the free margin around the shape inside its quadrant
_SUPERSAMPLE = 4
TRACK_GAP = 0.08  # of the picture: the middle of a track keeps this far from its quadrant's edges
EDGE = 0.02  # of the picture: a moving shape keeps this far from the picture's border


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


def half_sizes(scene: Scene) -> tuple[float, float]:
    """Half the shape's width and height, as fractions of the picture (a quadrant is 0.5)."""
    half = 0.25 * extent(scene)
    sizes = {"square": (half, half), "bar": (half, half / ASPECT), "column": (half / ASPECT, half)}
    if scene.shape not in sizes:
        raise ValueError(f"unknown shape {scene.shape!r}")
    return sizes[scene.shape]


def travel(scene: Scene) -> float:
    """How far a clip's shape moves over the whole clip, as a fraction of the picture (0 = still)."""
    if scene.speed is None:
        return 0.0
    return SPEEDS[scene.speed] * (1.0 + PACE_SPREAD * scene.pace)


def track(scene: Scene, frames: int = CLIP_FRAMES) -> np.ndarray:
    """The shape's centre (x, y) on each frame of a clip, (frames, 2) in picture fractions."""
    middle = list(centre(scene))
    step = DIRECTIONS.get(scene.direction or "", (0, 0))
    distance = travel(scene)
    for axis, sign in enumerate(step):
        if sign == 0:
            continue
        far_half = half_sizes(scene)[axis]
        offset = (scene.offset_x, scene.offset_y)[axis]
        second_half = scene.position.endswith("right") if axis == 0 else scene.position.startswith("bottom")
        if second_half:
            lo, hi = 0.5 + TRACK_GAP, 1.0 - EDGE - distance / 2 - far_half
        else:
            lo, hi = EDGE + distance / 2 + far_half, 0.5 - TRACK_GAP
        middle[axis] = lo + (hi - lo) * (offset + 1.0) / 2.0
    progress = np.linspace(-0.5, 0.5, frames)[:, None] if frames > 1 else np.zeros((1, 1))
    return np.asarray(middle)[None, :] + progress * distance * np.asarray(step, dtype=np.float64)[None, :]


def object_colour(scene: Scene) -> np.ndarray:
    """The shape's RGB: the named colour with its hue shifted by `scene.hue * HUE_SHIFT`."""
    h, s, v = colorsys.rgb_to_hsv(*COLOURS[scene.colour])
    return np.array(colorsys.hsv_to_rgb((h + HUE_SHIFT * scene.hue) % 1.0, s, v), dtype=np.float32)


def coverage(scene: Scene, size: int, at: tuple[float, float] | None = None) -> np.ndarray:
    """How much of each pixel (size, size) the shape covers, in [0, 1], centred on `at` (the
    picture's `centre` by default)."""
    n = size * _SUPERSAMPLE
    grid = (np.arange(n, dtype=np.float32) + 0.5) / n
    x, y = np.meshgrid(grid, grid)
    cx, cy = at if at is not None else centre(scene)
    half_w, half_h = half_sizes(scene)
    inside = (np.abs(x - cx) <= half_w) & (np.abs(y - cy) <= half_h)
    return inside.reshape(size, _SUPERSAMPLE, size, _SUPERSAMPLE).mean(axis=(1, 3)).astype(np.float32)


def _paint(scene: Scene, alpha: np.ndarray) -> np.ndarray:
    background = np.array(BACKGROUNDS[scene.background], dtype=np.float32)
    return (1.0 - alpha[..., None]) * background + alpha[..., None] * object_colour(scene)


def render(scene: Scene, size: int = 32) -> np.ndarray:
    """The picture of `scene`, (size, size, 3) float32 in [0, 1]."""
    return _paint(scene, coverage(scene, size))


def render_batch(scenes: Sequence[Scene], size: int = 32) -> np.ndarray:
    """Pictures (N, size, size, 3) of several scenes."""
    return np.stack([render(scene, size) for scene in scenes])


def render_track(scene: Scene, centres: np.ndarray, size: int = 32) -> np.ndarray:
    """`scene`'s shape drawn at each centre of `centres` (frames, 2), (frames, size, size, 3) float32."""
    return np.stack([_paint(scene, coverage(scene, size, tuple(at))) for at in centres])


def render_clip(scene: Scene, size: int = 32, frames: int = CLIP_FRAMES) -> np.ndarray:
    """The clip of `scene`, (frames, size, size, 3) float32 in [0, 1]."""
    return render_track(scene, track(scene, frames), size)


def render_clips(scenes: Sequence[Scene], size: int = 32, frames: int = CLIP_FRAMES) -> np.ndarray:
    """Clips (N, frames, size, size, 3) of several scenes."""
    return np.stack([render_clip(scene, size, frames) for scene in scenes])
