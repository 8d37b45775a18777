"""Sequence parallel for Wan transformers: diffusers' own context parallel, Ulysses only.

`enable_parallelism` with a `ContextParallelConfig` installs hooks from the model's `_cp_plan`:
the patch-embedded tokens (and the rotary embedding) are split over a context group after patch
embedding, each attention swaps sequence shards for head shards with an all-to-all, and the output
is gathered again at `proj_out`, so a caller sees the whole output. The text (cross-attention)
stays whole on every rank. Weight gradients are then each rank's share of the tokens: summed over a
group they are the gradient of one process, which the loop's loss scale and DDP's mean produce.

A processor of our own (the causal student's, distill/models/causal/attention.py) makes the same
swaps itself with `heads_to_ranks` and `tokens_to_ranks`, over the group `ulysses_group` names, and
attends as it must on every token of a share of the heads in between.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch.distributed._functional_collectives import all_to_all_single_autograd
from torch.distributed.device_mesh import DeviceMesh

from distill.models.attention_backend import has_backend, process_default_kept

logger = logging.getLogger(__name__)


@contextlib.contextmanager
def _one_device_on_cpu_builds() -> Iterator[None]:
    """diffusers picks `rank % torch.accelerator.device_count()` as the model's device, and a CPU
    build of torch counts 0 accelerators (ZeroDivisionError). The device is only recorded; the
    CPU (gloo) run computes where the model already is, so count 1 while the config is set up."""
    if torch.accelerator.device_count() > 0:
        yield
        return
    original = torch.accelerator.device_count
    torch.accelerator.device_count = lambda: 1
    try:
        yield
    finally:
        torch.accelerator.device_count = original


def enable_context_parallel(model: torch.nn.Module, mesh: DeviceMesh) -> int:
    """Split every Wan transformer inside `model` (itself, a LoRA model's experts, a critic's copies)
    over the context group of `mesh`; transformers already split are left as they are (the LoRA
    student shares the teacher's experts). Returns how many were split now."""
    from diffusers import ContextParallelConfig, WanTransformer3DModel

    split = 0
    for module in model.modules():
        if not isinstance(module, WanTransformer3DModel) or module._parallel_config is not None:
            continue
        # The backend that has a backward under Ulysses and runs everywhere (SDPA); set on the model,
        # not as the process default (which set_attention_backend also changes), so a user's own
        # backend choice elsewhere is untouched. One set by --attention_backend is kept (it was
        # checked to split: distill.config.attention_backends).
        if not has_backend(module):
            with process_default_kept():
                module.set_attention_backend("native")
        with _one_device_on_cpu_builds():
            module.enable_parallelism(config=ContextParallelConfig(ulysses_degree=mesh.size(), mesh=mesh))
        split += 1
    return split


def ulysses_group(parallel_config: object | None) -> dist.ProcessGroup | None:
    """The process group a processor's Ulysses all-to-alls run over (diffusers sets
    `processor._parallel_config` in `enable_parallelism`), None for a model that is not split."""
    context = getattr(parallel_config, "context_parallel_config", None)
    if context is None:
        return None
    return context._ulysses_mesh.get_group()


def heads_to_ranks(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """(batch, tokens / N, heads, dim) on each rank of the group -> (batch, tokens, heads / N, dim):
    every token, this rank's share of the heads (the swap Ulysses makes before attention). The
    all-to-all is differentiable: its backward is the reverse swap of the gradient."""
    size = dist.get_world_size(group)
    batch, local_tokens, heads, dim = x.shape
    parts = x.reshape(batch, local_tokens, size, heads // size, dim).permute(2, 1, 0, 3, 4).contiguous()
    parts = all_to_all_single_autograd(parts, None, None, group)  # [source rank, its tokens, ...]
    return parts.flatten(0, 1).permute(1, 0, 2, 3)


def tokens_to_ranks(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """The reverse of `heads_to_ranks`: (batch, tokens, heads / N, dim) -> (batch, tokens / N, heads,
    dim), this rank's share of the tokens with every head (the swap after attention)."""
    size = dist.get_world_size(group)
    batch, tokens, local_heads, dim = x.shape
    parts = x.reshape(batch, size, tokens // size, local_heads, dim).permute(1, 3, 0, 2, 4).contiguous()
    parts = all_to_all_single_autograd(parts, None, None, group)  # [source rank, its heads, ...]
    return parts.flatten(0, 1).permute(1, 2, 0, 3)
