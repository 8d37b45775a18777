"""The causal student kind: block-causal self-attention over chunks of latent frames, installed on an
unchanged diffusers WanTransformer3DModel.

    from distill.models.causal.attention import make_causal
    make_causal(student, chunk_frames=3)      # chunk k's tokens attend to chunks 0..k; text unchanged

The latent frames are split into chunks of `chunk_frames` (1 or 3 in the published causal students);
every token of chunk k attends to the tokens of chunks <= k (all of chunk k itself: within a chunk
attention stays bidirectional) and to the whole prompt. Two things of the model are replaced, both
through the seams diffusers gives:
- each block's self-attention processor (`attn1.set_processor`) by `ChunkCausalProcessor`, which
  attends chunk by chunk to the prefix it may see (no mask: any attention backend runs it, and no
  (tokens x tokens) mask is ever built), and reads and fills a KV cache when streaming;
- the rotary embedding (`model.rope`) by `ChunkRope`, which places the frames of a pass at their
  absolute index (a chunk streamed alone is frame 9, not frame 0) and tells the processors the
  pass's grid.
No parameter is added, removed or renamed: the state dict is a WanTransformer3DModel's, so a causal
student saves and loads as one, and any of our students (or the teacher's high-noise expert) can be
made causal. What makes a saved student causal again is `causal_config.json` beside its config.json
(distill/models/causal/layout.py).

Under sequence parallel (diffusers' context parallel, Ulysses) the rope's output is split with the
tokens as for any Wan model, and the processor makes the all-to-alls itself: every token of a share
of the heads, attended chunk by chunk as in one process.

What a forward does is set by `causal_pass` (no pass: the whole clip at once from frame 0, as in
training); the streaming sampler (distill/models/causal/streaming.py) runs one chunk at a time on a
`KVCache`.

A LoRA student is the teacher's own experts with the student's adapters on: `make_causal(expert,
chunk, when=..., name="high")` (distill/models/causal/experts.py) makes an expert causal only while
`when()` is true (the student's adapter active), so the same expert still attends over the whole
clip as the teacher and the critic. Each expert keeps its own entries of a shared KV cache (`name`
tells them apart), and a routed model (distill/models/lora.py: `routed_experts`) is causal through
its experts.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Hashable, Iterator
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.utils.checkpoint
from diffusers.models.attention_dispatch import dispatch_attention_fn
from diffusers.models.embeddings import get_1d_rotary_pos_embed
from diffusers.models.transformers.transformer_wan import WanRotaryPosEmbed

from distill.models.causal.kv_cache import KVCache
from distill.models.causal.layout import CausalLayout, check_chunk_frames
from distill.models.context_parallel import heads_to_ranks, tokens_to_ranks, ulysses_group

# WanTransformer3DModel builds its rotary embedding with this base (diffusers does not store it).
ROPE_THETA = 10000.0


@dataclass(frozen=True)
class CausalPass:
    """What one forward of a causal model covers: frames from `start_frame`, attending to the chunks
    held in `cache` (if any) besides its own; `commit` adds its keys and values to the cache;
    `window` (chunks) bounds how far back a chunk may look, None for the whole prefix."""

    start_frame: int = 0
    cache: KVCache | None = None
    commit: bool = False
    window: int | None = None


class CausalState:
    """Shared by a causal model's rope and processors: its layout, the pass running, the grid
    (frames, height, width in patches) the rope saw at the start of the forward, and `when`: None
    for a model that is always causal, else what says whether it is causal now (an expert of the
    teacher is causal only while it runs the LoRA student's adapter)."""

    def __init__(self, layout: CausalLayout, when: Callable[[], bool] | None = None) -> None:
        self.layout = layout
        self.current = CausalPass()
        self.grid: tuple[int, int, int] | None = None
        self.when = when

    @property
    def causal_now(self) -> bool:
        return self.when is None or self.when()


class ChunkRope(WanRotaryPosEmbed):
    """Wan's 3-D rotary embedding with the frame axis starting at the pass's `start_frame`.

    Height and width bands are Wan's own; the frame band of frame f is Wan's row f, also past the
    model's rope_max_seq_len (a stream longer than any clip the table was sized for): rows beyond it
    are computed the way diffusers computes the table, so those within it are the same numbers.
    Records the pass's grid for the processors (the rope runs first in every forward).
    """

    def __init__(self, original: WanRotaryPosEmbed, state: CausalState) -> None:
        super().__init__(original.attention_head_dim, original.patch_size, original.max_seq_len, ROPE_THETA)
        self.to(original.freqs_cos.device)
        self.state = state

    def _frame_band(self, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = (table[:, : self.t_dim] for table in (self.freqs_cos, self.freqs_sin))
        if end <= self.max_seq_len:
            return cos, sin
        cos, sin = get_1d_rotary_pos_embed(
            self.t_dim,
            end,
            ROPE_THETA,
            use_real=True,
            repeat_interleave_real=True,
            freqs_dtype=torch.float64,
        )
        return cos.to(self.freqs_cos.device), sin.to(self.freqs_cos.device)

    def forward(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        _, _, frames, height, width = hidden_states.shape
        p_t, p_h, p_w = self.patch_size
        ppf, pph, ppw = frames // p_t, height // p_h, width // p_w
        self.state.grid = (ppf, pph, ppw)
        # Not causal now (the teacher's turn on a LoRA student's expert): the whole clip from frame 0.
        start = self.state.current.start_frame if self.state.causal_now else 0
        frame_cos, frame_sin = self._frame_band(start + ppf)
        bands = []
        for frame_band, table in ((frame_cos, self.freqs_cos), (frame_sin, self.freqs_sin)):
            _, h_band, w_band = table.split([self.t_dim, self.h_dim, self.w_dim], dim=1)
            parts = (
                frame_band[start : start + ppf].view(ppf, 1, 1, -1).expand(ppf, pph, ppw, -1),
                h_band[:pph].view(1, pph, 1, -1).expand(ppf, pph, ppw, -1),
                w_band[:ppw].view(1, 1, ppw, -1).expand(ppf, pph, ppw, -1),
            )
            bands.append(torch.cat(parts, dim=-1).reshape(1, ppf * pph * ppw, 1, -1))
        return bands[0], bands[1]


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Wan's rotary embedding on (B, tokens, heads, head_dim): channel pairs rotated by the angle."""
    x1, x2 = x.unflatten(-1, (-1, 2)).unbind(-1)
    cos, sin = cos[..., 0::2], sin[..., 1::2]
    out = torch.empty_like(x)
    out[..., 0::2] = x1 * cos - x2 * sin
    out[..., 1::2] = x1 * sin + x2 * cos
    return out.type_as(x)


class ChunkCausalProcessor:
    """Self-attention of one block of a causal model (`layer`: its entry in the KV cache, the
    block's index, or (expert, index) for an expert of a LoRA student).

    The queries of each chunk attend to the keys of the chunks they may see: those held in the pass's
    cache and those of this pass up to and including their own chunk (within `window` chunks back).
    The chunks are contiguous, so that is one slice of the keys per chunk and one unmasked attention
    call; the per-chunk results are the rows a block-causal mask would give. While the model is not
    causal (`CausalState.when`), every query attends to every key of the forward, as Wan's own
    processor does, and the pass and its cache are left alone.
    """

    # Set by diffusers' set_attention_backend / enable_parallelism on every processor.
    _attention_backend = None
    _parallel_config = None

    def __init__(self, state: CausalState, layer: Hashable) -> None:
        self.state = state
        self.layer = layer

    def __call__(
        self,
        attn: Any,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        rotary_emb: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        if encoder_hidden_states is not None or attention_mask is not None:
            raise ValueError("ChunkCausalProcessor is a self-attention processor (attn1), without a mask")
        state, run = self.state, self.state.current
        if state.grid is None:
            raise RuntimeError("the causal rope did not run before the self-attention")
        frames, height, width = state.grid
        per_frame = height * width

        if getattr(attn, "fused_projections", False):
            query, key, value = attn.to_qkv(hidden_states).chunk(3, dim=-1)
        else:
            query, key, value = attn.to_q(hidden_states), attn.to_k(hidden_states), attn.to_v(hidden_states)
        query, key = attn.norm_q(query), attn.norm_k(key)
        query, key, value = (t.unflatten(2, (attn.heads, -1)) for t in (query, key, value))
        if rotary_emb is not None:
            query, key = _rotate(query, *rotary_emb), _rotate(key, *rotary_emb)
        # Split by sequence parallel (each rank holds tokens / N of the pass): swap to every token of
        # heads / N, attend chunk by chunk as one process would, swap back. The cache holds the swapped
        # keys and values (every token, this rank's heads), as chunk by chunk needs them.
        group = ulysses_group(self._parallel_config)
        if group is not None:
            query, key, value = (heads_to_ranks(t, group) for t in (query, key, value))

        if not state.causal_now:
            run = CausalPass(start_frame=0, window=None)
            chunk = frames  # one chunk: the whole forward, no cache
        else:
            chunk = state.layout.chunk_frames
        held_keys, held_values = run.cache.parts(self.layer) if run.cache is not None else ([], [])
        first = run.start_frame
        keys, values = key, value
        if held_keys:
            assert run.cache is not None and run.cache.first_frame is not None
            first = run.cache.first_frame
            keys, values = torch.cat([*held_keys, key], dim=1), torch.cat([*held_values, value], dim=1)

        out = []
        for start in range(run.start_frame, run.start_frame + frames, chunk):
            end = start + chunk
            seen = first if run.window is None else max(first, start - run.window * chunk)
            rows = slice((start - run.start_frame) * per_frame, (end - run.start_frame) * per_frame)
            cols = slice((seen - first) * per_frame, (end - first) * per_frame)
            out.append(
                dispatch_attention_fn(
                    query[:, rows],
                    keys[:, cols],
                    values[:, cols],
                    dropout_p=0.0,
                    is_causal=False,
                    backend=self._attention_backend,
                )
            )
        if run.commit and run.cache is not None:
            run.cache.stage(self.layer, key, value)
        hidden_states = torch.cat(out, dim=1)
        if group is not None:
            hidden_states = tokens_to_ranks(hidden_states, group)
        hidden_states = hidden_states.flatten(2, 3).type_as(query)
        hidden_states = attn.to_out[0](hidden_states)
        return attn.to_out[1](hidden_states)


def make_causal(
    model: torch.nn.Module,
    chunk_frames: int,
    *,
    when: Callable[[], bool] | None = None,
    name: str | None = None,
) -> torch.nn.Module:
    """`model` (a bare WanTransformer3DModel: before DDP, compile or sharding) made block-causal over
    chunks of `chunk_frames` latent frames, in place; returns it. Weights are untouched. An attention
    backend set on its processors before is kept. Calling it again changes the chunk size.

    `when`: causal only while it returns True (else it attends as Wan's own processors do), for an
    expert that is also the teacher. `name`: the model's own entries in a KV cache it shares with
    other causal models (each expert of a LoRA student)."""
    layout = CausalLayout(check_chunk_frames(chunk_frames))
    if getattr(model, "_parallel_config", None) is not None:
        # Sequence parallel hooks the rope by its module, which make_causal replaces.
        raise ValueError("make_causal goes before sequence parallel splits the model, not after")
    existing = _state_of(model)
    if existing is not None:
        existing.layout = layout
        return model
    state = CausalState(layout, when)
    model.rope = ChunkRope(model.rope, state)
    for index, block in enumerate(model.blocks):
        processor = ChunkCausalProcessor(state, index if name is None else (name, index))
        processor._attention_backend = getattr(block.attn1.processor, "_attention_backend", None)
        block.attn1.set_processor(processor)
    return model


def _states_of(model: torch.nn.Module) -> list[CausalState]:
    """The causal states of `model`: its own, or one per expert of a routed model (a LoRA student,
    whose experts are not its submodules). Through any wrapper (DDP's .module, torch.compile's
    ._orig_mod are submodules)."""
    states: list[CausalState] = []
    for module in model.modules():
        parts = getattr(module, "routed_experts", None)
        for part in [module] if parts is None else [module, *(m for e in parts() for m in e.modules())]:
            if isinstance(part, ChunkRope) and all(part.state is not s for s in states):
                states.append(part.state)
    return states


def _state_of(model: torch.nn.Module) -> CausalState | None:
    """The causal state of a model made causal as one (not a routed model), None for a bidirectional one."""
    states = _states_of(model)
    if len(states) > 1:
        raise ValueError("a routed model's experts are causal each: take them one by one")
    return states[0] if states else None


def causal_layout(model: torch.nn.Module) -> CausalLayout | None:
    """The layout of a causal model (also inside DDP or torch.compile, or a LoRA student's experts),
    None for a bidirectional one."""
    states = _states_of(model)
    return states[0].layout if states else None


@contextlib.contextmanager
def causal_pass(
    model: torch.nn.Module,
    *,
    start_frame: int = 0,
    cache: KVCache | None = None,
    commit: bool = False,
    window: int | None = None,
) -> Iterator[CausalState]:
    """Within the block, forwards of the causal `model` cover frames from `start_frame` and attend to
    the chunks `cache` holds; with `commit`, a forward that finishes adds its chunks to the cache.
    `window` defaults to the cache's. A LoRA student's experts run the pass each, on their own
    entries of the cache; a commit pass must run every one of them (`each_expert`)."""
    states = _states_of(model)
    if not states:
        raise ValueError("causal_pass needs a causal model (make_causal)")
    chunk = states[0].layout.chunk_frames
    if start_frame % chunk:
        raise ValueError(
            f"a pass starts on a chunk boundary (a multiple of {chunk}), got frame {start_frame}"
        )
    if cache is not None and cache.end_frame not in (None, start_frame):
        raise ValueError(f"the KV cache ends at frame {cache.end_frame}, the pass starts at {start_frame}")
    if window is None and cache is not None:
        window = cache.window
    previous = [state.current for state in states]
    for state in states:
        # The grid is set again by the rope of each forward; cleared, it tells which experts ran.
        state.current, state.grid = CausalPass(start_frame, cache, commit, window), None
    try:
        yield states[0]
    except BaseException:
        if cache is not None:
            cache.discard()
        raise
    finally:
        grids = {state.grid for state in states if state.grid is not None}
        for state, run in zip(states, previous):
            state.current = run
    if commit and cache is not None and grids:
        if len(grids) > 1:
            raise ValueError(f"the experts of one pass saw other grids: {sorted(grids)}")
        frames, height, width = grids.pop()
        chunks = [
            (f, min(chunk, start_frame + frames - f)) for f in range(start_frame, start_frame + frames, chunk)
        ]
        cache.commit(chunks, height * width)


def causal_checkpointing(model: torch.nn.Module) -> Callable[..., Any] | None:
    """The gradient-checkpointing function a causal `model` needs (for diffusers'
    `enable_gradient_checkpointing`), None for a bidirectional one (diffusers' own is right).

    A checkpointed block runs its forward again during backward. By then a training rollout has
    moved on: another chunk's pass is set (or none), the KV cache holds more chunks, the rope saw
    another grid. So each checkpointed call keeps what its processors read as the forward saw it (the
    pass, a snapshot of the cache, the grid) and the recompute runs under that; the recompute never
    commits, so a chunk cannot be added to the cache twice.
    """
    state = _state_of(model)
    if state is None:
        return None

    def checkpointed(block: torch.nn.Module, *args: Any) -> Any:
        run = state.current
        cache = run.cache.snapshot() if run.cache is not None else None
        seen = replace(run, cache=cache, commit=False), state.grid
        calls = 0

        def forward(*inputs: Any) -> Any:
            nonlocal calls
            calls += 1
            if calls == 1:  # the forward itself, under the live pass (it may commit)
                return block(*inputs)
            previous = state.current, state.grid
            state.current, state.grid = seen
            try:
                return block(*inputs)
            finally:
                state.current, state.grid = previous

        return torch.utils.checkpoint.checkpoint(forward, *args, use_reentrant=False)

    return checkpointed


def enable_checkpointing(model: torch.nn.Module) -> None:
    """Gradient checkpointing on `model`: diffusers' own for a bidirectional model,
    `causal_checkpointing` for a causal one; a routed model's experts each as they are."""
    experts = getattr(model, "routed_experts", None)
    if experts is not None:
        for expert in experts():
            enable_checkpointing(expert)
        return
    checkpointing = causal_checkpointing(model)
    if checkpointing is None:
        model.enable_gradient_checkpointing()
    else:
        model.enable_gradient_checkpointing(checkpointing)
