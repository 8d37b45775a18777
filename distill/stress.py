"""Rehearse every failure that involves a signal or a second process, many times over.

    python -m distill.stress                          # each scenario 10 times, every other run beside a CPU hog
    python -m distill.stress --runs 50 --hog always --scenario dead_worker
    python -m distill.stress --list

A failure path that is right nine times in ten is wrong for somebody every day, and timing is what
changes between runs: a rank starved of CPU, a worker that dies a moment earlier or later. Each
run here starts the trainer as a user would (plain python, or the real torchrun with two CPU
processes on gloo) on a tiny random Wan 2.2 teacher, injects one failure (DISTILL_INJECT_FAULT,
see distill/ops/faults.py), then checks the exit code and the banner of every rank, and that the same
command with `--resume auto` finishes from what the failure left in the checkpoint folder. One
scenario is the opposite case: a healthy step slower than --stall_timeout (slow_step), which must
finish with no report at all. With a CPU hog, busy processes take every core while the run goes
on, as on a shared node.

The suite runs each scenario a few times (tests/test_stress.py); the figures of long runs are
recorded in TORCHRUN_ERROR_FIXES.md. Exit code: 0 when every run ended as expected, 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path

from distill.ops.command import Parser, PathAction, entry_point, integer
from distill.ops.errors import DistillError, report
from distill.ops.paths import Kind, PathFlag, check_paths

REPO = Path(__file__).resolve().parents[1]
NUM_STEPS = 6


@dataclass
class Outcome:
    """One finished run: what it printed and left behind."""

    returncode: int
    stdout: str
    stderr: str
    output_dir: Path

    def rank_exit_codes(self) -> list[int]:
        """torchrun's summary: the exit code of every rank that failed (root cause included)."""
        return [int(code) for code in re.findall(r"exitcode\s*:\s*(-?\d+)", self.stderr)]

    def checkpoints(self) -> list[str]:
        from distill.train.checkpoint import checkpoint_root, complete_checkpoints

        return [path.name for path in complete_checkpoints(checkpoint_root(self.output_dir))]


Check = Callable[[Outcome], list[str]]


@dataclass(frozen=True)
class Scenario:
    name: str
    what: str
    nproc: int  # 1: python train_distillation.py; more: torchrun --nproc_per_node
    fault: str
    check: Check
    flags: dict[str, str] = field(default_factory=dict)


def _needs(outcome: Outcome, *texts: str) -> list[str]:
    return [f"stderr lacks {text!r}" for text in texts if text not in outcome.stderr]


def _traceback_after_banner(outcome: Outcome) -> list[str]:
    last_banner = outcome.stderr.rfind("(exit code ")
    if last_banner >= 0 and "Traceback" in outcome.stderr[last_banner:].split("Root Cause")[0]:
        return ["a traceback follows the banner (clean-up failed loudly)"]
    return []


DEAD_WORKER_SIGNALS = ("SIGABRT (Aborted)", "SIGSEGV (Segmentation fault)")


def _check_dead_worker(outcome: Outcome) -> list[str]:
    problems = [] if outcome.returncode == 6 else [f"exit code {outcome.returncode}, expected 6 (DATA)"]
    problems += _needs(outcome, "ERROR (data): a DataLoader worker process died during training, step")
    problems += _needs(
        outcome, "DataLoader worker (pid", "--num_workers 0", "docker run --shm-size", "/dev/shm:"
    )
    # The dead worker and its signal, whichever way it was noticed. SIGABRT runs Python's fault
    # handler in the worker, which dumps every thread's stack; when that dump itself crashes (seen
    # once in 11-28's CI), torch's worker handler ends the worker with SIGSEGV instead.
    if not any(f"was killed by {signal}" in outcome.stderr for signal in DEAD_WORKER_SIGNALS):
        problems.append(
            f"stderr names neither signal a dead worker dies of: {' / '.join(DEAD_WORKER_SIGNALS)}"
        )
    if "another rank" in outcome.stderr:
        problems.append("a single process blamed another rank")
    if "Traceback" in outcome.stderr:
        problems.append("a traceback was printed")
    return problems


