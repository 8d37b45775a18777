"""wandb is a guest: offline without a key, never fatal, its loss reported once; metrics.jsonl always."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys

from conftest import REPO, repo_pythonpath, train_args

from distill.train.tracking import Tracker


def test_offline_run_is_written_without_any_key(tmp_path, monkeypatch):
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("NETRC", str(tmp_path / "no-netrc"))
    tracker = Tracker(tmp_path, True, 2, 0, wandb_project="distill-test", wandb_mode="online")
    assert tracker.run is not None and tracker.run.settings.mode == "offline"
    tracker.log(1, {"loss": 1.0, "lr": 0.1})
    tracker.close()
    assert list((tmp_path / "wandb").glob("offline-run-*"))
    assert json.loads((tmp_path / "metrics.jsonl").read_text())["loss"] == 1.0


def test_losing_wandb_mid_run_is_reported_once_and_training_goes_on(tmp_path, caplog, monkeypatch):
    monkeypatch.setenv("NETRC", str(tmp_path / "no-netrc"))
    tracker = Tracker(tmp_path, True, 3, 0, wandb_project="distill-test", wandb_mode="offline")
    calls = []

    def broken_log(*args, **kwargs):
        calls.append(args)
        raise ConnectionError("network is unreachable")

    monkeypatch.setattr(tracker.run, "log", broken_log)
    with caplog.at_level(logging.WARNING):
        for step in (1, 2, 3):
            tracker.log(step, {"loss": 1.0 / step, "lr": 0.1})
    tracker.close()
    assert len(calls) == 1  # wandb is dropped after the first failure ...
    assert sum("wandb logging failed" in r.getMessage() for r in caplog.records) == 1  # ... reported once
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]


def test_unreachable_wandb_server_with_a_key_does_not_stop_training(tiny_teacher, shared_cache, tmp_path):
    env = {
        **os.environ,
        "PYTHONPATH": repo_pythonpath(),
        "WANDB_API_KEY": "k" * 40,
        "WANDB_BASE_URL": "http://127.0.0.1:9",
        "WANDB_INIT_TIMEOUT": "3",
    }
    args = train_args(tiny_teacher, tmp_path / "out", shared_cache, num_steps=2, wandb_project="distill-test")
    proc = subprocess.run(
        [sys.executable, str(REPO / "train_distillation.py"), *map(str, args)],
        capture_output=True,
        text=True,
        env=env,
        timeout=180,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "wandb could not start" in proc.stderr and "training continues without it" in proc.stderr
    assert (tmp_path / "out" / "student").is_dir()
