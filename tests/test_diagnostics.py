"""Failures are recognised and explained with advice that fits the run (distill/train/diagnose.py,
distill/ops/watchdog.py, distill/ops/distributed.py's setup messages)."""

from __future__ import annotations

import io
import json
import shlex
import sys
import threading

import pytest
import torch
from conftest import REPO, train_args

from distill.config.cli import parse_config
from distill.ops import distributed, watchdog
from distill.ops.errors import DistillError, Progress, Stage
from distill.train.diagnose import failure_report
from distill.train.oom import out_of_memory_error
from train_distillation import main

BASE = [
    "--teacher_path",
    "models/Wan2.2-T2V-A14B-Diffusers",
    "--student_config",
    "config/student_config.json",
    "--data_path",
    "data/static_prompts.txt",
    "--output_dir",
    "outputs/run1",
]
CUDA_OOM = torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB.")


@pytest.fixture(autouse=True)
def _single_process(monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "DDP_BACKEND"):
        monkeypatch.delenv(name, raising=False)
    yield
    Progress.enter(Stage.SETUP)


def as_torchrun(monkeypatch, world: int) -> None:
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", str(world))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(world))


def combined_command(error: DistillError) -> list[str]:
    """The trainer arguments of the 'all at once' fix (what follows the script name)."""
    line = next(f for f in error.fixes if "at once" in f).split("\n", 1)[1].strip()
    words = shlex.split(line)
    return words[words.index("train_distillation.py") + 1 :]


# ------------------------------------------------------------------------------------------------
# Out of memory
# ------------------------------------------------------------------------------------------------


def test_oom_at_batch_1_claims_no_same_global_batch():
    error = out_of_memory_error(CUDA_OOM, BASE, world_size=1, gpu=True)
    text = "\n".join(error.fixes)
    assert "same global batch" not in text
    assert "--batch_size is already 1" in text
    cfg = parse_config(combined_command(error))
    assert (cfg.batch_size, cfg.gradient_accumulation_steps) == (1, 1)


@pytest.mark.parametrize(
    ("extra", "world", "file_settings"),
    [
        (["--teacher_placement", "gpu", "--batch_size", "4"], 1, {}),
        (["--teacher_placement", "gpu", "--batch_size", "6", "--gradient_accumulation_steps", "2"], 8, {}),
        (["--teacher_device_strategy", "auto", "--batch_size", "3"], 2, {}),
        (["--teacher_placement=gpu"], 4, {}),
        ([], 4, {"teacher_on_cpu": False, "teacher_device_strategy": "auto", "batch_size": 2}),
        ([], 1, {"teacher_placement": "gpu"}),
    ],
)
def test_oom_command_passes_the_trainers_validation_and_keeps_the_global_batch(
    monkeypatch, tmp_path, extra, world, file_settings
):
    argv = BASE + extra
    if file_settings:
        config = tmp_path / "run.json"
        config.write_text(json.dumps(file_settings))
        argv += ["--config", str(config)]
    if world > 1:
        as_torchrun(monkeypatch, world)
    before = parse_config(argv)
    error = out_of_memory_error(CUDA_OOM, argv, world_size=world, gpu=True)
    after = parse_config(combined_command(error))  # raises if the trainer would refuse it
    expected = "shard" if world > 1 else "cpu"
    assert after.teacher_placement == expected
    assert f"--teacher_placement {expected}" in error.fixes[0]
    assert after.gradient_checkpointing
    assert after.batch_size * after.gradient_accumulation_steps == (
        before.batch_size * before.gradient_accumulation_steps
    )
    assert after.batch_size <= before.batch_size


def test_oom_with_several_gpus_suggests_shard_and_a_cpu_teacher_is_left_on_the_cpu(monkeypatch):
    as_torchrun(monkeypatch, 4)
    auto = out_of_memory_error(CUDA_OOM, BASE, gpu=True)
    assert auto.fixes[0].startswith("--teacher_placement shard: each of the 4 ranks holds 1/4")
    assert parse_config(combined_command(auto)).teacher_placement == "shard"
    # The teacher is already off the GPUs: moving it back onto them (shard) would not help.
    on_cpu = out_of_memory_error(CUDA_OOM, [*BASE, "--teacher_on_cpu"], gpu=True)
    assert not any("--teacher_placement" in fix for fix in on_cpu.fixes)
    assert parse_config(combined_command(on_cpu)).teacher_placement == "cpu"


