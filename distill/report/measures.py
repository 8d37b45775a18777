"""What the report measures, on the same inputs for teacher and student: the denoiser's error at
probe timesteps (x_t built from the teacher's own samples), the whole sampler's error from the same
noise, and the cost of each (seconds and transformer forwards per sample). The teacher's side is
computed once (`build_reference`) and reused for every student compared against it."""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from distill.models.conditioning import Condition, conditioned, image_condition
from distill.models.flow_matching import NUM_TRAIN_TIMESTEPS, add_noise, per_sample_mse
from distill.models.guided_teacher import GuidedTeacher
from distill.models.pipelines import (
    compute_dtype,
    decode_latents,
    initial_noise,
    load_scheduler,
    sample_latents,
    student_pipeline,
    teacher_pipeline,
    teacher_vae,
)
from distill.models.teacher import TeacherInfo
from distill.models.teacher_kind import T2V_A14B, TeacherKind
from distill.sample.media import rank_share

DEFAULT_MAX_SEQUENCE_LENGTH = 512  # WanPipeline's; only for students exported without run_settings.json


MAX_PSNR_DB = 100.0  # identical frames would give infinity, which JSON cannot hold


def no_barrier() -> None:
    return None


@dataclass
class EvalSettings:
    """What the report samples and probes."""

    height: int = 480
    """Height in pixels of the samples (the training resolution)."""
    width: int = 832
    """Width in pixels."""
    num_frames: int = 1
    """Frames per sample: 1 = image, 4k+1 = video."""
    steps: int = 30
    """Teacher sampler steps (and the student's, unless student_steps is set)."""
    seed: int = 0
    """Prompt i starts from the noise of seed `seed + i` (for both models)."""
    num_buckets: int = 10
    """Timestep buckets over [0, 1000] for the denoiser comparison."""
    samples_per_bucket: int = 1
    """Noised inputs per bucket and prompt (evenly spaced inside the bucket)."""
    guidance_scale: float = 4.0
    """Teacher guidance of the high-noise expert."""
    guidance_scale_2: float = 3.0
    """Teacher guidance of the low-noise expert."""
    probe_batch: int = 1
    """Noised inputs per model forward in the denoiser comparison; the training batch size fits."""
    student_steps: int | None = None
    """Student sampler steps; None = `steps`. Fewer than `steps` also samples the teacher at these."""
    student_scheduler: dict[str, Any] | None = None
    """The student's own scheduler config (with `_class_name`), e.g. a dmd student's K-step one,
    sampled by distill.models.few_step.sample_few_step; None = the teacher's scheduler in WanPipeline."""

    @property
    def steps_of_student(self) -> int:
        return self.student_steps if self.student_steps is not None else self.steps

    @property
    def teacher_short_steps(self) -> int | None:
        """The teacher's second, shorter run (the student's step count), if the student has fewer steps."""
        return self.steps_of_student if self.steps_of_student < self.steps else None


@dataclass
class TeacherReference:
    """The teacher's side of the report for this rank's prompts: computed once, compared many times."""

    items: list[tuple[int, bool]]
    """(global prompt index, keep) as given by `rank_share`; keep=False entries only keep ranks in step."""
    latents: list[torch.Tensor]
    """The teacher's final latent (C, F, h, w) for each item, on the CPU; also x0 of the denoiser probes."""
    seconds: list[float]
    """Sampling time per item (the sampling loop only)."""
    forwards: list[int]
    """Expert forwards per item."""
    timesteps: torch.Tensor
    """Probe timesteps (K,), the same for every prompt."""
    targets: list[torch.Tensor] | None
    """Guided teacher velocity (K, C, F, h, w) at each probe, per item; None without probes."""
    short: tuple[list[torch.Tensor], list[float], list[int]] | None = None
    """(latents, seconds, forwards) of the teacher at the student's fewer steps; None if not fewer."""


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)  # timings must include the queued GPU work


@contextlib.contextmanager
def count_forwards(*models: torch.nn.Module) -> Iterator[list[int]]:
    """Count the calls of `models` inside the block: `with count_forwards(m) as n: ...; n[0]`."""
    counter = [0]

    def hook(*_: Any) -> None:
        counter[0] += 1

    # None: the missing second expert of a one-transformer teacher (TI2V-5B)
    handles = [m.register_forward_pre_hook(hook) for m in models if m is not None]
    try:
        yield counter
    finally:
        for handle in handles:
            handle.remove()


