"""Turn an unexpected exception into the report a user can act on.

The entry point hands every exception that is not already a `DistillError` to `failure_report`,
which recognises the failures users meet in their first week (out of memory, a DataLoader worker
that died, NCCL errors, DDP's unused-parameter error, a rank that vanished) and explains each
with fixes computed from the run's own settings. Anything else keeps its traceback.
"""

from __future__ import annotations

import os
import shlex
import traceback
from collections.abc import Callable

from distill import errors, workers
from distill.errors import DistillError, Progress, Stage, current_rank


def first_line(exc: BaseException) -> str:
    """The first line of an exception's message (empty for none)."""
    text = str(exc).strip()
    return text.splitlines()[0] if text else ""


# ---------------------------------------------------------------------------------------------
# Rewriting the user's command line
# ---------------------------------------------------------------------------------------------


def rewrite(argv: list[str], flag: str, value: str | None = None) -> list[str]:
    """argv with `flag` set (to `value`, or as a switch), dropping earlier settings of it.

    `--flag v`, `--flag=v` and a switch's `--no-flag` form are all removed first.
    """
    negated = "--no-" + flag[2:]
    out, skip = [], False
    for i, arg in enumerate(argv):
        if skip:
            skip = False
            continue
        if arg in (flag, negated) or arg.startswith(flag + "="):
            # `--flag value`: also drop the value, unless the next word is another flag (a switch)
            skip = arg == flag and i + 1 < len(argv) and not argv[i + 1].startswith("--")
            continue
        out.append(arg)
    return out + ([flag] if value is None else [flag, value])


def without(argv: list[str], *flags: str) -> list[str]:
    """argv with every setting of `flags` removed (value-taking or switch)."""
    for flag in flags:
        argv = rewrite(argv, flag)[:-1]
    return argv


def launcher() -> str:
    """How this run was started, for a corrected command: torchrun with the same shape, or python."""
    if current_rank() is None:
        return "python train_distillation.py"
    local = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE", "1")))
    nodes = int(os.environ.get("WORLD_SIZE", str(local))) // max(local, 1)
    if nodes > 1:
        return f"torchrun --nnodes={nodes} --nproc_per_node={local} ... train_distillation.py"
    return f"torchrun --standalone --nproc_per_node={local} train_distillation.py"


def command(argv: list[str]) -> str:
    return " ".join([launcher(), shlex.join(argv)]).rstrip()


def _config(argv: list[str]):  # noqa: ANN202 - TrainConfig, imported lazily (config imports errors)
    """The run's settings as the trainer resolved them, or None when argv is not a trainer command line."""
    from distill.config import parse_config

    try:
        return parse_config(argv)
    except (DistillError, SystemExit):
        return None


def _valid(argv: list[str]) -> bool:
    return _config(argv) is not None


def _config_file_values(argv: list[str]) -> dict:
    from distill.config import load_config_file

    path = next((argv[i + 1] for i, a in enumerate(argv[:-1]) if a == "--config"), None)
    path = path or next((a.split("=", 1)[1] for a in argv if a.startswith("--config=")), None)
    try:
        return load_config_file(path) if path else {}
    except DistillError:
        return {}


def set_placement(argv: list[str], placement: str) -> list[str]:
    """argv with the teacher placement set to `placement`, whatever spelling the user had used.

    --teacher_on_cpu and --teacher_device_strategy are aliases that conflict with a different
    --teacher_placement, on the command line or in a --config file, so they are removed or
    overridden to agree.
    """
    argv = without(argv, "--teacher_on_cpu", "--teacher_device_strategy")
    argv = rewrite(argv, "--teacher_placement", placement)
    from_file = _config_file_values(argv)
    if from_file.get("teacher_on_cpu") and placement != "cpu":
        argv.append("--no-teacher_on_cpu")
    if from_file.get("teacher_device_strategy") is not None:
        argv += ["--teacher_device_strategy", {"cpu": "cpu", "shard": "balanced"}.get(placement, "auto")]
    return argv


