"""Fitting the toy teacher's VAE (Wan's architecture, a small width) to the world's pictures and
clips, and how well it reconstructs them (the gate before the experts train on its latents).

Wan's VAE encodes the first frame alone and every later group of 4 frames into one latent frame, so
a 9-frame clip has 3 latent frames and a picture 1. Motion of a few pixels is under one latent
pixel: it survives only in the channels, which is why the gate reads the motion back from the
reconstructions (direction, motion ratio) before any expert trains."""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import torch

from distill.toy import world
from distill.toy.recipe import Recipe
from distill.toy.render import render_batch, render_clips
from distill.toy.world import Scene

# The clips' gate: what the VAE's reconstructions must show before the experts train on its latents.
GATE = {"direction": 0.98, "motion_ratio": (0.9, 1.1)}


def to_vae_input(media: np.ndarray) -> torch.Tensor:
    """Pictures (N, H, W, 3) or clips (N, F, H, W, 3) in [0, 1] -> (N, 3, F, H, W) in [-1, 1], as
    WanPipeline's VAE sees frames (F = 1 for pictures)."""
    x = torch.from_numpy(np.ascontiguousarray(media))
    if x.ndim == 4:
        x = x[:, None]
    return x.permute(0, 4, 1, 2, 3).mul(2.0).sub(1.0).contiguous()


def render_for(scenes: list[Scene], recipe: Recipe) -> np.ndarray:
    """Pictures, or clips of recipe.clip_frames when the scenes are clips."""
    if scenes and scenes[0].is_clip:
        return render_clips(scenes, recipe.size, recipe.clip_frames)
    return render_batch(scenes, recipe.size)


def fit_batch(recipe: Recipe, step: int) -> list[Scene]:
    """The scenes of VAE step `step`: pictures, and on every other step clips when the recipe has them."""
    if recipe.clip_frames and step % 2 == 1:
        return world.sample_scenes(recipe.vae_clip_batch, recipe.seed * 7919 + 5 * 10**6 + step, clips=True)
    return world.sample_scenes(recipe.vae_batch, recipe.seed * 7919 + step)


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
        x = to_vae_input(render_for(fit_batch(recipe, step), recipe))
        # An autoencoder with a little latent noise rather than a full VAE: the posterior's
        # initial unit variance would drown the code for most of a short fit, and the noise
        # (5% of the latents' spread) keeps the decoder tolerant of imperfect diffusion samples.
        mean = vae.encode(x).latent_dist.mode()
        z = mean + recipe.vae_latent_noise * mean.detach().std() * torch.randn_like(mean)
        vae.decode(z)
        y = torch.cat(unclamped, dim=2)
        unclamped.clear()
        # Shape pixels weigh 5x: they are a tenth of the picture but all of its meaning.
        weight = 1.0 + 4.0 * ((x - x[:, :, :1, :1, :1]).abs().amax(dim=1, keepdim=True) > 0.2).float()
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
            if recipe.clip_frames:
                log(
                    f"vae step {step:5d}  clip reconstructions {clip_reconstruction_score(vae, recipe, count=96)}"
                )
            unclamped.clear()  # the hook saw those decodes too
            vae.train()
    hook.remove()
    vae.eval().requires_grad_(False)
    latents = encode_pictures(
        vae, world.sample_scenes(2048, recipe.seed * 7919 + 10**6 + 1), recipe.size, normalise=False
    )
    # One mean and spread per channel over every latent frame, of pictures and clips alike (Wan's
    # config has one pair per channel for all frames).
    frames = latents.transpose(1, 2).flatten(0, 1)
    if recipe.clip_frames:
        clip_scenes = world.sample_scenes(512, recipe.seed * 7919 + 10**6 + 5, clips=True)
        clips = encode_scenes(vae, clip_scenes, recipe, normalise=False)
        frames = torch.cat([frames, clips.transpose(1, 2).flatten(0, 1)])
    mean = frames.mean(dim=(0, 2, 3))
    std = frames.std(dim=(0, 2, 3)).clamp_min(1e-3)
    vae.register_to_config(latents_mean=mean.tolist(), latents_std=std.tolist())
    return vae


@torch.no_grad()
def encode_pictures(vae: Any, scenes: list[world.Scene], size: int, normalise: bool = True) -> torch.Tensor:
    """Latents (N, 16, 1, size/8, size/8) of the scenes' pictures (posterior means), normalised as
    WanPipeline's latents are when `normalise`."""
    return encode_scenes(vae, scenes, Recipe(size=size, clip_frames=0), normalise)


@torch.no_grad()
def encode_scenes(
    vae: Any, scenes: list[world.Scene], recipe: Recipe, normalise: bool = True
) -> torch.Tensor:
    """Latents (N, 16, T, size/8, size/8) of pictures (T = 1) or clips (T = (F - 1) / 4 + 1),
    posterior means, normalised as WanPipeline's latents are when `normalise`."""
    chunks = []
    chunk = 256 if not (scenes and scenes[0].is_clip) else 64
    for start in range(0, len(scenes), chunk):
        x = to_vae_input(render_for(scenes[start : start + chunk], recipe))
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
    gap = result["diversity_gap"]  # None when no reconstruction shows a shape
    return {"accuracy": result["accuracy"], "diversity_gap": None if gap is None else round(gap, 3)}


@torch.no_grad()
def clip_reconstruction_score(vae: Any, recipe: Recipe, count: int = 192) -> dict[str, Any]:
    """The clip scorer on the VAE's reconstructions of fresh clips: accuracy, direction, speed,
    motion_ratio, still_leak and whether GATE passes."""
    from distill.toy.score import score_clips

    scenes = world.sample_scenes(count, recipe.seed * 7919 + 10**6 + 4, clips=True)
    clips = []
    for start in range(0, count, 64):
        x = to_vae_input(render_for(scenes[start : start + 64], recipe))
        y = vae.decode(vae.encode(x).latent_dist.mode()).sample
        clips.append(((y.permute(0, 2, 3, 4, 1) + 1.0) / 2.0).clamp(0, 1).numpy())
    result = score_clips(list(np.concatenate(clips)), [s.prompt for s in scenes])
    ratio = result["motion_ratio"]
    low, high = GATE["motion_ratio"]
    passed = (
        result["per_attribute"]["direction"] >= GATE["direction"]
        and ratio is not None
        and low <= ratio <= high
    )
    return {
        "accuracy": result["accuracy"],
        "direction": result["per_attribute"]["direction"],
        "speed": result["per_attribute"]["speed"],
        "motion_ratio": None if ratio is None else round(ratio, 3),
        "still_leak": result["still_leak"],
        "passes_gate": passed,
    }
