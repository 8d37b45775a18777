"""The dmd method on tiny real models: the DMD gradient, gradient isolation, expert routing, the
exported K-step scheduler and sampler, resume and data parallelism."""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path

import pytest
import torch
from conftest import A14B_EXPERT, REPO, train_args
from safetensors.torch import load_file
from test_distributed import assert_same_trajectory, launch

from distill.config.cli import parse_config
from distill.data.caches import TensorCache
from distill.models.few_step import few_step_scheduler, sample_few_step, student_grid
from distill.models.flow_matching import apply_guidance
from distill.models.guided_teacher import GuidedTeacher
from distill.models.student import build_student
from distill.models.student_config import load_student_config
from distill.models.teacher import inspect_teacher, load_expert
from distill.train.methods.base import BatchRandomness, MethodEnv
from distill.train.methods.dmd import DmdMethod, dmd_gradient, dmd_loss, score_estimates, score_sigmas
from distill.train.trainer import Distiller
from train_distillation import main

LATENT = (16, 1, 4, 4)  # (C, F, H, W) of a 32x32 image on the tiny teacher


def experts(teacher_path: Path) -> tuple[torch.nn.Module, torch.nn.Module]:
    info = inspect_teacher(str(teacher_path))
    return load_expert(info, "transformer", torch.float32), load_expert(info, "transformer_2", torch.float32)


def inputs(seed: int = 0, batch: int = 2) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return (
        torch.randn(batch, *LATENT, generator=gen),
        torch.randn(batch, 7, 32, generator=gen),
        torch.randn(1, 7, 32, generator=gen),
    )


def test_a_critic_equal_to_the_unguided_teacher_gives_zero_dmd_gradient(tiny_teacher):
    high, low = experts(tiny_teacher)
    teacher = GuidedTeacher(high, high, 0.875, 1.0, 1.0, torch.device("cpu"), torch.float32)
    x0_hat, cond, uncond = inputs()
    x0_hat.requires_grad_(True)
    sigmas = torch.tensor([0.9, 0.4])
    x_t = (1 - sigmas.view(-1, 1, 1, 1, 1)) * x0_hat.detach() + sigmas.view(
        -1, 1, 1, 1, 1
    ) * torch.randn_like(x0_hat)

    real, fake = score_estimates(x_t, sigmas, cond, uncond, teacher, copy.deepcopy(high))
    grad = dmd_gradient(x0_hat, real, fake)
    dmd_loss(x0_hat, grad).sum().backward()
    assert grad.abs().max() < 1e-5 and x0_hat.grad.abs().max() < 1e-8

    # the control: a critic that differs from the teacher pushes the sample
    real, fake = score_estimates(x_t, sigmas, cond, uncond, teacher, low)
    assert dmd_gradient(x0_hat, real, fake).abs().mean() > 1e-2


def test_score_timesteps_are_clamped_and_routed_to_the_expert_that_owns_them(tiny_teacher):
    assert score_sigmas(torch.tensor([0.0, 0.5, 1.0], dtype=torch.float64), 3.0).tolist() == pytest.approx(
        [0.02, 0.75, 0.98]
    )
    high, low = experts(tiny_teacher)
    teacher = GuidedTeacher(high, low, 0.875, 4.0, 3.0, torch.device("cpu"), torch.float32)
    x_t, cond, uncond = inputs(1)
    # t' = 950 (high-noise expert), 300 (low-noise expert); float64 as score_sigmas gives them
    sigmas = torch.tensor([0.95, 0.3], dtype=torch.float64)
    real, _ = score_estimates(x_t, sigmas, cond, uncond, teacher, low)

    def guided_x0(expert, scale, i):
        def v(text):
            t = torch.tensor([[950], [300]][i])
            return expert(hidden_states=x_t[i : i + 1], timestep=t, encoder_hidden_states=text)[0]

        with torch.no_grad():
            return x_t[i] - sigmas[i].float() * apply_guidance(v(cond[i : i + 1]), v(uncond), scale)[0]

    assert torch.allclose(real[0], guided_x0(high, 4.0, 0), atol=1e-5)
    assert torch.allclose(real[1], guided_x0(low, 3.0, 1), atol=1e-5)
    assert not torch.allclose(real[0], guided_x0(low, 3.0, 0), atol=1e-3)  # the experts do differ


