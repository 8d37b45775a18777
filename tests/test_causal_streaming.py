"""Streaming a causal student (distill/models/causal/): the KV cache, the chunk-by-chunk sampler, the
rotary positions past the model's table and the chunk-by-chunk VAE decode, on the tiny teacher's
high-noise expert made causal (float32) and its VAE."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from diffusers.models.transformers.transformer_wan import WanRotaryPosEmbed

from distill.models.causal.attention import (
    CausalPass,
    CausalState,
    ChunkRope,
    causal_pass,
    make_causal,
)
from distill.models.causal.decode import ChunkDecoder
from distill.models.causal.kv_cache import KVCache
from distill.models.causal.layout import CausalLayout
from distill.models.causal.streaming import stream_latents
from distill.models.conditioning import image_condition
from distill.models.few_step import few_step_scheduler, rollout_step, sample_few_step, student_grid
from distill.models.pipelines import decode_latents, load_vae
from distill.models.teacher import inspect_teacher, load_expert
from distill.models.teacher_kind import I2V_A14B, TI2V_5B
from distill.models.tiny import build_tiny_pipeline

FRAMES = 6  # latent frames: 2 chunks of 3, or 6 of 1; a frame is 16 tokens (8 x 8 latents, patch 2)


def causal_expert(tiny_teacher: Path, chunk: int) -> torch.nn.Module:
    expert = load_expert(inspect_teacher(str(tiny_teacher)), "transformer", torch.float32)
    return make_causal(expert, chunk)


def inputs(seed: int = 0, frames: int = FRAMES) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(1, 16, frames, 8, 8, generator=generator), torch.randn(1, 7, 32, generator=generator)


@torch.no_grad()
def run(model: torch.nn.Module, latents: torch.Tensor, text: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    return model(latents, t, text, return_dict=False)[0]


@pytest.mark.parametrize("chunk", [1, 3])
def test_chunk_by_chunk_with_the_cache_equals_the_whole_clip_in_one_forward(
    tiny_teacher: Path, chunk: int
) -> None:
    """Every chunk at the same timestep: the whole clip under the block-causal attention in one
    forward, and chunk after chunk, each attending to the cached keys and values of those before."""
    model = causal_expert(tiny_teacher, chunk)
    latents, text = inputs()
    t = torch.tensor([700.0])
    whole = run(model, latents, text, t)
    cache, parts = KVCache(), []
    for first in range(0, FRAMES, chunk):
        with causal_pass(model, start_frame=first, cache=cache, commit=True):
            parts.append(run(model, latents[:, :, first : first + chunk], text, t))
    assert cache.chunks == [(first, chunk) for first in range(0, FRAMES, chunk)]
    torch.testing.assert_close(torch.cat(parts, dim=2), whole, rtol=0, atol=1e-5)
    # A pass that reads the cache without committing leaves it as it was.
    with causal_pass(model, start_frame=FRAMES, cache=cache):
        run(model, latents[:, :, :chunk], text, t)
    assert cache.end_frame == FRAMES


def test_the_sampler_is_the_few_step_rollout_of_each_chunk_on_its_clean_past(tiny_teacher: Path) -> None:
    """The streaming sampler against the same sampling done without any cache: each chunk's K steps
    are forwards of the whole prefix, the finished chunks clean at t=0 (a timestep per token) and the
    chunk being made at its step's timestep, under the block-causal attention."""
    chunk, steps = 3, 2
    model = causal_expert(tiny_teacher, chunk)
    _, text = inputs()
    scheduler = few_step_scheduler(shift=5.0)
    streamed = [c.latents for c in stream_latents(model, scheduler, steps, text, (16, FRAMES, 8, 8), seed=3)]
    assert [c.shape[2] for c in streamed] == [chunk] * (FRAMES // chunk)
    expected = stream_without_cache(model, scheduler, steps, text, torch.zeros(1, 16, 0, 8, 8), chunk, seed=3)
    for ours, theirs in zip(streamed, expected, strict=True):
        torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-5)


def stream_without_cache(
    model: torch.nn.Module,
    scheduler: object,
    steps: int,
    text: torch.Tensor,
    done: torch.Tensor,
    chunk: int,
    seed: int,
) -> list[torch.Tensor]:
    """The chunks after `done` (clean latent frames) up to FRAMES, sampled with no cache: each chunk's
    steps are forwards of the whole prefix, the finished frames at t=0 (a timestep per token) and the
    chunk being made at its step's timestep; noise drawn as stream_latents draws it."""
    offset = done.shape[2]
    generator = torch.Generator().manual_seed(seed)
    noise = torch.randn((1, 16, FRAMES - offset, 8, 8), generator=generator)
    timesteps, sigmas = student_grid(scheduler, steps)
    per_frame = 16
    made = []
    for first in range(offset, FRAMES, chunk):
        x = noise[:, :, first - offset : first - offset + chunk]
        for i in range(steps):
            t = torch.cat(
                [torch.zeros(first * per_frame), torch.full((chunk * per_frame,), float(timesteps[i]))]
            )
            velocity = run(model, torch.cat([done, x], dim=2), text, t[None])[:, :, first:]
            renoise = torch.randn(tuple(x.shape), generator=generator)
            _, x = rollout_step(x, velocity, sigmas[i], sigmas[i + 1], renoise)
        made.append(x)
        done = torch.cat([done, x], dim=2)
    return made


