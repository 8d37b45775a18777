"""What `python -m distill.toy.build` starts from: the toy VAE's architecture, and the check that a
--from folder is a toy teacher and a --vae_from VAE has the toy VAE's architecture, made before any
minutes of fitting (no amount of fitting would fix either)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from distill.ops.errors import DistillError, Stage
from distill.toy import world
from distill.toy.recipe import Recipe


def toy_vae_shape(recipe: Recipe) -> dict[str, Any]:
    """The toy VAE's architecture (AutoencoderKLWan arguments): what a --vae_from VAE must have."""
    return {
        "base_dim": recipe.vae_base_dim,
        "z_dim": 16,
        "dim_mult": [1, 2, 2, 2],
        "num_res_blocks": 1,
        "attn_scales": [],
        "temperal_downsample": [False, True, True],
    }


def check_starting_points(start_from: str | None, vae_from: str | None, recipe: Recipe) -> None:
    """Refuse, before minutes of fitting, a --from folder that is no toy teacher and a VAE of another
    architecture than the toy world's: no amount of fitting (the VAE gate's advice) would fix either."""
    if start_from and world.read_world(start_from) is None:
        raise DistillError(
            f"--from {start_from} is not a toy teacher: it holds no {world.WORLD_FILE}",
            "--from continues the training of a toy teacher (its experts, and its VAE unless --vae_from); "
            "a teacher trained on anything else, or a random one, is no start for the toy world.",
            fixes=[
                "pass a toy teacher: assets/toy_teacher, or a folder python download_wan.py --toy DIR wrote",
                "or train a new toy teacher: leave --from out",
            ],
            stage=Stage.CONFIG,
        )
    source = vae_from or start_from
    if not source:
        return
    folder = Path(source) / "vae" if (Path(source) / "vae").is_dir() else Path(source)
    flag = "--vae_from" if vae_from else "--from"
    try:
        config = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError) as error:
        raise DistillError(
            f"{flag} {source} holds no VAE this command can read",
            f"{folder / 'config.json'}: {type(error).__name__}: {error}",
            fixes=["pass a toy teacher folder, or the VAE a build saved beside its --output (OUTPUT.vae)"],
            stage=Stage.CONFIG,
        ) from None
    want = toy_vae_shape(recipe)
    differ = (
        {k: config.get(k) for k, v in want.items() if config.get(k) != v}
        if isinstance(config, dict)
        else want
    )
    if differ:
        raise DistillError(
            f"{flag} {source}: its VAE has another architecture than the toy world's",
            "\n".join(f"{k}: {differ[k]} there, {want[k]} in the toy VAE" for k in differ),
            fixes=[
                "pass the VAE of a toy teacher (assets/toy_teacher), or leave "
                f"{'--vae_from' if vae_from else '--from'} out to fit a new toy VAE",
            ],
            stage=Stage.CONFIG,
        )
