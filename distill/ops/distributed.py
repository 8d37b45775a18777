"""Process-group setup and teardown, rank helpers, and agreeing on things across ranks.

One code path: under torchrun (`dist.is_torchelastic_launched()`) the run is data-parallel over
all ranks; under plain `python` it is one process and every helper here is a no-op. Setup
failures become `DistillError`s that print the environment torchrun gave this rank.
"""

from __future__ import annotations

import datetime
import logging
import os
import sys
from dataclasses import dataclass

import torch
import torch.distributed as dist

from distill.ops.errors import DistillError, Stage

logger = logging.getLogger(__name__)

ENV_VARS = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "GROUP_RANK",
)
# NCCL reads its variables when a communicator starts; torch reads TORCH_DISTRIBUTED_DEBUG when
# torch.distributed is imported (setup() re-reads it) and TORCH_CPP_LOG_LEVEL when torch loads
# (train_distillation.py sets it before importing torch).
# INFO, not DETAIL: DETAIL made DDP's constructor crash (SIGSEGV) with torch 2.13 on CPU/gloo, and
# INFO already makes DDP name parameters that got no gradient.
DEBUG_ENV = {
    "TORCH_DISTRIBUTED_DEBUG": "INFO",
    "NCCL_DEBUG": "INFO",
    "NCCL_DEBUG_SUBSYS": "INIT,NET,ENV",
}


@dataclass(frozen=True)
class DistContext:
    """Where this process sits in the run."""

    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    backend: str | None = None
    device: torch.device = torch.device("cpu")
    # Ranks that share one sample (--sequence_parallel): consecutive ranks form a context group.
    sequence_parallel: int = 1

    @property
    def enabled(self) -> bool:
        return self.backend is not None

    @property
    def data_rank(self) -> int:
        """Which slice of the global batch this rank's context group reads."""
        return self.rank // self.sequence_parallel

    @property
    def data_world(self) -> int:
        """How many slices the global batch has: one per context group."""
        return self.world_size // self.sequence_parallel

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def launched_by_torchrun() -> bool:
    return dist.is_torchelastic_launched()


def env_summary() -> str:
    return "\n".join(f"{name}={os.environ.get(name, '<unset>')}" for name in ENV_VARS)


def choose_backend(requested: str) -> str:
    """auto = nccl with CUDA, gloo without; DDP_BACKEND overrides an `auto` request."""
    from_env = False
    if requested == "auto":
        variable = os.environ.get("DDP_BACKEND", "").strip().lower()
        if variable and variable != "auto":
            requested, from_env = variable, True
    if requested == "auto":
        return "nccl" if torch.cuda.is_available() else "gloo"
    asked = f"DDP_BACKEND={requested} (environment)" if from_env else f"--backend {requested}"
    if requested not in ("nccl", "gloo"):
        raise DistillError(
            f"unknown distributed backend {requested!r}, from {asked}",
            fixes=[
                "set DDP_BACKEND to nccl or gloo, or unset it"
                if from_env
                else "use --backend auto, nccl or gloo"
            ],
            stage=Stage.SETUP,
        )
    if requested == "nccl" and not torch.cuda.is_available():
        if from_env:
            fixes = [
                "unset DDP_BACKEND (or set DDP_BACKEND=gloo): it overrides --backend auto, so changing "
                "--backend does nothing while it says nccl",
                "or pass --backend gloo, which wins over DDP_BACKEND",
            ]
        else:
            fixes = ["on a CPU machine use --backend gloo (or --backend auto)"]
        raise DistillError(
            f"the nccl backend needs CUDA, but torch sees no GPU on this node (asked for by {asked})",
            f"torch {torch.__version__}, CUDA build {torch.version.cuda}, "
            f"CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', '<unset>')}",
            causes=[
                "a CPU-only torch build",
                "no GPU allocated to this job",
                "CUDA_VISIBLE_DEVICES is empty",
            ],
            fixes=[
                *fixes,
                "on a GPU node check `nvidia-smi` and `python -c 'import torch; print(torch.cuda.is_available())'`",
            ],
            stage=Stage.SETUP,
        )
    return requested


