"""Every failure scenario of TORCHRUN_ERROR_FIXES.md, run for real and checked.

    python test_error_handling.py          # prints one line per scenario, ends with "N passed, M failed"
    python -m pytest test_error_handling.py

Each scenario starts real processes (plain python, or the real torchrun with 2 CPU processes on
the gloo backend) on a tiny random Wan 2.2 teacher, injects the failure where needed
(DISTILL_INJECT_FAULT) and asserts on stderr, on the root cause in torchrun's summary and on the
exit code.
"""

from __future__ import annotations

import atexit
import functools
import inspect
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import pytest

# A couple of minutes in all: under `make test` it starts first, beside the other long modules.
pytestmark = pytest.mark.long

REPO = Path(__file__).resolve().parent
# The scenarios distill/stress.py also runs (dead_worker, hang_one_rank, exception_one_rank,
# kill_one_rank), here on a quiet machine. `make test` runs each scenario once, in tests/test_stress.py
# beside a CPU hog, the harder condition, with the same checks and a resume (-m "not stress_twin");
# `python test_error_handling.py` and `python -m pytest test_error_handling.py` run them here too.
STRESS_TWIN = pytest.mark.stress_twin
TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]
TIMEOUT = 180


@functools.cache
def workdir() -> Path:
    """A scratch folder with a tiny teacher, built once per process."""
    from distill.models.tiny import write_tiny_teacher

    root = Path(tempfile.mkdtemp(prefix="distill-errors-"))
    atexit.register(shutil.rmtree, root, ignore_errors=True)
    write_tiny_teacher(root / "teacher", seed=0)
    return root


def train_flags(out: str, **overrides: str) -> list[str]:
    root = workdir()
    flags = {
        "--teacher_path": str(root / "teacher"),
        "--student_config": str(REPO / "config" / "student_tiny.json"),
        "--data_path": str(REPO / "data" / "static_prompts.txt"),
        "--output_dir": str(root / out),
        "--cache_dir": str(root / "cache"),
        "--height": "16",
        "--width": "16",
        "--teacher_sample_steps": "2",
        "--max_prompts": "8",
        "--batch_size": "1",
        "--num_steps": "6",
        "--log_every": "1",
        "--checkpoint_every": "2",
    }
    flags.update(overrides)
    return [item for pair in flags.items() for item in pair]


def run(
    args: list[str], env: dict[str, str] | None = None, timeout: int = TIMEOUT, cwd: Path = REPO
) -> subprocess.CompletedProcess:
    pythonpath = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    full_env = {**os.environ, "PYTHONPATH": pythonpath, "PYTHONUNBUFFERED": "1", **(env or {})}
    full_env.pop("DISTILL_INJECT_FAULT", None) if "DISTILL_INJECT_FAULT" not in (env or {}) else None
    return subprocess.run(args, cwd=cwd, env=full_env, capture_output=True, text=True, timeout=timeout)


def torchrun(
    script_args: list[str], env: dict[str, str] | None = None, nproc: int = 2
) -> subprocess.CompletedProcess:
    launcher = [*TORCHRUN, "--standalone", f"--nproc_per_node={nproc}", "--shutdown-timeout=10"]
    return run([*launcher, *script_args], env={"OMP_NUM_THREADS": "1", **(env or {})})


def root_cause(stderr: str) -> str:
    """The 'Root Cause' section of torchrun's ChildFailedError summary."""
    assert "Root Cause" in stderr, f"no torchrun summary in:\n{stderr[-3000:]}"
    return stderr[stderr.index("Root Cause") :]


def expect(condition: bool, message: str, proc: subprocess.CompletedProcess) -> None:
    if not condition:
        raise AssertionError(
            f"{message}\n--- exit {proc.returncode}\n--- stderr (end):\n{proc.stderr[-4000:]}"
        )


# ------------------------------------------------------------------------------------------------
# 1. argv sanity checks
# ------------------------------------------------------------------------------------------------


def test_torchrun_given_python_before_the_script() -> None:
    proc = torchrun(["python", "train_distillation.py", "--batch_size", "2"])
    expect(proc.returncode != 0, "must fail", proc)
    expect("can't open file" not in proc.stderr, "Python's bare message must not appear", proc)
    expect(
        "torchrun --nproc_per_node=2 train_distillation.py --batch_size 2" in proc.stderr,
        "corrected command",
        proc,
    )
    cause = root_cause(proc.stderr)
    expect("was given 'python' as the script" in cause, "our text is torchrun's root cause", proc)
    expect("exitcode  : 2" in cause, "ARGV exit code 2 in the summary", proc)
    expect("[Rank 0]" in proc.stderr and "[Rank 1]" in proc.stderr, "each rank says it", proc)


