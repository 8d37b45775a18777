"""The plan's compute: the FLOP formulas agree with torch's FlopCounterMode on a real
WanTransformer3DModel (frozen, trained whole, trained through LoRA adapters), and the forwards the
plan says a run makes are the forwards a real run on the tiny teacher makes (hooks on the models)."""

from __future__ import annotations

import json
from collections import Counter

import pytest
import torch
from conftest import REPO, SMALL_EXPERT, train_args
from torch.utils.flop_counter import FlopCounterMode, sdpa_backward_flop_count, sdpa_flop_count

from distill.config.cli import parse_config
from distill.models.flow_matching import high_noise_mask
from distill.models.lora import LoraShape, add_adapter
from distill.models.student import build_student
from distill.ops.errors import DistillError
from distill.train.cost import H100_BF16_FLOPS, RunCounts, run_cost
from distill.train.flops import model_flops
from distill.train.loop import TrainingLoop
from distill.train.trainer import Distiller

pytestmark = pytest.mark.usefixtures("one_thread")

CONFIG = SMALL_EXPERT
TARGETS = ("to_q", "to_k", "to_v", "to_out.0", "ffn.net.0.proj", "ffn.net.2")
ATEN = torch.ops.aten
# torch's counter knows the CUDA attention kernels; the CPU one saves the same and counts the same.
CPU_ATTENTION = {
    ATEN._scaled_dot_product_flash_attention_for_cpu: lambda q, k, v, *_, out_shape=None, **__: (
        sdpa_flop_count(q, k, v)
    ),
    ATEN._scaled_dot_product_flash_attention_for_cpu_backward: (
        lambda g, q, k, v, *_, out_shape=None, **__: sdpa_backward_flop_count(g, q, k, v)
    ),
}


def counted_flops(trained: str, checkpointing: bool = False) -> tuple[int, int]:
    """(forward, forward + backward) FLOPs that FlopCounterMode counts on a real model."""
    model = build_student(CONFIG, seed=0)
    if trained == "none":
        model.requires_grad_(False)
    if trained == "lora":
        add_adapter(model, "student", LoraShape(4, 4.0, TARGETS), seed=0)
    if checkpointing:
        model.enable_gradient_checkpointing()
    x, text, t = torch.randn(1, 16, 2, 8, 12), torch.randn(1, 7, 24), torch.tensor([300])
    with FlopCounterMode(display=False, custom_mapping=CPU_ATTENTION) as forward:
        model(hidden_states=x, timestep=t, encoder_hidden_states=text, return_dict=False)
    with FlopCounterMode(display=False, custom_mapping=CPU_ATTENTION) as both:
        out = model(hidden_states=x, timestep=t, encoder_hidden_states=text, return_dict=False)[0]
        if trained != "none":
            out.square().mean().backward()
    return forward.get_total_flops(), both.get_total_flops()


@pytest.mark.parametrize("trained", ["none", "all", "lora"])
def test_the_flop_formula_is_what_torch_counts(trained):
    """2 frames of 4 x 6 patches (48 tokens) against 7 text tokens: every product of the forward, and
    of the backward (weight gradients where trained, input gradients where something trained lies
    before, attention's backward as the fused kernels run it)."""
    forward, both = counted_flops(trained)
    flops = model_flops(CONFIG, (16, 2, 8, 12), 7, trained, 4 if trained == "lora" else 0, TARGETS)
    assert flops.forward == forward
    assert flops.forward + flops.backward == (both if trained != "none" else forward)
    if trained != "none":  # gradient checkpointing: the blocks' forward once more, nothing outside them
        assert flops.trained_step(True) == counted_flops(trained, checkpointing=True)[1] > both


def forwards_of_a_run(monkeypatch: pytest.MonkeyPatch, args: list[str]) -> tuple[Counter, object, object]:
    """Run the trainer for real with a hook on every WanTransformer3DModel forward; count samples
    per (phase, model, with gradient): 'cache' before the first step, 'train' after."""
    from diffusers import WanTransformer3DModel
    from torch._subclasses.fake_tensor import FakeTensor

    cfg = parse_config(args)
    distiller = Distiller(cfg)
    boundary = distiller.info.boundary_ratio
    counts: Counter = Counter()
    phase = ["cache"]
    step = TrainingLoop.train_step

    def in_training(loop, *a, **k):
        phase[0] = "train"
        return step(loop, *a, **k)

    def hook(module, _args, kwargs, output):
        if not isinstance(module, WanTransformer3DModel) or isinstance(kwargs["hidden_states"], FakeTensor):
            return  # the plan's own measurement runs the models on fake tensors
        samples = kwargs["hidden_states"].shape[0]
        if module.config.num_attention_heads == 2:  # the tiny teacher's experts
            high = bool(high_noise_mask(kwargs["timestep"].cpu(), boundary).all())
            name = "teacher high" if high else "teacher low"
        else:
            name = "critic" if module.config.num_layers == 1 else "student"
        counts[(phase[0], name, torch.is_grad_enabled())] += samples

    monkeypatch.setattr(TrainingLoop, "train_step", in_training)
    handle = torch.nn.modules.module.register_module_forward_hook(hook, with_kwargs=True)
    try:
        distiller.run()
    finally:
        handle.remove()
    cost = run_cost(
        cfg, distiller.info, distiller.student_config, distiller.critic_config, RunCounts.from_config(cfg)
    )
    return counts, cost, cfg


