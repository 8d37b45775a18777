"""End-to-end runs of the trainer on the tiny real teacher: no mocks, real caches, real checkpoints."""

import json
import os

import numpy as np
import pytest
import torch
from conftest import REPO, WARM_PYTHON, repo_pythonpath, run_command, train_args
from diffusers import WanPipeline, WanTransformer3DModel
from safetensors.torch import load_file

from distill.config.cli import parse_config
from distill.models.student import build_student
from distill.models.student_config import load_student_config
from distill.models.tiny import TinyTeacherShape, write_tiny_teacher
from distill.train.trainer import Distiller
from train_distillation import main


def run(args):
    return Distiller(parse_config(args)).run()


def weights(folder):
    return load_file(str(folder / "diffusion_pytorch_model.safetensors"))


def test_loss_falls_clearly_from_a_random_student(tiny_teacher, tmp_path):
    result = run(
        train_args(
            tiny_teacher,
            tmp_path / "out",
            tmp_path / "cache",
            height=32,
            width=32,
            max_prompts=32,
            num_steps=300,
            lr=3e-3,
            batch_size=4,
            log_every=10,
            lr_warmup_steps=10,
        )
    )
    assert result.steps == 300
    # The first logged value averages steps 1-10; the student must end far below it.
    assert result.last_loss < result.first_loss / 3, (result.first_loss, result.last_loss)
    lines = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines] == list(range(10, 301, 10))
    assert all({"loss", "lr", "grad_norm"} <= set(r) for r in lines)
    assert any("loss_high_noise" in r for r in lines) and any("loss_low_noise" in r for r in lines)


def test_second_run_reuses_both_caches(tiny_teacher, tmp_path):
    cache = tmp_path / "cache"
    first = run(train_args(tiny_teacher, tmp_path / "a", cache, num_steps=1))
    assert first.embeddings_built == 9  # 8 prompts + the (empty) negative prompt
    assert first.latents_built == 8
    stamps = {p: p.stat().st_mtime_ns for p in cache.rglob("*.safetensors")}
    second = run(train_args(tiny_teacher, tmp_path / "b", cache, num_steps=1))
    assert (second.embeddings_built, second.latents_built) == (0, 0)
    assert {p: p.stat().st_mtime_ns for p in cache.rglob("*.safetensors")} == stamps


def test_runs_with_other_sampling_settings_share_the_embeddings_and_keep_their_own_latents(
    tiny_teacher, tmp_path
):
    """Stage 1 (guidance 1) and stage 2 (the teacher's guidance) given the same --cache_dir: the
    prompt embeddings are encoded once, each keeps its own clean latents, and neither is rebuilt."""
    cache = tmp_path / "cache"
    stage_one = dict(num_steps=1, guidance_scale=1, guidance_scale_2=1)
    first = run(train_args(tiny_teacher, tmp_path / "a", cache, **stage_one))
    second = run(train_args(tiny_teacher, tmp_path / "b", cache, num_steps=1))
    assert (first.embeddings_built, first.latents_built) == (9, 8)
    assert (second.embeddings_built, second.latents_built) == (0, 8)
    folders = sorted(p.parent for p in cache.glob("latents/*/settings.json"))
    assert len(folders) == 2
    guidance = {json.loads((f / "settings.json").read_text())["guidance_scale"] for f in folders}
    assert guidance == {1.0, 4.0}
    again = run(train_args(tiny_teacher, tmp_path / "c", cache, **stage_one))
    assert (again.embeddings_built, again.latents_built) == (0, 0)


def test_embedding_cache_with_other_settings_is_refused_with_folder_to_delete(
    tiny_teacher, shared_cache, tmp_path, capsys
):
    run(train_args(tiny_teacher, tmp_path / "a", shared_cache, num_steps=1))
    code = main(train_args(tiny_teacher, tmp_path / "b", shared_cache, num_steps=1, max_sequence_length=64))
    err = capsys.readouterr().err
    assert code == 6
    assert "max_sequence_length: cache has 512, this run has 64" in err
    assert f"delete {shared_cache / 'embeddings'}" in err


def test_interrupted_then_resumed_run_equals_uninterrupted_bitwise(
    tiny_teacher, shared_cache, tmp_path, monkeypatch
):
    common = dict(num_steps=8, checkpoint_every=3, ema_decay=0.9)
    straight = run(train_args(tiny_teacher, tmp_path / "straight", shared_cache, **common))

    monkeypatch.setenv("DISTILL_INJECT_FAULT", "exception:6")
    with pytest.raises(RuntimeError, match="injected exception at step 6"):
        run(train_args(tiny_teacher, tmp_path / "resumed", shared_cache, **common))
    monkeypatch.delenv("DISTILL_INJECT_FAULT")
    resumed = run(train_args(tiny_teacher, tmp_path / "resumed", shared_cache, **common))

    assert resumed.resumed_from.name == "step_00000003"
    for name in ("student", "student_ema"):
        a, b = weights(straight.output_dir / name), weights(resumed.output_dir / name)
        assert a.keys() == b.keys()
        assert all(torch.equal(a[k], b[k]) for k in a), name
    # and the resumed half logged the same losses as the straight run
    straight_log = (straight.output_dir / "metrics.jsonl").read_text().splitlines()
    resumed_log = (resumed.output_dir / "metrics.jsonl").read_text().splitlines()
    loss = lambda line: json.loads(line)["loss"]  # noqa: E731
    assert [loss(x) for x in straight_log[3:]] == [loss(x) for x in resumed_log[-5:]]


