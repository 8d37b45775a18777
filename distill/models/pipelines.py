"""Generating images and videos with diffusers' WanPipeline (WanImageToVideoPipeline for an
image-to-video teacher): the student alone, or the teacher.

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
import copy
import json
import logging
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import torch

from distill.models.teacher import empty_device_cache
from distill.models.teacher_kind import I2V_A14B, T2V_A14B, TeacherKind
from distill.ops.errors import DistillError, Stage

logger = logging.getLogger(__name__)
# The image-to-video pipeline's module imports transformers' CLIP image processor, whose first use
# warns that torchvision is missing; the A14B models use no image encoder, so the warning (of
# transformers' import machinery, which says nothing else at run time) only misleads.
logging.getLogger("transformers.utils.import_utils").setLevel(logging.ERROR)


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

    Loads the text encoder, encodes as WanPipeline does (on the tokens the prompts need, zero-padded
    after: `encode_on_needed_tokens`), and frees it again.
    """
    from diffusers import WanPipeline

    tokenizer, encoder = load_text_components(teacher_path, device, dtype)
    pipe = WanPipeline(tokenizer=tokenizer, text_encoder=encoder, vae=None, scheduler=None)
    unique = list(dict.fromkeys(prompts))
    with torch.no_grad():
        embeds = encode_on_needed_tokens(pipe, unique, max_sequence_length, device, dtype=dtype)[0]
    result = {prompt: embed.cpu() for prompt, embed in zip(unique, embeds)}
    del pipe, tokenizer, encoder, embeds
    empty_device_cache()
    return result


def encode_on_needed_tokens(
    pipe: Any,
    prompts: Sequence[str],
    max_sequence_length: int,
    device: torch.device | str,
    negative: bool = False,
    dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`pipe.encode_prompt` of `prompts` (and of as many empty negative prompts when `negative`),
    zero-padded to `max_sequence_length` rows as WanPipeline pads them, but encoded on only as many
    tokens as the longest of them needs.

    Why: UMT5 masks the padding, so a prompt's rows do not depend on how far it is padded (the same
    up to float rounding, 1e-6 on the toy teacher), while the encoder's cost grows with the padded
    length: 64 toy prompts of 12 tokens took 5.5 s at 512 tokens and 0.01 s at 12."""
    from diffusers.pipelines.wan.pipeline_wan import prompt_clean

    texts = [*prompts, *([""] if negative else [])]
    tokens = pipe.tokenizer(
        [prompt_clean(text) for text in texts],
        add_special_tokens=True,
        truncation=True,
        max_length=max_sequence_length,
    ).input_ids
    needed = max((len(ids) for ids in tokens), default=1)
    embeds, negative_embeds = pipe.encode_prompt(
        prompt=list(prompts),
        negative_prompt=[""] * len(prompts) if negative else None,
        do_classifier_free_guidance=negative,
        max_sequence_length=needed,
        device=device,
        dtype=dtype,
    )

    def padded(rows: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.pad(rows, (0, 0, 0, max_sequence_length - rows.shape[1]))

    return padded(embeds), padded(negative_embeds) if negative else None


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


def stock_pipeline_class(kind: TeacherKind, image: bool | None = None) -> Any:
    """The diffusers pipeline class of `kind`, imported by name (only an image-to-video run imports
    its module). `image` picks the mode of a kind that has two (TI2V-5B: WanPipeline for text,
    WanImageToVideoPipeline for an image); None means the kind's own (the first it lists)."""
    import diffusers

    name = kind.pipeline_class
    if image is not None and len(kind.pipeline_classes) > 1:
        name = I2V_A14B.pipeline_class if image else T2V_A14B.pipeline_class
    return getattr(diffusers, name)


def _pipeline(
    kind: TeacherKind,
    image: bool | None,
    high: torch.nn.Module,
    low: torch.nn.Module | None,
    boundary_ratio: float | None,
    scheduler: Any,
    components: dict[str, Any],
) -> Any:
    """The stock pipeline of `kind` (in the mode `image` picks) on these transformers: with
    `expand_timesteps` for a kind that has a timestep per token, exactly as its folder loads.
    `components`: tokenizer, text_encoder, vae, and without a VAE `vae_scales` (spatial, temporal)."""
    pipeline_class = stock_pipeline_class(kind, image)
    if pipeline_class.__name__ == I2V_A14B.pipeline_class and components.get("vae") is None:
        raise ValueError("the image-to-video pipeline needs the teacher's VAE (vae=) to encode the image")
    extra = {"expand_timesteps": True} if kind.per_token_timesteps else {}
    pipe = pipeline_class(
        tokenizer=components.get("tokenizer"),
        text_encoder=components.get("text_encoder"),
        vae=components.get("vae"),
        scheduler=scheduler,
        transformer=high,
        transformer_2=low,
        boundary_ratio=boundary_ratio,
        **extra,
    )
    vae_scales = components.get("vae_scales")
    if components.get("vae") is None and vae_scales is not None:
        # Without a VAE the pipelines assume the Wan 2.1 VAE's 8x: a TI2V-5B latent (16x) drawn from
        # `height` and `width` would have the wrong size.
        pipe.vae_scale_factor_spatial, pipe.vae_scale_factor_temporal = vae_scales
    pipe.set_progress_bar_config(disable=True)
    return pipe


