"""CUDA paths of every teacher kind (marker `gpu`; skipped on CPU machines and in CI): the tiny
Wan2.2-T2V-A14B, Wan2.2-I2V-A14B (36 input channels) and Wan2.2-TI2V-5B (one transformer, the
48-channel Wan2.2 VAE, a timestep per token) in image mode compute on the GPU what they compute on
the CPU (the noise is drawn on the CPU whatever the device), train in bf16 with gradient
checkpointing and the teacher streamed from CPU memory, resume, run dmd with a LoRA, and train a
causal student by self_forcing.

python -m pytest -m gpu tests/test_gpu_kinds.py
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from conftest import REPO, train_args
from test_i2v_training import write_pairs

from distill.config.cli import parse_config
from distill.models.teacher_kind import I2V_A14B, T2V_A14B, TI2V_5B, TeacherKind
from distill.models.tiny import write_tiny_teacher
from distill.train.trainer import Distiller

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

# Per kind: pixels (the Wan2.2 VAE is 16x, the Wan 2.1 one 8x: 2x2 latent pixels either way).
SIZES = {T2V_A14B.name: 16, I2V_A14B.name: 16, TI2V_5B.name: 32}


@pytest.fixture(scope="module", params=[T2V_A14B, I2V_A14B, TI2V_5B], ids=lambda kind: kind.name)
def world(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    kind: TeacherKind = request.param
    root = tmp_path_factory.mktemp(kind.name)
    teacher = write_tiny_teacher(root / "teacher", seed=0, kind=kind)
    expert = json.loads((teacher / "transformer" / "config.json").read_text())
    config = json.loads((REPO / "config" / "student_tiny.json").read_text())
    student = {
        **config,
        "in_channels": expert["in_channels"],
        "out_channels": expert["out_channels"],
        "text_dim": expert["text_dim"],
    }
    (root / "student.json").write_text(json.dumps(student))
    size = SIZES[kind.name]
    return {
        "kind": kind,
        "teacher": teacher,
        # Text to video trains on prompts; the image kinds on image-prompt pairs.
        "pairs": REPO / "data" / "static_prompts.txt"
        if kind is T2V_A14B
        else write_pairs(root / "data", size=size),
        "student": root / "student.json",
        "size": size,
    }


def args_for(world: dict[str, object], out: Path, **overrides: object) -> list[str]:
    size = world["size"]
    settings: dict[str, object] = {
        "student_config": world["student"],
        "data_path": world["pairs"],
        "height": size,
        "width": size,
        "num_frames": 5,
        "teacher_sample_steps": 2,
        "max_prompts": 4,
        "guidance_scale": 4.0,
        **overrides,
    }
    return train_args(world["teacher"], out, out.parent / f"cache-{out.name}", **settings)


def first_loss(out: Path) -> float:
    return json.loads((out / "metrics.jsonl").read_text().splitlines()[0])["loss"]


def test_the_first_step_on_cuda_computes_what_the_cpu_does(world, tmp_path):
    """float32 on both (the teacher's `auto` dtype is bfloat16 on CUDA): the same caches (text
    embeddings, image latents, teacher latents) and the same first loss, the noise drawn on the CPU
    for both. Measured on an H100 with noise drawn this way: 4e-7 relative for all three kinds."""
    for device in ("cpu", "cuda"):
        cfg = parse_config(
            args_for(
                world, tmp_path / device, device=device, teacher_dtype="float32", num_steps=1, log_every=1
            )
        )
        assert Distiller(cfg).run().steps == 1
    assert first_loss(tmp_path / "cuda") == pytest.approx(first_loss(tmp_path / "cpu"), rel=1e-3)


def test_training_on_cuda_in_bf16_with_checkpointing_streaming_and_resume(world, tmp_path):
    def args(steps: int) -> list[str]:
        return args_for(
            world,
            tmp_path / "out",
            device="cuda",
            teacher_dtype="bfloat16",
            mixed_precision="bf16",
            gradient_checkpointing=True,
            teacher_on_cpu=True,
            num_steps=steps,
            checkpoint_every=3,
        )

    result = Distiller(parse_config(args(6))).run()
    assert result.steps == 6 and math.isfinite(result.last_loss)
    resumed = Distiller(parse_config(args(8))).run()
    assert resumed.resumed_from.name == "step_00000006" and resumed.steps == 8
    config = json.loads((tmp_path / "out" / "student" / "config.json").read_text())
    assert config["in_channels"] == world["kind"].in_channels


def test_dmd_with_a_lora_of_the_teachers_transformers_on_cuda_in_bf16(world, tmp_path):
    args = args_for(
        world,
        tmp_path / "out",
        device="cuda",
        teacher_dtype="bfloat16",
        mixed_precision="bf16",
        method="dmd",
        student_lora_rank=4,
        student_config=None,
        student_init=None,
        critic_updates=1,
        num_steps=4,
        log_every=1,
    )
    result = Distiller(parse_config(args)).run()
    assert result.steps == 4
    rows = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    losses = [row[key] for row in rows for key in ("loss", "critic_loss") if row.get(key) is not None]
    assert losses and all(math.isfinite(value) for value in losses)
    assert any((tmp_path / "out" / "lora").glob("*.safetensors"))


def causal_args(world: dict[str, object], out: Path, **overrides: object) -> list[str]:
    """Self-Forcing from the teacher's high-noise expert made causal (chunks of one latent frame: the
    5-frame clip streams as 2 chunks on the KV cache), judged by the teacher and a critic."""
    settings = dict(method="self_forcing", student_chunk_frames=1, student_init="teacher", critic_updates=1)
    return args_for(world, out, log_every=1, **{**settings, **overrides})


@pytest.mark.parametrize("student", ["separate", "lora"])
def test_a_causal_student_on_cuda_computes_what_the_cpu_does_and_trains_in_bf16(world, tmp_path, student):
    """The causal attention (chunk by chunk on a KV cache, whatever kernel SDPA picks on the GPU): the
    first self_forcing loss in float32 on CUDA is the CPU's, and a bf16 run with checkpointing trains.
    A LoRA student: the teacher's experts, causal while its adapters run, each with its own cache."""
    lora = dict(student_lora_rank=4, student_config=None, student_init=None) if student == "lora" else {}
    for device in ("cpu", "cuda"):
        cfg = parse_config(
            causal_args(world, tmp_path / device, device=device, teacher_dtype="float32", num_steps=1, **lora)
        )
        assert Distiller(cfg).run().steps == 1
    assert first_loss(tmp_path / "cuda") == pytest.approx(first_loss(tmp_path / "cpu"), rel=1e-3)
    bf16 = dict(teacher_dtype="bfloat16", mixed_precision="bf16", gradient_checkpointing=True)
    result = Distiller(
        parse_config(causal_args(world, tmp_path / "bf16", device="cuda", num_steps=3, **bf16, **lora))
    ).run()
    assert result.steps == 3 and math.isfinite(result.last_loss)
    assert (tmp_path / "bf16" / ("lora" if lora else "student") / "causal_config.json").is_file()
