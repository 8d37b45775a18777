"""Turn an unexpected exception into the report a user can act on.

The entry point hands every exception that is not already a `DistillError` to `failure_report`,
which recognises the failures users meet in their first week (out of memory, a DataLoader worker
that died, NCCL errors, DDP's unused-parameter error, a rank that vanished) and explains each
with fixes computed from the run's own settings. Anything else keeps its traceback.
"""

from __future__ import annotations

import os
import traceback
from collections.abc import Callable

from distill.ops import workers
from distill.ops.errors import DistillError, Progress, Stage
from distill.train.commands import command, config_of, first_line, rewrite
from distill.train.oom import is_out_of_memory, out_of_memory_error

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
    cfg = config_of(argv)
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
