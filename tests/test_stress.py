"""Every failure that involves a signal or a second process: the same exit codes and banners every
time, and the checkpoint folder always resumes.

`make test` runs every scenario once, here, on a machine the suite keeps busy (pytest -n 3 on two
cores: the other workers' tests take the cores this scenario's two ranks and its launcher share). The
four scenarios test_error_handling.py also runs as a command of its own (a dead DataLoader worker, a
hung rank, an exception and a SIGKILL on one rank) run here only, with the checks of both
(-m "not stress_twin"). `python -m distill.stress --runs N` is the long version: many runs of each,
every other one beside a CPU hog on every core (its figures are in TORCHRUN_ERROR_FIXES.md). The
suite adds no hog of its own: the suite's own load makes the machine busy, and a hog beside it cost
about a tenth of the suite's CPU time (142 of some 1500 CPU seconds, measured 11-28).
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
from conftest import WARM_PYTHON, WARM_TORCHRUN, run_command

from distill import stress

pytestmark = [pytest.mark.slow, pytest.mark.long]
# The warm-up run and every resume: what they check is what the checkpoint folder holds, not how a run
# starts (the failing runs launch as users do).
WARM = stress.Launcher(WARM_TORCHRUN, run_command, WARM_PYTHON)


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory):
    return stress.prepare(tmp_path_factory.mktemp("stress"), WARM)


@pytest.mark.parametrize("name", [*stress.SCENARIOS, stress.CHECKPOINT_KILL])
def test_the_scenario_ends_the_same_way_every_time(workdir, name):
    report: list[str] = []
    failures = stress.stress([name], 1, "never", workdir, say=report.append, resume_launcher=WARM)
    assert failures == 0, "\n".join(report)
    assert report[-1].startswith(f"{name}: 1 of 1 runs as expected")


def hog_processes() -> list[int]:
    """This process's children that are the hog's busy loop (read from /proc)."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            status = (entry / "status").read_text()
            command = (entry / "cmdline").read_bytes()
        except (OSError, ValueError):
            continue
        if f"PPid:\t{os.getpid()}\n" in status and b"while True: pass" in command:
            found.append(int(entry.name))
    return found


def test_the_long_versions_hog_busies_every_core_and_leaves_nothing_behind():
    """`python -m distill.stress --hog always|alternate` (the suite runs none): one busy process per
    core while a run lasts, none after it."""
    cores = os.cpu_count() or 2
    with stress.cpu_hog():
        # A child shows the hog's command line only once it has exec'd, which on a busy machine can come
        # well after Popen returned: wait for it rather than read /proc once.
        deadline = time.monotonic() + 60
        while len(hog_processes()) < cores and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(hog_processes()) == cores
    assert hog_processes() == []
