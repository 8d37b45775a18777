"""Decoding a streamed clip chunk by chunk with the Wan VAE, frames out as each chunk arrives.

The Wan VAE's decoder is causal in time: diffusers' `AutoencoderKLWan.decode` runs it one latent
frame at a time, each call reading and updating a cache of the previous frames' features. Keeping
that cache between chunks instead of between frames of one call gives the same frames as decoding
the whole clip at once, while each chunk's frames come out as soon as it is made (latent frame 0 gives
1 video frame, every later latent frame 4). It reads the VAE's cache fields (`clear_cache`,
`_feat_map`, `_conv_idx`), as `decode` itself does; tests/test_causal_streaming.py holds the result to
`decode` so a diffusers change cannot pass unnoticed. Tiled decoding is not used here.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch


class ChunkDecoder:
    """Frames (F, H, W, 3) in [0, 1] of one sample's latent chunks (1, C, f, h, w), fed in order,
    exactly as WanPipeline decodes the whole latent (distill.models.pipelines.decode_latents)."""

    def __init__(self, vae: Any) -> None:
        from diffusers.video_processor import VideoProcessor

        self.vae = vae
        self.processor = VideoProcessor(vae_scale_factor=vae.config.scale_factor_spatial)
        z_dim = int(vae.config.z_dim)
        self.mean = torch.tensor(vae.config.latents_mean).view(1, z_dim, 1, 1, 1)
        self.std = torch.tensor(vae.config.latents_std).view(1, z_dim, 1, 1, 1)
        self.first = True
        vae.clear_cache()

    @torch.no_grad()
    def __call__(self, latents: torch.Tensor) -> np.ndarray:
        from diffusers.models.autoencoders.autoencoder_kl_wan import unpatchify

        vae = self.vae
        z = latents.to(vae.device, vae.dtype)
        z = z * self.std.to(z) + self.mean.to(z)
        x = vae.post_quant_conv(z)  # a 1x1x1 convolution: frame by frame, no state
        out = []
        for i in range(x.shape[2]):
            vae._conv_idx = [0]
            out.append(
                vae.decoder(
                    x[:, :, i : i + 1],
                    feat_cache=vae._feat_map,
                    feat_idx=vae._conv_idx,
                    first_chunk=self.first,
                )
            )
            self.first = False
        video = torch.cat(out, dim=2)
        if vae.config.patch_size is not None:
            video = unpatchify(video, patch_size=vae.config.patch_size)
        video = torch.clamp(video, min=-1.0, max=1.0)
        return self.processor.postprocess_video(video, output_type="np")[0].astype(np.float32)

    def close(self) -> None:
        """Free the VAE's cache (it holds the last frames' features at full resolution)."""
        self.vae.clear_cache()
