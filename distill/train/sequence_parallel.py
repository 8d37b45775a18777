"""--sequence_parallel: which degrees a run can use (checked before the teacher loads), and the
placement that applies it to the trained models and the teacher's experts.

A context group of N consecutive ranks shares one sample: its tokens are split N ways by diffusers'
context parallel (Ulysses), so every rank of a group needs the same batch, noise and timesteps
(the loop reads data by `DistContext.data_rank`) and the gradients of a group add up to one
process's (the loop scales the loss by N; DDP's mean over all ranks divides it back out).
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, TypeVar

import torch

from distill.config.settings import TrainConfig
from distill.models.context_parallel import enable_context_parallel
from distill.models.teacher import TeacherInfo
from distill.ops.distributed import DistContext
from distill.ops.errors import DistillError, Stage
from distill.ops.mesh import context_mesh


def split_tokens(cfg: TrainConfig, info: TeacherInfo) -> tuple[int, str]:
    """The fewest tokens a forward of this run splits over a context group, and what they are in
    words. A causal student's rollout runs one chunk at a time (the clip is whole chunks), the other
    forwards a whole sample."""
    tokens = info.tokens(cfg.height, cfg.width, cfg.num_frames)
    chunk = cfg.student_chunk_frames
    if not chunk:
        return tokens, "a sample"
    frames = info.latent_shape(cfg.height, cfg.width, cfg.num_frames)[1] // info.patch_size[0]
    return tokens // frames * chunk, f"a chunk of --student_chunk_frames {chunk} latent frame(s)"


def _refuse(title: str, details: str, fixes: list[str]) -> DistillError:
    return DistillError(title, details, fixes=fixes, stage=Stage.CONFIG)


def check_sequence_parallel(
    cfg: TrainConfig,
    info: TeacherInfo,
    heads: dict[str, int],
    world_size: int,
    ranks_per_node: int,
    launched: bool,
) -> None:
    """Refuse a --sequence_parallel degree this run cannot split by, naming the degrees it can.

    `heads` maps each model the degree splits (teacher experts, student, critic) to its attention
    heads: Ulysses hands each rank heads / N of them. Tokens must split evenly too: the padding
    diffusers offers for uneven splits (`ulysses_anything`) has no proven backward, so it is not used.
    """
    degree = cfg.sequence_parallel
    if degree == 1:
        return
    tokens, what = split_tokens(cfg, info)
    # A chunk's tokens change with the frame's size and the chunk's, not with the clip's length.
    sizes = (
        "--height, --width or --student_chunk_frames"
        if cfg.student_chunk_frames
        else "--height, --width or --num_frames"
    )

    def fits(d: int) -> bool:
        return not (world_size % d or ranks_per_node % d or tokens % d or any(h % d for h in heads.values()))

    usable = ", ".join(str(d) for d in range(1, world_size + 1) if fits(d))
    others = f"or --sequence_parallel {usable} (the degrees this run can use)"
    if not launched:
        raise _refuse(
            f"--sequence_parallel {degree} splits each sample over {degree} ranks, but this run is one "
            "process (not launched by torchrun)",
            "The token shards live on different processes, which torchrun starts.",
            [
                f"torchrun --nproc_per_node={degree} train_distillation.py ... --sequence_parallel {degree}",
                "or --sequence_parallel 1 (off) for one process",
                *(
                    [
                        f"or plan for the GPUs it will run on: --dry_run --plan_world_size {8 // degree * degree or degree}"
                    ]
                    if cfg.dry_run
                    else []
                ),
            ],
        )
    if world_size % degree or ranks_per_node % degree:
        raise _refuse(
            f"--sequence_parallel {degree} must divide the ranks per node ({ranks_per_node}) and the "
            f"world size ({world_size})",
            "A context group's ranks exchange every attention's activations (all-to-all), so a group "
            "stays inside one node and the ranks split into whole groups.",
            [
                f"start a multiple of {degree} ranks on every node "
                f"(torchrun --nproc_per_node={degree * max(1, ranks_per_node // degree)} ...)",
                others,
            ],
        )
    for model, count in heads.items():
        if count % degree:
            raise _refuse(
                f"--sequence_parallel {degree} does not divide the {count} attention heads of the {model}",
                "Ulysses gives each rank of a context group heads / N whole heads.",
                [others],
            )
    if tokens % degree:
        raise _refuse(
            f"--sequence_parallel {degree} does not divide the {tokens} tokens of {what} "
            f"(--height {cfg.height} --width {cfg.width} --num_frames {cfg.num_frames})",
            "Each rank of a context group holds tokens / N of them; uneven splits are not supported.",
            [others, f"or a {sizes} whose token count N divides"],
        )


def context_groups(
    cfg: TrainConfig,
    info: TeacherInfo,
    ctx: DistContext,
    student_config: dict[str, Any],
    critic_config: dict[str, Any] | None,
) -> DistContext:
    """This rank's context, knowing its context group, once the degree is checked against the
    launch and every model it splits (before the teacher loads). A dry run with --plan_world_size
    checks it against the ranks it plans for, on nodes as the plan assumes (distill.train.plan)."""
    world, launched = ctx.world_size, ctx.enabled
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    if cfg.dry_run and cfg.plan_world_size:
        launched, world = True, cfg.plan_world_size
        per_node = min(world, int(os.environ.get("LOCAL_WORLD_SIZE", 8)))
    models = {"teacher's experts": info.expert_config, "student": student_config, "critic": critic_config}
    heads = {name: int(config["num_attention_heads"]) for name, config in models.items() if config}
    check_sequence_parallel(cfg, info, heads, world, per_node, launched)
    return dataclasses.replace(ctx, sequence_parallel=cfg.sequence_parallel)


M = TypeVar("M", bound=torch.nn.Module | None)


def split_model(ctx: DistContext, model: M) -> M:
    """`model` with the run's context parallel applied (as it is at --sequence_parallel 1, or None).

    The teacher is split only once the caches are filled: each rank samples clean latents for its
    own prompts, which a split forward (a collective over the group) would mix up."""
    if ctx.sequence_parallel > 1 and model is not None:
        enable_context_parallel(model, context_mesh(ctx.device, ctx.world_size, ctx.sequence_parallel))
    return model
