"""What a distillation method is to the training loop.

The loop (distill/train/loop.py) owns ranks, data order, accumulation, clipping, the non-finite
check, one optimizer and LR schedule per trained model, EMA, checkpoints, logging and export. A
method says which models it trains and, for each update, computes the loss of one micro-batch as
plain tensor code. It draws its randomness from `BatchRandomness`, which hands each rank its rows
of one global batch, so a method never needs to know how many processes share the batch.
"""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from distill.config.settings import TrainConfig
from distill.models.flow_matching import sample_sigmas
from distill.models.guided_teacher import GuidedTeacher


def sample_seed(seed: int, draw: int, row: int) -> int:
    """The seed of row `row` of the global batch in noise draw number `draw` of a run seeded `seed`."""
    digest = hashlib.blake2b(f"{seed}:{draw}:{row}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & (2**63 - 1)


class BatchRandomness:
    """Random draws for one GLOBAL micro-batch, identical on every rank; each rank keeps its rows.

    `cpu` draws timesteps, step indices and other small numbers (on the CPU, so routing samples to
    experts needs no device sync); it is the loop's generator and part of every checkpoint. Noise is
    drawn per sample: row g of the global batch in the run's n-th noise draw comes from its own seed
    (`sample_seed(noise_seed, n, g)`), so a rank draws only its own rows (the global batch of noise
    at 64 ranks would be gigabytes per draw), the numbers do not depend on how many ranks share the
    batch, and a checkpoint only needs the draw count. Rank r of w keeps rows [r*B, (r+1)*B) of a
    global batch of w*B.

    Noise is drawn on the CPU and moved to the run's device: a CUDA generator gives other numbers for
    the same seed, and a run whose numbers depend on its device cannot be replayed or debugged on a
    CPU (per sample at 480x832x81 the noise is ~2 MB, nothing next to a forward).
    """

    # Named in every checkpoint: a checkpoint without it drew its noise on the run's device.
    STREAM = "cpu-per-sample"

    def __init__(
        self, cpu: torch.Generator, noise_seed: int, rank: int, world_size: int, on: torch.device
    ) -> None:
        self.cpu, self.noise_seed = cpu, noise_seed
        self.rank, self.world_size, self.on = rank, world_size, on
        self.noise_draws = 0  # noise draws so far, the same on every rank
        self._noise_generator = torch.Generator("cpu")

    def _rows(self, batch: int) -> slice:
        return slice(self.rank * batch, (self.rank + 1) * batch)

    def sigmas(self, batch: int, shift: float) -> tuple[torch.Tensor, torch.Tensor]:
        """Shifted training sigmas (CPU, float64; see objective.sample_sigmas): (this rank's rows, the
        whole global batch)."""
        every = sample_sigmas(batch * self.world_size, shift, self.cpu)
        return every[self._rows(batch)], every

    def uniform(self, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Uniform [0, 1) numbers (CPU, float64): (this rank's rows, the global batch)."""
        every = torch.rand(batch * self.world_size, generator=self.cpu, dtype=torch.float64)
        return every[self._rows(batch)], every

    def integer(self, high: int) -> int:
        """One integer in [0, high), the same on every rank (e.g. a rollout depth for the whole batch)."""
        return int(torch.randint(high, (1,), generator=self.cpu).item())

    def noise(self, shape: tuple[int, ...]) -> torch.Tensor:
        """Standard normal noise of this rank's rows on the run's device; `shape` is the per-rank
        shape (B, ...)."""
        return self.noise_on_cpu(shape).to(self.on)

    def noise_on_cpu(self, shape: tuple[int, ...]) -> torch.Tensor:
        """The next noise draw as `noise` gives it, before it moves to the run's device."""
        draw, self.noise_draws = self.noise_draws, self.noise_draws + 1
        rows = []
        for row in range(self._rows(shape[0]).start, self._rows(shape[0]).stop):
            self._noise_generator.manual_seed(sample_seed(self.noise_seed, draw, row))
            rows.append(torch.randn(shape[1:], generator=self._noise_generator))
        return torch.stack(rows)


@dataclass
class MethodEnv:
    """What the loop lends a method: the teacher, the negative prompt and how to run a forward."""

    teacher: GuidedTeacher
    negative: torch.Tensor  # (1, L, D) padded negative-prompt embedding, on the device
    device: torch.device
    shift: float  # the training timestep shift (teacher scheduler's unless --flow_shift)
    autocast: Callable[[], contextlib.AbstractContextManager]
    # Mean and std of the teacher's clean latents (read lazily: only methods that report drift ask).
    latent_statistics: Callable[[], tuple[float, float]]
    # (C, F, H, W) of a clean latent: what a method that starts from noise draws without any x0.
    latent_shape: tuple[int, ...] | None = None
    # The teacher's mean frame-to-frame change over the reference latents (None for pictures): what a
    # student's motion is compared with when the batch has no clean latents of its own prompts.
    reference_motion: Callable[[], float | None] = field(default=lambda: None)


@dataclass
class UpdateLoss:
    """One micro-batch's loss for one update, per sample, and what the loop should add up for logging.

    `high_noise` says which expert's timestep range each sample's loss belongs to (for the
    per-range metrics). `extras` are per-sample values the loop averages over the logged steps
    (e.g. the mean of a generated latent); `Method.finish_metrics` turns them into reported numbers.
    """

    losses: torch.Tensor  # (B,) float32
    high_noise: torch.Tensor  # (B,) bool
    extras: dict[str, torch.Tensor] = field(default_factory=dict)

    def off_device(self, device: torch.device) -> list[str]:
        """The fields not on `device`, each as 'name (its device)'.

        The loop combines them with each other on the training device; a (B,) tensor left on the
        CPU passes every CPU run and fails the first CUDA step ("Expected all tensors to be on the
        same device"), so the loop checks this on every device, CPU included.
        """
        tensors = {"losses": self.losses, "high_noise": self.high_noise, **self.extras}
        return [
            f"{name} ({tensor.device})"
            for name, tensor in tensors.items()
            if tensor.device.type != device.type
            or (device.index is not None and tensor.device.index != device.index)
        ]


def motion_ratio(metrics: dict[str, Any]) -> dict[str, Any]:
    """On clips: `latent_motion_ratio` = the student's clean estimates' frame-to-frame change over
    the teacher's for the same prompts (`flow_matching.motion_extras`, under any update's prefix).
    1 = as much motion as the teacher; a ratio falling below 1 during a run is slow motion coming."""
    for key in [k for k in metrics if k.endswith("teacher_motion")]:
        prefix = key[: -len("teacher_motion")]
        ours, theirs = metrics.pop(f"{prefix}motion", None), metrics.pop(key)
        if ours is not None and theirs:
            metrics["latent_motion_ratio"] = ours / theirs
    return metrics


class Method:
    """Base of a distillation method. Subclasses set `name` and implement `loss`."""

    name = ""
    # Update names whose metrics are logged without a prefix ("loss", "loss_high_noise", ...).
    main_update = "student"

    def __init__(self, cfg: TrainConfig, env: MethodEnv, models: dict[str, torch.nn.Module]) -> None:
        self.cfg, self.env = cfg, env
        self.models = models  # unwrapped, for forwards without gradient
        self.train_models: dict[str, torch.nn.Module] = dict(models)  # DDP-wrapped where data-parallel

    @staticmethod
    def extra_models(cfg: TrainConfig) -> dict[str, tuple[str | None, str | None]]:
        """Trained models besides the student: name -> (config file, init); None means like the student's."""
        return {}

    @staticmethod
    def needs_clean_latents(cfg: TrainConfig) -> bool:
        """Whether the updates read the teacher's clean latent x0 of every training prompt (batch["x0"]).
        When not, the teacher samples only the --reference_prompts set before training, for metrics."""
        return True

    @staticmethod
    def needs_teacher_noise(cfg: TrainConfig) -> bool:
        """Whether the updates read the initial noise each cached clean latent was sampled from
        (batch["noise"]: the teacher's noise -> x0 pair)."""
        return False

    @staticmethod
    def student_timestep_per_token(cfg: TrainConfig) -> bool:
        """Whether the student's forward with gradient reads one timestep per token (frames at their own
        noise levels), not one per sample: its blocks then hold a per-token modulation, which the
        --dry_run memory plan measures."""
        return False

    def bind(self, train_models: dict[str, torch.nn.Module]) -> None:
        """Receive the models as the loop runs them (wrapped for data parallelism)."""
        self.train_models = train_models

    def updates(self, step: int) -> list[str]:
        """Models updated at 1-based `step`, in order; each gets its own accumulation and optimizer step."""
        return ["student"]

    def update_count(self, name: str, total_steps: int) -> int:
        """How many optimizer steps model `name` takes in a run of `total_steps` (for its LR schedule)."""
        return sum(name in self.updates(step) for step in range(1, total_steps + 1))

    def optimizer_settings(self, name: str) -> dict[str, Any]:
        """AdamW keyword arguments of model `name`."""
        return {"lr": self.cfg.lr, "weight_decay": self.cfg.weight_decay}

    def metric_prefix(self, name: str) -> str:
        return "" if name == self.main_update else f"{name}_"

    def loss(self, update: str, batch: dict[str, torch.Tensor], rng: BatchRandomness) -> UpdateLoss:
        raise NotImplementedError

    def finish_metrics(self, metrics: dict[str, Any]) -> dict[str, Any]:
        """Turn the averaged extras of a logged step into reported metrics (same on every rank)."""
        return motion_ratio(metrics)

    @staticmethod
    def identity(cfg: TrainConfig) -> dict[str, Any]:
        """Settings (beyond the run's) a checkpoint of this method must agree with to be resumed."""
        return {}

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass

    def export_scheduler(self) -> Any | None:
        """The scheduler to ship with the exported student (None: the teacher's)."""
        return None

    def sampling_settings(self) -> dict[str, Any]:
        """How the exported student samples, for run_settings.json and the model card
        (distill.sample.run_settings.settings_from_run keywords); {} = the teacher's scheduler at guidance 1."""
        return {}
