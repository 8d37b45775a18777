"""Distribution-matching distillation (DMD2-style): the student becomes a K-step generator.

Two trained models. The student (generator) samples with K stochastic flow-match steps (see
distill/models/few_step.py). A critic (the "fake score", by default the student's shape) learns by flow
matching what the student currently generates. The generator update moves the student's samples
along the difference between the critic's and the guided teacher's ("real score") clean-latent
estimates of the same noised sample:

    x0_hat            the student's clean estimate at one of its steps (with gradient)
    x_t'              x0_hat (detached) noised to a random t' (shifted, clamped to [0.02, 0.98])
    real, fake        x_t' - sigma' v for the teacher expert owning t' (with guidance) and the critic
    grad              (fake - real) / mean|x0_hat - real|          (per sample)
    generator loss    0.5 * MSE(x0_hat, stopgrad(x0_hat - grad))   (its gradient w.r.t. x0_hat is grad)

The critic updates `--critic_updates` times per generator update, on detached student samples.
Neither update sends a gradient into the other model: the generator update reads the critic
without gradient, and the critic update generates without gradient.

Every forward (the rollout's, the student's update, the teacher's, the critic's) goes through the
conditioning layer, so each sees the teacher kind's input and timestep (TI2V-5B: one per token) and
the sample's condition (an image). Every loss counts only what the condition leaves to the model
(`loss_weight`; TI2V image mode: not latent frame 0, the image), the normaliser of the gradient too:
weight None, every other kind and mode, is exactly the unweighted arithmetic.
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Callable
from typing import Any

import torch

from distill.config.settings import TrainConfig
from distill.models.conditioning import Condition, batch_condition, blend_latents, conditioned, loss_weight
from distill.models.few_step import check_grid, few_step_scheduler, rollout, student_grid
from distill.models.flow_matching import (
    add_noise,
    frame_change,
    high_noise_mask,
    motion_extras,
    per_sample_mse,
    shift_sigmas,
    sigmas_to_timesteps,
)
from distill.models.guided_teacher import GuidedTeacher
from distill.train.methods.base import BatchRandomness, Method, MethodEnv, UpdateLoss

logger = logging.getLogger(__name__)

# DMD2 keeps the score timestep t' away from both ends, where either estimate says little.
SCORE_SIGMA_RANGE = (0.02, 0.98)
TREND_WINDOW = 20  # logged critic losses the trend metrics look back over


def x0_from_velocity(x_t: torch.Tensor, velocity: torch.Tensor, sigmas: torch.Tensor) -> torch.Tensor:
    """Clean estimate x0 = x_t - sigma * v (one sigma per sample)."""
    sigma = sigmas.to(x_t.device, torch.float32).view(-1, *([1] * (x_t.dim() - 1)))
    return x_t.float() - sigma * velocity.float()


@torch.no_grad()
def score_estimates(
    x_t: torch.Tensor,
    sigmas: torch.Tensor,
    cond: torch.Tensor,
    uncond: torch.Tensor,
    teacher: GuidedTeacher,
    critic: torch.nn.Module,
    experts_needed: tuple[bool, bool] | None = None,
    autocast: Callable[[], Any] | None = None,
    condition: Condition | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(real, fake) clean estimates of x_t at `sigmas` (CPU, per sample, float64 for exact integer
    timesteps): the guided teacher routes each sample to the expert owning its t' = floor(1000 sigma),
    the critic answers conditionally without guidance; both see the same `condition`."""
    timesteps = sigmas_to_timesteps(sigmas)
    real_v = teacher.velocity(x_t, timesteps, cond, uncond, experts_needed, condition)
    with autocast() if autocast is not None else contextlib.nullcontext():
        fake_v = conditioned(critic, teacher.kind, condition)(
            hidden_states=x_t,
            timestep=timesteps.to(x_t.device),
            encoder_hidden_states=cond,
            return_dict=False,
        )[0]
    return x0_from_velocity(x_t, real_v, sigmas), x0_from_velocity(x_t, fake_v, sigmas)


def final_step_motion(x0_hat: torch.Tensor, teacher_x0: torch.Tensor, final: bool) -> dict[str, torch.Tensor]:
    """Motion extras (`motion_extras`) that count only the student's FINAL samples: an earlier step's
    estimate is a blurred mean, whose smaller frame-to-frame change would read as slow motion in a
    student that has none. Other steps give zeros, which add nothing to either sum of the ratio."""
    extras = motion_extras(x0_hat, teacher_x0)
    if not final:
        extras = {name: torch.zeros_like(value) for name, value in extras.items()}
    return extras


