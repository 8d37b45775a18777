"""How fast is a distillation step, where does its time go, and how much of it is the trainer's own?

    python -m distill.bench --preset cpu-tiny  --json outputs/bench/cpu-tiny.json
    python -m distill.bench --preset cpu-small --json outputs/bench/cpu-small.json   # ~1 min, 2 CPU cores
    python -m distill.bench --preset gpu-1.3b  --json outputs/bench/gpu-1.3b.json    # CUDA
    python -m distill.bench --preset gpu-1.3b  --teacher_on_cpu --json outputs/bench/gpu-1.3b-offload.json
    python -m distill.bench --preset gpu-14b-slice --json outputs/bench/gpu-14b-slice.json

Any preset setting can be overridden: --steps --warmup --block --batch_size --height --width
--num_frames --text_len --teacher_layers --student_layers --dtype --teacher_on_cpu
--gradient_checkpointing --compile --peak_tflops --seed (see --help).

Everything runs in one process on real, randomly initialised `WanTransformer3DModel`s built in
memory (no teacher folder is needed): two teacher experts and a student, a `TrainingLoop` built as
`Distiller.run` builds it, fed by the real `DistillationDataset` over in-memory latents and
embeddings. It measures:

- trainer: `TrainingLoop.train_step` exactly as training calls it, with no extra syncs;
- bare: the least a step must do on the same models, optimizer and tensor shapes: the teacher's
  guided forward (cond + uncond in one batch, routed by t), student forward and backward, AdamW;
- overhead ratio = median trainer step / median bare step. The two are timed in alternating
  blocks (ABBA order), with identical timestep draws, so machine noise and expert routing hit
  both alike. On CUDA a block spans several steps so the trainer's host sync is paid as it is in
  training instead of being hidden by the per-block sync;
- phases: a separate pass of `train_step` with hooks on its parts (data iterator, teacher, student
  forward, loss backward, optimizer), each synchronised before and after; "other" is the rest;
- memory: peak CPU RSS, CUDA max allocated/reserved, and the floor (student params + grads +
  AdamW state + teacher weights where they are placed);
- FLOPs: matmul FLOPs of both models counted from their shapes (backward = 2 x forward, no
  recomputation), achieved FLOP/s and, on CUDA, MFU against the device's dense bf16 peak;
- with --teacher_on_cpu on CUDA: the streamed teacher's forward against a GPU-resident copy.

Presets: cpu-tiny is the project's tiny teacher (distill.tiny) with config/student_tiny.json;
cpu-small is sized so compute dominates on 2 CPU cores; gpu-1.3b is a Wan2.1-1.3B-shaped student
(config/student_config.json) under a teacher of the real A14B width (40 heads x 128, ffn 13824,
text 4096) cut to --teacher_layers blocks, bf16; gpu-14b-slice trains a student of that width too.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import json
import logging
import math
import platform
import resource
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from distill.config import TrainConfig, finite_float
from distill.data import DistillationDataset
from distill.distributed import DistContext
from distill.objective import NUM_TRAIN_TIMESTEPS, apply_guidance, sample_sigmas, sigmas_to_timesteps
from distill.student import TEACHER_SHARED_KEYS, build_student, load_student_config
from distill.teacher import GuidedTeacher, place_expert

logger = logging.getLogger(__name__)

REPO = Path(__file__).resolve().parents[1]
LATENT_CHANNELS = 16
VAE_STRIDE_SPATIAL, VAE_STRIDE_TEMPORAL = 8, 4  # Wan VAE (Wan 2.1 / 2.2 A14B)
BOUNDARY_RATIO, FLOW_SHIFT = 0.875, 3.0  # Wan2.2-T2V-A14B model_index.json / scheduler
GUIDANCE_HIGH, GUIDANCE_LOW = 4.0, 3.0
PROMPT_TOKENS = 64  # unpadded length of each cached prompt embedding; padded to --text_len

# One expert of Wan2.2-T2V-A14B (transformer/config.json); presets cut num_layers.
A14B_EXPERT: dict[str, Any] = {
    "patch_size": [1, 2, 2],
    "num_attention_heads": 40,
    "attention_head_dim": 128,
    "in_channels": 16,
    "out_channels": 16,
    "text_dim": 4096,
    "freq_dim": 256,
    "ffn_dim": 13824,
    "num_layers": 40,
    "cross_attn_norm": True,
    "qk_norm": "rms_norm_across_heads",
    "eps": 1e-06,
    "rope_max_seq_len": 1024,
}
A14B_WIDTH_STUDENT = {k: A14B_EXPERT[k] for k in ("num_attention_heads", "attention_head_dim", "ffn_dim")}
SMALL_EXPERT = {
    **A14B_EXPERT,
    "num_attention_heads": 6,
    "attention_head_dim": 64,
    "ffn_dim": 1536,
    "text_dim": 256,
    "num_layers": 4,
}
SMALL_STUDENT = {"num_attention_heads": 4, "attention_head_dim": 64, "ffn_dim": 1024, "num_layers": 4}

# Dense bf16 tensor-core peak (no sparsity), matched against torch.cuda.get_device_name.
PEAK_BF16_TFLOPS = (
    ("H100 PCIe", 756.0),
    ("H100 NVL", 835.0),
    ("H100", 989.0),
    ("H200", 989.0),
    ("GH200", 989.0),
    ("H800", 989.0),
    ("B200", 2250.0),
    ("A100", 312.0),
    ("A800", 312.0),
    ("L40S", 362.0),
    ("L4", 121.0),
    ("A10G", 70.0),
    ("4090", 165.0),
)


@dataclass
class BenchSettings:
    """One benchmark configuration: a preset with command-line overrides applied."""

    preset: str
    device: str = "cpu"
    teacher: str | dict[str, Any] = "tiny"
    """"tiny" (distill.tiny's teacher) or WanTransformer3DModel kwargs of each expert."""
    student: str | dict[str, Any] = "config/student_tiny.json"
    """A student config file (relative to the repo) or shape keys; the rest comes from the teacher."""
    teacher_layers: int | None = None
    student_layers: int | None = None
    batch_size: int = 4
    height: int = 32
    width: int = 32
    num_frames: int = 1
    text_len: int = 512
    dtype: str = "float32"
    """Teacher weights and student autocast dtype (the student keeps float32 master weights)."""
    steps: int = 40
    warmup: int = 3
    block: int = 1
    """Steps per timed block; the mean of a block is one sample of the step time."""
    teacher_on_cpu: bool = False
    gradient_checkpointing: bool = False
    compile: bool = False
    peak_tflops: float | None = None
    seed: int = 0
    method: str = "velocity"
    """velocity, or dmd: a bench step is then one cycle of the method, one generator update and
    --critic_updates critic updates (that many `train_step` calls)."""
    critic_updates: int = 5
    student_steps: int = 4


PRESETS: dict[str, dict[str, Any]] = {
    "cpu-tiny": {"steps": 40, "warmup": 5},
    "cpu-small": {
        "teacher": SMALL_EXPERT,
        "student": SMALL_STUDENT,
        "batch_size": 2,
        "height": 256,
        "width": 256,
        "steps": 50,
        "warmup": 3,
    },
    "gpu-1.3b": {
        "device": "cuda",
        "teacher": A14B_EXPERT,
        "teacher_layers": 4,
        "student": "config/student_config.json",
        "batch_size": 4,
        "height": 480,
        "width": 832,
        "dtype": "bfloat16",
        "steps": 30,
        "warmup": 5,
        "block": 5,
    },
    "gpu-14b-slice": {
        "device": "cuda",
        "teacher": A14B_EXPERT,
        "teacher_layers": 4,
        "student": A14B_WIDTH_STUDENT,
        "student_layers": 4,
        "batch_size": 1,
        "height": 480,
        "width": 832,
        "num_frames": 17,
        "dtype": "bfloat16",
        "steps": 20,
        "warmup": 4,
        "block": 5,
    },
}


# ---------------------------------------------------------------------------------------------
# Models, data and the training loop, built in memory
# ---------------------------------------------------------------------------------------------


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
    loop: Any  # distill.loop.TrainingLoop
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
        from distill.tiny import TinyTeacherShape, build_tiny_pipeline

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
    from distill.loop import TrainingLoop

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


# ---------------------------------------------------------------------------------------------
# The bare loop: what a step cannot do without
# ---------------------------------------------------------------------------------------------


class BareLoop:
    """Teacher guided forward (routed by t), student forward/backward, AdamW step; nothing else.

    Runs on the trainer's own models and optimizer, on a small pool of batches already on the
    device, with the timesteps the trainer draws (same generator, same seed), so step j of both
    loops routes the same samples to the same experts.
    """

    def __init__(self, setup: Setup, steps: int, pool: int = 2) -> None:
        s, loop = setup.settings, setup.loop
        self.high, self.low, self.student = setup.high, setup.low, setup.student
        self.optimizer = loop.optimizer
        self.dtype, self.device = setup.teacher_dtype, setup.device
        self.autocast_dtype = torch.bfloat16 if s.dtype == "bfloat16" else None
        batch = s.batch_size
        generator = torch.Generator().manual_seed(s.seed + 7)
        text_dim = setup.teacher_config["text_dim"]
        self.uncond = loop.negative.to(self.dtype)
        self.pool = [
            (
                torch.randn((batch, *setup.latent_shape), generator=generator).to(self.device),
                torch.randn(batch, s.text_len, text_dim, generator=generator).to(self.device, self.dtype),
            )
            for _ in range(pool)
        ]
        timestep_generator = torch.Generator().manual_seed(s.seed + 1)  # as TrainingLoop seeds its own
        self.timesteps = []
        for _ in range(steps):
            t = sigmas_to_timesteps(sample_sigmas(batch, FLOW_SHIFT, timestep_generator))
            self.timesteps.append((t, t.to(self.device)))
        self.done = 0

    def teacher_velocity(
        self, x_t: torch.Tensor, t: torch.Tensor, t_dev: torch.Tensor, cond: torch.Tensor
    ) -> torch.Tensor:
        is_high = t >= BOUNDARY_RATIO * NUM_TRAIN_TIMESTEPS
        n_high = int(is_high.sum())  # CPU tensor: no device sync
        parts = []
        for expert, scale, mask, count in (
            (self.high, GUIDANCE_HIGH, is_high, n_high),
            (self.low, GUIDANCE_LOW, ~is_high, len(t) - n_high),
        ):
            if count == 0:
                continue
            if count == len(t):
                x, tt, c = x_t, t_dev, cond
            else:
                rows = mask.nonzero().flatten().to(self.device)
                x, tt, c = x_t[rows], t_dev[rows], cond[rows]
            x = x.to(self.dtype)
            both = expert(
                hidden_states=torch.cat([x, x]),
                timestep=torch.cat([tt, tt]),
                encoder_hidden_states=torch.cat([c, self.uncond.expand(count, -1, -1)]),
                return_dict=False,
            )[0]
            parts.append((mask, apply_guidance(both[:count].float(), both[count:].float(), scale)))
        if len(parts) == 1:
            return parts[0][1]
        out = torch.empty(x_t.shape, dtype=torch.float32, device=self.device)
        for mask, value in parts:
            out[mask.to(self.device)] = value
        return out

    def step(self) -> None:
        x_t, cond = self.pool[self.done % len(self.pool)]
        t, t_dev = self.timesteps[self.done]
        self.done += 1
        with torch.no_grad():
            target = self.teacher_velocity(x_t, t, t_dev, cond)
        autocast = (
            torch.autocast(self.device.type, dtype=self.autocast_dtype)
            if self.autocast_dtype
            else contextlib.nullcontext()
        )
        with autocast:
            prediction = self.student(
                hidden_states=x_t, timestep=t_dev, encoder_hidden_states=cond, return_dict=False
            )[0]
        loss = (prediction.float() - target).pow(2).mean()
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)