def make_method(tiny_teacher, **overrides):
    cfg = parse_config(train_args(tiny_teacher, Path("unused"), Path("unused"), method="dmd", **overrides))
    high, low = experts(tiny_teacher)
    teacher = GuidedTeacher(high, low, 0.875, 4.0, 3.0, torch.device("cpu"), torch.float32)
    config = load_student_config(REPO / "config" / "student_tiny.json", dict(high.config))
    models = {
        "student": build_student(config, seed=0).train(),
        "critic": build_student(config, seed=1).train(),
    }
    _, _, uncond = inputs()
    env = MethodEnv(
        teacher,
        uncond,
        torch.device("cpu"),
        3.0,
        lambda: torch.autocast("cpu", enabled=False),
        lambda: (0.0, 1.0),
    )
    rng = BatchRandomness(torch.Generator().manual_seed(0), 1, 0, 1, torch.device("cpu"))
    return DmdMethod(cfg, env, models), models, rng


@pytest.mark.parametrize("dmd_inputs", ["simulate", "data"])
def test_no_gradient_leaks_between_the_generator_and_the_critic_update(tiny_teacher, dmd_inputs):
    method, models, rng = make_method(tiny_teacher, dmd_inputs=dmd_inputs, regression_weight=0.5)
    x0, cond, _ = inputs(2)
    batch = {"x0": x0, "cond": cond, "noise": torch.randn_like(x0)}

    def grads(model):
        return [p.grad for p in model.parameters()]

    for update, trained, frozen in (("student", "student", "critic"), ("critic", "critic", "student")):
        out = method.loss(update, batch, rng)
        out.losses.mean().backward()
        assert all(g is None for g in grads(models[frozen])), f"{update} update reached the {frozen}"
        assert sum(g.abs().sum() for g in grads(models[trained]) if g is not None) > 0
        for model in models.values():
            model.zero_grad(set_to_none=True)
    assert set(method.loss("student", batch, rng).extras) == {"regression_loss"}


def run(args):
    return Distiller(parse_config(args)).run()


def dmd_args(teacher, out, cache, **overrides):
    settings = dict(method="dmd", height=32, width=32, num_steps=3, critic_updates=2, regression_weight=0.5)
    settings.update(overrides)
    return train_args(teacher, out, cache, **settings)


def test_exported_scheduler_and_stock_wan_pipeline_reproduce_the_students_k_step_rollout(
    tiny_teacher, tmp_path
):
    from diffusers import FlowMatchEulerDiscreteScheduler, WanPipeline

    result = run(dmd_args(tiny_teacher, tmp_path / "out", tmp_path / "cache", num_steps=2))
    method_grid = student_grid(few_step_scheduler(5.0), 4)  # what training uses at the default shift
    exported = FlowMatchEulerDiscreteScheduler.from_pretrained(result.student_dir)
    in_pipeline = FlowMatchEulerDiscreteScheduler.from_pretrained(
        result.output_dir / "pipeline" / "scheduler"
    )
    for scheduler in (exported, in_pipeline):
        assert scheduler.config.stochastic_sampling
        scheduler.set_timesteps(4)
        assert torch.equal(scheduler.timesteps, method_grid[0])
    # 2 + 2 across the tiny teacher's boundary 0.875, as for A14B
    assert [t >= 875 for t in method_grid[0].tolist()] == [True, True, False, False]

    settings = json.loads((result.student_dir / "run_settings.json").read_text())
    assert (settings["method"], settings["num_inference_steps"], settings["guidance_scale"]) == (
        "dmd",
        4,
        1.0,
    )
    assert settings["scheduler"]["_class_name"] == "FlowMatchEulerDiscreteScheduler"

    pipe = WanPipeline.from_pretrained(result.output_dir / "pipeline")
    pipe.set_progress_bar_config(disable=True)
    cond = torch.randn(1, 512, 32, generator=torch.Generator().manual_seed(5))
    torch.manual_seed(11)
    stock = pipe(
        prompt_embeds=cond,
        height=32,
        width=32,
        num_frames=1,
        num_inference_steps=4,
        guidance_scale=1.0,
        output_type="latent",
    ).frames
    ours = sample_few_step(pipe.transformer, exported, 4, cond, LATENT, seed=11)
    assert torch.allclose(ours, stock, atol=1e-6), (ours - stock).abs().max()
    assert not torch.allclose(
        sample_few_step(pipe.transformer, exported, 4, cond, LATENT, seed=12), stock, atol=1e-3
    )


