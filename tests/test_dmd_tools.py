"""A dmd student in the tools around training: samples and the report during training, the
evaluate command, the generate command and the generator's AdamW betas, on the tiny real teacher."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import REPO, load_teacher_parts, train_args

from distill import evaluate, generate
from distill.config.cli import parse_config
from distill.models.few_step import few_step_scheduler, sample_few_step, student_grid
from distill.models.student import build_student
from distill.models.student_config import load_student_config
from distill.models.teacher import inspect_teacher, load_expert
from distill.ops.errors import DistillError
from distill.report.measures import EvalSettings
from distill.report.monitor import SampleMonitor, SampleSettings
from distill.report.summary import evaluate_student, flat_metrics
from distill.train.trainer import Distiller

CPU = torch.device("cpu")
PROMPTS = ["a red cube on a table", "a blue sphere in the rain"]
K_GRID = student_grid(few_step_scheduler(5.0), 4)[0].tolist()  # the default dmd student's timesteps


@pytest.fixture(scope="module")
def dmd_run(tiny_teacher, tmp_path_factory):
    """Two dmd steps with samples and the report at the last step (teacher 6 steps, student 4)."""
    root = tmp_path_factory.mktemp("dmd_run")
    (root / "prompts.txt").write_text(PROMPTS[0] + "\n")
    args = train_args(
        tiny_teacher,
        root / "out",
        root / "cache",
        method="dmd",
        height=32,
        width=32,
        num_steps=2,
        critic_updates=2,
        save_samples=True,
        sample_prompts=root / "prompts.txt",
        sample_interval=2,
        eval_interval=2,
        eval_num_buckets=2,
        sample_steps=6,
    )
    return Distiller(parse_config(args)).run()


@pytest.fixture(scope="module")
def teacher(tiny_teacher):
    return load_teacher_parts(tiny_teacher, PROMPTS)


def tiny_student(info, seed: int = 0, config_name: str = "student_tiny.json") -> torch.nn.Module:
    config = load_student_config(REPO / "config" / config_name, info.expert_config)
    return build_student(config, seed=seed).eval()


class TimestepLog:
    """The timesteps `model` is called with, one list per sampling run (a hook, not a stand-in)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.calls: list[float] = []
        model.register_forward_pre_hook(self._hook, with_kwargs=True)

    def _hook(self, module, args, kwargs) -> None:
        self.calls.append(float(kwargs["timestep"].reshape(-1)[0]))


def test_training_report_of_a_dmd_student_counts_each_side_at_its_own_steps(dmd_run):
    report = json.loads((dmd_run.output_dir / "eval" / "step_00000002" / "eval.json").read_text())
    sampler, cost = report["sampler"], report["cost"]
    assert (sampler["student_steps"], sampler["teacher_steps"]) == (4, 6)
    assert cost["student"]["forwards_per_sample"] == 4  # K steps, guidance 1
    assert cost["student"]["scheduler"] == "FlowMatchEulerDiscreteScheduler"
    assert cost["teacher"]["forwards_per_sample"] == 12  # 6 steps x (conditional + unconditional)
    assert cost["teacher_at_student_steps"]["forwards_per_sample"] == 8
    assert cost["speedup_forwards"] == pytest.approx(3.0)
    # The teacher at 4 steps is not the teacher at 6: the baseline is a real, different sample.
    assert sampler["teacher_at_student_steps"]["latent_mse"] > 1e-6
    assert (dmd_run.output_dir / "samples" / "grid_step_00000002.png").is_file()


@pytest.mark.parametrize("method", ["velocity", "dmd"])
def test_samples_during_training_use_the_students_own_sampler(teacher, tmp_path, method):
    info, high, low, embeddings = teacher
    prompts = tmp_path / "prompts.txt"
    prompts.write_text(PROMPTS[0] + "\n")
    settings = SampleSettings(
        save_samples=True, sample_prompts=str(prompts), sample_steps=6, height=32, width=32, method=method
    )
    monitor = SampleMonitor(settings, info, tmp_path, CPU)
    monitor.start(high, low, embeddings, embeddings[""])
    student = tiny_student(info)
    log = TimestepLog(student)
    files = monitor.after_step(1, student, force=True)
    assert files and files[-1].name == "grid_step_00000001.png"
    if method == "dmd":  # K stochastic flow-match steps at the exported grid
        assert log.calls == pytest.approx(K_GRID)
    else:  # velocity: unchanged, the teacher's scheduler at sample_steps
        from distill.models.pipelines import load_scheduler

        scheduler = load_scheduler(info.path)
        scheduler.set_timesteps(6)
        assert log.calls == pytest.approx(scheduler.timesteps.tolist())