class BareDmdLoop:
    """One dmd cycle with nothing else: a generator update then `critic_updates` critic updates.

    Generator update: the student's no-grad rollout from noise to a random step k of its K, its
    forward with gradient there (x0_hat), x0_hat noised to a random t', the guided teacher (routed
    by t') and the critic without gradient, the normalised DMD loss, backward, AdamW. Critic update:
    the rollout to k and one more no-grad student forward (x0_hat), x0_hat noised to a shifted t,
    the critic's forward and backward on the flow-matching loss, AdamW. The trainer's models and
    optimizers; k, t' and t come from a generator seeded as the trainer's and drawn in the same
    order, so both loops run the same rollout depths and route the same samples to the same experts.
    """

    def __init__(self, setup: Setup, pool: int = 2) -> None:
        from distill.few_step import few_step_scheduler, student_grid

        s, loop = setup.settings, setup.loop
        self.velocity_loop = BareLoop(setup, 0, pool)  # its pool, dtype and guided teacher forward
        self.student, self.critic = setup.student, setup.extra["critic"]
        self.optimizers = loop.optimizers
        self.device, self.shift, self.updates = setup.device, FLOW_SHIFT, s.critic_updates
        self.batch, self.shape = s.batch_size, (s.batch_size, *setup.latent_shape)
        self.timesteps, self.sigmas = student_grid(
            few_step_scheduler(loop.cfg.student_shift, loop.cfg.student_shift_terminal), s.student_steps
        )
        self.cpu = torch.Generator().manual_seed(s.seed + 1)  # as TrainingLoop seeds its own
        self.noise_generator = torch.Generator(self.device).manual_seed(s.seed + 2)
        self.done = 0

    def noise(self) -> torch.Tensor:
        return torch.randn(self.shape, generator=self.noise_generator, device=self.device)

    def autocast(self) -> contextlib.AbstractContextManager:
        dtype = self.velocity_loop.autocast_dtype
        return torch.autocast(self.device.type, dtype=dtype) if dtype else contextlib.nullcontext()

    def forward(
        self, model: torch.nn.Module, x: torch.Tensor, t: torch.Tensor, cond: torch.Tensor
    ) -> torch.Tensor:
        with self.autocast():
            return model(hidden_states=x, timestep=t, encoder_hidden_states=cond, return_dict=False)[
                0
            ].float()

    def sample(self, cond: torch.Tensor, grad: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """(x0_hat, the latent it came from) at a random student step, through the no-grad rollout."""
        k = int(torch.randint(len(self.timesteps), (1,), generator=self.cpu).item())
        x = self.noise()
        with torch.no_grad():
            for i in range(k):
                t = self.timesteps[i].expand(self.batch).to(self.device)
                x0 = x - self.sigmas[i] * self.forward(self.student, x, t, cond)
                x = (1 - self.sigmas[i + 1]) * x0 + self.sigmas[i + 1] * self.noise()
        t = self.timesteps[k].expand(self.batch).to(self.device)
        with torch.set_grad_enabled(grad):
            return x - self.sigmas[k] * self.forward(self.student, x, t, cond), x

    def generator_update(self, cond: torch.Tensor) -> None:
        x0_hat, _ = self.sample(cond, grad=True)
        uniform = torch.rand(self.batch, generator=self.cpu, dtype=torch.float64)
        sigma = (self.shift * uniform / (1 + (self.shift - 1) * uniform)).clamp(0.02, 0.98)
        t = (sigma * NUM_TRAIN_TIMESTEPS).to(torch.int64)
        sigma_dev = sigma.to(self.device, torch.float32).view(-1, 1, 1, 1, 1)
        x_t = (1 - sigma_dev) * x0_hat.detach() + sigma_dev * self.noise()
        with torch.no_grad():
            real = x_t - sigma_dev * self.velocity_loop.teacher_velocity(x_t, t, t.to(self.device), cond)
            fake = x_t - sigma_dev * self.forward(self.critic, x_t, t.to(self.device), cond)
            scale = (x0_hat.detach() - real).abs().mean(dim=(1, 2, 3, 4), keepdim=True)
            target = x0_hat.detach() - (fake - real) / scale
        loss = 0.5 * (x0_hat - target).pow(2).mean()
        loss.backward()
        self.optimizers["student"].step()
        self.optimizers["student"].zero_grad(set_to_none=True)

    def critic_update(self, cond: torch.Tensor) -> None:
        x0_hat, _ = self.sample(cond, grad=False)
        sigma = sample_sigmas(self.batch, self.shift, self.cpu)
        t = (sigma * NUM_TRAIN_TIMESTEPS).to(torch.int64).to(self.device)
        sigma_dev = sigma.to(self.device, torch.float32).view(-1, 1, 1, 1, 1)
        noise = self.noise()
        x_t = (1 - sigma_dev) * x0_hat + sigma_dev * noise
        loss = (self.forward(self.critic, x_t, t, cond) - (noise - x0_hat)).pow(2).mean()
        loss.backward()
        self.optimizers["critic"].step()
        self.optimizers["critic"].zero_grad(set_to_none=True)

    def step(self) -> None:
        """One cycle: as `critic_updates` trainer steps (the first also updates the generator)."""
        pool = self.velocity_loop.pool
        for i in range(self.updates):
            cond = pool[(self.done + i) % len(pool)][1]
            if i == 0:
                self.generator_update(cond)
            self.critic_update(cond)
        self.done += self.updates


# ---------------------------------------------------------------------------------------------
# Timing
# ---------------------------------------------------------------------------------------------


def synchronizer(device: torch.device) -> Callable[[], None]:
    if device.type == "cuda":
        return lambda: torch.cuda.synchronize(device)
    return lambda: None


class TrainerSteps:
    """Calls `TrainingLoop.train_step` as `TrainingLoop.train` does; counts skipped steps. One bench
    step is `per_step` loop steps (dmd: a cycle of one generator and --critic_updates critic updates)."""

    def __init__(self, loop: Any, per_step: int = 1) -> None:
        self.loop = loop
        self.batches = iter(loop.make_loader())
        self.skipped = 0
        self.per_step = per_step

    def step(self) -> None:
        for _ in range(self.per_step):
            _, stepped, _ = self.loop.train_step(self.batches)
            self.skipped += not stepped


def time_block(step: Callable[[], None], n: int, sync: Callable[[], None]) -> float:
    """Seconds per step over `n` back-to-back steps, synchronised only at the block's ends."""
    sync()
    start = time.perf_counter()
    for _ in range(n):
        step()
    sync()
    return (time.perf_counter() - start) / n


def interleaved(
    trainer: Callable[[], None], bare: Callable[[], None], steps: int, block: int, sync: Callable[[], None]
) -> tuple[list[float], list[float]]:
    """Per-step times of both loops, in alternating blocks (trainer first, then bare first, ...)."""
    trainer_times: list[float] = []
    bare_times: list[float] = []
    for i in range(math.ceil(steps / block)):
        order = [(trainer, trainer_times), (bare, bare_times)]
        for step, times in order if i % 2 == 0 else order[::-1]:
            times.append(time_block(step, block, sync))
    return trainer_times, bare_times


class _TimedBackward:
    """What `scaler.scale(loss)` returns during the phase pass: its `.backward()` is timed."""

    def __init__(self, loss: torch.Tensor, clock: PhaseClock, name: str = "student_backward") -> None:
        self.loss, self.clock, self.name = loss, clock, name

    def backward(self, *args: Any, **kwargs: Any) -> None:
        with self.clock.phase(self.name):
            self.loss.backward(*args, **kwargs)


class PhaseClock:
    """Hooks on the parts of `train_step`, each synchronised before and after, summed per step."""

    PHASES = ("data", "teacher", "student_forward", "student_backward", "optimizer")
    # dmd: the no-grad student forwards (rollouts and the critic's samples), the guided teacher's
    # (real) and the critic's (fake) score, the generator's forward/backward/AdamW and the critic's.
    DMD_PHASES = (
        "data",
        "student_sampling",
        "teacher_real_score",
        "critic_fake_score",
        "generator_forward",
        "generator_backward",
        "generator_optimizer",
        "critic_forward",
        "critic_backward",
        "critic_optimizer",
    )

    def __init__(self, sync: Callable[[], None], phases: tuple[str, ...] = PHASES) -> None:
        self.sync = sync
        self.phases = phases
        self.current: dict[str, float] = {}
        self._starts: dict[str, float] = {}

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        self.start(name)
        try:
            yield
        finally:
            self.stop(name)

    def start(self, name: str) -> None:
        self.sync()
        self._starts[name] = time.perf_counter()

    def stop(self, name: str) -> None:
        self.sync()
        self.current[name] = self.current.get(name, 0.0) + time.perf_counter() - self._starts.pop(name)

    def timed(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            with self.phase(name):
                return fn(*args, **kwargs)

        return wrapper


class _TimedIterator:
    def __init__(self, inner: Iterator[Any], clock: PhaseClock) -> None:
        self.inner, self.clock = inner, clock

    def __iter__(self) -> _TimedIterator:
        return self

    def __next__(self) -> Any:
        with self.clock.phase("data"):
            return next(self.inner)


@contextlib.contextmanager
def _phase_hooks(
    steps: TrainerSteps, clock: PhaseClock, teacher_phase: str
) -> Iterator[tuple[list[Any], list[Any]]]:
    """Time the teacher's velocity (as `teacher_phase`) and the data loading. Yields two lists the
    caller fills: hook handles, and the grad scalers whose `scale` it patched; all undone on exit."""
    teacher = steps.loop.teacher
    original_batches = steps.batches
    teacher.velocity = clock.timed(teacher_phase, teacher.velocity)
    steps.batches = _TimedIterator(original_batches, clock)
    handles: list[Any] = []
    scalers: list[Any] = []
    try:
        yield handles, scalers
    finally:
        steps.batches = original_batches
        for handle in handles:
            handle.remove()
        del teacher.velocity  # the class attributes show through again
        for scaler in scalers:
            del scaler.scale


@contextlib.contextmanager
def instrumented(steps: TrainerSteps, clock: PhaseClock) -> Iterator[None]:
    """Install the phase hooks on the loop's teacher, model, scaler and optimizer; remove them after."""
    loop = steps.loop
    scaler, model, optimizer = loop.scaler, loop.model, loop.optimizer
    with _phase_hooks(steps, clock, "teacher") as (handles, scalers):
        scalers.append(scaler)
        scale = scaler.scale
        scaler.scale = lambda loss: _TimedBackward(scale(loss), clock)
        handles += [
            model.register_forward_pre_hook(lambda *_: clock.start("student_forward")),
            model.register_forward_hook(lambda *_: clock.stop("student_forward")),
            optimizer.register_step_pre_hook(lambda *_: clock.start("optimizer")),
            optimizer.register_step_post_hook(lambda *_: clock.stop("optimizer")),
        ]
        yield


def _forward_phases(clock: PhaseClock, model: str) -> tuple[Callable[..., None], Callable[..., None]]:
    """Forward hooks of a dmd model that split its forwards by whether they carry a gradient."""
    open_forwards: list[str] = []

    def before(*_: Any) -> None:
        name = {
            ("student", True): "generator_forward",
            ("student", False): "student_sampling",
            ("critic", True): "critic_forward",
            ("critic", False): "critic_fake_score",
        }[(model, torch.is_grad_enabled())]
        open_forwards.append(name)
        clock.start(name)

    def after(*_: Any) -> None:
        clock.stop(open_forwards.pop())

    return before, after


@contextlib.contextmanager
def instrumented_dmd(steps: TrainerSteps, clock: PhaseClock) -> Iterator[None]:
    """The dmd phases: hooks on the teacher, both models (split by whether the forward carries a
    gradient), both grad scalers and both optimizers; removed after."""
    loop = steps.loop
    with _phase_hooks(steps, clock, "teacher_real_score") as (handles, scalers):
        for model in ("student", "critic"):
            before, after = _forward_phases(clock, model)
            module = loop.models[model]
            handles += [module.register_forward_pre_hook(before), module.register_forward_hook(after)]
            name = "generator" if model == "student" else "critic"
            optimizer = loop.optimizers[model]
            handles += [
                optimizer.register_step_pre_hook(lambda *_, n=name: clock.start(f"{n}_optimizer")),
                optimizer.register_step_post_hook(lambda *_, n=name: clock.stop(f"{n}_optimizer")),
            ]
            scaler = loop.scalers[model]
            scalers.append(scaler)
            scale = scaler.scale
            scaler.scale = lambda loss, scale=scale, n=name: _TimedBackward(
                scale(loss), clock, f"{n}_backward"
            )
        yield


def phase_pass(
    steps: TrainerSteps, n: int, sync: Callable[[], None], dmd: bool = False
) -> dict[str, list[float]]:
    """Seconds per phase for each of `n` instrumented trainer steps; "other" is the step's remainder."""
    clock = PhaseClock(sync, PhaseClock.DMD_PHASES if dmd else PhaseClock.PHASES)
    per_phase: dict[str, list[float]] = {name: [] for name in (*clock.phases, "other", "step")}
    with (instrumented_dmd if dmd else instrumented)(steps, clock):
        for _ in range(n):
            clock.current = {}
            total = time_block(steps.step, 1, sync)
            for name in clock.phases:
                per_phase[name].append(clock.current.get(name, 0.0))
            per_phase["other"].append(max(0.0, total - sum(clock.current.values())))
            per_phase["step"].append(total)
    return per_phase


def summary_ms(seconds: list[float]) -> dict[str, float]:
    values = np.asarray(seconds) * 1e3
    return {
        "median": float(np.median(values)),
        "p10": float(np.percentile(values, 10)),
        "p90": float(np.percentile(values, 90)),
    }


def compare_teacher_placement(setup: Setup, reps: int, sync: Callable[[], None]) -> dict[str, Any]:
    """Streamed (CPU-resident) teacher against a GPU-resident one of the same shape, same inputs."""
    s = setup.settings
    config = dict(setup.teacher_config)
    resident = [random_expert(config, setup.device, setup.teacher_dtype) for _ in range(2)]
    streamed = setup.loop.teacher
    gpu = GuidedTeacher(
        *resident, BOUNDARY_RATIO, GUIDANCE_HIGH, GUIDANCE_LOW, setup.device, setup.teacher_dtype
    )
    generator = torch.Generator().manual_seed(s.seed + 11)
    x_t = torch.randn((s.batch_size, *setup.latent_shape), generator=generator).to(setup.device)
    cond = torch.randn(s.batch_size, s.text_len, config["text_dim"], generator=generator)
    cond = cond.to(setup.device, setup.teacher_dtype)
    times: dict[str, list[float]] = {"streamed": [], "resident": []}
    for i in range(reps + 1):
        t = sigmas_to_timesteps(sample_sigmas(s.batch_size, FLOW_SHIFT, generator))
        for name, teacher in (("streamed", streamed), ("resident", gpu)):
            seconds = time_block(
                lambda teacher=teacher, t=t: teacher.velocity(x_t, t, cond, setup.loop.negative), 1, sync
            )
            if i:  # the first round warms both up
                times[name].append(seconds)
    del gpu, resident
    free_memory()
    streamed_ms, resident_ms = summary_ms(times["streamed"]), summary_ms(times["resident"])
    return {
        "streamed_ms": streamed_ms,
        "resident_ms": resident_ms,
        "slowdown": streamed_ms["median"] / resident_ms["median"],
    }


def free_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


# ---------------------------------------------------------------------------------------------
# Memory and FLOPs
# ---------------------------------------------------------------------------------------------


def tensor_bytes(tensors: Iterator[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def memory_report(setup: Setup) -> dict[str, Any]:
    student = setup.student
    trainable = [p for p in student.parameters() if p.requires_grad]
    state = [v for s in setup.loop.optimizer.state.values() for v in s.values() if torch.is_tensor(v)]
    teacher = tensor_bytes(t for m in (setup.high, setup.low) for t in (*m.parameters(), *m.buffers()))
    streamed = setup.settings.teacher_on_cpu and setup.device.type == "cuda"
    floor = {
        "student_params": tensor_bytes(student.parameters()),
        "student_grads": tensor_bytes(iter(trainable)),
        "optimizer_state": tensor_bytes(iter(state)),
        "teacher_weights": teacher,
        "teacher_placement": "cpu" if streamed or setup.device.type == "cpu" else str(setup.device),
    }
    for name, model in setup.extra.items():  # dmd: the critic, with its gradients and AdamW state
        optimizer = setup.loop.optimizers[name]
        floor[f"{name}_params"] = tensor_bytes(model.parameters())
        floor[f"{name}_grads"] = tensor_bytes(p for p in model.parameters() if p.requires_grad)
        floor[f"{name}_optimizer_state"] = tensor_bytes(
            v for state in optimizer.state.values() for v in state.values() if torch.is_tensor(v)
        )
    report: dict[str, Any] = {
        "floor": floor,
        "floor_bytes": sum(v for k, v in floor.items() if k != "teacher_placement")
        - (teacher if streamed else 0),
        "teacher_host_bytes": teacher if streamed else 0,
        "cpu_rss_peak_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "cuda_max_allocated_bytes": None,
        "cuda_max_reserved_bytes": None,
    }
    if setup.device.type == "cuda":
        report["cuda_max_allocated_bytes"] = torch.cuda.max_memory_allocated(setup.device)
        report["cuda_max_reserved_bytes"] = torch.cuda.max_memory_reserved(setup.device)
    return report


def forward_flops(config: dict[str, Any], tokens: int, text_len: int) -> int:
    """Matmul FLOPs (2 per multiply-add) of one WanTransformer3DModel forward on one sample.

    Patch embedding, timestep and text embedders, per block self-attention (q, k, v, o and the
    two attention products), cross-attention (q, o on the video tokens, k, v on the text tokens,
    the two products), the feed-forward network, and the output projection.
    """
    dim = config["num_attention_heads"] * config["attention_head_dim"]
    patch = math.prod(config["patch_size"])
    n, length = tokens, text_len
    embed = (
        2 * n * config["in_channels"] * patch * dim
        + 2 * (config["freq_dim"] * dim + dim * dim + dim * 6 * dim)
        + 2 * length * (config["text_dim"] * dim + dim * dim)
    )
    self_attention = 2 * n * 4 * dim * dim + 4 * n * n * dim
    cross_attention = 2 * n * 2 * dim * dim + 2 * length * 2 * dim * dim + 4 * n * length * dim
    ffn = 2 * n * 2 * dim * config["ffn_dim"]
    out = 2 * n * dim * config["out_channels"] * patch
    return embed + config["num_layers"] * (self_attention + cross_attention + ffn) + out


def flops_report(setup: Setup, step_seconds: float) -> dict[str, Any]:
    s = setup.settings
    tokens = setup.tokens_per_sample
    # Each sample meets one expert, twice (cond + uncond); the experts share one shape.
    teacher = 2 * s.batch_size * forward_flops(setup.teacher_config, tokens, s.text_len)
    student_forward = s.batch_size * forward_flops(setup.student_config, tokens, s.text_len)
    student = 3 * student_forward
    if s.method == "dmd":
        # A cycle: the generator update (rollout to step k, forward + backward, the critic's fake
        # score) and critic_updates critic updates (rollout to k, one more forward, the critic's
        # forward + backward); k is uniform over the K steps, so a rollout averages (K-1)/2 forwards.
        rollout = (s.student_steps - 1) / 2 * student_forward
        critic = student_forward  # the critic has the student's shape
        student = int(
            rollout
            + 3 * student_forward
            + critic
            + s.critic_updates * (rollout + student_forward + 3 * critic)
        )
    per_step = teacher + student
    achieved = per_step / step_seconds
    peak = peak_flops(setup.device, s.peak_tflops)
    return {
        "per_step": per_step,
        "teacher_per_step": teacher,
        "student_per_step": student,
        "achieved_per_s": achieved,
        "peak_per_s": peak,
        "mfu": achieved / peak if peak else None,
    }


def peak_flops(device: torch.device, override_tflops: float | None) -> float | None:
    if override_tflops:
        return override_tflops * 1e12
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for key, tflops in PEAK_BF16_TFLOPS:
        if key in name:
            return tflops * 1e12
    return None


# ---------------------------------------------------------------------------------------------
# The run
# ---------------------------------------------------------------------------------------------


def environment(device: torch.device) -> dict[str, Any]:
    import diffusers

    name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu"
    return {
        "device": str(device),
        "device_name": name,
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "diffusers": diffusers.__version__,
        "python": platform.python_version(),
    }


def model_summary(setup: Setup) -> dict[str, Any]:
    def shape(config: dict[str, Any], model: torch.nn.Module) -> dict[str, Any]:
        return {
            "layers": config["num_layers"],
            "heads": config["num_attention_heads"],
            "head_dim": config["attention_head_dim"],
            "ffn_dim": config["ffn_dim"],
            "text_dim": config["text_dim"],
            "params": sum(p.numel() for p in model.parameters()),
        }

    return {
        "teacher_expert": shape(setup.teacher_config, setup.high),
        "student": shape(setup.student_config, setup.student),
        "latent_shape": list(setup.latent_shape),
        "tokens_per_sample": setup.tokens_per_sample,
        "text_len": setup.settings.text_len,
    }


def run_bench(settings: BenchSettings) -> dict[str, Any]:
    """Build, warm up, time both loops interleaved, time the phases, and report."""
    started = time.perf_counter()
    if settings.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit(f"preset {settings.preset} needs CUDA, and torch sees no GPU")
    with tempfile.TemporaryDirectory(prefix="distill-bench-") as tmp:
        setup = build_setup(settings, Path(tmp))
        sync = synchronizer(setup.device)
        blocks = math.ceil(settings.steps / settings.block)
        dmd = settings.method == "dmd"
        trainer = TrainerSteps(setup.loop, settings.critic_updates if dmd else 1)
        if dmd:
            bare: BareLoop | BareDmdLoop = BareDmdLoop(setup)
        else:
            bare = BareLoop(setup, settings.warmup + blocks * settings.block)
        for _ in range(settings.warmup):
            trainer.step()
            bare.step()
        sync()
        if setup.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(setup.device)
        trainer_times, bare_times = interleaved(trainer.step, bare.step, settings.steps, settings.block, sync)
        phases = phase_pass(trainer, settings.steps, sync, dmd)
        memory = memory_report(setup)
        placement = None
        if settings.teacher_on_cpu and setup.device.type == "cuda":
            placement = compare_teacher_placement(setup, max(3, settings.steps // 2), sync)
        result = report(setup, trainer_times, bare_times, phases, memory, placement, trainer.skipped)
    result["wall_s"] = time.perf_counter() - started
    return result


def loop_summary(times: list[float], batch: int) -> dict[str, float]:
    ms = summary_ms(times)
    return {
        "median_ms": ms["median"],
        "p10_ms": ms["p10"],
        "p90_ms": ms["p90"],
        "steps_per_s": 1e3 / ms["median"],
        "samples_per_s": batch * 1e3 / ms["median"],
    }


def report(
    setup: Setup,
    trainer_times: list[float],
    bare_times: list[float],
    phases: dict[str, list[float]],
    memory: dict[str, Any],
    placement: dict[str, Any] | None,
    skipped: int,
) -> dict[str, Any]:
    s = setup.settings
    trainer = loop_summary(trainer_times, s.batch_size)
    bare = loop_summary(bare_times, s.batch_size)
    return {
        "preset": s.preset,
        "settings": dataclasses.asdict(s),
        "environment": environment(setup.device),
        "models": model_summary(setup),
        "steps": {
            "warmup": s.warmup,
            "block": s.block,
            "timed_trainer": len(trainer_times) * s.block,
            "timed_bare": len(bare_times) * s.block,
            "instrumented": len(phases["step"]),
            "skipped_by_trainer": skipped,
        },
        "trainer": trainer,
        "bare": bare,
        "overhead_ratio": trainer["median_ms"] / bare["median_ms"],
        "phases_ms": {name: summary_ms(values) for name, values in phases.items()},
        "memory": memory,
        "flops": flops_report(setup, trainer["median_ms"] / 1e3),
        "teacher_on_cpu": placement,
        "method": s.method,
        "train_steps_per_bench_step": s.critic_updates if s.method == "dmd" else 1,
    }


# ---------------------------------------------------------------------------------------------
# Output
# ---------------------------------------------------------------------------------------------


def human_bytes(n: float | None) -> str:
    if n is None:
        return "-"
    for unit in ("B", "KB", "MB", "GB"):
        if abs(n) < 1024 or unit == "GB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} GB"


def human_count(n: float) -> str:
    for unit, scale in (("T", 1e12), ("G", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:.2f}{unit}"
    return f"{n:.0f}"


def format_table(result: dict[str, Any]) -> str:
    s, env, models = result["settings"], result["environment"], result["models"]
    teacher, student = models["teacher_expert"], models["student"]
    steps = result["steps"]
    lines = [
        f"distill.bench  preset {result['preset']}  {env['device_name']} ({env['device']}, {env['threads']} threads)"
        f"  torch {env['torch']}  diffusers {env['diffusers']}",
        f"teacher  2 experts x {teacher['layers']} layers, {teacher['heads']}x{teacher['head_dim']} heads, "
        f"ffn {teacher['ffn_dim']}, {human_count(teacher['params'])} params each, {s['dtype']}"
        + (", streamed from CPU" if s["teacher_on_cpu"] and env["device"].startswith("cuda") else ""),
        f"student  {student['layers']} layers, {student['heads']}x{student['head_dim']} heads, ffn {student['ffn_dim']}, "
        f"{human_count(student['params'])} params, float32 weights"
        + (", bf16 autocast" if s["dtype"] == "bfloat16" else "")
        + (", grad checkpointing" if s["gradient_checkpointing"] else "")
        + (", compiled" if s["compile"] else ""),
        f"batch {s['batch_size']} x {models['tokens_per_sample']} tokens ({s['num_frames']} frame(s) "
        f"{s['height']}x{s['width']}, latent {'x'.join(map(str, models['latent_shape']))}), "
        f"text {models['text_len']} tokens",
        (
            f"method dmd: one bench step = one cycle of {s['critic_updates']} train_step calls (a generator "
            f"update and {s['critic_updates']} critic updates), student {s['student_steps']} steps, "
            "critic of the student's shape"
            if result["method"] == "dmd"
            else "method velocity"
        ),
        f"timed {steps['timed_trainer']} trainer + {steps['timed_bare']} bare steps in alternating blocks of "
        f"{steps['block']} after {steps['warmup']} warm-up; {steps['instrumented']} instrumented steps; "
        f"{steps['skipped_by_trainer']} skipped",
        "",
        f"{'step time':<34}{'median ms':>10}{'p10':>10}{'p90':>10}{'steps/s':>10}{'samples/s':>11}",
    ]
    for label, key in (("trainer (TrainingLoop.train_step)", "trainer"), ("bare loop", "bare")):
        r = result[key]
        lines.append(
            f"{label:<34}{r['median_ms']:>10.2f}{r['p10_ms']:>10.2f}{r['p90_ms']:>10.2f}"
            f"{r['steps_per_s']:>10.2f}{r['samples_per_s']:>11.2f}"
        )
    lines += [f"overhead ratio (median trainer / median bare): {result['overhead_ratio']:.3f}", ""]
    lines.append(f"{'phase (instrumented, synced)':<34}{'median ms':>10}{'p10':>10}{'p90':>10}{'share':>10}")
    phases = result["phases_ms"]
    for name, values in phases.items():
        share = values["median"] / phases["step"]["median"]
        lines.append(
            f"{name.replace('_', ' '):<34}{values['median']:>10.2f}{values['p10']:>10.2f}{values['p90']:>10.2f}"
            f"{share:>10.1%}"
        )
    memory, floor = result["memory"], result["memory"]["floor"]
    lines += [
        "",
        f"memory floor {human_bytes(memory['floor_bytes'])} on {env['device']}: student params "
        f"{human_bytes(floor['student_params'])} + grads {human_bytes(floor['student_grads'])} + AdamW state "
        f"{human_bytes(floor['optimizer_state'])} + teacher {human_bytes(floor['teacher_weights'])} "
        f"(on {floor['teacher_placement']})"
        + (
            f" + critic {human_bytes(floor['critic_params'])} + grads {human_bytes(floor['critic_grads'])} "
            f"+ AdamW state {human_bytes(floor['critic_optimizer_state'])}"
            if "critic_params" in floor
            else ""
        ),
        f"peak: CPU RSS {human_bytes(memory['cpu_rss_peak_bytes'])}"
        + (
            f", CUDA max allocated {human_bytes(memory['cuda_max_allocated_bytes'])}, "
            f"reserved {human_bytes(memory['cuda_max_reserved_bytes'])}"
            if memory["cuda_max_allocated_bytes"] is not None
            else ""
        ),
    ]
    flops = result["flops"]
    line = (
        f"model FLOPs per step {human_count(flops['per_step'])} (teacher {human_count(flops['teacher_per_step'])}, "
        f"student {human_count(flops['student_per_step'])}), achieved {flops['achieved_per_s'] / 1e12:.3f} TFLOP/s"
    )
    if flops["mfu"] is not None:
        line += f", MFU {flops['mfu']:.1%} of {flops['peak_per_s'] / 1e12:.0f} TFLOP/s"
    lines.append(line)
    placement = result["teacher_on_cpu"]
    if placement:
        lines.append(
            f"teacher forward streamed from CPU {placement['streamed_ms']['median']:.1f} ms vs GPU-resident "
            f"{placement['resident_ms']['median']:.1f} ms: {placement['slowdown']:.2f}x"
        )
    lines.append(f"wall time {result['wall_s']:.1f} s")
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> tuple[BenchSettings, Path | None]:
    parser = argparse.ArgumentParser(
        prog="python -m distill.bench",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--preset", choices=sorted(PRESETS), default="cpu-small")
    parser.add_argument("--json", type=Path, help="write the results here as JSON")
    parser.add_argument("--device", choices=("cpu", "cuda"))
    for name in (
        "steps",
        "warmup",
        "block",
        "batch_size",
        "height",
        "width",
        "num_frames",
        "text_len",
        "seed",
    ):
        parser.add_argument(f"--{name}", type=int)
    parser.add_argument("--teacher_layers", type=int, help="blocks per teacher expert")
    parser.add_argument("--student_layers", type=int, help="blocks of the student")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), help="teacher weights / student autocast")
    for name in ("teacher_on_cpu", "gradient_checkpointing", "compile"):
        parser.add_argument(f"--{name}", action=argparse.BooleanOptionalAction, default=None)
    parser.add_argument(
        "--peak_tflops", type=finite_float, help="peak FLOP/s for MFU (default: by device name)"
    )
    parser.add_argument(
        "--method", choices=("velocity", "dmd"), help="the training method whose step is timed (velocity)"
    )
    parser.add_argument("--critic_updates", type=int, help="dmd: critic updates per generator update (5)")
    parser.add_argument("--student_steps", type=int, help="dmd: the student's sampling steps K (4)")
    args = vars(parser.parse_args(argv))
    preset, json_path = args.pop("preset"), args.pop("json")
    overrides = {key: value for key, value in args.items() if value is not None}
    preset_values = dict(PRESETS[preset])
    if overrides.get("method") == "dmd":
        # A dmd bench step is a whole cycle (~critic_updates+2 velocity steps of work): fewer of them,
        # and on CUDA one cycle per timed block (it already holds several host syncs).
        preset_values["steps"] = max(6, preset_values.get("steps", BenchSettings.steps) // 4)
        preset_values["block"] = 1
    settings = BenchSettings(preset=preset, **{**preset_values, **overrides})
    for name in ("steps", "warmup", "block", "batch_size", "critic_updates", "student_steps"):
        if getattr(settings, name) < (0 if name == "warmup" else 1):
            parser.error(f"--{name} must be positive")
    return settings, json_path


def main(argv: list[str] | None = None) -> dict[str, Any]:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    settings, json_path = parse_args(argv)
    result = run_bench(settings)
    print(format_table(result))
    if json_path is not None:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {json_path}")
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
