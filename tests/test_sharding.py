"""The teacher sharded over ranks with FSDP2 (CPU, gloo) gives the same results as a whole copy,
in training and across two torchrun agents acting as two nodes."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

from conftest import REPO, repo_pythonpath, train_args
from test_distributed import assert_same_trajectory

TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]


def env() -> dict[str, str]:
    out = {**os.environ, "PYTHONPATH": repo_pythonpath(), "OMP_NUM_THREADS": "1"}
    out.pop("DISTILL_INJECT_FAULT", None)
    return out


def run(command: list[str]) -> subprocess.CompletedProcess:
    proc = subprocess.run(command, capture_output=True, text=True, env=env(), timeout=300, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def test_sharded_experts_give_the_same_results_with_one_token_placeholders(tiny_teacher):
    proc = run(
        [
            *TORCHRUN,
            "--standalone",
            "--nproc_per_node=2",
            str(REPO / "tests" / "shard_velocity_check.py"),
            str(tiny_teacher),
        ]
    )
    assert "rank 0 max abs difference" in proc.stdout and "rank 1 max abs difference" in proc.stdout
    # 4 tokens per sample (a 4x4 latent in 2x2 patches), guided pairs for the teacher. Rank 1 has no
    # high-noise sample: it joins that expert's gathers with a one-token placeholder, not a sample.
    assert "rank 0 teacher tokens high 16 low 8" in proc.stdout
    assert "rank 1 teacher tokens high 1 low 24" in proc.stdout
    assert "rank 0 lora tokens high 8 low 4" in proc.stdout
    assert "rank 1 lora tokens high 1 low 12" in proc.stdout


def test_training_with_a_sharded_teacher_matches_a_whole_teacher(tiny_teacher, tmp_path):
    common = dict(height=32, width=32, max_prompts=7, num_steps=6, batch_size=1, student_init="teacher")
    for placement in ("shard", "gpu"):
        out = tmp_path / placement
        proc = run(
            [
                *TORCHRUN,
                "--standalone",
                "--nproc_per_node=2",
                str(REPO / "train_distillation.py"),
                *map(
                    str,
                    train_args(tiny_teacher, out, tmp_path / "cache", teacher_placement=placement, **common),
                ),
            ]
        )
        assert f"teacher placement: {placement}" in proc.stdout + proc.stderr
    assert_same_trajectory([tmp_path / "shard", tmp_path / "gpu"])


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_two_nodes_on_one_machine_finish_with_identical_students(tiny_teacher, tmp_path):
    port = _free_port()
    args = train_args(
        tiny_teacher,
        tmp_path / "out",
        tmp_path / "cache",
        num_steps=4,
        batch_size=1,
        teacher_placement="shard",
    )
    nodes = [
        subprocess.Popen(
            [
                *TORCHRUN,
                "--nnodes=2",
                f"--node-rank={rank}",
                "--nproc_per_node=1",
                "--rdzv-backend=c10d",
                f"--rdzv-endpoint=127.0.0.1:{port}",
                "--rdzv-id=two-nodes",
                str(REPO / "train_distillation.py"),
                *map(str, args),
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env(),
            cwd=REPO,
        )
        for rank in (0, 1)
    ]
    results = [node.communicate(timeout=300) for node in nodes]
    for node, (_out, err) in zip(nodes, results):
        assert node.returncode == 0, err[-3000:]
    logs = "".join(out + err for out, err in results)
    # Every rank's student is compared (all_gather of per-tensor checksums) before the run ends.
    assert "all 2 ranks hold identical student weights" in logs
    assert "teacher placement: shard" in logs
    assert (tmp_path / "out" / "student").is_dir()