LORA = [a for a in BASE if a not in ("--student_config", "config/student_config.json")] + [
    "--method",
    "dmd",
    "--student_lora_rank",
    "64",
]


@pytest.mark.parametrize(
    ("extra", "world", "placement", "first"),
    [
        ([], 1, "auto", "--expert_phase high, then"),
        (["--critic_lora_rank", "0"], 4, "shard", "--critic_lora_rank 64 --teacher_placement shard"),
        ([], 4, "shard", "--teacher_placement shard: each of the 4 ranks"),
    ],
)
def test_oom_in_a_lora_run_offers_what_a_lora_run_accepts(monkeypatch, extra, world, placement, first):
    """Never the cpu placement (the adapters train inside the experts) nor a smaller student config."""
    if world > 1:
        as_torchrun(monkeypatch, world)
    error = out_of_memory_error(CUDA_OOM, [*LORA, *extra], world_size=world, gpu=True)
    text = "\n".join(error.fixes)
    assert error.fixes[0].startswith(first), error.fixes
    assert "--teacher_placement cpu" not in text and "--student_config" not in text
    assert "--student_lora_rank" in text
    after = parse_config(combined_command(error))  # raises if the trainer would refuse it
    assert after.teacher_placement == placement and after.gradient_checkpointing


def test_oom_suggests_bfloat16_only_where_the_teacher_is_float32():
    def suggests_bf16(argv: list[str], gpu: bool) -> bool:
        return any("--teacher_dtype bfloat16" in f for f in out_of_memory_error(CUDA_OOM, argv, 1, gpu).fixes)

    assert not suggests_bf16(BASE, gpu=True)  # auto is already bfloat16 on CUDA
    assert not suggests_bf16([*BASE, "--teacher_dtype", "float16"], gpu=True)
    assert suggests_bf16([*BASE, "--teacher_dtype", "float32"], gpu=True)
    assert suggests_bf16([*BASE, "--device", "cpu"], gpu=False)  # auto is float32 on the CPU


@pytest.mark.parametrize(
    "exc",
    [
        RuntimeError("CUDA error: out of memory\nCUDA kernel errors might be asynchronously reported"),
        RuntimeError("[enforce fail at alloc_cpu.cpp:117] DefaultCPUAllocator: can't allocate memory"),
        MemoryError(),
        CUDA_OOM,
    ],
)
def test_every_spelling_of_out_of_memory_is_recognised(exc):
    assert failure_report(exc).stage == Stage.OUT_OF_MEMORY


def test_a_gpu_oom_from_the_real_entry_point_gets_advice_for_its_own_flags(
    tiny_teacher, shared_cache, tmp_path, monkeypatch, capsys
):
    monkeypatch.setenv("DISTILL_INJECT_FAULT", "oom:2")
    argv = train_args(tiny_teacher, tmp_path / "out", shared_cache, batch_size=2, teacher_placement="gpu")
    assert main(argv) == int(Stage.OUT_OF_MEMORY)
    err = capsys.readouterr().err
    assert "out of memory during training, step 2" in err
    command = next(
        line for line in err.splitlines() if line.lstrip().startswith("python train_distillation.py")
    )
    cfg = parse_config(shlex.split(command)[2:])
    assert (cfg.batch_size, cfg.gradient_accumulation_steps, cfg.gradient_checkpointing) == (1, 2, True)
    # On a GPU the teacher moves to CPU RAM; a rehearsed OOM on a CPU machine is about host RAM.
    assert cfg.teacher_placement == ("cpu" if torch.cuda.is_available() else "gpu")


# ------------------------------------------------------------------------------------------------
# DDP: parameters without gradient (a real DDP error from a real student)
# ------------------------------------------------------------------------------------------------


def test_ddp_unused_parameter_error_is_explained():
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from distill.models.student import build_student

    config = {k: v for k, v in json.loads((REPO / "config" / "student_tiny.json").read_text()).items()}
    config = {k: v for k, v in config.items() if not k.startswith("_")}
    config["image_dim"] = 32  # an image-to-video embedder text-to-video never calls
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        model = DistributedDataParallel(build_student(config, seed=0))
        inputs = dict(
            hidden_states=torch.randn(1, 16, 1, 8, 8),
            timestep=torch.tensor([500]),
            encoder_hidden_states=torch.randn(1, 4, 32),
            return_dict=False,
        )
        with pytest.raises(RuntimeError) as raised:
            for _ in range(2):
                model(**inputs)[0].square().mean().backward()
    finally:
        dist.destroy_process_group()
    Progress.enter(Stage.TRAINING, 2)
    error = failure_report(raised.value)
    assert error.title == "DDP: some student parameters received no gradient (during training, step 2)"
    assert "Parameter indices which did not receive grad for rank 0" in error.details
    assert any("image_dim" in fix for fix in error.fixes)
    assert error.stage == Stage.TRAINING


