"""The teacher as every method queries it: its frozen experts routed by timestep (two, or one with
no boundary), each with its classifier-free guidance, a condition (an image's latent for image to
video) entering each forward through the conditioning layer (distill/models/conditioning.py)."""

from __future__ import annotations

from typing import Any

import torch

from distill.models.conditioning import Condition, model_input, model_timestep
from distill.models.flow_matching import apply_guidance, high_noise_mask
from distill.models.lockstep import placeholder_inputs, split_degree
from distill.models.teacher_kind import T2V_A14B, TeacherKind


class GuidedTeacher:
    """The frozen experts, routed by timestep, returning classifier-free-guided velocities.

    Two experts (the A14B models): `high` while t >= boundary_ratio * 1000, `low` below. One
    transformer (TI2V-5B): `low` and `boundary_ratio` None, and `high` takes every sample with
    `guidance_high`, as the stock pipelines run a model with no `transformer_2` and no boundary.
    """

    def __init__(
        self,
        high: Any,
        low: Any | None,
        boundary_ratio: float | None,
        guidance_high: float,
        guidance_low: float,
        device: torch.device,
        dtype: torch.dtype,
        lockstep: bool = False,
        kind: TeacherKind = T2V_A14B,
    ) -> None:
        if (low is None) != (boundary_ratio is None):
            raise ValueError(
                "a second expert needs a boundary and one transformer has none: got "
                f"low={'None' if low is None else 'an expert'}, boundary_ratio={boundary_ratio}"
            )
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
        mode a rank with no sample for a needed expert joins its collectives with a placeholder of a
        token or a few (distill/models/lockstep.py) and drops the result. With one transformer the
        second entry is ignored.
        `condition` holds what the teacher's kind adds to each sample's input (the image: mask and
        image latent, on the device); its rows go with the batch's, and the conditional and
        unconditional passes see the same condition, as in the stock pipelines. The timestep each
        expert sees is the kind's (one per sample, or one per token for TI2V-5B).
        """
        out = torch.empty(x_t.shape, dtype=torch.float32, device=x_t.device)
        # No boundary: every sample is the one transformer's (`high`); `~is_high` is then empty.
        is_high = high_noise_mask(timesteps, self.boundary_ratio)
        needed = (
            experts_needed if experts_needed is not None else (bool(is_high.any()), bool((~is_high).any()))
        )
        routes = [(self.high, self.guidance_high, is_high, needed[0])]
        if self.low is not None:
            routes.append((self.low, self.guidance_low, ~is_high, needed[1]))
        for expert, scale, mask, anywhere in routes:
            rows = mask.nonzero().flatten()
            if rows.numel() == 0:
                if self.lockstep and anywhere:
                    self._placeholder(expert, x_t, timesteps, cond, condition)
                continue
            n = rows.numel()
            rows_dev = rows.to(x_t.device, non_blocking=True)
            picked = condition.select(rows_dev) if condition is not None else None
            x = model_input(self.kind, x_t.index_select(0, rows_dev), picked).to(self.dtype)
            t = model_timestep(
                self.kind, timesteps.index_select(0, rows).to(x_t.device, non_blocking=True), x, picked
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

    def _placeholder(
        self,
        expert: Any,
        x_t: torch.Tensor,
        timesteps: torch.Tensor,
        cond: torch.Tensor,
        condition: Condition | None,
    ) -> None:
        """A placeholder forward of `expert` that keeps this rank in its collectives; the result is
        dropped. The first sample's whole input (condition channels included), cut to one token (a
        few when the expert is split over a context group: distill/models/lockstep.py), at the
        sample's timestep (one per sample, or one per token for a per-token kind)."""
        first = torch.zeros(1, dtype=torch.long, device=x_t.device)
        picked = condition.select(first) if condition is not None else None
        x = model_input(self.kind, x_t[:1], picked)
        t = timesteps[:1].to(x_t.device)
        x, _, text = placeholder_inputs(x, t, cond, expert.config.patch_size, split_degree(expert))
        expert(
            hidden_states=x.to(self.dtype),
            timestep=model_timestep(self.kind, t, x),
            encoder_hidden_states=text.to(self.dtype),
            return_dict=False,
        )
