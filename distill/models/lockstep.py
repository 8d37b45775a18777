"""The smallest forward that keeps ranks in step around a sharded expert.

An expert sharded with FSDP2 gathers each block's weights from every rank during its forward (and,
when it carries gradient, again in backward): a rank that skips a forward another rank runs leaves
that rank waiting in the gather forever. A rank with no sample for an expert in a step must still
run it; what it computes is thrown away, so it runs on one token: the first latent frame's first
patch of its first sample, with one text token. The weight gathers cost the same for any input;
the compute of a whole-size placeholder sample (at 480x832x81 a full 32,760-token forward) is gone.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def one_token_inputs(
    hidden_states: torch.Tensor,
    timestep: torch.Tensor,
    encoder_hidden_states: torch.Tensor,
    patch_size: Sequence[int],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(hidden_states, timestep, encoder_hidden_states) of a one-token forward, cut from a rank's real
    inputs (so device, dtype, channels and text width are right): the first sample's first latent
    frame, one patch of it, one text token."""
    _, patch_h, patch_w = patch_size
    return hidden_states[:1, :, :1, :patch_h, :patch_w], timestep[:1], encoder_hidden_states[:1, :1]
