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

from distill.config.settings import TrainConfig
from distill.models.lora import LoraShape, count_adapter_parameters
from distill.models.student import count_parameters
from distill.models.teacher import TeacherInfo, resolve_dtype

GIB = 1024**3
PLACEMENTS = ("gpu", "cpu", "shard")
HEADROOM = 0.9  # leave room for the allocator, CUDA context and fragmentation
REFERENCE_GPU_BYTES = 80e9  # what --dry_run without CUDA measures against (an H100/A100 80 GB)


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
    critic: float = 0.0  # dmd: the critic's weights + grads + AdamW

    @property
    def total(self) -> float:
        return self.teacher + self.student + self.critic + self.activations


def trained_parameters(
    cfg: TrainConfig, info: TeacherInfo, student_config: dict[str, Any], critic_config: dict[str, Any] | None
) -> tuple[int, int | None]:
    """Trained parameters of the student and of the dmd critic (None without one). With
    --student_lora_rank these are the adapters on both experts (a full critic: both experts whole)."""
    if not cfg.student_lora_rank:
        return count_parameters(student_config), (
            count_parameters(critic_config) if critic_config is not None else None
        )
    expert = info.expert_config
    trained = len(cfg.phase_experts)  # --expert_phase high|low trains one expert's adapters
    student = trained * count_adapter_parameters(
        expert, LoraShape(cfg.student_lora_rank, cfg.lora_alpha, cfg.lora_targets)
    )
    if cfg.method != "dmd":
        return student, None
    rank = cfg.critic_adapter_rank
    critic = (
        trained * count_adapter_parameters(expert, LoraShape(rank, float(rank), cfg.lora_targets))
        if rank
        else 2 * count_parameters(expert)
    )
    return student, critic