@pytest.mark.parametrize("guidance", [(4.0, 3.0), (1.0, 1.0)], ids=["guided", "guidance-1"])
def test_a_velocity_run_makes_the_forwards_the_plan_counts(tiny_teacher, tmp_path, monkeypatch, guidance):
    """Guidance above 1 on both experts: the teacher's batch carries the unconditional half (two
    forwards per sample); at guidance 1 one conditional forward per sample, in the cache too."""
    args = train_args(
        tiny_teacher,
        tmp_path / "out",
        tmp_path / "cache",
        guidance_scale=guidance[0],
        guidance_scale_2=guidance[1],
        max_prompts=4,
        batch_size=2,
        gradient_accumulation_steps=2,
        num_steps=3,
    )
    counts, cost, cfg = forwards_of_a_run(monkeypatch, args)
    cache_high, cache_low = cost.cache_split
    assert counts[("cache", "teacher high", False)] == cache_high
    assert counts[("cache", "teacher low", False)] == cache_low
    assert (
        cache_high + cache_low
        == cost.cache_forwards
        == 4 * cfg.teacher_sample_steps * (2 if guidance[0] > 1 else 1)
    )
    samples = cost.updates["student"] * cost.samples_per_update
    plan = cost.per_sample["student"]
    taught = counts[("train", "teacher high", False)] + counts[("train", "teacher low", False)]
    assert taught == plan.no_grad["teacher"] * samples == (2 if guidance[0] > 1 else 1) * 12
    assert counts[("train", "student", True)] == plan.grad["student"] * samples == 12
    assert sum(n for (when, _, _), n in counts.items() if when == "train") == taught + 12  # nothing else


def test_a_data_free_dmd_run_makes_the_forwards_the_plan_counts(tiny_teacher, tmp_path, monkeypatch):
    """One student step (its rollout stops at step 0: no random depth), simulate inputs, no
    regression: the teacher samples only the --reference_prompts before step 1; each generator
    update runs the student with gradient, the guided teacher and the critic without; each critic
    update the student without gradient and the critic with it."""
    critic = json.loads((REPO / "config" / "student_tiny.json").read_text())
    critic["num_layers"] = 1
    (tmp_path / "critic.json").write_text(json.dumps(critic))
    args = train_args(
        tiny_teacher,
        tmp_path / "out",
        tmp_path / "cache",
        method="dmd",
        critic_config=tmp_path / "critic.json",
        student_steps=1,
        max_prompts=4,
        reference_prompts=2,
        batch_size=1,
        num_steps=3,
        critic_updates=2,
    )
    counts, cost, cfg = forwards_of_a_run(monkeypatch, args)
    assert cost.cache_forwards == 2 * cfg.teacher_sample_steps * 2  # the reference prompts only
    assert (
        counts[("cache", "teacher high", False)] + counts[("cache", "teacher low", False)]
        == cost.cache_forwards
    )
    expected: Counter = Counter()
    for update, forwards in cost.per_sample.items():
        samples = cost.updates[update] * cost.samples_per_update
        for name, n in forwards.no_grad.items():
            expected[name, False] += n * samples
        for name, n in forwards.grad.items():
            expected[name, True] += n * samples
    teacher = counts[("train", "teacher high", False)] + counts[("train", "teacher low", False)]
    seen = {
        ("teacher", False): teacher,
        ("student", False): counts[("train", "student", False)],
        ("student", True): counts[("train", "student", True)],
        ("critic", False): counts[("train", "critic", False)],
        ("critic", True): counts[("train", "critic", True)],
    }
    assert seen == {key: expected[key] for key in seen}
    assert seen == {
        ("teacher", False): 4,  # 2 generator updates x 2 (guided)
        ("student", False): 3,  # the critic updates' x0_hat
        ("student", True): 2,
        ("critic", False): 2,
        ("critic", True): 3,
    }


