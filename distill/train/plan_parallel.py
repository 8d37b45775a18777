"""The plan a run prints at its own sizes, and, when it does not fit, the smallest --sequence_parallel
degree that would make it fit (or a line saying none does).

A degree is a candidate when the trainer would accept it (distill.train.sequence_parallel): it divides
the ranks per node and the world size, every split model's attention heads and a sample's tokens (a
causal student's: one chunk's). The search re-plans the run at each candidate, smallest first, with
the same placement, batch and accumulation, and names the first whose memory fits.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import torch

from distill.config.settings import TrainConfig
from distill.models.teacher import TeacherInfo, resolve_dtype
from distill.ops.distributed import DistContext
from distill.train.cost import RunCounts, run_cost
from distill.train.cp_traffic import StepTraffic, step_traffic, traffic_summary
from distill.train.plan import (
    GIB,
    HEADROOM,
    PLACEMENTS,
    REFERENCE_GPU_BYTES,
    choose_placement,
    estimate,
    memory_plan,
    teacher_bytes,
)
from distill.train.sequence_parallel import split_tokens


@dataclasses.dataclass(frozen=True)
class DegreeFit:
    """A --sequence_parallel degree and the memory per device it plans (None: no degree fits)."""

    degree: int | None
    need: float = 0.0
    tried: tuple[int, ...] = ()


@dataclasses.dataclass(frozen=True)
class PlanInputs:
    """What planning the run at another degree takes besides the degree: the run, its models, and the
    ranks and placement it is planned for (the same at every degree tried)."""

    cfg: TrainConfig
    info: TeacherInfo
    student_config: dict[str, Any]
    critic_config: dict[str, Any] | None
    device: torch.device
    world_size: int
    local_world_size: int
    placement: str

    def need(self, cfg: TrainConfig) -> float:
        """Bytes per device of `cfg` (this run, or it at another degree) with these models and ranks."""
        return estimate(
            cfg,
            self.info,
            self.student_config,
            self.device,
            self.placement,
            self.world_size,
            self.critic_config,
            self.local_world_size,
        ).total

    def traffic(self, cfg: TrainConfig, counts: RunCounts) -> StepTraffic:
        """The all-to-all bytes one rank sends per optimizer step of `cfg` (distill.train.cp_traffic)."""
        dtype = resolve_dtype(cfg.teacher_dtype, self.device)
        experts = teacher_bytes(self.info, dtype)[0]
        args = (cfg, self.info, self.student_config, self.critic_config)
        cost = run_cost(*args, counts, self.world_size, self.placement, experts)
        return step_traffic(*args, cost, dtype)

    def usable_degrees(self) -> list[int]:
        """The degrees above 1 the trainer accepts for this run, smallest first."""
        tokens, _ = split_tokens(self.cfg, self.info)
        heads = [
            int(config["num_attention_heads"])
            for config in (self.info.expert_config, self.student_config, self.critic_config)
            if config
        ]
        world, local = self.world_size, self.local_world_size
        return [
            d
            for d in range(2, local + 1)
            if not (world % d or local % d or tokens % d or any(h % d for h in heads))
        ]

    def smallest_fitting_degree(self, capacity: float) -> DegreeFit:
        """The smallest usable degree above the run's own whose plan fits `capacity` x HEADROOM bytes,
        with --gradient_accumulation_steps raised so that the global batch stays the run's."""
        tried = []
        for degree in self.usable_degrees():
            if degree <= self.cfg.sequence_parallel:
                continue
            tried.append(degree)
            need = self.need(at_degree(self.cfg, degree))
            if need <= capacity * HEADROOM:
                return DegreeFit(degree, need, tuple(tried))
        return DegreeFit(None, tried=tuple(tried))


def usable_degrees(
    cfg: TrainConfig,
    info: TeacherInfo,
    student_config: dict[str, Any],
    critic_config: dict[str, Any] | None,
    world_size: int,
    local_world_size: int,
    placement: str,
) -> list[int]:
    """The degrees above 1 the trainer accepts for this run, smallest first (the device plays no part)."""
    inputs = PlanInputs(
        cfg, info, student_config, critic_config, torch.device("cpu"), world_size, local_world_size, placement
    )
    return inputs.usable_degrees()