def dmd_gradient(
    x0_hat: torch.Tensor, real: torch.Tensor, fake: torch.Tensor, weight: torch.Tensor | None = None
) -> torch.Tensor:
    """DMD2's normalised distribution-matching gradient, per sample: (fake - real) / mean|x0_hat - real|.

    With `weight` (conditioning.loss_weight: 0 where the condition fixes the latents) the mean is
    over the counted positions only and the gradient is 0 elsewhere: the scores there answer a
    position the sampler overwrites, and would otherwise scale the gradient of every other one."""
    x0_hat = x0_hat.detach().float()
    dims = tuple(range(1, x0_hat.dim()))
    if weight is None:
        normaliser = (x0_hat - real).abs().mean(dim=dims, keepdim=True).clamp_min(1e-12)
        return torch.nan_to_num((fake - real) / normaliser)
    weight = weight.to(x0_hat.device, torch.float32).expand_as(x0_hat)
    counted = weight.sum(dim=dims, keepdim=True).clamp_min(1.0)
    normaliser = ((x0_hat - real).abs() * weight).sum(dim=dims, keepdim=True) / counted
    return torch.nan_to_num((fake - real) * weight / normaliser.clamp_min(1e-12))


def dmd_loss(x0_hat: torch.Tensor, grad: torch.Tensor, weight: torch.Tensor | None = None) -> torch.Tensor:
    """Per-sample 0.5 * MSE(x0_hat, stopgrad(x0_hat - grad)): its gradient w.r.t. x0_hat is grad / numel
    (grad / the counted positions with `weight`, which leaves the others out of the mean)."""
    target = (x0_hat.detach().float() - grad).detach()
    return 0.5 * per_sample_mse(x0_hat, target, weight)


def score_sigmas(uniform: torch.Tensor, shift: float) -> torch.Tensor:
    """t' / 1000 from uniform numbers: shifted like training timesteps, clamped to SCORE_SIGMA_RANGE.

    Float64 like objective.sample_sigmas: the teacher and the critic get t' = floor(1000 sigma) as
    int64 (as WanPipeline's scheduler feeds the teacher) and x_t' the float32 rounding of sigma."""
    return shift_sigmas(uniform.double(), shift).clamp(*SCORE_SIGMA_RANGE)


def phase_steps(timesteps: torch.Tensor, boundary_ratio: float | None, phase: str) -> list[int]:
    """Indices of the student's steps an --expert_phase trains (all of them for "both", and for the
    one transformer of a teacher with no boundary, which is `transformer`, the "high" expert)."""
    high = high_noise_mask(timesteps, boundary_ratio)
    keep = {"both": torch.ones_like(high), "high": high, "low": ~high}[phase]
    return [i for i in range(len(timesteps)) if keep[i]]


def phase_uniform(
    uniform: torch.Tensor, phase: str, shift: float, boundary_ratio: float | None
) -> torch.Tensor:
    """Uniform [0, 1) numbers moved into the part of [0, 1) whose shifted sigma lies on `phase`'s side
    of the boundary (shift_sigmas is monotonic: it is inverted at the boundary). With no boundary
    every noise level is the one transformer's: the numbers as they are."""
    if boundary_ratio is None:
        return uniform
    at_boundary = boundary_ratio / (shift - (shift - 1.0) * boundary_ratio)
    if phase == "high":
        return at_boundary + uniform * (1.0 - at_boundary)
    return uniform * at_boundary


def guided_stage_one(student_init: str | None) -> str | None:
    """Why a --student_init folder is a poor start for dmd, or None: a velocity student distilled
    from the guided teacher (its run_settings.json says so) has the guidance built into its
    velocity, and its clean estimates at high noise overshoot by that factor. On the toy teacher,
    dmd from such a student reached 0.70 at 4 steps; from one distilled at guidance 1, 0.97."""
    from distill.sample.card_code import learned_guidance
    from distill.sample.run_settings import find_run_settings

    if student_init in (None, "random", "teacher"):
        return None
    found = find_run_settings(student_init)
    if found is None or found[0].method != "velocity" or not learned_guidance(found[0]):
        return None
    settings, path = found
    return (
        f"--student_init {student_init} was distilled from the guided teacher (guidance "
        f"{settings.teacher_guidance_scale} / {settings.teacher_guidance_scale_2}, {path}); dmd works "
        "best from a stage-1 student distilled without guidance: run stage 1 with "
        "--guidance_scale 1 --guidance_scale_2 1 (README, the two-stage recipe)"
    )