def _pick_device(requested: str, local_rank: int, distributed: bool) -> torch.device:
    if requested == "cpu" or (requested == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise DistillError(
            f"--device {requested} asked for CUDA, but torch sees no GPU",
            f"torch {torch.__version__}, CUDA build: {torch.version.cuda}",
            fixes=["use --device auto (or cpu)", "install a CUDA build of torch on a GPU node"],
            stage=Stage.SETUP,
        )
    if not distributed:
        return torch.device(requested if requested != "auto" else "cuda")
    count = torch.cuda.device_count()
    if local_rank >= count:  # checked before set_device, whose own error says only "invalid device ordinal"
        raise local_rank_error(local_rank, count)
    try:
        torch.cuda.set_device(local_rank)
    except Exception as exc:
        raise DistillError(
            f"could not select GPU {local_rank}",
            f"{type(exc).__name__}: {exc}",
            causes=["the GPU is in exclusive-process mode and taken", "a driver problem (see nvidia-smi)"],
            fixes=["check nvidia-smi for other processes on that GPU", "python -m distill.doctor"],
            stage=Stage.SETUP,
        ) from None
    return torch.device("cuda", local_rank)


def setup(
    backend: str = "auto", device: str = "auto", timeout_minutes: float = 60.0, debug: bool = False
) -> DistContext:
    """Initialise the process group under torchrun; return a single-process context otherwise."""
    if debug:
        for name, value in DEBUG_ENV.items():
            os.environ.setdefault(name, value)
        dist.set_debug_level_from_env()  # read once at import otherwise, long before this
    if not launched_by_torchrun():
        ctx = DistContext(device=_pick_device(device, 0, distributed=False))
        _debug(debug, f"single process, device {ctx.device}")
        return ctx
    rank, local_rank = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"])
    world_size = int(os.environ["WORLD_SIZE"])
    _debug(debug, f"torchrun environment:\n{env_summary()}\n{versions()}\n{debug_settings()}")
    chosen = choose_backend(backend)
    torch_device = _pick_device(device if chosen == "nccl" or device != "auto" else "cpu", local_rank, True)
    if chosen == "nccl" and torch_device.type != "cuda":
        raise DistillError(
            "the nccl backend needs a CUDA device",
            fixes=["drop --device cpu, or use --backend gloo"],
            stage=Stage.SETUP,
        )
    _debug(debug, f"backend {chosen}, device {torch_device}; calling init_process_group")
    try:
        dist.init_process_group(
            backend=chosen,
            timeout=datetime.timedelta(minutes=timeout_minutes),
            device_id=torch_device if torch_device.type == "cuda" else None,
        )
    except Exception as exc:
        raise init_failure_error(exc, timeout_minutes, chosen) from None
    _debug(debug, f"process group ready: rank {rank}/{world_size}")
    return DistContext(rank, local_rank, world_size, chosen, torch_device)


def local_rank_error(local_rank: int, count: int) -> DistillError:
    return DistillError(
        f"LOCAL_RANK {local_rank} has no GPU: this node has {count} visible GPU(s)",
        f"{env_summary()}\nCUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', '<unset>')}",
        causes=[
            "--nproc_per_node is larger than the number of GPUs on the node",
            "CUDA_VISIBLE_DEVICES hides GPUs",
        ],
        fixes=[f"torchrun --nproc_per_node={count} train_distillation.py ..."],
        stage=Stage.SETUP,
    )


def init_failure_error(exc: BaseException, timeout_minutes: float, backend: str = "nccl") -> DistillError:
    causes = [
        "MASTER_ADDR/MASTER_PORT unreachable from this node (firewall, wrong address)",
        "the port is in use by another job",
        "other nodes never started, or started with a different --nnodes / rendezvous id",
        f"a rank took longer than --dist_timeout ({timeout_minutes:g} min) to arrive",
    ]
    fixes = [
        "single node: torchrun --standalone --nproc_per_node=N train_distillation.py ...",
        "busy port: torchrun --rdzv-endpoint=localhost:0 ... (or another --master-port)",
        "--debug_distributed: every rank logs each setup step"
        + (" and NCCL_DEBUG=INFO shows where NCCL stops" if backend == "nccl" else ""),
    ]
    if backend == "nccl":
        causes += [
            "an NCCL build that does not match the GPU driver (compare the versions above with nvidia-smi)",
            "NCCL picked a network interface the other nodes cannot reach, or InfiniBand that does not work",
        ]
        fixes += [
            "NCCL_SOCKET_IFNAME=<interface> (see `ip addr`) to choose the network interface NCCL uses",
            "NCCL_IB_DISABLE=1 to rule out InfiniBand",
            "try DDP_BACKEND=gloo to separate NCCL from the rest: if gloo forms the group, the problem is "
            "NCCL, its driver or the GPU network; if gloo fails too, it is the rendezvous or the network",
        ]
    fixes.append("python -m distill.doctor under the same torchrun command tests the group alone")
    versions_line = f"\n{versions()}" if backend == "nccl" else ""
    return DistillError(
        f"init_process_group ({backend}) failed: the ranks could not form a group",
        f"{type(exc).__name__}: {exc}\n{env_summary()}{versions_line}",
        causes=causes,
        fixes=fixes,
        stage=Stage.SETUP,
    )


def debug_settings() -> str:
    names = [*DEBUG_ENV, "TORCH_CPP_LOG_LEVEL", "DDP_BACKEND", "NCCL_SOCKET_IFNAME", "NCCL_IB_DISABLE"]
    lines = [f"{name}={os.environ.get(name, '<unset>')}" for name in names]
    return "\n".join([*lines, f"torch.distributed debug level in effect: {dist.get_debug_level().name}"])


def versions() -> str:
    nccl = ".".join(map(str, torch.cuda.nccl.version())) if torch.cuda.is_available() else "n/a"
    return (
        f"torch {torch.__version__}, CUDA {torch.version.cuda}, NCCL {nccl}, "
        f"visible GPUs {torch.cuda.device_count() if torch.cuda.is_available() else 0}"
    )


def _debug(enabled: bool, message: str) -> None:
    if enabled:
        rank = os.environ.get("RANK", "0")
        for line in message.splitlines():
            print(f"[Rank {rank}] [debug_distributed] {line}", file=sys.stderr, flush=True)


def teardown() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def all_reduce_sum(tensor: torch.Tensor) -> torch.Tensor:
    """Sum a tensor over ranks in place (identity in a single process)."""
    if dist.is_initialized():
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    return tensor


def all_reduce_max(value: int) -> int:
    """The largest `value` over all ranks (itself in a single process)."""
    if not dist.is_initialized():
        return value
    device = (
        torch.device("cuda", torch.cuda.current_device())
        if dist.get_backend() == "nccl"
        else torch.device("cpu")
    )
    tensor = torch.tensor([value], device=device)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return int(tensor.item())


def any_rank(flag: bool, device: torch.device) -> bool:
    """True on every rank when it is true on at least one: lets ranks agree before a collective."""
    if not dist.is_initialized():
        return flag
    value = torch.tensor([1.0 if flag else 0.0], device=device)
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return bool(value.item())


def gather_to_main(obj: object) -> list[object] | None:
    """Every rank's `obj` on rank 0 (None elsewhere); [obj] in a single process."""
    if not dist.is_initialized():
        return [obj]
    out = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(obj, out, dst=0)
    return out


def ranks_agree(model: torch.nn.Module, device: torch.device) -> tuple[bool, str]:
    """Whether every rank holds bit-identical parameters (the DDP invariant), with a short checksum.

    The fingerprint is a float64 sum and sum of squares per tensor: cheap on a 1.3B model, and
    any divergence between ranks changes it.
    """
    with torch.no_grad():
        stats = torch.stack(
            [
                torch.stack([p.detach().double().sum(), p.detach().double().square().sum()])
                for p in model.parameters()
            ]
        ).to(device)
    digest = f"{stats.sum().item():.10e}"
    if not dist.is_initialized():
        return True, digest
    gathered = [torch.empty_like(stats) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, stats)
    return all(torch.equal(g, gathered[0]) for g in gathered), digest
