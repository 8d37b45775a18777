"""The files samples become: PNG for one frame, MP4 (16 fps) for a clip, written under a temporary
name and renamed; reading them back (first frame or all frames); frame strips (a few frames of a
clip side by side, so a still picture shows motion); the labelled teacher/student grid picture; an
animated side-by-side GIF a person can play; and which rank draws which sample.
matplotlib runs headless (Agg)."""

from __future__ import annotations

import os
import textwrap
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from distill.ops.errors import DistillError, Stage

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


def read_frames(path: str | Path) -> np.ndarray:
    """All frames of a PNG (F=1) or MP4 as uint8 (F, H, W, 3).

    The same shape for pictures and clips, so callers (frame strips, GIFs) need no special case.
    """
    import imageio.v3 as iio

    path = Path(path)
    if path.suffix == ".mp4":
        frames = np.asarray(iio.imread(path, index=None))
    else:
        frames = np.asarray(iio.imread(path))[None]
    if frames.ndim == 3:  # grayscale (F, H, W): repeat the one channel as RGB
        frames = np.repeat(frames[..., None], 3, axis=-1)
    return np.ascontiguousarray(frames[..., :3])


STRIP_GUTTER = 0.8  # light gray between the frames of a strip, as a fraction of full brightness


def frame_strip(frames: np.ndarray, count: int = 5) -> np.ndarray:
    """`count` frames of a clip, evenly spaced from the first to the last (both always included),
    side by side with a 1-pixel light gray gutter: (H, count * W + count - 1, 3), input dtype.

    A grid of first frames cannot show whether a student learned motion or only a still picture;
    a strip can, in a PNG. One frame (F=1, or an (H, W, 3) picture) is returned as itself; a clip
    shorter than `count` gives one tile per frame.
    """
    if count < 1:
        raise ValueError(f"frame_strip needs count >= 1, got {count}")
    frames = np.asarray(frames)
    if frames.ndim == 3:
        return frames
    if frames.ndim != 4 or len(frames) == 0:
        raise ValueError(f"frame_strip needs frames of shape (F, H, W, C), got {frames.shape}")
    if len(frames) == 1:
        return frames[0]
    count = min(count, len(frames))
    picks = np.linspace(0, len(frames) - 1, count).round().astype(int)
    _, height, width, channels = frames.shape
    top = np.iinfo(frames.dtype).max if np.issubdtype(frames.dtype, np.integer) else 1.0
    strip = np.full(
        (height, count * width + count - 1, channels), STRIP_GUTTER * top, dtype=np.float64
    ).astype(frames.dtype)
    for slot, index in enumerate(picks):
        left = slot * (width + 1)
        strip[:, left : left + width] = frames[index]
    return strip


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


def strips(files: Sequence[Path], count: int = 5) -> list[np.ndarray]:
    """Like `first_frames`, but a frame strip per file: a clip shows its motion in the grid, a
    picture stays a picture. Each clip is read whole and dropped once its strip is cut."""
    return [frame_strip(read_frames(p), count) for p in files]


def plot_sample_grid(
    rows: Sequence[tuple[str, Sequence[np.ndarray]]],
    out_png: str | Path,
    prompts: Sequence[str] = (),
    title: str = "",
) -> Path:
    """One labelled row of images per (label, images) (teacher first), one column per prompt.

    Tiles are 2 inches wide; images wider than tall (frame strips) get tiles as wide as their
    aspect needs at the height a tile's image gets (about 1.3 inches), so that they are neither
    shrunk into a square slot nor spread out with empty space between the columns.
    """
    plt = pyplot()
    columns = max([len(images) for _, images in rows] + [1])
    aspect = max([image.shape[1] / image.shape[0] for _, images in rows for image in images] + [1.0])
    tile_width = 2.0 if aspect <= 1.0 else 1.3 * aspect + 0.2
    fig, axes = plt.subplots(
        len(rows), columns, figsize=(tile_width * columns, 2.1 * len(rows) + 0.4), squeeze=False
    )
    if aspect > 1.0:
        fig.subplots_adjust(wspace=0.08)
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


GIF_GUTTER = 2  # pixels of dark background between tiles
GIF_BACKGROUND = (24, 24, 24)
GIF_TEXT = (235, 235, 235)
GIF_LABEL_PAD = 6  # pixels left and right of the row labels in the margin


def label_margin(labels: Sequence[str]) -> int:
    """Width in pixels of the left margin that holds the row labels of a side-by-side GIF: the
    widest label in PIL's default font plus padding on both sides (0 when there are no labels)."""
    from PIL import Image, ImageDraw, ImageFont

    labels = [label for label in labels if label]
    if not labels:
        return 0
    draw = ImageDraw.Draw(Image.new("RGB", (1, 1)))
    font = ImageFont.load_default()
    widest = max(int(np.ceil(draw.textlength(label, font=font))) for label in labels)
    return widest + 2 * GIF_LABEL_PAD


def _as_uint8_clip(clip: np.ndarray) -> np.ndarray:
    """(F, H, W, 3) uint8 from a clip or picture given as floats in [0, 1] or uint8."""
    clip = np.asarray(clip)
    if clip.ndim == 3:
        clip = clip[None]
    if clip.ndim != 4 or len(clip) == 0:
        raise ValueError(f"a clip needs shape (F, H, W, 3) or (H, W, 3), got {clip.shape}")
    pixels = clip if clip.dtype == np.uint8 else to_uint8(clip)
    return pixels[..., :3]


