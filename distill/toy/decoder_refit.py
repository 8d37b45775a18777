"""Refit only the toy VAE's decoder, so clips decoded from the same latents keep their image.

    python -m distill.toy.decoder_refit --steps 3000 --output outputs/toy_i2v_vae   # ~20 min, one thread

The shipped toy VAE reads back right on the text-to-video score but not on image adherence: some
decoded thin bars read as squares, or change size by more than image_score.SIZE_TOLERANCE in a frame,
so its round trip of the world's own clips adheres on only ~0.78 of held-out cases. The encoder stays
frozen, so every latent (and every expert trained on them, and latents_mean / latents_std) stays
valid: only what the latents decode to changes. The loss is the fit's own (vae_fit: shape pixels
weigh 5x), on clips only (the image-to-video teacher decodes nothing else), through latents with the
fit's 5% of noise (decoding a diffusion sample is never decoding a posterior mean exactly).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from distill.ops.command import Parser, PathAction, entry_point, integer, number
from distill.ops.paths import Kind
from distill.toy import world
from distill.toy.recipe import Recipe
from distill.toy.render import render_clips
from distill.toy.shipped import ASSETS
from distill.toy.stream_score import render_stream
from distill.toy.vae_fit import to_vae_input

ADHERENCE_GATE = 0.88
"""What the refit decoder's round trip of the world's own clips must score on image adherence (216
held-out cases) before the experts train. The shipped toy VAE scores 0.78; 812 refit steps (batch 16,
lr 3e-4) took it to 0.90, and 600 more at lr 1e-4 left it there: what still fails is a thin shape
that reads square or changes size in the frames that share a latent frame with motion (4 frames per
latent frame). The issue's 0.95 is not reached; the gate keeps a refit that went backwards out."""
SHAPE_WEIGHT = 5.0  # vae_fit's weight of the shape's pixels
RIM = 2  # pixels around the shape weighted as the shape


def shape_weight(x: torch.Tensor) -> torch.Tensor:
    """Per-pixel loss weight (N, 1, F, H, W) of clips `x` (N, 3, F, H, W) in [-1, 1]: SHAPE_WEIGHT on
    the shape and RIM pixels around it, 1 elsewhere. The rim matters as much as the shape: the score
    reads a thin bar's aspect from the pixels over half way to its colour, and a decoder that bleeds
    a pixel past a 3-pixel-high bar's edges makes it read as a square."""
    shape = ((x - x[:, :, :1, :1, :1]).abs().amax(dim=1, keepdim=True) > 0.2).float()
    size = 2 * RIM + 1
    rim = torch.nn.functional.max_pool3d(shape, (1, size, size), stride=1, padding=(0, RIM, RIM))
    return 1.0 + (SHAPE_WEIGHT - 1.0) * rim


def world_clips(scenes: list[world.Scene], size: int, frames: int) -> np.ndarray:
    """The world's clips of `scenes` (N, frames, size, size, 3); past its clip length, its streams."""
    if frames <= world.CLIP_FRAMES:
        return render_clips(scenes, size, frames)
    return np.stack([render_stream(scene, frames, size) for scene in scenes])


def decoder_parameters(vae: Any) -> list[torch.nn.Parameter]:
    """The parameters that turn latents into pixels: post_quant_conv and the decoder."""
    return [*vae.post_quant_conv.parameters(), *vae.decoder.parameters()]


