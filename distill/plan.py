"""What a run will cost before it starts: parameter counts, per-device memory of each teacher
placement, and the placement `--teacher_placement auto` picks.

Printed by `--dry_run` (and at the start of every run) so users can size GPUs before renting them.
Activations are an order-of-magnitude estimate, not a measurement: `python -m distill.bench`
measures.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from distill.config import TrainConfig
from distill.student import count_parameters
from distill.teacher import TeacherInfo, resolve_dtype

GIB = 1024**3
PLACEMENTS = ("gpu", "cpu", "shard")
HEADROOM = 0.9  # leave room for the allocator, CUDA context and fragmentation


def human_count(n: int) -> str:
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return str(n)


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes per device for one placement (teacher share, student + grads + AdamW, activations)."""

    teacher: float
    student: float
    activations: float
    host_teacher: float  # CPU RAM per rank held by the teacher

    @property
    def total(self) -> float:
        return self.teacher + self.student + self.activations


def estimate(
    cfg: TrainConfig,
    info: TeacherInfo,
    student_config: dict[str, Any],
    device: torch.device,
    placement: str,
    world_size: int,
) -> MemoryEstimate:
    teacher_params = 2 * count_parameters(info.expert_config)
    teacher_bytes = teacher_params * (torch.finfo(resolve_dtype(cfg.teacher_dtype, device)).bits // 8)
    student_params = count_parameters(student_config)
    # fp32 weights + grads + two AdamW moments, plus the EMA copy when enabled.
    student_bytes = student_params * (16 + (4 if cfg.ema_decay else 0))
    _, frames, height, width = info.latent_shape(cfg.height, cfg.width, cfg.num_frames)
    tokens = frames * (height // info.patch_size[1]) * (width // info.patch_size[2])
    model_width = student_config["num_attention_heads"] * student_config["attention_head_dim"]
    # Rough: about a dozen saved fp32 activations of the model width per token and layer.
    per_layer = cfg.batch_size * tokens * model_width * 4 * 12
    layers_kept = 1 if cfg.gradient_checkpointing else student_config["num_layers"]
    activations = per_layer * (layers_kept + 1)
    if placement == "cpu":
        return MemoryEstimate(0.0, student_bytes, activations, teacher_bytes)
    if placement == "shard":
        # Each rank holds 1/N, plus one gathered block of each expert at a time.
        block = teacher_bytes / 2 / max(info.expert_config["num_layers"], 1)
        return MemoryEstimate(teacher_bytes / world_size + 2 * block, student_bytes, activations, 0.0)
    return MemoryEstimate(teacher_bytes, student_bytes, activations, 0.0)


def choose_placement(
    cfg: TrainConfig, info: TeacherInfo, student_config: dict[str, Any], device: torch.device, world_size: int
) -> tuple[str, str]:
    """The teacher placement to use and why, from the request and the device memory measured now."""
    requested = cfg.teacher_placement
    if requested == "shard" and world_size < 2:
        return (
            "gpu",
            "shard needs several ranks (torchrun --nproc_per_node>1); one process holds the whole teacher",
        )
    if requested != "auto":
        return requested, "as requested"
    if device.type != "cuda":
        return "gpu", "no CUDA: the teacher computes on the same device as everything else"
    free = torch.cuda.mem_get_info(device)[0] * HEADROOM
    options = ["gpu", "shard", "cpu"] if world_size > 1 else ["gpu", "cpu"]
    for placement in options:
        need = estimate(cfg, info, student_config, device, placement, world_size).total
        if need <= free or placement == "cpu":
            return placement, f"needs about {need / GIB:.1f} GiB per device, {free / GIB:.1f} GiB usable now"
    return "cpu", "nothing else fits"


def memory_plan(
    cfg: TrainConfig,
    info: TeacherInfo,
    student_config: dict[str, Any],
    device: torch.device,
    world_size: int = 1,
    local_world_size: int = 1,
    chosen: tuple[str, str] | None = None,
) -> str:
    """Parameters, then a per-device memory table with one column per teacher placement."""
    teacher_params = count_parameters(info.expert_config)
    student_params = count_parameters(student_config)
    teacher_dtype = resolve_dtype(cfg.teacher_dtype, device)
    _, frames, height, width = info.latent_shape(cfg.height, cfg.width, cfg.num_frames)
    tokens = frames * (height // info.patch_size[1]) * (width // info.patch_size[2])
    lines = [
        f"teacher   : {info.path}",
        f"  experts : 2 x {human_count(teacher_params)} parameters as {teacher_dtype}, "
        f"t >= {info.boundary_ratio * 1000:.0f} -> high-noise expert (transformer)",
        f"student   : {human_count(student_params)} parameters, {student_config['num_layers']} layers, "
        f"width {student_config['num_attention_heads'] * student_config['attention_head_dim']}",
        f"latents   : {info.latent_shape(cfg.height, cfg.width, cfg.num_frames)} per sample, {tokens} tokens",
        f"memory per device, GiB (rough; world size {world_size}, batch {cfg.batch_size}"
        + (", gradient checkpointing)" if cfg.gradient_checkpointing else ")"),
        f"  {'':28s}" + "".join(f"{p:>10s}" for p in PLACEMENTS),
    ]
    estimates = {p: estimate(cfg, info, student_config, device, p, world_size) for p in PLACEMENTS}
    for label, field in (
        ("teacher share", "teacher"),
        ("student+grads+AdamW", "student"),
        ("activations", "activations"),
        ("total", "total"),
        ("host RAM per rank (teacher)", "host_teacher"),
    ):
        lines.append(
            f"  {label:24s}" + "".join(f"{getattr(estimates[p], field) / GIB:10.2f}" for p in PLACEMENTS)
        )
    if world_size < 2:
        lines.append("  (shard needs torchrun with several ranks; with one it equals gpu)")
    if chosen:
        lines.append(f"teacher placement: {chosen[0]} ({chosen[1]})")
    if local_world_size > 1:
        lines.append(
            f"  cpu placement holds {local_world_size} teacher copies in each node's RAM "
            f"({estimates['cpu'].host_teacher * local_world_size / GIB:.1f} GiB)"
        )
    return "\n".join(lines)