def test_the_guard_works_only_in_the_repository_root_as_the_readme_says(tmp_path: Path) -> None:
    readme, fixes = (REPO / "README.md").read_text(), (REPO / "TORCHRUN_ERROR_FIXES.md").read_text()
    check = next(line.strip() for line in readme.splitlines() if line.strip().startswith("test -f python"))
    expect(check in fixes, "both documents show the same check", subprocess.CompletedProcess([], 0, "", ""))
    here = run(["bash", "-c", check])
    elsewhere = run(["bash", "-c", check], cwd=tmp_path)
    expect(here.stdout.startswith("guarded"), "the root is guarded", here)
    expect(elsewhere.stdout.startswith("no guard here"), "another folder is not", elsewhere)
    # What the README says happens from another folder: Python's own message, exit code 2.
    launcher = [*TORCHRUN, "--standalone", "--nproc_per_node=1", "--shutdown-timeout=10"]
    proc = run([*launcher, "python", str(REPO / "train_distillation.py")], cwd=tmp_path)
    expect(f"can't open file '{tmp_path / 'python'}'" in proc.stderr, "python's own message", proc)
    expect("exitcode  : 2" in proc.stderr, "exit code 2", proc)


def test_unknown_flag_gets_did_you_mean() -> None:
    proc = run([sys.executable, "train_distillation.py", "--teacher_pth", "x"])
    expect(proc.returncode == 2, "ARGV exit code", proc)
    expect("Did you mean --teacher_path?" in proc.stderr, "suggestion", proc)
    expect("Traceback" not in proc.stderr, "no traceback", proc)


def test_path_where_a_flag_was_expected() -> None:
    proc = run([sys.executable, "train_distillation.py", "configs/run.yaml"])
    expect(proc.returncode == 2, "ARGV exit code", proc)
    expect(
        "where a flag was expected" in proc.stderr and "--config configs/run.yaml" in proc.stderr,
        "hint",
        proc,
    )


def test_torchrun_flag_after_the_script() -> None:
    proc = run([sys.executable, "train_distillation.py", "--nproc_per_node=2", *train_flags("x")])
    expect(proc.returncode == 2, "ARGV exit code", proc)
    expect(
        "torchrun --nproc_per_node=2 train_distillation.py" in proc.stderr, "moved before the script", proc
    )


def test_distributed_flag_without_torchrun() -> None:
    proc = run([sys.executable, "train_distillation.py", "--distributed", *train_flags("x")])
    expect(proc.returncode == 2, "ARGV exit code", proc)
    expect(
        "not started by torchrun" in proc.stderr and "torchrun --standalone" in proc.stderr, "explains", proc
    )


# ------------------------------------------------------------------------------------------------
# 2. setup
# ------------------------------------------------------------------------------------------------


def test_nccl_without_cuda() -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: nccl is valid here")
    proc = torchrun(["train_distillation.py", "--backend", "nccl", *train_flags("nccl")])
    cause = root_cause(proc.stderr)
    expect("the nccl backend needs CUDA" in cause, "root cause is our setup message", proc)
    expect("exitcode  : 4" in cause, "SETUP exit code 4", proc)
    expect("--backend gloo" in proc.stderr, "fix offered", proc)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_init_process_group_failure_prints_environment() -> None:
    # A rank whose master never comes up: what a wrong MASTER_ADDR/PORT looks like.
    port = str(_free_port())
    env = {
        "TORCHELASTIC_RUN_ID": "fake",
        "RANK": "1",
        "WORLD_SIZE": "2",
        "LOCAL_RANK": "0",
        "LOCAL_WORLD_SIZE": "1",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": port,
    }
    started = time.monotonic()
    proc = run(
        [sys.executable, "train_distillation.py", "--dist_timeout", "0.1", *train_flags("pg")], env=env
    )
    expect(proc.returncode == 4, "SETUP exit code", proc)
    expect("init_process_group (gloo) failed" in proc.stderr, "title", proc)
    expect(f"MASTER_PORT={port}" in proc.stderr and "RANK=1" in proc.stderr, "environment printed", proc)
    expect("--rdzv-endpoint=localhost:0" in proc.stderr, "busy-port hint", proc)
    expect(time.monotonic() - started < 120, "bounded by --dist_timeout", proc)


