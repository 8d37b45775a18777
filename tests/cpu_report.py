"""The CPU seconds each test module costs, printed at the end of `make test`.

On the two-core CI machine the suite keeps both cores busy, so a test's wall time (pytest's
--durations) says as much about what ran beside it as about the test. What the suite's time is made
of is CPU: a module's own, in the pytest worker, and that of every process it started and waited for
(a run's interpreter, torchrun and its ranks). The two cores spend about 2 CPU seconds per second of
the suite, so cutting the suite's time means cutting these numbers.
"""

from __future__ import annotations

import resource
import time
from collections import Counter
from collections.abc import Iterator

import pytest

KEY = "cpu_seconds"  # the report's user property: the phases' CPU seconds, one entry per phase
SHOWN = 15
# The machine's own speed, measured before and after the suite: nearly the same code cost 1,225 CPU s
# one day and 2,391 another on this CI machine, so a suite's CPU means little without it. The
# reference is interpreted Python (a loop of small float operations), the kind of work the tiny
# models' many small kernels and the libraries' imports make of much of the suite. Best of a few
# tries: a try that shares its core with something else is slower, never faster. Its speed moves
# within one run too (0.55 and 0.40 s after two runs of nearly the same tree an hour apart): the two ends show
# by how much, and the suite's CPU in loops is a rough unit only.
REFERENCE_LOOPS = 5_000_000
REFERENCE_TRIES = 3


# CPU seconds of processes a test waited for that were not its children (tests/warm_torchrun.py's
# launches, forked from a server): charged to the test that waited, as its children's are.
_charged = 0.0


def charge(seconds: float) -> None:
    """Count `seconds` of a process this one waited for but did not start (see _charged)."""
    global _charged
    _charged += seconds


def cpu_seconds() -> float:
    """This process's CPU time (user + system), that of its children that have ended, and what was
    charged to it."""
    own = resource.getrusage(resource.RUSAGE_SELF)
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime + _charged


def reference_seconds() -> float:
    """CPU seconds of the reference workload on this machine (the best of REFERENCE_TRIES)."""
    best = float("inf")
    for _ in range(REFERENCE_TRIES):
        start = time.process_time()
        total = 0.0
        for i in range(REFERENCE_LOOPS):
            total += (i % 7) * 0.5
        best = min(best, time.process_time() - start)
    return best


def speed_line(total: float, at_start: float | None, at_end: float) -> str:
    """The report's last line: the reference loop's CPU seconds at both ends of the run (the start is
    missing where the session did not measure it) and `total` CPU seconds in loops of their mean."""
    before = f"{at_start:.3f}" if at_start is not None else "not measured"
    reference = (at_start + at_end) / 2 if at_start is not None else at_end
    return (
        f"this machine's reference loop: {before} CPU s before the tests, {at_end:.3f} after "
        f"(lower is faster); the CPU above is {total / reference:.0f} such loops, a rough unit"
    )


def register(config: pytest.Config) -> None:
    config.pluginmanager.register(CpuReport(), "cpu_report")


class CpuReport:
    """Measures each phase of a test where it runs (a worker under xdist) and sums the phases by
    module where reports arrive (the controller): the measure travels in the report's user
    properties, which xdist sends along."""

    def __init__(self) -> None:
        self.by_module: Counter[str] = Counter()
        self.reference_at_start: float | None = None

    def pytest_sessionstart(self, session: pytest.Session) -> None:
        if not hasattr(session.config, "workerinput"):  # the controller (or the one process), not a worker
            self.reference_at_start = reference_seconds()

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_setup(self, item: pytest.Item) -> Iterator[None]:
        yield from self._measured(item)

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_call(self, item: pytest.Item) -> Iterator[None]:
        yield from self._measured(item)

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_teardown(self, item: pytest.Item) -> Iterator[None]:
        yield from self._measured(item)

    @staticmethod
    def _measured(item: pytest.Item) -> Iterator[None]:
        start = cpu_seconds()
        yield
        item.user_properties.append((KEY, cpu_seconds() - start))

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        # The item's user properties accumulate over its phases: the teardown's report holds all three.
        if report.when == "teardown":
            module = report.nodeid.split("::", 1)[0]
            self.by_module[module] += sum(value for key, value in report.user_properties if key == KEY)

    def pytest_terminal_summary(self, terminalreporter: pytest.TerminalReporter) -> None:
        if not self.by_module:
            return
        total = sum(self.by_module.values())
        terminalreporter.write_sep(
            "=", f"CPU seconds by module: {total:.0f} in all (own + started processes)"
        )
        for module, seconds in self.by_module.most_common(SHOWN):
            terminalreporter.write_line(f"{seconds:8.1f}  {module}")
        terminalreporter.write_line(speed_line(total, self.reference_at_start, reference_seconds()))
