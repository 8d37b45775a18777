"""Rehearse failures on purpose: `DISTILL_INJECT_FAULT=KIND:STEP[@RANK]` (comma-separated for several).

KIND is one of exception, oom, nan, sigterm, kill, hang, worker_abort, slow, hang_forward. At
optimizer step STEP (counted from 1, on RANK only if given) the trainer raises, runs out of memory,
produces a non-finite loss, gets SIGTERM, is SIGKILLed, stops making progress before the step's
first forward (for the stall watchdog), or has its DataLoader worker processes die of SIGABRT,
exactly as a real failure would look. Two act inside the models' forwards (hooks on each model and
transformer block the loop watches, `FaultInjector.attach`):
- slow: every forward from step STEP's start until the next step's sleeps SLOW_FORWARD_S, as a
  legitimately slow step does its work in many pieces: the step outlasts a short --stall_timeout
  while the gaps between forwards stay short;
- hang_forward: the third forward of step STEP never returns (a rank stuck in the middle of a step,
  after its first forwards have signalled progress).
Faults fire only in torchrun's first attempt, so a restarted run recovers. Unset, it does nothing.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import time
from dataclasses import dataclass
from typing import Any

from distill.ops.errors import DistillError, Stage

ENV = "DISTILL_INJECT_FAULT"
KINDS = ("exception", "oom", "nan", "sigterm", "kill", "hang", "worker_abort", "slow", "hang_forward")
IN_FORWARD = ("slow", "hang_forward")  # kinds that act inside the models' forwards
SLOW_FORWARD_S = 1.0  # what a `slow` fault adds to each forward of a model or transformer block
HANG_AT_FORWARD = 3  # the forward of its step (counted from 1) in which a `hang_forward` fault hangs


class InjectedFault(RuntimeError):
    """Raised by an injected `exception` fault."""


@dataclass(frozen=True)
class Fault:
    kind: str
    step: int
    rank: int | None


def parse_faults(text: str | None) -> list[Fault]:
    faults = []
    for item in filter(None, (part.strip() for part in (text or "").split(","))):
        try:
            kind, rest = item.split(":", 1)
            step_text, _, rank_text = rest.partition("@")
            fault = Fault(kind.strip(), int(step_text), int(rank_text) if rank_text else None)
        except ValueError:
            fault = None
        if fault is None or fault.kind not in KINDS or fault.step < 1:
            raise DistillError(
                f"{ENV}={text!r} is not understood",
                f"each entry is KIND:STEP or KIND:STEP@RANK with KIND in {', '.join(KINDS)} and STEP >= 1",
                fixes=[f"e.g. {ENV}=exception:5 or {ENV}=kill:3@1, or unset {ENV}"],
                stage=Stage.CONFIG,
            )
        faults.append(fault)
    return faults


class FaultInjector:
    """Fires the faults configured in the environment for this rank."""

    def __init__(self, rank: int = 0) -> None:
        self.faults = [f for f in parse_faults(os.environ.get(ENV)) if f.rank in (None, rank)]
        # Faults fire in the first attempt only, so `torchrun --max-restarts` can be seen to recover.
        if int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0:
            self.faults = []
        self.rank = rank
        self.step = 0  # the step in progress (the last one started)
        self.forwards = 0  # forwards of watched modules since that step started

    def attach(self, *models: Any) -> None:
        """Hooks for the faults that act inside forwards, on each model and transformer block of `models`
        (the units the stall watchdog hears progress from). Nothing is registered without such a fault."""
        if not any(f.kind in IN_FORWARD for f in self.faults):
            return
        from distill.ops.watchdog import forward_units

        for module in forward_units(*models):
            module.register_forward_pre_hook(self._in_forward)

    def _in_forward(self, _module: Any, _args: Any) -> None:
        self.forwards += 1
        for fault in self.faults:
            if fault.step != self.step:
                continue
            if fault.kind == "slow":
                time.sleep(SLOW_FORWARD_S)
            if fault.kind == "hang_forward" and self.forwards == HANG_AT_FORWARD:
                while True:  # stuck in the middle of a step, after its first progress signals
                    time.sleep(60)

    def wants_nan(self, step: int) -> bool:
        return any(f.kind == "nan" and f.step == step for f in self.faults)

    def before_step(self, step: int) -> None:
        """Called at the start of optimizer step `step` (1-based)."""
        self.step, self.forwards = step, 0
        for fault in self.faults:
            if fault.step != step:
                continue
            if fault.kind == "exception":
                raise InjectedFault(f"injected exception at step {step} on rank {self.rank} ({ENV})")
            if fault.kind == "oom":
                raise torch_oom(f"injected out-of-memory at step {step} on rank {self.rank} ({ENV})")
            if fault.kind == "sigterm":
                os.kill(os.getpid(), signal.SIGTERM)
            if fault.kind == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            if fault.kind == "hang":
                while True:  # no progress, no exit: what a stuck collective or read looks like
                    time.sleep(60)
            if fault.kind == "worker_abort":
                abort_dataloader_workers(step, self.rank)


def abort_dataloader_workers(step: int, rank: int) -> None:
    """SIGABRT to this process's DataLoader workers: each dies as if it had called abort()."""
    workers = multiprocessing.active_children()
    if not workers:
        raise DistillError(
            f"{ENV}=worker_abort:{step} needs DataLoader worker processes, but rank {rank} has none",
            fixes=["add --num_workers 1 (or more) to the command"],
            stage=Stage.CONFIG,
        )
    for worker in workers:
        os.kill(worker.pid, signal.SIGABRT)


def torch_oom(message: str) -> Exception:
    import torch

    return torch.OutOfMemoryError(message)