def weights_of(result, name):
    if name == "critic":
        last = sorted((result.output_dir / "checkpoints").iterdir())[-1]
        return load_file(str(last / "critic.safetensors"))
    return load_file(str(result.output_dir / name / "diffusion_pytorch_model.safetensors"))


def test_dmd_resume_equals_an_uninterrupted_run_bitwise(tiny_teacher, tmp_path, monkeypatch):
    # checkpoint at step 2 sits mid-cycle: step 3 is a generator step, step 4 critic only
    common = dict(num_steps=5, checkpoint_every=2, ema_decay=0.9)
    cache = tmp_path / "cache"
    straight = run(dmd_args(tiny_teacher, tmp_path / "straight", cache, **common))
    monkeypatch.setenv("DISTILL_INJECT_FAULT", "exception:4")
    with pytest.raises(RuntimeError, match="injected exception at step 4"):
        run(dmd_args(tiny_teacher, tmp_path / "resumed", cache, **common))
    monkeypatch.delenv("DISTILL_INJECT_FAULT")
    resumed = run(dmd_args(tiny_teacher, tmp_path / "resumed", cache, **common))
    assert resumed.resumed_from.name == "step_00000002"
    meta = json.loads((resumed.resumed_from / "meta.json").read_text())
    assert meta["next_updates"] == ["student", "critic"] and meta["identity"]["method"] == "dmd"
    for name in ("student", "student_ema", "critic"):
        a, b = weights_of(straight, name), weights_of(resumed, name)
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), name
    rows = lambda r: [json.loads(x) for x in (r.output_dir / "metrics.jsonl").read_text().splitlines()]  # noqa: E731
    drop = lambda row: {k: v for k, v in row.items() if k != "steps_per_s"}  # noqa: E731
    assert [drop(r) for r in rows(straight)[2:]] == [drop(r) for r in rows(resumed)[-3:]]
    assert {
        "loss",
        "critic_loss",
        "grad_norm",
        "critic_grad_norm",
        "latent_mean_drift",
        "latent_std_ratio",
    } <= set(rows(straight)[0])


def test_dmd_two_processes_match_one_process(tiny_teacher, tmp_path):
    def args(nproc: int, batch: int) -> list[str]:
        return dmd_args(
            tiny_teacher,
            tmp_path / f"n{nproc}",
            tmp_path / "cache",
            batch_size=batch,
            num_steps=3,
            log_every=1,
        )

    two = launch(args(2, 1), nproc=2).stderr
    assert main(args(1, 2)) == 0  # one process: this one, on one thread as each rank
    # Equal losses and gradient norms of both models per step (weights after Adam are not compared:
    # see assert_same_trajectory), and replicas that agree at the end.
    keys = ("loss", "grad_norm", "critic_loss", "critic_grad_norm", "latent_std_ratio", "regression_loss")
    assert_same_trajectory([tmp_path / "n1", tmp_path / "n2"], keys=keys)
    assert "all 2 ranks hold identical student and critic weights" in two


