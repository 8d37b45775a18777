"""Data parallelism on CPU with the real torchrun (gloo): same result as one process, shared caches."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from conftest import REPO, repo_pythonpath, train_args
from safetensors.torch import load_file


def launch(args, nproc=None):
    env = {**os.environ, "PYTHONPATH": repo_pythonpath(), "OMP_NUM_THREADS": "1"}
    env.pop("DISTILL_INJECT_FAULT", None)
    if nproc:
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
    else:
        command = [sys.executable]
    proc = subprocess.run(
        [*command, str(REPO / "train_distillation.py"), *map(str, args)],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
        cwd=REPO,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def test_two_processes_match_one_process_with_the_same_global_batch(tiny_teacher, tmp_path):
    common = dict(
        height=32, width=32, num_steps=8, lr=1e-3, log_every=2, gradient_accumulation_steps=2, ema_decay=0.9
    )
    # Two ranks build the caches, each its share; the single process then finds them complete.
    two = launch(
        train_args(tiny_teacher, tmp_path / "two", tmp_path / "cache", batch_size=2, **common), nproc=2
    )
    one = launch(train_args(tiny_teacher, tmp_path / "one", tmp_path / "cache", batch_size=4, **common))
    assert "encoding" in two.stderr and "encoding" not in one.stderr  # caches reused across world sizes

    for name in ("student", "student_ema"):
        a = load_file(str(tmp_path / "one" / name / "diffusion_pytorch_model.safetensors"))
        b = load_file(str(tmp_path / "two" / name / "diffusion_pytorch_model.safetensors"))
        worst = max((a[k] - b[k]).abs().max().item() for k in a)
        assert worst < 5e-5, (name, worst)  # float tolerance: only the order of reductions differs
    logs = [
        [json.loads(line) for line in (tmp_path / d / "metrics.jsonl").read_text().splitlines()]
        for d in ("one", "two")
    ]
    assert [r["step"] for r in logs[0]] == [r["step"] for r in logs[1]] == [2, 4, 6, 8]
    for single, ddp in zip(*logs):
        assert abs(single["loss"] - ddp["loss"]) < 1e-5  # the logged loss is the mean over both ranks


def test_only_rank_zero_writes_metrics_checkpoints_and_export(tiny_teacher, shared_cache, tmp_path):
    launch(train_args(tiny_teacher, tmp_path / "out", shared_cache, num_steps=4, checkpoint_every=2), nproc=2)
    rows = (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(r)["step"] for r in rows] == [1, 2, 3, 4]  # one line per logged step, not one per rank
    assert sorted(p.name for p in (tmp_path / "out" / "checkpoints").iterdir()) == [
        "step_00000002",
        "step_00000004",
    ]
    assert (tmp_path / "out" / "student" / "config.json").is_file()
