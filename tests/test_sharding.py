"""The teacher sharded over ranks with FSDP2 (CPU, gloo) gives the same results as a whole copy,
in training and across two torchrun agents acting as two nodes."""

from __future__ import annotations

import os
import socket
import subprocess

from conftest import REPO, WARM_TORCHRUN, repo_pythonpath, run_command, start_command, train_args
from test_distributed import assert_same_trajectory
from test_teacher_lora import write_user_lora

from train_distillation import main


def env() -> dict[str, str]:
    out = {**os.environ, "PYTHONPATH": repo_pythonpath(), "OMP_NUM_THREADS": "1"}
    out.pop("DISTILL_INJECT_FAULT", None)
    return out


def run(command: list[str]) -> subprocess.CompletedProcess:
    proc = run_command(command, env=env(), timeout=300, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def test_sharded_experts_give_the_same_results_with_one_token_placeholders(tiny_teacher):
    proc = run(
        [
            *WARM_TORCHRUN,
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


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_two_nodes(
    args: list, per_node: int | tuple[int, int], run_id: str, script: str = "train_distillation.py"
) -> str:
    """Two torchrun agents on this machine as two nodes of `per_node` ranks each (or of the pair's
    sizes); `script` must succeed on every rank. Returns their logs."""
    sizes = per_node if isinstance(per_node, tuple) else (per_node, per_node)
    port = _free_port()
    nodes = [
        start_command(
            [
                *WARM_TORCHRUN,
                "--nnodes=2",
                f"--node-rank={rank}",
                f"--nproc_per_node={sizes[rank]}",
                "--rdzv-backend=c10d",
                f"--rdzv-endpoint=127.0.0.1:{port}",
                f"--rdzv-id={run_id}",
                str(REPO / script),
                *map(str, args),
            ],
            env=env(),
            cwd=REPO,
        )
        for rank in (0, 1)
    ]
    results = [node.communicate(timeout=300) for node in nodes]
    for node, (_out, err) in zip(nodes, results):
        assert node.returncode == 0, err[-3000:]
    return "".join(out + err for out, err in results)


def test_two_nodes_on_one_machine_finish_with_identical_students(tiny_teacher, tmp_path):
    args = train_args(
        tiny_teacher,
        tmp_path / "out",
        tmp_path / "cache",
        num_steps=4,
        batch_size=1,
        teacher_placement="shard",
    )
    logs = run_two_nodes(args, per_node=1, run_id="two-nodes")
    # Every rank's student is compared (all_gather of per-tensor checksums) before the run ends.
    assert "all 2 ranks hold identical student weights" in logs
    assert "teacher placement: shard" in logs
    # One rank per node has nothing to shard within a node: the experts stay sharded over both.
    assert "teacher sharded over all 2 ranks of 2 nodes" in logs
    assert (tmp_path / "out" / "student").is_dir()


def test_a_sharded_teacher_trains_as_a_whole_one_on_one_node_and_on_two(tiny_teacher, tmp_path):
    """On the same global batch (4 = 1 x 4 ranks = 2 x 2 ranks = 4 x 1 process), with the teacher from
    its high-noise expert's blocks and carrying a user's LoRA pair (fused before the experts are
    placed): 2 ranks with the teacher sharded train as 2 ranks with it whole and as one process;
    2 nodes x 2 ranks (HSDP: each expert sharded within a node, replicated across the two) as well."""
    users = tmp_path / "user_lora"
    write_user_lora(users / "style_high_noise.safetensors", seed=1)
    write_user_lora(users / "style_low_noise.safetensors", seed=2)
    common = dict(num_steps=3, student_init="teacher", teacher_lora=users)

    def args(name: str, batch_size: int, placement: str = "shard") -> list:
        return train_args(
            tiny_teacher,
            tmp_path / name,
            tmp_path / "cache",
            batch_size=batch_size,
            teacher_placement=placement,
            **common,
        )

    launcher = [*WARM_TORCHRUN, "--standalone", "--nproc_per_node=2"]
    flat = run([*launcher, str(REPO / "train_distillation.py"), *map(str, args("flat", 2))])
    assert "teacher sharded over all 2 ranks" in flat.stderr
    assert "style_high_noise.safetensors into the teacher's" in flat.stderr, flat.stderr[-3000:]
    whole = run([*launcher, str(REPO / "train_distillation.py"), *map(str, args("whole", 2, "gpu"))])
    assert "teacher placement: gpu" in whole.stdout + whole.stderr
    # One process: `shard` falls back to a whole teacher (nothing to shard over).
    assert main(args("one", 4)) == 0
    logs = run_two_nodes(args("nodes", 1), per_node=2, run_id="two-by-two")
    assert "teacher sharded within each node (2 ranks) and replicated across 2 nodes" in logs
    assert "all 4 ranks hold identical student weights" in logs
    assert_same_trajectory([tmp_path / "flat", tmp_path / "whole"])
    assert_same_trajectory([tmp_path / "one", tmp_path / "flat"])
    assert_same_trajectory([tmp_path / "one", tmp_path / "nodes"])


def test_nodes_of_different_sizes_are_refused_by_every_rank_before_sharding():
    """2 + 1 ranks: the node size (LOCAL_WORLD_SIZE) differs and WORLD_SIZE 3 is no multiple of 2.
    Every rank refuses alike (a rank that went on alone would hang in the mesh's collectives)."""
    logs = run_two_nodes([], per_node=(2, 1), run_id="uneven-nodes", script="tests/mesh_layout_check.py")
    refusal = "refused: --teacher_placement shard across nodes needs the same number of ranks on every node"
    for rank in range(3):
        assert f"rank {rank} {refusal} (LOCAL_WORLD_SIZE from 1 to 2, WORLD_SIZE 3)" in logs, logs[-3000:]
