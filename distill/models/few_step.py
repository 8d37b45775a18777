"""The few-step student's sampler: its scheduler, one rollout step, and sampling from a seed.

A few-step (dmd) student samples with diffusers' `FlowMatchEulerDiscreteScheduler` in stochastic
mode: at each of its K timesteps it predicts the clean latent x0 = x - sigma * v, then re-noises
it to the next sigma with fresh noise. The grid is what `set_timesteps(K)` makes of the scheduler's
`shift`, so the exported scheduler config alone reproduces it: stock `WanPipeline` with
`num_inference_steps=K, guidance_scale=1.0` runs exactly the rollout the student was trained on.

WanPipeline re-noises from the global torch RNG (it calls `scheduler.step` without a generator).
`sample_few_step(..., seed=s)` draws the starting noise and every re-noising from one CPU generator
seeded with s and moves them to the student's device, so a seed gives the same sample on any device.
On the CPU that is what the stock pipeline draws after `torch.manual_seed(s)` when called without a
generator:

    torch.manual_seed(s)
    pipe(prompt_embeds=..., num_inference_steps=K, guidance_scale=1.0, output_type="latent")

On a GPU the stock pipeline would draw from the GPU's own generator, whose numbers differ;
`distill.generate` passes the pipeline a CPU generator and re-noises from it too (`renoising_from`),
which gives these numbers on every device.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from distill.models.conditioning import Condition, blend_latents, conditioned
from distill.models.flow_matching import NUM_TRAIN_TIMESTEPS, high_noise_mask
from distill.models.teacher_kind import T2V_A14B, TeacherKind
from distill.ops.errors import DistillError, Stage


def few_step_scheduler(shift: float, shift_terminal: float | None = None) -> Any:
    """The scheduler a few-step student is trained with and exported with.

    `shift_terminal` stretches the shifted grid so that its last step lands at that sigma instead
    of near 0 (shift 5, 4 steps: timesteps 1000, 931, 783, 250 instead of 1000, 910, 717, 24); it
    is part of the scheduler's config, so stock WanPipeline's set_timesteps(K) reproduces it.
    """
    from diffusers import FlowMatchEulerDiscreteScheduler

    return FlowMatchEulerDiscreteScheduler(
        num_train_timesteps=NUM_TRAIN_TIMESTEPS,
        shift=shift,
        shift_terminal=shift_terminal,
        stochastic_sampling=True,
    )


def student_grid(scheduler: Any, steps: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(timesteps (K,), sigmas (K+1,) ending in 0) exactly as WanPipeline gets them from `scheduler`."""
    scheduler.set_timesteps(steps)
    return scheduler.timesteps.clone(), scheduler.sigmas.clone()


def steps_per_expert(timesteps: torch.Tensor, boundary_ratio: float | None) -> tuple[int, int]:
    """How many of the student's timesteps fall in the high- and the low-noise expert's range (with
    no boundary, one transformer, every step is `transformer`'s: (K, 0))."""
    high = int(high_noise_mask(timesteps, boundary_ratio).sum())
    return high, len(timesteps) - high


def check_grid(timesteps: torch.Tensor, boundary_ratio: float | None, shift: float) -> None:
    """Refuse a grid that leaves one expert's range without any step (for K >= 2). A teacher with
    one transformer (no boundary) runs every step of any grid."""
    if boundary_ratio is None:
        return
    high, low = steps_per_expert(timesteps, boundary_ratio)
    if len(timesteps) >= 2 and (high == 0 or low == 0):
        raise DistillError(
            f"--student_shift {shift} puts all {len(timesteps)} student steps in the "
            f"{'high' if low == 0 else 'low'}-noise expert's range",
            f"timesteps {[round(float(t)) for t in timesteps]}, expert boundary t = {boundary_ratio * 1000:.0f}",
            fixes=[
                "use a shift that splits the steps across the boundary, e.g. --student_shift 5 for 4 steps",
                "or move the last step up with --student_shift_terminal (e.g. 0.25)",
            ],
            stage=Stage.CONFIG,
        )


