"""The toy world: a small prompt grammar and the variation each prompt leaves unnamed.

A picture is one coloured shape in one quadrant of a plain background:

    "a red bar in the top left on a black background"

Named by the prompt: colour (6), shape (3), position (4 quadrants), background (3) = 216 prompts.
Not named (the world's diversity, which a student can lose): where inside its quadrant the shape
sits, its size and a small shift of its hue. Each is drawn uniformly from [-1, 1] and mapped to
pixels by `render`.

A clip (CLIP_FRAMES frames) is the same scene in motion, named between the shape and its place:

    "a red bar moving leftward fast in the top left on a black background"
    "a red bar standing still in the top left on a black background"

Motion: a direction (leftward, rightward, upward, downward) at a speed (slowly, fast), or standing
still: 9 motions x 216 = 1,944 clip prompts. The position names the quadrant of the track's middle.
Direction words are not position words ("top left moving right" and "top right moving left" would
share every word, and the toy tokenizer makes one piece per word). Not named: the exact pace
(`pace`, +-PACE_SPREAD of the speed's travel) on top of the picture's variation.
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from distill.ops.errors import DistillError, Stage

WORLD_FILE = "toy_world.json"

# RGB in [0, 1]. Far apart from each other and from every background, so a blurred sample still
# reads unambiguously.
COLOURS: dict[str, tuple[float, float, float]] = {
    "red": (0.9, 0.1, 0.1),
    "green": (0.1, 0.8, 0.2),
    "blue": (0.15, 0.25, 0.95),
    "yellow": (0.95, 0.85, 0.1),
    "cyan": (0.1, 0.85, 0.9),
    "magenta": (0.85, 0.15, 0.85),
}
# Told apart by aspect ratio alone (wide, even, tall): a property that survives the blur of a small
# VAE, where a circle, a square and a triangle of a dozen pixels all decode to the same blob.
SHAPES = ("square", "bar", "column")
POSITIONS = ("top left", "top right", "bottom left", "bottom right")
BACKGROUNDS: dict[str, tuple[float, float, float]] = {
    "black": (0.05, 0.05, 0.05),
    "gray": (0.5, 0.5, 0.5),
    "white": (0.95, 0.95, 0.95),
}
ATTRIBUTES = ("colour", "shape", "position", "background")
VARIATIONS = ("offset_x", "offset_y", "size", "hue")

CLIP_FRAMES = 9
"""Frames of a clip: the smallest that shows motion through Wan's VAE (3 latent frames: the first
frame alone, then two groups of 4)."""
# Unit step of each direction in picture coordinates (x right, y down).
DIRECTIONS: dict[str, tuple[int, int]] = {
    "leftward": (-1, 0),
    "rightward": (1, 0),
    "upward": (0, -1),
    "downward": (0, 1),
}
STILL = "still"
# Travel over the whole clip, as a fraction of the picture's width (4.8 and 9.6 pixels at 32 x 32).
SPEEDS: dict[str, float] = {"slowly": 0.15, "fast": 0.3}
PACE_SPREAD = 0.15
"""`pace` in [-1, 1] scales the travel by 1 +- this: slow and fast never overlap."""
MOTIONS = (*(f"moving {d} {s}" for d in DIRECTIONS for s in SPEEDS), "standing still")
CLIP_ATTRIBUTES = (*ATTRIBUTES, "direction", "speed")
CLIP_VARIATIONS = (*VARIATIONS, "pace")

_PROMPT = re.compile(
    r"^a (?P<colour>\w+) (?P<shape>\w+) "
    r"(?:(?:moving (?P<direction>\w+) (?P<speed>\w+)|(?P<still>standing still)) )?"
    r"in the (?P<position>(?:top|bottom) (?:left|right)) "
    r"on a (?P<background>\w+) background$"
)


@dataclass(frozen=True)
class Scene:
    """One picture of the world: the named attributes and the unnamed variation (each in [-1, 1])."""

    colour: str
    shape: str
    position: str
    background: str
    offset_x: float = 0.0
    """Horizontal place inside the quadrant: -1 = as far left as the shape fits, 1 = right."""
    offset_y: float = 0.0
    """Vertical place inside the quadrant: -1 = top, 1 = bottom."""
    size: float = 0.0
    """-1 = smallest, 1 = largest shape."""
    hue: float = 0.0
    """Shift of the colour's hue: -1 / 1 = the largest shift either way."""
    direction: str | None = None
    """A clip's direction (a DIRECTIONS key or STILL); None for a picture."""
    speed: str | None = None
    """A moving clip's speed (a SPEEDS key); None for pictures and still clips."""
    pace: float = 0.0
    """A moving clip's travel: -1 / 1 = PACE_SPREAD less / more than its speed's."""

    @property
    def is_clip(self) -> bool:
        return self.direction is not None

    @property
    def prompt(self) -> str:
        return prompt_of(self.colour, self.shape, self.position, self.background, self.direction, self.speed)

    def attributes(self) -> dict[str, str | None]:
        names = CLIP_ATTRIBUTES if self.is_clip else ATTRIBUTES
        return {name: getattr(self, name) for name in names}


def motion_words(direction: str | None, speed: str | None) -> str:
    """The words a clip prompt puts between the shape and its place ("" for a picture)."""
    if direction is None:
        return ""
    return "standing still" if direction == STILL else f"moving {direction} {speed}"


def prompt_of(
    colour: str,
    shape: str,
    position: str,
    background: str,
    direction: str | None = None,
    speed: str | None = None,
) -> str:
    motion = motion_words(direction, speed)
    return (
        f"a {colour} {shape} {motion + ' ' if motion else ''}in the {position} on a {background} background"
    )