def _check_sigterm(outcome: Outcome) -> list[str]:
    codes = outcome.rank_exit_codes()
    problems = (
        [] if codes and set(codes) == {75} else [f"rank exit codes {codes}, expected 75 for every rank"]
    )
    if outcome.checkpoints() != ["step_00000003"]:
        problems.append(f"checkpoints {outcome.checkpoints()}, expected exactly step_00000003")
    return problems


def _check_kill(outcome: Outcome) -> list[str]:
    problems = [] if outcome.returncode != 0 else ["torchrun exited 0 after a rank was SIGKILLed"]
    problems += _needs(outcome, "SIGKILL")
    codes = outcome.rank_exit_codes()
    if -9 not in codes:
        problems.append(f"rank exit codes {codes}: the killed rank (-9) is not named")
    return problems + _traceback_after_banner(outcome)


def _check_hang(outcome: Outcome) -> list[str]:
    problems = _needs(
        outcome,
        "[Rank 1] stall watchdog: no progress for 6 s",  # the hung rank dumps its stacks first
        "[Rank 1] ERROR (stalled): no progress for 6 s during training, step 3",
        "[Rank 1]   It is NOT inside a collective",
    )
    if 11 not in outcome.rank_exit_codes():
        problems.append(f"rank exit codes {outcome.rank_exit_codes()}: no rank exited 11 (STALLED)")
    # The rank that only waited says so: its own stall report, or, when the hung rank's exit
    # reaches it first, that it is a secondary failure.
    if not any(text in outcome.stderr for text in WAITING_RANK_REPORTS):
        problems.append("rank 0 printed neither its stall report nor the secondary-failure report")
    return problems


WAITING_RANK_REPORTS = (
    "[Rank 0]   It waits inside a collective",
    "[Rank 0] ERROR (training): lost contact with another rank",
)


def _check_hang_before_step(outcome: Outcome) -> list[str]:
    """As any hang, and the hung rank's stack shows it stuck before its step."""
    return _check_hang(outcome) + _needs(outcome, "in before_step")


def _check_hang_in_forward(outcome: Outcome) -> list[str]:
    """As a hang before the step, and the hung rank's stack shows it stuck inside a forward."""
    return _check_hang(outcome) + _needs(outcome, "in _in_forward")


SLOW_STEP = 3
SLOW_TIMEOUT_S = 6.0  # the slow scenario's --stall_timeout (0.1 min); each forward sleeps far less


def _check_slow_step(outcome: Outcome) -> list[str]:
    """Finished normally, no stall report, and the slow step really outlasted --stall_timeout."""
    problems = [] if outcome.returncode == 0 else [f"exit code {outcome.returncode}, expected 0"]
    if "stall watchdog" in outcome.stderr or "ERROR" in outcome.stderr:
        problems.append("a healthy slow step was reported as a failure")
    metrics = outcome.output_dir / "metrics.jsonl"
    rows = [json.loads(line) for line in metrics.read_text().splitlines()] if metrics.is_file() else []
    rate = next((row.get("steps_per_s") for row in rows if row["step"] == SLOW_STEP), None)
    if not rate or 1 / rate <= SLOW_TIMEOUT_S:
        took = f"{1 / rate:.1f} s" if rate else "no figure"
        problems.append(f"step {SLOW_STEP} took {took}: not longer than the {SLOW_TIMEOUT_S:g} s timeout")
    return problems


def _check_exception(outcome: Outcome) -> list[str]:
    problems = _needs(outcome, "[Rank 0] ERROR (internal): unexpected InjectedFault during training, step 4")
    root = outcome.stderr[outcome.stderr.find("Root Cause") :] if "Root Cause" in outcome.stderr else ""
    if "exitcode  : 10" not in root:
        problems.append("the root cause is not rank 0's exit code 10")
    if "Traceback" not in root:
        problems.append("the root cause shows no traceback of the unexpected exception")
    return problems


