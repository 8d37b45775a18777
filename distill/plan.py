"""What a run will cost before it starts: parameter counts and a per-device memory estimate.

Printed by `--dry_run` (and at the start of every run) so users can size GPUs before renting them.
The activation figure is an order-of-magnitude estimate, not a measurement: `python -m
distill.bench` measures.
"""

from __future__ import annotations

from typing import Any

import torch

from distill.config import TrainConfig
from distill.student import count_parameters
from distill.teacher import TeacherInfo, resolve_dtype

GIB = 1024**3


def human_count(n: int) -> str:
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return str(n)


def memory_plan(
    cfg: TrainConfig,
    info: TeacherInfo,
    student_config: dict[str, Any],
    device: torch.device,
    world_size: int = 1,
    local_world_size: int = 1,
) -> str:
    """A readable estimate of parameters and per-device memory."""
    teacher_params = count_parameters(info.expert_config)
    student_params = count_parameters(student_config)
    teacher_dtype = resolve_dtype(cfg.teacher_dtype, device)
    teacher_gib = 2 * teacher_params * (torch.finfo(teacher_dtype).bits // 8) / GIB
    # fp32 weights + grads + two AdamW moments, plus the EMA copy when enabled.
    student_gib = student_params * (16 + (4 if cfg.ema_decay else 0)) / GIB
    c, f, h, w = info.latent_shape(cfg.height, cfg.width, cfg.num_frames)
    tokens = f * (h // info.patch_size[1]) * (w // info.patch_size[2])
    width = student_config["num_attention_heads"] * student_config["attention_head_dim"]
    layers = student_config["num_layers"]
    # Rough: about a dozen saved activations of the model width per token and layer (fp32).
    per_layer = cfg.batch_size * tokens * width * 4 * 12
    activation_gib = per_layer * ((1 if cfg.gradient_checkpointing else layers) + 1) / GIB
    on_device_teacher = 0.0 if cfg.teacher_on_cpu else teacher_gib
    lines = [
        f"teacher   : {info.path}",
        f"  experts : 2 x {human_count(teacher_params)} parameters ({teacher_gib:.2f} GiB as {teacher_dtype}), "
        f"t >= {info.boundary_ratio * 1000:.0f} -> high-noise expert (transformer)",
        f"student   : {human_count(student_params)} parameters, {layers} layers, width {width}",
        f"latents   : {(c, f, h, w)} per sample, {tokens} tokens per sample",
        f"memory per device (rough; world size {world_size}):",
        f"  teacher weights        {on_device_teacher:9.2f} GiB"
        + ("  (held in CPU RAM and streamed)" if cfg.teacher_on_cpu else ""),
        f"  student+grads+AdamW    {student_gib:9.2f} GiB",
        f"  activations (batch {cfg.batch_size:>2}) {activation_gib:9.2f} GiB"
        + ("  (gradient checkpointing)" if cfg.gradient_checkpointing else ""),
        f"  total                  {on_device_teacher + student_gib + activation_gib:9.2f} GiB",
    ]
    if cfg.teacher_on_cpu:
        lines.append(
            f"host RAM for the teacher on each node: {teacher_gib * local_world_size:.2f} GiB "
            f"({local_world_size} rank(s) x one CPU copy each)"
        )
    return "\n".join(lines)
