"""User-facing failures: one exception type, one banner format, one exit code per stage.

Every failure a user can fix is raised as a `DistillError` that says what went wrong, why it
probably happened and what to run instead. The entry points catch it, print the banner on
stderr (prefixed with the rank under torchrun) and exit with the stage's code, so scripts and
schedulers can tell a bad config from an out-of-memory from a crash.
"""

from __future__ import annotations

import os
import sys
import textwrap
from collections.abc import Callable, Sequence
from enum import IntEnum


class Stage(IntEnum):
    """Exit codes, one per stage that can fail. Documented in TORCHRUN_ERROR_FIXES.md."""

    ARGV = 2  # same as argparse's usage errors
    CONFIG = 3
    SETUP = 4
    TEACHER_LOAD = 5
    DATA = 6
    OUT_OF_MEMORY = 7
    TRAINING = 8
    CHECKPOINT = 9
    INTERNAL = 10
    STALLED = 11  # no progress for --stall_timeout minutes (distill/ops/watchdog.py)


class DistillError(Exception):
    """A failure with an explanation a user can act on."""

    def __init__(
        self,
        title: str,
        details: str = "",
        *,
        causes: Sequence[str] = (),
        fixes: Sequence[str] = (),
        stage: Stage = Stage.CONFIG,
        secondary: bool = False,
    ) -> None:
        super().__init__(title if not details else f"{title}: {details}")
        self.secondary = secondary  # this rank only failed because another one did first
        self.title = title
        self.details = details
        self.causes = list(causes)
        self.fixes = list(fixes)
        self.stage = stage


def current_rank() -> int | None:
    """The global rank under torchrun, or None for a plain single process."""
    rank = os.environ.get("RANK")
    return int(rank) if rank is not None and rank.isdigit() else None


def format_banner(error: DistillError, rank: int | None = None) -> str:
    """The multi-line message printed on stderr for `error`; every line carries the rank under torchrun."""
    bar = "=" * 78
    stage = error.stage.name.lower().replace("_", " ")
    lines = [bar, f"ERROR ({stage}): {error.title}", bar]
    if error.details:
        lines += ["", *textwrap.indent(error.details.rstrip(), "  ").splitlines()]
    if error.causes:
        lines += ["", "Likely causes:"] + [f"  - {c}" for c in error.causes]
    if error.fixes:
        lines += ["", "How to fix:"] + [f"  {i}. {f}" for i, f in enumerate(error.fixes, 1)]
    lines += ["", f"(exit code {int(error.stage)})", bar]
    text = "\n".join(lines)
    if rank is None:
        return text
    return "\n".join(f"[Rank {rank}] {line}".rstrip() for line in text.splitlines())


# ---------------------------------------------------------------------------------------------
# Where the run is, so an unexpected failure can say which stage and step it happened in
# ---------------------------------------------------------------------------------------------


class Progress:
    """The stage and step the run is in; updated by the trainer, read by the failure reports."""

    stage: Stage = Stage.SETUP
    step: int | None = None
    argv: list[str] = []

    @classmethod
    def enter(cls, stage: Stage, step: int | None = None) -> None:
        cls.stage, cls.step = stage, step

    @classmethod
    def where(cls) -> str:
        name = cls.stage.name.lower().replace("_", " ")
        return f"{name}, step {cls.step}" if cls.step is not None else name


def write_torchrun_error_file(message: str, secondary: bool = False) -> None:
    """Put `message` where torchrun's ChildFailedError summary reads the root cause.

    torchrun sets TORCHELASTIC_ERROR_FILE per worker; a JSON {"message", "timestamp"} there is
    shown verbatim as the failure's root cause instead of `error_file: <N/A>`. torchrun takes
    the earliest timestamp as the root cause, in whole seconds, and the lowest rank on a tie: a
    `secondary` failure (a rank that lost its peer) is dated one second later, so that it never
    takes the place of the rank that failed first within the same second.

    Written under a temporary name and renamed: torchrun parses the file of every failed rank, and
    a rank it SIGTERMs between truncating the file and filling it would leave an empty one, on
    which torchrun itself crashes (JSONDecodeError) instead of printing its summary.
    """
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    import json
    import time

    partial = f"{path}.{os.getpid()}.partial"
    try:
        with open(partial, "w") as handle:
            json.dump({"message": message, "timestamp": int(time.time()) + int(secondary)}, handle)
        os.replace(partial, path)
    except OSError:
        pass  # reporting must never fail the report itself


def quietly(what: str, action: Callable[[], object]) -> None:
    """Run one clean-up step; if it fails, say so in one line and go on.

    Clean-up runs after the run's own outcome (success, or a banner with its exit code) is
    settled: a second failure here, e.g. a signal handler raising inside `Thread.join`, must
    neither replace that outcome nor print a traceback after the banner.
    """
    try:
        action()
    except BaseException as exc:  # noqa: BLE001 - see above: nothing may escape from clean-up
        rank = current_rank()
        text = str(exc).strip().splitlines()
        print(
            f"{f'[Rank {rank}] ' if rank is not None else ''}warning: {what} failed during clean-up "
            f"({type(exc).__name__}: {text[0] if text else ''}); ignored",
            file=sys.stderr,
            flush=True,
        )


def report(error: DistillError) -> int:
    """Print the banner for `error` on stderr, hand it to torchrun, and return the exit code."""
    banner = format_banner(error, current_rank())
    print(banner, file=sys.stderr, flush=True)
    write_torchrun_error_file(banner, error.secondary)
    return int(error.stage)


# ---------------------------------------------------------------------------------------------
# Facts the reports quote (distill/train/diagnose.py turns exceptions into reports)
# ---------------------------------------------------------------------------------------------


def memory_picture() -> str:
    """Allocated / reserved / peak / total memory of the current CUDA device, or host RAM."""
    import torch

    if torch.cuda.is_available() and torch.cuda.is_initialized():
        gib = 1024**3
        device = torch.cuda.current_device()
        free, total = torch.cuda.mem_get_info(device)
        return (
            f"GPU {device} ({torch.cuda.get_device_name(device)}): "
            f"allocated {torch.cuda.memory_allocated(device) / gib:.2f} GiB, "
            f"reserved {torch.cuda.memory_reserved(device) / gib:.2f} GiB, "
            f"peak {torch.cuda.max_memory_allocated(device) / gib:.2f} GiB, "
            f"free {free / gib:.2f} GiB of {total / gib:.2f} GiB"
        )
    try:
        pages, size = os.sysconf("SC_PHYS_PAGES"), os.sysconf("SC_PAGE_SIZE")
        available = os.sysconf("SC_AVPHYS_PAGES")
        return f"host RAM: {available * size / 1024**3:.2f} GiB free of {pages * size / 1024**3:.2f} GiB"
    except (ValueError, OSError):
        return "host RAM: unknown"
