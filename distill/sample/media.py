"""The files samples become: PNG for one frame, MP4 (16 fps) for a clip, written under a temporary
name and renamed; the labelled teacher/student grid picture; and which rank draws which sample.
matplotlib runs headless (Agg)."""

from __future__ import annotations

import os
import textwrap
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

FPS = 16  # Wan 2.x generates 16 frames per second


def rank_share(num_items: int, rank: int, world_size: int) -> list[tuple[int, bool]]:
    """This rank's items as (index, keep) pairs: items[rank::world_size], padded to the same length on every rank.

    Every rank gets ceil(num_items / world_size) entries so that models whose forward is a
    collective (FSDP-sharded teacher or student) run the same number of forwards on every rank;
    padding entries repeat a real item with keep=False and are not written.
    """
    rounds = -(-num_items // world_size)
    share = []
    for i in range(rounds):
        index = rank + i * world_size
        share.append((index, True) if index < num_items else (num_items - 1, False))
    return share


def media_suffix(num_frames: int) -> str:
    return ".png" if num_frames == 1 else ".mp4"


def sample_stem(step: int | None, index: int) -> str:
    """File name (no suffix) of a sample: by step (None for the teacher reference) and prompt index."""
    who = "teacher" if step is None else f"step_{step:08d}"
    return f"{who}_prompt_{index:02d}"


def to_uint8(frames: np.ndarray) -> np.ndarray:
    return (np.clip(frames, 0.0, 1.0) * 255.0).round().astype(np.uint8)


def write_frames(frames: np.ndarray, path: str | Path) -> Path:
    """Write (F, H, W, 3) frames in [0, 1]: a PNG for one frame, an MP4 (16 fps) for a video.

    The suffix of `path` is replaced by the right one. Written under a temporary name and renamed,
    so a reader (rank 0 building a grid, wandb) never sees half a file.
    """
    import imageio.v2 as imageio

    path = Path(path)
    target = path.with_suffix(media_suffix(len(frames)))
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.stem}.{os.getpid()}.tmp{target.suffix}")
    pixels = to_uint8(frames)
    if len(pixels) == 1:
        imageio.imwrite(tmp, pixels[0])
    else:
        # macro_block_size 16: Wan sizes are multiples of 16, so no resize warning or padding.
        imageio.mimwrite(tmp, list(pixels), fps=FPS, macro_block_size=16)
    os.replace(tmp, target)
    return target


def read_first_frame(path: str | Path) -> np.ndarray:
    """The first frame of a PNG or MP4 as uint8 (H, W, 3)."""
    import imageio.v3 as iio

    path = Path(path)
    if path.suffix == ".mp4":
        return np.asarray(iio.imread(path, index=0))[..., :3]
    return np.asarray(iio.imread(path))[..., :3]


def latent_preview(latent: torch.Tensor) -> np.ndarray:
    """A low-resolution look at a latent (C, F, h, w) without the VAE: channels 0-2 of the first
    frame as RGB, +-2 standard deviations mapped to [0, 255]. Wan latents are normalised to unit
    variance, so the same mapping fits every sample and teacher and student stay comparable."""
    rgb = latent[:3, 0].float().permute(1, 2, 0).cpu().numpy()
    return to_uint8(0.5 + rgb / 4.0)


def write_grid(
    rows: Sequence[tuple[str, Sequence[np.ndarray]]],
    out_png: str | Path,
    prompts: Sequence[str] = (),
    title: str = "",
) -> Path:
    """A grid PNG: one labelled row per (label, images), one column per prompt (teacher row first)."""

    return plot_sample_grid(rows, out_png, prompts=prompts, title=title)


def first_frames(files: Sequence[Path]) -> list[np.ndarray]:
    return [read_first_frame(p) for p in files]


def plot_sample_grid(
    rows: Sequence[tuple[str, Sequence[np.ndarray]]],
    out_png: str | Path,
    prompts: Sequence[str] = (),
    title: str = "",
) -> Path:
    """One labelled row of images per (label, images) (teacher first), one column per prompt."""
    plt = pyplot()
    columns = max([len(images) for _, images in rows] + [1])
    fig, axes = plt.subplots(
        len(rows), columns, figsize=(2.0 * columns, 2.1 * len(rows) + 0.4), squeeze=False
    )
    for row, (label, images) in enumerate(rows):
        for col in range(columns):
            ax = axes[row][col]
            ax.set_xticks([])
            ax.set_yticks([])
            if col < len(images):
                ax.imshow(images[col], interpolation="nearest")
            if col == 0:
                ax.set_ylabel(label, fontsize=10)
            if row == 0 and col < len(prompts):
                ax.set_title(_short(prompts[col]), fontsize=7)
    if title:
        fig.suptitle(title, fontsize=11)
    return save_figure(fig, out_png)


def _short(prompt: str, width: int = 26, lines: int = 3) -> str:
    return "\n".join(textwrap.wrap(prompt, width)[:lines])


def pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg", force=True)  # headless nodes have no display; never open a window
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig: Any, out_png: str | Path) -> Path:
    """Save as PNG under a temporary name, then rename: readers never see a half-written file."""
    out = Path(out_png)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    fig.savefig(tmp, format="png", dpi=100, bbox_inches="tight")
    pyplot().close(fig)
    os.replace(tmp, out)
    return out
