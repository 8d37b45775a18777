"""Every failure that involves a signal or a second process, twice each, once on a quiet machine and
once beside a CPU hog: the same exit codes and banners every time, and the checkpoint folder always
resumes. The hog is one busy process: the suite itself keeps the other core busy (pytest -n 2).

`python -m distill.stress --runs N` is the long version of the same runs (its figures are in
TORCHRUN_ERROR_FIXES.md); the suite keeps two of each to stay within its time budget.
"""

from __future__ import annotations

import pytest

from distill import stress

pytestmark = [pytest.mark.slow, pytest.mark.long]

RUNS = 2


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory):
    return stress.prepare(tmp_path_factory.mktemp("stress"))


@pytest.mark.parametrize("name", [*stress.SCENARIOS, stress.CHECKPOINT_KILL])
def test_the_scenario_ends_the_same_way_every_time(workdir, name):
    report: list[str] = []
    failures = stress.stress([name], RUNS, "alternate", workdir, say=report.append, hog_processes=1)
    assert failures == 0, "\n".join(report)
    assert report[-1].startswith(f"{name}: {RUNS} of {RUNS} runs as expected")