def rollout_step(
    x: torch.Tensor,
    velocity: torch.Tensor,
    sigma: torch.Tensor,
    sigma_next: torch.Tensor,
    noise: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One stochastic flow-match step, as FlowMatchEulerDiscreteScheduler(stochastic_sampling=True).step
    computes it: x0 = x - sigma v, then x_next = (1 - sigma_next) x0 + sigma_next noise. Returns (x0, x_next)."""
    x0 = x.float() - sigma * velocity
    return x0, ((1.0 - sigma_next) * x0 + sigma_next * noise).to(velocity.dtype)


def rollout(
    model: torch.nn.Module,
    x: torch.Tensor,
    cond: torch.Tensor,
    timesteps: torch.Tensor,
    sigmas: torch.Tensor,
    draw_noise: Callable[[tuple[int, ...]], torch.Tensor],
    stop: int | None = None,
    kind: TeacherKind = T2V_A14B,
    condition: Condition | None = None,
) -> torch.Tensor:
    """Run the student's stochastic sampler from `x` (noise at sigmas[0]) through steps 0..stop-1.

    Returns the latent the sampler holds before step `stop` (default: after all K steps, the sample).
    `draw_noise(shape)` gives each step's re-noising (drawn even at the last step, whose next sigma
    is 0, as the scheduler does: the random stream stays aligned with WanPipeline's).
    `model` is the bare student: each forward gets the input and timestep of the teacher's `kind` for
    `condition` (conditioning.conditioned), and after each step the latents get back what the
    condition fixes (TI2V image mode: the image's latent frame), as the official Wan sampler blends
    them; stock WanImageToVideoPipeline blends once at the end, the same latents, since a step is
    elementwise and no forward reads the replaced positions.
    """
    stop = len(timesteps) if stop is None else stop
    device = x.device
    forward = conditioned(model, kind, condition)
    x = blend_latents(kind, x, condition)
    for i in range(stop):
        dtype = getattr(model, "dtype", torch.float32)
        velocity = forward(
            hidden_states=x.to(dtype),
            timestep=timesteps[i].to(device).expand(x.shape[0]),
            encoder_hidden_states=cond,
            return_dict=False,
        )[0]
        noise = draw_noise(tuple(x.shape))
        _, x = rollout_step(x, velocity, sigmas[i].to(device), sigmas[i + 1].to(device), noise)
        x = blend_latents(kind, x, condition)
    return x


@torch.no_grad()
def sample_few_step(
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
    """A K-step sample (B, C, F, H, W) of the student for `prompt_embeds` (B, L, D), float32.

    On the CPU, equals stock WanPipeline(transformer=student, scheduler=<the exported one>) called with
    num_inference_steps=steps, guidance_scale=1.0 and no generator after torch.manual_seed(seed); on
    any device, the same sample as on the CPU (the noise is drawn on the CPU).
    `noise` (B, C, F, H, W) replaces the starting noise (e.g. the teacher's, drawn on the CPU, to
    compare both from the same start); the re-noising stream is the same either way. `condition`
    (one row per prompt) is what the teacher's `kind` adds to every forward (I2V: the image; TI2V
    image mode: the image's latent frame, which the sample then holds at frame 0, and a timestep
    per token, as WanImageToVideoPipeline with expand_timesteps gives them).
    """
    device = next(student.parameters()).device
    generator = torch.Generator("cpu").manual_seed(seed)

    def draw(shape: tuple[int, ...]) -> torch.Tensor:
        return torch.randn(shape, generator=generator, dtype=torch.float32).to(device)

    timesteps, sigmas = student_grid(scheduler, steps)
    cond = prompt_embeds.to(device, getattr(student, "dtype", torch.float32))
    x = draw((cond.shape[0], *latent_shape))  # drawn even when replaced: the stream stays aligned
    if noise is not None:
        x = noise.to(device, torch.float32).reshape(x.shape)
    condition = condition.to(device) if condition is not None else None
    return rollout(student, x, cond, timesteps, sigmas, draw, kind=kind, condition=condition).float()


@contextlib.contextmanager
def renoising_from(scheduler: Any, generator: torch.Generator) -> Iterator[None]:
    """Within the block, `scheduler.step` re-noises from `generator` (a CPU one).

    Stock pipelines call `scheduler.step` without a generator, so a stochastic scheduler draws its
    re-noising from the global RNG of the latents' device: the same seed gave another sample on a
    GPU than on the CPU. diffusers' `randn_tensor` draws on the CPU when given a CPU generator and
    moves the numbers, so with one stream for the start and the re-noising a seed gives the sample
    `sample_few_step` gives, on any device (on the CPU, bit for bit what the global RNG seeded the
    same way gave)."""
    scheduler.step = functools.partial(type(scheduler).step, scheduler, generator=generator)
    try:
        yield
    finally:
        del scheduler.step  # the instance attribute: the class's method shows again


def load_few_step_scheduler(student_dir: str | Path) -> Any | None:
    """The scheduler exported beside a few-step student (its scheduler_config.json), or None."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    if not (Path(student_dir) / "scheduler_config.json").is_file():
        return None
    return FlowMatchEulerDiscreteScheduler.from_pretrained(student_dir)
