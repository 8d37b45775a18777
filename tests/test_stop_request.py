"""The training loop's signal handling (distill/train/stop.py), in a process of its own.

Under torchrun the agent SIGTERMs every rank as soon as one exits. A rank whose loop just failed
because it lost that peer must still print its own (secondary) banner, so after a failure the
loop keeps SIGTERM from killing it; outside torchrun, and after a loop that ended normally, the
previous handlers come back.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

from conftest import REPO

# The loop fails, then a SIGTERM arrives before the failure is reported (as torchrun's does when
# a peer's exit reaches the agent first); the process then reports and exits 3.
FAIL_THEN_SIGTERM = textwrap.dedent(
    """
    import os, signal, sys, time
    from distill.train.stop import StopRequest

    try:
        with StopRequest(hold_on_failure={hold}):
            raise RuntimeError("Connection closed by peer")
    except RuntimeError:
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.2)
        print("reported the failure", flush=True)
        sys.exit(3)
    """
)


def run_child(source: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", source], cwd=REPO, capture_output=True, text=True, timeout=60
    )


def test_a_failed_loop_under_torchrun_reports_despite_the_agents_sigterm():
    proc = run_child(FAIL_THEN_SIGTERM.format(hold=True))
    assert proc.returncode == 3, proc.stderr
    assert "reported the failure" in proc.stdout


def test_outside_torchrun_a_sigterm_after_the_loop_still_ends_the_process():
    proc = run_child(FAIL_THEN_SIGTERM.format(hold=False))
    assert proc.returncode == -15, (proc.returncode, proc.stdout, proc.stderr)
    assert "reported the failure" not in proc.stdout


def test_a_loop_that_ends_normally_gives_the_handlers_back():
    source = textwrap.dedent(
        """
        import signal
        from distill.train.stop import StopRequest

        before = signal.getsignal(signal.SIGTERM)
        with StopRequest(hold_on_failure=True) as stop:
            signal.raise_signal(signal.SIGTERM)
        assert stop.signal_name == "SIGTERM", stop.signal_name
        assert signal.getsignal(signal.SIGTERM) is before
        print("restored", flush=True)
        """
    )
    proc = run_child(source)
    assert proc.returncode == 0 and "restored" in proc.stdout, proc.stderr