SCENARIOS: dict[str, Scenario] = {
    s.name: s
    for s in (
        Scenario(
            "dead_worker",
            "one process; its DataLoader worker dies of SIGABRT at step 3",
            1,
            "worker_abort:3",
            _check_dead_worker,
            {"--num_workers": "1"},
        ),
        Scenario(
            "sigterm_one_rank",
            "two ranks; rank 1 gets SIGTERM (preemption) at step 3",
            2,
            "sigterm:3@1",
            _check_sigterm,
            {"--checkpoint_every": "100"},
        ),
        Scenario("kill_one_rank", "two ranks; rank 1 is SIGKILLed at step 3", 2, "kill:3@1", _check_kill),
        Scenario(
            "hang_one_rank",
            "two ranks; rank 1 stops making progress at step 3",
            2,
            "hang:3@1",
            _check_hang_before_step,
            {"--stall_timeout": "0.1", "--num_steps": "8"},
        ),
        Scenario(
            "hang_in_forward",
            "two ranks; rank 1 gets stuck in its third forward of step 3, after signalling progress",
            2,
            "hang_forward:3@1",
            _check_hang_in_forward,
            {"--stall_timeout": "0.1", "--num_steps": "8"},
        ),
        Scenario(
            "slow_step",
            "two ranks; step 3 is slow on both (1 s in every forward), longer than --stall_timeout",
            2,
            f"slow:{SLOW_STEP}",
            _check_slow_step,
            {"--stall_timeout": f"{SLOW_TIMEOUT_S / 60:g}", "--gradient_accumulation_steps": "2"},
        ),
        Scenario(
            "exception_one_rank",
            "two ranks; rank 0 raises an unexpected exception at step 4",
            2,
            "exception:4@0",
            _check_exception,
        ),
    )
}
CHECKPOINT_KILL = "kill_during_checkpoint"  # its own procedure: see kill_during_checkpoint()


# ---------------------------------------------------------------------------------------------
# Running the trainer
# ---------------------------------------------------------------------------------------------


def environment(fault: str | None) -> dict[str, str]:
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
        "PYTHONUNBUFFERED": "1",
        "OMP_NUM_THREADS": "1",
        # restarted or repeated rendezvous on one host: see TORCHRUN_ERROR_FIXES.md
        "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
    }
    env.pop("DISTILL_INJECT_FAULT", None)
    if fault:
        env["DISTILL_INJECT_FAULT"] = fault
    return env


@dataclass(frozen=True)
class Launcher:
    """How a run starts: the command before the script (by default python, and torchrun as users start
    it for several ranks), and what runs the whole command line (the suite's forks a warm process)."""

    command: Sequence[str] = (sys.executable, "-m", "torch.distributed.run")
    run: Callable[..., subprocess.CompletedProcess] = subprocess.run
    python: Sequence[str] = (sys.executable,)


AS_USERS = Launcher()


def command(nproc: int, flags: dict[str, str], launcher: Launcher = AS_USERS) -> list[str]:
    script = [str(REPO / "train_distillation.py"), *(item for pair in flags.items() for item in pair)]
    if nproc == 1:
        return [*launcher.python, *script]
    # A rank left waiting for a dead or hung peer is SIGKILLed this long after the first exit.
    return [*launcher.command, "--standalone", f"--nproc_per_node={nproc}", "--shutdown-timeout=5", *script]


def train_flags(workdir: Path, output_dir: Path, extra: dict[str, str]) -> dict[str, str]:
    return {
        "--teacher_path": str(workdir / "teacher"),
        "--student_config": str(REPO / "config" / "student_tiny.json"),
        "--data_path": str(REPO / "data" / "static_prompts.txt"),
        "--output_dir": str(output_dir),
        "--cache_dir": str(workdir / "cache"),
        "--height": "16",
        "--width": "16",
        "--teacher_sample_steps": "2",
        "--max_prompts": "8",
        "--batch_size": "1",
        "--num_steps": str(NUM_STEPS),
        "--log_every": "1",
        "--checkpoint_every": "2",
        **extra,
    }


