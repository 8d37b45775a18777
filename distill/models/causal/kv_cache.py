"""The keys and values of the finished chunks of a streamed clip, one entry per transformer layer.

A causal student (distill/models/causal/attention.py) denoises chunk k while attending to the chunks
before it. Those are clean by then, and their keys and values at every layer do not depend on chunk k
(block-causal attention), so they are computed once, by one pass of the clean chunk at t=0, and held
here; each later pass reads them instead of recomputing the whole prefix.

The keys are held with their rotary embedding applied at the chunk's absolute frame index. RoPE makes
attention depend on frame differences only, so they stay right however far the stream goes on.

`window` bounds the memory and the attention span: the cache keeps at most that many chunks and drops
the oldest when a new one is added, so a clip longer than the student was trained on streams with the
same span it was trained with. None keeps every chunk.

Each chunk's keys and values are a tensor of their own, never copied into a longer one: a training
rollout's checkpointed forwards each keep a snapshot of the cache as they saw it until backward
(distill/models/causal/attention.py), and snapshots of chunk tensors share them, so the rollout holds
every chunk's keys once (a cache grown by concatenation held chunk 0 in every snapshot: the sum of
all prefixes, quadratic in the chunks). `read` joins them for one forward.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass, field

import torch


@dataclass
class _Pending:
    """What a commit pass stages, layer by layer, until it is added as whole chunks."""

    keys: dict[Hashable, torch.Tensor] = field(default_factory=dict)
    values: dict[Hashable, torch.Tensor] = field(default_factory=dict)


class KVCache:
    """Per-layer keys and values (B, tokens, heads, head_dim) of contiguous finished chunks; a layer
    is any key its model's processors use (the block's index, or (expert, index)).

    The chunks held are `chunks` ((first frame, frames) each, oldest first); they always cover
    consecutive frames ending at `end_frame`, the first frame the next pass may start at.
    """

    def __init__(self, window: int | None = None) -> None:
        if window is not None and window < 1:
            raise ValueError(f"a KV cache window holds at least 1 chunk, got {window}")
        self.window = window
        self.chunks: list[tuple[int, int]] = []
        self.tokens_per_frame: int | None = None
        # Per layer, one tensor per chunk held, oldest first.
        self._keys: dict[Hashable, list[torch.Tensor]] = {}
        self._values: dict[Hashable, list[torch.Tensor]] = {}
        self._pending = _Pending()
        self.dropped = 0  # chunks dropped by the window so far

    @property
    def first_frame(self) -> int | None:
        """The first frame held, None when empty."""
        return self.chunks[0][0] if self.chunks else None

    @property
    def end_frame(self) -> int | None:
        """One past the last frame held, None when empty."""
        if not self.chunks:
            return None
        first, frames = self.chunks[-1]
        return first + frames

    def read(self, layer: Hashable) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(keys, values) of `layer` over every chunk held, None when empty."""
        keys, values = self.parts(layer)
        if not keys:
            return None
        return torch.cat(keys, dim=1), torch.cat(values, dim=1)

    def parts(self, layer: Hashable) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """(keys, values) of `layer`, one tensor per chunk held, oldest first (empty lists when none):
        a forward joins them with its own keys in one concatenation."""
        return list(self._keys.get(layer, [])), list(self._values.get(layer, []))

    def stage(self, layer: Hashable, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Hold `layer`'s keys and values of the pass now running; `commit` adds them."""
        # Detached: the cache holds context, never a path for gradients into earlier chunks.
        self._pending.keys[layer] = keys.detach()
        self._pending.values[layer] = values.detach()

    def commit(self, chunks: list[tuple[int, int]], tokens_per_frame: int) -> None:
        """Add what the pass staged as `chunks` ((first frame, frames), in order), then drop the
        oldest chunks beyond the window."""
        pending, self._pending = self._pending, _Pending()
        if not chunks:
            return
        if self.end_frame is not None and chunks[0][0] != self.end_frame:
            raise ValueError(
                f"the KV cache holds frames up to {self.end_frame}; a chunk starting at frame "
                f"{chunks[0][0]} would leave a gap or overlap"
            )
        if self.tokens_per_frame not in (None, tokens_per_frame):
            raise ValueError(
                f"the KV cache holds {self.tokens_per_frame} tokens a frame, this pass {tokens_per_frame}"
            )
        self.tokens_per_frame = tokens_per_frame
        sizes = [frames * tokens_per_frame for _, frames in chunks]
        for layer, keys in pending.keys.items():
            # A pass over several chunks: one view of its tensor per chunk (freed with the last of them).
            self._keys.setdefault(layer, []).extend(keys.split(sizes, dim=1))
            self._values.setdefault(layer, []).extend(pending.values[layer].split(sizes, dim=1))
        self.chunks.extend(chunks)
        while self.window is not None and len(self.chunks) > self.window:
            self._drop_oldest()

    def snapshot(self) -> KVCache:
        """A copy holding the chunks held now, which later commits and drops leave as it is (they
        change this cache's lists, never its tensors): what a checkpointed forward's recompute in
        backward must read again. It shares the chunks' tensors with the cache."""
        copy = KVCache(self.window)
        copy.chunks = list(self.chunks)
        copy.tokens_per_frame = self.tokens_per_frame
        copy._keys = {layer: list(chunks) for layer, chunks in self._keys.items()}
        copy._values = {layer: list(chunks) for layer, chunks in self._values.items()}
        copy.dropped = self.dropped
        return copy

    def discard(self) -> None:
        """Forget what a pass staged (it failed before it finished)."""
        self._pending = _Pending()

    def _drop_oldest(self) -> None:
        self.chunks.pop(0)
        for layer in self._keys:
            self._keys[layer].pop(0)
            self._values[layer].pop(0)
        self.dropped += 1