class CriticLossTrend:
    """Oscillation of the critic loss over the last logged values: its running std, and how often the
    slope of the loss changes sign (a steadily learning critic changes slope rarely)."""

    def __init__(self) -> None:
        self.values: list[float] = []

    def add(self, value: float) -> dict[str, float]:
        self.values = (self.values + [value])[-TREND_WINDOW:]
        values = torch.tensor(self.values, dtype=torch.float64)
        metrics = {"critic_loss_running_std": float(values.std()) if len(values) > 1 else 0.0}
        slopes = values.diff()
        signs = slopes[slopes != 0].sign()
        metrics["critic_loss_slope_sign_changes"] = (
            float((signs.diff() != 0).sum()) if len(signs) > 1 else 0.0
        )
        return metrics


class DmdMethod(Method):
    name = "dmd"

    def __init__(self, cfg: TrainConfig, env: MethodEnv, models: dict[str, torch.nn.Module]) -> None:
        super().__init__(cfg, env, models)
        self.scheduler = few_step_scheduler(cfg.student_shift, cfg.student_shift_terminal)
        self.timesteps, self.sigmas = student_grid(self.scheduler, cfg.student_steps)
        check_grid(self.timesteps, env.teacher.boundary_ratio, cfg.student_shift)
        # --expert_phase: the student steps, and the noise levels of the score and the critic, on one
        # side of the boundary (published phased recipes keep each expert's DMD inside its range).
        # One transformer owns every step and noise level: its only phase is both (run_checks
        # refuses another --expert_phase for such a teacher before anything loads).
        self.phase = cfg.expert_phase if env.teacher.boundary_ratio is not None else "both"
        self.step_choices = phase_steps(self.timesteps, env.teacher.boundary_ratio, self.phase)
        self.trend = CriticLossTrend()
        advice = guided_stage_one(cfg.student_init)
        if advice:
            logger.warning(advice)

    @staticmethod
    def extra_models(cfg: TrainConfig) -> dict[str, tuple[str | None, str | None]]:
        return {"critic": (cfg.critic_config, cfg.critic_init)}

    @staticmethod
    def needs_clean_latents(cfg: TrainConfig) -> bool:
        """Backward simulation starts from noise and the scores come from the teacher and the critic:
        only `data` inputs and the regression term read the teacher's samples."""
        return cfg.dmd_inputs == "data" or cfg.regression_weight > 0

    @staticmethod
    def needs_teacher_noise(cfg: TrainConfig) -> bool:
        return cfg.regression_weight > 0

    # -- schedule of updates -------------------------------------------------------------------
    def updates(self, step: int) -> list[str]:
        """Every step trains the critic; every `critic_updates`-th (from the first) also the student, first."""
        generator = (step - 1) % self.cfg.critic_updates == 0
        return ["student", "critic"] if generator else ["critic"]

    def update_count(self, name: str, total_steps: int) -> int:
        return total_steps if name == "critic" else math.ceil(total_steps / self.cfg.critic_updates)

    def optimizer_settings(self, name: str) -> dict[str, Any]:
        if name == "critic":
            return {
                "lr": self.cfg.critic_lr or self.cfg.lr,
                "betas": self.cfg.critic_betas_tuple,
                "weight_decay": self.cfg.weight_decay,
            }
        # DMD2 runs both models with beta1 = 0: the generator's target moves with the critic.
        return {**super().optimizer_settings(name), "betas": self.cfg.generator_betas_tuple}

    def metric_prefix(self, name: str) -> str:
        return "" if name == "student" else "critic_"

    def in_phase(self, uniform: torch.Tensor) -> torch.Tensor:
        return phase_uniform(uniform, self.phase, self.env.shift, self.env.teacher.boundary_ratio)

    # -- the student's samples ---------------------------------------------------------------
    def generate(
        self,
        batch: dict[str, torch.Tensor],
        cond: torch.Tensor,
        rng: BatchRandomness,
        model: torch.nn.Module,
        regression: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None, int]:
        """The student's clean estimate x0_hat at a random one of its K steps, computed by `model` (the
        caller decides whether it carries gradient).

        With `regression`, the same forward also gives the student's first-step estimate from the
        teacher's own initial noise (whose teacher sample is the cached x0): DDP allows one forward
        per backward, so both ride in one batch. Returns (x0_hat, that estimate or None, the step).
        """
        env, device = self.env, self.env.device
        n = cond.shape[0]
        shape = tuple(batch["x0"].shape) if "x0" in batch else (n, *env.latent_shape)
        k = self.step_choices[rng.integer(len(self.step_choices))]
        # The sample's condition (I2V: its image) enters every forward of the rollout and the update.
        condition = batch_condition(batch, device)
        kind = env.teacher.kind
        if self.cfg.dmd_inputs == "simulate":
            # Backward simulation: the student's own rollout from noise, without gradient, to step k.
            x = rng.noise(shape)
            with torch.no_grad(), env.autocast():
                x = rollout(
                    self.models["student"],
                    x,
                    cond,
                    self.timesteps,
                    self.sigmas,
                    rng.noise,
                    stop=k,
                    kind=kind,
                    condition=condition,
                )
        else:  # data: the teacher's clean latents noised to the student's k-th sigma
            x0 = batch["x0"].to(device, torch.float32, non_blocking=True)
            x = add_noise(x0, rng.noise(shape), self.sigmas[k].expand(n))
        inputs, timesteps, text, both = x, self.timesteps[k].expand(n), cond, condition
        if regression:
            teacher_noise = batch["noise"].to(device, torch.float32, non_blocking=True)
            inputs = torch.cat([x, teacher_noise])
            timesteps = torch.cat([timesteps, self.timesteps[0].expand(n)])
            text = torch.cat([cond, cond])
            both = condition.repeat(2) if condition is not None else None
        with env.autocast():
            velocity = conditioned(model, kind, both)(
                hidden_states=inputs,
                timestep=timesteps.to(device),
                encoder_hidden_states=text,
                return_dict=False,
            )[0].float()
        # The sample as the sampler hands it on: what the condition fixes put back (TI2V image mode:
        # the image at frame 0, which carries no gradient), so the scores and the metrics see it.
        x0_hat = blend_latents(kind, x.float() - self.sigmas[k].to(device) * velocity[:n], condition)
        if not regression:
            return x0_hat, None, k
        return x0_hat, inputs[n:] - self.sigmas[0].to(device) * velocity[n:], k

    def judged_positions(self, x_t: torch.Tensor, condition: Condition | None) -> torch.Tensor | None:
        """Which positions of the student's last sample the generator update counts: those the
        condition leaves to the model (`loss_weight`; None: all)."""
        return loss_weight(self.env.teacher.kind, x_t, condition)

    # -- losses --------------------------------------------------------------------------------
    def loss(self, update: str, batch: dict[str, torch.Tensor], rng: BatchRandomness) -> UpdateLoss:
        cond = batch["cond"].to(self.env.device, torch.float32, non_blocking=True)
        if update == "critic":
            return self.critic_loss(batch, cond, rng)
        return self.generator_loss(batch, cond, rng)

    def critic_loss(
        self, batch: dict[str, torch.Tensor], cond: torch.Tensor, rng: BatchRandomness
    ) -> UpdateLoss:
        """Flow matching of the critic on detached student samples (target: noise - x0_hat)."""
        env = self.env
        with torch.no_grad():
            x0_hat, _, step = self.generate(batch, cond, rng, self.models["student"])
        if self.phase == "both":
            sigmas, _ = rng.sigmas(x0_hat.shape[0], env.shift)
        else:
            uniform, _ = rng.uniform(x0_hat.shape[0])
            sigmas = shift_sigmas(self.in_phase(uniform.clamp(1e-4, 1.0 - 1e-4)), env.shift)
        noise = rng.noise(tuple(x0_hat.shape))
        timesteps = sigmas_to_timesteps(sigmas).to(env.device)
        x_t = add_noise(x0_hat, noise, sigmas)
        condition = batch_condition(batch, env.device)
        critic = conditioned(self.train_models["critic"], env.teacher.kind, condition)
        with env.autocast():
            prediction = critic(
                hidden_states=x_t, timestep=timesteps, encoder_hidden_states=cond, return_dict=False
            )[0]
        dims = tuple(range(1, x0_hat.dim()))
        return UpdateLoss(
            per_sample_mse(prediction, noise - x0_hat, loss_weight(env.teacher.kind, x_t, condition)),
            high_noise_mask(timesteps, env.teacher.boundary_ratio),
            # The student's samples against the teacher's clean latents: over-saturation shows here
            # first, and on clips slow motion (the teacher's cached latents of the same prompts).
            {
                "sample_mean": x0_hat.mean(dim=dims),
                "sample_std": x0_hat.std(dim=dims),
                **self.final_motion(x0_hat, batch, step),
            },
        )

    def final_motion(
        self, x0_hat: torch.Tensor, batch: dict[str, torch.Tensor], step: int
    ) -> dict[str, torch.Tensor]:
        """Motion extras of the student's samples against the teacher's cached latents of the same
        prompts (see `final_step_motion`), or, when the batch has none (data-free), against the
        teacher's mean motion over the reference prompts."""
        final = step == len(self.timesteps) - 1
        if "x0" in batch:
            teacher = batch["x0"].to(self.env.device, torch.float32, non_blocking=True)
            return final_step_motion(x0_hat, teacher, final)
        reference = self.env.reference_motion()
        ours = frame_change(x0_hat.detach())
        if reference is None or ours is None:
            return {}
        extras = {"motion": ours, "teacher_motion": torch.full_like(ours, reference)}
        return extras if final else {name: torch.zeros_like(value) for name, value in extras.items()}

    def generator_loss(
        self, batch: dict[str, torch.Tensor], cond: torch.Tensor, rng: BatchRandomness
    ) -> UpdateLoss:
        env, cfg = self.env, self.cfg
        student = self.train_models["student"]
        regression = cfg.regression_weight > 0
        x0_hat, first, _ = self.generate(batch, cond, rng, student, regression)
        batch_size = x0_hat.shape[0]
        uniform, every = rng.uniform(batch_size)
        if self.phase != "both":
            uniform, every = self.in_phase(uniform), self.in_phase(every)
        sigmas = score_sigmas(uniform, env.shift)
        high_anywhere = high_noise_mask(
            sigmas_to_timesteps(score_sigmas(every, env.shift)), env.teacher.boundary_ratio
        )
        experts_needed = (bool(high_anywhere.any()), bool((~high_anywhere).any()))
        noise = rng.noise(tuple(x0_hat.shape))
        x_t = add_noise(x0_hat.detach(), noise, sigmas)
        condition = batch_condition(batch, env.device)
        weight = self.judged_positions(x_t, condition)
        real, fake = score_estimates(
            x_t,
            sigmas,
            cond,
            env.negative,
            env.teacher,
            self.models["critic"],
            experts_needed,
            env.autocast,
            condition,
        )
        losses = dmd_loss(x0_hat, dmd_gradient(x0_hat, real, fake, weight), weight)
        extras = {}
        if regression:
            target = batch["x0"].to(env.device, torch.float32, non_blocking=True)
            reg = per_sample_mse(first, target, weight)
            losses = losses + cfg.regression_weight * reg
            extras["regression_loss"] = reg.detach()
        # The sigmas are float64 on the CPU (see score_sigmas); the mask joins the losses on the device.
        high_noise = high_noise_mask(sigmas_to_timesteps(sigmas), env.teacher.boundary_ratio)
        return UpdateLoss(losses, high_noise.to(env.device), extras)

    # -- reporting and state -------------------------------------------------------------------
    def finish_metrics(self, metrics: dict[str, Any]) -> dict[str, Any]:
        mean, std = self.env.latent_statistics()
        if "critic_sample_mean" in metrics:
            metrics["latent_mean_drift"] = metrics.pop("critic_sample_mean") - mean
            metrics["latent_std_ratio"] = metrics.pop("critic_sample_std") / max(std, 1e-12)
        if metrics.get("critic_loss") is not None:  # null: every critic update since the last row skipped
            metrics.update(self.trend.add(metrics["critic_loss"]))
        return super().finish_metrics(metrics)

    @staticmethod
    def identity(cfg: TrainConfig) -> dict[str, Any]:
        return {
            "student_steps": cfg.student_steps,
            "student_shift": cfg.student_shift,
            **({"student_shift_terminal": cfg.student_shift_terminal} if cfg.student_shift_terminal else {}),
            "critic_config": cfg.critic_config,
        }

    def state_dict(self) -> dict[str, Any]:
        return {"critic_loss_window": list(self.trend.values)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.trend.values = list(state.get("critic_loss_window", []))

    def export_scheduler(self) -> Any:
        return self.scheduler

    def sampling_settings(self) -> dict[str, Any]:
        return few_step_sampling(self.name, self.cfg, self.scheduler, self.timesteps)


def few_step_sampling(name: str, cfg: TrainConfig, scheduler: Any, timesteps: torch.Tensor) -> dict[str, Any]:
    """How a few-step student samples (Method.sampling_settings): its K steps of `scheduler`, guidance 1."""
    steps = cfg.student_steps
    return {
        "method": name,
        "num_inference_steps": steps,
        "guidance_scale": 1.0,
        "scheduler": {"_class_name": type(scheduler).__name__, **dict(scheduler.config)},
        "scheduler_note": (
            f"{steps} steps of FlowMatchEulerDiscreteScheduler(shift={cfg.student_shift}, "
            f"shift_terminal={cfg.student_shift_terminal}, stochastic_sampling=True) at timesteps {[round(float(t)) for t in timesteps]}: "
            "the exact rollout the student was trained on; it re-noises from the global torch RNG, "
            "so call torch.manual_seed(seed) first for a reproducible sample"
        ),
    }
