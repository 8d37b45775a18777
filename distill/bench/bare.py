"""The least a step must do on the same models and tensors (teacher's guided forward, student forward
and backward, AdamW; a whole generator + critic cycle for dmd): the baseline the trainer's own
step is compared against."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch

from distill.bench.settings import BOUNDARY_RATIO, FLOW_SHIFT, GUIDANCE_HIGH, GUIDANCE_LOW
from distill.bench.setup import Setup
from distill.models.flow_matching import (
    NUM_TRAIN_TIMESTEPS,
    apply_guidance,
    sample_sigmas,
    sigmas_to_timesteps,
)


class BareLoop:
    """Teacher guided forward (routed by t), student forward/backward, AdamW step; nothing else.

    Runs on the trainer's own models and optimizer, on a small pool of batches already on the
    device, with the timesteps the trainer draws (same generator, same seed), so step j of both
    loops routes the same samples to the same experts.
    """

    def __init__(self, setup: Setup, steps: int, pool: int = 2) -> None:
        s, loop = setup.settings, setup.loop
        self.high, self.low, self.student = setup.high, setup.low, setup.student
        self.optimizer = loop.optimizer
        self.dtype, self.device = setup.teacher_dtype, setup.device
        self.autocast_dtype = torch.bfloat16 if s.dtype == "bfloat16" else None
        batch = s.batch_size
        generator = torch.Generator().manual_seed(s.seed + 7)
        text_dim = setup.teacher_config["text_dim"]
        self.uncond = loop.negative.to(self.dtype)
        self.pool = [
            (
                torch.randn((batch, *setup.latent_shape), generator=generator).to(self.device),
                torch.randn(batch, s.text_len, text_dim, generator=generator).to(self.device, self.dtype),
            )
            for _ in range(pool)
        ]
        timestep_generator = torch.Generator().manual_seed(s.seed + 1)  # as TrainingLoop seeds its own
        self.timesteps = []
        for _ in range(steps):
            t = sigmas_to_timesteps(sample_sigmas(batch, FLOW_SHIFT, timestep_generator))
            self.timesteps.append((t, t.to(self.device)))
        self.done = 0

    def teacher_velocity(
        self, x_t: torch.Tensor, t: torch.Tensor, t_dev: torch.Tensor, cond: torch.Tensor
    ) -> torch.Tensor:
        is_high = t >= BOUNDARY_RATIO * NUM_TRAIN_TIMESTEPS
        n_high = int(is_high.sum())  # CPU tensor: no device sync
        parts = []
        for expert, scale, mask, count in (
            (self.high, GUIDANCE_HIGH, is_high, n_high),
            (self.low, GUIDANCE_LOW, ~is_high, len(t) - n_high),
        ):
            if count == 0:
                continue
            if count == len(t):
                x, tt, c = x_t, t_dev, cond
            else:
                rows = mask.nonzero().flatten().to(self.device)
                x, tt, c = x_t[rows], t_dev[rows], cond[rows]
            x = x.to(self.dtype)
            both = expert(
                hidden_states=torch.cat([x, x]),
                timestep=torch.cat([tt, tt]),
                encoder_hidden_states=torch.cat([c, self.uncond.expand(count, -1, -1)]),
                return_dict=False,
            )[0]
            parts.append((mask, apply_guidance(both[:count].float(), both[count:].float(), scale)))
        if len(parts) == 1:
            return parts[0][1]
        out = torch.empty(x_t.shape, dtype=torch.float32, device=self.device)
        for mask, value in parts:
            out[mask.to(self.device)] = value
        return out

    def step(self) -> None:
        x_t, cond = self.pool[self.done % len(self.pool)]
        t, t_dev = self.timesteps[self.done]
        self.done += 1
        with torch.no_grad():
            target = self.teacher_velocity(x_t, t, t_dev, cond)
        autocast = (
            torch.autocast(self.device.type, dtype=self.autocast_dtype)
            if self.autocast_dtype
            else contextlib.nullcontext()
        )
        with autocast:
            prediction = self.student(
                hidden_states=x_t, timestep=t_dev, encoder_hidden_states=cond, return_dict=False
            )[0]
        loss = (prediction.float() - target).pow(2).mean()
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)


class BareDmdLoop:
    """One dmd cycle with nothing else: a generator update then `critic_updates` critic updates.

    Generator update: the student's no-grad rollout from noise to a random step k of its K, its
    forward with gradient there (x0_hat), x0_hat noised to a random t', the guided teacher (routed
    by t') and the critic without gradient, the normalised DMD loss, backward, AdamW. Critic update:
    the rollout to k and one more no-grad student forward (x0_hat), x0_hat noised to a shifted t,
    the critic's forward and backward on the flow-matching loss, AdamW. The trainer's models and
    optimizers; k, t' and t come from a generator seeded as the trainer's and drawn in the same
    order, so both loops run the same rollout depths and route the same samples to the same experts.
    """

    def __init__(self, setup: Setup, pool: int = 2) -> None:
        from distill.models.few_step import few_step_scheduler, student_grid

        s, loop = setup.settings, setup.loop
        self.velocity_loop = BareLoop(setup, 0, pool)  # its pool, dtype and guided teacher forward
        self.student, self.critic = setup.student, setup.extra["critic"]
        self.optimizers = loop.optimizers
        self.device, self.shift, self.updates = setup.device, FLOW_SHIFT, s.critic_updates
        self.batch, self.shape = s.batch_size, (s.batch_size, *setup.latent_shape)
        self.timesteps, self.sigmas = student_grid(
            few_step_scheduler(loop.cfg.student_shift, loop.cfg.student_shift_terminal), s.student_steps
        )
        self.cpu = torch.Generator().manual_seed(s.seed + 1)  # as TrainingLoop seeds its own
        self.noise_generator = torch.Generator(self.device).manual_seed(s.seed + 2)
        self.done = 0

    def noise(self) -> torch.Tensor:
        return torch.randn(self.shape, generator=self.noise_generator, device=self.device)

    def autocast(self) -> contextlib.AbstractContextManager:
        dtype = self.velocity_loop.autocast_dtype
        return torch.autocast(self.device.type, dtype=dtype) if dtype else contextlib.nullcontext()

    def forward(
        self, model: torch.nn.Module, x: torch.Tensor, t: torch.Tensor, cond: torch.Tensor
    ) -> torch.Tensor:
        with self.autocast():
            return model(hidden_states=x, timestep=t, encoder_hidden_states=cond, return_dict=False)[
                0
            ].float()

    def sample(self, cond: torch.Tensor, grad: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """(x0_hat, the latent it came from) at a random student step, through the no-grad rollout."""
        k = int(torch.randint(len(self.timesteps), (1,), generator=self.cpu).item())
        x = self.noise()
        with torch.no_grad():
            for i in range(k):
                t = self.timesteps[i].expand(self.batch).to(self.device)
                x0 = x - self.sigmas[i] * self.forward(self.student, x, t, cond)
                x = (1 - self.sigmas[i + 1]) * x0 + self.sigmas[i + 1] * self.noise()
        t = self.timesteps[k].expand(self.batch).to(self.device)
        with torch.set_grad_enabled(grad):
            return x - self.sigmas[k] * self.forward(self.student, x, t, cond), x

    def generator_update(self, cond: torch.Tensor) -> None:
        x0_hat, _ = self.sample(cond, grad=True)
        uniform = torch.rand(self.batch, generator=self.cpu, dtype=torch.float64)
        sigma = (self.shift * uniform / (1 + (self.shift - 1) * uniform)).clamp(0.02, 0.98)
        t = (sigma * NUM_TRAIN_TIMESTEPS).to(torch.int64)
        sigma_dev = sigma.to(self.device, torch.float32).view(-1, 1, 1, 1, 1)
        x_t = (1 - sigma_dev) * x0_hat.detach() + sigma_dev * self.noise()
        with torch.no_grad():
            real = x_t - sigma_dev * self.velocity_loop.teacher_velocity(x_t, t, t.to(self.device), cond)
            fake = x_t - sigma_dev * self.forward(self.critic, x_t, t.to(self.device), cond)
            scale = (x0_hat.detach() - real).abs().mean(dim=(1, 2, 3, 4), keepdim=True)
            target = x0_hat.detach() - (fake - real) / scale
        loss = 0.5 * (x0_hat - target).pow(2).mean()
        loss.backward()
        self.optimizers["student"].step()
        self.optimizers["student"].zero_grad(set_to_none=True)

    def critic_update(self, cond: torch.Tensor) -> None:
        x0_hat, _ = self.sample(cond, grad=False)
        sigma = sample_sigmas(self.batch, self.shift, self.cpu)
        t = (sigma * NUM_TRAIN_TIMESTEPS).to(torch.int64).to(self.device)
        sigma_dev = sigma.to(self.device, torch.float32).view(-1, 1, 1, 1, 1)
        noise = self.noise()
        x_t = (1 - sigma_dev) * x0_hat + sigma_dev * noise
        loss = (self.forward(self.critic, x_t, t, cond) - (noise - x0_hat)).pow(2).mean()
        loss.backward()
        self.optimizers["critic"].step()
        self.optimizers["critic"].zero_grad(set_to_none=True)

    def step(self) -> None:
        """One cycle: as `critic_updates` trainer steps (the first also updates the generator)."""
        pool = self.velocity_loop.pool
        for i in range(self.updates):
            cond = pool[(self.done + i) % len(pool)][1]
            if i == 0:
                self.generator_update(cond)
            self.critic_update(cond)
        self.done += self.updates


def synchronizer(device: torch.device) -> Callable[[], None]:
    if device.type == "cuda":
        return lambda: torch.cuda.synchronize(device)
    return lambda: None


class TrainerSteps:
    """Calls `TrainingLoop.train_step` as `TrainingLoop.train` does; counts skipped steps. One bench
    step is `per_step` loop steps (dmd: a cycle of one generator and --critic_updates critic updates)."""

    def __init__(self, loop: Any, per_step: int = 1) -> None:
        self.loop = loop
        self.batches = iter(loop.make_loader())
        self.skipped = 0
        self.per_step = per_step

    def step(self) -> None:
        for _ in range(self.per_step):
            _, stepped, _ = self.loop.train_step(self.batches)
            self.skipped += not stepped
