"""The distillation objective as pure tensor functions: timesteps, noising, guidance, loss.

Conventions follow Wan's flow matching (and diffusers' WanPipeline): sigma in [0, 1], timestep
t = floor(1000 * sigma) as an integer (what WanPipeline's UniPC scheduler feeds the models),
x_t = (1 - sigma) * x0 + sigma * noise, and the models predict the velocity noise - x0. The schedule is shifted towards high noise exactly as Wan's sampler shifts it.
"""

from __future__ import annotations

import torch

NUM_TRAIN_TIMESTEPS = 1000


def shift_sigmas(sigmas: torch.Tensor, shift: float) -> torch.Tensor:
    """Wan's time shift: sigma' = shift * s / (1 + (shift - 1) * s), so shift > 1 favours high noise."""
    return shift * sigmas / (1.0 + (shift - 1.0) * sigmas)


def sample_sigmas(batch_size: int, shift: float, generator: torch.Generator) -> torch.Tensor:
    """Draw training sigmas on the CPU: uniform in (0, 1), then shifted like the teacher's sampler.

    Drawn on the CPU on purpose: routing samples to experts then needs no device-to-host sync.
    Float64, like the scheduler's own sigmas: the timestep is taken from these (sigmas_to_timesteps)
    and x_t from their float32 rounding (add_noise), exactly as WanPipeline does.
    """
    uniform = torch.rand(batch_size, generator=generator, dtype=torch.float64)
    # Keep away from the exact ends, where x_t is pure data or pure noise and t is out of range.
    uniform = uniform.clamp(1e-4, 1.0 - 1e-4)
    return shift_sigmas(uniform, shift)


def sigmas_to_timesteps(sigmas: torch.Tensor) -> torch.Tensor:
    """Integer timesteps floor(1000 * sigma), as UniPCMultistepScheduler.set_timesteps casts them
    (float64 sigmas times 1000, then int64). Give float64 sigmas to match it exactly: a float32
    sigma can round across an integer (0.334 -> 334.0 where the scheduler has 333)."""
    return (sigmas.double() * NUM_TRAIN_TIMESTEPS).to(torch.int64)


def add_noise(x0: torch.Tensor, noise: torch.Tensor, sigmas: torch.Tensor) -> torch.Tensor:
    """x_t = (1 - sigma) * x0 + sigma * noise, with one sigma per sample."""
    sigma = sigmas.to(device=x0.device, dtype=x0.dtype).view(-1, *([1] * (x0.dim() - 1)))
    return (1.0 - sigma) * x0 + sigma * noise


def high_noise_mask(timesteps: torch.Tensor, boundary_ratio: float | None) -> torch.Tensor:
    """True where the high-noise expert (`transformer`) handles the sample, as in WanPipeline; with
    no boundary (a model with one transformer) `transformer` handles every sample."""
    if boundary_ratio is None:
        return torch.ones(timesteps.shape, dtype=torch.bool, device=timesteps.device)
    return timesteps >= boundary_ratio * NUM_TRAIN_TIMESTEPS


def apply_guidance(cond: torch.Tensor, uncond: torch.Tensor, scale: float) -> torch.Tensor:
    """Classifier-free guidance: uncond + scale * (cond - uncond)."""
    return uncond + scale * (cond - uncond)


def per_sample_mse(
    prediction: torch.Tensor, target: torch.Tensor, weight: torch.Tensor | None = None
) -> torch.Tensor:
    """Mean squared error of each sample, computed in float32 (shape (B,)). With `weight` (0/1,
    broadcasting against the prediction: conditioning.loss_weight) the mean is over the counted
    positions only, so a masked frame neither adds error nor dilutes it."""
    diff = prediction.float() - target.float()
    if weight is None:
        return diff.pow(2).flatten(1).mean(dim=1)
    weight = weight.expand_as(diff)
    return (diff.pow(2) * weight).flatten(1).sum(dim=1) / weight.flatten(1).sum(dim=1).clamp_min(1.0)


def frame_change(latents: torch.Tensor) -> torch.Tensor | None:
    """How much each clip's latents change from one latent frame to the next: the mean absolute
    difference of consecutive frames of (B, C, T, h, w), per sample (B,); None for pictures (T = 1).
    The same measure on a student's and on the teacher's latents of the same prompts gives their
    motion ratio (below 1: the student moves less)."""
    if latents.dim() != 5 or latents.shape[2] < 2:
        return None
    return (latents[:, :, 1:] - latents[:, :, :-1]).abs().float().mean(dim=(1, 2, 3, 4))


def motion_extras(student_x0: torch.Tensor, teacher_x0: torch.Tensor) -> dict[str, torch.Tensor]:
    """UpdateLoss extras for the motion ratio (`Method.finish_metrics`): empty for pictures."""
    ours, theirs = frame_change(student_x0.detach()), frame_change(teacher_x0.detach())
    if ours is None or theirs is None:
        return {}
    return {"motion": ours, "teacher_motion": theirs}
