"""The pipeline `generate` renders with: the teacher's stock pipeline with its shared components and
the student, a LoRA folder's adapters on the teacher, a LoRA run's merged experts in the teacher's
place, or the teacher alone (--teacher_only); and one render with it, seeded as generate seeds it.

    from distill.sample.render_pipeline import build_pipeline, render
"""

from __future__ import annotations

import argparse
import contextlib
import logging
from typing import Any

import torch

from distill.models.few_step import renoising_from
from distill.models.lora_files import is_lora_folder, lora_files
from distill.models.pipelines import (
    load_scheduler,
    load_text_components,
    load_vae,
    preprocessed_images,
    scheduler_from_config,
    student_pipeline,
    teacher_pipeline,
)
from distill.models.teacher import TeacherInfo
from distill.ops.errors import DistillError, Stage
from distill.sample.run_settings import RunSettings
from distill.sample.student_folder import is_merged_folder, load_merged_student, load_student

logger = logging.getLogger(__name__)


def build_pipeline(
    args: argparse.Namespace,
    info: TeacherInfo,
    device: torch.device,
    dtype: torch.dtype,
    run: RunSettings | None = None,
    image: bool | None = None,
) -> Any:
    """The teacher's stock pipeline with its shared components and the student (or the teacher's
    experts, or its one transformer). `image` picks the mode of a teacher with two (TI2V-5B: True
    for WanImageToVideoPipeline); None: the teacher's own.

    The student samples with its run's own scheduler when the run recorded one, else the teacher's.
    """
    from distill.models.teacher import load_experts

    lora = not args.teacher_only and is_lora_folder(args.student)
    merged = not args.teacher_only and is_merged_folder(args.student)
    if merged:  # first: a bad --student fails fast
        high, low = load_merged_student(args.student, info, device, dtype).sampling_experts()
    elif not args.teacher_only and not lora:
        student = load_student(args.student, info, device, dtype)
    tokenizer, text_encoder = load_text_components(info.path, device, dtype)
    shared = {"tokenizer": tokenizer, "text_encoder": text_encoder, "vae": load_vae(info.path, device)}
    if args.teacher_only or lora:
        high, low = (None if e is None else e.to(device) for e in load_experts(info, dtype))
        pipe = teacher_pipeline(
            high, low, info.boundary_ratio, load_scheduler(info.path), info.kind, image=image, **shared
        )
        if not lora:
            return pipe
        # A LoRA run: the teacher with its adapters, loaded as stock diffusers loads them (the folder
        # was checked whole before anything loaded: distill.models.lora_folder).
        folder = str(args.student)
        try:
            # one file per expert: high_noise_lora / low_noise_lora, or TI2V-5B's one lora.safetensors
            files = lora_files(("high",) if low is None else ("high", "low"))
            pipe.load_lora_weights(folder, weight_name=files["high"], adapter_name="fast")
            if low is not None:
                pipe.load_lora_weights(
                    folder, weight_name=files["low"], adapter_name="fast_2", load_into_transformer_2=True
                )
        except (ValueError, RuntimeError, KeyError, OSError) as exc:
            text = str(exc).strip().splitlines()
            raise DistillError(
                f"diffusers cannot load the LoRA adapters in {folder}",
                f"{type(exc).__name__}: {text[0] if text else ''}",
                causes=["a LoRA file written by another tool, in keys diffusers does not convert"],
                fixes=["pass the lora/ folder a LoRA run of train_distillation.py wrote"],
                stage=Stage.CONFIG,
            ) from None
    if run is not None and run.scheduler:
        scheduler = scheduler_from_config(run.scheduler)
        logger.info("the student samples with its run's %s (%s)", type(scheduler).__name__, run.method)
    else:
        scheduler = load_scheduler(info.path)
    if lora:
        pipe.scheduler = scheduler
        return pipe
    if merged:  # the merged experts where the teacher's were, switched at its boundary
        return teacher_pipeline(high, low, info.boundary_ratio, scheduler, info.kind, image=image, **shared)
    return student_pipeline(student, scheduler, info.kind, image=image, **shared)


def render(
    pipe: Any,
    args: argparse.Namespace,
    prompt: str,
    seed: int,
    output_type: str = "np",
    image: torch.Tensor | None = None,
) -> Any:
    """One sample with the resolved settings of `args`: frames (F, H, W, 3) in [0, 1], or the
    final latent with output_type="latent". `image` (an image-to-video pipeline) is the first
    frame, already preprocessed as the pipeline would (distill.sample.image_inputs)."""
    # None for a one-model student: WanPipeline refuses a second scale without a second expert.
    extra: dict[str, Any] = {"guidance_scale_2": args.guidance_2} if args.guidance_2 is not None else {}
    if image is not None:
        extra["image"] = image
    generator = torch.Generator("cpu").manual_seed(seed)
    # A few-step student's scheduler re-noises at every step; the stock pipeline would draw that from
    # the device's global RNG (it gives scheduler.step no generator). It draws from the start's CPU
    # stream instead, as distill.models.few_step.sample_few_step(..., seed) does: the same sample on
    # every device, and on the CPU the stock pipeline's after torch.manual_seed(seed).
    renoising = (
        renoising_from(pipe.scheduler, generator)
        if getattr(pipe.scheduler.config, "stochastic_sampling", False)
        else contextlib.nullcontext()
    )
    with preprocessed_images(pipe, image is not None), renoising:
        return pipe(
            prompt=prompt,
            negative_prompt=args.negative_prompt,
            height=args.height,
            width=args.width,
            num_frames=args.num_frames,
            num_inference_steps=args.steps,
            guidance_scale=args.guidance,
            generator=generator,
            output_type=output_type,
            max_sequence_length=args.max_sequence_length,
            **extra,
        ).frames[0]
