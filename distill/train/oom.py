"""Out of memory, recognised on any device, with fixes computed from the run's own settings:
a smaller batch with accumulation keeping the effective batch, gradient checkpointing, a teacher
placement that frees memory, in that order of cost."""

from __future__ import annotations

import os

from distill.ops import errors
from distill.ops.errors import DistillError, Progress, Stage
from distill.train.commands import command, config_of, first_line, parses, rewrite, set_placement

OOM_MARKERS = (
    "CUDA out of memory",
    "CUDA error: out of memory",
    "CUBLAS_STATUS_ALLOC_FAILED",
    "CUDNN_STATUS_ALLOC_FAILED",
    "DefaultCPUAllocator: can't allocate memory",
    "HIP out of memory",
)


def is_out_of_memory(exc: BaseException) -> bool:
    """A device or host allocation failure, whichever way torch reported it."""
    import torch

    if isinstance(exc, (torch.OutOfMemoryError, MemoryError)):
        return True
    return isinstance(exc, RuntimeError) and any(marker in str(exc) for marker in OOM_MARKERS)


def _on_gpu(exc: BaseException) -> bool:
    """Whether the allocation that failed was on a GPU (a rehearsed OOM on a CPU machine is not)."""
    import torch

    text = str(exc)
    if "DefaultCPUAllocator" in text or type(exc) is MemoryError or not torch.cuda.is_available():
        return False
    return isinstance(exc, torch.OutOfMemoryError) or "CUDA" in text or "HIP" in text


def _split(batch: int) -> int:
    """The smallest factor > 1 of `batch`: dividing the micro-batch by it keeps the global batch exact."""
    return next(d for d in range(2, batch + 1) if batch % d == 0)


def _oom_fixes(cfg, argv: list[str], world: int, gpu: bool) -> tuple[list[str], list[str]]:  # noqa: ANN001
    """The fixes that apply to the run `cfg`, biggest saving first, and argv with all of them applied."""
    fixes: list[str] = []
    combined = list(argv)
    placement = cfg.teacher_placement  # aliases already folded in by validation
    # auto chose from measured memory: the plan printed at the start of the log says what it chose
    maybe = (
        " (auto may already have chosen it: the plan at the start of the log says)"
        if placement == "auto"
        else ""
    )
    lora = bool(cfg.student_lora_rank)
    full_critic = lora and cfg.trains_critic and not cfg.critic_adapter_rank
    if placement in ("auto", "gpu") and world > 1 and full_critic:
        fixes.append(
            "--critic_lora_rank 64 --teacher_placement shard: a LoRA critic instead of two more whole "
            f"experts, and each of the {world} ranks holds 1/{world} of the experts{maybe}"
        )
        combined = rewrite(set_placement(combined, "shard"), "--critic_lora_rank", "64")
    elif placement in ("auto", "gpu") and world > 1:
        fixes.append(
            f"--teacher_placement shard: each of the {world} ranks holds 1/{world} of the teacher and "
            f"gathers one block at a time, the largest saving with several GPUs{maybe}"
        )
        combined = set_placement(combined, "shard")
    elif placement in ("auto", "gpu") and gpu and lora:
        if cfg.expert_phase == "both":
            fixes.append(
                "--expert_phase high, then --expert_phase low --student_lora_init <its lora/>: one expert's "
                "adapters (and their AdamW state) at a time"
            )
            combined = rewrite(combined, "--expert_phase", "high")
        fixes.append("several GPUs with --teacher_placement shard: each holds 1/N of the experts")
    elif placement in ("auto", "gpu") and gpu:
        fixes.append(
            "--teacher_placement cpu: keep the teacher in CPU RAM and stream it to the GPU block by block, "
            f"the largest saving on one GPU (steps get slower){maybe}"
        )
        combined = set_placement(combined, "cpu")
    elif placement == "shard" and gpu and lora:
        fixes.append("more GPUs: every added rank shrinks each rank's share of the sharded experts")
    elif placement == "shard" and gpu:
        fixes.append(
            "more GPUs: every added rank shrinks each rank's share of the sharded teacher (or "
            "--teacher_placement cpu to take the teacher off the GPUs entirely, with much slower steps)"
        )
    on_cuda = gpu or cfg.device.startswith("cuda")
    dtype = cfg.teacher_dtype if cfg.teacher_dtype != "auto" else ("bfloat16" if on_cuda else "float32")
    if dtype == "float32":
        fixes.append("--teacher_dtype bfloat16: half the teacher's memory (it is float32 now)")
        combined = rewrite(combined, "--teacher_dtype", "bfloat16")
    if not cfg.gradient_checkpointing:
        fixes.append("--gradient_checkpointing: recompute the student's activations in backward")
        combined = rewrite(combined, "--gradient_checkpointing")
    if cfg.batch_size > 1:
        factor = _split(cfg.batch_size)
        batch, accumulation = cfg.batch_size // factor, cfg.gradient_accumulation_steps * factor
        global_batch = cfg.batch_size * cfg.gradient_accumulation_steps * world
        fixes.append(
            f"--batch_size {batch} --gradient_accumulation_steps {accumulation}: the same global batch "
            f"({global_batch} samples per step) in {factor}x smaller micro-batches"
        )
        combined = rewrite(combined, "--batch_size", str(batch))
        combined = rewrite(combined, "--gradient_accumulation_steps", str(accumulation))
    else:
        fixes.append(
            "--batch_size is already 1: fewer tokens per sample (--height, --width, --num_frames) is the "
            "remaining activation saving, and it changes what is trained"
        )
    if cfg.mixed_precision == "no" and on_cuda:
        fixes.append("--mixed_precision bf16: the student's activations in bfloat16")
        combined = rewrite(combined, "--mixed_precision", "bf16")
    if lora:
        fixes.append("smaller adapters: a lower --student_lora_rank (and --critic_lora_rank)")
    else:
        fixes.append("a smaller student (fewer num_layers / a narrower config in --student_config)")
    if not gpu and world > 1:
        fixes.append(
            f"host RAM: fewer ranks per node, or --teacher_load_concurrency 1 (the {world} ranks each read "
            "the teacher into RAM while loading)"
        )
    return fixes, combined


