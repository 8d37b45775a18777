"""The CPU seconds each test module costs, printed at the end of `make test`.

On the two-core CI machine the suite keeps both cores busy, so a test's wall time (pytest's
--durations) says as much about what ran beside it as about the test. What the suite's time is made
of is CPU: a module's own, in the pytest worker, and that of every process it started and waited for
(a run's interpreter, torchrun and its ranks). The two cores spend about 2 CPU seconds per second of
the suite, so cutting the suite's time means cutting these numbers.
"""

from __future__ import annotations

import resource
from collections import Counter
from collections.abc import Iterator

import pytest

KEY = "cpu_seconds"  # the report's user property: the phases' CPU seconds, one entry per phase
SHOWN = 15


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


def register(config: pytest.Config) -> None:
    config.pluginmanager.register(CpuReport(), "cpu_report")


class CpuReport:
    """Measures each phase of a test where it runs (a worker under xdist) and sums the phases by
    module where reports arrive (the controller): the measure travels in the report's user
    properties, which xdist sends along."""

    def __init__(self) -> None:
        self.by_module: Counter[str] = Counter()

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