# ---------------------------------------------------------------------------------------------
# Out of memory
# ---------------------------------------------------------------------------------------------

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
    if placement in ("auto", "gpu") and world > 1:
        fixes.append(
            f"--teacher_placement shard: each of the {world} ranks holds 1/{world} of the teacher and "
            f"gathers one block at a time, the largest saving with several GPUs{maybe}"
        )
        combined = set_placement(combined, "shard")
    elif placement in ("auto", "gpu") and gpu:
        fixes.append(
            "--teacher_placement cpu: keep the teacher in CPU RAM and stream it to the GPU block by block, "
            f"the largest saving on one GPU (steps get slower){maybe}"
        )
        combined = set_placement(combined, "cpu")
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
    cfg = _config(argv)
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
    if combined != argv and _valid(combined):
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


# ---------------------------------------------------------------------------------------------
# DataLoader workers
# ---------------------------------------------------------------------------------------------

WORKER_MARKERS = (
    "DataLoader worker (pid",  # "... is killed by signal: X" / "... exited unexpectedly"
    "out of shared memory",
    "insufficient shared memory",
    "unable to open shared memory object",
    "unable to write to file </torch_",
)


# How long a report waits for a worker whose sockets closed to be seen exiting (normally milliseconds;
# seconds on a machine starved of CPU).
WORKER_EXIT_WAIT_S = 5.0


def is_worker_failure(exc: BaseException) -> bool:
    return any(marker in str(exc) for marker in WORKER_MARKERS)


def shared_memory_picture() -> str:
    try:
        stat = os.statvfs("/dev/shm")
    except OSError:
        return "/dev/shm: not found"
    gib = 1024**3
    return f"/dev/shm: {stat.f_bavail * stat.f_frsize / gib:.2f} GiB free of {stat.f_blocks * stat.f_frsize / gib:.2f} GiB"


def dataloader_worker_error(
    exc: BaseException, argv: list[str] | None = None, dead: list[workers.DeadWorker] | None = None
) -> DistillError:
    """A DataLoader worker process died (a signal, the OOM killer, or /dev/shm too small).

    `dead` names the workers seen dead; without it, the exception's own text is the evidence.
    """
    argv = list(Progress.argv if argv is None else argv)
    cfg = _config(argv)
    workers = cfg.num_workers if cfg is not None else None
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    count = (
        f"--num_workers {workers} per rank x {per_node} rank(s) on this node = {workers * per_node} worker processes"
        if workers is not None
        else f"{per_node} rank(s) on this node"
    )
    fixes = [
        "--num_workers 0: read the cache in the training process itself (no worker processes, no shared "
        "memory; the cache reads are small) -- it also shows the real error if a worker crashed:\n       "
        + command(rewrite(argv, "--num_workers", "0")),
        "a larger /dev/shm, where workers hand batches over: `docker run --shm-size=16g` (or --ipc=host); "
        "on Kubernetes mount an emptyDir with medium: Memory at /dev/shm",
    ]
    if workers is not None and workers > 1:
        fixes.append(f"fewer workers per rank: --num_workers {workers // 2} (every rank starts its own)")
    fixes.append("then rerun the same command: --resume auto continues from the last checkpoint")
    return DistillError(
        f"a DataLoader worker process died during {Progress.where()}",
        "\n".join(
            [
                *(worker.describe() for worker in dead or []),
                f"the training process then saw {type(exc).__name__}: {first_line(exc)}"
                if dead
                else f"{type(exc).__name__}: {first_line(exc)}",
                shared_memory_picture(),
                count,
            ]
        ),
        causes=[
            "/dev/shm too small for the batches in flight (docker's default is 64 MB): 'Bus error', "
            "'out of shared memory', 'No space left on device'",
            "the host ran out of RAM and the kernel killed the worker ('signal: Killed'; see `dmesg | grep -i oom`)",
            "a crash inside the worker ('signal: Aborted' / 'Segmentation fault'); --num_workers 0 shows it",
        ],
        fixes=fixes,
        stage=Stage.DATA,
    )


# ---------------------------------------------------------------------------------------------
# DDP: parameters that got no gradient
# ---------------------------------------------------------------------------------------------