def all_prompts() -> list[str]:
    """Every picture prompt of the grammar, in a fixed order."""
    return [prompt_of(c, s, p, b) for c in COLOURS for s in SHAPES for p in POSITIONS for b in BACKGROUNDS]


def motions() -> list[tuple[str, str | None]]:
    """Every (direction, speed) of a clip, standing still last."""
    return [*((d, s) for d in DIRECTIONS for s in SPEEDS), (STILL, None)]


def all_clip_prompts() -> list[str]:
    """Every clip prompt of the grammar, in a fixed order (each picture prompt in every motion)."""
    return [
        prompt_of(c, s, p, b, d, v)
        for c in COLOURS
        for s in SHAPES
        for d, v in motions()
        for p in POSITIONS
        for b in BACKGROUNDS
    ]


def parse_prompt(prompt: str) -> dict[str, str | None] | None:
    """The named attributes of a grammar prompt (picture: ATTRIBUTES; clip: CLIP_ATTRIBUTES, speed
    None when standing still), or None for any other text."""
    match = _PROMPT.match(" ".join(prompt.strip().lower().split()))
    if match is None:
        return None
    found = match.groupdict()
    attributes: dict[str, str | None] = {name: found[name] for name in ATTRIBUTES}
    valid = (
        found["colour"] in COLOURS
        and found["shape"] in SHAPES
        and found["position"] in POSITIONS
        and found["background"] in BACKGROUNDS
    )
    if found["still"]:
        attributes |= {"direction": STILL, "speed": None}
    elif found["direction"] is not None:
        attributes |= {"direction": found["direction"], "speed": found["speed"]}
        valid = valid and found["direction"] in DIRECTIONS and found["speed"] in SPEEDS
    return attributes if valid else None


def is_clip_prompt(prompt: str) -> bool:
    attributes = parse_prompt(prompt)
    return attributes is not None and "direction" in attributes


def scene_for(prompt: str, rng: np.random.Generator) -> Scene:
    """A random scene for a grammar prompt (its hidden variation drawn from `rng`)."""
    attributes = parse_prompt(prompt)
    if attributes is None:
        raise DistillError(
            f"not a prompt of the toy world: {prompt!r}",
            "Toy prompts read: a <colour> <shape> [<motion>] in the <top|bottom> <left|right> on a "
            "<background> background",
            fixes=[
                f"colours: {', '.join(COLOURS)}; shapes: {', '.join(SHAPES)}; backgrounds: {', '.join(BACKGROUNDS)}",
                f"motions (clips only): {', '.join(MOTIONS)}",
            ],
            stage=Stage.CONFIG,
        )
    # A picture draws only its own variation, so picture scenes stay the same draws as ever.
    names = CLIP_VARIATIONS if "direction" in attributes else VARIATIONS
    variation = dict(zip(names, rng.uniform(-1.0, 1.0, len(names)).tolist()))
    if attributes.get("speed") is None:
        variation.pop("pace", None)  # a still clip has no travel to vary
    return Scene(**attributes, **variation)


def sample_scenes(count: int, seed: int, clips: bool = False) -> list[Scene]:
    """`count` scenes drawn uniformly from the whole world (prompt and variation): pictures, or
    clips when `clips`."""
    rng = np.random.default_rng(seed)
    prompts = all_clip_prompts() if clips else all_prompts()
    return [scene_for(prompts[i], rng) for i in rng.integers(0, len(prompts), count)]


def describe(**extra: Any) -> dict[str, Any]:
    """The world as JSON (what `toy_world.json` holds), plus `extra` (sizes, step counts)."""
    clip = Scene("red", "bar", "top left", "black", direction="rightward", speed="fast")
    return {
        "grammar": "a <colour> <shape> in the <position> on a <background> background",
        "clip_grammar": "a <colour> <shape> <motion> in the <position> on a <background> background",
        "colours": COLOURS,
        "shapes": list(SHAPES),
        "positions": list(POSITIONS),
        "backgrounds": BACKGROUNDS,
        "motions": list(MOTIONS),
        "speeds": {name: {"travel": travel, "pace_spread": PACE_SPREAD} for name, travel in SPEEDS.items()},
        "variations": list(VARIATIONS),
        "clip_variations": list(CLIP_VARIATIONS),
        "example": asdict(Scene("red", "bar", "top left", "black"))
        | {"prompt": prompt_of("red", "bar", "top left", "black")},
        "clip_example": asdict(clip) | {"prompt": clip.prompt},
        **extra,
    }


def guidance_of(description: dict[str, Any], clips: bool = False) -> tuple[float, float]:
    """The toy teacher's own guidance (high-noise, low-noise) on pictures, or on clips (a teacher
    written before clips had their own uses its picture guidance for both)."""
    pictures = (
        float(description.get("guidance_scale", 4.0)),
        float(description.get("guidance_scale_2", 3.0)),
    )
    if not clips:
        return pictures
    return (
        float(description.get("clip_guidance_scale", pictures[0])),
        float(description.get("clip_guidance_scale_2", pictures[1])),
    )


def read_world(teacher_path: str | Path) -> dict[str, Any] | None:
    """The `toy_world.json` of a teacher folder, or None when the teacher is not a toy one."""
    path = Path(teacher_path) / WORLD_FILE
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text())
    except ValueError as error:
        raise DistillError(
            f"{path} does not parse",
            str(error),
            fixes=["Rewrite the teacher: python download_wan.py --toy DIR --overwrite"],
            stage=Stage.TEACHER_LOAD,
        ) from None