# ------------------------------------------------------------------------------------------------
# NCCL
# ------------------------------------------------------------------------------------------------


def test_nccl_init_failure_names_the_nccl_knobs_and_gloo_as_a_separator():
    error = distributed.init_failure_error(RuntimeError("NCCL error: unhandled system error"), 60, "nccl")
    text = "\n".join(error.causes + error.fixes)
    for needle in (
        "NCCL build",
        "NCCL_SOCKET_IFNAME",
        "NCCL_IB_DISABLE",
        "--debug_distributed",
        "DDP_BACKEND=gloo",
    ):
        assert needle in text, needle
    gloo = distributed.init_failure_error(RuntimeError("timeout"), 60, "gloo")
    assert "NCCL_SOCKET_IFNAME" not in "\n".join(gloo.fixes)


@pytest.mark.parametrize(
    ("message", "timed_out"),
    [
        (
            "NCCL error in: ProcessGroupNCCL.cpp:1970, unhandled system error (run with NCCL_DEBUG=INFO for "
            "details), NCCL version 2.21.5",
            False,
        ),
        (
            "[Rank 1] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=9, OpType=ALLREDUCE, "
            "NumelIn=5, NumelOut=5, Timeout(ms)=600000) ran for 600075 milliseconds before timing out.",
            True,
        ),
    ],
)
def test_nccl_errors_during_training_get_their_own_banner(message, timed_out):
    Progress.enter(Stage.TRAINING, 40)
    error = failure_report(torch.distributed.DistBackendError(message))
    assert error.title.startswith("NCCL failed during training, step 40")
    assert ("timed out" in error.title) == timed_out
    assert any("DDP_BACKEND=gloo" in fix for fix in error.fixes)
    assert error.stage == Stage.TRAINING


def test_ddp_backend_nccl_on_a_cpu_machine_names_the_variable(monkeypatch):
    if torch.cuda.is_available():
        pytest.skip("CUDA present: nccl is valid here")
    monkeypatch.setenv("DDP_BACKEND", "nccl")
    with pytest.raises(DistillError) as raised:
        distributed.choose_backend("auto")
    assert "DDP_BACKEND=nccl" in raised.value.title
    assert raised.value.fixes[0].startswith("unset DDP_BACKEND")
    assert distributed.choose_backend("gloo") == "gloo"  # an explicit --backend wins over the variable


# ------------------------------------------------------------------------------------------------
# Stall watchdog (in process; tests/../test_error_handling.py runs a real hang under torchrun)
# ------------------------------------------------------------------------------------------------


def test_the_watchdog_reports_stage_step_and_every_threads_stack(monkeypatch):
    stderr = io.StringIO()
    monkeypatch.setattr(sys, "stderr", stderr)
    fired = threading.Event()
    dog = watchdog.StallWatchdog(0.2, on_stall=fired.set).start()
    try:
        dog.beat(Stage.TRAINING, 7)
        assert fired.wait(30)
    finally:
        dog.stop()
    text = stderr.getvalue()
    assert "ERROR (stalled): no progress for 0.2 s during training, step 7 (stall watchdog)" in text
    assert "Thread MainThread" in text and "test_the_watchdog_reports" in text  # the main thread's stack
    assert "(exit code 11)" in text
    assert "It is NOT inside a collective: this rank is probably the one that stalled" in text


def test_a_paused_watchdog_never_fires():
    fired = threading.Event()
    dog = watchdog.StallWatchdog(0.5, on_stall=fired.set).start()
    try:
        dog.beat(Stage.TRAINING, 1)
        dog.pause()
        assert not fired.wait(2.0)  # four timeouts long
    finally:
        dog.stop()


def test_stall_timeout_is_validated():
    assert parse_config([*BASE, "--stall_timeout", "0.5"]).stall_timeout == 0.5
    with pytest.raises(DistillError, match="--stall_timeout"):
        parse_config([*BASE, "--stall_timeout", "-1"])
