"""Generating images and videos with diffusers' WanPipeline: the student alone, or the teacher.

The student learned the teacher's *guided* velocity, so it samples with one model and guidance 1
(`transformer=student, transformer_2=None, boundary_ratio=None`); the teacher samples with both
experts, switched at its boundary, and its own guidance scales (4.0 / 3.0 for Wan 2.2 A14B).
Tokenizer, text encoder, VAE and scheduler always come from the teacher folder.

During training nothing here loads the text encoder: pipelines take precomputed, zero-padded
prompt embeddings, sample to latents, and `decode_with_teacher_vae` loads the VAE only for the
decode and frees it after. The command-line front end is `distill/generate.py`:

    python -m distill.generate --student outputs/run1/student --teacher_path TEACHER \
        --prompt "a red fox in the snow" --output fox.png
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import torch

from distill.errors import DistillError, Stage
from distill.teacher import free

logger = logging.getLogger(__name__)

FPS = 16  # Wan 2.x generates 16 frames per second
SHARED_COMPONENTS = ("text_encoder", "tokenizer", "vae", "scheduler")


# ---------------------------------------------------------------------------------------------
# Teacher components, loaded on demand
# ---------------------------------------------------------------------------------------------


def load_scheduler(teacher_path: str | Path) -> Any:
    """A fresh instance of the teacher's scheduler (of the class its scheduler_config.json names).

    Every pipeline gets its own: a multistep scheduler keeps state between steps, so two pipelines
    must not share one.
    """
    import diffusers

    folder = Path(teacher_path) / "scheduler"
    name = json.loads((folder / "scheduler_config.json").read_text()).get(
        "_class_name", "UniPCMultistepScheduler"
    )
    return getattr(diffusers, name).from_pretrained(folder)


def scheduler_from_config(config: Mapping[str, Any]) -> Any:
    """A diffusers scheduler from a config dict naming its class (`_class_name`), e.g. a
    run_settings.json `scheduler` entry."""
    import diffusers

    name = config.get("_class_name")
    cls = getattr(diffusers, str(name), None)
    if cls is None or not hasattr(cls, "from_config"):
        raise DistillError(
            f"unknown scheduler class {name!r}",
            fixes=["name a diffusers scheduler in `_class_name`, e.g. FlowMatchEulerDiscreteScheduler"],
            stage=Stage.CONFIG,
        )
    return cls.from_config(dict(config))


def load_vae(teacher_path: str | Path, device: torch.device, dtype: torch.dtype = torch.float32) -> Any:
    """The teacher's Wan VAE, frozen, on `device` (float32 by default: decoding is cheap and exact)."""
    from diffusers import AutoencoderKLWan

    vae = AutoencoderKLWan.from_pretrained(Path(teacher_path) / "vae", torch_dtype=dtype)
    return vae.requires_grad_(False).eval().to(device)


def load_text_components(
    teacher_path: str | Path, device: torch.device, dtype: torch.dtype
) -> tuple[Any, Any]:
    """The teacher's tokenizer and UMT5 text encoder (frozen, on `device`)."""
    from transformers import AutoTokenizer, UMT5EncoderModel

    path = Path(teacher_path)
    tokenizer = AutoTokenizer.from_pretrained(path / "tokenizer")
    encoder = UMT5EncoderModel.from_pretrained(path / "text_encoder", torch_dtype=dtype)
    return tokenizer, encoder.requires_grad_(False).eval().to(device)


def encode_prompts(
    teacher_path: str | Path,
    prompts: Sequence[str],
    max_sequence_length: int,
    device: torch.device,
    dtype: torch.dtype,
) -> dict[str, torch.Tensor]:
    """Zero-padded (max_sequence_length, text_dim) embeddings of `prompts`, on the CPU.

    Loads the text encoder, encodes exactly as WanPipeline does, and frees it again.
    """
    from diffusers import WanPipeline

    tokenizer, encoder = load_text_components(teacher_path, device, dtype)
    pipe = WanPipeline(tokenizer=tokenizer, text_encoder=encoder, vae=None, scheduler=None)
    unique = list(dict.fromkeys(prompts))
    with torch.no_grad():
        embeds = pipe.encode_prompt(
            unique,
            do_classifier_free_guidance=False,
            max_sequence_length=max_sequence_length,
            device=device,
            dtype=dtype,
        )[0]
    result = {prompt: embed.cpu() for prompt, embed in zip(unique, embeds)}
    free(pipe, tokenizer, encoder)
    return result