UNUSED_PARAMETER_MARKERS = (
    "Expected to have finished reduction in the prior iteration",
    "did not receive grad",
    "were not used in producing loss",
)


def is_unused_parameters(exc: BaseException) -> bool:
    return any(marker in str(exc) for marker in UNUSED_PARAMETER_MARKERS)


def unused_parameters_error(exc: BaseException) -> DistillError:
    """DDP found student parameters that took no part in the loss."""
    text = str(exc)
    named = "\n".join(line.strip() for line in text.splitlines() if "did not receive grad" in line)
    return DistillError(
        f"DDP: some student parameters received no gradient (during {Progress.where()})",
        "DDP all-reduces every parameter's gradient after each backward. A parameter that takes no part "
        "in the loss never gets one, so DDP is still waiting for it when the next step starts "
        "('Expected to have finished reduction in the prior iteration').\n"
        + (named or "Rerun with --debug_distributed: TORCH_DISTRIBUTED_DEBUG=INFO names the parameters."),
        causes=[
            "a student with modules text-to-video never calls: image_dim / added_kv_proj_dim (the "
            "image-to-video embedder and projections) in --student_config or in a --student_init model",
            "the student or the loss was changed so that a branch is skipped",
        ],
        fixes=[
            "remove image_dim and added_kv_proj_dim from --student_config (or set them to null)",
            "--debug_distributed (TORCH_DISTRIBUTED_DEBUG=INFO): the error then names the parameters",
            "if it happens with the shipped student configs, report it with the command line",
        ],
        stage=Stage.TRAINING,
    )


# ---------------------------------------------------------------------------------------------
# NCCL during training, and ranks that vanished
# ---------------------------------------------------------------------------------------------

PEER_LOST_MARKERS = (
    "Connection closed by peer",
    "Connection reset by peer",
    "Broken pipe",
    "NCCL communicator was aborted",
    "ProcessGroupNCCL is aborted",
    "DistNetworkError",
    "recvBytes",
    "Socket Timeout",
)

NCCL_MARKERS = (
    "NCCL error",
    "unhandled system error",
    "unhandled cuda error",
    "internal error - please report this issue to the NCCL developers",
    "remote process exited or there was a network error",
    "ncclSystemError",
    "ncclInternalError",
    "ncclUnhandledCudaError",
    "ncclRemoteError",
    "Watchdog caught collective operation timeout",
    "ProcessGroupNCCL",
)


def is_peer_lost(exc: BaseException) -> bool:
    """A connection to another rank broke; never said of a single process, which has no peer."""
    if int(os.environ.get("WORLD_SIZE", "1")) < 2:
        return False
    text = f"{type(exc).__name__}: {exc}"
    return any(marker in text for marker in PEER_LOST_MARKERS)


def is_nccl_error(exc: BaseException) -> bool:
    return any(marker in str(exc) for marker in NCCL_MARKERS)


def peer_lost_error(exc: BaseException) -> DistillError:
    return DistillError(
        f"lost contact with another rank during {Progress.where()} (SECONDARY failure)",
        f"{type(exc).__name__}: {exc}",
        causes=[
            "another rank died first: look for its own error banner above, or for 'SIGKILL' / "
            "'Signals.SIGKILL' in torchrun's summary (the host OOM killer does this)",
            "a network problem between nodes",
        ],
        fixes=[
            "fix the first rank's failure; this rank only stopped because of it",
            "if a rank was SIGKILLed, check `dmesg | grep -i oom` and reduce host memory use",
            "rerun with --resume auto to continue from the last checkpoint",
        ],
        stage=Stage.TRAINING,
        secondary=True,
    )


