"""Training the toy experts on short prompt embeddings at the cost of long ones: the zero padding
of a 512-token embedding is folded into one slot with an attention bias of log(padding length),
which gives the same cross-attention as the padded embedding (checked by `check_folding`)."""

from __future__ import annotations

import math
from typing import Any

import torch


def fold_padding(embeds: torch.Tensor, lengths: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Short embeddings (N, Lc, D) and additive attention biases (N, 1, 1, Lc) equivalent to the
    zero-padded (N, 512, D): the real tokens, one zero token weighted by log(padding count), and
    masked slots."""
    width = max(lengths) + 1
    short = torch.zeros(embeds.shape[0], width, embeds.shape[-1])
    bias = torch.full((embeds.shape[0], 1, 1, width), -1e9)
    for i, length in enumerate(lengths):
        short[i, :length] = embeds[i, :length]
        bias[i, ..., :length] = 0.0
        bias[i, ..., length] = math.log(embeds.shape[1] - length)
    return short, bias


class _FoldedPaddingProcessor:
    """Wan attention with an extra additive bias on the cross-attention logits (training only)."""

    def __init__(self) -> None:
        from diffusers.models.transformers.transformer_wan import WanAttnProcessor

        self.inner = WanAttnProcessor()
        self.bias: torch.Tensor | None = None

    def __call__(
        self,
        attn: Any,
        hidden_states: Any,
        encoder_hidden_states: Any = None,
        attention_mask: Any = None,
        rotary_emb: Any = None,
    ) -> Any:
        return self.inner(attn, hidden_states, encoder_hidden_states, self.bias, rotary_emb)


def fold_into(expert: Any) -> _FoldedPaddingProcessor:
    processor = _FoldedPaddingProcessor()
    for block in expert.blocks:
        block.attn2.set_processor(processor)
    return processor


def unfold_from(expert: Any) -> None:
    from diffusers.models.transformers.transformer_wan import WanAttnProcessor

    for block in expert.blocks:
        block.attn2.set_processor(WanAttnProcessor())


@torch.no_grad()
def check_folding(expert: Any, embeds: torch.Tensor, lengths: list[int]) -> float:
    """Largest difference between the expert on full padded embeddings and on folded ones."""
    x = torch.randn(len(lengths), 16, 1, 4, 4, generator=torch.Generator().manual_seed(0))
    t = torch.linspace(50, 950, len(lengths))
    full = expert(x, t, embeds, return_dict=False)[0]
    short, bias = fold_padding(embeds, lengths)
    processor = fold_into(expert)
    processor.bias = bias
    try:
        folded = expert(x, t, short, return_dict=False)[0]
    finally:
        unfold_from(expert)
    return float((full - folded).abs().max())
