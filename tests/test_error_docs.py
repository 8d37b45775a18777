"""TORCHRUN_ERROR_FIXES.md shows the exact banners the trainer prints; this keeps them in sync.

Each example in the document sits between `<!-- example: NAME -->` and `<!-- /example -->`. The
test produces the same failure through the real code path, with fixed inputs, and compares.
After changing a message, refresh the document with:

    .venv/bin/python tests/test_error_docs.py --write
"""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from distill.config.cli import parse_config  # noqa: E402
from distill.models.teacher import inspect_teacher  # noqa: E402
from distill.ops import distributed, errors, watchdog, workers  # noqa: E402
from distill.ops.errors import DistillError, Progress, Stage, format_banner  # noqa: E402
from distill.ops.launch_check import launch_error  # noqa: E402
from distill.train import diagnose  # noqa: E402

DOC = REPO / "TORCHRUN_ERROR_FIXES.md"
BLOCK = re.compile(r"<!-- example: (?P<name>[\w-]+) -->\n```text\n(?P<body>.*?)```\n<!-- /example -->", re.S)
TORCHRUN_ENV = {
    "RANK": "1",
    "WORLD_SIZE": "2",
    "LOCAL_RANK": "1",
    "LOCAL_WORLD_SIZE": "2",
    "MASTER_ADDR": "node-a",
    "MASTER_PORT": "29500",
    "GROUP_RANK": "0",
    "CUDA_VISIBLE_DEVICES": "0,1",
}


def _raised(fn: Callable[[], object]) -> DistillError:
    try:
        fn()
    except DistillError as error:
        return error
    raise AssertionError("expected a DistillError")


def _python_before_script() -> DistillError:
    os.environ["TORCHELASTIC_RUN_ID"] = "example"
    return launch_error("python", ["train_distillation.py", "--batch_size", "2"])


def _out_of_memory() -> DistillError:
    Progress.argv = [
        "--teacher_path",
        "models/Wan2.2-T2V-A14B-Diffusers",
        "--student_config",
        "config/student_config.json",
        "--data_path",
        "data/static_prompts.txt",
        "--output_dir",
        "outputs/run1",
        "--batch_size",
        "4",
    ]
    Progress.enter(Stage.TRAINING, 120)
    errors.memory_picture = lambda: (  # a GPU's numbers, so the example reads as it does on a node
        "GPU 1 (NVIDIA H100 80GB HBM3): allocated 76.10 GiB, reserved 78.02 GiB, peak 77.94 GiB, "
        "free 0.31 GiB of 79.19 GiB"
    )
    exc = torch.OutOfMemoryError(
        "CUDA out of memory. Tried to allocate 2.00 GiB. GPU 1 has a total capacity of 79.19 GiB"
    )
    return diagnose.out_of_memory_error(exc, gpu=True)  # as on a GPU node, whatever runs the test


def _unexpected() -> DistillError:
    Progress.enter(Stage.TRAINING, 1200)
    return diagnose.failure_report(ValueError("cannot reshape tensor of 0 elements into shape [0, -1]"))


def _peer_lost() -> DistillError:
    Progress.enter(Stage.TRAINING, 57)
    return diagnose.failure_report(
        RuntimeError("[gloo/transport/tcp/pair.cc:537] Read error: Connection reset by peer")
    )


def _nccl_without_cuda(variable: bool = False) -> DistillError:
    if torch.cuda.is_available():
        pytest.skip("CUDA present: nccl is valid on this machine")
    if variable:
        os.environ["DDP_BACKEND"] = "nccl"
    return _raised(lambda: distributed.choose_backend("auto" if variable else "nccl"))


def _dataloader_worker() -> DistillError:
    Progress.argv = ["--teacher_path", "models/Wan2.2-T2V-A14B-Diffusers", "--student_config",
                     "config/student_config.json", "--data_path", "data/static_prompts.txt",
                     "--output_dir", "outputs/run1", "--num_workers", "4"]  # fmt: skip
    Progress.enter(Stage.TRAINING, 311)
    diagnose.shared_memory_picture = lambda: "/dev/shm: 0.00 GiB free of 0.06 GiB"  # docker's default
    # What the report says when it finds the worker dead (here of SIGBUS) behind a broken hand-over.
    return diagnose.dataloader_worker_error(
        ConnectionResetError(104, "Connection reset by peer"), dead=[workers.DeadWorker(48113, -7)]
    )


def _ddp_unused_parameters() -> DistillError:
    Progress.enter(Stage.TRAINING, 2)
    return diagnose.failure_report(
        RuntimeError(
            "Expected to have finished reduction in the prior iteration before starting a new one. This error "
            "indicates that your module has parameters that were not used in producing loss.\n"
            "Parameter indices which did not receive grad for rank 1: 13 14 15 16 17 18 19 20"
        )
    )


