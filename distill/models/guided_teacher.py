"""The teacher as every method queries it: the two frozen experts routed by timestep, each with its
classifier-free guidance, a condition (an image's latent for image to video) entering each forward
through the conditioning layer (distill/models/conditioning.py)."""

from __future__ import annotations

from typing import Any

import torch

from distill.models.conditioning import Condition, model_input, model_timestep
from distill.models.flow_matching import apply_guidance, high_noise_mask
from distill.models.lockstep import one_token_inputs
from distill.models.teacher_kind import T2V_A14B, TeacherKind


class GuidedTeacher:
    """The two frozen experts, routed by timestep, returning classifier-free-guided velocities."""

    def __init__(
        self,
        high: Any,
        low: Any,
        boundary_ratio: float,
        guidance_high: float,
        guidance_low: float,
        device: torch.device,
        dtype: torch.dtype,
        lockstep: bool = False,
        kind: TeacherKind = T2V_A14B,
    ) -> None:
        self.high, self.low = high, low
        # Which model the experts are: how a condition enters their input (models/conditioning.py).
        self.kind = kind
        # Sharded experts run collectives in their forward: every rank must call an expert whenever
        # any rank does, even with nothing of its own to compute.
        self.lockstep = lockstep
        self.boundary_ratio = boundary_ratio
        self.guidance_high, self.guidance_low = guidance_high, guidance_low
        self.device, self.dtype = device, dtype

    @torch.no_grad()
    def velocity(
        self,
        x_t: torch.Tensor,
        timesteps: torch.Tensor,
        cond: torch.Tensor,
        uncond: torch.Tensor,
        experts_needed: tuple[bool, bool] | None = None,
        condition: Condition | None = None,
    ) -> torch.Tensor:
        """Guided velocity for each sample of a batch.

        x_t (B,C,F,H,W) and cond (B,L,D) live on the device; `timesteps` (B,) lives on the CPU so the
        routing below costs no device sync; `uncond` is the negative-prompt embedding (1,L,D).
        Each expert runs once, on its slice of the batch, with the conditional and unconditional
        inputs stacked into one forward; an expert whose guidance is 1 runs the conditional pass
        only (uncond + 1 * (cond - uncond) is cond: the unconditional half would be thrown away).
        `experts_needed` = (high, low) says whether ANY rank needs each expert this step; in lockstep
        mode a rank with no sample for a needed expert joins its collectives with a one-token
        placeholder (distill/models/lockstep.py) and drops the result.
        `condition` holds what the teacher's kind adds to each sample's input (the I2V image: mask and
        image latent, on the device); its rows go with the batch's, and the conditional and
        unconditional passes see the same condition, as in the stock pipelines.
        """
        out = torch.empty(x_t.shape, dtype=torch.float32, device=x_t.device)
        is_high = high_noise_mask(timesteps, self.boundary_ratio)
        needed = (
            experts_needed if experts_needed is not None else (bool(is_high.any()), bool((~is_high).any()))
        )
        for expert, scale, mask, anywhere in (
            (self.high, self.guidance_high, is_high, needed[0]),
            (self.low, self.guidance_low, ~is_high, needed[1]),
        ):
            rows = mask.nonzero().flatten()
            if rows.numel() == 0:
                if self.lockstep and anywhere:
                    # The first sample's whole input (condition channels included), cut to one token.
                    first = torch.zeros(1, dtype=torch.long, device=x_t.device)
                    x = self._input(x_t[:1], condition, first)
                    x, t, text = one_token_inputs(
                        x,
                        model_timestep(self.kind, timesteps[:1].to(x_t.device), x),
                        cond,
                        expert.config.patch_size,
                    )
                    expert(
                        hidden_states=x.to(self.dtype),
                        timestep=t,
                        encoder_hidden_states=text.to(self.dtype),
                        return_dict=False,
                    )
                continue
            n = rows.numel()
            rows_dev = rows.to(x_t.device, non_blocking=True)
            x = self._input(x_t.index_select(0, rows_dev), condition, rows_dev).to(self.dtype)
            t = model_timestep(
                self.kind, timesteps.index_select(0, rows).to(x_t.device, non_blocking=True), x
            )
            text = cond.index_select(0, rows_dev).to(self.dtype)
            if scale == 1.0:
                (velocity,) = expert(
                    hidden_states=x, timestep=t, encoder_hidden_states=text, return_dict=False
                )
                out.index_copy_(0, rows_dev, velocity.float())
                continue
            both = expert(
                hidden_states=torch.cat([x, x]),
                timestep=torch.cat([t, t]),
                encoder_hidden_states=torch.cat([text, uncond.expand(n, -1, -1).to(self.dtype)]),
                return_dict=False,
            )[0]
            guided = apply_guidance(both[:n].float(), both[n:].float(), scale)
            out.index_copy_(0, rows_dev, guided)
        return out

    def _input(self, x: torch.Tensor, condition: Condition | None, rows: torch.Tensor) -> torch.Tensor:
        """The experts' input for the noisy latents `x`, which are the batch's samples `rows`."""
        return model_input(self.kind, x, condition.select(rows) if condition is not None else None)
