"""What a run will cost before it starts: parameter counts, per-device memory of each teacher
placement, the placement `--teacher_placement auto` picks, and (distill.train.cost) the forwards and
GPU-hours of the whole run.

Printed by `--dry_run` (and at the start of every run) so users can size GPUs before renting them.
Weights, optimizer states and DDP's gradient buckets are counted from the configs; gradients and
activations are measured: the real diffusers models run one step's forwards and backward on fake
tensors at the run's sizes (distill.train.activations), and the plan takes the peak of the step's
phases (tests/test_memory_plan.py holds it against the measured peak of real CPU training steps, and
tests/test_sequence_parallel.py against a rank's of a context group).
Left out: what no tensor shows (the allocator's caching and fragmentation, the CUDA context, kernel
workspaces: hence HEADROOM), the VAE that decodes sample rounds, and the methods' own latent-sized
tensors beyond a model's input and target (a few per sample, 8.4 MB each at 480x832x81).
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from distill.config.settings import TrainConfig
from distill.models.lora import LoraShape, count_adapter_parameters
from distill.models.teacher import TeacherInfo, resolve_dtype
from distill.ops.mesh import shard_group_size
from distill.train.activations import ModelUse, no_grad_peak, parameter_count, stored_bytes, trained
from distill.train.cost import RunCounts, cost_lines, run_cost, teacher_guided
from distill.train.cp_traffic import step_traffic, traffic_lines
from distill.train.rollout_memory import rollout_cache

GIB = 1024**3
PLACEMENTS = ("gpu", "cpu", "shard")
HEADROOM = 0.9  # leave room for the allocator, CUDA context and fragmentation
REFERENCE_GPU_BYTES = 80e9  # what --dry_run without CUDA measures against (an H100/A100 80 GB)
ADAMW_BYTES = 12  # float32 weight + two float32 AdamW moments per trained parameter
AUTOCAST = {"bf16": "bfloat16", "fp16": "float16", "no": None}


def human_count(n: int) -> str:
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return str(n)


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes per device for one placement: what is held for the whole run (teacher share, trained
    weights with AdamW, DDP buckets) and the measured peak of a step's gradients and activations."""

    teacher: float
    student: float  # trained parameters (float32), two AdamW moments, the EMA copy
    activations: float  # the step's peak of gradients and activations (see step_activations)
    host_teacher: float  # CPU RAM per rank held by the teacher
    critic: float = 0.0  # dmd: the critic's weights + AdamW
    buckets: float = 0.0  # DDP's flat gradient buckets: a second copy of every trained gradient

    @property
    def total(self) -> float:
        return self.teacher + self.student + self.critic + self.buckets + self.activations


@dataclass(frozen=True)
class StepPeak:
    """The activation peak of a training step and the phase it happens in."""

    bytes: float
    phase: str


def trained_experts(cfg: TrainConfig, info: TeacherInfo) -> int:
    """The teacher's transformers whose adapters a LoRA run trains: both experts, or the one
    --expert_phase names; the one transformer of a teacher without a boundary (TI2V-5B)."""
    return min(len(cfg.phase_experts), info.kind.experts)


def trained_parameters(
    cfg: TrainConfig, info: TeacherInfo, student_config: dict[str, Any], critic_config: dict[str, Any] | None
) -> tuple[int, int | None]:
    """Trained parameters of the student and of the dmd critic (None without one). With
    --student_lora_rank these are the adapters on the trained experts (a full critic: every expert
    of the teacher whole)."""
    if not cfg.student_lora_rank:
        return parameter_count(student_config), (
            parameter_count(critic_config) if critic_config is not None else None
        )
    expert = info.expert_config
    trained = trained_experts(cfg, info)
    student = trained * count_adapter_parameters(
        expert, LoraShape(cfg.student_lora_rank, cfg.lora_alpha, cfg.lora_targets)
    )
    if not cfg.trains_critic:
        return student, None
    rank = cfg.critic_adapter_rank
    critic = (
        trained * count_adapter_parameters(expert, LoraShape(rank, float(rank), cfg.lora_targets))
        if rank
        else info.kind.experts * parameter_count(expert)
    )
    return student, critic


def tokens_of(cfg: TrainConfig, info: TeacherInfo) -> int:
    """Transformer tokens of one training sample (latent frames x patches)."""
    return info.tokens(cfg.height, cfg.width, cfg.num_frames)


