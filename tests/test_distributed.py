"""Data parallelism on CPU under torchrun (gloo; its ranks started warm, tests/warm_torchrun.py): same result as one process, shared caches."""

from __future__ import annotations

import json
import os
import sys

import pytest
from conftest import REPO, WARM_TORCHRUN, repo_pythonpath, run_command, train_args

from train_distillation import main


def launch(args, nproc=None):
    env = {**os.environ, "PYTHONPATH": repo_pythonpath(), "OMP_NUM_THREADS": "1"}
    env.pop("DISTILL_INJECT_FAULT", None)
    if nproc:
        command = [*WARM_TORCHRUN, "--standalone", f"--nproc_per_node={nproc}"]
    else:
        command = [sys.executable]
    proc = run_command(
        [*command, str(REPO / "train_distillation.py"), *map(str, args)], env=env, timeout=300, cwd=REPO
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def assert_same_trajectory(
    runs: list,
    first_rtol: float = 1e-5,
    rtol: float = 1e-4,
    keys: tuple[str, ...] = ("loss", "grad_norm", "loss_high_noise", "loss_low_noise"),
) -> None:
    """Two code paths trained on the same global batches: equal losses and gradient norms per step.

    Weights are not compared: Adam divides by the root of tiny second moments, so 1e-7 of float
    noise (another order of reduction, another CPU's kernels) moves some weights by up to lr.
    Step 1 is computed before any update; later steps follow the (noise-perturbed) trajectory.
    """
    logs = [[json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()] for out in runs]
    assert [r["step"] for r in logs[0]] == [r["step"] for r in logs[1]] and logs[0]
    for ours, theirs in zip(*logs):
        assert ours.keys() == theirs.keys(), ours["step"]
        tolerance = first_rtol if ours["step"] == 1 else rtol
        for key in keys:
            if key in ours:
                assert ours[key] == pytest.approx(theirs[key], rel=tolerance), (ours["step"], key)


def test_two_processes_match_one_process_with_the_same_global_batch(tiny_teacher, tmp_path, capsys):
    common = dict(
        height=32, width=32, num_steps=8, lr=1e-3, log_every=1, gradient_accumulation_steps=2, ema_decay=0.9
    )
    # Two ranks build the caches, each its share; the single process (this one) then finds them complete.
    two = launch(
        train_args(tiny_teacher, tmp_path / "two", tmp_path / "cache", batch_size=2, **common), nproc=2
    )
    capsys.readouterr()
    assert main(train_args(tiny_teacher, tmp_path / "one", tmp_path / "cache", batch_size=4, **common)) == 0
    one = capsys.readouterr()
    assert "encoding" in two.stderr and "encoding" not in one.err  # caches reused across world sizes
    assert "all 2 ranks hold identical student weights" in two.stderr
    # The logged loss is the mean over both ranks, the gradient norm that of the all-reduced
    # gradient: equal to the single process's only if every rank used its slice of the same batch.
    assert_same_trajectory([tmp_path / "one", tmp_path / "two"])
    assert (tmp_path / "two" / "student_ema" / "config.json").is_file()


def test_only_rank_zero_writes_metrics_checkpoints_and_export(tiny_teacher, shared_cache, tmp_path):
    launch(train_args(tiny_teacher, tmp_path / "out", shared_cache, num_steps=4, checkpoint_every=2), nproc=2)
    rows = (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(r)["step"] for r in rows] == [1, 2, 3, 4]  # one line per logged step, not one per rank
    assert sorted(p.name for p in (tmp_path / "out" / "checkpoints").iterdir()) == [
        "step_00000002",
        "step_00000004",
    ]
    assert (tmp_path / "out" / "student" / "config.json").is_file()
