"""torchrun for the suite's multi-rank runs that check what training computes, with its ranks forked
from a process that has already imported the trainer.

    python tests/warm_torchrun.py --standalone --nproc_per_node=2 SCRIPT ARGS...

The launcher is torch.distributed.run itself (its arguments, rendezvous, agent and failure summary);
only the way a rank starts differs. A rank of the real torchrun is a new interpreter that imports
torch, diffusers, peft and transformers again before its first step: about 7 CPU seconds a rank, most
of what a tiny two-rank run costs and, over the suite's launches, minutes of a suite that runs on two
cores. Here the imports happen once, in this process; each rank is forked from it (torchrun's
`--run-path --start-method fork`) and calls the script's `main()` with sys.argv set as the script
would see it (SCRIPT: train_distillation.py or one of tests/*_check.py).

The suite does not even pay those imports once per launch: `run` (and `start`, for launches that run
side by side) forks the launcher itself from one server per pytest worker that imported them when the
worker first launched (multiprocessing's forkserver, a clean process started for it, not a fork of
the worker and its threads). The command line above stays for running a check by hand.

The runs that check failures (distill/stress.py, test_error_handling.py, tests/test_resilience.py)
keep the real torchrun: what they hold is what a user's own launch prints, exit codes and signals
included.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.forkserver
import os
import resource
import runpy
import shutil
import signal
import subprocess
import sys
import tempfile
import traceback
from collections.abc import Mapping, Sequence
from pathlib import Path

# What a rank imports at its start (torch, diffusers, peft, transformers), once, before the ranks are
# forked; and what it imports only when it gets there: the VAE and the pipelines (the caches, the
# samples) and matplotlib (loss.png, at every run's end). Left to each launch, those last were 2% of
# the suite's CPU (a profile of `make test`: 1.3% matplotlib, 0.8% the VAE and the pipelines).
from diffusers import AutoencoderKLWan, WanImageToVideoPipeline, WanPipeline  # noqa: F401
from torch.distributed import run as torchrun

import distill.train.diagnose  # noqa: F401
import distill.train.trainer  # noqa: F401
import train_distillation  # noqa: F401
from distill.sample.media import pyplot

pyplot()  # matplotlib with the backend the trainer sets

HERE = Path(__file__).resolve()
# The process that imported this module: the launches' server, when the imports above were paid once.
IMPORTED_IN = os.getpid()
# The command line of a warm launch: `run` recognises it and forks it instead of starting it.
COMMAND = (sys.executable, str(HERE))
# A single process run warm: `python tests/warm_torchrun.py --python SCRIPT ARGS...` runs SCRIPT as
# `python SCRIPT ARGS...` would, after the imports (for runs that check what a run computes or
# leaves, not how a process starts).
PYTHON = "--python"


def rank_main(script: str, *args: str) -> None:
    """One rank: the script's main(), its exit code raised as SystemExit when it is not 0. A rank must
    return rather than leave through os._exit (as train_distillation.py's own `__main__` does under
    torchrun): the agent of function ranks counts a rank as done when its return value arrives."""
    sys.argv = [script, *args]
    namespace = runpy.run_path(script, run_name="__rank__")  # defines; its __main__ block does not run
    code = namespace["main"]()
    if code:
        raise SystemExit(code)


def main(argv: list[str]) -> None:
    if argv[:1] == [PYTHON]:
        sys.argv = argv[1:]
        runpy.run_path(argv[1], run_name="__main__")
        return
    # torchrun's --run-path calls this module's run_script_path(script, *args) in each rank
    torchrun.run_script_path = rank_main
    torchrun.main(["--run-path", "--start-method", "fork", *argv])


# ---------------------------------------------------------------------------------------------
# The suite's launches: forked from a server that has imported all of the above
# ---------------------------------------------------------------------------------------------

_SERVER: multiprocessing.context.ForkServerContext | None = None


def _server() -> multiprocessing.context.ForkServerContext:
    """The forkserver of this process, started on first use with this module imported."""
    global _SERVER
    if _SERVER is None:
        context = multiprocessing.get_context("forkserver")
        context.set_forkserver_preload([HERE.stem])  # this module: its imports are the trainer's
        # The server is a new interpreter that finds modules by PYTHONPATH alone (Python 3.11 drops
        # the sys.path multiprocessing hands it), and a preload it cannot import is skipped without a
        # word: each launch would then import the trainer itself.
        given = os.environ.get("PYTHONPATH")
        os.environ["PYTHONPATH"] = os.pathsep.join(
            filter(None, [str(HERE.parent), str(HERE.parents[1]), given])
        )
        try:
            multiprocessing.forkserver.ensure_running()
        finally:
            if given is None:
                del os.environ["PYTHONPATH"]
            else:
                os.environ["PYTHONPATH"] = given
        _SERVER = context
    return _SERVER


def _launcher(argv: list[str], env: dict[str, str], cwd: str, out: str, err: str, usage: str) -> None:
    """The launcher, as `python tests/warm_torchrun.py ARGV` would run it in `cwd` with `env`: its
    stdout and stderr in the files `out` and `err`, its exit code the process's (1 and a traceback
    for an exception, as Python's own), the CPU seconds of it and its ranks written to `usage`."""
    os.setpgid(0, 0)  # its own process group with its ranks: a timeout ends them all
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    if "OMP_NUM_THREADS" in env:  # read by OpenMP when torch loaded, in the server: set it as asked
        import torch

        torch.set_num_threads(int(env["OMP_NUM_THREADS"]))
    for fd, path in ((1, out), (2, err)):
        opened = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        os.dup2(opened, fd)
        os.close(opened)
    sys.argv = [str(HERE), *argv]
    code: int = 0
    try:
        main(argv)
    except SystemExit as stop:
        code = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
    except BaseException:  # noqa: BLE001 - reported as Python reports an uncaught exception
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    own, ranks = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    Path(usage).write_text(str(own.ru_utime + own.ru_stime + ranks.ru_utime + ranks.ru_stime))
    os._exit(code)


