"""This rank's DataLoader worker processes: which ones died, and keeping their death out of the way.

A worker that dies can surface in the training process in several ways, depending on timing:
torch's SIGCHLD handler raises "DataLoader worker (pid N) is killed by signal" wherever the main
thread happens to be (inside an import of the failure report, inside `Thread.join` during
teardown), the next batch read fails with "exited unexpectedly", or, when the worker died while
handing over a batch's shared-memory file descriptor, the read fails first with a bare
`ConnectionResetError` / `EOFError` that looks like a lost peer.

So while a tracked loader runs, torch's SIGCHLD handler is set aside (`track`): nothing is raised
asynchronously, and a dead worker is found where the loop waits for it (torch's own liveness check
of its workers every few seconds, or the broken hand-over) and by the failure report, which asks
the processes themselves (`dead_workers`) before it reads any exception text.
"""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

# The iterators of the loaders this process runs, kept alive until `shutdown` so that a failure
# report can still look at their worker processes.
_tracked: list[Any] = []
_silenced: Any = None  # the SIGCHLD handler that was in place before `silence_worker_signals`


@dataclass(frozen=True)
class DeadWorker:
    pid: int
    exitcode: int

    def describe(self) -> str:
        if self.exitcode < 0:
            number = -self.exitcode
            try:
                name = signal.Signals(number).name
            except ValueError:
                name = f"signal {number}"
            words = signal.strsignal(number) or name
            return f"DataLoader worker (pid {self.pid}) was killed by {name} ({words})"
        return f"DataLoader worker (pid {self.pid}) exited with code {self.exitcode}"


def track(iterator: Iterator) -> Iterator:
    """Remember `iterator`'s worker processes (an iterator without workers is ignored) and set
    torch's SIGCHLD handler aside until they are stopped (see the module docstring)."""
    if getattr(iterator, "_workers", None):
        _tracked.append(iterator)
        silence_worker_signals()
    return iterator


def _processes() -> list[Any]:
    return [worker for iterator in _tracked for worker in getattr(iterator, "_workers", [])]


def dead_workers(wait_s: float = 0.0) -> list[DeadWorker]:
    """Tracked workers that have exited, waiting up to `wait_s` for one to be seen exiting.

    The wait covers the moment between a worker closing its sockets (what the training process
    notices first) and the kernel reporting its exit.
    """
    processes = _processes()
    deadline = time.monotonic() + (wait_s if processes else 0.0)
    while True:
        dead = [
            DeadWorker(worker.pid, worker.exitcode)
            for worker in processes
            # exitcode polls the process; torch's own liveness checks read the same Process object
            if worker.exitcode is not None
        ]
        if dead or time.monotonic() >= deadline:
            return dead
        time.sleep(0.05)


def silence_worker_signals() -> None:
    """From now on a worker's exit raises nothing in the main thread."""
    global _silenced
    if _silenced is None and threading.current_thread() is threading.main_thread():
        _silenced = signal.signal(signal.SIGCHLD, signal.SIG_DFL)


def restore_worker_signals() -> None:
    """Give torch its SIGCHLD handler back (after `shutdown`, so no dead worker is left to raise)."""
    global _silenced
    if _silenced is not None and threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGCHLD, _silenced)
        _silenced = None


def _stop(iterator: Iterator) -> None:
    stop = getattr(iterator, "_shutdown_workers", None)
    if stop is not None:
        stop()


def shutdown() -> None:
    """Stop every tracked loader's workers, forget them, and give torch its handler back."""
    while _tracked:
        _stop(_tracked.pop())
    restore_worker_signals()


def release(iterator: Iterator) -> None:
    """Stop one loader's workers (the loop is done with it)."""
    if iterator in _tracked:
        _tracked.remove(iterator)
    _stop(iterator)
    if not _tracked:
        restore_worker_signals()
