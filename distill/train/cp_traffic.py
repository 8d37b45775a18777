"""The bytes each rank sends under --sequence_parallel N (diffusers' Ulysses context parallel), per
training step, and the time they take on an assumed intra-node link, beside the step's compute.

What moves (diffusers 0.42.1: `WanTransformer3DModel._cp_plan`, `TemplatedUlyssesAttention` in
models/attention_dispatch.py, read for this module):
- Every block's self-attention: before attention, one all-to-all each of q, k and v (sequence shards
  swapped for head shards); after it, one of the output. Its backward: one of the output's gradient,
  then one each of q's, k's and v's gradients. Each moves a tensor of tokens/N x width per sample on
  every rank, of which a rank keeps 1/N and sends (N-1)/N.
- Cross-attention (to the text) is called with no parallel config: nothing moves.
- The split after patch embedding (tokens, rotary tables, TI2V's per-token timesteps) is a local slice;
  the output is all-gathered at `proj_out` (each rank sends its tokens/N x out_channels x patch to the
  N-1 others; its backward is a local slice again). Tiny beside the blocks, counted anyway.
- Gradient checkpointing recomputes each block's forward in the backward: its four all-to-alls again.

The dtypes the tensors move in: the frozen teacher runs outside autocast, so q, k, v and the output
are in its weights' dtype (bf16). A trained model (student, critic, LoRA experts) runs under
--mixed_precision's autocast: on CUDA autocast runs `rms_norm` (Wan's norm_q and norm_k) in float32
(ATen's autocast op lists), and the rotary embedding keeps its input's dtype, so q and k move as
float32, v (no norm) and attention's output in the autocast dtype. CPU autocast keeps rms_norm in
bf16 (checked here), so a CPU run moves less than this plan says; the plan is for GPUs. Without
autocast everything moves in the weights' dtype (a full student: float32). A gradient has its
tensor's dtype.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from distill.config.settings import TrainConfig
from distill.models.teacher import TeacherInfo
from distill.train.cost import H100_BF16_FLOPS, Forwards, RunCost

# NVLink 4 (H100 SXM, H200 SXM): 900 GB/s per GPU both directions together, 450 GB/s each way. An
# all-to-all never reaches the link's peak (NCCL's protocol overheads, the step's other traffic);
# the fraction below is an ASSUMPTION, not a measurement: read the time as an order of magnitude.
NVLINK4_BYTES_PER_S = 450e9
ALL_TO_ALL_EFFICIENCY = 0.5
ALL_TO_ALL_BYTES_PER_S = NVLINK4_BYTES_PER_S * ALL_TO_ALL_EFFICIENCY
AUTOCAST_BYTES = {"bf16": 2, "fp16": 2, "no": None}


@dataclass(frozen=True)
class MovedBytes:
    """Bytes per element of the tensors one split model moves: q, k, v, attention's output (and
    each's gradient, in the same dtype), and the gathered model output."""

    query: int
    key: int
    value: int
    out: int
    model_out: int

    @property
    def attention(self) -> int:
        return self.query + self.key + self.value + self.out


@dataclass(frozen=True)
class ModelTraffic:
    """Bytes one rank sends for one sample through one split model."""

    forward: float  # every block's four all-to-alls, and the output's gather
    backward: float  # every block's four gradient all-to-alls
    recompute: float  # gradient checkpointing: every block's forward all-to-alls again

    def trained_step(self, checkpointing: bool) -> float:
        return self.forward + self.backward + (self.recompute if checkpointing else 0.0)


def model_traffic(config: dict[str, Any], tokens: int, degree: int, moved: MovedBytes) -> ModelTraffic:
    """Bytes one rank of a context group of `degree` sends for one sample of `tokens` tokens through
    the WanTransformer3DModel `config` describes (0 at degree 1: nothing is split)."""
    if degree <= 1:
        return ModelTraffic(0.0, 0.0, 0.0)
    width = int(config["num_attention_heads"]) * int(config["attention_head_dim"])
    layers = int(config["num_layers"])
    sent = (degree - 1) / degree  # of each tensor a rank holds, all but its own 1/N leaves it
    held = tokens / degree  # tokens of the sample on each rank
    blocks = layers * held * width * sent * moved.attention
    # The gather sends this rank's output share to each of the N-1 others.
    head = math.prod(config["patch_size"]) * int(config["out_channels"])
    gather = held * head * (degree - 1) * moved.model_out
    return ModelTraffic(forward=blocks + gather, backward=blocks, recompute=blocks)