def test_debug_distributed_logs_every_setup_step_and_loads_in_waves() -> None:
    proc = torchrun(
        [
            "train_distillation.py",
            "--debug_distributed",
            "--teacher_load_concurrency",
            "1",
            *train_flags("debug", **{"--num_steps": "1"}),
        ]
    )
    expect(proc.returncode == 0, "the run succeeds", proc)
    err = proc.stderr
    expect("[debug_distributed]" not in proc.stdout, "diagnostics go to stderr, not stdout", proc)
    for rank in (0, 1):
        for needle in (
            f"RANK={rank}",
            "torch ",
            "NCCL_DEBUG_SUBSYS=INIT,NET,ENV",
            "TORCH_CPP_LOG_LEVEL=INFO",
            "torch.distributed debug level in effect: INFO",
            "backend gloo, device cpu; calling init_process_group",
            f"process group ready: rank {rank}/2",
        ):
            expect(f"[Rank {rank}] [debug_distributed] {needle}" in err, f"rank {rank} logs {needle!r}", proc)
    expect(
        "[Rank 0] [debug_distributed] LOCAL_RANK=0" in err
        and "[Rank 1] [debug_distributed] LOCAL_RANK=1" in err,
        "environment per rank",
        proc,
    )
    # torch's C++ INFO messages appear only when TORCH_CPP_LOG_LEVEL was set before torch loaded.
    expect("[c10d]" in err, "torch's C++ distributed log is on", proc)
    expect("wave 1 of 2" in err and "wave 2 of 2" in err, "staggered teacher loading", proc)


def test_doctor_passes_under_torchrun_and_names_a_bad_teacher() -> None:
    good = torchrun(["-m", "distill.doctor", "--teacher_path", str(workdir() / "teacher")])
    expect(good.returncode == 0, "doctor passes", good)
    expect("[Rank 0] PASS" in good.stdout and "[Rank 1] PASS" in good.stdout, "each rank says PASS", good)
    expect("all_reduce over 2 rank(s) on gloo" in good.stdout, "collective checked", good)
    bad = run([sys.executable, "-m", "distill.doctor", "--teacher_path", str(workdir() / "missing")])
    expect(
        bad.returncode == 1 and "FAIL teacher" in bad.stdout and "FAILED: teacher" in bad.stdout,
        "names it",
        bad,
    )


# ------------------------------------------------------------------------------------------------
# 3. teacher load
# ------------------------------------------------------------------------------------------------


def test_missing_teacher_folder_lists_both_layouts() -> None:
    proc = run(
        [
            sys.executable,
            "train_distillation.py",
            *train_flags("t", **{"--teacher_path": str(workdir() / "no-teacher-here")}),
        ]
    )
    expect(proc.returncode == 5, "TEACHER_LOAD exit code", proc)
    for name in (
        "model_index.json",
        "transformer_2/",
        "models_t5_umt5-xxl-enc-bf16.pth",
        "high_noise_model/",
        "download_wan.py",
    ):
        expect(name in proc.stderr, f"mentions {name}", proc)


def test_hub_id_without_network() -> None:
    proc = run(
        [
            sys.executable,
            "train_distillation.py",
            *train_flags("hub", **{"--teacher_path": "Wan-AI/Not-A-Real-Teacher"}),
        ],
        env={"HF_HUB_OFFLINE": "1"},
    )
    expect(proc.returncode == 5, "TEACHER_LOAD exit code", proc)
    expect("could not fetch the teacher Wan-AI/Not-A-Real-Teacher" in proc.stderr, "title", proc)
    expect("download_wan.py" in proc.stderr and "Traceback" not in proc.stderr, "fix, no traceback", proc)


# ------------------------------------------------------------------------------------------------
# 4-5. out of memory and anything else, under the real torchrun
# ------------------------------------------------------------------------------------------------


def test_out_of_memory_on_one_rank() -> None:
    flags = train_flags("oom", **{"--batch_size": "2"})
    proc = torchrun(["train_distillation.py", *flags], env={"DISTILL_INJECT_FAULT": "oom:3@1"})
    cause = root_cause(proc.stderr)
    expect(
        "[Rank 1] ERROR (out of memory): out of memory during training, step 3" in cause, "root cause", proc
    )
    expect("exitcode  : 7" in cause, "OUT_OF_MEMORY exit code 7", proc)
    for fix in (
        "--teacher_placement shard: each of the 2 ranks holds 1/2 of the teacher",
        "--gradient_checkpointing",
        "--batch_size 1 --gradient_accumulation_steps 2: the same global batch (4 samples per step)",
        "torchrun --standalone --nproc_per_node=2 train_distillation.py",
    ):
        expect(fix in proc.stderr, f"fix {fix}", proc)


# What a DataLoader worker killed by the injected SIGABRT is reported as dying of (distill/stress.py
# checks the same): SIGSEGV when the fault handler's stack dump in the aborting worker crashes too.
DEAD_WORKER_SIGNALS = ("SIGABRT (Aborted)", "SIGSEGV (Segmentation fault)")


