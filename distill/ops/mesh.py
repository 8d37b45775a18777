"""The device mesh a sharded teacher lives on: flat on one node, 2-D (HSDP) across several.

Sharding an expert over every rank of several nodes makes each of its forwards all-gather the
whole expert over the network between nodes (28 GB per A14B expert pass). With a 2-D mesh each
node holds one whole copy, sharded over its own ranks, so the gathers stay inside the node:
FSDP2's `fully_shard` replicates across dim 0 ("nodes") and shards within dim 1 ("node").

The node size is torchrun's LOCAL_WORLD_SIZE. Ranks agree on it with one collective before any
mesh exists, so a mismatch between nodes is refused by every rank alike instead of hanging one.
"""

from __future__ import annotations

import logging
import os

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from distill.ops.errors import DistillError, Stage

logger = logging.getLogger(__name__)

REPLICATE_DIM, SHARD_DIM = "nodes", "node"

# One mesh per process group and device type: both experts (and every role's view of them) share it,
# and building a 2-D mesh creates process groups, which every rank must do the same number of times.
_meshes: dict[tuple[int, str, int], DeviceMesh] = {}


def shard_group_size(world_size: int, local_world_size: int) -> int:
    """How many ranks share one copy of a sharded expert: the ranks of a node, or all of them when
    each node has one rank (or there is one node). The memory plan divides the teacher by this."""
    if local_world_size <= 1 or local_world_size >= world_size:
        return world_size
    return local_world_size


def node_layout(world_size: int) -> tuple[int, int]:
    """(nodes, ranks per node) of this run, checked to be the same on every rank and node.

    Raises the same DistillError on every rank when nodes differ in size, when WORLD_SIZE is not a
    multiple of the node size, or when ranks are not numbered node by node (torchrun numbers them so).
    """
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    rank = dist.get_rank() if dist.is_initialized() else 0
    node = int(os.environ.get("GROUP_RANK", rank // max(local, 1)))
    local_rank = int(os.environ.get("LOCAL_RANK", rank % max(local, 1)))
    contiguous = rank == node * local + local_rank
    smallest, largest, scattered = local, local, not contiguous
    if dist.is_initialized():
        backend = dist.get_backend()
        device = (
            torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
        )
        # MAX of (size, -size, scattered): the largest and smallest node, and whether any rank is out of order.
        flags = torch.tensor([local, -local, int(scattered)], device=device)
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        largest, smallest, scattered = int(flags[0]), -int(flags[1]), bool(flags[2])
    if smallest != largest or world_size % local:
        raise DistillError(
            f"--teacher_placement shard across nodes needs the same number of ranks on every node "
            f"(LOCAL_WORLD_SIZE from {smallest} to {largest}, WORLD_SIZE {world_size})",
            "Each expert is sharded within a node and replicated across nodes, so every node must "
            "hold the same share.",
            fixes=[
                "start every node with the same --nproc_per_node "
                "(torchrun --nnodes=N --nproc_per_node=G ... on each node)",
                "or use --teacher_placement gpu (a whole teacher on each rank)",
            ],
            stage=Stage.SETUP,
        )
    if scattered:
        raise DistillError(
            "--teacher_placement shard across nodes needs the ranks of each node numbered together "
            "(RANK = GROUP_RANK x LOCAL_WORLD_SIZE + LOCAL_RANK), as torchrun numbers them",
            f"this rank: RANK {rank}, GROUP_RANK {node}, LOCAL_WORLD_SIZE {local}, LOCAL_RANK {local_rank}",
            fixes=["launch every node with torchrun (not a hand-made RANK / WORLD_SIZE environment)"],
            stage=Stage.SETUP,
        )
    return world_size // local, local


def shard_mesh(device: torch.device, world_size: int) -> DeviceMesh:
    """The mesh to shard frozen experts on (built once per process group; every rank must call it).

    One node: a flat mesh over its ranks. Several nodes with several ranks each: (nodes, node), shard
    within a node, replicate across nodes. One rank per node has nothing to shard within a node, so
    the mesh stays flat over all ranks (the experts would otherwise be whole on every rank).
    """
    group = dist.group.WORLD if dist.is_initialized() else None
    key = (id(group), device.type, world_size)
    if key in _meshes:
        return _meshes[key]
    nodes, per_node = node_layout(world_size)
    main = not dist.is_initialized() or dist.get_rank() == 0
    if shard_group_size(world_size, per_node) < world_size:
        mesh = init_device_mesh(device.type, (nodes, per_node), mesh_dim_names=(REPLICATE_DIM, SHARD_DIM))
        if main:
            logger.info(
                "teacher sharded within each node (%d ranks) and replicated across %d nodes", per_node, nodes
            )
    else:
        mesh = init_device_mesh(device.type, (world_size,))
        if main:
            logger.info(
                "teacher sharded over all %d ranks%s",
                world_size,
                f" of {nodes} nodes (one rank per node: nothing to shard within a node)" if nodes > 1 else "",
            )
    _meshes[key] = mesh
    return mesh


# diffusers' ContextParallelConfig looks its groups up by these names.
DATA_DIM, RING_DIM, ULYSSES_DIM = "data", "ring", "ulysses"


def context_mesh(device: torch.device, world_size: int, degree: int) -> DeviceMesh:
    """The ("ring", "ulysses") mesh a context group shares, out of a (data, ring, ulysses) mesh
    over every rank (built once per process group; every rank must call it).

    Row-major numbering puts consecutive ranks in one context group, so with `degree` dividing the
    ranks per node (checked before) every all-to-all stays inside a node. Ring is 1: Ulysses only.
    """
    key = (id(dist.group.WORLD), f"context-{device.type}", degree)
    if key not in _meshes:
        mesh = init_device_mesh(
            device.type,
            (world_size // degree, 1, degree),
            mesh_dim_names=(DATA_DIM, RING_DIM, ULYSSES_DIM),
        )
        _meshes[key] = mesh[(RING_DIM, ULYSSES_DIM)]
        if dist.get_rank() == 0:
            logger.info(
                "sequence parallel: %d context group(s) of %d ranks, each sample's tokens split over a group",
                world_size // degree,
                degree,
            )
    return _meshes[key]
