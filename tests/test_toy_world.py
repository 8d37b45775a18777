"""The toy world's grammar, renderer and scorer (no models: numpy only, fast)."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from distill.ops.errors import DistillError
from distill.toy.render import render, render_batch
from distill.toy.score import CHANCE, read, score, wasserstein_1d
from distill.toy.world import ATTRIBUTES, all_prompts, parse_prompt, sample_scenes, scene_for


def test_grammar_covers_the_world_and_parses_back() -> None:
    prompts = all_prompts()
    assert len(prompts) == len(set(prompts)) == 6 * 3 * 4 * 3
    for prompt in prompts[::17]:
        attributes = parse_prompt(prompt)
        assert attributes is not None
        assert scene_for(prompt, np.random.default_rng(0)).prompt == prompt
    assert parse_prompt("a purple bar in the top left on a black background") is None
    assert parse_prompt("a cat walking through fresh snow") is None
    with pytest.raises(DistillError, match="not a prompt of the toy world"):
        scene_for("a cat", np.random.default_rng(0))


def test_ground_truth_scores_one_and_noise_scores_chance() -> None:
    scenes = sample_scenes(400, seed=11)
    prompts = [s.prompt for s in scenes]
    truth = score(list(render_batch(scenes)), prompts)
    assert truth["accuracy"] == 1.0
    assert all(value == 1.0 for value in truth["per_attribute"].values())
    assert truth["diversity_gap"] < 0.2

    noise = np.random.default_rng(0).uniform(0.0, 1.0, (400, 32, 32, 3)).astype(np.float32)
    result = score(list(noise), prompts)
    # 400 samples: the binomial standard deviation at p = 1/3 is 0.024, so 0.1 is a wide margin.
    for name in ATTRIBUTES:
        assert abs(result["per_attribute"][name] - CHANCE[name]) < 0.1, (name, result["per_attribute"])
    assert result["accuracy"] < 0.03
    assert result["diversity_gap"] > 1.0


def test_wrong_pictures_lose_accuracy_of_that_attribute_only() -> None:
    scenes = sample_scenes(60, seed=3)
    swapped = [
        replace(s, shape={"square": "bar", "bar": "column", "column": "square"}[s.shape]) for s in scenes
    ]
    result = score(list(render_batch(swapped)), [s.prompt for s in scenes])
    assert result["per_attribute"]["shape"] == 0.0
    assert result["per_attribute"]["colour"] == result["per_attribute"]["position"] == 1.0
    assert result["accuracy"] == 0.0


def test_collapsed_variation_shows_as_a_diversity_gap() -> None:
    scenes = sample_scenes(300, seed=5)
    prompts = [s.prompt for s in scenes]
    collapsed = [replace(s, offset_x=0.2, offset_y=-0.3, size=0.0, hue=0.1) for s in scenes]
    truth = score(list(render_batch(scenes)), prompts)
    same = score(list(render_batch(collapsed)), prompts)
    assert same["accuracy"] == 1.0  # every named attribute is still right
    assert same["diversity_gap"] > truth["diversity_gap"] + 0.4


def test_reading_recovers_the_hidden_variation() -> None:
    small, large = (
        replace(scene_for(all_prompts()[0], np.random.default_rng(1)), size=v) for v in (-1.0, 1.0)
    )
    assert read(render(large)).variations["size"] > read(render(small)).variations["size"] + 0.05
    left, right = (replace(small, offset_x=v) for v in (-1.0, 1.0))
    assert read(render(right)).variations["offset_x"] > read(render(left)).variations["offset_x"] + 0.05


def test_wasserstein_of_shifted_samples_is_the_shift() -> None:
    a = np.random.default_rng(0).normal(size=2000)
    assert wasserstein_1d(a, a) == pytest.approx(0.0, abs=1e-9)
    assert wasserstein_1d(a, a + 0.5) == pytest.approx(0.5, abs=1e-3)