def _nccl_in_training() -> DistillError:
    Progress.enter(Stage.TRAINING, 40)
    return diagnose.failure_report(
        torch.distributed.DistBackendError(
            "NCCL error in: ../torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp:1970, unhandled system error "
            "(run with NCCL_DEBUG=INFO for details), NCCL version 2.21.5"
        )
    )


def _nccl_timeout() -> DistillError:
    Progress.enter(Stage.TRAINING, 40)
    return diagnose.failure_report(
        torch.distributed.DistBackendError(
            "[Rank 1] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=83, OpType=ALLREDUCE, "
            "NumelIn=2, NumelOut=2, Timeout(ms)=600000) ran for 600042 milliseconds before timing out."
        )
    )


def _stalled() -> DistillError:
    location = (
        "/usr/lib/python3.11/site-packages/torch/autograd/graph.py:829 in _engine_run_backward\n"
        "  called from /work/distill/train/loop.py:311 in micro_step"
    )
    return watchdog.stall_error(Stage.TRAINING, 3, 600.0, location)


EXAMPLES: dict[str, Callable[[], DistillError]] = {
    "python-before-script": _python_before_script,
    "unknown-flag": lambda: _raised(lambda: parse_config(["--teacher_pth", "models/wan"])),
    "path-for-flag": lambda: _raised(lambda: parse_config(["configs/run.yaml"])),
    "torchrun-flag-after-script": lambda: _raised(lambda: parse_config(["--nproc_per_node=8"])),
    "nccl-without-cuda": _nccl_without_cuda,
    "local-rank-without-gpu": lambda: distributed.local_rank_error(1, 1),
    "ddp-backend-nccl-without-cuda": lambda: _nccl_without_cuda(variable=True),
    "init-process-group": lambda: distributed.init_failure_error(
        RuntimeError(
            "The client socket has timed out after 600000ms while trying to connect to (node-a, 29500)."
        ),
        60,
        "nccl",
    ),
    "teacher-missing": lambda: _raised(lambda: inspect_teacher("/data/Wan2.2-T2V-A14B-Diffusers")),
    "out-of-memory": _out_of_memory,
    "dataloader-worker": _dataloader_worker,
    "ddp-unused-parameters": _ddp_unused_parameters,
    "nccl-in-training": _nccl_in_training,
    "nccl-timeout": _nccl_timeout,
    "stalled": _stalled,
    "unexpected": _unexpected,
    "peer-lost": _peer_lost,
}


def render(name: str) -> str:
    saved_env, saved_pictures = dict(os.environ), (errors.memory_picture, diagnose.shared_memory_picture)
    try:
        os.environ.pop("DDP_BACKEND", None)
        os.environ.update(TORCHRUN_ENV)
        return format_banner(EXAMPLES[name](), rank=1) + "\n"
    finally:
        os.environ.clear()
        os.environ.update(saved_env)
        errors.memory_picture, diagnose.shared_memory_picture = saved_pictures
        Progress.enter(Stage.SETUP)
        Progress.argv = []


def test_every_example_is_in_the_document() -> None:
    names = [m["name"] for m in BLOCK.finditer(DOC.read_text())]
    assert sorted(names) == sorted(EXAMPLES)


@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_document_shows_the_real_message(name: str) -> None:
    blocks = {m["name"]: m["body"] for m in BLOCK.finditer(DOC.read_text())}
    assert blocks[name] == render(name), f"refresh with: python tests/test_error_docs.py --write ({name})"


def write() -> None:
    text = DOC.read_text()

    def fill(match: re.Match) -> str:
        return f"<!-- example: {match['name']} -->\n```text\n{render(match['name'])}```\n<!-- /example -->"

    DOC.write_text(BLOCK.sub(fill, text))


if __name__ == "__main__":
    if "--write" in sys.argv:
        write()
        print(f"refreshed {DOC}")


def test_the_exit_code_table_matches_the_code() -> None:
    from train_distillation import EXIT_PREEMPTED

    section = DOC.read_text().split("## Exit codes", 1)[1].split("\n## ", 1)[0]
    rows = dict(re.findall(r"^\|\s*(\d+)\s*\|\s*([a-z ]+?)\s*\|", section, flags=re.M))
    expected = {str(int(stage)): stage.name.lower().replace("_", " ") for stage in Stage}
    expected.update({"0": "finished", str(EXIT_PREEMPTED): "preempted"})
    assert rows == expected