# ---------------------------------------------------------------------------------------------
# Sizes a model can handle
# ---------------------------------------------------------------------------------------------


class SizeLimits(NamedTuple):
    """What bounds the sample sizes a Wan transformer accepts, read from its config."""

    name: str
    """How messages call it: "student", "teacher"."""
    config_file: str
    """Where its config lives, for the message."""
    patch_size: tuple[int, int, int]
    rope_max_seq_len: int
    """Positions of its rotary table per axis: more patches along any axis cannot be embedded."""

    @classmethod
    def of(cls, name: str, config: Mapping[str, Any], config_file: str | Path) -> SizeLimits:
        # WanTransformer3DModel's own defaults for a config that leaves them out.
        patch = tuple(config.get("patch_size") or (1, 2, 2))
        return cls(name, str(config_file), patch, int(config.get("rope_max_seq_len") or 1024))


def check_sample_size(
    height: int,
    width: int,
    num_frames: int,
    vae_scale_spatial: int,
    vae_scale_temporal: int,
    models: Sequence[SizeLimits],
    *,
    fixes: Sequence[str] = (),
) -> None:
    """Refuse a size that one of `models` cannot denoise, before anything is loaded.

    WanPipeline would otherwise round a size silently (not a multiple of VAE stride x patch) or
    crash deep inside the rotary embedding (more patches along an axis than rope_max_seq_len).
    `fixes` come first in the message (e.g. the size the student was trained at).
    """
    if num_frames <= 0 or (num_frames - 1) % vae_scale_temporal:
        raise DistillError(
            f"--num_frames must be 1 or {vae_scale_temporal}k+1, got {num_frames}",
            f"the Wan VAE compresses time by {vae_scale_temporal}",
            fixes=[*fixes, "use --num_frames 1 (image) or 81 (video)"],
            stage=Stage.CONFIG,
        )
    latent_frames = (num_frames - 1) // vae_scale_temporal + 1
    for model in models:
        p_t, p_h, p_w = model.patch_size
        for flag, value, patch in (("height", height, p_h), ("width", width, p_w)):
            multiple = vae_scale_spatial * patch
            if value <= 0 or value % multiple:
                raise DistillError(
                    f"--{flag} must be a positive multiple of {multiple}, got {value}",
                    f"VAE stride {vae_scale_spatial} x the {model.name}'s patch {patch} ({model.config_file})",
                    fixes=[*fixes, f"use --{flag} {max(multiple, value // multiple * multiple)}"],
                    stage=Stage.CONFIG,
                )
        axes = (
            (
                "num_frames",
                num_frames,
                latent_frames // p_t,
                (model.rope_max_seq_len * p_t - 1) * vae_scale_temporal + 1,
            ),
            (
                "height",
                height,
                height // vae_scale_spatial // p_h,
                model.rope_max_seq_len * vae_scale_spatial * p_h,
            ),
            (
                "width",
                width,
                width // vae_scale_spatial // p_w,
                model.rope_max_seq_len * vae_scale_spatial * p_w,
            ),
        )
        for flag, value, patches, largest in axes:
            if patches > model.rope_max_seq_len:
                raise DistillError(
                    f"--{flag} {value} is too large for the {model.name}: {patches} patches along that axis, "
                    f"its rope_max_seq_len is {model.rope_max_seq_len}",
                    f"the {model.name}'s rotary position table ({model.config_file}) has "
                    f"{model.rope_max_seq_len} positions per axis, so --{flag} can be at most {largest}",
                    fixes=[*fixes, f"use --{flag} {largest} or less"],
                    stage=Stage.CONFIG,
                )


# ---------------------------------------------------------------------------------------------
# Pipelines
# ---------------------------------------------------------------------------------------------


