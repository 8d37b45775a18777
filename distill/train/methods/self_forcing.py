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
"""

from __future__ import annotations

import torch

from distill.models.causal.rollout import rollout_clip
from distill.models.conditioning import batch_condition
from distill.train.methods.base import BatchRandomness
from distill.train.methods.dmd import DmdMethod


class SelfForcingMethod(DmdMethod):
    name = "self_forcing"

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
        noise = rng.noise(shape)
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
            )
        return x0_hat, None, exit_step
