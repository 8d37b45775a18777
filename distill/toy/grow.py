"""Grow a trained toy expert deeper and its feed-forward wider without changing what it computes.

Retraining the toy teacher from scratch costs hours on a CPU; a grown expert starts exactly where
the trained one stands and spends its training on what the extra capacity can add. Two moves,
each exact at the start:

- New blocks sit between the old ones with the output projections of their self-attention,
  cross-attention and feed-forward at zero. Every Wan block adds its branches to the residual
  stream, so such a block passes its input through unchanged until training moves those weights.
- A wider feed-forward keeps the old hidden units and adds new ones whose outgoing weights are
  zero: they contribute nothing until trained.

Only the block count (`num_layers`) and `ffn_dim` grow; the width of the residual stream
(`num_attention_heads * attention_head_dim`) cannot grow this way, because the blocks' layer norms
would see the new channels.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from distill.ops.errors import DistillError, Stage

# The parameters through which a block's branches reach the residual stream.
_BRANCH_OUTPUTS = ("attn1.to_out.0.", "attn2.to_out.0.", "ffn.net.2.")


def grow_expert(expert: Any, num_layers: int, ffn_dim: int, seed: int = 0) -> Any:
    """A WanTransformer3DModel with `num_layers` blocks and `ffn_dim` feed-forward units that
    computes what `expert` computes (to float rounding). New weights are drawn from `seed`."""
    from diffusers import WanTransformer3DModel

    old_layers, old_ffn = expert.config.num_layers, expert.config.ffn_dim
    if num_layers < old_layers or ffn_dim < old_ffn:
        raise ValueError(
            f"An expert can only grow: it has {old_layers} layers and ffn_dim {old_ffn}, "
            f"asked for {num_layers} and {ffn_dim}"
        )
    settings = {k: v for k, v in expert.config.items() if not k.startswith("_")}
    torch.manual_seed(seed)
    grown = WanTransformer3DModel(**(settings | {"num_layers": num_layers, "ffn_dim": ffn_dim}))
    # state_dict() hands out the parameters' own storage: copying into it sets the weights.
    old_state, state = expert.state_dict(), grown.state_dict()
    # Old block i lands at i * num_layers // old_layers: spread evenly, the first one first.
    source_of = {i * num_layers // old_layers: i for i in range(old_layers)}
    with torch.no_grad():
        for key, value in state.items():
            if not key.startswith("blocks."):
                value.copy_(old_state[key])
                continue
            _, index, rest = key.split(".", 2)
            if int(index) not in source_of:
                if rest.startswith(_BRANCH_OUTPUTS):
                    value.zero_()
                continue
            old = old_state[f"blocks.{source_of[int(index)]}.{rest}"]
            if rest == "ffn.net.2.weight":
                value.zero_()
                value[:, :old_ffn] = old
            elif rest.startswith("ffn.net.0.proj."):
                value[:old_ffn] = old  # the new hidden units keep their fresh input weights
            else:
                value.copy_(old)
    return grown.to(next(expert.parameters()).dtype)


# The build's names for the experts (--train_experts), and their folders in a teacher.
EXPERT_FOLDERS = {"high": "transformer", "low": "transformer_2"}


def expert_shape(teacher: Path, expert: str = "high") -> dict[str, int]:
    """The Recipe fields one of a teacher folder's experts fixes (`expert`: "high" or "low"):
    `layers`, `ffn_dim`, `spatial_patch`. The two may differ: a build can grow one alone."""
    config = teacher / EXPERT_FOLDERS[expert] / "config.json"
    try:
        settings = json.loads(config.read_text())
        return {
            "layers": int(settings["num_layers"]),
            "ffn_dim": int(settings["ffn_dim"]),
            "spatial_patch": int(settings["patch_size"][1]),
        }
    except (OSError, ValueError, KeyError, IndexError, TypeError) as error:
        raise DistillError(
            "--from is not a toy teacher folder",
            f"{config} could not be read ({error}).",
            fixes=["Pass a folder written by this command (assets/toy_teacher is one)."],
            stage=Stage.SETUP,
        ) from error