def test_a_checkpoint_from_before_cpu_noise_resumes_with_a_warning_if_it_was_written_on_cuda(
    tiny_teacher, shared_cache, tmp_path, caplog
):
    """Until noise was drawn on the CPU, a GPU run drew it on the GPU: its checkpoint resumes, and the
    log says that the noise from there on differs from what that run would have drawn. A checkpoint of
    the CPU stream (or an old one written on a CPU machine, whose stream is unchanged) says nothing."""
    first = run(train_args(tiny_teacher, tmp_path / "out", shared_cache, num_steps=2, checkpoint_every=2))
    state_file = first.output_dir / "checkpoints" / "step_00000002" / "state.pt"
    state = torch.load(state_file, weights_only=False)
    assert state["noise_stream"] == "cpu-per-sample"
    del state["noise_stream"]
    state["rng"]["cuda"] = []  # written on a machine with CUDA (restored only where CUDA is)
    torch.save(state, state_file)
    with caplog.at_level("WARNING"):
        resumed = run(train_args(tiny_teacher, tmp_path / "out", shared_cache, num_steps=3))
    assert resumed.resumed_from.name == "step_00000002" and resumed.steps == 3
    assert "noise from step 3 on differs" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING"):
        again = run(
            train_args(tiny_teacher, tmp_path / "again", shared_cache, num_steps=2, checkpoint_every=2)
        )
        run(train_args(tiny_teacher, again.output_dir, shared_cache, num_steps=3))
    assert "noise from step" not in caplog.text


def test_checkpoints_are_pruned_to_keep_last(tiny_teacher, shared_cache, tmp_path):
    result = run(
        train_args(tiny_teacher, tmp_path / "out", shared_cache, num_steps=7, checkpoint_every=2, keep_last=2)
    )
    names = sorted(p.name for p in (result.output_dir / "checkpoints").iterdir())
    assert names == ["step_00000006", "step_00000007"]
    assert all((result.output_dir / "checkpoints" / n / "COMPLETE").is_file() for n in names)


def test_gradient_checkpointing_gives_identical_loss_and_grads(tiny_teacher):
    config = load_student_config(
        REPO / "config" / "student_tiny.json",
        json.loads((tiny_teacher / "transformer" / "config.json").read_text()),
    )
    plain, checkpointed = build_student(config, seed=0).train(), build_student(config, seed=0).train()
    checkpointed.enable_gradient_checkpointing()
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(2, 16, 1, 4, 4, generator=gen)
    text = torch.randn(2, 7, 32, generator=gen)
    t = torch.tensor([900.0, 200.0])
    target = torch.randn(2, 16, 1, 4, 4, generator=gen)
    losses, grads = [], []
    for model in (plain, checkpointed):
        loss = (
            (model(hidden_states=x, timestep=t, encoder_hidden_states=text, return_dict=False)[0] - target)
            .pow(2)
            .mean()
        )
        loss.backward()
        losses.append(loss.detach())
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
    assert torch.equal(losses[0], losses[1])
    assert grads[0].keys() == grads[1].keys()
    assert all(torch.equal(grads[0][n], grads[1][n]) for n in grads[0])


def test_exported_student_runs_in_wan_pipeline_as_image_and_video(tiny_teacher, shared_cache, tmp_path):
    result = run(
        train_args(tiny_teacher, tmp_path / "out", shared_cache, num_steps=2, gradient_checkpointing=True)
    )
    student = WanTransformer3DModel.from_pretrained(result.student_dir)
    teacher = WanPipeline.from_pretrained(tiny_teacher)
    pipe = WanPipeline(
        tokenizer=teacher.tokenizer,
        text_encoder=teacher.text_encoder,
        vae=teacher.vae,
        scheduler=teacher.scheduler,
        transformer=student,
        transformer_2=None,
        boundary_ratio=None,
    )
    pipe.set_progress_bar_config(disable=True)
    for frames in (1, 5):
        out = pipe(
            prompt="a red cube",
            height=16,
            width=16,
            num_frames=frames,
            num_inference_steps=2,
            guidance_scale=1.0,
            output_type="np",
        ).frames
        assert out.shape == (1, frames, 16, 16, 3)
        assert np.isfinite(out).all() and out.min() >= 0 and out.max() <= 1
    saved = json.loads((result.output_dir / "run_config.json").read_text())
    assert saved["num_steps"] == 2 and saved["gradient_checkpointing"] is True