def estimate(
    cfg: TrainConfig,
    info: TeacherInfo,
    student_config: dict[str, Any],
    device: torch.device,
    placement: str,
    world_size: int,
    critic_config: dict[str, Any] | None = None,
) -> MemoryEstimate:
    teacher_params = 2 * count_parameters(info.expert_config)
    teacher_bytes = teacher_params * (torch.finfo(resolve_dtype(cfg.teacher_dtype, device)).bits // 8)
    student_params, critic_params = trained_parameters(cfg, info, student_config, critic_config)
    # fp32 weights + grads + two AdamW moments, plus the EMA copy when enabled.
    student_bytes = student_params * (16 + (4 if cfg.ema_decay else 0))
    _, frames, height, width = info.latent_shape(cfg.height, cfg.width, cfg.num_frames)
    tokens = frames * (height // info.patch_size[1]) * (width // info.patch_size[2])
    model_width = student_config["num_attention_heads"] * student_config["attention_head_dim"]
    # Rough: about a dozen saved fp32 activations of the model width per token and layer.
    per_layer = cfg.batch_size * tokens * model_width * 4 * 12
    layers_kept = 1 if cfg.gradient_checkpointing else student_config["num_layers"]
    activations = per_layer * (layers_kept + 1)
    if critic_config is not None and cfg.regression_weight:
        activations *= 2  # the regression pair rides in the generator's forward
    # A critic is trained like the student (fp32 weights, grads, two AdamW moments), never at once with it.
    critic = 16.0 * critic_params if critic_params is not None else 0.0
    if placement == "cpu":
        return MemoryEstimate(0.0, student_bytes, activations, teacher_bytes, critic)
    if placement == "shard":
        # Each rank holds 1/N, plus one gathered block of each expert at a time.
        block = teacher_bytes / 2 / max(info.expert_config["num_layers"], 1)
        return MemoryEstimate(teacher_bytes / world_size + 2 * block, student_bytes, activations, 0.0, critic)
    return MemoryEstimate(teacher_bytes, student_bytes, activations, 0.0, critic)


def choose_placement(
    cfg: TrainConfig,
    info: TeacherInfo,
    student_config: dict[str, Any],
    device: torch.device,
    world_size: int,
    critic_config: dict[str, Any] | None = None,
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
    if cfg.student_lora_rank:  # the adapters train inside the experts: never streamed from the CPU
        full_critic = cfg.method == "dmd" and not cfg.critic_adapter_rank
        options = [p for p in options if p != "cpu" and not (p == "shard" and full_critic)]
    for placement in options:
        need = estimate(cfg, info, student_config, device, placement, world_size, critic_config).total
        if need <= free or placement == "cpu":
            return placement, f"needs about {need / GIB:.1f} GiB per device, {free / GIB:.1f} GiB usable now"
    if cfg.student_lora_rank:
        return options[-1], f"nothing fits; {options[-1]} needs the least memory (see --dry_run)"
    return "cpu", "nothing else fits"


def memory_plan(
    cfg: TrainConfig,
    info: TeacherInfo,
    student_config: dict[str, Any],
    device: torch.device,
    world_size: int = 1,
    local_world_size: int = 1,
    chosen: tuple[str, str] | None = None,
    critic_config: dict[str, Any] | None = None,
) -> str:
    """Parameters, then a per-device memory table with one column per teacher placement, and which
    placements fit the device (dmd adds the critic)."""
    teacher_params = count_parameters(info.expert_config)
    student_params, critic_params = trained_parameters(cfg, info, student_config, critic_config)
    teacher_dtype = resolve_dtype(cfg.teacher_dtype, device)
    _, frames, height, width = info.latent_shape(cfg.height, cfg.width, cfg.num_frames)
    tokens = frames * (height // info.patch_size[1]) * (width // info.patch_size[2])
    lines = [
        f"teacher   : {info.path}",
        f"  experts : 2 x {human_count(teacher_params)} parameters as {teacher_dtype}, "
        f"t >= {info.boundary_ratio * 1000:.0f} -> high-noise expert (transformer)",
        (
            f"student   : LoRA rank {cfg.student_lora_rank} (alpha {cfg.lora_alpha:g}) on both experts, "
            f"{human_count(student_params)} trained parameters; the experts' weights are the teacher's, held once"
            if cfg.student_lora_rank
            else f"student   : {human_count(student_params)} parameters, {student_config['num_layers']} layers, "
            f"width {student_config['num_attention_heads'] * student_config['attention_head_dim']}"
        ),
        *(
            [
                f"critic    : {human_count(critic_params or 0)} trained parameters, "
                + (
                    (
                        f"LoRA rank {cfg.critic_adapter_rank} on the same experts"
                        if cfg.critic_adapter_rank
                        else "a full copy of both experts"
                    )
                    if cfg.student_lora_rank
                    else f"{critic_config['num_layers']} layers"
                )
                + " (dmd fake score, trained with its own AdamW)"
            ]
            if critic_config is not None
            else []
        ),
        f"latents   : {info.latent_shape(cfg.height, cfg.width, cfg.num_frames)} per sample, {tokens} tokens",
        f"memory per device, GiB (rough; world size {world_size}, batch {cfg.batch_size}"
        + (", gradient checkpointing)" if cfg.gradient_checkpointing else ")"),
        f"  {'':28s}" + "".join(f"{p:>10s}" for p in PLACEMENTS),
    ]
    estimates = {
        p: estimate(cfg, info, student_config, device, p, world_size, critic_config) for p in PLACEMENTS
    }
    rows = [("teacher share", "teacher"), ("student+grads+AdamW", "student")]
    if critic_config is not None:
        rows.append(("critic+grads+AdamW", "critic"))
    for label, field in (
        *rows,
        ("activations", "activations"),
        ("total", "total"),
        ("host RAM per rank (teacher)", "host_teacher"),
    ):
        lines.append(
            f"  {label:24s}" + "".join(f"{getattr(estimates[p], field) / GIB:10.2f}" for p in PLACEMENTS)
        )
    if world_size < 2:
        lines.append("  (shard needs torchrun with several ranks; with one it equals gpu)")
    if device.type == "cuda":
        capacity, where = torch.cuda.get_device_properties(device).total_memory, "this GPU"
    else:
        capacity, where = REFERENCE_GPU_BYTES, "an 80 GB GPU (no CUDA here)"
    verdict = ", ".join(
        f"{p} {'yes' if estimates[p].total <= capacity * HEADROOM else 'no'}"
        for p in PLACEMENTS
        if (p != "shard" or world_size > 1) and (p != "cpu" or not cfg.student_lora_rank)
    )
    lines.append(f"fits {where} ({capacity * HEADROOM / GIB:.0f} GiB usable): {verdict}")
    if chosen:
        lines.append(f"teacher placement: {chosen[0]} ({chosen[1]})")
    if local_world_size > 1 and not cfg.student_lora_rank:  # a LoRA run never streams its experts
        lines.append(
            f"  cpu placement holds {local_world_size} teacher copies in each node's RAM "
            f"({estimates['cpu'].host_teacher * local_world_size / GIB:.1f} GiB)"
        )
    return "\n".join(lines)