def refit_decoder(
    vae: Any,
    steps: int,
    lr: float = 1e-4,
    batch: int = 8,
    seed: int = 0,
    log: Any = print,
    check_every: int = 0,
    check: Any = None,
    device: str | torch.device = "cpu",
    frames: int | None = None,
) -> Any:
    """Train `vae`'s decoder for `steps` on fresh world clips; the encoder (and quant_conv) frozen.
    `check(step)` runs every `check_every` steps with the VAE in eval mode (a score, a save). The
    clips and noise are drawn on the CPU, so `device` changes where the arithmetic runs only; the VAE
    is back on the CPU at the end. `frames` longer than the world's clip trains on its right streams
    of that length (`stream_score.render_stream`: the clip's motion continued per frame)."""
    vae.to(device).eval().requires_grad_(False)
    params = decoder_parameters(vae)
    for p in params:
        p.requires_grad_(True)
    vae.decoder.train()
    optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.OneCycleLR(
        optimizer, lr, total_steps=steps, pct_start=max(0.05, 2.5 / steps)
    )
    # As in vae_fit: the loss reads the decoder's output before decode() clamps it (no gradient there).
    unclamped: list[torch.Tensor] = []
    hook = vae.decoder.register_forward_hook(lambda module, args, output: unclamped.append(output))
    generator = torch.Generator().manual_seed(seed * 7919 + 38)
    recipe = Recipe(seed=seed)
    start = time.perf_counter()
    try:
        for step in range(steps):
            # Seeds far from the fit's and the held-out cases' (image_score.HELD_OUT_SEED).
            scenes = world.sample_scenes(batch, seed * 7919 + 38 * 10**6 + step, clips=True)
            x = to_vae_input(world_clips(scenes, recipe.size, frames or recipe.clip_frames)).to(device)
            with torch.no_grad():
                mean = vae.encode(x).latent_dist.mode()
                noise = torch.randn(mean.shape, generator=generator).to(device)
                z = mean + recipe.vae_latent_noise * mean.std() * noise
            vae.decode(z)
            y = torch.cat(unclamped, dim=2)
            unclamped.clear()
            weight = shape_weight(x)
            loss = (weight * (y - x).pow(2)).mean()
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            optimizer.step()
            schedule.step()
            if step % 100 == 0 or step == steps - 1:
                log(f"decoder step {step:5d}  loss {loss.item():.5f}  ({time.perf_counter() - start:.0f} s)")
            if check is not None and check_every and step % check_every == check_every - 1:
                vae.decoder.eval()
                check(step)
                unclamped.clear()  # the hook saw the check's decodes too
                vae.decoder.train()
    finally:
        hook.remove()
        vae.to("cpu").eval().requires_grad_(False)
    return vae


def round_trip_adherence(vae: Any, count: int = 216, seed: int | None = None) -> dict[str, Any]:
    """image_score on `vae`'s round trip of the world's own clips of `count` held-out cases: the most
    a model decoding through this VAE can adhere."""
    from distill.toy.image_score import HELD_OUT_SEED, motion_prompts, reference_clips, score_image_clips

    cases = motion_prompts(count, HELD_OUT_SEED if seed is None else seed)
    clips = reference_clips(cases)
    decoded = []
    with torch.no_grad():
        for start in range(0, len(clips), 32):
            x = to_vae_input(clips[start : start + 32]).to(next(vae.parameters()).device)
            y = vae.decode(vae.encode(x).latent_dist.mode()).sample
            decoded.append(((y.clamp(-1.0, 1.0) + 1.0) / 2.0).permute(0, 2, 3, 4, 1).cpu().numpy())
    return score_image_clips(list(np.concatenate(decoded)), cases)


@entry_point
def main(argv: list[str] | None = None) -> int:
    parser = Parser(prog="python -m distill.toy.decoder_refit", description=__doc__.split("\n\n")[0])
    parser.add_argument("--vae_from", default=str(ASSETS), action=PathAction, kind=Kind.FOLDER)
    parser.add_argument("--output", required=True, action=PathAction, kind=Kind.OUTPUT_FOLDER)
    parser.add_argument("--steps", type=integer(1), default=3000)
    parser.add_argument("--lr", type=number(0.0, above=True), default=1e-4)
    parser.add_argument("--batch", type=integer(1), default=8)
    parser.add_argument("--threads", type=integer(1), default=1)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    from diffusers import AutoencoderKLWan

    folder = Path(args.vae_from)
    vae = AutoencoderKLWan.from_pretrained(folder / "vae" if (folder / "vae").is_dir() else folder)
    print(f"before: {round_trip_adherence(vae)}", flush=True)

    def check(step: int) -> None:  # the score as the refit goes, and a copy to stop at
        scored = round_trip_adherence(vae, count=108)
        print(f"step {step}: adherence {scored['adherence']:.3f} {scored['parts']}", flush=True)
        vae.save_pretrained(args.output)

    refit_decoder(
        vae, args.steps, args.lr, args.batch, log=lambda m: print(m, flush=True), check_every=250, check=check
    )
    vae.save_pretrained(args.output)
    print(f"after: {round_trip_adherence(vae)}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