def test_any_valid_teacher_shape_and_video_mode(tmp_path):
    shape = TinyTeacherShape(
        num_layers=3, num_attention_heads=4, attention_head_dim=8, ffn_dim=48, text_dim=16, boundary_ratio=0.7
    )
    teacher = write_tiny_teacher(tmp_path / "teacher", seed=3, shape=shape)
    student_config = tmp_path / "student.json"
    student_config.write_text(
        json.dumps({"num_layers": 1, "num_attention_heads": 2, "attention_head_dim": 8, "ffn_dim": 16})
    )
    result = run(
        train_args(
            teacher,
            tmp_path / "out",
            tmp_path / "cache",
            student_config=student_config,
            num_frames=5,
            height=32,
            width=16,
            num_steps=3,
            student_init="teacher",
        )
    )
    student = WanTransformer3DModel.from_pretrained(result.student_dir)
    assert student.config.text_dim == 16 and student.config.num_layers == 1
    latent = next((tmp_path / "cache" / "latents").glob("*/*.safetensors"))
    assert load_file(str(latent))["value"].shape == (16, 2, 4, 2)


def test_mismatched_teacher_is_a_clear_error(tmp_path, capsys):
    teacher = write_tiny_teacher(tmp_path / "teacher", seed=1, shape=TinyTeacherShape(text_dim=16))
    code = main(train_args(teacher, tmp_path / "out", tmp_path / "cache"))
    err = capsys.readouterr().err
    assert code == 3
    assert "text_dim" in err and "16" in err and "student_tiny.json" in err
    assert not (tmp_path / "out").exists()  # refused before anything was written


def test_bad_student_config_exits_non_zero_with_message(tiny_teacher, tmp_path):
    bad = tmp_path / "student.json"
    bad.write_text(json.dumps({"hidden_size": 256, "depth": 4, "num_heads": 4, "num_channels": 4}))
    env = {**os.environ, "PYTHONPATH": repo_pythonpath()}
    proc = run_command(  # the command's exit code and stderr, in a process forked after the imports
        [
            *WARM_PYTHON,
            str(REPO / "train_distillation.py"),
            *train_args(tiny_teacher, tmp_path / "out", tmp_path / "c", student_config=bad),
        ],
        env=env,
        timeout=120,
    )
    assert proc.returncode == 3
    assert "num_channels" in proc.stderr and "16" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_dry_run_prints_plan_and_writes_nothing(tiny_teacher, tmp_path, capsys):
    code = main(train_args(tiny_teacher, tmp_path / "out", tmp_path / "cache", dry_run=True))
    out = capsys.readouterr().out
    assert code == 0
    assert "student" in out and "memory per device" in out
    assert not (tmp_path / "out").exists() and not (tmp_path / "cache").exists()


def test_training_with_samples_and_reports_leaves_pictures_and_eval(tiny_teacher, shared_cache, tmp_path):
    result = run(
        train_args(
            tiny_teacher,
            tmp_path / "out",
            shared_cache,
            num_steps=4,
            save_samples=True,
            sample_interval=2,
            sample_steps=2,
            eval_interval=4,
            log_every=2,
        )
    )
    samples = tmp_path / "out" / "samples"
    names = {p.name for p in samples.iterdir()}
    assert {f"teacher_prompt_0{i}.png" for i in range(4)} <= names
    assert {f"step_0000000{s}_prompt_0{i}.png" for s in (2, 4) for i in range(4)} <= names
    assert {"grid_step_00000002.png", "grid_step_00000004.png"} <= names
    report = json.loads((tmp_path / "out" / "eval" / "step_00000004" / "eval.json").read_text())
    assert {"denoiser", "sampler", "cost"} <= set(report)
    assert (tmp_path / "out" / "loss.png").stat().st_size > 1000
    pipe = WanPipeline.from_pretrained(result.output_dir / "pipeline")
    pipe.set_progress_bar_config(disable=True)
    frames = pipe(
        prompt="a cat",
        height=16,
        width=16,
        num_frames=1,
        num_inference_steps=2,
        guidance_scale=1.0,
        output_type="np",
    ).frames
    assert frames.shape == (1, 1, 16, 16, 3)


def test_video_training_samples_are_mp4(tiny_teacher, tmp_path):
    run(
        train_args(
            tiny_teacher,
            tmp_path / "out",
            tmp_path / "cache",
            num_frames=5,
            num_steps=2,
            save_samples=True,
            sample_interval=2,
            sample_steps=2,
            max_prompts=2,
        )
    )
    mp4s = sorted(p.name for p in (tmp_path / "out" / "samples").glob("*.mp4"))
    assert "step_00000002_prompt_00.mp4" in mp4s and "teacher_prompt_00.mp4" in mp4s
