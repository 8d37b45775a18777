"""The warnings a benchmark run raised, each once, with the line of the model code that raised it.

A warning can be a slow path: torch says "Mismatch dtype between input and weight ... Cannot dispatch
to fused implementation" when an RMSNorm's float32 weight meets a bfloat16 input under autocast, and
the step then runs the unfused norm. Where it is raised is what a fix needs: torch's own frames
(`torch/nn/functional.py`) say nothing, the caller does (diffusers' Wan attention, or ours). So each
distinct warning is kept with the innermost frame outside torch, and `distill.gpu_check` shows them
beside each step's figures.

torch raises some of its warnings once per process (TORCH_WARN_ONCE): one raised before the run, in
another benchmark of the same process, would be missed. The log asks torch to raise each of them
every time while it is open, and Python's "default" action shows each distinct one once (per text
and the line of torch that raised it: the first caller is kept), so a warning in a loop is recorded
once and costs the timed steps little.
"""

from __future__ import annotations

import traceback
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

import torch

# Frames that say nothing of who raised a warning: torch's, the warnings machinery's, this module's.
_SKIPPED = (f"{Path(torch.__file__).parent}/", f"{Path(warnings.__file__)}", f"{Path(__file__)}")


@dataclass
class Raised:
    """One distinct warning: its category, its message's first line and the frame that raised it."""

    category: str
    message: str
    where: str


def raiser(stack: list[traceback.FrameSummary]) -> str:
    """The innermost frame of `stack` outside torch and the warnings machinery, as 'path:line'; a path
    inside a site-packages folder is shown from there (diffusers/models/...)."""
    for frame in reversed(stack):
        if not frame.filename.startswith(_SKIPPED):
            return f"{frame.filename.split('site-packages/')[-1]}:{frame.lineno}"
    return "unknown"


class WarningLog:
    """Records the distinct warnings raised while it is open (`with WarningLog() as log:`)."""

    def __init__(self) -> None:
        self.raised: list[Raised] = []
        self._catch = warnings.catch_warnings()
        self._warn_always = False

    def __enter__(self) -> WarningLog:
        self._catch.__enter__()
        warnings.simplefilter("default")
        warnings.showwarning = self._record
        self._warn_always = torch.is_warn_always_enabled()
        torch.set_warn_always(True)
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        trace: TracebackType | None,
    ) -> None:
        torch.set_warn_always(self._warn_always)
        self._catch.__exit__(kind, error, trace)

    def _record(self, message: Any, category: type[Warning], *_: Any, **__: Any) -> None:
        text = str(message).splitlines()[0] if str(message) else ""
        self.raised.append(Raised(category.__name__, text, raiser(traceback.extract_stack()[:-1])))

    def entries(self) -> list[dict[str, Any]]:
        """Each distinct warning as a dict (category, message, where), in the order raised."""
        return [asdict(raised) for raised in self.raised]


def warning_lines(entries: list[dict[str, Any]]) -> list[str]:
    """The lines the bench prints after its table."""
    if not entries:
        return ["warnings while it ran: none"]
    return [f"warnings while it ran: {len(entries)}"] + [
        f"  {e['category']} at {e['where']}: {e['message'][:160]}" for e in entries
    ]