def nccl_error(exc: BaseException) -> DistillError:
    """NCCL failed inside a collective: a timeout, or a system / CUDA / network error."""
    text = str(exc)
    timeout = "Watchdog caught collective operation timeout" in text or "timed out" in text.lower()
    causes = (
        [
            "a rank stopped making progress (a hang, or it died without its peers noticing): the stall "
            "watchdog (--stall_timeout) prints every rank's stacks before this timeout",
            "ranks called different collectives (a rank skipped a step or took another branch)",
            "--dist_timeout shorter than a legitimately slow step (large --gradient_accumulation_steps)",
        ]
        if timeout
        else [
            "the network between GPUs or nodes: NCCL picked an interface the others cannot reach, or "
            "InfiniBand is present but not working",
            "/dev/shm too small for NCCL's shared-memory transport (docker: --shm-size or --ipc=host)",
            "an NCCL build that does not match the driver, or a GPU in a bad state (nvidia-smi, dmesg)",
            "another rank died first: a banner from that rank above makes this one secondary",
        ]
    )
    if timeout:
        fixes = [
            "read the stall watchdog's report above (every rank's stacks): the rank not waiting inside a "
            "collective is the one that stopped; --stall_timeout sets how soon it reports",
            "--debug_distributed: the NCCL and torch.distributed logs of every rank",
            "if a step legitimately takes longer, raise --dist_timeout (minutes)",
        ]
    else:
        fixes = [
            "--debug_distributed: NCCL_DEBUG=INFO (INIT, NET and ENV) shows which transport and "
            "interface each rank uses and where it fails",
            "NCCL_SOCKET_IFNAME=<interface> (see `ip addr`) when NCCL picks the wrong network interface",
            "NCCL_IB_DISABLE=1 to rule out InfiniBand",
        ]
    fixes += [
        "DDP_BACKEND=gloo (slower) separates NCCL from the rest: if gloo runs, the problem is NCCL, "
        "its driver or the GPU network",
        "python -m distill.doctor under the same torchrun command tests a collective alone",
        "rerun with --resume auto to continue from the last checkpoint",
    ]
    return DistillError(
        f"NCCL failed during {Progress.where()}" + (" (a collective timed out)" if timeout else ""),
        f"{type(exc).__name__}: {first_line(exc)}",
        causes=causes,
        fixes=fixes,
        stage=Stage.TRAINING,
    )


# ---------------------------------------------------------------------------------------------
# Anything else, and the dispatcher
# ---------------------------------------------------------------------------------------------


def unexpected_error(exc: BaseException) -> DistillError:
    """Any other exception: its type, message and traceback, with the stage and step it happened in."""
    trace = "".join(traceback.format_exception(exc)).rstrip()
    return DistillError(
        f"unexpected {type(exc).__name__} during {Progress.where()}",
        f"{exc}\n\n{trace}",
        fixes=[
            "rerun with --resume auto: training continues from the last complete checkpoint",
            "if it happens again, report it with the traceback above and your command line",
        ],
        stage=Stage.INTERNAL,
    )


# First match wins: a dead worker or a DDP error can mention NCCL, and a vanished peer is
# reported as secondary before any NCCL-specific advice.
RECOGNISED: tuple[tuple[Callable[[BaseException], bool], Callable[[BaseException], DistillError]], ...] = (
    (is_out_of_memory, out_of_memory_error),
    (is_worker_failure, dataloader_worker_error),
    (is_unused_parameters, unused_parameters_error),
    (is_peer_lost, peer_lost_error),
    (is_nccl_error, nccl_error),
)


def _may_hide_a_dead_worker(exc: BaseException) -> bool:
    """Errors a worker's death shows up as before its exit can be seen (a broken hand-over)."""
    return isinstance(exc, (ConnectionError, EOFError)) or is_worker_failure(exc)


def failure_report(exc: BaseException) -> DistillError:
    """The DistillError to report for any exception that ended the run.

    What actually died comes first: a DataLoader worker of this process that is seen dead makes
    the failure a data failure, whatever the exception that reached the loop says.
    """
    if isinstance(exc, DistillError):
        return exc
    dead = workers.dead_workers(wait_s=WORKER_EXIT_WAIT_S if _may_hide_a_dead_worker(exc) else 0.0)
    if dead:
        return dataloader_worker_error(exc, dead=dead)
    for recognise, explain in RECOGNISED:
        if recognise(exc):
            return explain(exc)
    return unexpected_error(exc)
