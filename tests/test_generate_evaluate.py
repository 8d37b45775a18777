"""The inference command, the student-vs-teacher report and the demo pictures, on the tiny real
teacher with a tiny student trained for real."""

import json
import os
import subprocess
import sys

import imageio.v2 as imageio
import pytest
import torch
from conftest import REPO, load_teacher_parts, train_args

from distill import evaluate, generate
from distill.config.cli import parse_config
from distill.data.prompts import read_prompts
from distill.models.student import build_student
from distill.models.student_config import load_student_config
from distill.report.measures import EvalSettings
from distill.report.monitor import DEFAULT_SAMPLE_PROMPTS, SampleMonitor, SampleSettings
from distill.report.summary import evaluate_student
from distill.train.trainer import Distiller

pytestmark = pytest.mark.long  # a minute or more in all: scheduled first (conftest.py)

CPU = torch.device("cpu")
PROMPTS = read_prompts(DEFAULT_SAMPLE_PROMPTS)  # held out: never trained on
ENV = {**os.environ, "PYTHONPATH": str(REPO)}


@pytest.fixture(scope="module")
def trained(tiny_teacher, tmp_path_factory):
    """A tiny student distilled for 200 steps at 32x32, like the demo (a few seconds)."""
    root = tmp_path_factory.mktemp("trained")
    args = train_args(
        tiny_teacher,
        root / "out",
        root / "cache",
        height=32,
        width=32,
        max_prompts=32,
        num_steps=200,
        lr=3e-3,
        batch_size=4,
        log_every=20,
        lr_warmup_steps=10,
    )
    return Distiller(parse_config(args)).run()


@pytest.fixture(scope="module")
def teacher(tiny_teacher):
    return load_teacher_parts(tiny_teacher, PROMPTS)


