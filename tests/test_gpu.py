"""CUDA paths, run only where a GPU exists (marker `gpu`; skipped on CPU machines and in CI).

python -m pytest -m gpu
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from conftest import REPO, repo_pythonpath, train_args

from distill.config.cli import parse_config
from distill.models.guided_teacher import GuidedTeacher
from distill.models.teacher import inspect_teacher, load_expert, place_expert
from distill.train.trainer import Distiller

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def test_teacher_on_cpu_streams_blocks_to_the_gpu_and_matches_the_resident_teacher(tiny_teacher):
    info = inspect_teacher(str(tiny_teacher))
    cuda = torch.device("cuda")
    resident = [
        place_expert(load_expert(info, name, torch.bfloat16), cuda, on_cpu=False)
        for name in ("transformer", "transformer_2")
    ]
    streamed = [
        place_expert(load_expert(info, name, torch.bfloat16), cuda, on_cpu=True)
        for name in ("transformer", "transformer_2")
    ]
    # the streamed experts' weights stay in CPU memory between forwards
    assert all(p.device.type == "cpu" for p in streamed[0].blocks.parameters())
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(4, 16, 1, 8, 8, generator=gen).to(cuda)
    cond = torch.randn(4, 12, info.text_dim, generator=gen).to(cuda)
    uncond = torch.randn(1, 12, info.text_dim, generator=gen).to(cuda)
    t = torch.tensor([990.0, 10.0, 900.0, 300.0])
    outs = [
        GuidedTeacher(*experts, info.boundary_ratio, 4.0, 3.0, cuda, torch.bfloat16).velocity(
            x, t, cond, uncond
        )
        for experts in (resident, streamed)
    ]
    assert outs[1].device.type == "cuda"
    assert torch.allclose(outs[0], outs[1], atol=1e-2, rtol=1e-2)


def test_training_on_cuda_in_bf16_with_checkpointing_and_resume(tiny_teacher, tmp_path):
    def args(steps):
        return train_args(
            tiny_teacher,
            tmp_path / "out",
            tmp_path / "cache",
            device="cuda",
            teacher_dtype="bfloat16",
            mixed_precision="bf16",
            gradient_checkpointing=True,
            num_steps=steps,
            checkpoint_every=3,
            teacher_on_cpu=True,
            ema_decay=0.9,  # checkpoints load on the CPU: the resumed EMA must come back to the GPU
        )

    result = Distiller(parse_config(args(6))).run()
    assert result.steps == 6 and torch.isfinite(torch.tensor(result.last_loss))
    resumed = Distiller(parse_config(args(8))).run()
    assert resumed.resumed_from.name == "step_00000006" and resumed.steps == 8
    assert resumed.ema_dir is not None and (resumed.ema_dir / "config.json").is_file()


def test_two_dmd_steps_on_cuda_in_bf16_train_the_generator_and_the_critic(tiny_teacher, tmp_path):
    args = train_args(
        tiny_teacher,
        tmp_path / "dmd",
        tmp_path / "cache",
        method="dmd",
        device="cuda",
        teacher_dtype="bfloat16",
        mixed_precision="bf16",
        height=32,
        width=32,
        num_steps=2,
        critic_updates=2,  # step 1: generator and critic; step 2: the critic alone
    )
    result = Distiller(parse_config(args)).run()
    assert result.steps == 2 and result.bad_steps == 0
    assert result.history[0]["loss"] is not None and result.history[-1]["critic_loss"] is not None
    assert (result.student_dir / "scheduler_config.json").is_file()


def test_generate_draws_a_few_step_students_sample_on_cuda_as_on_the_cpu(tiny_teacher, tmp_path):
    """A dmd student's stochastic sampler re-noises from the seed's CPU stream, not the device's RNG:
    the same seed gives the same latent on CUDA as on the CPU (float32 on both)."""
    from distill import generate

    args = train_args(
        tiny_teacher, tmp_path / "dmd", tmp_path / "cache", method="dmd", height=32, width=32, num_steps=1
    )
    student = Distiller(parse_config(args)).run().student_dir
    latents = {}
    for device in ("cpu", "cuda"):
        argv = ["--student", str(student), "--prompt", "a red bar", "--output", "unused.png"]
        argv += ["--device", device, "--dtype", "float32"]
        parsed = generate.build_parser().parse_args(argv)
        pipe, prompts, _, _ = generate.prepare(parsed)
        latents[device] = generate.render(pipe, parsed, prompts[0], 3, output_type="latent").float().cpu()
    torch.testing.assert_close(latents["cuda"], latents["cpu"], rtol=1e-3, atol=1e-3)


def test_a_stream_continued_by_an_image_to_video_student_is_the_same_on_cuda_as_on_the_cpu(toy_teacher):
    """generate --stream --continue_with: the shipped causal student's stream and the shipped I2V
    student's hops draw every noise from CPU streams, so CUDA gives the CPU's frames (float32 on both;
    a device-drawn noise would give another clip, off by tenths)."""
    import numpy as np

    from distill import generate
    from distill.toy.shipped import ASSETS, I2V_ASSETS

    frames = {}
    for device in ("cpu", "cuda"):
        stream = generate.open_stream(
            [
                *("--student", str(ASSETS.parent / "toy_student_causal"), "--teacher_path", str(toy_teacher)),
                *("--continue_with", str(ASSETS.parent / "toy_i2v_student_dmd")),
                *("--continue_teacher_path", str(I2V_ASSETS), "--num_frames", "33"),
                *("--prompt", "a red square moving rightward fast in the top left on a black background"),
                *("--device", device, "--dtype", "float32"),
            ]
        )
        frames[device] = np.concatenate(list(stream.chunks(0, seed=3)))
    assert frames["cuda"].shape == frames["cpu"].shape == (33, 32, 32, 3)
    np.testing.assert_allclose(frames["cuda"], frames["cpu"], atol=2e-2)


def test_local_rank_beyond_the_visible_gpus_is_explained(tiny_teacher, tmp_path):
    count = torch.cuda.device_count()
    env = {
        **os.environ,
        "PYTHONPATH": repo_pythonpath(),
        "TORCHELASTIC_RUN_ID": "x",
        "RANK": str(count),
        "WORLD_SIZE": str(count + 1),
        "LOCAL_RANK": str(count),
        "LOCAL_WORLD_SIZE": str(count + 1),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": "29999",
    }
    proc = subprocess.run(
        [
            sys.executable,
            str(REPO / "train_distillation.py"),
            *train_args(tiny_teacher, tmp_path / "o", tmp_path / "c", device="auto", backend="auto"),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 4
    assert f"LOCAL_RANK {count} has no GPU" in proc.stderr and f"--nproc_per_node={count}" in proc.stderr


def test_torchrun_on_nccl(tiny_teacher, tmp_path):
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node=1",
            str(REPO / "train_distillation.py"),
            *train_args(tiny_teacher, tmp_path / "o", tmp_path / "c", device="auto", backend="nccl"),
        ],
        env={**os.environ, "PYTHONPATH": repo_pythonpath()},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (tmp_path / "o" / "student").is_dir()