class WarmLaunch:
    """A warm launch in progress, used as a subprocess.Popen of its command line with text pipes."""

    def __init__(self, argv: Sequence[str], env: Mapping[str, str] | None, cwd: str | Path | None) -> None:
        self.args = [*COMMAND, *map(str, argv)]
        self.returncode: int | None = None
        self._files = Path(tempfile.mkdtemp(prefix="warm-launch-"))
        self._out, self._err, self._cpu = (self._files / name for name in ("stdout", "stderr", "cpu"))
        environment = dict(os.environ if env is None else env)
        files = map(str, (self._out, self._err, self._cpu))
        self._process = _server().Process(
            target=_launcher, args=([*map(str, argv)], environment, str(cwd or os.getcwd()), *files)
        )
        self._process.start()

    def communicate(self, timeout: float | None = None) -> tuple[str, str]:
        """(stdout, stderr) once the launch has ended; subprocess.TimeoutExpired after `timeout`
        seconds, the launcher and its ranks killed first."""
        try:
            self._process.join(timeout)
            if self._process.exitcode is None:
                try:
                    os.killpg(self._process.pid, signal.SIGKILL)
                except ProcessLookupError:  # not yet in a group of its own
                    self._process.kill()
                self._process.join()
                raise subprocess.TimeoutExpired(self.args, timeout or 0)
            self.returncode = self._process.exitcode
            if self._cpu.is_file():
                _charge(float(self._cpu.read_text()))
            return self._out.read_text(errors="replace"), self._err.read_text(errors="replace")
        finally:
            shutil.rmtree(self._files, ignore_errors=True)


def _charge(seconds: float) -> None:
    """The launch's CPU seconds to the test that waited for it (tests/cpu_report.py): forked from the
    server, the launcher is no child of the test's process, whose own count cannot see it."""
    try:
        import cpu_report
    except ImportError:  # launched outside the suite
        return
    cpu_report.charge(seconds)


def start(command: Sequence[str], env: Mapping[str, str] | None = None, cwd: str | Path | None = None):
    """subprocess.Popen(command, stdout=PIPE, stderr=PIPE, text=True, env=env, cwd=cwd), forked warm
    when `command` is a warm launch (COMMAND, then the launcher's arguments)."""
    if tuple(command[: len(COMMAND)]) == COMMAND:
        return WarmLaunch(command[len(COMMAND) :], env, cwd)
    return subprocess.Popen(
        list(command), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=cwd
    )


def run(
    command: Sequence[str],
    *,
    env: Mapping[str, str] | None = None,
    cwd: str | Path | None = None,
    timeout: float | None = None,
    capture_output: bool = True,
    text: bool = True,
) -> subprocess.CompletedProcess:
    """subprocess.run(command, capture_output=True, text=True, ...), forked warm when `command` is a
    warm launch. Only captured text output is supported, as the suite uses it."""
    if not (capture_output and text):
        raise ValueError("warm_torchrun.run captures text output only")
    launch = start(command, env, cwd)
    try:
        out, err = launch.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        if isinstance(launch, subprocess.Popen):
            launch.kill()
            launch.communicate()
        raise
    return subprocess.CompletedProcess(list(command), launch.returncode, out, err)


if __name__ == "__main__":
    main(sys.argv[1:])