def student_pipeline(student: torch.nn.Module, scheduler: Any, **components: Any) -> Any:
    """WanPipeline running the student alone (sample it with guidance_scale=1.0).

    `components` may add tokenizer, text_encoder and vae; without them pass prompt embeddings and
    ask for output_type="latent".
    """
    from diffusers import WanPipeline

    pipe = WanPipeline(
        tokenizer=components.get("tokenizer"),
        text_encoder=components.get("text_encoder"),
        vae=components.get("vae"),
        scheduler=scheduler,
        transformer=student,
        transformer_2=None,
        boundary_ratio=None,
    )
    pipe.set_progress_bar_config(disable=True)
    return pipe


def teacher_pipeline(
    high: torch.nn.Module, low: torch.nn.Module, boundary_ratio: float, scheduler: Any, **components: Any
) -> Any:
    """WanPipeline running both experts: `high` (transformer) while t >= boundary_ratio * 1000, `low` below."""
    from diffusers import WanPipeline

    pipe = WanPipeline(
        tokenizer=components.get("tokenizer"),
        text_encoder=components.get("text_encoder"),
        vae=components.get("vae"),
        scheduler=scheduler,
        transformer=high,
        transformer_2=low,
        boundary_ratio=boundary_ratio,
    )
    pipe.set_progress_bar_config(disable=True)
    return pipe


def compute_dtype(model: torch.nn.Module) -> torch.dtype:
    """The dtype a model computes in. Not its first parameter's: diffusers keeps some Wan modules
    (time embedder, norms, modulation tables) in float32 inside a bfloat16 model."""
    dtype = getattr(model, "dtype", None)
    return dtype if isinstance(dtype, torch.dtype) else next(model.parameters()).dtype


def initial_noise(latent_shape: Sequence[int], seed: int) -> torch.Tensor:
    """The starting noise (1, C, F, H, W) for `seed`, drawn on the CPU.

    Identical to what WanPipeline draws from `generator=torch.Generator("cpu").manual_seed(seed)`,
    so a sample made here can be reproduced with plain diffusers, on any device.
    """
    generator = torch.Generator("cpu").manual_seed(seed)
    return torch.randn((1, *latent_shape), generator=generator, dtype=torch.float32)


def sample_latents(
    pipe: Any,
    noise: torch.Tensor,
    prompt_embeds: torch.Tensor,
    negative_prompt_embeds: torch.Tensor | None,
    steps: int,
    guidance_scale: float,
    guidance_scale_2: float | None = None,
) -> torch.Tensor:
    """Run `pipe` from `noise` (1,C,F,H,W) to its final latent (C,F,H,W), float32 on the CPU.

    `prompt_embeds` is (1, L, D) or (L, D), zero-padded as WanPipeline pads prompts.
    """
    device = pipe._execution_device
    dtype = compute_dtype(pipe.transformer if pipe.transformer is not None else pipe.transformer_2)
    cond = prompt_embeds.reshape(1, *prompt_embeds.shape[-2:]).to(device, dtype)
    uncond = None
    if negative_prompt_embeds is not None and guidance_scale > 1.0:
        uncond = negative_prompt_embeds.reshape(1, *negative_prompt_embeds.shape[-2:]).to(device, dtype)
    _, _, frames, height, width = noise.shape
    scale = pipe.vae_scale_factor_spatial
    if pipe.config.boundary_ratio is None:
        guidance_scale_2 = None  # WanPipeline refuses a second scale for a single model
    latents = pipe(
        prompt_embeds=cond,
        negative_prompt_embeds=uncond,
        height=height * scale,
        width=width * scale,
        num_frames=(frames - 1) * pipe.vae_scale_factor_temporal + 1,
        num_inference_steps=steps,
        guidance_scale=guidance_scale,
        guidance_scale_2=guidance_scale_2,
        latents=noise.to(device),
        output_type="latent",
        max_sequence_length=cond.shape[1],
    ).frames
    return latents[0].float().cpu()


# ---------------------------------------------------------------------------------------------
# Decoding
# ---------------------------------------------------------------------------------------------