def rank_latent_shape(
    shape: tuple[int, int, int, int], patch: Sequence[int], degree: int
) -> tuple[int, int, int, int]:
    """A latent (C, F, H, W) holding 1/`degree` of `shape`'s tokens: what one rank of a context group
    computes on (--sequence_parallel). Frames, then patch rows, then patch columns give up what
    `degree` divides of them; `degree` dividing the tokens (checked before a run) is enough for their
    product to give up all of it."""
    channels, *sizes = shape
    left, share = degree, []
    for size, step in zip(sizes, patch):
        cut = math.gcd(size // step, left)
        share.append(size // cut)
        left //= cut
    if left != 1:
        raise ValueError(f"{shape} in {tuple(patch)} patches does not split {degree} ways")
    return (channels, *share)


# ---------------------------------------------------------------------------------------------
# Activations: the step's phases, each measured on the real models (distill.train.activations)
# ---------------------------------------------------------------------------------------------


def _uses(
    cfg: TrainConfig,
    info: TeacherInfo,
    student_config: dict[str, Any],
    critic_config: dict[str, Any] | None,
    teacher_dtype: torch.dtype,
) -> dict[str, Any]:
    """How the step runs each model (distill.train.activations): the teacher's forward (batch doubled
    when an expert's guidance runs the unconditional pass), and the trained models' forwards without
    gradient and with it (the student's batch doubled by the dmd regression term)."""
    # Each rank of a context group computes on its share of the tokens (diffusers splits them after the
    # patch embedding), with the whole text in every cross-attention.
    shape = rank_latent_shape(
        info.latent_shape(cfg.height, cfg.width, cfg.num_frames), info.patch_size, cfg.sequence_parallel
    )
    # TI2V-5B gives every model (teacher, student, critic) a timestep per token.
    common = dict(
        latent_shape=shape, text_len=cfg.max_sequence_length, token_timesteps=info.kind.per_token_timesteps
    )
    weights = str(teacher_dtype).removeprefix("torch.")  # the experts' dtype, as the teacher loads them
    guided = teacher_guided(cfg, info.kind.experts)
    batch = cfg.batch_size
    trained = dict(
        autocast=AUTOCAST[cfg.mixed_precision],
        checkpointing=cfg.gradient_checkpointing,
        # With accumulation the gradients of earlier micro-batches are there when the next one starts;
        # without, each backward allocates them as it goes (the measured peak includes those).
        grads_held=cfg.gradient_accumulation_steps > 1,
    )

    def lora(rank: int, alpha: float) -> dict[str, Any]:
        return dict(weights=weights, lora_rank=rank, lora_alpha=alpha, lora_targets=cfg.lora_targets)

    from distill.train.methods import method_class

    # ode_init gives each frame of the student's input its chunk's timestep: one per token.
    student_tokens = method_class(cfg.method).student_timestep_per_token(cfg)

    def trained_use(name: str, config: dict[str, Any], regression: bool = False) -> dict[str, ModelUse]:
        size = batch * (2 if regression else 1)
        per_token = common["token_timesteps"] or (name == "student" and student_tokens)
        if not cfg.student_lora_rank:
            spec = dict(config=config, weights="float32")
        elif name == "student":
            spec = dict(config=info.expert_config, **lora(cfg.student_lora_rank, cfg.lora_alpha))
        elif cfg.critic_adapter_rank:
            spec = dict(
                config=info.expert_config, **lora(cfg.critic_adapter_rank, float(cfg.critic_adapter_rank))
            )
        else:  # a full float32 copy of the experts
            spec = dict(config=info.expert_config, weights="float32")
        config_of = spec.pop("config")
        uses = {**common, "token_timesteps": per_token}
        return {
            "train": ModelUse.of(config_of, batch=size, **uses, **trained, **spec),
            "no_grad": ModelUse.of(
                config_of, batch=batch, **uses, **{**trained, "grads_held": False}, **spec
            ),
        }

    uses: dict[str, Any] = {
        "teacher": ModelUse.of(
            info.expert_config, batch=batch * (2 if guided else 1), weights=weights, **common
        ),
        "student": trained_use(
            "student", student_config, regression=cfg.method == "dmd" and cfg.regression_weight > 0
        ),
    }
    if critic_config is not None:
        uses["critic"] = trained_use("critic", critic_config)
    return uses


def step_activations(
    cfg: TrainConfig,
    info: TeacherInfo,
    student_config: dict[str, Any],
    critic_config: dict[str, Any] | None,
    teacher_dtype: torch.dtype,
) -> StepPeak:
    """The peak of a micro-step's gradients and activations over its phases, in the order the methods
    run them.

    velocity: the teacher's forward (no gradient), then the student's forward and backward.
    dmd, generator update: the student's rollout (no gradient); its forward with gradient, whose saved
    activations stay while the teacher and the critic answer without gradient; its backward.
    dmd, critic update: the student generates without gradient, then the critic's forward and backward.
    Only the updated model has gradients (each optimizer step sets them to None); with accumulation
    they are there for the whole update, otherwise the measured backward allocates them.
    --sequence_parallel N: every model is measured on one rank's share of the tokens (rank_latent_shape)
    with the whole text, so what stays whole on each rank of a context group (the text's keys and
    values in every cross-attention, the weights' gradients) stays whole in the plan.
    """
    uses = _uses(cfg, info, student_config, critic_config, teacher_dtype)
    cache = rollout_cache(cfg, info, student_config, teacher_dtype)
    student_params, critic_params = trained_parameters(cfg, info, student_config, critic_config)
    accumulating = cfg.gradient_accumulation_steps > 1
    grads = {"student": 4.0 * student_params if accumulating else 0.0}
    grads["critic"] = 4.0 * (critic_params or 0) if accumulating else 0.0
    teacher = no_grad_peak(uses["teacher"])
    student = trained(uses["student"]["train"])
    phases = {
        "the teacher's forward": teacher + grads["student"],
        "the student's forward and backward": student.peak + cache.kept + grads["student"],
    }
    if cfg.trains_critic:
        rollout = no_grad_peak(uses["student"]["no_grad"])
        phases["the student's rollout"] = rollout + cache.live + max(grads.values())
        critic_no_grad = 0.0
        if "critic" in uses:
            critic = trained(uses["critic"]["train"])
            critic_no_grad = no_grad_peak(uses["critic"]["no_grad"])
            phases["the critic's forward and backward"] = critic.peak + grads["critic"]
        scores = student.held + cache.kept + max(teacher, critic_no_grad) + grads["student"]
        phases["the scores (teacher and critic) over the student's saved activations"] = scores
        del phases["the teacher's forward"]  # it runs inside the scores phase
    phase = max(phases, key=phases.get)
    return StepPeak(phases[phase], phase)


# ---------------------------------------------------------------------------------------------
# Per placement
# ---------------------------------------------------------------------------------------------


def teacher_bytes(info: TeacherInfo, dtype: torch.dtype) -> tuple[float, float, float]:
    """(all the teacher's transformers: both experts or the one of TI2V-5B, one block of one, one's
    parts outside its blocks) in bytes, as diffusers loads them in `dtype` (its float32 modules stay
    float32)."""
    expert = info.expert_config
    layers = int(expert["num_layers"])
    one, two = (stored_bytes({**expert, "num_layers": n}, dtype) for n in (1, 2))
    block = two - one
    return float(info.kind.experts * (one + (layers - 1) * block)), float(block), float(one - block)


def estimate(
    cfg: TrainConfig,
    info: TeacherInfo,
    student_config: dict[str, Any],
    device: torch.device,
    placement: str,
    world_size: int,
    critic_config: dict[str, Any] | None = None,
    local_world_size: int | None = None,
) -> MemoryEstimate:
    """Bytes per device for `placement` at `world_size` ranks (`local_world_size` per node: a sharded
    teacher is sharded within a node and replicated across nodes)."""
    teacher_dtype = resolve_dtype(cfg.teacher_dtype, device)
    experts, block, outside = teacher_bytes(info, teacher_dtype)
    student_params, critic_params = trained_parameters(cfg, info, student_config, critic_config)
    # float32 weights + two AdamW moments, plus the EMA copy when enabled.
    student = student_params * (ADAMW_BYTES + (4 if cfg.ema_decay else 0))
    critic = ADAMW_BYTES * critic_params if critic_params is not None else 0.0
    # DDP keeps a flat float32 bucket copy of every trained gradient, for the whole run.
    buckets = 4.0 * (student_params + (critic_params or 0)) if world_size > 1 else 0.0
    activations = step_activations(cfg, info, student_config, critic_config, teacher_dtype).bytes
    held = dict(student=student, activations=activations, critic=critic, buckets=buckets)
    if placement == "cpu":
        # Streamed block by block: the block computing and the next one prefetched, and the parts
        # outside the blocks (embedders, head), which group offloading copies whole each forward.
        return MemoryEstimate(2 * block + outside, host_teacher=experts, **held)
    if placement == "shard":
        shard = shard_group_size(world_size, local_world_size or world_size)
        # Each rank holds 1/N of its node's copy, plus the gathered block computing and the next.
        return MemoryEstimate(experts / shard + 2 * block, host_teacher=0.0, **held)
    return MemoryEstimate(experts, host_teacher=0.0, **held)


def choose_placement(
    cfg: TrainConfig,
    info: TeacherInfo,
    student_config: dict[str, Any],
    device: torch.device,
    world_size: int,
    critic_config: dict[str, Any] | None = None,
    local_world_size: int | None = None,
) -> tuple[str, str]:
    """The teacher placement to use and why, from the request and the device memory measured now.
    `local_world_size`: ranks per node (default: torchrun's LOCAL_WORLD_SIZE, else all on one node)."""
    if local_world_size is None:
        local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
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
        full_critic = cfg.trains_critic and not cfg.critic_adapter_rank
        options = [p for p in options if p != "cpu" and not (p == "shard" and full_critic)]
    for placement in options:
        need = estimate(
            cfg, info, student_config, device, placement, world_size, critic_config, local_world_size
        ).total
        if need <= free or placement == "cpu":
            return placement, f"needs about {need / GIB:.1f} GiB per device, {free / GIB:.1f} GiB usable now"
    if cfg.student_lora_rank:
        return options[-1], f"nothing fits; {options[-1]} needs the least memory (see --dry_run)"
    return "cpu", "nothing else fits"


def weights_line(info: TeacherInfo) -> list[str]:
    """A line saying the teacher's weights are not downloaded yet (a configs-only folder), else none."""
    from distill.models.layout import components_without_weights

    missing = components_without_weights(info.path)
    if not missing:
        return []
    return [
        f"  weights : not there yet ({', '.join(missing)} hold configs only): this plan comes from the "
        f"configs; training needs them: python download_wan.py --local_dir {info.path}"
    ]


def memory_plan(
    cfg: TrainConfig,
    info: TeacherInfo,
    student_config: dict[str, Any],
    device: torch.device,
    world_size: int = 1,
    local_world_size: int | None = None,
    chosen: tuple[str, str] | None = None,
    critic_config: dict[str, Any] | None = None,
    counts: RunCounts | None = None,
) -> str:
    """Parameters, then a per-device memory table with one column per teacher placement, which
    placements fit the device (dmd adds the critic), and with `counts` the run's compute cost.
    `local_world_size`: ranks per node (default: all on one node)."""
    local_world_size = local_world_size or world_size
    teacher_params = parameter_count(info.expert_config)
    student_params, critic_params = trained_parameters(cfg, info, student_config, critic_config)
    teacher_dtype = resolve_dtype(cfg.teacher_dtype, device)
    tokens = tokens_of(cfg, info)
    two = info.kind.experts == 2  # the A14B models; TI2V-5B has one transformer and no boundary
    experts, weights = (
        ("both experts", "experts' weights are")
        if two
        else ("the one transformer", "transformer's weights are")
    )
    lines = [
        # The model the files say it is (an image-to-video run needs images in its data).
        f"teacher   : {info.path} ({info.kind.model}, {info.kind.task})",
        *weights_line(info),
        (
            f"  experts : 2 x {human_count(teacher_params)} parameters as {teacher_dtype}, "
            f"t >= {info.boundary_ratio * 1000:.0f} -> high-noise expert (transformer)"
            if info.boundary_ratio is not None
            else f"  model   : one transformer, {human_count(teacher_params)} parameters as {teacher_dtype}, "
            "at every timestep (no expert boundary)"
        ),
        (
            f"student   : LoRA rank {cfg.student_lora_rank} (alpha {cfg.lora_alpha:g}) on {experts}, "
            f"{human_count(student_params)} trained parameters; the {weights} the teacher's, held once"
            if cfg.student_lora_rank
            else f"student   : {human_count(student_params)} parameters, {student_config['num_layers']} layers, "
            f"width {student_config['num_attention_heads'] * student_config['attention_head_dim']}"
        ),
        *(
            [
                f"critic    : {human_count(critic_params or 0)} trained parameters, "
                + (
                    (
                        f"LoRA rank {cfg.critic_adapter_rank} on the same {'experts' if two else 'transformer'}"
                        if cfg.critic_adapter_rank
                        else f"a full copy of {experts}"
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
        "memory per device, {unit} (world size "
        + f"{world_size}, batch {cfg.batch_size}"
        + (", gradient checkpointing" if cfg.gradient_checkpointing else "")
        + (f", autocast {AUTOCAST[cfg.mixed_precision]}" if AUTOCAST[cfg.mixed_precision] else "")
        + ")",
        f"  {'':28s}" + "".join(f"{p:>10s}" for p in PLACEMENTS),
    ]
    estimates = {
        p: estimate(cfg, info, student_config, device, p, world_size, critic_config, local_world_size)
        for p in PLACEMENTS
    }
    # Toy runs are planned in MiB: GiB with two decimals would read 0.00 everywhere.
    unit, scale = ("GiB", GIB) if max(e.total for e in estimates.values()) >= GIB else ("MiB", 2**20)
    lines = [line.replace("{unit}", unit) for line in lines]
    rows = [("teacher share", "teacher"), ("student+AdamW", "student")]
    if critic_config is not None:
        rows.append(("critic+AdamW", "critic"))
    if world_size > 1:
        rows.append(("DDP gradient buckets", "buckets"))
    for label, field in (
        *rows,
        ("gradients+activations", "activations"),
        ("total", "total"),
        ("host RAM per rank (teacher)", "host_teacher"),
    ):
        lines.append(
            f"  {label:28s}" + "".join(f"{getattr(estimates[p], field) / scale:10.2f}" for p in PLACEMENTS)
        )
    peak = step_activations(cfg, info, student_config, critic_config, teacher_dtype)
    lines.append(
        f"  activations: the peak of a micro-step, during {peak.phase}; measured on the diffusers models at "
        f"{tokens} tokens"
        + (
            f", each rank computing on 1/{cfg.sequence_parallel} of them (--sequence_parallel)"
            if cfg.sequence_parallel > 1
            else ""
        )
    )
    cache = rollout_cache(cfg, info, student_config, teacher_dtype)
    if cache.kept:
        experts = " (each expert its own)" if cfg.student_lora_rank and info.kind.experts > 1 else ""
        lines.append(
            f"  of which the rollout's KV cache{experts}: {cache.kept / GIB:.2f} GiB kept until the "
            f"student's backward (what its exit steps saw), {cache.live / GIB:.2f} GiB at its fullest"
        )
    if world_size < 2:
        lines.append("  (shard needs torchrun with several ranks; with one it equals gpu)")
    elif 1 < local_world_size < world_size:
        lines.append(
            f"  shard: each expert sharded over the {local_world_size} GPUs of a node, replicated across nodes"
        )
    if device.type == "cuda":
        capacity, where = torch.cuda.get_device_properties(device).total_memory, "this GPU"
    else:
        capacity, where = REFERENCE_GPU_BYTES, "an 80 GB GPU (no CUDA here)"
    if chosen:
        lines.append(f"teacher placement: {chosen[0]} ({chosen[1]})")
    if local_world_size > 1 and not cfg.student_lora_rank:  # a LoRA run never streams its experts
        lines.append(
            f"  cpu placement holds {local_world_size} teacher copies in each node's RAM "
            f"({estimates['cpu'].host_teacher * local_world_size / GIB:.1f} GiB)"
        )
    verdict = ", ".join(
        f"{p} {'yes' if estimates[p].total <= capacity * HEADROOM else 'no'}"
        for p in PLACEMENTS
        if (p != "shard" or world_size > 1) and (p != "cpu" or not cfg.student_lora_rank)
    )
    lines.append(f"fits {where} ({capacity * HEADROOM / GIB:.0f} GiB usable): {verdict}")
    if counts is not None:
        placement = chosen[0] if chosen else cfg.teacher_placement
        cost = run_cost(
            cfg,
            info,
            student_config,
            critic_config,
            counts,
            world_size,
            placement,
            teacher_bytes(info, teacher_dtype)[0],
        )
        lines += cost_lines(cost, cfg, counts)
        lines += traffic_lines(step_traffic(cfg, info, student_config, critic_config, cost, teacher_dtype))
    return "\n".join(lines)