@pytest.mark.parametrize("chunk", [1, 3])
def test_a_stream_continues_its_context_as_if_it_had_made_those_frames(
    tiny_teacher: Path, chunk: int
) -> None:
    """`context`: clean latent frames (a re-encoded last frame of an earlier stream, say) that the
    clip continues: they sit in the cache at frames 0..K-1 as finished chunks do, and the chunks
    made after them are the cache-free sampling of the same prefix. Another context, another clip."""
    model = causal_expert(tiny_teacher, chunk)
    _, text = inputs()
    scheduler = few_step_scheduler(shift=5.0)
    context = inputs(seed=9, frames=chunk)[0]

    def continued(context: torch.Tensor) -> list:
        shape = (16, FRAMES - context.shape[2], 8, 8)
        return list(stream_latents(model, scheduler, 2, text, shape, seed=3, context=context))

    made = continued(context)
    assert [c.first_frame for c in made] == list(range(chunk, FRAMES, chunk))
    expected = stream_without_cache(model, scheduler, 2, text, context, chunk, seed=3)
    for ours, theirs in zip(made, expected, strict=True):
        torch.testing.assert_close(ours.latents, theirs, rtol=0, atol=1e-5)
    other = continued(inputs(seed=10, frames=chunk)[0])
    assert (other[0].latents - made[0].latents).abs().max() > 1e-2
    if chunk > 1:
        with pytest.raises(ValueError, match="a context of 2 latent frames is not whole chunks of 3"):
            list(stream_latents(model, scheduler, 2, text, (16, 3, 8, 8), seed=3, context=context[:, :, :2]))


def test_the_rolling_window_drops_the_oldest_chunks(tiny_teacher: Path) -> None:
    model = causal_expert(tiny_teacher, 1)
    latents, text = inputs()
    t = torch.tensor([500.0])
    cache = KVCache(window=2)
    keys = []
    for first in range(4):
        with causal_pass(model, start_frame=first, cache=cache, commit=True):
            run(model, latents[:, :, first : first + 1], text, t)
        keys.append(cache.read(0)[0][:, -16:].clone())  # layer 0's keys of the chunk just added
    assert cache.chunks == [(2, 1), (3, 1)] and cache.dropped == 2
    assert cache.first_frame == 2 and cache.read(0)[0].shape[1] == 2 * 16
    torch.testing.assert_close(cache.read(0)[0], torch.cat(keys[2:], dim=1), rtol=0, atol=0)

    # The next chunk attends to the two chunks held and itself: what the whole clip in one forward
    # computes under the same window (a sliding window over chunks), not the unwindowed prefix.
    with causal_pass(model, start_frame=4, cache=cache):
        streamed = run(model, latents[:, :, 4:5], text, t)
    with causal_pass(model, window=2):
        windowed = run(model, latents[:, :, :5], text, t)[:, :, 4:5]
    torch.testing.assert_close(streamed, windowed, rtol=0, atol=1e-5)
    assert (run(model, latents[:, :, :5], text, t)[:, :, 4:5] - windowed).abs().max() > 1e-3


def test_rotary_positions_go_on_past_the_models_table() -> None:
    """A stream longer than rope_max_seq_len frames: positions past the table are those of a
    longer table, and those within it Wan's own."""
    short, longer = WanRotaryPosEmbed(12, (1, 2, 2), 32), WanRotaryPosEmbed(12, (1, 2, 2), 64)
    rope = ChunkRope(short, CausalState(CausalLayout(3)))
    latents = torch.zeros(1, 16, 3, 4, 4)
    for start in (0, 30, 45):
        rope.state.current = CausalPass(start_frame=start)
        ours = rope(latents)
        theirs = longer(torch.zeros(1, 16, start + 3, 4, 4))
        tokens = 3 * 2 * 2
        for mine, reference in zip(ours, theirs):
            torch.testing.assert_close(mine, reference[:, -tokens:], rtol=0, atol=0)
    rope.state.current = CausalPass()
    for mine, reference in zip(rope(latents), short(latents)):
        torch.testing.assert_close(mine, reference, rtol=0, atol=0)


