"""Builds what one benchmark times: random teacher experts and a student of the preset's shapes, an
in-memory dataset, and the real `TrainingLoop` around them, as `Distiller.run` builds it."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from distill.bench.settings import (
    BOUNDARY_RATIO,
    FLOW_SHIFT,
    GUIDANCE_HIGH,
    GUIDANCE_LOW,
    LATENT_CHANNELS,
    PROMPT_TOKENS,
    REPO,
    VAE_STRIDE_SPATIAL,
    VAE_STRIDE_TEMPORAL,
    BenchSettings,
)
from distill.config.settings import TrainConfig
from distill.data.dataset import DistillationDataset
from distill.models.attention_backend import apply_backend
from distill.models.guided_teacher import GuidedTeacher
from distill.models.student import build_student
from distill.models.student_config import TEACHER_SHARED_KEYS, load_student_config
from distill.models.teacher import place_expert
from distill.ops.distributed import DistContext


@dataclass
class InMemoryRun:
    """Stands in for `Distiller`: what `TrainingLoop` reads from it (ctx, device, shift, identity())."""

    ctx: DistContext
    device: torch.device
    shift: float = FLOW_SHIFT

    def identity(self) -> dict[str, Any]:
        return {"bench": True}


@dataclass
class Setup:
    """Everything both loops run on."""

    settings: BenchSettings
    device: torch.device
    teacher_dtype: torch.dtype
    teacher_config: dict[str, Any]
    student_config: dict[str, Any]
    high: torch.nn.Module
    low: torch.nn.Module
    student: torch.nn.Module
    loop: Any  # distill.train.loop.TrainingLoop
    latent_shape: tuple[int, int, int, int]
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def tokens_per_sample(self) -> int:
        return tokens_per_sample(self.teacher_config, self.latent_shape)


def latent_shape(height: int, width: int, num_frames: int) -> tuple[int, int, int, int]:
    frames = (num_frames - 1) // VAE_STRIDE_TEMPORAL + 1
    return (LATENT_CHANNELS, frames, height // VAE_STRIDE_SPATIAL, width // VAE_STRIDE_SPATIAL)


def tokens_per_sample(config: dict[str, Any], shape: tuple[int, int, int, int]) -> int:
    p_t, p_h, p_w = config["patch_size"]
    return (shape[1] // p_t) * (shape[2] // p_h) * (shape[3] // p_w)


def cast_as_loaded(model: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Module:
    """Cast like `from_pretrained(torch_dtype=dtype)`: the model's `_keep_in_fp32_modules` stay float32."""
    keep = set(getattr(model, "_keep_in_fp32_modules", None) or ())
    for name, module in model.named_modules():
        kept = bool(keep & set(name.split(".")))
        for key, tensor in [*module._parameters.items(), *module._buffers.items()]:
            if tensor is None or not tensor.is_floating_point() or kept or key in keep:
                continue
            if key in module._parameters:
                tensor.data = tensor.data.to(dtype)
            else:
                module._buffers[key] = tensor.to(dtype)
    return model


def random_expert(config: dict[str, Any], device: torch.device, dtype: torch.dtype) -> torch.nn.Module:
    """A random expert built directly on `device` (a 14B-wide block is slow to initialise on a CPU)."""
    from diffusers import WanTransformer3DModel

    with torch.device(device):
        model = WanTransformer3DModel(**config)
    return cast_as_loaded(model, dtype).requires_grad_(False).eval()


def build_teacher(
    settings: BenchSettings, device: torch.device, dtype: torch.dtype
) -> tuple[torch.nn.Module, torch.nn.Module, dict[str, Any]]:
    """The two experts, placed as the trainer places them (`place_expert`)."""
    build_device = device
    if settings.teacher == "tiny":
        from distill.models.tiny import TinyTeacherShape, build_tiny_pipeline

        layers = settings.teacher_layers or TinyTeacherShape.num_layers
        pipe = build_tiny_pipeline(settings.seed, TinyTeacherShape(num_layers=layers))
        experts = [
            cast_as_loaded(m, dtype).requires_grad_(False).eval()
            for m in (pipe.transformer, pipe.transformer_2)
        ]
        del pipe
    else:
        config = dict(settings.teacher)
        if settings.teacher_layers:
            config["num_layers"] = settings.teacher_layers
        experts = [random_expert(config, build_device, dtype) for _ in range(2)]
    on_cpu = settings.teacher_on_cpu and device.type == "cuda"
    placed = [place_expert(m.to("cpu") if on_cpu else m, device, on_cpu) for m in experts]
    config = {key: value for key, value in placed[0].config.items() if not key.startswith("_")}
    return placed[0], placed[1], config


