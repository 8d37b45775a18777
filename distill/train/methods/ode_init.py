"""ODE initialisation: regress the teacher's (noise -> clean latent) pairs at the student's few steps,
one step per chunk of a causal student.

The clean-latent cache already holds, for every prompt, the teacher's sample x0 and (re-drawn from
its seed) the noise it started from: the two ends of one path of the teacher's sampler. One update
puts each chunk of the clip at one of the student's K timesteps t_k (drawn per sample and chunk), on
the line between the two ends, x_k = (1 - sigma_k) x0 + sigma_k noise, and regresses the student's
clean estimate x - sigma_k v onto x0, every token at its chunk's timestep (the transformer reads one
per token). At the first step (sigma 1) the input is exactly the teacher's noise, so the student
learns the teacher's noise -> sample map there; at later steps the input lies on the straight line
between the pair rather than on the teacher's own curved path (which would need a cache of the
teacher's intermediate latents), the deterministic coupling a reflow-style regression trains on.

Under the block-causal mask each chunk sees only the chunks before it, each at its own noise level,
so the student learns to denoise a chunk from a past of any cleanliness, as streaming needs (its past
is clean there); this is the causal start CausVid-style training begins from, before Self-Forcing.
A bidirectional student (no --student_chunk_frames) is one chunk: one step per sample. The student
samples with the few-step grid it was regressed at (exported with its scheduler, like dmd's).
"""

from __future__ import annotations

from typing import Any

import torch

from distill.config.settings import TrainConfig
from distill.models.conditioning import (
    batch_condition,
    blend_latents,
    loss_weight,
    model_input,
    model_timestep,
)
from distill.models.few_step import check_grid, few_step_scheduler, student_grid
from distill.models.flow_matching import high_noise_mask, per_sample_mse
from distill.models.student import unwrap_model
from distill.train.methods.base import BatchRandomness, Method, MethodEnv, UpdateLoss
from distill.train.methods.dmd import few_step_sampling


def chunk_steps(rng: BatchRandomness, batch: int, chunks: int, steps: int) -> torch.Tensor:
    """(batch, chunks) indices into the student's `steps`-step grid, uniform, from the run's CPU
    generator: each chunk's draw is one global-batch draw whose rows this rank keeps, so the numbers
    do not depend on how many ranks share the batch."""
    draws = [rng.uniform(batch)[0] for _ in range(chunks)]
    return (torch.stack(draws, dim=1) * steps).long().clamp(max=steps - 1)


class OdeInitMethod(Method):
    name = "ode_init"

    def __init__(self, cfg: TrainConfig, env: MethodEnv, models: dict[str, torch.nn.Module]) -> None:
        super().__init__(cfg, env, models)
        self.scheduler = few_step_scheduler(cfg.student_shift, cfg.student_shift_terminal)
        self.timesteps, self.sigmas = student_grid(self.scheduler, cfg.student_steps)
        check_grid(self.timesteps, env.teacher.boundary_ratio, cfg.student_shift)
        # A timestep per token: one per (height x width) patch of the student's.
        config = getattr(unwrap_model(models["student"]), "config", None)
        self.patch = tuple(int(p) for p in getattr(config, "patch_size", (1, 2, 2))[1:])

    @staticmethod
    def needs_teacher_noise(cfg: TrainConfig) -> bool:
        return True

    @staticmethod
    def student_timestep_per_token(cfg: TrainConfig) -> bool:
        return True  # each frame at its chunk's step (a bidirectional student: one chunk, still per frame)

    def loss(self, update: str, batch: dict[str, torch.Tensor], rng: BatchRandomness) -> UpdateLoss:
        env, device, kind = self.env, self.env.device, self.env.teacher.kind
        x0 = batch["x0"].to(device, torch.float32, non_blocking=True)
        noise = batch["noise"].to(device, torch.float32, non_blocking=True)
        cond = batch["cond"].to(device, torch.float32, non_blocking=True)
        n, frames = x0.shape[0], x0.shape[2]
        chunk = self.cfg.student_chunk_frames or frames
        steps = chunk_steps(rng, n, frames // chunk, len(self.timesteps))
        per_frame = steps.repeat_interleave(chunk, dim=1)  # (B, F): each frame its chunk's step
        sigma = self.sigmas[per_frame].to(device, torch.float32).view(n, 1, frames, 1, 1)
        timesteps = self.timesteps[per_frame].to(device, torch.float32)
        condition = batch_condition(batch, device)
        x_t = blend_latents(kind, (1.0 - sigma) * x0 + sigma * noise, condition)
        with env.autocast():
            velocity = self.train_models["student"](
                hidden_states=model_input(kind, x_t, condition),
                timestep=model_timestep(kind, timesteps, x_t, condition, self.patch),
                encoder_hidden_states=cond,
                return_dict=False,
            )[0].float()
        estimate = blend_latents(kind, x_t - sigma * velocity, condition)
        losses = per_sample_mse(estimate, x0, loss_weight(kind, x_t, condition))
        # A sample's range: where most of its frames' timesteps lie (the loss is split by range in the logs).
        high = high_noise_mask(timesteps, env.teacher.boundary_ratio).float().mean(dim=1) >= 0.5
        return UpdateLoss(losses, high)

    @staticmethod
    def identity(cfg: TrainConfig) -> dict[str, Any]:
        return {
            "student_steps": cfg.student_steps,
            "student_shift": cfg.student_shift,
            **({"student_shift_terminal": cfg.student_shift_terminal} if cfg.student_shift_terminal else {}),
        }

    def export_scheduler(self) -> Any:
        return self.scheduler

    def sampling_settings(self) -> dict[str, Any]:
        return few_step_sampling(self.name, self.cfg, self.scheduler, self.timesteps)