def probe_timesteps(num_buckets: int, per_bucket: int) -> torch.Tensor:
    """`per_bucket` evenly spaced timesteps inside each of `num_buckets` equal buckets of [0, 1000]."""
    width = NUM_TRAIN_TIMESTEPS / num_buckets
    values = [
        b * width + (k + 0.5) * width / per_bucket for b in range(num_buckets) for k in range(per_bucket)
    ]
    return torch.tensor(values, dtype=torch.float32)


def probe_inputs(x0: torch.Tensor, timesteps: torch.Tensor, seed: int) -> torch.Tensor:
    """x_t (K, C, F, h, w) for each probe timestep, from x0 and noise drawn from `seed` (CPU)."""
    generator = torch.Generator("cpu").manual_seed(seed)
    noise = torch.randn((len(timesteps), *x0.shape), generator=generator, dtype=torch.float32)
    return add_noise(x0.float().expand_as(noise), noise, timesteps / NUM_TRAIN_TIMESTEPS)


def probe_seed(seed: int, index: int) -> int:
    """Probe noise for prompt `index`: independent of the sampling noise and of the rank split."""
    return (seed + 1) * 1_000_003 + index


def psnr_db(mse: float) -> float:
    return MAX_PSNR_DB if mse <= 10 ** (-MAX_PSNR_DB / 10) else 10.0 * math.log10(1.0 / mse)


def _cond(conds: Mapping[int, torch.Tensor], index: int) -> torch.Tensor:
    return conds[index].reshape(1, *conds[index].shape[-2:])


Images = Mapping[int, torch.Tensor]
"""Image to video: each prompt index's first frame, (1, 3, H, W) in [-1, 1] at the sample's size
(preprocessed as WanImageToVideoPipeline does: distill.data.images.ImagePreprocessor)."""


@contextlib.contextmanager
def image_vae(info: TeacherInfo, images: Images | None, device: torch.device) -> Iterator[Any]:
    """The teacher's VAE while prompts bring images (the image-to-video pipelines encode each one
    and the probes need its condition), else None: a text-to-video report loads nothing more."""
    if images is None:
        yield None
        return
    with teacher_vae(info.path, device) as vae:
        yield vae


def _image(images: Images | None, index: int) -> torch.Tensor | None:
    return None if images is None else images[index]


def _condition(
    vae: Any,
    images: Images | None,
    index: int,
    settings: EvalSettings,
    device: torch.device,
    kind: TeacherKind,
) -> Condition | None:
    """What prompt `index`'s image adds to every forward for the teacher's `kind`
    (models/conditioning.py), or None (text to video)."""
    if images is None:
        return None
    return image_condition(vae, images[index], settings.num_frames, device=device, kind=kind)


def build_reference(
    high: torch.nn.Module,
    low: torch.nn.Module | None,
    info: TeacherInfo,
    conds: Mapping[int, torch.Tensor],
    negative: torch.Tensor,
    num_prompts: int,
    settings: EvalSettings,
    device: torch.device,
    *,
    rank: int = 0,
    world_size: int = 1,
    with_probes: bool = True,
    images: Images | None = None,
) -> TeacherReference:
    """Sample this rank's prompts with the teacher (both experts, or its one transformer, with its
    guidance) and, with
    `with_probes`, its guided velocities at the denoiser probes.

    `conds` maps a global prompt index to its zero-padded embedding (L, D) (this rank's indices
    suffice); `negative` is the zero-padded negative-prompt embedding (L, D). `images` (an
    image-to-video teacher, or TI2V-5B in image mode) maps each index to its first frame; None is
    text to video.
    """
    with image_vae(info, images, device) as vae:
        return _build_reference(
            high,
            low,
            info,
            conds,
            negative,
            num_prompts,
            settings,
            device,
            rank,
            world_size,
            with_probes,
            images,
            vae,
        )