def run_trainer(
    nproc: int, flags: dict[str, str], output_dir: Path, fault: str | None, launcher: Launcher = AS_USERS
) -> Outcome:
    line = command(nproc, flags, launcher)
    proc = launcher.run(line, env=environment(fault), capture_output=True, text=True, timeout=300, cwd=REPO)
    return Outcome(proc.returncode, proc.stdout, proc.stderr, output_dir)


def resume_problems(
    nproc: int, flags: dict[str, str], output_dir: Path, launcher: Launcher = AS_USERS
) -> list[str]:
    """The same command, without the fault: it must finish from what the failure left."""
    had = Outcome(0, "", "", output_dir).checkpoints()
    resumed = run_trainer(nproc, flags, output_dir, fault=None, launcher=launcher)
    problems = []
    if resumed.returncode != 0:
        kept = keep_stderr(resumed, "resume")
        problems.append(
            f"--resume auto exited {resumed.returncode} (all of stderr: {kept}):\n{resumed.stderr[-1500:]}"
        )
    elif had and "resumed from" not in resumed.stderr:
        problems.append(f"--resume auto did not resume from {had[-1]}")
    return problems


def prepare(workdir: Path, launcher: Launcher = AS_USERS) -> Path:
    """The tiny teacher and a warm prompt-embedding / latent cache, shared by every run."""
    from distill.models.tiny import write_tiny_teacher

    if not (workdir / "teacher").exists():
        write_tiny_teacher(workdir / "teacher", seed=0)
        flags = train_flags(workdir, workdir / "warm", {"--num_steps": "1"})
        if (warm := run_trainer(1, flags, workdir, None, launcher)).returncode != 0:
            raise RuntimeError(f"the warm-up run failed:\n{warm.stderr[-3000:]}")
    return workdir


def run_scenario(
    scenario: Scenario, workdir: Path, index: int, resume_launcher: Launcher = AS_USERS
) -> list[str]:
    """One run of `scenario` (launched as users launch) and its resume, whose multi-rank launch
    `resume_launcher` starts (the suite's: tests/warm_torchrun.py); the problems found (none: as expected)."""
    output_dir = workdir / f"{scenario.name}-{index}"
    shutil.rmtree(output_dir, ignore_errors=True)
    flags = train_flags(workdir, output_dir, scenario.flags)
    outcome = run_trainer(scenario.nproc, flags, output_dir, scenario.fault)
    problems = scenario.check(outcome)
    if problems:
        kept = keep_stderr(outcome, "run")
        return [*problems, f"--- stderr (end; all of it: {kept}):\n{outcome.stderr[-3000:]}"]
    return resume_problems(scenario.nproc, flags, output_dir, resume_launcher)


def keep_stderr(outcome: Outcome, name: str) -> Path:
    """A failed run's whole stderr beside its output folder (the report shows only its end)."""
    path = outcome.output_dir.with_name(f"{outcome.output_dir.name}.{name}.stderr.txt")
    path.write_text(outcome.stderr)
    return path