def test_a_stream_longer_than_the_rope_table_runs_on_a_window(tiny_teacher: Path) -> None:
    model = causal_expert(tiny_teacher, 3)
    _, text = inputs()
    cache = KVCache(window=2)
    chunks = list(
        stream_latents(model, few_step_scheduler(5.0), 1, text, (16, 36, 4, 4), seed=0, cache=cache)
    )
    assert [c.first_frame for c in chunks] == list(range(0, 36, 3)) and chunks[-1].last
    assert all(torch.isfinite(c.latents).all() for c in chunks)
    assert cache.chunks == [(27, 3), (30, 3)]  # the last chunk is never added: nothing follows it


def test_decoding_chunk_by_chunk_equals_decoding_the_whole_clip(tiny_teacher: Path) -> None:
    vae = load_vae(tiny_teacher, torch.device("cpu"))
    latents = torch.randn(16, 5, 8, 8, generator=torch.Generator().manual_seed(0))
    whole = decode_latents(latents, vae)
    decoder = ChunkDecoder(vae)
    parts = [decoder(latents[None, :, a:b]) for a, b in ((0, 1), (1, 3), (3, 5))]
    decoder.close()
    assert [len(p) for p in parts] == [1, 8, 8]  # 1 video frame for latent frame 0, 4 for each after
    assert len(whole) == 17
    torch.testing.assert_close(
        torch.from_numpy(np.concatenate(parts)), torch.from_numpy(whole), rtol=0, atol=1e-5
    )


@pytest.mark.parametrize("kind", [I2V_A14B, TI2V_5B], ids=lambda k: k.name)
def test_a_chunk_over_the_whole_clip_streams_the_few_step_sample_with_the_image(kind) -> None:
    """The image condition reaches the streamed chunks as it reaches the bidirectional sampler: a
    causal student whose one chunk is the whole clip streams exactly sample_few_step's sample."""
    pipe = build_tiny_pipeline(0, kind=kind)
    expert, vae = pipe.transformer.float(), pipe.vae.float()
    image = torch.rand(1, 3, 32, 32, generator=torch.Generator().manual_seed(1)) * 2 - 1
    condition = image_condition(vae, image, 9, kind=kind)
    _, text = inputs()
    latent_shape = (
        kind.out_channels,
        3,
        32 // 16 if kind == TI2V_5B else 4,
        32 // 16 if kind == TI2V_5B else 4,
    )
    scheduler = few_step_scheduler(5.0)
    whole = sample_few_step(expert, scheduler, 2, text, latent_shape, 4, condition=condition, kind=kind)
    make_causal(expert, 3)
    (chunk,) = stream_latents(expert, scheduler, 2, text, latent_shape, 4, kind=kind, condition=condition)
    torch.testing.assert_close(chunk.latents, whole, rtol=0, atol=1e-5)
    if kind == TI2V_5B:  # the image's latent frame held at frame 0, as the bidirectional sampler holds it
        torch.testing.assert_close(chunk.latents[:, :, :1], condition.channels, rtol=0, atol=0)


def test_a_causal_students_in_run_samples_are_its_streams(tiny_teacher: Path) -> None:
    """The samples and evaluations of a run (distill.report.measures.student_sampler, which the sample
    monitor and the report call) make a causal student's clip as `generate --stream` makes it, chunk
    after chunk on its KV cache, not in one rollout of the whole clip; a bidirectional student keeps
    sample_few_step."""
    from distill.models.pipelines import scheduler_from_config
    from distill.report.measures import EvalSettings, student_sampler

    info = inspect_teacher(str(tiny_teacher))
    scheduler = few_step_scheduler(5.0)
    settings = EvalSettings(
        height=64,
        width=64,
        num_frames=4 * (FRAMES - 1) + 1,
        seed=5,
        student_steps=2,
        student_scheduler={"_class_name": type(scheduler).__name__, **dict(scheduler.config)},
    )
    shape = info.latent_shape(settings.height, settings.width, settings.num_frames)
    assert shape == (16, FRAMES, 8, 8)
    _, text = inputs()
    conds = {0: text[0], 1: inputs(1)[1][0]}
    scheduler = scheduler_from_config(settings.student_scheduler)
    model = causal_expert(tiny_teacher, 3)
    for index in conds:
        sampled = student_sampler(model, info, conds, settings)(index, 2)
        streamed = torch.cat(
            [
                c.latents
                for c in stream_latents(model, scheduler, 2, conds[index][None], shape, seed=5 + index)
            ],
            2,
        )
        whole = sample_few_step(model, scheduler, 2, conds[index][None], shape, 5 + index)
        torch.testing.assert_close(sampled, streamed[0])
        assert (sampled - whole[0]).abs().max() > 1e-3  # the whole clip at once is another sample
    bidirectional = load_expert(info, "transformer", torch.float32)
    torch.testing.assert_close(
        student_sampler(bidirectional, info, conds, settings)(0, 2),
        sample_few_step(bidirectional, scheduler, 2, conds[0][None], shape, 5)[0],
    )