def test_gpu_hours_are_the_flops_over_an_h100_at_the_stated_mfu(tiny_teacher, tmp_path):
    base = train_args(tiny_teacher, tmp_path / "out", tmp_path / "cache")
    cfg, slow = parse_config(base), parse_config([*base, "--mfu", "0.2"])
    distiller = Distiller(cfg)
    counts = RunCounts.from_config(cfg)
    at_04 = run_cost(cfg, distiller.info, distiller.student_config, None, counts)
    at_02 = run_cost(slow, distiller.info, distiller.student_config, None, counts)
    assert cfg.mfu == 0.4 and at_04.gpu_hours() == at_04.total_flops / (H100_BF16_FLOPS * 0.4) / 3600
    assert at_02.gpu_hours() == pytest.approx(2 * at_04.gpu_hours())
    assert at_02.beat_free_seconds == pytest.approx(2 * at_04.beat_free_seconds)
    plan = distiller.plan()
    assert "GPU-hours" in plan and "MFU 0.4" in plan and "teacher forwards" in plan
    for value in ("0", "1.5", "-0.1"):
        with pytest.raises(DistillError) as refused:
            parse_config([*base, "--mfu", value])
        assert "--mfu" in refused.value.title


@pytest.mark.parametrize(
    "stretch, timeout, words",
    [
        (0.004, 10, "well under a second (one forward); --stall_timeout 10 min is far above it"),
        (12.0, 10, "12.0 s (one forward); --stall_timeout 10 min = 50 x that"),
        (200.0, 10, "200.0 s (one forward); --stall_timeout 10 min is less than"),
        (0.004, 0, "well under a second (one forward); --stall_timeout off"),
    ],
)
def test_the_stall_timeout_is_put_against_the_longest_stretch_in_words(stretch, timeout, words):
    from distill.train.cost import stall_verdict

    verdict = stall_verdict(stretch, "one forward", timeout)
    assert verdict.startswith(words), verdict
    assert "x that" not in verdict or stretch >= 1  # no ratio over a stretch that rounds to nothing


def self_forcing_forwards(teacher, tmp_path, **extra):
    """The planned forwards of each update of a self_forcing run in chunks of 1 of a 9-frame clip, at
    one student step (the rollout stops at step 0: no random depth)."""
    from distill.train.cost import update_forwards

    args = train_args(
        teacher,
        tmp_path / "out",
        tmp_path / "cache",
        method="self_forcing",
        student_chunk_frames=1,
        num_frames=9,
        student_steps=1,
        **extra,
    )
    cfg = parse_config(args)
    return update_forwards(cfg, Distiller(cfg).info)


def test_a_longer_self_forcing_rollout_is_counted_in_the_plan(tiny_teacher, tmp_path):
    """--rollout_frames 33 of a 9-frame clip in chunks of 1: the rollout ends with a window drawn among
    7 starts, so it is 2 clips long on average: twice the student's forwards without gradient of a
    critic update, the exits before the window added to the generator's; the forwards with gradient
    (the judged window) and everything else unchanged."""

    def plan(**extra):
        return self_forcing_forwards(tiny_teacher, tmp_path, student_init="teacher", **extra)

    clip, longer = plan(), plan(rollout_frames=33)
    assert longer["critic"].no_grad["student"] == 2 * clip["critic"].no_grad["student"] == 2 * 2.0
    assert longer["student"].no_grad["student"] == 2 * clip["student"].no_grad["student"] + 1.0 == 3.0
    assert longer["student"].grad == clip["student"].grad and longer["critic"].grad == clip["critic"].grad
    for update in ("student", "critic"):
        assert {k: v for k, v in longer[update].no_grad.items() if k != "student"} == {
            k: v for k, v in clip[update].no_grad.items() if k != "student"
        }


def test_a_causal_lora_students_cache_passes_run_both_experts_in_the_plan(tiny_teacher, tmp_path):
    """A LoRA student's finished chunks pass into the KV cache through both experts (each keeps its own
    keys): one more clip of forwards without gradient than a separate causal student's, nothing else."""
    separate = self_forcing_forwards(tiny_teacher, tmp_path, student_init="teacher")
    lora = self_forcing_forwards(tiny_teacher, tmp_path, student_lora_rank=4, student_config=None)
    assert separate["critic"].no_grad["student"] == 2.0 and lora["critic"].no_grad["student"] == 3.0
    assert lora["student"].no_grad["student"] == separate["student"].no_grad["student"] + 1.0 == 2.0
    assert lora["student"].grad == separate["student"].grad
