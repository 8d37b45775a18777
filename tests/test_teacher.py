"""The teacher on the tiny real Wan 2.2 layout: inspection, routing per sample, guidance."""

import json
import shutil

import pytest
import torch

from distill.models.guided_teacher import GuidedTeacher
from distill.models.teacher import inspect_teacher, load_expert
from distill.ops.errors import DistillError, Stage


@pytest.fixture(scope="module")
def experts(tiny_teacher):
    info = inspect_teacher(str(tiny_teacher))
    high = load_expert(info, "transformer", torch.float32)
    low = load_expert(info, "transformer_2", torch.float32)
    return info, high, low


def _single(expert, x, t, text):
    return expert(hidden_states=x, timestep=t, encoder_hidden_states=text, return_dict=False)[0]


def test_inspect_reads_boundary_and_shapes(experts):
    info, high, _ = experts
    assert info.boundary_ratio == 0.875
    assert info.latent_channels == 16
    assert info.text_dim == high.config.text_dim
    assert info.latent_shape(32, 48, 5) == (16, 2, 4, 6)
    assert not any(p.requires_grad for p in high.parameters())


def test_each_sample_goes_to_its_expert_with_guidance_by_hand(experts):
    info, high, low = experts
    teacher = GuidedTeacher(high, low, info.boundary_ratio, 4.0, 3.0, torch.device("cpu"), torch.float32)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(4, 16, 1, 4, 4, generator=gen)
    cond = torch.randn(4, 6, info.text_dim, generator=gen)
    uncond = torch.randn(1, 6, info.text_dim, generator=gen)
    t = torch.tensor([950.0, 100.0, 875.0, 874.0])
    out = teacher.velocity(x, t, cond, uncond)
    expected_expert = [(high, 4.0), (low, 3.0), (high, 4.0), (low, 3.0)]
    with torch.no_grad():
        for i, (expert, scale) in enumerate(expected_expert):
            c = _single(expert, x[i : i + 1], t[i : i + 1], cond[i : i + 1])
            u = _single(expert, x[i : i + 1], t[i : i + 1], uncond)
            by_hand = u + scale * (c - u)
            assert torch.allclose(out[i : i + 1], by_hand, atol=1e-5), f"sample {i}"
            other = low if expert is high else high
            wrong = _single(other, x[i : i + 1], t[i : i + 1], cond[i : i + 1])
            assert not torch.allclose(out[i : i + 1], wrong, atol=1e-3)


def count_samples(*models):
    """Samples each model's forwards have seen (batch sizes summed), counted by forward pre-hooks."""
    seen = {id(m): 0 for m in models}

    def hook(module, args, kwargs):
        seen[id(module)] += kwargs["hidden_states"].shape[0]

    handles = [m.register_forward_pre_hook(hook, with_kwargs=True) for m in models]
    return seen, handles


@pytest.mark.parametrize("scales", [(1.0, 1.0), (1.0, 3.0)])
def test_an_expert_at_guidance_one_runs_the_conditional_pass_only(experts, scales):
    info, high, low = experts
    teacher = GuidedTeacher(high, low, info.boundary_ratio, *scales, torch.device("cpu"), torch.float32)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(4, 16, 1, 4, 4, generator=gen)
    cond = torch.randn(4, 6, info.text_dim, generator=gen)
    uncond = torch.randn(1, 6, info.text_dim, generator=gen)
    t = torch.tensor([950.0, 100.0, 900.0, 300.0])
    seen, handles = count_samples(high, low)
    try:
        out = teacher.velocity(x, t, cond, uncond)
    finally:
        for handle in handles:
            handle.remove()
    # Two samples per expert: one forward each at guidance 1, a cond + uncond pair above it.
    assert seen[id(high)] == (2 if scales[0] == 1.0 else 4)
    assert seen[id(low)] == (2 if scales[1] == 1.0 else 4)
    with torch.no_grad():  # what the two-pass guidance formula gives, within float rounding
        for i, expert, scale in ((0, high, scales[0]), (1, low, scales[1])):
            c = _single(expert, x[i : i + 1], t[i : i + 1], cond[i : i + 1])
            u = _single(expert, x[i : i + 1], t[i : i + 1], uncond)
            torch.testing.assert_close(out[i : i + 1], u + scale * (c - u), atol=1e-5, rtol=1e-5)


def test_missing_component_is_named(tiny_teacher, tmp_path):
    broken = tmp_path / "teacher"
    shutil.copytree(tiny_teacher, broken)
    shutil.rmtree(broken / "transformer_2")
    with pytest.raises(DistillError) as err:
        inspect_teacher(str(broken))
    assert err.value.stage == Stage.TEACHER_LOAD
    assert "transformer_2/" in err.value.title
    assert "download_wan.py" in " ".join(err.value.fixes)


def test_experts_that_disagree_are_refused(tiny_teacher, tmp_path):
    broken = tmp_path / "teacher"
    shutil.copytree(tiny_teacher, broken)
    config_path = broken / "transformer_2" / "config.json"
    config = json.loads(config_path.read_text())
    config["text_dim"] = 64
    config_path.write_text(json.dumps(config))
    with pytest.raises(DistillError, match="text_dim"):
        inspect_teacher(str(broken))


def test_no_folder_no_hub_id(tmp_path):
    with pytest.raises(DistillError, match="not found"):
        inspect_teacher(str(tmp_path / "nowhere" / "deeper" / "x"))
