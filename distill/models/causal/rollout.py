"""A causal student's whole clip as Self-Forcing trains it: rolled out chunk by chunk on its own KV cache,
with gradient only through each chunk's exit step.

    x0_hat = rollout_clip(student, noise, cond, timesteps, sigmas, draw, exit_step=2, grad_model=ddp_student)

Chunk k runs the student's few-step sampler (distill/models/few_step.py) from its own noise, attending
to the chunks before it through the KV cache, exactly as the streaming sampler makes it
(distill/models/causal/streaming.py), but stops at `exit_step`: the steps before it run without
gradient, the exit step's forward goes through `grad_model` (the same weights, wrapped for data
parallelism) and its clean estimate x0 = x - sigma v is the chunk's part of the clip. That estimate,
detached, is then added to the cache by one pass at t=0, so the next chunk is made on the student's
own output, as at inference, and no gradient reaches one chunk through another.

One exit step for the whole clip (drawn by the caller): a clip whose chunks all stop at the same step
is one sample of the student's estimates at that step, what the dmd critic and the teacher's score
judge in a bidirectional run (dmd's backward simulation at a random step), and over the run every
step of the grid is trained on the rollout it meets at inference. Exiting only at the last step would
leave the earlier steps' estimates untrained under the causal mask.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch

from distill.models.causal.attention import causal_layout, causal_pass
from distill.models.causal.kv_cache import KVCache
from distill.models.causal.streaming import CONTEXT_TIMESTEP, cache_filler
from distill.models.conditioning import Condition, blend_latents, condition_frames, conditioned
from distill.models.few_step import rollout
from distill.models.teacher_kind import T2V_A14B, TeacherKind


def rollout_clip(
    student: torch.nn.Module,
    noise: torch.Tensor,
    cond: torch.Tensor,
    timesteps: torch.Tensor,
    sigmas: torch.Tensor,
    draw_noise: Callable[[tuple[int, ...]], torch.Tensor],
    exit_step: int,
    *,
    kind: TeacherKind = T2V_A14B,
    condition: Condition | None = None,
    grad_model: torch.nn.Module | None = None,
    window: int | None = None,
    judged_from: int = 0,
) -> torch.Tensor:
    """The clip (B, C, F, h, w), float32: each chunk's clean estimate at step `exit_step` of the grid
    (`timesteps` (K,), `sigmas` (K+1,)), rolled out from `noise` (B, C, F, h, w) chunk after chunk.

    `student` is the bare causal model (the passes without gradient); `grad_model` (default: the
    student) runs each chunk's exit step, with gradient when grad is enabled. `draw_noise(shape)`
    gives each earlier step's re-noising, chunk by chunk. `condition` covers the whole clip and is cut
    to each chunk. `window` bounds the chunks the cache keeps (None: all of them).

    `judged_from` (a chunk boundary): only the frames from it on are returned and carry gradient; the
    chunks before it are made the same way, without gradient, as the context the judged ones continue
    (a training rollout longer than the clip the teacher judges, distill/train/methods/self_forcing.py).
    """
    layout = causal_layout(student)
    if layout is None:
        raise ValueError("rollout_clip needs a causal student (distill.models.causal.attention.make_causal)")
    frames, chunk = noise.shape[2], layout.chunk_frames
    if not layout.whole_chunks(frames):
        raise ValueError(f"{frames} latent frames are not whole chunks of {chunk}")
    if not 0 <= exit_step < len(timesteps):
        raise ValueError(f"exit step {exit_step} is not a step of a {len(timesteps)}-step grid")
    if judged_from % chunk or not 0 <= judged_from < frames:
        raise ValueError(f"judged_from {judged_from} is not a chunk boundary inside {frames} latent frames")
    grad_model = grad_model if grad_model is not None else student
    device, batch = noise.device, noise.shape[0]
    dtype = getattr(student, "dtype", torch.float32)
    sigma = sigmas[exit_step].to(device)
    cache = KVCache(window)
    parts = []
    for first in range(0, frames, chunk):
        part = condition_frames(kind, condition, first, first + chunk)
        with causal_pass(student, start_frame=first, cache=cache):
            x = blend_latents(kind, noise[:, :, first : first + chunk], part)
            if exit_step:  # the steps before the exit, without gradient
                with torch.no_grad():
                    x = rollout(
                        student,
                        x,
                        cond,
                        timesteps,
                        sigmas,
                        draw_noise,
                        stop=exit_step,
                        kind=kind,
                        condition=part,
                    )
            judged = first >= judged_from
            with contextlib.nullcontext() if judged else torch.no_grad():
                velocity = conditioned(grad_model if judged else student, kind, part)(
                    hidden_states=x.to(dtype),
                    timestep=timesteps[exit_step].to(device).expand(batch),
                    encoder_hidden_states=cond,
                    return_dict=False,
                )[0].float()
        clean = blend_latents(kind, x.float() - sigma * velocity, part)
        if judged:
            parts.append(clean)
        if first + chunk < frames:  # the estimate, detached, is the next chunks' clean context
            with torch.no_grad(), causal_pass(student, start_frame=first, cache=cache, commit=True):
                conditioned(cache_filler(student), kind, part)(
                    hidden_states=clean.detach().to(dtype),
                    timestep=torch.full((batch,), CONTEXT_TIMESTEP, device=device),
                    encoder_hidden_states=cond,
                    return_dict=False,
                )
    return torch.cat(parts, dim=2)
