"""Velocity distillation: regress the student onto the guided teacher's velocity at a random timestep.

One micro-batch: clean latents x0 from the teacher's cache, fresh noise and shifted timesteps,
x_t = (1 - sigma) x0 + sigma noise; the teacher expert that owns t (with its guidance) gives the
target velocity, and the student is trained with MSE onto it. Makes the student small; it still
samples with the teacher's number of steps.
"""

from __future__ import annotations

import torch

from distill.models.conditioning import batch_condition, conditioned, loss_weight
from distill.models.flow_matching import (
    add_noise,
    high_noise_mask,
    motion_extras,
    per_sample_mse,
    sigmas_to_timesteps,
)
from distill.train.methods.base import BatchRandomness, Method, UpdateLoss


class VelocityMethod(Method):
    name = "velocity"

    def loss(self, update: str, batch: dict[str, torch.Tensor], rng: BatchRandomness) -> UpdateLoss:
        env = self.env
        device = env.device
        x0 = batch["x0"].to(device, non_blocking=True)
        # The cache keeps embeddings in the teacher's dtype; the student computes in float32 (or autocast).
        cond = batch["cond"].to(device, torch.float32, non_blocking=True)
        sigmas, every = rng.sigmas(x0.shape[0], env.shift)
        noise = rng.noise(tuple(x0.shape))
        high_anywhere = high_noise_mask(sigmas_to_timesteps(every), env.teacher.boundary_ratio)
        experts_needed = (bool(high_anywhere.any()), bool((~high_anywhere).any()))
        timesteps = sigmas_to_timesteps(sigmas)
        # Non-blocking copies of the small CPU tensors: a blocking one waits for every queued kernel
        # (the previous step's optimizer, then the teacher), leaving the GPU idle while the host
        # catches up with its kernel launches.
        timesteps_device = timesteps.to(device, non_blocking=True)
        # x_t from the float32 rounding of the float64 sigmas, the timestep floor(1000 sigma) as int64:
        # what WanPipeline's scheduler feeds the teacher at inference.
        x_t = add_noise(x0, noise.to(x0.dtype), sigmas.to(device, torch.float32, non_blocking=True))
        # What the teacher's kind adds to each input (I2V: the image), the same for both models.
        condition = batch_condition(batch, device)
        target = env.teacher.velocity(x_t, timesteps, cond, env.negative, experts_needed, condition)
        student = conditioned(self.train_models["student"], env.teacher.kind, condition)
        with env.autocast():
            prediction = student(
                hidden_states=x_t, timestep=timesteps_device, encoder_hidden_states=cond, return_dict=False
            )[0]
        # On clips: the clean estimates both imply at this x_t, whose frame-to-frame change is the motion.
        sigma = sigmas.to(device, torch.float32, non_blocking=True).view(-1, *([1] * (x_t.dim() - 1)))
        extras = motion_extras(x_t - sigma * prediction.float(), x_t - sigma * target.float())
        return UpdateLoss(
            per_sample_mse(prediction, target, loss_weight(env.teacher.kind, x_t, condition)),
            high_noise_mask(timesteps_device, env.teacher.boundary_ratio),
            extras,
        )
