"""How a condition enters a forward, for each kind of teacher: the one place that decides it.

A Wan 2.2 transformer predicts the velocity of its 16 noisy latent channels; whatever else its
input holds is the condition, and the kind of teacher (models/teacher_kind.py) says what that is:
- text to video (T2V-A14B): nothing; the input is the noisy latents as they are;
- image to video (I2V-A14B): 20 channels per latent frame after the 16 noisy ones, a 4-channel
  first-frame mask then the image's 16-channel VAE latent, exactly as `WanImageToVideoPipeline`
  concatenates them (the text enters through the prompt embeddings, as for every kind).
Teacher, students, methods and samplers build a model's input with `model_input` and never look
inside a `Condition`, so a new kind only adds a branch here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from distill.models.teacher_kind import I2V_A14B, T2V_A14B, TeacherKind

# The noisy latents every kind predicts the velocity of (the Wan 2.1 VAE's z_dim).
NOISY_CHANNELS = 16
# I2V: a first-frame mask folded into the VAE's temporal stride (4 channels), then the image latent.
MASK_CHANNELS = 4


@dataclass(frozen=True)
class Condition:
    """The per-sample tensors a kind adds to a forward's input (batch first, like the latents).

    For I2V `channels` is (B, 20, F', h, w): mask (4) then image latent (16) per latent frame.
    For T2V there is nothing: `Condition()` or None.
    """

    channels: torch.Tensor | None = None

    def __len__(self) -> int:
        return 0 if self.channels is None else int(self.channels.shape[0])

    def select(self, rows: torch.Tensor) -> Condition:
        """The samples `rows` (an index tensor on the condition's device), as the batch is selected."""
        if self.channels is None:
            return self
        return Condition(self.channels.index_select(0, rows.to(self.channels.device)))

    def to(self, *args: Any, **kwargs: Any) -> Condition:
        return self if self.channels is None else Condition(self.channels.to(*args, **kwargs))

    def repeat(self, times: int) -> Condition:
        """The samples `times` over, in order (a forward that stacks the batch with itself)."""
        if self.channels is None:
            return self
        return Condition(self.channels.repeat(times, *([1] * (self.channels.dim() - 1))))


def batch_condition(batch: dict[str, torch.Tensor], device: torch.device) -> Condition | None:
    """The condition of a training micro-batch (its "condition" entry, on `device`), or None."""
    channels = batch.get("condition")
    return None if channels is None else Condition(channels.to(device, non_blocking=True))


class Conditioned:
    """A Wan transformer (or a routed pair of experts) called as methods and samplers call one, with
    each forward's input built by `model_input` / `model_timestep` for the teacher's kind.

    `condition` holds one row per sample of every call (`Condition.repeat` for a doubled batch).
    Made per batch by `conditioned`; holds no state of its own.
    """

    def __init__(self, model: Any, kind: TeacherKind, condition: Condition | None) -> None:
        self.model, self.kind, self.condition = model, kind, condition

    def __call__(
        self,
        hidden_states: torch.Tensor,
        timestep: torch.Tensor,
        encoder_hidden_states: torch.Tensor,
        return_dict: bool = False,
        **kwargs: Any,
    ) -> Any:
        return self.model(
            hidden_states=model_input(self.kind, hidden_states, self.condition),
            timestep=model_timestep(self.kind, timestep, hidden_states),
            encoder_hidden_states=encoder_hidden_states,
            return_dict=return_dict,
            **kwargs,
        )

    def __getattr__(self, name: str) -> Any:  # dtype, config, parameters() ... of the model
        return getattr(self.model, name)


def conditioned(model: Any, kind: TeacherKind, condition: Condition | None) -> Any:
    """`model` with `condition` entering each of its forwards; a kind that adds nothing (text to
    video) gets the model itself, so its forwards are exactly what they were."""
    if condition_channels(kind) == 0 and (condition is None or condition.channels is None):
        return model
    return Conditioned(model, kind, condition)


def condition_channels(kind: TeacherKind) -> int:
    """How many input channels the condition of `kind` adds to the noisy latents."""
    return kind.in_channels - kind.out_channels


def model_input(kind: TeacherKind, noisy: torch.Tensor, condition: Condition | None) -> torch.Tensor:
    """The transformer input of `kind` for noisy latents (B, 16, F', h, w) and their condition.

    The result has the noisy latents' dtype and device: the stock pipelines concatenate in float32
    and cast the whole input to the transformer's dtype, which is the same cast element by element.
    """
    if kind == T2V_A14B:
        if condition is not None and condition.channels is not None:
            raise ValueError(
                f"{kind.model} takes no condition channels, got {tuple(condition.channels.shape)}"
            )
        return noisy
    if kind == I2V_A14B:
        if condition is None or condition.channels is None:
            raise ValueError(f"{kind.model} needs the image condition (mask + image latent) of every sample")
        channels = condition.channels
        expected = (noisy.shape[0], condition_channels(kind), *noisy.shape[2:])
        if tuple(channels.shape) != expected:
            raise ValueError(
                f"{kind.model}: condition of shape {tuple(channels.shape)} for latents of shape "
                f"{tuple(noisy.shape)}; expected {expected}"
            )
        return torch.cat([noisy, channels.to(noisy.device, noisy.dtype)], dim=1)
    raise ValueError(f"conditioning of {kind.model} ({kind.inputs}) is not handled by this version")


def model_timestep(kind: TeacherKind, timesteps: torch.Tensor, noisy: torch.Tensor) -> torch.Tensor:
    """The transformer's timestep argument of `kind` for noisy latents (B, ...) at `timesteps` (B,).

    Both A14B models take one timestep per sample, the image's latent frame included (I2V-A14B
    denoises it like the others; the mask tells the model which frame the image fixes).
    """
    if kind in (T2V_A14B, I2V_A14B):
        return timesteps
    raise ValueError(f"timesteps of {kind.model} ({kind.inputs}) are not handled by this version")


@torch.no_grad()
def image_condition(
    vae: Any,
    image: torch.Tensor,
    num_frames: int,
    *,
    scale_temporal: int | None = None,
    device: torch.device | None = None,
) -> Condition:
    """The I2V condition of a preprocessed image, as `WanImageToVideoPipeline.prepare_latents` makes it.

    `image` is (3, H, W) or (B, 3, H, W) in [-1, 1], already resized and cropped to the run's size
    (what the pipeline's video processor returns). The clip [image, then num_frames - 1 black
    frames] is VAE-encoded whole, its mode taken and normalised with the VAE's latents_mean / std;
    the mask is 1 on pixel frame 0, which the VAE's temporal stride folds into 4 channels that are
    1 on latent frame 0 and 0 after. Returns (B, 20, F', H / s, W / s) float32 on `device` (default:
    the image's).
    """
    stride = scale_temporal or int(vae.config.scale_factor_temporal)
    if (num_frames - 1) % stride:
        raise ValueError(f"num_frames must be 1 or {stride}k+1, got {num_frames}")
    images = image[None] if image.dim() == 3 else image
    device = device if device is not None else images.device
    batch, _, height, width = images.shape
    first = images.float().unsqueeze(2)  # the pipeline's clip is float32 until the VAE's cast
    clip = torch.cat([first, first.new_zeros(batch, first.shape[1], num_frames - 1, height, width)], dim=2)
    vae_device = next(vae.parameters()).device
    latent = vae.encode(clip.to(vae_device, vae.dtype)).latent_dist.mode().to(device, torch.float32)
    z_dim = int(vae.config.z_dim)
    mean = torch.tensor(vae.config.latents_mean).view(1, z_dim, 1, 1, 1).to(device, torch.float32)
    # Multiplying by the reciprocal, not dividing: the pipeline's arithmetic, to the last bit.
    inv_std = 1.0 / torch.tensor(vae.config.latents_std).view(1, z_dim, 1, 1, 1).to(device, torch.float32)
    latent = (latent - mean) * inv_std
    mask = torch.zeros(batch, MASK_CHANNELS, *latent.shape[2:], device=device, dtype=torch.float32)
    mask[:, :, 0] = 1.0  # pixel frame 0 (the image) lies in latent frame 0: all 4 of its folded slots
    return Condition(torch.cat([mask, latent], dim=1))
