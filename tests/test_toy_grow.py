"""Growing the toy teacher's experts: deeper and wider, starting from exactly what they compute."""

from __future__ import annotations

import pytest
import torch

from distill.toy.build import main
from distill.toy.grow import grow_expert
from distill.toy.shipped import ASSETS


@pytest.fixture(scope="module")
def shipped_expert():
    from diffusers import WanTransformer3DModel

    return WanTransformer3DModel.from_pretrained(ASSETS / "transformer").eval()


def test_a_grown_expert_computes_what_the_trained_one_does_and_can_still_learn(shipped_expert):
    grown = grow_expert(shipped_expert, num_layers=5, ffn_dim=384, seed=1).eval()
    assert (grown.config.num_layers, grown.config.ffn_dim) == (5, 384)
    generator = torch.Generator().manual_seed(0)
    latents = torch.randn(3, 16, 3, 4, 4, generator=generator)
    timesteps = torch.tensor([50.0, 500.0, 950.0])
    text = torch.randn(3, 12, shipped_expert.config.text_dim, generator=generator)
    with torch.no_grad():
        before = shipped_expert(latents, timesteps, text, return_dict=False)[0]
        after = grown(latents, timesteps, text, return_dict=False)[0]
    torch.testing.assert_close(after, before, rtol=1e-4, atol=1e-4)
    # The zeroed branch outputs are trainable weights: one step moves the output.
    grown.train()
    optimizer = torch.optim.SGD(grown.parameters(), lr=0.1)
    grown(latents, timesteps, text, return_dict=False)[0].pow(2).mean().backward()
    assert grown.blocks[1].ffn.net[2].weight.grad.abs().sum() > 0
    optimizer.step()
    with torch.no_grad():
        moved = grown.eval()(latents, timesteps, text, return_dict=False)[0]
    assert (moved - before).abs().max() > 1e-3


def test_an_expert_cannot_shrink(shipped_expert):
    with pytest.raises(ValueError, match="can only grow"):
        grow_expert(shipped_expert, num_layers=2, ffn_dim=shipped_expert.config.ffn_dim)


def test_the_build_names_the_setting_when_asked_to_shrink_or_given_no_teacher(tmp_path, capsys):
    with pytest.raises(SystemExit) as stopped:
        main(["--retrain", "--from", str(ASSETS), "--layers", "2", "--output", str(tmp_path / "t")])
    assert stopped.value.code == 2
    assert "--layers 2" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--retrain", "--from", str(ASSETS), "--spatial_patch", "2", "--output", str(tmp_path / "t")])
    assert "--spatial_patch 2" in capsys.readouterr().err
    assert main(["--retrain", "--from", str(tmp_path / "nowhere"), "--output", str(tmp_path / "t")]) != 0
    message = capsys.readouterr().err
    assert "--from" in message and "nowhere" in message
    assert not (tmp_path / "t").exists()


def test_experts_with_a_token_per_latent_pixel():
    from distill.toy.build import build_components
    from distill.toy.recipe import Recipe

    expert = build_components(Recipe(spatial_patch=1))["transformer"]
    assert tuple(expert.config.patch_size) == (1, 1, 1)
    grown = grow_expert(expert, num_layers=4, ffn_dim=256)
    assert tuple(grown.config.patch_size) == (1, 1, 1)
    latents = torch.randn(2, 16, 3, 4, 4)
    with torch.no_grad():
        out = grown(latents, torch.tensor([10.0, 900.0]), torch.randn(2, 8, 32), return_dict=False)[0]
    assert out.shape == latents.shape


def test_only_the_experts_that_train_grow_and_the_default_keeps_the_deepest(tmp_path, capsys):
    from dataclasses import replace

    from distill.toy.build import experts_to_train_from, trained_shape
    from distill.toy.recipe import Recipe

    shapes = {name: trained_shape(ASSETS, (name,))["layers"] for name in ("high", "low")}
    grown = shapes["low"] + 1
    recipe = replace(Recipe(), layers=grown, ffn_dim=256, trained_experts=("low",))
    experts = experts_to_train_from(ASSETS, recipe, log=lambda line: None)
    assert experts["transformer"].config.num_layers == shapes["high"]  # it does not train: as it was
    assert experts["transformer_2"].config.num_layers == grown
    both = experts_to_train_from(
        ASSETS, replace(recipe, trained_experts=("high", "low")), log=lambda line: None
    )
    assert both["transformer"].config.num_layers == both["transformer_2"].config.num_layers == grown
    # Left out, --layers is the deepest trained expert's; below it is a shrink, named.
    assert trained_shape(ASSETS, ("high", "low"))["layers"] == max(shapes.values())
    deepest = max(shapes.values())
    with pytest.raises(SystemExit):
        main(
            [
                "--retrain",
                "--from",
                str(ASSETS),
                "--layers",
                str(deepest - 1),
                "--output",
                str(tmp_path / "t"),
            ]
        )
    assert f"--layers {deepest - 1}" in capsys.readouterr().err
    assert not (tmp_path / "t").exists()
