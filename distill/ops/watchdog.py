"""Stall watchdog: a rank that stops making progress ends the run loudly instead of waiting silently.

A stuck collective or a stuck DataLoader otherwise sits until --dist_timeout (60 minutes by
default) and then dies with a message that says nothing about where it was. Here a background
thread on every rank watches the heartbeat the training loop gives at the start of each step
(`beat(stage, step)`). When no beat has come for --stall_timeout minutes, it prints the stack of
every thread (faulthandler), then the usual banner naming the stage and step, writes it to
torchrun's error file and ends the process with exit code 11.

Long pieces of work that are not steps (sample rounds, evaluations, checkpoint saves) call
`pause()` first; the next `beat` re-arms the watch. Setup, teacher loading and cache building are
not watched: their collectives are bounded by --dist_timeout.

As a backstop for a main thread that never releases the GIL (so no Python thread can run),
faulthandler's own C-level timer dumps the stacks and exits (code 1) 30 to 60 seconds after the
watchdog should have fired.
"""

from __future__ import annotations

import faulthandler
import os
import sys
import threading
import time
import traceback
from collections.abc import Callable

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
            "one optimizer step that really takes longer than --stall_timeout",
        ],
        fixes=[
            "compare the stacks every rank printed: the rank whose main thread is NOT inside a collective "
            "is the one that stalled; the others wait for it",
            "if a step legitimately takes this long, raise --stall_timeout (0 turns the watchdog off)",
            "--debug_distributed adds the NCCL / torch.distributed logs of the collectives",
            "rerun with --resume auto to continue from the last checkpoint",
        ],
        stage=Stage.STALLED,
    )


def _exit_stalled() -> None:
    os._exit(int(Stage.STALLED))  # the main thread is stuck: only leaving the process ends it


class StallWatchdog:
    """Fires `on_stall` when armed and no `beat` came for `timeout_s` seconds."""

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
        self._last: float | None = None  # None: paused
        self._backstop_armed: float | None = None
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
        """Progress: the clock starts again (and the watch is armed if it was paused)."""
        now = time.monotonic()
        with self._lock:
            self._last, self._where = now, (stage, step)
            # Re-arming restarts faulthandler's timer thread (~0.1 ms): at most every half grace.
            armed = self._backstop_armed
            if self.backstop and (armed is None or now - armed > BACKSTOP_GRACE_S / 2):
                faulthandler.dump_traceback_later(
                    self.timeout_s + BACKSTOP_GRACE_S, exit=True, file=sys.stderr
                )
                self._backstop_armed = now

    def pause(self) -> None:
        """Stop watching until the next beat (for work that is allowed to take long).

        Cheap, since the loop pauses after every step: the watch thread disarms the backstop.
        """
        with self._lock:
            self._last = None

    def _disarm_backstop(self) -> None:
        with self._lock:
            if self._backstop_armed is not None and self._last is None:
                faulthandler.cancel_dump_traceback_later()
                self._backstop_armed = None

    def _watch(self) -> None:
        poll = min(max(self.timeout_s / 10, 0.05), 5.0)
        while not self._stop.wait(poll):
            with self._lock:
                last, (stage, step) = self._last, self._where
            if last is None:
                self._disarm_backstop()
                continue
            if time.monotonic() - last < self.timeout_s:
                continue
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


def pause() -> None:
    if _active is not None:
        _active.pause()


def stop() -> None:
    global _active
    if _active is not None:
        _active.stop()
        _active = None