def out_of_memory_error(
    exc: BaseException,
    argv: list[str] | None = None,
    world_size: int | None = None,
    gpu: bool | None = None,
) -> DistillError:
    """The out-of-memory report: the memory picture, then the fixes that apply to THIS run.

    Every fix is computed from the run's resolved settings and world size (defaults: the command
    line and WORLD_SIZE of this process), and the combined command line is only offered when the
    trainer's own validation accepts it.
    """
    argv = list(Progress.argv if argv is None else argv)
    world = world_size or int(os.environ.get("WORLD_SIZE", "1"))
    gpu = _on_gpu(exc) if gpu is None else gpu
    cfg = config_of(argv)
    if cfg is None:  # not a trainer command line (a tool, a test): general advice only
        fixes, combined = (
            [
                "--teacher_placement shard (several GPUs) or cpu (one GPU) to move the teacher off each device",
                "--gradient_checkpointing, a smaller --batch_size or a smaller student",
            ],
            argv,
        )
    else:
        fixes, combined = _oom_fixes(cfg, argv, world, gpu)
    if gpu:
        fixes.append("PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to reduce fragmentation")
    if combined != argv and parses(combined):
        fixes.append("all of the flag changes above at once:\n       " + command(combined))
    cause = (
        "the teacher, the student with its optimizer state, and the activations do not fit together"
        if gpu
        else "host RAM is exhausted (teacher copies per rank, caches, DataLoader workers)"
    )
    return DistillError(
        f"out of memory during {Progress.where()}",
        f"{type(exc).__name__}: {first_line(exc)}\n{errors.memory_picture()}",
        causes=[cause],
        fixes=fixes,
        stage=Stage.OUT_OF_MEMORY,
    )
