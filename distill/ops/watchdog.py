"""Stall watchdog: a rank that stops making progress ends the run loudly instead of waiting silently.

A stuck collective or a stuck DataLoader otherwise sits until --dist_timeout (60 minutes by
default) and then dies with a message that says nothing about where it was. Here a background
thread on every rank watches for progress. When none has come for --stall_timeout minutes, it
prints the stack of every thread (faulthandler), then the usual banner naming the stage and step,
writes it to torchrun's error file and ends the process with exit code 11.

What counts as progress, so that one legitimately slow step (minutes per step at real scale) is
never taken for a hang:
- `beat(stage, step)`: the training loop, at the start of each step and of each micro-batch; it
  also records the stage and step the banner names, and arms the watch;
- `progress()`: every forward of a watched model and of each of its transformer blocks, and every
  backward through such a block (`watch_forwards`, hooks registered once per model). It only
  stores the time: no lock, nothing else, so it costs nothing next to a block's compute.
A rank stuck outright, or waiting in a collective for a rank that is, calls neither, and is
reported as before.

Long pieces of work that are not steps (sample rounds, evaluations, checkpoint saves) call
`pause()` first; the next `beat` re-arms the watch (their forwards signal progress, which counts
only while armed). Setup, teacher loading and cache building are not watched: their collectives
are bounded by --dist_timeout.

As a backstop for a main thread that never releases the GIL (so no Python thread can run),
faulthandler's own C-level timer dumps the stacks and exits (code 1) 30 to 60 seconds after the
watchdog should have fired; the watch thread keeps pushing that timer on while progress comes.
"""

from __future__ import annotations

import faulthandler
import os
import sys
import threading
import time
import traceback
import weakref
from collections.abc import Callable
from typing import Any

from distill.ops.errors import DistillError, Stage, current_rank, report

BACKSTOP_GRACE_S = 60.0


def _stage_name(stage: Stage | str) -> str:
    return stage.name.lower().replace("_", " ") if isinstance(stage, Stage) else str(stage)


def _duration(seconds: float) -> str:
    return f"{seconds / 60:g} min" if seconds >= 60 else f"{seconds:g} s"


def _stderr_fd() -> int | None:
    try:
        return sys.stderr.fileno()
    except (AttributeError, OSError, ValueError):
        return None  # replaced by a non-file object (a test capturing output)


def dump_all_stacks() -> None:
    """Every thread's Python stack on stderr: faulthandler when stderr is a real file, else traceback."""
    sys.stderr.flush()
    if _stderr_fd() is not None:
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        return
    names = {thread.ident: thread.name for thread in threading.enumerate()}
    for ident, frame in sys._current_frames().items():
        print(f"Thread {names.get(ident, ident)} (most recent call last):", file=sys.stderr)
        print("".join(traceback.format_stack(frame)), file=sys.stderr)


def main_thread_location() -> str:
    """Where the main thread is now: its innermost frame, and the innermost one in this project."""
    frame = sys._current_frames().get(threading.main_thread().ident)
    if frame is None:
        return "unknown"
    stack = traceback.extract_stack(frame)
    innermost = stack[-1]
    ours = next((f for f in reversed(stack) if f"{os.sep}distill{os.sep}" in f.filename), None)
    text = f"{innermost.filename}:{innermost.lineno} in {innermost.name}"
    if ours is not None and ours is not innermost:
        text += f"\n  called from {ours.filename}:{ours.lineno} in {ours.name}"
    return text


# Where a rank that only waits for its peers sits: collectives, DDP's hooks, autograd running them.
COLLECTIVE_PATHS = tuple(
    os.path.join("torch", *parts) for parts in (("distributed",), ("nn", "parallel"), ("autograd",))
)


