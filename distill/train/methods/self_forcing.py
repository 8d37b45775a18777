"""Self-Forcing: distribution matching on a causal student's own chunk-by-chunk rollout.

The student is causal (--student_chunk_frames, distill/models/causal). Each generator and critic
update makes a whole clip the way the student streams it: chunk after chunk, each in the student's
few steps on a KV cache of the chunks before, each finished chunk added to the cache by one pass at
t=0 (distill/models/causal/rollout.py). The rollout stops at one random step of the grid for the whole
clip (dmd's backward simulation); only that step's forward of each chunk carries gradient, and the
cache is detached, so no gradient runs from one chunk into another. Then dmd judges the whole clip
exactly as it judges a bidirectional student's sample: the critic (bidirectional) learns what the
student makes, and the generator moves along the critic's and the guided teacher's disagreement
(distill/train/methods/dmd.py). What changes is only where the student's samples come from, so the
student learns to continue its own output, the thing it does at inference, rather than a teacher's.

With --rollout_frames longer than the clip (--num_frames), the student learns to stream past it: each
update streams that many frames on the KV cache window generate --stream keeps by default, and dmd
judges one window of the clip's length, chunk-aligned and drawn at random, the chunks before it made
without gradient as its context (the rollout stops at the window's end). The teacher and the critic
judge a clip of the length they know; the student's window sits at its absolute frames, so it trains
the rope positions and the windowed context it meets past the trained length, which a rollout of the
clip alone never shows it.
"""

from __future__ import annotations

from typing import Any

import torch

from distill.config.causal_rules import latent_frames
from distill.config.settings import TrainConfig
from distill.models.causal.attention import causal_layout
from distill.models.causal.rollout import rollout_clip
from distill.models.conditioning import Condition, batch_condition
from distill.train.methods.base import BatchRandomness, MethodEnv
from distill.train.methods.dmd import DmdMethod


class SelfForcingMethod(DmdMethod):
    name = "self_forcing"

    def __init__(self, cfg: TrainConfig, env: MethodEnv, models: dict[str, torch.nn.Module]) -> None:
        super().__init__(cfg, env, models)
        self.rollout_latent_frames = latent_frames(cfg.rollout_frames or cfg.num_frames)
        self.judged_from = 0  # where the last rollout's judged window starts (latent frames)

    def judged_positions(self, x_t: torch.Tensor, condition: Condition | None) -> torch.Tensor | None:
        """dmd's, but for a window judged past the clip's start: the teacher reads its first latent
        frame as a clip's first frame (one image, the VAE's first latent frame), which a frame inside a
        stream is not, so the generator is not moved toward that reading there; the frame is judged
        again, as a later frame, in the windows that start before it."""
        weight = super().judged_positions(x_t, condition)
        if not self.judged_from:
            return weight
        first = torch.ones((1, 1, x_t.shape[2], 1, 1), device=x_t.device)
        first[:, :, 0] = 0.0
        return first if weight is None else weight * first

    @staticmethod
    def identity(cfg: TrainConfig) -> dict[str, Any]:
        """dmd's, and a rollout longer than the clip (another objective: a resume with another is told)."""
        longer = {"rollout_frames": cfg.rollout_frames} if cfg.longer_rollout else {}
        return {**DmdMethod.identity(cfg), **longer}

    def generate(
        self,
        batch: dict[str, torch.Tensor],
        cond: torch.Tensor,
        rng: BatchRandomness,
        model: torch.nn.Module,
        regression: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None, int]:
        """The student's clip rolled out chunk by chunk to a random exit step, through `model` at the
        exit steps (the caller decides whether it carries gradient). Returns (x0_hat, None, the step);
        the regression term is refused for this method (distill/config/causal_rules.py)."""
        env = self.env
        n = cond.shape[0]
        shape = tuple(batch["x0"].shape) if "x0" in batch else (n, *env.latent_shape)
        exit_step = self.step_choices[rng.integer(len(self.step_choices))]
        clip = shape[2]
        judged_from, window = 0, None
        if self.rollout_latent_frames > clip:  # a longer rollout: judge a random window of the clip's length
            layout = causal_layout(self.models["student"])
            assert layout is not None  # a self_forcing student is causal (distill/config/causal_rules.py)
            judged_from = layout.chunk_frames * rng.integer(
                (self.rollout_latent_frames - clip) // layout.chunk_frames + 1
            )
            window = layout.trained_window(clip)
        self.judged_from = judged_from
        noise = rng.noise((*shape[:2], judged_from + clip, *shape[3:]))
        with env.autocast():
            x0_hat = rollout_clip(
                self.models["student"],
                noise,
                cond,
                self.timesteps,
                self.sigmas,
                rng.noise,
                exit_step,
                kind=env.teacher.kind,
                condition=batch_condition(batch, env.device),
                grad_model=model,
                window=window,
                judged_from=judged_from,
            )
        return x0_hat, None, exit_step
