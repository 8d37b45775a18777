"""The smallest forward that keeps ranks in step around a sharded expert.

An expert sharded with FSDP2 gathers each block's weights from every rank during its forward (and,
when it carries gradient, again in backward): a rank that skips a forward another rank runs leaves
that rank waiting in the gather forever. A rank with no sample for an expert in a step must still
run it; what it computes is thrown away, so it runs on as few tokens as the expert takes: one patch
of the first latent frame of its first sample, with one text token. The weight gathers cost the same
for any input; the compute of a whole-size placeholder sample (at 480x832x81 a full 32,760-token
forward) is gone.

An expert also split by --sequence_parallel N hands each rank of its context group tokens / N of
them, so its placeholder is the smallest box of patches (frames x rows x columns) whose count N
divides: N patches of one row when the row is that wide. The sample's own token count is a multiple
of N (checked before the run), so such a box always exists.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch


def placeholder_box(patches: Sequence[int], split: int = 1) -> tuple[int, int, int]:
    """(frames, rows, columns) of patches, each at most `patches`' own, the fewest in all whose count
    `split` divides; ties go to the fewest frames, then rows (the first row's patches lie together).
    `patches` must hold a multiple of `split` patches in all."""
    frames, rows, columns = patches
    best: tuple[int, int, int] | None = None
    for f in range(1, frames + 1):
        for r in range(1, rows + 1):
            # The fewest columns that make f x r x c a multiple of split.
            step = split // math.gcd(split, f * r)
            if step <= columns and (best is None or f * r * step < math.prod(best)):
                best = (f, r, step)
    if best is None:
        raise ValueError(f"{frames}x{rows}x{columns} patches do not split {split} ways")
    return best


def placeholder_inputs(
    hidden_states: torch.Tensor,
    timestep: torch.Tensor,
    encoder_hidden_states: torch.Tensor,
    patch_size: Sequence[int],
    split: int = 1,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(hidden_states, timestep, encoder_hidden_states) of a placeholder forward, cut from a rank's
    real inputs (so device, dtype, channels and text width are right): the first sample, the box of
    `placeholder_box` from its first patch on (one patch when `split` is 1), one text token."""
    patch_t, patch_h, patch_w = patch_size
    shape = hidden_states.shape[2:]
    frames, rows, columns = placeholder_box([n // p for n, p in zip(shape, patch_size)], split)
    box = hidden_states[:1, :, : frames * patch_t, : rows * patch_h, : columns * patch_w]
    return box, timestep[:1], encoder_hidden_states[:1, :1]


def split_degree(model: torch.nn.Module) -> int:
    """How many ranks share each of `model`'s forwards (the Ulysses degree diffusers' context parallel
    split it by, distill/models/context_parallel.py; 1 when it is not split): what the placeholder's
    token count must be a multiple of."""
    config = getattr(model, "_parallel_config", None)
    context = getattr(config, "context_parallel_config", None)
    return int(context.ulysses_degree) if context is not None else 1