def at_degree(cfg: TrainConfig, degree: int) -> TrainConfig:
    """The run at --sequence_parallel `degree`, accumulating as many more micro-steps as it has fewer
    context groups (the same global batch)."""
    accumulation = -(-cfg.gradient_accumulation_steps * degree // cfg.sequence_parallel)
    return dataclasses.replace(cfg, sequence_parallel=degree, gradient_accumulation_steps=accumulation)


def smallest_fitting_degree(
    cfg: TrainConfig,
    info: TeacherInfo,
    student_config: dict[str, Any],
    critic_config: dict[str, Any] | None,
    device: torch.device,
    world_size: int,
    local_world_size: int,
    placement: str,
    capacity: float,
) -> DegreeFit:
    """PlanInputs.smallest_fitting_degree of these inputs."""
    inputs = PlanInputs(
        cfg, info, student_config, critic_config, device, world_size, local_world_size, placement
    )
    return inputs.smallest_fitting_degree(capacity)


def degree_line(inputs: PlanInputs, counts: RunCounts) -> list[str]:
    """One line when the placement does not fit the device: the degree that fits, with the all-to-all
    traffic it adds (the run's `counts`), or that none does."""
    cfg, world_size, placement = inputs.cfg, inputs.world_size, inputs.placement
    if placement not in PLACEMENTS or world_size < 2:
        return []
    device = inputs.device
    capacity = (
        torch.cuda.get_device_properties(device).total_memory
        if device.type == "cuda"
        else REFERENCE_GPU_BYTES
    )
    if inputs.need(cfg) <= capacity * HEADROOM:
        return []
    fit = inputs.smallest_fitting_degree(capacity)
    if fit.degree is None:
        tried = ", ".join(map(str, fit.tried)) or "none usable"
        return [
            f"  {placement} does not fit at any --sequence_parallel degree this run can use "
            f"(tried: {tried}); lower --height, --width or --num_frames"
        ]
    groups = world_size // fit.degree
    planned = at_degree(cfg, fit.degree)
    return [
        f"  {placement} fits with --sequence_parallel {fit.degree} --gradient_accumulation_steps "
        f"{planned.gradient_accumulation_steps}: {fit.need / GIB:.2f} GiB per device ({groups} context group"
        f"{'s' if groups > 1 else ''} of {fit.degree} ranks, the same global batch); "
        + traffic_summary(inputs.traffic(planned, counts))
    ]


def run_plan(
    cfg: TrainConfig,
    info: TeacherInfo,
    student_config: dict[str, Any],
    critic_config: dict[str, Any] | None,
    device: torch.device,
    ctx: DistContext,
    chosen: tuple[str, str],
) -> str:
    """The plan a run prints (--dry_run) and logs at its start: memory per device at the launched world
    size (or --plan_world_size, on nodes of torchrun's LOCAL_WORLD_SIZE, 8 when planning for another
    machine), the degree that fits when the placement does not, then the run's forwards and GPU-hours."""
    world = cfg.plan_world_size or ctx.world_size
    local_world = min(world, int(os.environ.get("LOCAL_WORLD_SIZE", 8 if cfg.plan_world_size else 1)))
    if cfg.plan_world_size and cfg.plan_world_size != ctx.world_size:
        chosen = choose_placement(cfg, info, student_config, device, world, critic_config, local_world)
    counts = RunCounts.from_config(cfg)
    text = memory_plan(cfg, info, student_config, device, world, local_world, chosen, critic_config, counts)
    lines = text.splitlines()
    verdict = next(i for i, line in enumerate(lines) if line.startswith("fits "))
    hint = degree_line(
        PlanInputs(cfg, info, student_config, critic_config, device, world, local_world, chosen[0]), counts
    )
    return "\n".join([*lines[: verdict + 1], *hint, *lines[verdict + 1 :]])