def _build_reference(
    high: torch.nn.Module,
    low: torch.nn.Module | None,
    info: TeacherInfo,
    conds: Mapping[int, torch.Tensor],
    negative: torch.Tensor,
    num_prompts: int,
    settings: EvalSettings,
    device: torch.device,
    rank: int,
    world_size: int,
    with_probes: bool,
    images: Images | None,
    vae: Any,
) -> TeacherReference:
    items = rank_share(num_prompts, rank, world_size)
    shape = info.latent_shape(settings.height, settings.width, settings.num_frames)
    kind = kind_of(info)
    pipe = teacher_pipeline(
        high, low, info.boundary_ratio, load_scheduler(info.path), kind, image=images is not None, vae=vae
    )
    negative = negative.reshape(1, *negative.shape[-2:])

    def run(index: int, steps: int) -> torch.Tensor:
        return sample_latents(
            pipe,
            initial_noise(shape, settings.seed + index),
            _cond(conds, index),
            negative,
            steps,
            settings.guidance_scale,
            settings.guidance_scale_2,
            image=_image(images, index),
        )

    def timed(steps: int) -> tuple[list[torch.Tensor], list[float], list[int]]:
        latents, seconds, forwards = [], [], []
        for index, _ in items:
            _sync(device)
            start = time.perf_counter()
            with count_forwards(high, low) as calls:
                latents.append(run(index, steps))
            _sync(device)
            seconds.append(time.perf_counter() - start)
            forwards.append(calls[0])
        return latents, seconds, forwards

    run(items[0][0], 2)  # warm-up: the first call pays one-off costs (allocator, kernels)
    latents, seconds, forwards = timed(settings.steps)
    short = timed(settings.teacher_short_steps) if settings.teacher_short_steps else None

    timesteps = probe_timesteps(settings.num_buckets, settings.samples_per_bucket)
    targets = None
    if with_probes:
        teacher = GuidedTeacher(
            high,
            low,
            info.boundary_ratio,
            settings.guidance_scale,
            settings.guidance_scale_2,
            device,
            compute_dtype(high),
            kind=kind,
        )
        uncond = negative.to(device, torch.float32)
        targets = []
        for (index, _), x0 in zip(items, latents):
            x_t = probe_inputs(x0, timesteps, probe_seed(settings.seed, index))
            cond = _cond(conds, index).to(device, torch.float32)
            condition = _condition(vae, images, index, settings, device, kind)
            chunks = [
                teacher.velocity(
                    x.to(device),
                    t,
                    cond.expand(len(t), -1, -1).contiguous(),
                    uncond,
                    condition=condition.repeat(len(t)) if condition is not None else None,
                ).cpu()
                for x, t in zip(x_t.split(settings.probe_batch), timesteps.split(settings.probe_batch))
            ]
            targets.append(torch.cat(chunks))
    return TeacherReference(items, latents, seconds, forwards, timesteps, targets, short)


@torch.no_grad()
def denoiser_errors(
    student: torch.nn.Module,
    x_t: torch.Tensor,
    timesteps: torch.Tensor,
    cond: torch.Tensor,
    targets: torch.Tensor,
    device: torch.device,
    batch: int,
    condition: Condition | None = None,
    kind: TeacherKind = T2V_A14B,
) -> list[list[float]]:
    """[t, mse, mean(target^2)] for each probe: the student's velocity against the guided teacher's.
    `condition` (one row: the prompt's image, for an image-to-video teacher) enters every forward."""
    dtype = compute_dtype(student)
    rows = []
    for x, t, target in zip(x_t.split(batch), timesteps.split(batch), targets.split(batch)):
        model = conditioned(student, kind, condition.repeat(len(t)) if condition is not None else None)
        prediction = model(
            hidden_states=x.to(device, dtype),
            timestep=t.to(device),
            encoder_hidden_states=cond.to(device, dtype).expand(len(t), -1, -1),
            return_dict=False,
        )[0]
        mse = per_sample_mse(prediction, target.to(device)).cpu()
        power = target.float().pow(2).flatten(1).mean(1)
        rows += [[float(a), float(b), float(c)] for a, b, c in zip(t, mse, power)]
    return rows


def compare_student(
    student: torch.nn.Module,
    reference: TeacherReference,
    info: TeacherInfo,
    conds: Mapping[int, torch.Tensor],
    prompts: Sequence[str],
    settings: EvalSettings,
    device: torch.device,
    images: Images | None = None,
) -> list[dict[str, Any]]:
    """One record per prompt of this rank: sampler errors, cost and (with probes) denoiser errors.

    The student must be in eval mode; it samples with guidance 1 from the same noise as the teacher,
    with its own scheduler if `settings.student_scheduler` names one (a few-step student), and
    from each prompt's image when `images` are given (as `build_reference` got them).
    """
    with image_vae(info, images, device) as vae:
        records = _compare_student(student, reference, info, conds, prompts, settings, device, images, vae)
    _add_frame_errors(records, info.path, device)
    return records