def moved_bytes(cfg: TrainConfig, teacher_dtype: torch.dtype) -> dict[str, MovedBytes]:
    """What each model moves per element (see the module's docstring): the teacher, and the trained
    models (student, critic) under the run's autocast."""
    frozen = teacher_dtype.itemsize
    teacher = MovedBytes(frozen, frozen, frozen, frozen, frozen)
    low = AUTOCAST_BYTES[cfg.mixed_precision]
    if low is not None:
        trained = MovedBytes(4, 4, low, low, low)
    else:  # a LoRA run's experts keep the teacher's dtype; a full student or critic is float32
        weights = frozen if cfg.student_lora_rank else 4
        trained = MovedBytes(weights, weights, weights, weights, weights)
    return {"teacher": teacher, "student": trained, "critic": trained}


@dataclass(frozen=True)
class StepTraffic:
    """One rank's all-to-all bytes of an average optimizer step, and the step's compute per GPU."""

    bytes: float
    compute_seconds: float  # the step's FLOPs per GPU at --mfu (distill.train.cost)
    degree: int

    @property
    def seconds(self) -> float:
        return self.bytes / ALL_TO_ALL_BYTES_PER_S


def step_traffic(
    cfg: TrainConfig,
    info: TeacherInfo,
    student_config: dict[str, Any],
    critic_config: dict[str, Any] | None,
    cost: RunCost,
    teacher_dtype: torch.dtype,
) -> StepTraffic:
    """Bytes one rank sends in an optimizer step, averaged over the run (dmd's generator update runs
    every --critic_updates-th step), from the forwards the cost counts for each update (cost.per_sample:
    guidance, rollouts, regression batches), each through its model's split."""
    tokens = info.tokens(cfg.height, cfg.width, cfg.num_frames)
    degree = cfg.sequence_parallel
    configs = {"teacher": info.expert_config, "student": student_config, "critic": critic_config}
    if cfg.student_lora_rank:  # the trained models are the teacher's experts with adapters
        configs = {name: info.expert_config for name in configs}
    moved = moved_bytes(cfg, teacher_dtype)
    traffic = {
        name: model_traffic(config, tokens, degree, moved[name])
        for name, config in configs.items()
        if config is not None
    }

    def sample_bytes(forwards: Forwards) -> float:
        return sum(traffic[m].forward * n for m, n in forwards.no_grad.items()) + sum(
            traffic[m].trained_step(cfg.gradient_checkpointing) * n for m, n in forwards.grad.items()
        )

    # Every rank of a group runs every sample of the group's micro-batches (its share of their tokens).
    samples = cfg.batch_size * cfg.gradient_accumulation_steps
    per_step = sum(
        sample_bytes(forwards) * cost.updates[update] / cost.steps * samples
        for update, forwards in cost.per_sample.items()
    )
    compute = cost.flops["training"] / (cost.steps * cost.world_size) / (H100_BF16_FLOPS * cost.mfu)
    return StepTraffic(per_step, compute, degree)


def _bytes_text(n: float) -> str:
    # A toy run sends kilobytes: "0.0 GB" would say nothing.
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n:.0f} B"


def _seconds_text(seconds: float) -> str:
    return f"{seconds:.1f} s" if seconds >= 0.1 else f"{seconds:.2g} s"


def traffic_summary(traffic: StepTraffic) -> str:
    """The traffic in a few words, for the plan's line naming a degree that fits."""
    share = traffic.seconds / traffic.compute_seconds if traffic.compute_seconds else math.inf
    return (
        f"all-to-all {_bytes_text(traffic.bytes)} sent per rank per step, {_seconds_text(traffic.seconds)} "
        f"at an assumed {ALL_TO_ALL_BYTES_PER_S / 1e9:.0f} GB/s ({share:.1%} of the step's compute)"
    )


def traffic_lines(traffic: StepTraffic) -> list[str]:
    """The plan's lines on the all-to-all traffic (none without sequence parallel)."""
    if traffic.degree <= 1:
        return []
    share = traffic.seconds / traffic.compute_seconds if traffic.compute_seconds else math.inf
    return [
        f"  all-to-all (--sequence_parallel {traffic.degree}, Ulysses): {_bytes_text(traffic.bytes)} sent "
        f"per rank per step: {_seconds_text(traffic.seconds)} at an assumed "
        f"{ALL_TO_ALL_BYTES_PER_S / 1e9:.0f} GB/s (NVLink 4's {NVLINK4_BYTES_PER_S / 1e9:.0f} GB/s per "
        f"direction x {ALL_TO_ALL_EFFICIENCY:g}), against {_seconds_text(traffic.compute_seconds)} of "
        f"compute per step ({share:.1%}; diffusers waits for each exchange, so it adds to the step)"
    ]
