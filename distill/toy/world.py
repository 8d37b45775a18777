"""The toy world: a small prompt grammar and the variation each prompt leaves unnamed.

A scene is one coloured shape in one quadrant of a plain background:

    "a red bar in the top left on a black background"

Named by the prompt: colour (6), shape (3), position (4 quadrants), background (3) = 216 prompts.
Not named (the world's diversity, which a student can lose): where inside its quadrant the shape
sits, its size and a small shift of its hue. Each is drawn uniformly from [-1, 1] and mapped to
pixels by `render`.
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

_PROMPT = re.compile(
    r"^a (?P<colour>\w+) (?P<shape>\w+) in the (?P<position>(?:top|bottom) (?:left|right)) "
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

    @property
    def prompt(self) -> str:
        return prompt_of(self.colour, self.shape, self.position, self.background)

    def attributes(self) -> dict[str, str]:
        return {name: getattr(self, name) for name in ATTRIBUTES}


def prompt_of(colour: str, shape: str, position: str, background: str) -> str:
    return f"a {colour} {shape} in the {position} on a {background} background"


def all_prompts() -> list[str]:
    """Every prompt of the grammar, in a fixed order."""
    return [prompt_of(c, s, p, b) for c in COLOURS for s in SHAPES for p in POSITIONS for b in BACKGROUNDS]


def parse_prompt(prompt: str) -> dict[str, str] | None:
    """The named attributes of a grammar prompt, or None for any other text."""
    match = _PROMPT.match(prompt.strip().lower())
    if match is None:
        return None
    attributes = match.groupdict()
    valid = (
        attributes["colour"] in COLOURS
        and attributes["shape"] in SHAPES
        and attributes["position"] in POSITIONS
        and attributes["background"] in BACKGROUNDS
    )
    return attributes if valid else None


def scene_for(prompt: str, rng: np.random.Generator) -> Scene:
    """A random scene for a grammar prompt (its hidden variation drawn from `rng`)."""
    attributes = parse_prompt(prompt)
    if attributes is None:
        raise DistillError(
            f"not a prompt of the toy world: {prompt!r}",
            "Toy prompts read: a <colour> <shape> in the <top|bottom> <left|right> on a <background> background",
            fixes=[
                f"colours: {', '.join(COLOURS)}; shapes: {', '.join(SHAPES)}; backgrounds: {', '.join(BACKGROUNDS)}"
            ],
            stage=Stage.CONFIG,
        )
    return Scene(**attributes, **dict(zip(VARIATIONS, rng.uniform(-1.0, 1.0, len(VARIATIONS)).tolist())))


def sample_scenes(count: int, seed: int) -> list[Scene]:
    """`count` scenes drawn uniformly from the whole world (prompt and variation)."""
    rng = np.random.default_rng(seed)
    prompts = all_prompts()
    return [scene_for(prompts[i], rng) for i in rng.integers(0, len(prompts), count)]


def describe(**extra: Any) -> dict[str, Any]:
    """The world as JSON (what `toy_world.json` holds), plus `extra` (sizes, step counts)."""
    return {
        "grammar": "a <colour> <shape> in the <position> on a <background> background",
        "colours": COLOURS,
        "shapes": list(SHAPES),
        "positions": list(POSITIONS),
        "backgrounds": BACKGROUNDS,
        "variations": list(VARIATIONS),
        "example": asdict(Scene("red", "bar", "top left", "black"))
        | {"prompt": prompt_of("red", "bar", "top left", "black")},
        **extra,
    }


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