def kill_during_checkpoint(workdir: Path, index: int, resume_launcher: Launcher = AS_USERS) -> list[str]:
    """SIGKILL a run that saves a checkpoint every step at a random moment; resume must find a whole one.

    The moment is drawn over the stretch in which the run saves, so most kills land inside a save
    (its tensors, its state, its COMPLETE marker or the rename into place).
    """
    from distill.train.checkpoint import checkpoint_root, complete_checkpoints, load_checkpoint

    rng = random.Random(index)
    output_dir = workdir / f"{CHECKPOINT_KILL}-{index}"
    shutil.rmtree(output_dir, ignore_errors=True)
    flags = train_flags(workdir, output_dir, {"--num_steps": "40", "--checkpoint_every": "1"})
    proc = subprocess.Popen(
        command(1, flags), env=environment(None), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    root = checkpoint_root(output_dir)
    deadline = time.monotonic() + 120
    while not (root.exists() and any(root.iterdir())) and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(rng.uniform(0.0, 1.5))
    proc.kill()
    proc.wait()
    problems = []
    for path in complete_checkpoints(root):
        try:
            load_checkpoint(path)
        except Exception as exc:  # noqa: BLE001 - any failure to load is the finding
            problems.append(f"{path.name} is marked complete but does not load: {type(exc).__name__}: {exc}")
    return problems or resume_problems(1, {**flags, "--num_steps": "41"}, output_dir, resume_launcher)


# ---------------------------------------------------------------------------------------------
# A busy machine
# ---------------------------------------------------------------------------------------------


@contextmanager
def cpu_hog() -> Iterator[None]:
    """A busy process on every core while the block runs."""
    count = os.cpu_count() or 2
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(count)]
    try:
        yield
    finally:
        for hog in hogs:
            hog.kill()
            hog.wait()


# ---------------------------------------------------------------------------------------------
# The command line
# ---------------------------------------------------------------------------------------------


def stress(
    names: list[str],
    runs: int,
    hog: str,
    workdir: Path,
    say: Callable[[str], None] = print,
    resume_launcher: Launcher = AS_USERS,
) -> int:
    """Run each scenario `runs` times; returns the number of runs that did not end as expected.

    A busy process on every core runs beside the runs `hog` selects ("always", "alternate", "never").
    `resume_launcher`: see run_scenario.
    """
    prepare(workdir, resume_launcher)
    failures = 0
    for name in names:
        failed = 0
        started = time.monotonic()
        for index in range(runs):
            busy = hog == "always" or (hog == "alternate" and index % 2 == 1)
            with cpu_hog() if busy else nullcontext():
                if name == CHECKPOINT_KILL:
                    problems = kill_during_checkpoint(workdir, index, resume_launcher)
                else:
                    problems = run_scenario(SCENARIOS[name], workdir, index, resume_launcher)
            if problems:
                failed += 1
                say(f"  {name} run {index + 1} ({'with' if busy else 'without'} CPU hog) FAILED:")
                say("    " + "\n    ".join("\n".join(problems).splitlines()))
        failures += failed
        say(
            f"{name}: {runs - failed} of {runs} runs as expected, {failed} failed "
            f"({time.monotonic() - started:.0f} s)"
        )
    return failures


@entry_point
def main(argv: list[str] | None = None) -> int:
    names = [*SCENARIOS, CHECKPOINT_KILL]
    parser = Parser(
        prog="python -m distill.stress", description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--runs", type=integer(1), default=10, help="runs per scenario (default 10)")
    parser.add_argument(
        "--hog",
        choices=("never", "alternate", "always"),
        default="alternate",
        help="busy processes on every core beside the run: never, every other run (default), always",
    )
    parser.add_argument("--scenario", action="append", choices=names, help="only these (repeatable)")
    parser.add_argument("--list", action="store_true", help="list the scenarios and exit")
    parser.add_argument(
        "--workdir",
        type=Path,
        action=PathAction,
        kind=Kind.OUTPUT_FOLDER,
        help="scratch folder (default: a new temporary one)",
    )
    args = parser.parse_args(argv)
    if args.list:
        for scenario in SCENARIOS.values():
            print(f"{scenario.name:22} {scenario.what}")
        print(f"{CHECKPOINT_KILL:22} one process saving every step; SIGKILL at a random moment")
        return 0
    try:  # before the first scenario starts
        check_paths([PathFlag("--workdir", args.workdir, Kind.OUTPUT_FOLDER)])
    except DistillError as error:
        return report(error)
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="distill-stress-"))
    failures = stress(args.scenario or names, args.runs, args.hog, workdir)
    total = args.runs * len(args.scenario or names)
    print(f"{total - failures} passed, {failures} failed")
    if args.workdir is None:
        shutil.rmtree(workdir, ignore_errors=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