def _compare_student(
    student: torch.nn.Module,
    reference: TeacherReference,
    info: TeacherInfo,
    conds: Mapping[int, torch.Tensor],
    prompts: Sequence[str],
    settings: EvalSettings,
    device: torch.device,
    images: Images | None,
    vae: Any,
) -> list[dict[str, Any]]:
    run = student_sampler(student, info, conds, settings, images, vae)
    run(reference.items[0][0], min(2, settings.steps_of_student))  # warm-up, as for the teacher
    records = []
    for position, (index, keep) in enumerate(reference.items):
        _sync(device)
        start = time.perf_counter()
        with count_forwards(student) as calls:
            latent = run(index, settings.steps_of_student)
        _sync(device)
        seconds = time.perf_counter() - start
        probes = []
        if reference.targets is not None:
            x_t = probe_inputs(
                reference.latents[position], reference.timesteps, probe_seed(settings.seed, index)
            )
            probes = denoiser_errors(
                student,
                x_t,
                reference.timesteps,
                _cond(conds, index),
                reference.targets[position],
                device,
                settings.probe_batch,
                _condition(vae, images, index, settings, device, kind_of(info)),
                kind_of(info),
            )
        if not keep:
            continue
        teacher_latent = reference.latents[position]
        record = {
            "index": index,
            "prompt": prompts[index],
            "latent_mse": float((latent - teacher_latent).pow(2).mean()),
            "teacher_seconds": reference.seconds[position],
            "teacher_forwards": reference.forwards[position],
            "student_seconds": seconds,
            "student_forwards": calls[0],
            "probes": probes,
            "_latents": (teacher_latent, latent),
        }
        if reference.short is not None:
            short_latent = reference.short[0][position]
            record.update(
                {
                    "teacher_short_latent_mse": float((short_latent - teacher_latent).pow(2).mean()),
                    "teacher_short_seconds": reference.short[1][position],
                    "teacher_short_forwards": reference.short[2][position],
                    "_short_latent": short_latent,
                }
            )
        records.append(record)
    return records


def student_sampler(
    student: torch.nn.Module,
    info: TeacherInfo,
    conds: Mapping[int, torch.Tensor],
    settings: EvalSettings,
    images: Images | None = None,
    vae: Any = None,
) -> Callable[[int, int], torch.Tensor]:
    """`run(prompt index, steps) -> final latent (C, F, h, w)` of the student at guidance 1, from the
    teacher's starting noise: in WanPipeline (WanImageToVideoPipeline from the prompt's image, with
    `vae`) with the teacher's scheduler, or, for a few-step student, with its own scheduler (the
    rollout it was trained on, re-noising from seed + index; a causal student streams it chunk by
    chunk)."""
    from distill.models.causal.streaming import few_step_sampler
    from distill.models.pipelines import scheduler_from_config

    shape = info.latent_shape(settings.height, settings.width, settings.num_frames)
    kind = kind_of(info)
    if settings.student_scheduler is None:
        pipe = student_pipeline(student, load_scheduler(info.path), kind, image=images is not None, vae=vae)

        def run(index: int, steps: int) -> torch.Tensor:
            noise = initial_noise(shape, settings.seed + index)
            image = _image(images, index)
            return sample_latents(pipe, noise, _cond(conds, index), None, steps, 1.0, image=image)

        return run

    scheduler = scheduler_from_config(settings.student_scheduler)
    sample = few_step_sampler(student)  # a causal student streams

    def run_few_step(index: int, steps: int) -> torch.Tensor:
        seed = settings.seed + index
        noise = initial_noise(shape, seed)
        condition = _condition(vae, images, index, settings, noise.device, kind)
        latent = sample(
            student, scheduler, steps, _cond(conds, index), shape, seed, noise, condition=condition, kind=kind
        )
        return latent[0].cpu()

    return run_few_step


def kind_of(info: TeacherInfo) -> TeacherKind:
    """The teacher's kind (text to video for an info made without one)."""
    return getattr(info, "kind", T2V_A14B)


def _add_frame_errors(records: list[dict[str, Any]], teacher_path: Path, device: torch.device) -> None:
    """Decode both final latents of each record with the teacher's VAE (loaded for this only)."""
    if not records:
        return
    with teacher_vae(teacher_path, device) as vae:
        for record in records:
            teacher_latent, student_latent = record.pop("_latents")
            a, b = decode_latents(teacher_latent, vae), decode_latents(student_latent, vae)
            record["frame_mse"] = float(np.mean((a - b) ** 2))
            record["frame_psnr_db"] = psnr_db(record["frame_mse"])
            if "_short_latent" in record:
                c = decode_latents(record.pop("_short_latent"), vae)
                record["teacher_short_frame_mse"] = float(np.mean((a - c) ** 2))
                record["teacher_short_frame_psnr_db"] = psnr_db(record["teacher_short_frame_mse"])
