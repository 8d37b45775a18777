"""Sequence parallel for Wan transformers: diffusers' own context parallel, Ulysses only.

`enable_parallelism` with a `ContextParallelConfig` installs hooks from the model's `_cp_plan`:
the patch-embedded tokens (and the rotary embedding) are split over a context group after patch
embedding, each attention swaps sequence shards for head shards with an all-to-all, and the output
is gathered again at `proj_out`, so a caller sees the whole output. The text (cross-attention)
stays whole on every rank. Weight gradients are then each rank's share of the tokens: summed over a
group they are the gradient of one process, which the loop's loss scale and DDP's mean produce.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator

import torch
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
