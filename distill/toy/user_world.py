"""The user's world: the toy world as a user's LoRA of the toy teacher redraws it.

A user's LoRA teaches the model something the base model does not do. Here it is a palette: every
colour word draws the next colour of the world's list ("a red bar ..." shows a green bar, "a magenta
bar ..." a red one), everything else as the base world draws it. No prompt of the base world shows
that picture for that prompt, so a model either carries the LoRA or it does not.

The scorer needs nothing new: a user-world picture of prompt P is right exactly when the base
world's scorer finds it right for `drawn_prompt(P)`, the base prompt that names what the user world
draws (the same shape, place and background, the palette's colour). Diversity is the world's own too.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np

from distill.toy import world
from distill.toy.score import score

_ORDER = tuple(world.COLOURS)
PALETTE: dict[str, str] = {name: _ORDER[(i + 1) % len(_ORDER)] for i, name in enumerate(_ORDER)}
"""Colour named in the prompt -> colour the user's world draws: each the next in the world's list, so
no colour word keeps its own colour."""


def drawn_prompt(prompt: str) -> str:
    """The base-world prompt that names what the user's world draws for `prompt`."""
    attributes = world.parse_prompt(prompt)
    if attributes is None:
        raise ValueError(f"not a toy-world prompt: {prompt!r}")
    return world.prompt_of(**(attributes | {"colour": PALETTE[str(attributes["colour"])]}))


def drawn_scene(scene: world.Scene) -> world.Scene:
    """The picture the user's world draws for `scene`'s prompt: the palette's colour, the same variation."""
    return dataclasses.replace(scene, colour=PALETTE[scene.colour])


def sample_user_scenes(count: int, seed: int) -> tuple[list[str], list[world.Scene]]:
    """`count` user-world pictures drawn uniformly: their prompts, and the scenes they show."""
    scenes = world.sample_scenes(count, seed)
    return [s.prompt for s in scenes], [drawn_scene(s) for s in scenes]


def score_user(pictures: Sequence[np.ndarray], prompts: Sequence[str]) -> dict[str, Any]:
    """`distill.toy.score.score` of pictures drawn for `prompts` in the user's world."""
    return score(list(pictures), [drawn_prompt(p) for p in prompts])