def build_student_config(settings: BenchSettings, teacher_config: dict[str, Any]) -> dict[str, Any]:
    if isinstance(settings.student, str):
        config = load_student_config(REPO / settings.student, teacher_config)
    else:
        config = {key: teacher_config[key] for key in TEACHER_SHARED_KEYS} | dict(settings.student)
    if settings.student_layers:
        config["num_layers"] = settings.student_layers
    return config


def make_student(settings: BenchSettings, config: dict[str, Any], device: torch.device) -> torch.nn.Module:
    """As `Distiller.make_student` with random init, but built on the device."""
    with torch.device(device):
        student = build_student(config, seed=settings.seed)
    if settings.gradient_checkpointing:
        student.enable_gradient_checkpointing()
    return student.to(device).train()


def make_dataset(
    settings: BenchSettings, shape: tuple[int, ...], text_dim: int, dtype: torch.dtype
) -> tuple[DistillationDataset, torch.Tensor]:
    """The real `DistillationDataset` over in-memory "caches" (anything with .get(prompt) will do),
    holding what the caches hold: float32 clean latents, unpadded embeddings in the teacher dtype."""
    count = max(16, 4 * settings.batch_size)
    prompts = [f"benchmark prompt {i}" for i in range(count)]
    generator = torch.Generator().manual_seed(settings.seed)
    latents = {p: torch.randn(shape, generator=generator) for p in prompts}
    embeddings = {p: torch.randn(PROMPT_TOKENS, text_dim, generator=generator).to(dtype) for p in prompts}
    negative = torch.randn(PROMPT_TOKENS // 4, text_dim, generator=generator).to(dtype)
    return DistillationDataset(prompts, latents, embeddings, settings.text_len), negative


def train_config(settings: BenchSettings, output_dir: Path) -> TrainConfig:
    return TrainConfig(
        teacher_path="(in memory)",
        student_config=str(settings.student),
        data_path="(in memory)",
        output_dir=str(output_dir),
        teacher_dtype=settings.dtype,
        teacher_on_cpu=settings.teacher_on_cpu,
        gradient_checkpointing=settings.gradient_checkpointing,
        height=settings.height,
        width=settings.width,
        num_frames=settings.num_frames,
        max_sequence_length=settings.text_len,
        batch_size=settings.batch_size,
        num_steps=1_000_000,  # the cosine schedule stays near its peak for the whole benchmark
        mixed_precision="bf16" if settings.dtype == "bfloat16" else "no",
        seed=settings.seed,
        checkpoint_every=0,
        device=settings.device,
        method=settings.method,
        critic_updates=settings.critic_updates,
        student_steps=settings.student_steps,
    )


def build_setup(settings: BenchSettings, output_dir: Path) -> Setup:
    from distill.train.loop import TrainingLoop

    device = torch.device(settings.device)
    teacher_dtype = getattr(torch, settings.dtype)
    torch.manual_seed(settings.seed)
    high, low, teacher_config = build_teacher(settings, device, teacher_dtype)
    student_config = build_student_config(settings, teacher_config)
    student = make_student(settings, student_config, device)
    # dmd's critic: the student's shape, initialised like it (another seed, as a separate model)
    extra = {"critic": make_student(settings, student_config, device)} if settings.method == "dmd" else {}
    shape = latent_shape(settings.height, settings.width, settings.num_frames)
    dataset, negative = make_dataset(settings, shape, teacher_config["text_dim"], teacher_dtype)
    teacher = GuidedTeacher(high, low, BOUNDARY_RATIO, GUIDANCE_HIGH, GUIDANCE_LOW, device, teacher_dtype)
    run = InMemoryRun(ctx=DistContext(device=device), device=device)
    loop = TrainingLoop(
        train_config(settings, output_dir), run, student, teacher, dataset, negative, output_dir, extra
    )
    for model in (high, low, student, *extra.values()):
        apply_backend(settings.attention_backend, model)
    if settings.compile:
        for model in extra.values():
            model.compile_repeated_blocks()
        student.compile_repeated_blocks()
        if not settings.teacher_on_cpu:  # group offloading's hooks and dynamo do not mix well
            high.compile_repeated_blocks()
            low.compile_repeated_blocks()
    return Setup(
        settings,
        device,
        teacher_dtype,
        teacher_config,
        student_config,
        high,
        low,
        student,
        loop,
        shape,
        extra,
    )