def stall_error(stage: Stage | str, step: int | None, timeout_s: float, location: str) -> DistillError:
    where = _stage_name(stage) + (f", step {step}" if step is not None else "")
    innermost = location.splitlines()[0]
    verdict = (
        "It waits inside a collective (torch.distributed / DDP / autograd): most likely for another rank."
        if any(path in innermost for path in COLLECTIVE_PATHS)
        else "It is NOT inside a collective: this rank is probably the one that stalled."
    )
    return DistillError(
        f"no progress for {_duration(timeout_s)} during {where} (stall watchdog)",
        f"This rank's main thread is at:\n  {location}\n{verdict}\n"
        "The stack of every thread of this rank is printed above this banner.",
        causes=[
            "another rank failed or hangs, and this rank waits for it inside a collective (its stack "
            "shows torch.distributed, DDP or autograd)",
            "a DataLoader worker that hangs, e.g. on a stuck network file system",
            "ranks that called different collectives (a rank skipped or repeated a step)",
            "one forward or backward of a transformer block, or one wait for slower ranks, that really "
            "takes longer than --stall_timeout (a slow step is not a stall: its forwards are progress)",
        ],
        fixes=[
            "compare the stacks every rank printed: the rank whose main thread is NOT inside a collective "
            "is the one that stalled; the others wait for it",
            "if one block's forward or backward legitimately takes this long, raise --stall_timeout "
            "(0 turns the watchdog off)",
            "--debug_distributed adds the NCCL / torch.distributed logs of the collectives",
            "rerun with --resume auto to continue from the last checkpoint",
        ],
        stage=Stage.STALLED,
    )


def _exit_stalled() -> None:
    os._exit(int(Stage.STALLED))  # the main thread is stuck: only leaving the process ends it


class StallWatchdog:
    """Fires `on_stall` when armed (by a `beat`) and neither a beat nor a `progress` signal came for
    `timeout_s` seconds."""

    def __init__(
        self,
        timeout_s: float,
        on_stall: Callable[[], None] = _exit_stalled,
        backstop: bool = True,
    ) -> None:
        self.timeout_s = timeout_s
        self.on_stall = on_stall
        self.backstop = backstop and _stderr_fd() is not None
        self._lock = threading.Lock()
        self._last: float | None = None  # the last beat; None: paused
        # The last progress signal. Written without the lock (one float store from hooks); it counts
        # only while armed, and only when it is later than the beat that armed the watch.
        self._progress = 0.0
        self._backstop_deadline: float | None = None  # when faulthandler's timer fires, if armed
        self._where: tuple[Stage | str, int | None] = (Stage.TRAINING, None)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="stall-watchdog", daemon=True)
        self.fired = False

    def start(self) -> StallWatchdog:
        self._thread.start()
        return self

    def stop(self) -> None:
        self.pause()
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join()
        self._disarm_backstop()

    def beat(self, stage: Stage | str, step: int | None = None) -> None:
        """Progress at a known place: the clock starts again (and the watch is armed if it was paused)."""
        now = time.monotonic()
        with self._lock:
            self._last, self._where = now, (stage, step)

    def progress(self) -> None:
        """Progress inside a step (a forward or backward): the clock starts again. Arms nothing."""
        self._progress = time.monotonic()

    def _last_progress(self) -> float | None:
        """The latest beat or progress signal while armed; None while paused."""
        with self._lock:
            last = self._last
        return None if last is None else max(last, self._progress)

    def pause(self) -> None:
        """Stop watching until the next beat (for work that is allowed to take long).

        Cheap, since the loop pauses after every step: the watch thread disarms the backstop.
        """
        with self._lock:
            self._last = None

    def _disarm_backstop(self) -> None:
        with self._lock:
            if self._backstop_deadline is not None and self._last is None:
                faulthandler.cancel_dump_traceback_later()
                self._backstop_deadline = None

    def _push_backstop(self, last: float) -> None:
        """Keep faulthandler's timer BACKSTOP_GRACE_S after the watchdog's own deadline.

        Re-arming restarts faulthandler's timer thread (~0.1 ms): done when the deadline has moved on
        by half the grace, so the timer fires 30 to 60 s after the watchdog should have.
        """
        deadline = last + self.timeout_s + BACKSTOP_GRACE_S
        armed = self._backstop_deadline
        if self.backstop and (armed is None or deadline - armed > BACKSTOP_GRACE_S / 2):
            faulthandler.dump_traceback_later(
                max(deadline - time.monotonic(), 1.0), exit=True, file=sys.stderr
            )
            self._backstop_deadline = deadline

    def _watch(self) -> None:
        poll = min(max(self.timeout_s / 10, 0.05), 5.0)
        while not self._stop.wait(poll):
            last = self._last_progress()
            if last is None:
                self._disarm_backstop()
                continue
            self._push_backstop(last)
            if time.monotonic() - last < self.timeout_s:
                continue
            with self._lock:
                if self._last is None:  # paused meanwhile: a failure on its way to its own banner
                    continue
                stage, step = self._where
                self.fired = True
            rank = current_rank()
            print(
                f"{f'[Rank {rank}] ' if rank is not None else ''}stall watchdog: no progress for "
                f"{_duration(self.timeout_s)}; the stacks of every thread follow",
                file=sys.stderr,
                flush=True,
            )
            dump_all_stacks()
            report(stall_error(stage, step, self.timeout_s, main_thread_location()))
            self.on_stall()
            return