def test_generate_command_writes_a_png(trained, tiny_teacher, tmp_path):
    command = [sys.executable, "-m", "distill.generate", "--student", str(trained.student_dir)]
    command += [
        "--teacher_path",
        str(tiny_teacher),
        "--prompt",
        "a red cube",
        "--height",
        "32",
        "--width",
        "32",
    ]
    command += ["--steps", "3", "--output", str(tmp_path / "cube")]
    proc = subprocess.run(command, capture_output=True, text=True, env=ENV, cwd=REPO, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == str(tmp_path / "cube.png")
    assert imageio.imread(tmp_path / "cube.png").shape == (32, 32, 3)


def test_generate_writes_mp4s_for_several_prompts_and_renders_the_teacher(trained, tiny_teacher, tmp_path):
    common = ["--teacher_path", str(tiny_teacher), "--height", "32", "--width", "16", "--steps", "2"]
    code = generate.main(
        ["--student", str(trained.student_dir), *common, "--prompt", "a", "--prompt", "b"]
        + ["--num_frames", "5", "--output", str(tmp_path / "videos")]
    )
    assert code == 0
    videos = sorted((tmp_path / "videos").iterdir())
    # Each clip as an MP4, and all of them side by side in one GIF that any browser plays.
    assert [p.name for p in videos] == ["all_clips.gif", "prompt_00.mp4", "prompt_01.mp4"]
    assert imageio.get_reader(videos[1]).count_frames() == 5
    assert len(imageio.mimread(videos[0])) == 5
    assert (
        generate.main([*common, "--teacher_only", "--prompt", "a", "--output", str(tmp_path / "t.png")]) == 0
    )
    assert imageio.imread(tmp_path / "t.png").shape == (32, 16, 3)


def test_generate_errors_are_reports_not_tracebacks(trained, tiny_teacher, tmp_path, capsys):
    base = ["--prompt", "a", "--output", str(tmp_path / "x.png")]
    assert (
        generate.main(["--student", str(tmp_path / "none"), "--teacher_path", str(tiny_teacher), *base]) == 3
    )
    assert (
        generate.main(
            ["--student", str(trained.student_dir), "--teacher_path", str(tmp_path / "none"), *base]
        )
        == 5
    )
    err = capsys.readouterr().err
    assert "student folder not found" in err and "teacher folder not found" in err
    assert "Traceback" not in err
    wrong = ["--student", str(trained.student_dir), "--teacher_path", str(tiny_teacher), "--num_frames", "5"]
    assert generate.main([*wrong, *base]) == 2
    assert "x.mp4" in capsys.readouterr().err
    assert not (tmp_path / "x.png").exists()


def test_evaluate_command_writes_every_number(trained, tiny_teacher, tmp_path):
    command = [sys.executable, "-m", "distill.evaluate", "--student", str(trained.student_dir)]
    command += ["--teacher_path", str(tiny_teacher), "--prompts", str(DEFAULT_SAMPLE_PROMPTS)]
    command += ["--output_dir", str(tmp_path / "eval"), "--height", "32", "--width", "32", "--steps", "3"]
    command += ["--samples_per_bucket", "2"]
    proc = subprocess.run(command, capture_output=True, text=True, env=ENV, cwd=REPO, timeout=120)
    assert proc.returncode == 0, proc.stderr
    result = json.loads((tmp_path / "eval" / "eval.json").read_text())
    assert imageio.imread(tmp_path / "eval" / "eval.png").shape[0] > 200

    denoiser = result["denoiser"]
    assert len(denoiser["buckets"]) == 10 and all(
        b["count"] == 8 for b in denoiser["buckets"]
    )  # 4 prompts x 2
    assert [b["t_min"] for b in denoiser["buckets"]] == [100.0 * i for i in range(10)]
    assert denoiser["by_expert"]["high_noise"]["t_range"] == [875.0, 1000]
    assert denoiser["by_expert"]["high_noise"]["count"] + denoiser["by_expert"]["low_noise"]["count"] == 80
    assert denoiser["mse"] > 0 and denoiser["relative_mse"] > 0

    sampler = result["sampler"]
    assert {"latent_mse", "frame_mse", "frame_psnr_db"} <= set(sampler)
    assert [r["index"] for r in sampler["per_prompt"]] == [0, 1, 2, 3]
    assert sampler["per_prompt"][0]["prompt"] == PROMPTS[0]

    cost = result["cost"]
    assert cost["teacher"]["forwards_per_sample"] == 6  # 3 steps x (conditional + unconditional)
    assert cost["student"]["forwards_per_sample"] == 3
    assert cost["speedup_forwards"] == 2.0
    assert cost["teacher"]["seconds_per_sample"] > 0 and cost["speedup_seconds"] > 0
    assert (
        result["better"]["sampler.frame_psnr_db"] == "higher" and result["better"]["denoiser.mse"] == "lower"
    )
    assert "denoiser MSE" in proc.stdout


def test_evaluate_missing_student_is_a_report(tiny_teacher, tmp_path, capsys):
    code = evaluate.main(
        ["--student", str(tmp_path / "none"), "--teacher_path", str(tiny_teacher)]
        + ["--prompts", str(DEFAULT_SAMPLE_PROMPTS), "--output_dir", str(tmp_path / "e")]
    )
    err = capsys.readouterr().err
    assert code == 3 and "student folder not found" in err and "Traceback" not in err


def test_a_teacher_folder_given_as_the_student_is_refused_not_taken_for_merged_experts(
    tiny_teacher, tmp_path, capsys
):
    """A teacher's folder has the subfolders of a LoRA run's merged/ (transformer/, transformer_2/),
    but no run wrote it: it is no student."""
    code = generate.main(
        ["--student", str(tiny_teacher), "--teacher_path", str(tiny_teacher), "--prompt", "a red ball"]
        + ["--output", str(tmp_path / "never.png")]
    )
    err = capsys.readouterr().err
    assert code == 3 and "student folder not found" in err and "it holds: model_index.json" in err
    assert not (tmp_path / "never.png").exists()


def test_trained_student_is_closer_to_the_teacher_than_a_random_one(trained, teacher, tmp_path):
    info, high, low, embeddings = teacher
    from diffusers import WanTransformer3DModel

    settings = EvalSettings(height=32, width=32, num_frames=1, steps=4, samples_per_bucket=2)
    random_student = build_student(
        load_student_config(REPO / "config" / "student_tiny.json", info.expert_config), seed=0
    )
    results = {}
    for name, student in (
        ("random", random_student.eval()),
        ("trained", WanTransformer3DModel.from_pretrained(trained.student_dir).eval()),
    ):
        results[name] = evaluate_student(
            student, high, low, info, embeddings, embeddings[""], PROMPTS, settings, tmp_path / name, CPU
        )
    before, after = results["random"], results["trained"]
    assert after["denoiser"]["mse"] < 0.5 * before["denoiser"]["mse"], (before["denoiser"], after["denoiser"])
    for expert in ("high_noise", "low_noise"):
        assert after["denoiser"]["by_expert"][expert]["mse"] < before["denoiser"]["by_expert"][expert]["mse"]
    assert after["denoiser"]["relative_mse"] < before["denoiser"]["relative_mse"]
    assert after["sampler"]["latent_mse"] < before["sampler"]["latent_mse"]


def test_demo_pictures_for_the_readme_can_be_made(trained, teacher, tmp_path):
    """The pictures the README shows: a sample grid, the eval plot and loss.png, as small PNGs."""
    info, high, low, embeddings = teacher
    from diffusers import WanTransformer3DModel

    settings = SampleSettings(
        save_samples=True, sample_interval=200, sample_steps=4, eval_interval=200, height=32, width=32
    )
    monitor = SampleMonitor(settings, info, tmp_path, CPU)
    monitor.start(high, low, embeddings, embeddings[""])
    student = WanTransformer3DModel.from_pretrained(trained.student_dir)
    grid = monitor.after_step(200, student)[-1]
    report = monitor.evaluate(200, student)
    loss = monitor.plot_loss(trained.output_dir / "metrics.jsonl", tmp_path / "loss.png", force=True)
    assert set(report.metrics) >= {"eval/denoiser_mse", "eval/frame_psnr_db", "eval/speedup_forwards"}
    pictures = [grid, report.files[1], loss]
    assert [p.name for p in pictures] == ["grid_step_00000200.png", "eval.png", "loss.png"]
    for picture in pictures:
        assert imageio.imread(picture).ndim == 3
        assert picture.stat().st_size < 200_000  # small enough to commit


def test_an_unwritable_output_is_refused_before_anything_renders(trained, tiny_teacher, capsys):
    common = ["--student", str(trained.student_dir), "--teacher_path", str(tiny_teacher)]
    assert generate.main([*common, "--prompt", "a", "--output", "/proc/nope/g.png"]) == 3
    err = capsys.readouterr().err
    assert "--output /proc/nope is not writable" in err and "Traceback" not in err
    prompts = str(REPO / "data" / "sample_prompts.txt")
    assert evaluate.main([*common, "--prompts", prompts, "--output_dir", "/proc/nope/eval"]) == 3
    err = capsys.readouterr().err
    assert "--output_dir /proc/nope/eval is not writable" in err and "Traceback" not in err
