"""The toy teacher build's training options: which experts train, and the low expert's focus."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from distill.toy.build import main
from distill.toy.expert_training import FOCUS_SIGMA, train_experts
from distill.toy.recipe import Recipe
from distill.toy.shipped import ASSETS
from distill.toy.text_padding import fold_padding


def shipped_experts():
    from diffusers import WanTransformer3DModel

    return tuple(
        WanTransformer3DModel.from_pretrained(ASSETS / name) for name in ("transformer", "transformer_2")
    )


def tiny_data(text_dim: int):
    generator = torch.Generator().manual_seed(0)
    pictures = torch.randn(6, 16, 1, 4, 4, generator=generator)
    clips = torch.randn(6, 16, 3, 4, 4, generator=generator)
    ids = torch.tensor([0, 1, 0, 1, 0, 1])
    text = fold_padding(torch.randn(3, 512, text_dim, generator=generator), [5, 6, 1])
    return [(pictures, ids, 4), (clips, ids, 4)], text


def sigmas_seen(model) -> list[float]:
    seen: list[float] = []
    model.register_forward_pre_hook(lambda module, args: seen.extend((args[1] / 1000.0).tolist()))
    return seen


RECIPE = Recipe(expert_steps=2, expert_lr=1e-3)


def test_only_the_named_expert_trains():
    high, low = shipped_experts()
    data, text = tiny_data(high.config.text_dim)
    high_before = {k: v.clone() for k, v in high.state_dict().items()}
    low_before = {k: v.clone() for k, v in low.state_dict().items()}
    high_sigmas = sigmas_seen(high)
    train_experts(high, low, data, text, replace(RECIPE, trained_experts=("low",)), log=lambda line: None)
    assert all(torch.equal(v, high_before[k]) for k, v in high.state_dict().items())
    assert not high_sigmas  # the high expert was not even run
    assert any(not torch.equal(v, low_before[k]) for k, v in low.state_dict().items())
    assert not high.training and not low.training and not any(p.requires_grad for p in low.parameters())


def test_both_experts_train_by_default():
    high, low = shipped_experts()
    data, text = tiny_data(high.config.text_dim)
    high_before = {k: v.clone() for k, v in high.state_dict().items()}
    train_experts(high, low, data, text, RECIPE, log=lambda line: None)
    assert any(not torch.equal(v, high_before[k]) for k, v in high.state_dict().items())


@pytest.mark.parametrize("focus", [0.0, 1.0])
def test_the_low_experts_focus_draws_its_sigmas_from_the_top_of_its_range(focus):
    high, low = shipped_experts()
    data, text = tiny_data(high.config.text_dim)
    seen = sigmas_seen(low)
    recipe = replace(RECIPE, expert_steps=6, expert_lr=1e-6, trained_experts=("low",), low_focus=focus)
    train_experts(high, low, data, text, recipe, log=lambda line: None)
    top = recipe.boundary_ratio + recipe.expert_overlap
    assert len(seen) == 6 * 8 and max(seen) <= top + 1e-6
    if focus == 1.0:
        assert min(seen) >= FOCUS_SIGMA - 1e-6
    else:  # the whole range: 48 uniform draws all above 0.45 would be a 1-in-10^9 event
        assert min(seen) < FOCUS_SIGMA


@pytest.mark.parametrize(
    "flags, named",
    [
        (["--train_experts", "middle"], "--train_experts 'middle'"),
        (["--train_experts", "low,low"], "--train_experts 'low,low'"),
        (["--low_focus", "1.5"], "--low_focus 1.5"),
    ],
)
def test_the_build_names_a_bad_training_option(tmp_path, capsys, flags, named):
    with pytest.raises(SystemExit) as stopped:
        main(["--retrain", "--from", str(ASSETS), "--output", str(tmp_path / "t"), *flags])
    assert stopped.value.code == 2
    assert named in capsys.readouterr().err
    assert not (tmp_path / "t").exists()


def test_one_expert_alone_needs_a_trained_teacher_to_start_from(tmp_path, capsys):
    with pytest.raises(SystemExit):
        main(["--retrain", "--train_experts", "low", "--output", str(tmp_path / "t")])
    assert "--from" in capsys.readouterr().err
    assert not (tmp_path / "t").exists()
