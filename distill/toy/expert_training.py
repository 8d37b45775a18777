"""Flow matching of the toy teacher's two experts on encoded pictures and clips, with WanPipeline's
conventions (x_t = (1 - s) x0 + s noise, target noise - x0, timestep 1000 s on the shifted
schedule); the high-noise expert above the boundary, the low-noise one below, each a little past it."""

from __future__ import annotations

import time
from typing import Any

import torch

from distill.toy.recipe import Recipe
from distill.toy.text_padding import fold_into, unfold_from


def shifted_sigma(u: torch.Tensor, shift: float) -> torch.Tensor:
    """The scheduler's time shift: sigma = shift u / (1 + (shift - 1) u)."""
    return shift * u / (1.0 + (shift - 1.0) * u)


def unshifted(sigma: float, shift: float) -> float:
    return sigma / (shift - (shift - 1.0) * sigma)


# Where the low-noise expert's focus (Recipe.low_focus) starts.
FOCUS_SIGMA = 0.45


def train_experts(
    high: Any,
    low: Any,
    data: list[tuple[torch.Tensor, ...]],
    text: tuple[torch.Tensor, torch.Tensor],
    recipe: Recipe,
    log: Any = print,
    device: str | torch.device = "cpu",
    adapters_only: bool = False,
) -> None:
    """Flow matching of the recipe's trained experts (both by default) on each (latents (N, C, T,
    h, w), prompt ids (N,) into the folded text table `text` (whose last row is the empty prompt),
    batch[, condition]) of `data` every step: pictures and clips side by side, as Wan trains on both.
    A `condition` (N, C', T, h, w) is concatenated after the noisy latents, as the image-to-video
    model's input is (models/conditioning.py `model_input`); it is never dropped with the text.
    Every draw comes from one CPU generator, so `device` changes where the arithmetic runs, not which
    samples, noise and timesteps a step sees. With `adapters_only` only the experts' LoRA weights
    (peft's `lora_` parameters, added beforehand) train: a user's LoRA of a frozen teacher."""
    short, bias = text
    empty = short.shape[0] - 1
    generator = torch.Generator().manual_seed(recipe.seed * 31 + 5)
    b = recipe.boundary_ratio
    ranges = {
        "high": (unshifted(b - recipe.expert_overlap, recipe.flow_shift), 1.0),
        "low": (0.0, unshifted(b + recipe.expert_overlap, recipe.flow_shift)),
    }
    focus_from = unshifted(FOCUS_SIGMA, recipe.flow_shift)
    for model in (high, low):
        model.to(device).eval().requires_grad_(False)  # an expert the recipe does not train stays as it is
    experts = {
        name: model for name, model in (("high", high), ("low", low)) if name in recipe.trained_experts
    }
    for model in experts.values():
        model.train()
        for key, parameter in model.named_parameters():
            parameter.requires_grad_(not adapters_only or ".lora_" in key)
    processors = {name: fold_into(model) for name, model in experts.items()}
    params = [p for model in experts.values() for p in model.parameters() if p.requires_grad]
    if not params:
        raise ValueError("nothing to train: adapters_only needs LoRA adapters added to the trained experts")
    optimizer = torch.optim.AdamW(params, lr=recipe.expert_lr, weight_decay=0.01)
    schedule = torch.optim.lr_scheduler.OneCycleLR(
        optimizer, recipe.expert_lr, total_steps=recipe.expert_steps, pct_start=0.05
    )
    start = time.perf_counter()
    try:
        for step in range(recipe.expert_steps):
            losses = {}
            for name, model in experts.items():
                losses[name] = torch.zeros((), device=device)
                for latents, prompt_ids, batch, *condition in data:
                    index = torch.randint(0, len(latents), (batch,), generator=generator)
                    x0 = latents[index]
                    noise = torch.randn(x0.shape, generator=generator).to(device)
                    x0 = x0.to(device)
                    lo, hi = ranges[name]
                    u = lo + (hi - lo) * torch.rand(len(index), generator=generator)
                    if name == "low" and recipe.low_focus > 0:
                        focused = torch.rand(len(index), generator=generator) < recipe.low_focus
                        top = focus_from + (hi - focus_from) * torch.rand(len(index), generator=generator)
                        u = torch.where(focused, top, u)
                    sigma = shifted_sigma(u, recipe.flow_shift).to(device)
                    s = sigma.view(-1, 1, 1, 1, 1)
                    x_t = (1.0 - s) * x0 + s * noise
                    ids = prompt_ids[index].clone()
                    ids[torch.rand(len(ids), generator=generator) < recipe.text_dropout] = empty
                    processors[name].bias = bias[ids].to(device)
                    if condition:
                        x_t = torch.cat([x_t, condition[0][index].to(device)], dim=1)
                    v = model(x_t, sigma * 1000.0, short[ids].to(device), return_dict=False)[0]
                    losses[name] = losses[name] + (v - (noise - x0)).pow(2).mean()
            optimizer.zero_grad(set_to_none=True)
            sum(losses.values()).backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            optimizer.step()
            schedule.step()
            if step % 250 == 0 or step == recipe.expert_steps - 1:
                shown = "  ".join(f"{name} {loss.item():.4f}" for name, loss in losses.items())
                log(f"experts step {step:5d}  loss {shown}  ({time.perf_counter() - start:.0f} s)")
    finally:
        for model in experts.values():
            unfold_from(model)
        for model in (high, low):
            model.to("cpu").eval().requires_grad_(False)