def test_dry_run_plan_adds_the_critic_and_says_which_placements_fit():
    from distill.models.teacher import TeacherInfo
    from distill.train.plan import estimate, memory_plan

    a14b_expert = A14B_EXPERT
    info = TeacherInfo(Path("A14B"), 0.875, 3.0, a14b_expert, 8, 4)
    student = load_student_config(REPO / "config" / "student_config.json", a14b_expert)
    argv = train_args(
        Path("t"),
        Path("o"),
        Path("c"),
        method="dmd",
        teacher_dtype="bfloat16",
        height=480,
        width=832,
        gradient_checkpointing=True,
    )
    cfg, cpu = parse_config(argv), torch.device("cpu")
    plan = memory_plan(cfg, info, student, cpu, critic_config=student)
    assert "critic+AdamW" in plan and "fits an 80 GB GPU" in plan
    assert plan.splitlines()[-1].endswith("gpu no, cpu yes")
    with_critic = estimate(cfg, info, student, cpu, "gpu", 1, student)
    without = estimate(cfg, info, student, cpu, "gpu", 1).total
    # A14B in bf16 (53 GiB) + a 1.3B student and a 1.3B critic with AdamW (16 GiB each); one model's
    # gradients at a time (in the measured step peak)
    assert with_critic.critic == pytest.approx(12 * 1.42e9, rel=0.01)
    assert 85 < with_critic.total / 2**30 < 100 and with_critic.total - without >= with_critic.critic
    with_critic = with_critic.total
    assert estimate(cfg, info, student, cpu, "cpu", 1, student).total / 2**30 < 67  # fits on 80 GB


def test_a_data_free_dmd_run_samples_only_its_reference_prompts_and_resumes_exactly(
    tiny_teacher, tmp_path, monkeypatch
):
    """Simulate inputs and no regression: no update reads a clean latent, so the teacher samples only
    the --reference_prompts set (evenly spaced over the prompts) for the drift and motion metrics."""
    from distill.data.prompts import read_prompts, reference_prompts

    prompt_file = tmp_path / "prompts.txt"
    prompt_file.write_text("".join(f"a red circle number {i} in the middle\n" for i in range(200)))
    common = dict(
        data_path=prompt_file,
        max_prompts=None,
        regression_weight=0,
        reference_prompts=4,
        student_steps=1,  # every critic update then sees the student's final samples: motion is measured
        height=16,
        width=16,
        num_frames=5,
        num_steps=5,
        checkpoint_every=2,
    )
    cache = tmp_path / "cache"
    straight = run(dmd_args(tiny_teacher, tmp_path / "straight", cache, **common))
    assert (straight.embeddings_built, straight.latents_built) == (201, 4)
    reference = reference_prompts(read_prompts(prompt_file), 4)
    assert reference == [f"a red circle number {i} in the middle" for i in (0, 50, 100, 150)]
    cached = {p.name for p in cache.glob("latents/*/*.safetensors")}
    assert cached == {TensorCache(cache, {}, "").path(p).name for p in reference}
    rows = [json.loads(x) for x in (straight.output_dir / "metrics.jsonl").read_text().splitlines()]
    # The metrics that compare with the teacher come from the reference latents (the motion ratio in
    # rows whose critic updates drew the student's final step).
    assert {"latent_mean_drift", "latent_std_ratio"} <= set(rows[0])
    motion = [r["latent_motion_ratio"] for r in rows if "latent_motion_ratio" in r]
    assert motion and all(math.isfinite(m) and m > 0 for m in motion)

    monkeypatch.setenv("DISTILL_INJECT_FAULT", "exception:4")
    with pytest.raises(RuntimeError, match="injected exception at step 4"):
        run(dmd_args(tiny_teacher, tmp_path / "resumed", cache, **common))
    monkeypatch.delenv("DISTILL_INJECT_FAULT")
    resumed = run(dmd_args(tiny_teacher, tmp_path / "resumed", cache, **common))
    assert resumed.resumed_from.name == "step_00000002" and resumed.latents_built == 0
    for name in ("student", "critic"):
        a, b = weights_of(straight, name), weights_of(resumed, name)
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), name
