"""Preemption: SIGTERM, SIGINT or SIGUSR1 asks the run to stop; the loop checkpoints at the next
step boundary, every rank agrees, and the run exits 75 so a scheduler requeues it (`--resume auto`)."""

from __future__ import annotations

import contextlib
import signal
from typing import Any

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)


class StopRequest:
    """Remembers a preemption signal so every rank can stop together at the next step boundary."""

    def __init__(self, hold_on_failure: bool = False) -> None:
        self.signal_name: str | None = None
        self.hold_on_failure = hold_on_failure
        self._previous: dict[int, Any] = {}
        self._held = False

    def __enter__(self) -> StopRequest:
        for sig in STOP_SIGNALS:
            # Outside the main thread signals stay with whoever owns them.
            with contextlib.suppress(ValueError):
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum: int, frame: Any) -> None:
        self.signal_name = signal.Signals(signum).name

    def hold(self) -> None:
        """Ignore these signals from now until the process exits: the stop is already under way.

        Under torchrun, the first rank to exit with 75 makes the agent SIGTERM the ranks still
        finishing the same orderly stop; with the default handler back, those would die of that
        signal instead of exiting 75 themselves. SIG_IGN, not a Python handler: Python resets its
        own handlers to the default while the interpreter shuts down, and ignoring survives that.
        """
        self._held = True
        for sig in self._previous:
            signal.signal(sig, signal.SIG_IGN)

    def __exit__(self, exc_type: type[BaseException] | None, *exc: Any) -> None:
        if self._held:
            return
        if self.hold_on_failure and exc_type is not None and issubclass(exc_type, Exception):
            # A failure is on its way to its banner. Under torchrun, the first rank to exit makes
            # the agent SIGTERM the others at once: a rank that only lost its peer (a secondary
            # failure) would die of that signal, silently, between here and its own report.
            # torchrun's SIGKILL after --shutdown-timeout still ends a rank that never gets there.
            self.hold()
            return
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