@torch.no_grad()
def decode_latents(latents: torch.Tensor, vae: Any) -> np.ndarray:
    """Frames (F, H, W, 3) in [0, 1] from one latent (C, F, h, w), exactly as WanPipeline decodes."""
    from diffusers.video_processor import VideoProcessor

    z = latents[None].to(vae.device, vae.dtype)
    mean = torch.tensor(vae.config.latents_mean).view(1, -1, 1, 1, 1).to(z)
    std = torch.tensor(vae.config.latents_std).view(1, -1, 1, 1, 1).to(z)
    video = vae.decode(z * std + mean, return_dict=False)[0]
    processor = VideoProcessor(vae_scale_factor=vae.config.scale_factor_spatial)
    return processor.postprocess_video(video, output_type="np")[0].astype(np.float32)


@contextlib.contextmanager
def teacher_vae(teacher_path: str | Path, device: torch.device) -> Iterator[Any]:
    """The teacher's VAE for the duration of a `with` block; freed afterwards."""
    vae = load_vae(teacher_path, device)
    try:
        yield vae
    finally:
        free(vae)


def decode_with_teacher_vae(
    latents: Sequence[torch.Tensor], teacher_path: str | Path, device: torch.device
) -> list[np.ndarray]:
    """Decode several latents with the teacher's VAE, loaded for this call only."""
    if not latents:
        return []
    with teacher_vae(teacher_path, device) as vae:
        return [decode_latents(z, vae) for z in latents]


# ---------------------------------------------------------------------------------------------
# Files
# ---------------------------------------------------------------------------------------------


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
    from distill.plots import plot_sample_grid

    return plot_sample_grid(rows, out_png, prompts=prompts, title=title)


def first_frames(files: Sequence[Path]) -> list[np.ndarray]:
    return [read_first_frame(p) for p in files]


# ---------------------------------------------------------------------------------------------
# A pipeline folder that borrows the teacher's components
# ---------------------------------------------------------------------------------------------


def write_pipeline_folder(
    output_dir: str | Path,
    teacher_path: str | Path,
    student_dir: str | Path,
    scheduler_config: Mapping[str, Any] | None = None,
) -> Path:
    """Write `<output_dir>/pipeline/` so `WanPipeline.from_pretrained(<output_dir>/pipeline)` loads the student.

    The folder holds a model_index.json (the teacher's, with `transformer_2` and `boundary_ratio`
    removed) and symbolic links: `transformer` -> the student folder (relative, so the run folder
    can be moved), and text_encoder / tokenizer / vae / scheduler -> the teacher's folders
    (absolute), so nothing of the teacher is copied. diffusers follows the links like folders.
    It stops working if the teacher folder moves; `distill.generate` keeps working then.
    `scheduler_config` (with `_class_name`), when given, is the student's own sampler: written into
    pipeline/scheduler/ instead of linking the teacher's.
    """
    output_dir, student_dir = Path(output_dir), Path(student_dir)
    teacher = Path(teacher_path).resolve()
    index = json.loads((teacher / "model_index.json").read_text())
    index["transformer_2"] = [None, None]
    index["boundary_ratio"] = None
    folder = output_dir / "pipeline"
    staging = output_dir / f".pipeline.{os.getpid()}.tmp"
    _remove(staging)
    staging.mkdir(parents=True)
    try:
        for name in SHARED_COMPONENTS:
            if name == "scheduler" and scheduler_config is not None:
                scheduler = scheduler_from_config(scheduler_config)
                scheduler.save_pretrained(staging / name)
                index[name] = ["diffusers", type(scheduler).__name__]
            else:
                os.symlink(teacher / name, staging / name, target_is_directory=True)
        # Relative to where the link will live once the folder is renamed into place.
        target = os.path.relpath(student_dir.resolve(), output_dir.resolve() / "pipeline")
        os.symlink(target, staging / "transformer", target_is_directory=True)
        (staging / "model_index.json").write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    except OSError as exc:
        _remove(staging)
        raise DistillError(
            f"cannot write {folder}",
            f"{type(exc).__name__}: {exc}",
            causes=["the file system does not support symbolic links"],
            fixes=["use python -m distill.generate, which needs no pipeline folder"],
            stage=Stage.CHECKPOINT,
        ) from None
    _remove(folder)
    os.replace(staging, folder)
    return folder


def _remove(path: Path) -> None:
    import shutil

    if path.is_symlink() or path.is_file():
        path.unlink()
    elif path.is_dir():
        shutil.rmtree(path)
