"""Run under torchrun by tests/test_sharding.py: ask for the sharded teacher's mesh and print what
every rank got (the mesh's shape, or the refusal's title).

torchrun --nnodes=2 --node-rank=I --nproc_per_node=G ... tests/mesh_layout_check.py
"""

import sys

import torch

from distill.ops import distributed
from distill.ops.errors import DistillError
from distill.ops.mesh import shard_mesh


def main() -> int:
    ctx = distributed.setup("gloo", "cpu")
    try:
        mesh = shard_mesh(torch.device("cpu"), ctx.world_size)
        print(f"rank {ctx.rank} mesh {tuple(mesh.shape)}", flush=True)
    except DistillError as error:
        print(f"rank {ctx.rank} refused: {error.title}", flush=True)
    distributed.teardown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