_active: StallWatchdog | None = None


def start(timeout_minutes: float) -> StallWatchdog | None:
    """Start this process's watchdog (0 minutes: none). It watches only once the loop beats."""
    global _active
    stop()
    if timeout_minutes > 0:
        _active = StallWatchdog(timeout_minutes * 60).start()
    return _active


def beat(stage: Stage | str, step: int | None = None) -> None:
    """The training loop's heartbeat; does nothing when no watchdog runs (tests, tools)."""
    if _active is not None:
        _active.beat(stage, step)


def progress() -> None:
    """Progress inside a step (called by the hooks of `watch_forwards`); nothing without a watchdog."""
    watchdog = _active
    if watchdog is not None:
        watchdog.progress()


def pause() -> None:
    if _active is not None:
        _active.pause()


def stop() -> None:
    global _active
    if _active is not None:
        _active.stop()
        _active = None


# ---------------------------------------------------------------------------------------------
# Progress from inside a step: hooks on the models' forwards
# ---------------------------------------------------------------------------------------------

_watched: weakref.WeakSet = weakref.WeakSet()  # modules that already signal progress


def forward_units(*models: Any) -> list[Any]:
    """Each model and each transformer block inside it (a module's `blocks` list: Wan's layers),
    found through wrappers (an expert view, a pair of expert copies), each module once."""
    from torch import nn

    units: dict[int, Any] = {}
    for model in models:
        units.setdefault(id(model), model)
        for module in model.modules():
            blocks = getattr(module, "blocks", None)
            if isinstance(blocks, nn.ModuleList):
                units.setdefault(id(module), module)
                for block in blocks:
                    units.setdefault(id(block), block)
    return list(units.values())


def watch_forwards(*models: Any) -> None:
    """Signal progress at every forward of `models` and of their blocks, and every backward through a
    block (a hook on its output's gradient), so the longest stretch without a signal is one block's
    forward or backward (or a wait in a collective). Registered once per module; the hooks stay for
    the life of the model and cost one clock read each."""
    import torch

    @torch.compiler.disable  # a clock read is no part of a compiled graph
    def before_forward(_module: Any, _args: Any) -> None:
        progress()

    @torch.compiler.disable
    def after_forward(_module: Any, _args: Any, output: Any) -> None:
        progress()
        first = output[0] if isinstance(output, (tuple, list)) and output else output
        if isinstance(first, torch.Tensor) and first.requires_grad:
            # Fires when backward reaches this module's output, i.e. as backward enters the module.
            first.register_hook(_progress_in_backward)

    for module in forward_units(*models):
        if module in _watched:
            continue
        module.register_forward_pre_hook(before_forward)
        module.register_forward_hook(after_forward)
        _watched.add(module)


def _progress_in_backward(grad: Any) -> None:
    progress()
