"""A quick check of the machine before a long run: environment, CUDA, NCCL, collectives, teacher folder.

    python -m distill.doctor [--teacher_path DIR]
    torchrun --standalone --nproc_per_node=8 -m distill.doctor [--teacher_path DIR]

Each rank prints its checks and ends with PASS or the list of what failed (exit code 0 / 1); a
--teacher_path that cannot be a teacher (a file, or a path under one) is refused first (exit code 3).
Under torchrun it also forms the process group and all-reduces across every rank, which is
the part of a training launch that most often fails on a new cluster.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable

import torch

from distill.ops import distributed
from distill.ops.command import Parser, PathAction, entry_point, number
from distill.ops.errors import DistillError, report
from distill.ops.paths import Kind, PathFlag, check_paths


def _check(name: str, fn: Callable[[], str], results: list[tuple[str, bool, str]]) -> None:
    try:
        results.append((name, True, fn()))
    except DistillError as exc:
        results.append((name, False, f"{exc.title} -- fix: {exc.fixes[0] if exc.fixes else ''}"))
    except Exception as exc:
        results.append((name, False, f"{type(exc).__name__}: {exc}"))


def _environment() -> str:
    return distributed.env_summary().replace("\n", ", ")


def _cuda() -> str:
    if not torch.cuda.is_available():
        return "no CUDA (CPU only: use --backend gloo, or auto)"
    names = {torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())}
    probe = torch.ones(1024, device="cuda") * 2  # a real kernel launch, not only a driver query
    assert probe.sum().item() == 2048
    return f"{torch.cuda.device_count()} GPU(s): {', '.join(sorted(names))}"


def _collective(ctx: distributed.DistContext) -> str:
    if not ctx.enabled:
        return "single process (not under torchrun): no collective to test"
    value = torch.tensor([float(ctx.rank + 1)], device=ctx.device)
    started = time.perf_counter()
    distributed.all_reduce_sum(value)
    expected = ctx.world_size * (ctx.world_size + 1) / 2
    if value.item() != expected:
        raise RuntimeError(f"all_reduce gave {value.item()}, expected {expected}")
    return f"all_reduce over {ctx.world_size} rank(s) on {ctx.backend} in {1000 * (time.perf_counter() - started):.1f} ms"


def _teacher(path: str) -> str:
    from distill.models.teacher import inspect_teacher

    info = inspect_teacher(path)
    if info.kind.experts == 1:  # TI2V-5B: no transformer_2/, no expert switch
        return (
            f"{info.path}: {info.kind.model} ({info.kind.task}), diffusers layout complete, one transformer "
            f"({info.kind.in_channels} latent channels, a timestep per token)"
        )
    return (
        f"{info.path}: {info.kind.model} ({info.kind.task}), diffusers layout complete, "
        f"boundary_ratio {info.boundary_ratio}"
    )


@entry_point
def main(argv: list[str] | None = None) -> int:
    parser = Parser(prog="python -m distill.doctor", description=__doc__.split("\n")[0])
    parser.add_argument(
        "--teacher_path",
        action=PathAction,
        kind=Kind.FOLDER_OR_HUB,
        help="also check this teacher folder's layout",
    )
    parser.add_argument("--backend", default="auto", choices=("auto", "nccl", "gloo"))
    parser.add_argument(
        "--dist_timeout",
        type=number(0.0, above=True),
        default=5.0,
        help="minutes to wait for the other ranks",
    )
    args = parser.parse_args(argv)
    try:  # a file given as the teacher is the user's mistake, not the machine's: a banner, not a FAIL
        check_paths([PathFlag("--teacher_path", args.teacher_path, Kind.FOLDER_OR_HUB)])
    except DistillError as error:
        return report(error)
    rank = os.environ.get("RANK")
    prefix = f"[Rank {rank}] " if rank is not None else ""
    results: list[tuple[str, bool, str]] = []
    _check("environment", _environment, results)
    _check("versions", distributed.versions, results)
    _check("cuda", _cuda, results)
    ctx = distributed.DistContext()
    try:
        ctx = distributed.setup(args.backend, "auto", args.dist_timeout)
        results.append(("process group", True, f"backend {ctx.backend or 'none'}, device {ctx.device}"))
        _check("collective", lambda: _collective(ctx), results)
    except DistillError as exc:
        results.append(("process group", False, f"{exc.title} -- fix: {exc.fixes[0] if exc.fixes else ''}"))
    if args.teacher_path:
        _check("teacher", lambda: _teacher(args.teacher_path), results)
    distributed.teardown()
    for name, ok, detail in results:
        print(f"{prefix}{'ok  ' if ok else 'FAIL'} {name:14s} {detail}", flush=True)
    failed = [name for name, ok, _ in results if not ok]
    print(f"{prefix}{'PASS' if not failed else 'FAILED: ' + ', '.join(failed)}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
