"""The streaming sampler of a causal student: the clip made chunk after chunk, each one yielded as soon
as it is clean, so its frames can be decoded and shown while the rest is still being made.

    from distill.models.causal.streaming import stream_latents
    for chunk in stream_latents(student, scheduler, 4, prompt_embeds, (16, 9, 60, 104), seed=0, window=3):
        frames = decoder(chunk.latents)          # distill/models/causal/decode.py

Chunk k (frames k*c .. k*c+c-1, c the student's chunk size) starts from its own noise and runs the
student's few-step rollout (distill/models/few_step.py: the same scheduler, grid and stochastic step
as the bidirectional few-step student), every forward attending to the chunks before it through the
KV cache. Once clean, one more pass at t=0 over it adds its keys and values to the cache: later chunks
see it as clean context, as Self-Forcing and CausVid run their students (the last chunk needs no such
pass). `window` keeps that many past chunks in the cache and drops older ones, so a clip longer than
the student was trained on streams with the attention span it was trained with.

Randomness: one CPU generator seeded with `seed` draws the whole clip's starting noise first (the
draw `sample_few_step` makes for the same shape), then each step's re-noising chunk by chunk, so a
seed gives the same clip on every device.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from distill.models.causal.attention import causal_layout, causal_pass
from distill.models.causal.kv_cache import KVCache
from distill.models.conditioning import Condition, condition_frames, conditioned
from distill.models.few_step import rollout, sample_few_step, student_grid
from distill.models.teacher_kind import T2V_A14B, TeacherKind

# The timestep of the pass that fills the cache with a finished chunk: clean context.
CONTEXT_TIMESTEP = 0.0


def cache_filler(student: torch.nn.Module) -> Callable[..., Any]:
    """What runs the pass that adds a clean chunk to the KV cache: the student, or every expert of a
    LoRA student (its `each_expert`). Routed by the timestep, t=0 would reach the low-noise expert
    alone, and the high-noise expert needs the finished chunks' keys of its own for the first steps
    of the next chunk. (Each expert reads the chunk at t=0: the clean context streaming gives.)"""
    return getattr(student, "each_expert", student)


@dataclass(frozen=True)
class StreamedChunk:
    """One finished chunk: `latents` (B, C, frames, h, w), float32, from latent frame `first_frame`."""

    index: int
    first_frame: int
    latents: torch.Tensor
    last: bool


@torch.no_grad()
def stream_latents(
    student: torch.nn.Module,
    scheduler: Any,
    steps: int,
    prompt_embeds: torch.Tensor,
    latent_shape: tuple[int, ...],
    seed: int,
    window: int | None = None,
    kind: TeacherKind = T2V_A14B,
    condition: Condition | None = None,
    noise: torch.Tensor | None = None,
    cache: KVCache | None = None,
    context: torch.Tensor | None = None,
) -> Iterator[StreamedChunk]:
    """Yield the chunks of a K-step (`steps`) sample of the causal `student`, in order, each as it finishes.

    `latent_shape` is (C, F, h, w) with F whole chunks; `prompt_embeds` (B, L, D). `noise`
    (B, C, F, h, w) replaces the starting noise (the re-noising stream stays the same). `condition`
    covers the whole clip and is cut to each chunk (distill.models.conditioning.condition_frames).
    `cache` (a fresh one by default, with `window`) is the KV cache used: pass one to look at it.
    `context` (B, C, K, h, w), K whole chunks: clean latent frames the clip continues (the last frame
    of an earlier stream re-encoded as an image, say). They enter the cache first, as a finished
    chunk does, and the F frames are made after them, from latent frame K on; they are not yielded.
    """
    layout = causal_layout(student)
    if layout is None:
        raise ValueError(
            "stream_latents needs a causal student (distill.models.causal.attention.make_causal)"
        )
    frames = latent_shape[1]
    chunk = layout.chunk_frames
    if not layout.whole_chunks(frames):
        raise ValueError(f"{frames} latent frames are not whole chunks of {chunk}")
    offset = 0 if context is None else context.shape[2]
    if not layout.whole_chunks(offset):
        raise ValueError(f"a context of {offset} latent frames is not whole chunks of {chunk}")
    if context is not None and condition is not None:
        raise ValueError("a condition covers a clip from its first frame: give a context or a condition")
    device = next(student.parameters()).device
    generator = torch.Generator("cpu").manual_seed(seed)

    def draw(shape: tuple[int, ...]) -> torch.Tensor:
        return torch.randn(shape, generator=generator, dtype=torch.float32).to(device)

    timesteps, sigmas = student_grid(scheduler, steps)
    dtype = getattr(student, "dtype", torch.float32)
    cond = prompt_embeds.to(device, dtype)
    start_noise = draw((cond.shape[0], *latent_shape))
    if noise is not None:
        start_noise = noise.to(device, torch.float32).reshape(start_noise.shape)
    cache = cache if cache is not None else KVCache(window)

    def remember(clean: torch.Tensor, first: int, part: torch.Tensor | None) -> None:
        """The pass at t=0 that adds a finished chunk's keys and values to the cache."""
        with causal_pass(student, start_frame=first, cache=cache, commit=True):
            conditioned(cache_filler(student), kind, part)(
                hidden_states=clean.to(dtype),
                timestep=torch.full((clean.shape[0],), CONTEXT_TIMESTEP, device=device),
                encoder_hidden_states=cond,
                return_dict=False,
            )

    for first in range(0, offset, chunk):
        remember(context[:, :, first : first + chunk].to(device), first, None)
    count = frames // chunk
    for index in range(count):
        first = offset + index * chunk
        part = condition_frames(kind, condition, first, first + chunk)
        part = part.to(device) if part is not None else None
        with causal_pass(student, start_frame=first, cache=cache):
            clean = rollout(
                student,
                start_noise[:, :, first - offset : first - offset + chunk],
                cond,
                timesteps,
                sigmas,
                draw,
                kind=kind,
                condition=part,
            ).float()
        last = index == count - 1
        yield StreamedChunk(index, first, clean, last)
        if not last:  # the clean chunk becomes context for every later one
            remember(clean, first, part)


def stream_clip(
    student: torch.nn.Module,
    scheduler: Any,
    steps: int,
    prompt_embeds: torch.Tensor,
    latent_shape: tuple[int, ...],
    seed: int,
    noise: torch.Tensor | None = None,
    condition: Condition | None = None,
    kind: TeacherKind = T2V_A14B,
) -> torch.Tensor:
    """The whole streamed clip (B, C, F, h, w), float32: stream_latents' chunks joined, in the call
    shape of distill.models.few_step.sample_few_step."""
    chunks = stream_latents(
        student,
        scheduler,
        steps,
        prompt_embeds,
        latent_shape,
        seed,
        kind=kind,
        condition=condition,
        noise=noise,
    )
    return torch.cat([chunk.latents for chunk in chunks], dim=2)


def few_step_sampler(student: torch.nn.Module) -> Callable[..., torch.Tensor]:
    """How `student` makes a clip in its few steps: a causal student streams it (stream_clip), as
    `generate --stream` does; any other runs sample_few_step over the whole clip. A causal run's
    in-run samples and evaluations are then the clips its users get."""
    return stream_clip if causal_layout(student) is not None else sample_few_step
