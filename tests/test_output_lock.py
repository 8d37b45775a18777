"""Two runs in one --output_dir: the second is refused naming the first; a dead run holds nothing."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys

from conftest import REPO, repo_pythonpath, train_args

from distill.ops.output_dir import hold_output_dir
from train_distillation import main


def test_a_second_run_in_a_busy_output_dir_is_refused_naming_the_first(
    tiny_teacher, shared_cache, tmp_path, capsys
):
    out = tmp_path / "out"
    out.mkdir()
    (out / "metrics.jsonl").write_text('{"step": 1}\n')  # the first run's history
    with hold_output_dir(out):
        code = main(train_args(tiny_teacher, out, shared_cache, lr=3e-4))
    err = capsys.readouterr().err
    assert code == 3 and "Traceback" not in err
    assert (
        f"--output_dir {out} is in use by another run (pid {os.getpid()} on host {socket.gethostname()}"
        in err
    )
    assert (out / "metrics.jsonl").read_text() == '{"step": 1}\n'  # untouched
    assert not (out / "checkpoints").exists() and not (out / "run_config.json").exists()
    # Once the first run is gone, the folder is free again.
    assert main(train_args(tiny_teacher, out, shared_cache, num_steps=2)) == 0


def test_a_killed_run_leaves_no_stale_lock(tiny_teacher, shared_cache, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time; from pathlib import Path; "
         "from distill.ops.output_dir import hold_output_dir; "
         f"ctx = hold_output_dir(Path({str(out)!r})); ctx.__enter__(); print('held', flush=True); time.sleep(600)"],
        env={**os.environ, "PYTHONPATH": repo_pythonpath()},
        stdout=subprocess.PIPE,
        text=True,
        cwd=REPO,
    )  # fmt: skip
    assert holder.stdout.readline().strip() == "held"
    os.kill(holder.pid, signal.SIGKILL)
    holder.wait()
    assert main(train_args(tiny_teacher, out, shared_cache, num_steps=2)) == 0