def student_pipeline(
    student: torch.nn.Module,
    scheduler: Any,
    kind: TeacherKind = T2V_A14B,
    image: bool | None = None,
    **components: Any,
) -> Any:
    """The stock pipeline of the teacher's `kind` running the student alone (sample it with
    guidance_scale=1.0): WanPipeline, or WanImageToVideoPipeline for an image-to-video teacher
    (which needs `vae=` to encode the image), exactly as its exported pipeline/ folder loads.
    `image` picks the mode of a kind that has two (TI2V-5B); None: the kind's own.

    `components` may add tokenizer, text_encoder and vae; without them pass prompt embeddings and
    ask for output_type="latent". A LoRA student (the teacher's experts with its adapters) samples
    as the teacher does, both experts switched at the boundary, with its adapters on.
    """

    from distill.models.lora import RoutedModel

    if isinstance(student, RoutedModel):
        high, low = student.sampling_experts()
        return teacher_pipeline(high, low, student.boundary_ratio, scheduler, kind, image=image, **components)
    return _pipeline(kind, image, student, None, None, scheduler, components)


def teacher_pipeline(
    high: torch.nn.Module,
    low: torch.nn.Module | None,
    boundary_ratio: float | None,
    scheduler: Any,
    kind: TeacherKind = T2V_A14B,
    image: bool | None = None,
    **components: Any,
) -> Any:
    """The stock pipeline of `kind` running the teacher: `high` (transformer) while
    t >= boundary_ratio * 1000, `low` below; a one-transformer teacher (TI2V-5B) passes `low` and
    `boundary_ratio` None. WanPipeline for text to video; WanImageToVideoPipeline for image to
    video, which needs `vae=` (it encodes the image) and has no image encoder (no Wan 2.2 model takes
    one). `image` picks the mode of a kind that has two (TI2V-5B); None: the kind's own."""
    return _pipeline(kind, image, high, low, boundary_ratio, scheduler, components)


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
    image: torch.Tensor | None = None,
) -> torch.Tensor:
    """Run `pipe` from `noise` (1,C,F,H,W) to its final latent (C,F,H,W), float32 on the CPU.

    `prompt_embeds` is (1, L, D) or (L, D), zero-padded as WanPipeline pads prompts. `image` (an
    image-to-video pipeline only) is the first frame, (3, H, W) or (1, 3, H, W) in [-1, 1], already
    resized and cropped to the sample's size as the pipeline's video processor does it.
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
    takes_image = type(pipe).__name__ == I2V_A14B.pipeline_class
    if takes_image != (image is not None):
        raise ValueError(f"{type(pipe).__name__} " + ("needs an image" if takes_image else "takes no image"))
    extra: dict[str, Any] = {}
    if image is not None:
        extra["image"] = image.reshape(1, *image.shape[-3:]).float()
    with preprocessed_images(pipe, image is not None):
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
            **extra,
        ).frames
    return latents[0].float().cpu()


@contextlib.contextmanager
def preprocessed_images(pipe: Any, active: bool) -> Iterator[None]:
    """Let `pipe` take an image that is already preprocessed, as it is.

    The stock video processor expects [0, 1] and maps it to [-1, 1] unless the image has a negative
    value: a preprocessed image of a bright scene (no value below 0) would be mapped twice. For the
    call, the pipeline's processor preprocesses with one that neither resizes nor normalises; it still
    postprocesses the decoded frames as stock (back to [0, 1]), which a processor that does not
    normalise would leave in [-1, 1].
    """
    if not active:
        yield
        return
    from diffusers.video_processor import VideoProcessor

    stock = pipe.video_processor
    as_given = VideoProcessor(
        vae_scale_factor=pipe.vae_scale_factor_spatial, do_resize=False, do_normalize=False
    )
    pipe.video_processor = copy.copy(stock)
    pipe.video_processor.preprocess = as_given.preprocess
    try:
        yield
    finally:
        pipe.video_processor = stock


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
        del vae  # the caller's `as` name goes when its function returns
        empty_device_cache()


def decode_with_teacher_vae(
    latents: Sequence[torch.Tensor], teacher_path: str | Path, device: torch.device
) -> list[np.ndarray]:
    """Decode several latents with the teacher's VAE, loaded for this call only."""
    if not latents:
        return []
    with teacher_vae(teacher_path, device) as vae:
        frames = [decode_latents(z, vae) for z in latents]
        del vae  # this name too: the VAE is freed as the block ends, before the device cache is emptied
    return frames
