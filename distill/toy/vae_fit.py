"""Fitting the toy teacher's VAE (Wan's architecture, a small width) to the world's pictures, and how
well it reconstructs them (the gate before the experts train on its latents)."""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import torch

from distill.toy import world
from distill.toy.recipe import Recipe
from distill.toy.render import render_batch


def to_vae_input(pictures: np.ndarray) -> torch.Tensor:
    """(N, H, W, 3) in [0, 1] -> (N, 3, 1, H, W) in [-1, 1], as WanPipeline's VAE sees frames."""
    return torch.from_numpy(pictures).permute(0, 3, 1, 2)[:, :, None].mul(2.0).sub(1.0).contiguous()


def fit_vae(vae: Any, recipe: Recipe, log: Any = print) -> Any:
    """Fit the VAE to rendered pictures (reconstruction through slightly noised latents), then set
    latents_mean / latents_std from its latents."""
    vae.train()
    optimizer = torch.optim.AdamW(vae.parameters(), lr=recipe.vae_lr, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.OneCycleLR(
        optimizer, recipe.vae_lr, total_steps=recipe.vae_steps, pct_start=0.1
    )
    # The loss reads the decoder's output before AutoencoderKLWan.decode clamps it to [-1, 1]:
    # the clamp has no gradient, and pixels pushed past it early would never come back.
    unclamped: list[torch.Tensor] = []
    hook = vae.decoder.register_forward_hook(lambda module, args, output: unclamped.append(output))
    start = time.perf_counter()
    for step in range(recipe.vae_steps):
        x = to_vae_input(
            render_batch(world.sample_scenes(recipe.vae_batch, recipe.seed * 7919 + step), recipe.size)
        )
        # An autoencoder with a little latent noise rather than a full VAE: the posterior's
        # initial unit variance would drown the code for most of a short fit, and the noise
        # (5% of the latents' spread) keeps the decoder tolerant of imperfect diffusion samples.
        mean = vae.encode(x).latent_dist.mode()
        z = mean + recipe.vae_latent_noise * mean.detach().std() * torch.randn_like(mean)
        vae.decode(z)
        y = torch.cat(unclamped, dim=2)
        unclamped.clear()
        # Shape pixels weigh 5x: they are a tenth of the picture but all of its meaning.
        weight = 1.0 + 4.0 * ((x - x[..., :1, :1]).abs().amax(dim=1, keepdim=True) > 0.2).float()
        loss = (weight * (y - x).pow(2)).mean()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(vae.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        if step % 100 == 0 or step == recipe.vae_steps - 1:
            log(f"vae step {step:5d}  mse {loss.item():.5f}  ({time.perf_counter() - start:.0f} s)")
        if step % 1000 == 999:  # what the scorer reads back from reconstructions, as the fit goes
            vae.eval()
            log(f"vae step {step:5d}  reconstructions {reconstruction_score(vae, recipe, count=128)}")
            unclamped.clear()  # the hook saw those decodes too
            vae.train()
    hook.remove()
    vae.eval().requires_grad_(False)
    latents = encode_pictures(
        vae, world.sample_scenes(2048, recipe.seed * 7919 + 10**6 + 1), recipe.size, normalise=False
    )
    mean = latents.mean(dim=(0, 2, 3, 4))
    std = latents.std(dim=(0, 2, 3, 4)).clamp_min(1e-3)
    vae.register_to_config(latents_mean=mean.tolist(), latents_std=std.tolist())
    return vae


@torch.no_grad()
def encode_pictures(vae: Any, scenes: list[world.Scene], size: int, normalise: bool = True) -> torch.Tensor:
    """Latents (N, 16, 1, size/8, size/8) of the scenes' pictures (posterior means), normalised as
    WanPipeline's latents are when `normalise`."""
    chunks = []
    for start in range(0, len(scenes), 256):
        x = to_vae_input(render_batch(scenes[start : start + 256], size))
        chunks.append(vae.encode(x).latent_dist.mode())
    latents = torch.cat(chunks)
    if normalise:
        mean = torch.tensor(vae.config.latents_mean).view(1, -1, 1, 1, 1)
        std = torch.tensor(vae.config.latents_std).view(1, -1, 1, 1, 1)
        latents = (latents - mean) / std
    return latents


@torch.no_grad()
def reconstruction_score(vae: Any, recipe: Recipe, count: int = 256) -> dict[str, Any]:
    """The scorer on the VAE's reconstructions of fresh pictures (1.0 = every attribute survives)."""
    from distill.toy.score import score

    scenes = world.sample_scenes(count, recipe.seed * 7919 + 10**6 + 2)
    y = vae.decode(vae.encode(to_vae_input(render_batch(scenes, recipe.size))).latent_dist.mode()).sample
    pictures = ((y[:, :, 0].permute(0, 2, 3, 1) + 1.0) / 2.0).clamp(0, 1).numpy()
    result = score(list(pictures), [s.prompt for s in scenes])
    return {"accuracy": result["accuracy"], "diversity_gap": round(result["diversity_gap"], 3)}
