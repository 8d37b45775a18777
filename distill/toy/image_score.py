"""Image to video on the toy world: does a clip keep its input image, and does it keep moving?

The complaints about few-step image-to-video students are the image ignored (frame 0 is not the
image, or the object changes after it) and lost motion (slow or static clips). This module scores
both on the moving world, reading clips with `score.py`:

- `motion_prompts(count, seed)`: (prompt, image, scene) cases. The prompt names only the motion
  ("the shape moving leftward fast"), so only the image can decide colour, shape, size, place and
  background (`named=True`: the world's full clip prompt, `scene.prompt`). The image is frame 0 of
  the scene's own clip, so the scene is the reference: what a perfect model makes from the two.
- `image_adherence(clip, image, prompt)`: one clip's parts (first_frame, identity, start, direction,
  speed; `adheres` = all) and `score_image_clips(clips, cases)` their rates, `motion_ratio` and
  `static_rate`.
- `calibrate()` / `python -m distill.toy.image_score --calibrate [--teacher DIR]`: what the world's
  own clips, the known failures and the controls score.

The frame-0 threshold is set by the calibration's shuffled-image control: half the 5th percentile of
the RMSE between one held-out image and another (`frame_threshold`), so another image of the world
passes that part rarely, while the toy VAE's round trip of a true first frame (RMSE 0.03 mean, 0.055
at most on 64 clips; `tests/test_toy_image_score.py` checks it) passes.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from distill.ops.command import Parser, PathAction, entry_point, integer
from distill.ops.paths import Kind
from distill.toy.render import render_clip, travel
from distill.toy.score import STILL_BELOW, read, read_clip, score_clips
from distill.toy.world import (
    BACKGROUNDS,
    CLIP_FRAMES,
    COLOURS,
    DIRECTIONS,
    SHAPES,
    SPEEDS,
    STILL,
    Scene,
    all_prompts,
    motion_words,
    motions,
    parse_prompt,
    prompt_of,
    scene_for,
)

MOTION_SUBJECT = "the shape"
"""What a motion-only prompt calls the object: it names none of the image's attributes. "shape" is
not a word of the toy T2V tokenizer's grammar; the toy I2V teacher's tokenizer has it as a piece
(`build_i2v.i2v_tokenizer`)."""
HELD_OUT_SEED = 3800
"""Default seed of the held-out cases: a teacher or student trained on image cases draws its own
from other seeds."""

# frame_threshold: FRAME_FRACTION of the FRAME_QUANTILE quantile of the shuffled control's frame-0
# RMSE, over CALIBRATION_COUNT cases (every picture prompt once: the threshold sees the whole world).
FRAME_QUANTILE, FRAME_FRACTION = 0.05, 0.5
CALIBRATION_SEED, CALIBRATION_COUNT = 38, 216
SIZE_TOLERANCE = 0.2
"""Largest relative change of the read size (score.py's: sqrt of the pixels over half way to the
shape's colour) in any frame. The world's sizes span a ratio of 1.45 (extent 0.55-0.8 of the
quadrant), so 20% is a size a viewer sees change. It sits above the read size's own wobble: a thin
shape gains or loses a row of pixels as its edge crosses a pixel (up to 16% on the world's own clips),
and the toy VAE's round trip of true clips stays within it on 89% of 64 clips (median 8%)."""
START_TOLERANCE = 0.5 * STILL_BELOW
"""How far (picture fractions; 1 pixel at 32) the fitted track's start may sit from the image's
centroid: half of what the motion score calls no motion at all."""
STATIC_BELOW = STILL_BELOW
"""Net travel under which a clip asked to move counts as static: score.py's still line, half the
slowest travel the world draws. A true slow clip (at least 2x that) never counts, and a clip that
moves less would read as "standing still" by `score_clips` too."""

_MOTION_ONLY = re.compile(rf"^{MOTION_SUBJECT} (?:moving (?P<direction>\w+) (?P<speed>\w+)|standing still)$")


class ImageCase(NamedTuple):
    """One held-out image-to-video case: what a caller sends and the scene that is its answer."""

    prompt: str
    image: np.ndarray
    """(H, W, 3) float32 in [0, 1]: frame 0 of the scene's clip."""
    scene: Scene


def motion_prompt(direction: str, speed: str | None) -> str:
    """A prompt that names only the motion: "the shape moving leftward fast", "the shape standing
    still" (direction a DIRECTIONS key or STILL)."""
    return f"{MOTION_SUBJECT} {motion_words(direction, speed)}"


def motion_of(prompt: str) -> tuple[str, str | None]:
    """(direction, speed) of a motion-only prompt or of a world clip prompt (speed None if still)."""
    text = " ".join(prompt.strip().lower().split())
    found = _MOTION_ONLY.match(text)
    if found is not None:
        direction, speed = found["direction"] or STILL, found["speed"]
        if direction == STILL or (direction in DIRECTIONS and speed in SPEEDS):
            return direction, speed
    attributes = parse_prompt(text)
    if attributes is None or "direction" not in attributes:
        raise ValueError(f"not a motion prompt or a toy-world clip prompt: {prompt!r}")
    return str(attributes["direction"]), attributes["speed"]


def motion_prompts(
    count: int, seed: int = HELD_OUT_SEED, size: int = 32, frames: int = CLIP_FRAMES, named: bool = False
) -> list[ImageCase]:
    """`count` cases, deterministic from `seed`: the world's 216 scenes in a shuffled order (each once
    before any repeats), the 9 motions in turn (any 9 in a row hold each once), the unnamed variation
    drawn per case. The prompt names only the motion, or with `named` what the image shows too."""
    rng = np.random.default_rng(seed)
    pictures = all_prompts()
    order = rng.permutation(len(pictures))
    cases = []
    for i in range(count):
        direction, speed = motions()[i % len(motions())]
        attributes = parse_prompt(pictures[order[i % len(pictures)]]) or {}
        scene = scene_for(prompt_of(**attributes, direction=direction, speed=speed), rng)
        prompt = scene.prompt if named else motion_prompt(direction, speed)
        cases.append(ImageCase(prompt, render_clip(scene, size, frames)[0], scene))
    return cases


def reference_clips(cases: Sequence[ImageCase], frames: int = CLIP_FRAMES) -> np.ndarray:
    """The world's own clips of the cases (N, F, H, W, 3): each starts from its case's image."""
    return np.stack([render_clip(case.scene, case.image.shape[0], frames) for case in cases])


def _as_float(pixels: np.ndarray) -> np.ndarray:  # uint8 accepted, as score.read does
    pixels = np.asarray(pixels, dtype=np.float32)
    return pixels / 255.0 if pixels.max() > 1.5 else pixels


def frame_error(frame: np.ndarray, image: np.ndarray) -> float:
    """RMSE between two pictures in [0, 1] (uint8 accepted)."""
    return float(np.sqrt(np.mean((_as_float(frame) - _as_float(image)) ** 2)))


@dataclass(frozen=True)
class Adherence:
    """How one clip keeps its image and its prompt's motion."""

    frame_error: float
    first_frame: bool
    identity: bool
    start: bool
    direction: bool
    speed: bool
    travel: float
    """Net travel of the fitted track (picture fractions; 0 without a track)."""
    moving_prompt: bool

    @property
    def motion(self) -> bool:  # direction and speed both as the prompt says
        return self.direction and self.speed

    @property
    def static(self) -> bool:
        """Asked to move, and barely moved."""
        return self.moving_prompt and self.travel < STATIC_BELOW

    @property
    def adheres(self) -> bool:
        return self.first_frame and self.identity and self.start and self.motion


PARTS = ("first_frame", "identity", "start", "direction", "speed", "motion")


def image_adherence(
    clip: np.ndarray, image: np.ndarray, prompt: str, threshold: float | None = None
) -> Adherence:
    """Score one clip (F, H, W, 3) against its input image (H, W, 3) and prompt (motion-only or a
    world clip prompt). `threshold`: the frame-0 RMSE limit (`frame_threshold()` by default)."""
    frames, image = _as_float(clip), _as_float(image)
    direction, speed = motion_of(prompt)
    error = frame_error(frames[0], image)
    limit = frame_threshold() if threshold is None else threshold
    want = read(image)
    readings = [read(frame) for frame in frames]
    identity = want.centre is not None and all(
        r.centre is not None
        and all(r.attributes[name] == want.attributes[name] for name in ("colour", "shape", "background"))
        and abs(r.variations["size"] / want.variations["size"] - 1.0) <= SIZE_TOLERANCE
        for r in readings
    )
    found = [(t, r.centre) for t, r in enumerate(readings) if r.centre is not None]
    start = False
    if want.centre is not None and len(found) >= 3:
        times, centres = np.array([t for t, _ in found], float), np.array([c for _, c in found], float)
        # The straight line read_clip fits, evaluated at frame 0: where the track starts.
        begins = [np.polyval(np.polyfit(times, centres[:, axis], 1), 0.0) for axis in (0, 1)]
        start = float(np.hypot(begins[0] - want.centre[0], begins[1] - want.centre[1])) <= START_TOLERANCE
    motion = read_clip(frames)
    return Adherence(
        frame_error=error,
        first_frame=error <= limit,
        identity=bool(identity),
        start=bool(start),
        direction=motion.attributes["direction"] == direction,
        speed=motion.attributes["speed"] == speed,
        travel=float(motion.variations.get("travel", 0.0)),
        moving_prompt=direction != STILL,
    )


def score_image_clips(
    clips: Sequence[np.ndarray],
    cases: Sequence[ImageCase],
    threshold: float | None = None,
    images: Sequence[np.ndarray] | None = None,
    named_score: bool = False,
) -> dict[str, Any]:
    """Image adherence and motion of `clips` made for `cases` (one each).

    Returns `adherence` (the fraction of clips that adhere), `parts` (the rate of each of PARTS),
    `motion_ratio` (score.py's: per speed class, mean travel over the reference renders' mean travel,
    a clip without a track counting 0; averaged over the classes present), `motion_ratio_per_speed`,
    `static_rate` (of the clips asked to move, those under STATIC_BELOW), `still_leak` (of the still
    prompts, those that moved), `frame_error` (median frame-0 RMSE) and `threshold`. `images` scores
    against other images than the cases' own (the shuffled control). `named_score` adds `clip_score`:
    `score_clips` against the cases' full prompts (accuracy, diversity gap)."""
    if len(clips) != len(cases) or not len(cases):
        raise ValueError(f"need one case per clip, got {len(clips)} clips and {len(cases)} cases")
    images = [c.image for c in cases] if images is None else images
    results = [image_adherence(cl, im, c.prompt, threshold) for cl, im, c in zip(clips, images, cases)]
    # The reference travel is read from the world's own clip of each case, so a perfect model
    # scores 1.0 however the cases' paces were drawn.
    frames = int(np.asarray(clips[0]).shape[0])
    reference = [read_clip(clip).variations.get("travel", 0.0) for clip in reference_clips(cases, frames)]
    ratios: dict[str, float] = {}
    for speed in SPEEDS:
        chosen = [i for i, case in enumerate(cases) if case.scene.speed == speed]
        world = float(np.mean([reference[i] for i in chosen])) if chosen else 0.0
        if world > 0:
            ratios[speed] = float(np.mean([results[i].travel for i in chosen])) / world
    moving, still = [r for r in results if r.moving_prompt], [r for r in results if not r.moving_prompt]
    scored: dict[str, Any] = {
        "adherence": float(np.mean([r.adheres for r in results])),
        "parts": {name: float(np.mean([getattr(r, name) for r in results])) for name in PARTS},
        "motion_ratio": float(np.mean(list(ratios.values()))) if ratios else None,
        "motion_ratio_per_speed": ratios,
        "static_rate": float(np.mean([r.static for r in moving])) if moving else None,
        "still_leak": float(np.mean([r.travel >= STILL_BELOW for r in still])) if still else None,
        "frame_error": float(np.median([r.frame_error for r in results])),
        "threshold": frame_threshold() if threshold is None else threshold,
        "count": len(results),
        "chance": CHANCE,
    }
    if named_score:
        scored["clip_score"] = score_clips(clips, [case.scene.prompt for case in cases])
    return scored


IDENTITY_CHANCE = 1 / (len(COLOURS) * len(SHAPES) * len(BACKGROUNDS))
CHANCE = {"identity": IDENTITY_CHANCE, "adherence": IDENTITY_CHANCE}
"""The most another image of the world scores (the shuffled control): `identity` needs its colour, shape
and background (1/54) and size; `adherence` also its place within a pixel and frame 0: near 0."""


def shuffled(count: int) -> np.ndarray:
    """The shuffled control's image for each clip: the next case's (an independent scene, never its own)."""
    return np.roll(np.arange(count), -1)


@functools.cache
def frame_threshold(count: int = CALIBRATION_COUNT, seed: int = CALIBRATION_SEED) -> float:
    """The frame-0 RMSE limit: FRAME_FRACTION of the FRAME_QUANTILE quantile of the shuffled-image
    control's frame-0 errors (each held-out image against the next case's image)."""
    images = [case.image for case in motion_prompts(count, seed)]
    errors = [frame_error(images[j], images[i]) for i, j in enumerate(shuffled(len(images)))]
    return FRAME_FRACTION * float(np.quantile(errors, FRAME_QUANTILE))


def slide(image: np.ndarray, direction: str, distance: float, frames: int = CLIP_FRAMES) -> np.ndarray:
    """A clip that starts exactly at `image` and slides it (whole pixels, the border's colour filling
    in) `distance` of the picture towards `direction` over the clip: 0 is the image frozen."""
    image = _as_float(image)
    size = image.shape[0]
    dx, dy = DIRECTIONS.get(direction, (0, 0))
    pad = int(np.ceil(abs(distance) * size)) + 1
    padded = np.pad(image, ((pad, pad), (pad, pad), (0, 0)), mode="edge")
    clip = []
    for t in range(frames):
        step = int(round(distance * size * t / max(frames - 1, 1)))
        top, left = pad - dy * step, pad - dx * step
        clip.append(padded[top : top + size, left : left + size])
    return np.stack(clip)


def opposite(direction: str) -> str:
    """The DIRECTIONS key pointing the other way."""
    dx, dy = DIRECTIONS[direction]
    return next(name for name, step in DIRECTIONS.items() if step == (-dx, -dy))


def _box_blur(clip: np.ndarray) -> np.ndarray:
    """A 3x3 box blur of every frame: about the toy VAE's own round-trip error (RMSE 0.03)."""
    size = clip.shape[-2]
    padded = np.pad(clip, [(0, 0)] * (clip.ndim - 3) + [(1, 1), (1, 1), (0, 0)], mode="edge")
    return sum(padded[..., i : i + size, j : j + size, :] for i in range(3) for j in range(3)) / 9.0


def calibration_clips(cases: Sequence[ImageCase], seed: int = 0) -> dict[str, tuple[np.ndarray, list | None]]:
    """The calibration's rows: name -> (clips, images they are scored against; None = the cases')."""
    truth = reference_clips(cases)
    rng = np.random.default_rng(seed)
    # A model that follows a full prompt but not the image: the same named scene, a new variation.
    words_only = np.stack([render_clip(scene_for(case.scene.prompt, rng), truth.shape[2]) for case in cases])
    half = [slide(c.image, c.scene.direction or STILL, 0.5 * travel(c.scene), len(truth[0])) for c in cases]
    # A still prompt's wrong way is any motion: there, rightward at the slow speed.
    wrong_way = [
        slide(c.image, opposite(c.scene.direction) if c.scene.speed else "rightward", travel(c.scene) or 0.15)
        for c in cases
    ]
    return {
        "world's own clips (from the image)": (truth, None),
        "the same, 3x3 blur (VAE-scale error)": (_box_blur(truth), None),
        "image frozen (static clip)": (np.stack([slide(case.image, STILL, 0.0) for case in cases]), None),
        "image slid at half the speed": (np.stack(half), None),
        "image slid the wrong way": (np.stack(wrong_way), None),
        "prompt's words, not the image": (words_only, None),
        "shuffled image (another case's)": (truth, [cases[j].image for j in shuffled(len(cases))]),
        "uniform noise": (rng.uniform(0.0, 1.0, truth.shape).astype(np.float32), None),
    }


def vae_round_trip(clips: np.ndarray, teacher_path: str | Path, batch: int = 32) -> np.ndarray:
    """`clips` (N, F, H, W, 3) encoded and decoded by a toy teacher's VAE (latent means, no noise):
    the most any model that decodes through that VAE can show."""
    import torch
    from diffusers import AutoencoderKLWan

    vae = AutoencoderKLWan.from_pretrained(Path(teacher_path) / "vae").eval()
    decoded = []
    with torch.no_grad():
        for start in range(0, len(clips), batch):
            pixels = torch.from_numpy(np.ascontiguousarray(clips[start : start + batch]))
            out = vae.decode(vae.encode(pixels.permute(0, 4, 1, 2, 3) * 2.0 - 1.0).latent_dist.mode()).sample
            decoded.append(((out.clamp(-1.0, 1.0) + 1.0) / 2.0).permute(0, 2, 3, 4, 1).numpy())
    return np.concatenate(decoded).astype(np.float32)


VAE_ROW = "world's own clips through the teacher's VAE"


def calibrate(
    count: int = 72, seed: int = HELD_OUT_SEED, teacher_path: str | Path | None = None
) -> dict[str, dict[str, Any]]:
    """What each calibration row scores on `count` held-out motion-prompt cases (`seed`); with a toy
    teacher folder, also its VAE's round trip of the world's own clips (VAE_ROW): the ceiling of any
    model decoding through that VAE."""
    cases = motion_prompts(count, seed)
    rows = calibration_clips(cases, seed)
    if teacher_path is not None:
        truth = rows["world's own clips (from the image)"][0]
        rows = {**dict(list(rows.items())[:2]), VAE_ROW: (vae_round_trip(truth, teacher_path), None)} | rows
    return {name: score_image_clips(clips, cases, images=images) for name, (clips, images) in rows.items()}


def table(results: dict[str, dict[str, Any]]) -> str:
    """The calibration as a Markdown table."""
    head = "| clips | adheres | frame 0 | identity | start | direction | speed | motion ratio | static | frame-0 RMSE |"
    rows = [head, "|---|" + "---:|" * 9]
    for name, r in results.items():
        cells = [r["adherence"], *(r["parts"][p] for p in PARTS[:5]), r["motion_ratio"], r["static_rate"]]
        text = " | ".join("-" if value is None else f"{value:.2f}" for value in cells)
        rows.append(f"| {name} | {text} | {r['frame_error']:.3f} |")
    return "\n".join(rows)


@entry_point
def main(argv: list[str] | None = None) -> int:
    parser = Parser(prog="python -m distill.toy.image_score", description=__doc__.split("\n\n")[0])
    parser.add_argument("--calibrate", action="store_true", help="print the calibration table")
    parser.add_argument("--count", type=integer(minimum=9), default=72, help="held-out cases (default 72)")
    parser.add_argument("--seed", type=integer(minimum=0), default=HELD_OUT_SEED, help="their seed")
    vae_help = "a toy teacher folder (assets/toy_teacher): adds its VAE's round trip of the world's clips"
    parser.add_argument("--teacher", action=PathAction, kind=Kind.FOLDER, help=vae_help)
    args = parser.parse_args(argv)
    if not args.calibrate:
        parser.error("pass --calibrate to print the calibration table")
    results = calibrate(args.count, args.seed, args.teacher)
    print(f"{args.count} held-out cases (seed {args.seed}); frame-0 RMSE threshold {frame_threshold():.3f}")
    print(table(results))
    print(f"chance (shuffled image): identity and adherence at most {IDENTITY_CHANCE:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
