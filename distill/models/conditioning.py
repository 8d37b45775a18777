"""How a condition enters a forward, for each kind of teacher: the one place that decides it.

A Wan 2.2 transformer predicts the velocity of its noisy latents; whatever else its input holds is
the condition, and the kind of teacher (models/teacher_kind.py) says what that is:
- text to video (T2V-A14B): nothing; the input is the noisy latents as they are;
- image to video (I2V-A14B): 20 channels per latent frame after the 16 noisy ones, a 4-channel
  first-frame mask then the image's 16-channel VAE latent, exactly as `WanImageToVideoPipeline`
  concatenates them (the text enters through the prompt embeddings, as for every kind);
- text or image to video (TI2V-5B, `expand_timesteps`): no extra channels. In text mode the input
  is the 48 noisy channels; in image mode the image's one latent frame replaces latent frame 0 of
  the noisy latents (a mask says where), as `WanImageToVideoPipeline` blends them. Its timestep is
  one per token: t everywhere, 0 on the tokens the image fixes.
Teacher, students, methods and samplers build a model's input with `model_input` and its timestep
with `model_timestep`, weight a loss with `loss_weight`, and never look inside a `Condition`, so a
new kind only adds a branch here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from distill.models.teacher_kind import I2V_A14B, T2V_A14B, TI2V_5B, TeacherKind

# The noisy latents the A14B kinds predict the velocity of (the Wan 2.1 VAE's z_dim).
NOISY_CHANNELS = 16
# I2V: a first-frame mask folded into the VAE's temporal stride (4 channels), then the image latent.
MASK_CHANNELS = 4
# Tokens are 1x2x2 latent patches in every Wan 2.2 transformer; the pipelines' per-token timestep
# (`mask[0][0][:, ::2, ::2]`) hard-codes the 2.
TOKEN_PATCH = 2


@dataclass(frozen=True)
class Condition:
    """The per-sample tensors a kind adds to a forward (batch first, like the latents).

    - I2V-A14B: `channels` (B, 20, F', h, w), mask (4) then image latent (16) per latent frame.
    - TI2V-5B image mode: `channels` (B, 48, 1, h, w), the image's latent frame, and `mask`
      (B, 1, F', h, w), 1 where the noisy latents enter and 0 where `channels` replaces them (latent
      frame 0). A sample whose mask is all 1 is a text-mode sample, so one batch may mix both modes.
    - text to video (any kind): nothing, `Condition()` or None.
    """

    channels: torch.Tensor | None = None
    mask: torch.Tensor | None = None

    @property
    def empty(self) -> bool:
        return self.channels is None and self.mask is None

    def __len__(self) -> int:
        first = self.channels if self.channels is not None else self.mask
        return 0 if first is None else int(first.shape[0])

    def select(self, rows: torch.Tensor) -> Condition:
        """The samples `rows` (an index tensor on the condition's device), as the batch is selected."""
        return self._each(lambda x: x.index_select(0, rows.to(x.device)))

    def to(self, *args: Any, **kwargs: Any) -> Condition:
        return self._each(lambda x: x.to(*args, **kwargs))

    def repeat(self, times: int) -> Condition:
        """The samples `times` over, in order (a forward that stacks the batch with itself)."""
        return self._each(lambda x: x.repeat(times, *([1] * (x.dim() - 1))))

    def _each(self, change: Any) -> Condition:
        if self.empty:
            return self
        return Condition(
            None if self.channels is None else change(self.channels),
            None if self.mask is None else change(self.mask),
        )


def batch_condition(batch: dict[str, torch.Tensor], device: torch.device) -> Condition | None:
    """The condition of a training micro-batch (its "condition" entry, and "condition_mask" where
    the kind has one, on `device`), or None."""
    channels, mask = batch.get("condition"), batch.get("condition_mask")
    if channels is None and mask is None:
        return None
    return Condition(
        None if channels is None else channels.to(device, non_blocking=True),
        None if mask is None else mask.to(device, non_blocking=True),
    )


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
            timestep=model_timestep(self.kind, timestep, hidden_states, self.condition),
            encoder_hidden_states=encoder_hidden_states,
            return_dict=return_dict,
            **kwargs,
        )

    def __getattr__(self, name: str) -> Any:  # dtype, config, parameters() ... of the model
        return getattr(self.model, name)


def conditioned(model: Any, kind: TeacherKind, condition: Condition | None) -> Any:
    """`model` with `condition` entering each of its forwards; a kind that adds nothing (text to
    video with one timestep per sample) gets the model itself, so its forwards are exactly what they
    were. A per-token kind is always wrapped: even in text mode its timestep is one per token."""
    if (
        condition_channels(kind) == 0
        and not kind.per_token_timesteps
        and (condition is None or condition.empty)
    ):
        return model
    return Conditioned(model, kind, condition)


def condition_channels(kind: TeacherKind) -> int:
    """How many input channels the condition of `kind` adds to the noisy latents."""
    return kind.in_channels - kind.out_channels


def model_input(kind: TeacherKind, noisy: torch.Tensor, condition: Condition | None) -> torch.Tensor:
    """The transformer input of `kind` for noisy latents (B, C, F', h, w) and their condition.

    The result has the noisy latents' dtype and device: the stock pipelines build the input in
    float32 and cast it whole to the transformer's dtype, which is the same cast element by element
    (TI2V's blend with a 0/1 mask picks either value exactly, in any dtype).
    """
    if kind == T2V_A14B:
        if condition is not None and not condition.empty:
            raise ValueError(f"{kind.model} takes no condition, got {_shapes(condition)}")
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
    if kind == TI2V_5B:
        if condition is None or condition.empty:
            return noisy  # text mode: the noisy latents as they are (WanPipeline)
        return blend_latents(kind, noisy, condition)
    raise ValueError(f"conditioning of {kind.model} ({kind.inputs}) is not handled by this version")


def blend_latents(kind: TeacherKind, latents: torch.Tensor, condition: Condition | None) -> torch.Tensor:
    """The latents with what the condition fixes put back: for TI2V image mode
    (1 - mask) * image latent + mask * latents, as `WanImageToVideoPipeline` builds each step's input
    and blends its final latents (the official Wan code blends after every step: the same result,
    since the input never reads the replaced positions and the scheduler's step is elementwise).
    The latents as they are for every other kind and mode. Same dtype and device as `latents`."""
    if kind != TI2V_5B or condition is None or condition.empty:
        return latents
    image, mask = condition.channels, condition.mask
    if image is None or mask is None:
        raise ValueError(
            f"{kind.model} image mode needs both the image latent and its mask, got {_shapes(condition)}"
        )
    batch, channels, frames, height, width = latents.shape
    if (
        tuple(mask.shape) != (batch, 1, frames, height, width)
        or image.shape[:2] != (batch, channels)
        or image.shape[2] not in (1, frames)
        or tuple(image.shape[3:]) != (height, width)
    ):
        raise ValueError(
            f"{kind.model}: condition {_shapes(condition)} for latents of shape {tuple(latents.shape)}; "
            f"expected channels ({batch}, {channels}, 1, {height}, {width}) and mask "
            f"({batch}, 1, {frames}, {height}, {width})"
        )
    # The pipeline's arithmetic in float32 (its latents, condition and mask all are), then one cast.
    mask = mask.to(latents.device, torch.float32)
    image = image.to(latents.device, torch.float32)
    return ((1 - mask) * image + mask * latents.float()).to(latents.dtype)


def model_timestep(
    kind: TeacherKind,
    timesteps: torch.Tensor,
    noisy: torch.Tensor,
    condition: Condition | None = None,
    patch: tuple[int, int] = (TOKEN_PATCH, TOKEN_PATCH),
) -> torch.Tensor:
    """The transformer's timestep argument of `kind` for noisy latents (B, ...) at `timesteps` (B,).

    Both A14B models take one timestep per sample, the image's latent frame included (I2V-A14B
    denoises it like the others; the mask tells the model which frame the image fixes). TI2V-5B
    takes one per token, (B, F' * h/2 * w/2) float32, as the pipelines' `expand_timesteps` builds
    it: mask * t, so t on every token in text mode and 0 on the tokens the image fixes.

    `timesteps` may also be (B, F'), one per latent frame (a causal student's chunks, each at its own
    noise level): every kind then gets one per token, (B, F' * h/2 * w/2), the frame's t on its tokens
    (TI2V-5B: times the mask, as above). WanTransformer3DModel reads a 2-D timestep per token, one per
    patch: `patch` is the model's (height, width) patch (its config's patch_size[1:]; 2 x 2 in every
    Wan 2.2 model, other in a toy one).
    """
    per_frame = timesteps.dim() == 2
    if kind in (T2V_A14B, I2V_A14B) and not per_frame:
        return timesteps
    if kind in (T2V_A14B, I2V_A14B, TI2V_5B):
        batch, _, frames, height, width = noisy.shape
        if kind == TI2V_5B and condition is not None and condition.mask is not None:
            mask = condition.mask[:, 0].to(noisy.device, torch.float32)
        else:  # text mode (WanPipeline's mask of ones), or a kind whose every token takes t
            mask = torch.ones(batch, frames, height, width, device=noisy.device)
        shape = (batch, frames, 1, 1) if per_frame else (-1, 1, 1, 1)
        t = timesteps.to(noisy.device, torch.float32).reshape(shape)
        # float32 mask times t, the pipelines' product (their t is a scheduler timestep); the
        # pipelines' own per-token timestep (TI2V, one per sample) hard-codes the 2.
        rows, cols = patch if per_frame else (TOKEN_PATCH, TOKEN_PATCH)
        return (mask[:, :, ::rows, ::cols] * t).flatten(1)
    raise ValueError(f"timesteps of {kind.model} ({kind.inputs}) are not handled by this version")


def loss_weight(kind: TeacherKind, noisy: torch.Tensor, condition: Condition | None) -> torch.Tensor | None:
    """Which latent positions a loss may count: None where every position counts (both A14B kinds:
    I2V-A14B denoises the image's frame like any other; TI2V text mode), else float32 broadcasting
    against (B, C, F', h, w) noisy latents, 1 where the model's prediction is learned and 0 where the
    condition fixes the latents (TI2V image mode: latent frame 0, the image, which the model input
    replaces and the sampler's blend overwrites: no prediction there is ever used)."""
    if kind == TI2V_5B and condition is not None and condition.mask is not None:
        return condition.mask.to(noisy.device, torch.float32)
    return None


def fixed_latent_frames(kind: TeacherKind, image: bool) -> int:
    """How many leading latent frames the condition fixes, which no loss counts (`loss_weight`):
    TI2V-5B's image mode replaces latent frame 0 with the image's; every other kind and mode
    learns every frame (I2V-A14B denoises the image's frame like any other)."""
    return 1 if kind == TI2V_5B and image else 0


def condition_frames(
    kind: TeacherKind, condition: Condition | None, start: int, end: int
) -> Condition | None:
    """What latent frames [start, end) of a clip take of the whole clip's `condition` (a causal
    student's chunk, distill/models/causal/streaming.py): I2V-A14B's mask and image-latent channels
    of those frames; TI2V-5B's mask of those frames with the image's one latent frame, which only a
    chunk holding frame 0 takes (a later chunk's mask is all 1, so it enters as in text mode)."""
    if condition is None or condition.empty:
        return condition
    mask = None if condition.mask is None else condition.mask[:, :, start:end]
    if kind == TI2V_5B:
        return Condition(condition.channels, mask)
    channels = None if condition.channels is None else condition.channels[:, :, start:end]
    return Condition(channels, mask)


def stored_condition(condition: Condition) -> torch.Tensor:
    """What the image-latent cache keeps of one sample's condition (batch of one): its channels
    (I2V-A14B: mask + image latent; TI2V-5B: the image's latent frame). A TI2V mask is rebuilt from
    the latent frame count by `condition_entries`, so it costs no disk."""
    if condition.channels is None or len(condition) != 1:
        raise ValueError(f"one sample's condition with channels expected, got {_shapes(condition)}")
    return condition.channels[0]


def condition_entries(kind: TeacherKind, stored: torch.Tensor, latent_frames: int) -> dict[str, torch.Tensor]:
    """A training item's condition entries (batched by the data loader, read by `batch_condition`)
    from what the image-latent cache stored for its image."""
    if kind == TI2V_5B:
        keep = torch.ones(1, latent_frames, *stored.shape[2:], dtype=torch.float32)
        keep[:, 0] = 0.0  # latent frame 0 is the image's
        return {"condition": stored, "condition_mask": keep}
    return {"condition": stored}


@torch.no_grad()
def image_condition(
    vae: Any,
    image: torch.Tensor,
    num_frames: int,
    *,
    scale_temporal: int | None = None,
    device: torch.device | None = None,
    kind: TeacherKind = I2V_A14B,
) -> Condition:
    """The condition of a preprocessed image for `kind`, as `WanImageToVideoPipeline.prepare_latents`
    makes it.

    `image` is (3, H, W) or (B, 3, H, W) in [-1, 1], already resized and cropped to the run's size
    (what the pipeline's video processor returns). Float32 on `device` (default: the image's).
    - I2V-A14B: the clip [image, then num_frames - 1 black frames] is VAE-encoded whole, its mode
      taken and normalised with the VAE's latents_mean / std; the mask is 1 on pixel frame 0, which
      the VAE's temporal stride folds into 4 channels that are 1 on latent frame 0 and 0 after.
      Returns channels (B, 20, F', H / s, W / s).
    - TI2V-5B (`expand_timesteps`): the image alone is encoded, to one latent frame, normalised the
      same way; the mask is 0 on latent frame 0 and 1 after. Returns channels (B, 48, 1, h, w) and
      mask (B, 1, F', h, w).
    """
    stride = scale_temporal or int(vae.config.scale_factor_temporal)
    if (num_frames - 1) % stride:
        raise ValueError(f"num_frames must be 1 or {stride}k+1, got {num_frames}")
    if kind not in (I2V_A14B, TI2V_5B):
        raise ValueError(f"{kind.model} ({kind.task}) takes no image")
    images = image[None] if image.dim() == 3 else image
    device = device if device is not None else images.device
    batch, _, height, width = images.shape
    first = images.float().unsqueeze(2)  # the pipeline's clip is float32 until the VAE's cast
    if kind == TI2V_5B:
        clip = first
    else:
        clip = torch.cat(
            [first, first.new_zeros(batch, first.shape[1], num_frames - 1, height, width)], dim=2
        )
    vae_device = next(vae.parameters()).device
    latent = vae.encode(clip.to(vae_device, vae.dtype)).latent_dist.mode().to(device, torch.float32)
    z_dim = int(vae.config.z_dim)
    mean = torch.tensor(vae.config.latents_mean).view(1, z_dim, 1, 1, 1).to(device, torch.float32)
    # Multiplying by the reciprocal, not dividing: the pipeline's arithmetic, to the last bit.
    inv_std = 1.0 / torch.tensor(vae.config.latents_std).view(1, z_dim, 1, 1, 1).to(device, torch.float32)
    latent = (latent - mean) * inv_std
    if kind == TI2V_5B:
        frames = (num_frames - 1) // stride + 1
        keep = torch.ones(batch, 1, frames, *latent.shape[3:], device=device, dtype=torch.float32)
        keep[:, :, 0] = 0.0  # latent frame 0 is the image's
        return Condition(latent, keep)
    mask = torch.zeros(batch, MASK_CHANNELS, *latent.shape[2:], device=device, dtype=torch.float32)
    mask[:, :, 0] = 1.0  # pixel frame 0 (the image) lies in latent frame 0: all 4 of its folded slots
    return Condition(torch.cat([mask, latent], dim=1))


def _shapes(condition: Condition) -> str:
    return ", ".join(
        f"{name} {tuple(x.shape)}"
        for name, x in (("channels", condition.channels), ("mask", condition.mask))
        if x is not None
    )