def write_side_by_side_gif(
    rows: Sequence[tuple[str, Sequence[np.ndarray]]],
    out_path: str | Path,
    fps: int = FPS // 2,
    scale: int = 4,
) -> Path:
    """An animated GIF, looping forever: one labelled row per (label, clips) (teacher first), one
    column per clip, each clip upscaled `scale` times (nearest neighbour) with a 2-pixel dark gutter.

    A person judges motion by watching it: teacher and student, same prompts and noise, played in
    step. Toy clips are 32 px, hence the upscaling; half speed (8 fps) makes short clips readable.
    Pictures (F=1) and shorter clips hold their last frame; the GIF has as many frames as the
    longest clip (PIL merges consecutive identical frames into one longer frame, which plays the
    same). The suffix of `out_path` becomes .gif; written under a temporary name and renamed, so
    a reader never sees half a file.
    """
    from PIL import Image, ImageDraw, ImageFont

    if scale < 1 or fps < 1:
        raise ValueError(f"write_side_by_side_gif needs scale >= 1 and fps >= 1, got {scale}, {fps}")
    clips = [[_as_uint8_clip(c) for c in row_clips] for _, row_clips in rows]
    every = [c for row_clips in clips for c in row_clips]
    if not every:
        raise ValueError("write_side_by_side_gif needs at least one clip")
    columns = max(len(row_clips) for row_clips in clips)
    tile_h = max(c.shape[1] for c in every) * scale
    tile_w = max(c.shape[2] for c in every) * scale
    num_frames = max(len(c) for c in every)
    margin = label_margin([label for label, _ in rows])
    width = margin + columns * tile_w + (columns - 1) * GIF_GUTTER
    height = len(rows) * tile_h + (len(rows) - 1) * GIF_GUTTER

    # Labels are the same on every frame: draw them once on a background, copy it per frame.
    background = Image.new("RGB", (width, height), GIF_BACKGROUND)
    draw = ImageDraw.Draw(background)
    font = ImageFont.load_default()
    for r, (label, _) in enumerate(rows):
        if label:
            _, text_top, _, text_bottom = draw.textbbox((0, 0), label, font=font)
            y = r * (tile_h + GIF_GUTTER) + (tile_h - text_top - text_bottom) // 2  # centred on the row
            draw.text((GIF_LABEL_PAD, y), label, fill=GIF_TEXT, font=font)
    base = np.asarray(background)

    frames = []
    for t in range(num_frames):
        canvas = base.copy()
        for r, row_clips in enumerate(clips):
            top = r * (tile_h + GIF_GUTTER)
            for col, clip in enumerate(row_clips):
                left = margin + col * (tile_w + GIF_GUTTER)
                frame = clip[min(t, len(clip) - 1)]
                big = frame.repeat(scale, axis=0).repeat(scale, axis=1)
                canvas[top : top + big.shape[0], left : left + big.shape[1]] = big
        frames.append(Image.fromarray(canvas))

    target = Path(out_path).with_suffix(".gif")
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.stem}.{os.getpid()}.tmp.gif")
    frames[0].save(
        tmp,
        format="GIF",
        save_all=True,
        append_images=frames[1:],
        duration=round(1000 / fps),
        loop=0,
    )
    os.replace(tmp, target)
    return target


def _short(prompt: str, width: int = 26, lines: int = 3) -> str:
    return "\n".join(textwrap.wrap(prompt, width)[:lines])


def pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg", force=True)  # headless nodes have no display; never open a window
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig: Any, out_png: str | Path, *, tight: bool = True) -> Path:
    """Save as PNG under a temporary name, then rename: readers never see a half-written file.
    `tight` crops the page to what is drawn (it costs a second draw); without it the figure's own
    margins are kept."""
    out = Path(out_png)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    fig.savefig(tmp, format="png", dpi=100, bbox_inches="tight" if tight else None)
    pyplot().close(fig)
    os.replace(tmp, out)
    return out


def write_files_gif(rows: Sequence[tuple[str, Sequence[Path]]], out_path: str | Path) -> Path:
    """`write_side_by_side_gif` of written samples: one row per (label, files)."""
    return write_side_by_side_gif(
        [(label, [read_frames(f) for f in files]) for label, files in rows], out_path
    )


def output_paths(output: str | Path, count: int, num_frames: int) -> list[Path]:
    """Where each prompt's sample goes: one prompt, `output` is the file (its suffix added when
    missing); several prompts, or an existing folder, a folder of prompt_00.png (or .mp4), ..."""
    output = Path(output)
    suffix = media_suffix(num_frames)
    if count > 1 or output.is_dir():
        if output.suffix.lower() in (".png", ".mp4"):
            raise DistillError(
                f"--output {output} names a file, but there are {count} prompts",
                fixes=[f"pass a folder, e.g. --output {output.with_suffix('')}/"],
                stage=Stage.ARGV,
            )
        return [output / f"prompt_{i:02d}{suffix}" for i in range(count)]
    if output.suffix and output.suffix.lower() != suffix:
        kind = "image" if num_frames == 1 else f"{num_frames}-frame video"
        raise DistillError(
            f"--output {output}: a {kind} is written as {suffix}",
            fixes=[f"use --output {output.with_suffix(suffix)}"],
            stage=Stage.ARGV,
        )
    return [output.with_suffix(suffix)]