def test_evaluate_samples_a_few_step_student_from_the_teachers_noise(teacher, tmp_path):
    from distill.models.pipelines import initial_noise

    info, high, low, embeddings = teacher
    scheduler = few_step_scheduler(5.0)
    config = {"_class_name": type(scheduler).__name__, **dict(scheduler.config)}
    settings = EvalSettings(
        height=32, width=32, steps=6, num_buckets=2, student_steps=4, student_scheduler=config
    )
    student = tiny_student(info)
    result = evaluate_student(
        student, high, low, info, embeddings, embeddings[""], PROMPTS[:1], settings, tmp_path, CPU
    )
    # The same latent as the project's K-step sampler from the teacher's starting noise: recompute
    # the mse to the teacher's 6-step sample from the report's own reference run.
    shape = info.latent_shape(32, 32, 1)
    ours = sample_few_step(
        student, few_step_scheduler(5.0), 4, embeddings[PROMPTS[0]][None], shape, 0, initial_noise(shape, 0)
    )[0]
    from distill.models.pipelines import load_scheduler, sample_latents, teacher_pipeline

    pipe = teacher_pipeline(high, low, info.boundary_ratio, load_scheduler(info.path))
    teacher_latent = sample_latents(
        pipe, initial_noise(shape, 0), embeddings[PROMPTS[0]], embeddings[""], 6, 4.0, 3.0
    )
    expected = float((ours - teacher_latent).pow(2).mean())
    assert result["sampler"]["latent_mse"] == pytest.approx(expected, rel=1e-5)
    assert result["cost"]["student"]["forwards_per_sample"] == 4
    assert result["cost"]["teacher_at_student_steps"]["steps"] == 4
    assert set(flat_metrics(result)) >= {
        "eval/teacher_at_student_steps_latent_mse",
        "eval/teacher_at_student_steps_frame_psnr_db",
    }


def test_evaluate_command_takes_the_dmd_students_steps_and_scheduler_from_its_run(dmd_run, tmp_path, capsys):
    prompts = tmp_path / "p.txt"
    prompts.write_text(PROMPTS[1] + "\n")
    code = evaluate.main(
        ["--student", str(dmd_run.student_dir), "--prompts", str(prompts)]
        + ["--output_dir", str(tmp_path / "eval"), "--num_buckets", "2", "--teacher_steps", "5"]
    )
    assert code == 0, capsys.readouterr().err
    out = capsys.readouterr().out
    assert "student at 4 steps" in out and "the teacher itself at 4 steps" in out
    report = json.loads((tmp_path / "eval" / "eval.json").read_text())
    assert (report["sampler"]["student_steps"], report["sampler"]["teacher_steps"]) == (4, 5)
    assert report["cost"]["student"]["forwards_per_sample"] == 4
    assert report["cost"]["teacher"]["forwards_per_sample"] == 10

    # Without --teacher_steps the teacher samples with the steps of its run (--teacher_sample_steps).
    args = evaluate.build_parser().parse_args(
        ["--student", str(dmd_run.student_dir), "--prompts", str(prompts), "--output_dir", "x"]
    )
    run_settings, _ = evaluate.resolve_defaults(args)
    assert (args.steps, args.teacher_steps) == (4, run_settings.teacher_sample_steps)
    assert args.student_scheduler["stochastic_sampling"] is True