@STRESS_TWIN
def test_dataloader_worker_that_dies() -> None:
    flags = train_flags("worker", **{"--num_workers": "1"})
    proc = run(
        [sys.executable, "train_distillation.py", *flags], env={"DISTILL_INJECT_FAULT": "worker_abort:3"}
    )
    expect(proc.returncode == 6, "DATA exit code", proc)
    # The loader notices the dead worker when it next needs a batch: at step 3, or at step 4 when
    # the worker had already prefetched step 3's batch (idle machines are fast enough for that).
    expect(
        any(
            f"ERROR (data): a DataLoader worker process died during training, step {step}" in proc.stderr
            for step in (3, 4)
        ),
        "title names the stage and the step",
        proc,
    )
    # Whichever way the training process noticed (torch's SIGCHLD handler, "exited unexpectedly",
    # or a reset hand-over socket), the report names the worker process and the signal it died of:
    # SIGABRT, or SIGSEGV when the fault handler's stack dump in the aborting worker crashed too.
    expect(
        any(f"was killed by {signal}" in proc.stderr for signal in DEAD_WORKER_SIGNALS),
        "the dead worker and its signal",
        proc,
    )
    expect("another rank" not in proc.stderr, "a single process has no other rank to blame", proc)
    for fix in ("--num_workers 0", "docker run --shm-size", "/dev/shm:"):
        expect(fix in proc.stderr, f"mentions {fix}", proc)
    expect("Traceback" not in proc.stderr, "no traceback", proc)


@STRESS_TWIN
def test_a_rank_that_hangs_is_reported_with_every_ranks_stacks() -> None:
    flags = train_flags("hang", **{"--num_steps": "8", "--stall_timeout": "0.2"})
    proc = torchrun(["train_distillation.py", *flags], env={"DISTILL_INJECT_FAULT": "hang:3@1"})
    cause = root_cause(proc.stderr)
    expect("exitcode  : 11" in cause, "STALLED exit code 11", proc)
    # The hung rank: its stacks (faulthandler shows where it is stuck), then the banner.
    expect("[Rank 1] stall watchdog: no progress for 12 s" in proc.stderr, "rank 1 dumps its stacks", proc)
    expect("in before_step" in proc.stderr, "the hung rank's stack", proc)
    expect(
        "[Rank 1] ERROR (stalled): no progress for 12 s during training, step 3" in proc.stderr,
        "rank 1 names stage and step",
        proc,
    )
    expect("[Rank 1]   It is NOT inside a collective" in proc.stderr, "rank 1 is the one", proc)
    # The waiting rank reports the stall itself (saying it waits in a collective), or, when the
    # hung rank's exit reaches it first, that it is a secondary failure.
    waited = "[Rank 0]   It waits inside a collective" in proc.stderr
    secondary = "[Rank 0] ERROR (training): lost contact with another rank" in proc.stderr
    expect(waited or secondary, "rank 0 says it only waited", proc)


@STRESS_TWIN
def test_unexpected_exception_names_stage_and_step() -> None:
    proc = torchrun(
        ["train_distillation.py", *train_flags("exc")], env={"DISTILL_INJECT_FAULT": "exception:4@0"}
    )
    cause = root_cause(proc.stderr)
    expect(
        "[Rank 0] ERROR (internal): unexpected InjectedFault during training, step 4" in cause,
        "root cause",
        proc,
    )
    expect("Traceback" in cause and "exitcode  : 10" in cause, "traceback and exit code", proc)


@STRESS_TWIN
def test_killed_rank_does_not_hang_the_others() -> None:
    started = time.monotonic()
    proc = torchrun(
        ["train_distillation.py", *train_flags("kill", **{"--num_steps": "50"})],
        env={"DISTILL_INJECT_FAULT": "kill:3@1"},
    )
    expect(proc.returncode != 0, "must fail", proc)
    expect(time.monotonic() - started < 90, "finishes promptly", proc)
    expect("SIGKILL" in proc.stderr, "torchrun names the killed rank's signal", proc)


# ------------------------------------------------------------------------------------------------


def fixtures_for(fn: Callable[..., None]) -> dict[str, Path]:
    """What pytest would hand `fn`: a fresh folder for every `tmp_path` it asks for."""
    wanted = inspect.signature(fn).parameters
    unknown = sorted(set(wanted) - {"tmp_path"})
    if unknown:
        raise TypeError(f"{fn.__name__} asks for fixtures this runner does not provide: {unknown}")
    return {"tmp_path": Path(tempfile.mkdtemp(prefix="distill-errors-", dir=workdir()))} if wanted else {}


def main() -> int:
    scenarios = [(name, fn) for name, fn in globals().items() if name.startswith("test_") and callable(fn)]
    passed = failed = 0
    for name, fn in scenarios:
        started = time.monotonic()
        try:
            fn(**fixtures_for(fn))
        except pytest.skip.Exception as skip:
            print(f"SKIP  {name}: {skip}", flush=True)
            continue
        except Exception as exc:
            failed += 1
            print(f"FAIL  {name} ({time.monotonic() - started:.1f}s)\n{exc}", flush=True)
            continue
        passed += 1
        print(f"PASS  {name} ({time.monotonic() - started:.1f}s)", flush=True)
    print(f"{passed} passed, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
