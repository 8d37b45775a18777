"""Every failure that involves a signal or a second process, beside a CPU hog: the same exit codes
and banners every time, and the checkpoint folder always resumes. The hog is one busy process: the
suite itself keeps the other core busy (pytest -n 2).

Four scenarios also run on a quiet machine in test_error_handling.py (a dead DataLoader worker, a
hung rank, an exception and a SIGKILL on one rank) when it runs as a command of its own; `make test`
runs every scenario once, here, beside the hog, the harder of the two conditions, with the checks of
both (-m "not stress_twin"). `python -m distill.stress --runs N` is the long version of the same runs,
quiet and beside the hog (its figures, many runs of each, are in TORCHRUN_ERROR_FIXES.md).
"""

from __future__ import annotations

import pytest

from distill import stress

pytestmark = [pytest.mark.slow, pytest.mark.long]

# (runs, which of them beside the hog)
ALSO_IN_TEST_ERROR_HANDLING = (1, "always")
ONLY_HERE = (1, "always")
RUNS = {
    "dead_worker": ALSO_IN_TEST_ERROR_HANDLING,
    "sigterm_one_rank": ONLY_HERE,
    "kill_one_rank": ALSO_IN_TEST_ERROR_HANDLING,
    "hang_one_rank": ALSO_IN_TEST_ERROR_HANDLING,
    "hang_in_forward": ONLY_HERE,
    "slow_step": ONLY_HERE,
    "exception_one_rank": ALSO_IN_TEST_ERROR_HANDLING,
    stress.CHECKPOINT_KILL: ONLY_HERE,
}


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory):
    return stress.prepare(tmp_path_factory.mktemp("stress"))


@pytest.mark.parametrize("name", [*stress.SCENARIOS, stress.CHECKPOINT_KILL])
def test_the_scenario_ends_the_same_way_every_time(workdir, name):
    runs, hog = RUNS[name]
    report: list[str] = []
    failures = stress.stress([name], runs, hog, workdir, say=report.append, hog_processes=1)
    assert failures == 0, "\n".join(report)
    assert report[-1].startswith(f"{name}: {runs} of {runs} runs as expected")


def test_every_scenario_has_its_runs():
    assert set(RUNS) == {*stress.SCENARIOS, stress.CHECKPOINT_KILL}
