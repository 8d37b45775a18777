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
from collections.abc import Sequence
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
    ) -> None:
        super().__init__(title if not details else f"{title}: {details}")
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
    """The multi-line message printed on stderr for `error`."""
    prefix = f"[Rank {rank}] " if rank is not None else ""
    bar = "=" * 78
    lines = [bar, f"{prefix}ERROR ({error.stage.name.lower().replace('_', ' ')}): {error.title}", bar]
    if error.details:
        lines += ["", *textwrap.indent(error.details.rstrip(), "  ").splitlines()]
    if error.causes:
        lines += ["", "Likely causes:"] + [f"  - {c}" for c in error.causes]
    if error.fixes:
        lines += ["", "How to fix:"] + [f"  {i}. {f}" for i, f in enumerate(error.fixes, 1)]
    lines += ["", f"(exit code {int(error.stage)})", bar]
    return "\n".join(f"{prefix}{line}" if prefix and line else line for line in lines)


def report(error: DistillError) -> int:
    """Print the banner for `error` on stderr and return the exit code to use."""
    print(format_banner(error, current_rank()), file=sys.stderr, flush=True)
    return int(error.stage)
