"""`make test` ends with the CPU seconds of each module (tests/cpu_report.py), counted where the
tests ran, the processes they started included, and summed where xdist's reports arrive."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import cpu_report

HERE = Path(__file__).resolve().parent

BUSY = "import time\nend = time.process_time() + 0.6\nwhile time.process_time() < end:\n    pass\n"


def write_session(root: Path) -> None:
    """Three modules: one that computes for 0.6 CPU s itself, one whose child process does, one that
    sleeps 0.6 s; and a conftest that registers the report as ours does."""
    (root / "conftest.py").write_text(
        "import cpu_report\n\n\ndef pytest_configure(config):\n    cpu_report.register(config)\n"
    )
    (root / "test_own.py").write_text(f"def test_busy_here():\n    exec({BUSY!r})\n")
    (root / "test_child.py").write_text(
        f"import subprocess, sys\n\n\ndef test_busy_in_a_child():\n    subprocess.run([sys.executable, '-c', {BUSY!r}], check=True)\n"
    )
    (root / "test_idle.py").write_text("import time\n\n\ndef test_sleeps():\n    time.sleep(0.6)\n")


def test_each_module_is_charged_its_own_and_its_childrens_cpu(tmp_path):
    """Under xdist, as `make test` runs: measured in the workers, summed in the controller."""
    write_session(tmp_path)
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "2", str(tmp_path)],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env={"PYTHONPATH": str(HERE), "PATH": "/usr/bin:/bin"},
        timeout=120,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert re.search(r"CPU seconds by module: \d+ in all", proc.stdout), proc.stdout
    charged = {m[2]: float(m[1]) for m in re.finditer(r"^\s+([\d.]+)  (\S+)$", proc.stdout, re.M)}
    assert set(charged) == {"test_own.py", "test_child.py", "test_idle.py"}, proc.stdout
    assert 0.55 <= charged["test_own.py"] <= 1.0 and 0.55 <= charged["test_child.py"] <= 1.0, charged
    assert charged["test_idle.py"] < 0.3, charged
    # The machine's speed beside it: the reference loop's CPU, and the suite's CPU in that unit.
    speed = re.search(
        r"reference loop: ([\d.]+) CPU s before the tests, ([\d.]+) after .* is (\d+) such loops", proc.stdout
    )
    assert speed, proc.stdout
    assert float(speed[1]) > 0 and float(speed[2]) > 0 and int(speed[3]) > 0, speed[0]


def test_the_speed_line_counts_the_suites_cpu_in_loops_of_the_mean_of_both_ends():
    line = cpu_report.speed_line(2000.0, 0.5, 0.3)
    assert "0.500 CPU s before the tests, 0.300 after" in line and "is 5000 such loops" in line, line
    line = cpu_report.speed_line(2000.0, None, 0.4)
    assert "not measured CPU s before the tests, 0.400 after" in line and "is 5000 such loops" in line, line
