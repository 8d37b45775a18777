"""The suite's warm launches (tests/warm_torchrun.py: the launcher forked from a server that has
imported the trainer) end as the same command started as a process does: exit code, stdout, stderr,
timeout; and their CPU is charged to the test that waited (tests/cpu_report.py)."""

from __future__ import annotations

import subprocess
import sys
import time

import cpu_report
import pytest
import warm_torchrun  # noqa: F401 - its imports (the trainer's) are paid here, not in a measured launch
from conftest import REPO, WARM_TORCHRUN, run_command, start_command

SCRIPT = """import os, sys, time


def main():
    rank = int(os.environ["RANK"])
    print(f"rank {rank} says {os.environ.get('WARM_CHECK')} in {os.getcwd()}")
    print(f"rank {rank} complains", file=sys.stderr)
    warm = sys.modules.get("warm_torchrun")  # imported by the server the launcher was forked from?
    print(f"rank {rank} found the trainer imported: {warm is not None and warm.IMPORTED_IN != os.getppid()}")
    busy = time.process_time() + 0.3
    while time.process_time() < busy:
        pass
    if os.environ.get("WARM_SLEEP"):
        time.sleep(60)
    return int(os.environ.get("WARM_EXIT", "0")) if rank == 1 else 0
"""


def launch(tmp_path, run, **env: str):
    script = tmp_path / "ranks.py"
    script.write_text(SCRIPT)
    command = [*WARM_TORCHRUN, "--standalone", "--nproc_per_node=2", str(script)]
    environment = {
        "PATH": "/usr/bin:/bin",
        "PYTHONPATH": str(REPO),
        "OMP_NUM_THREADS": "1",
        "WARM_CHECK": "hello",
    }
    environment.update(env)
    return run(command, env=environment, cwd=tmp_path, timeout=120)


def test_a_warm_launch_prints_and_exits_as_its_command_line_does(tmp_path):
    before = cpu_report.cpu_seconds()
    warm = launch(tmp_path, run_command)
    charged = cpu_report.cpu_seconds() - before
    assert warm.returncode == 0, warm.stderr
    for rank in (0, 1):
        assert f"rank {rank} says hello in {tmp_path}" in warm.stdout
        assert f"rank {rank} complains" in warm.stderr
        assert f"rank {rank} found the trainer imported: True" in warm.stdout
    assert charged >= 0.6, charged  # both ranks' busy 0.3 s, though neither is this process's child


def test_a_failing_rank_fails_the_warm_launch_as_it_fails_the_process(tmp_path):
    warm = launch(tmp_path, run_command, WARM_EXIT="3")
    cold = launch(
        tmp_path, lambda line, **kw: subprocess.run(line, capture_output=True, text=True, **kw), WARM_EXIT="3"
    )
    assert warm.returncode == cold.returncode == 1, (warm.stderr[-2000:], cold.stderr[-2000:])
    for run in (warm, cold):
        assert "ChildFailedError" in run.stderr and "exitcode  : 3" in run.stderr, run.stderr[-2000:]


def test_a_warm_launch_past_its_timeout_is_killed_and_raises(tmp_path):
    script = tmp_path / "ranks.py"
    script.write_text(SCRIPT)
    command = [*WARM_TORCHRUN, "--standalone", "--nproc_per_node=1", str(script)]
    launch_ = start_command(command, env={"PATH": "/usr/bin:/bin", "WARM_SLEEP": "1"}, cwd=tmp_path)
    started = time.monotonic()
    with pytest.raises(subprocess.TimeoutExpired):
        launch_.communicate(timeout=8)
    assert time.monotonic() - started < 30
    assert launch_.returncode is None


def test_a_command_that_is_no_warm_launch_runs_as_a_process(tmp_path):
    proc = run_command([sys.executable, "-c", "import sys; print('out'); sys.exit(4)"], cwd=REPO, timeout=60)
    assert (proc.returncode, proc.stdout) == (4, "out\n")