def test_generate_samples_a_dmd_student_with_its_k_step_scheduler(dmd_run, tmp_path):
    args = generate.build_parser().parse_args(
        ["--student", str(dmd_run.student_dir), "--prompt", PROMPTS[0], "--output", str(tmp_path / "a.png")]
    )
    found = generate.resolve_defaults(args)
    assert (args.steps, args.guidance) == (4, 1.0)
    info = inspect_teacher(args.teacher_path)
    pipe = generate.build_pipeline(args, info, CPU, torch.float32, found[0])
    assert type(pipe.scheduler).__name__ == "FlowMatchEulerDiscreteScheduler"
    assert pipe.scheduler.config.stochastic_sampling
    global_rng = torch.get_rng_state()
    latent = generate.render(pipe, args, PROMPTS[0], 7, output_type="latent")
    # Every draw, the start and each re-noising, came from the seed's CPU generator: the global RNG
    # (on a GPU, the device's own, whose numbers differ) was not touched, so any device gets these.
    assert torch.equal(torch.get_rng_state(), global_rng)
    assert "step" not in vars(pipe.scheduler)  # the stock step again after the sample
    torch.randn(100)  # other use of the global RNG in between changes nothing
    again = generate.render(pipe, args, PROMPTS[0], 7, output_type="latent")
    assert torch.equal(latent, again)
    # Exactly the project's K-step rollout for seed 7 (the same the stock pipeline gives on the CPU
    # after torch.manual_seed(7)); another seed differs.
    embeds, _ = pipe.encode_prompt(PROMPTS[0], do_classifier_free_guidance=False, max_sequence_length=512)
    ours = sample_few_step(pipe.transformer, pipe.scheduler, 4, embeds, tuple(latent.shape), seed=7)[0]
    assert torch.allclose(latent.float(), ours, atol=1e-6), (latent - ours).abs().max()
    other = generate.render(pipe, args, PROMPTS[0], 8, output_type="latent")
    assert not torch.allclose(other, latent, atol=1e-3)
    assert generate.generate(args)[0].is_file()


def test_generator_betas_reach_the_students_adamw(tiny_teacher):
    from test_dmd import make_method

    def betas(**overrides):
        method, _, _ = make_method(tiny_teacher, **overrides)
        return method.optimizer_settings("student")["betas"], method.optimizer_settings("critic")["betas"]

    assert betas() == ((0.0, 0.999), (0.0, 0.999))  # DMD2's, for both models
    assert betas(generator_betas="0.5,0.99") == ((0.5, 0.99), (0.0, 0.999))
    with pytest.raises(DistillError, match="--generator_betas"):
        parse_config(train_args(tiny_teacher, Path("o"), Path("c"), method="dmd", generator_betas="0.9"))


def test_a_non_finite_dmd_step_logs_null_for_both_models_and_keeps_the_last_loss(
    tiny_teacher, shared_cache, tmp_path, monkeypatch
):
    # Step 1 updates student and critic (both poisoned), step 2 the critic, step 3 both again.
    monkeypatch.setenv("DISTILL_INJECT_FAULT", "nan:1")
    args = train_args(
        tiny_teacher, tmp_path / "out", shared_cache, method="dmd", num_steps=3, critic_updates=2
    )
    result = Distiller(parse_config(args)).run()
    rows = result.history
    assert [r["step"] for r in rows] == [1, 2, 3] and result.bad_steps == 1
    first = rows[0]
    assert first["skipped"] is True
    assert all(first[k] is None for k in ("loss", "grad_norm", "critic_loss", "critic_grad_norm")), first
    assert "skipped" not in rows[1] and rows[1]["critic_loss"] > 0 and "loss" not in rows[1]
    assert "skipped" not in rows[2] and rows[2]["loss"] is not None
    assert result.first_loss == result.last_loss == rows[2]["loss"]
    saved = json.loads((tmp_path / "out" / "metrics.jsonl").read_text().splitlines()[0])
    assert saved["loss"] is None and saved["skipped"] is True


def test_toy_scores_of_a_dmd_student_use_its_k_step_scheduler(toy_teacher, tmp_path):
    from distill.report.toy_report import add_toy_report

    info = inspect_teacher(str(toy_teacher))
    high, low = (load_expert(info, name, torch.float32) for name in ("transformer", "transformer_2"))
    scheduler = few_step_scheduler(5.0)
    settings = EvalSettings(
        height=32,
        width=32,
        steps=6,
        student_steps=4,
        student_scheduler={"_class_name": type(scheduler).__name__, **dict(scheduler.config)},
    )
    student = tiny_student(info, config_name="student_toy.json")  # the toy teacher's patch grid
    log = TimestepLog(student)
    # 4 of the world's prompts keep this test short
    result = add_toy_report({"denoiser": None}, toy_teacher, student, high, low, settings, tmp_path, count=4)
    toy = result["toy"]
    assert toy["prompts"] == 4
    assert toy["student"]["steps"] == toy["teacher_at_student_steps"]["steps"] == 4
    assert toy["teacher"]["steps"] == 20  # the toy world's full step count
    assert log.calls == pytest.approx(K_GRID)  # one batched call per step, at the exported grid
