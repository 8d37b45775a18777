"""Run under torchrun by tests/test_sharding.py: sharded vs whole teacher, same guided velocity.

torchrun --standalone --nproc_per_node=2 tests/shard_velocity_check.py TEACHER_DIR
"""

import sys

import torch

from distill.models.teacher import GuidedTeacher, inspect_teacher, load_expert, place_expert
from distill.ops import distributed


def main(teacher_dir: str) -> int:
    ctx = distributed.setup("gloo", "cpu")
    info = inspect_teacher(teacher_dir)
    experts = {name: load_expert(info, name, torch.float32) for name in ("transformer", "transformer_2")}
    whole = GuidedTeacher(
        experts["transformer"],
        experts["transformer_2"],
        info.boundary_ratio,
        4.0,
        3.0,
        ctx.device,
        torch.float32,
    )
    sharded_experts = [
        place_expert(load_expert(info, name, torch.float32), ctx.device, False, ctx.world_size)
        for name in ("transformer", "transformer_2")
    ]
    sharded = GuidedTeacher(
        *sharded_experts, info.boundary_ratio, 4.0, 3.0, ctx.device, torch.float32, lockstep=True
    )
    gen = torch.Generator().manual_seed(10 + ctx.rank)
    x = torch.randn(3, 16, 1, 4, 4, generator=gen)
    cond = torch.randn(3, 9, info.text_dim, generator=gen)
    uncond = torch.randn(1, 9, info.text_dim, generator=gen)
    # Rank 0 has samples for both experts, rank 1 only low-noise ones: it must still join the
    # high-noise expert's gathers (a placeholder forward) or rank 0 would wait forever.
    t = torch.tensor([990.0, 100.0, 900.0]) if ctx.rank == 0 else torch.tensor([100.0, 300.0, 500.0])
    worst = (
        (sharded.velocity(x, t, cond, uncond, (True, True)) - whole.velocity(x, t, cond, uncond))
        .abs()
        .max()
        .item()
    )
    print(f"rank {ctx.rank} max abs difference {worst:.3e}", flush=True)
    distributed.teardown()
    return 0 if worst < 1e-5 else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
