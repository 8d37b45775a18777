"""How close is the student to the teacher? A report in eval.json and eval.png.

    python -m distill.evaluate --student outputs/run1/student \
        --prompts data/sample_prompts.txt --output_dir outputs/run1/eval \
        [--teacher_path T --height H --width W --num_frames F --steps N --teacher_steps M --seed 0
         --num_buckets 10 --samples_per_bucket 1]

Every setting left out comes from the run that made the student (`run_settings.json` in or beside
the student folder): teacher, training resolution and frames, sample steps, the teacher's guidance
and negative prompt, max_sequence_length. A size the student or teacher cannot handle is refused
before anything loads.

The teacher is Wan 2.2 A14B as it is meant to be used: both experts, switched at
t = boundary_ratio * 1000, each with classifier-free guidance (4.0 / 3.0). The student runs alone
at guidance 1, with `--steps` steps (default: the run's). The teacher samples with `--teacher_steps`
(default: the same for a velocity student; for a few-step (dmd) student the teacher's steps of
its run, e.g. 40). A few-step student samples with its own K-step scheduler (recorded in
run_settings.json), and the teacher is then also sampled at K steps: the baseline a few-step
student has to beat. Prompt i always starts from the noise of seed `seed + i`.

What eval.json holds, and which way is better:

- `denoiser`: fidelity of the denoiser on the same inputs. x0 is the teacher's own sample for each
  prompt; for timesteps t spread evenly over [0, 1000] (`num_buckets` buckets, `samples_per_bucket`
  each) x_t = (1 - t/1000) x0 + (t/1000) noise. Each number is the mean squared error between the
  student's velocity and the guided teacher's velocity (the exact training target) at those x_t:
  `mse` over all of them, `relative_mse` = mse / mean(teacher velocity^2) (scale-free: 0 is perfect,
  1 is as far off as predicting zero), `by_expert.high_noise` (t >= boundary, where the teacher
  uses `transformer`) and `by_expert.low_noise` (t below, `transformer_2`), and `buckets`, one
  entry per timestep bucket. LOWER is better.
- `sampler`: fidelity of the whole sampler. Teacher and student sample from the same noise with
  the same scheduler and step count: `latent_mse` between their final latents (LOWER is better),
  `frame_mse` between the decoded frames in [0, 1] (LOWER is better) and `frame_psnr_db`
  = 10 log10(1 / frame_mse), averaged over prompts (HIGHER is better; capped at 100 dB when the
  frames are identical). Errors of every step add up here, so these move more slowly than the
  denoiser numbers. When the student has fewer steps than the teacher, `teacher_at_student_steps`
  holds the same three numbers for the teacher at the student's step count (same noise, its own
  scheduler and guidance) against itself at full steps.
- `cost`: per sample, for teacher and student: `seconds_per_sample` (the sampling loop only, after
  one warm-up run; the VAE decode is the same for both and left out) and `forwards_per_sample`
  (transformer calls: 2 per step for the teacher, conditional + unconditional, and 1 for the
  student), each with its own `steps`. `speedup_seconds` and `speedup_forwards` are teacher at full
  steps / student: HIGHER is better.
  Timings from the tiny CPU teacher say little about a GPU run; the forward counts hold anywhere.

`evaluate_student` is the same report in-process; during training `distill.monitor.SampleMonitor`
computes the teacher's side once (`build_reference`) and compares the student to it every
--eval_interval steps.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import math
import os
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from distill.config import finite_float
from distill.errors import DistillError, Stage, report
from distill.objective import NUM_TRAIN_TIMESTEPS, add_noise, per_sample_mse
from distill.run_settings import (
    RunSettings,
    fill_left_out_flags,
    find_run_settings,
    warn_without_run_settings,
)
from distill.sampling import (
    compute_dtype,
    decode_latents,
    initial_noise,
    load_scheduler,
    rank_share,
    sample_latents,
    student_pipeline,
    teacher_pipeline,
    teacher_vae,
)
from distill.teacher import GuidedTeacher, TeacherInfo, resolve_dtype

logger = logging.getLogger(__name__)

DEFAULT_MAX_SEQUENCE_LENGTH = 512  # WanPipeline's; only for students exported without run_settings.json

MAX_PSNR_DB = 100.0  # identical frames would give infinity, which JSON cannot hold

# Which way each number of eval.json improves; written into the file so it documents itself.
BETTER = {
    "denoiser.mse": "lower",
    "denoiser.relative_mse": "lower",
    "denoiser.by_expert.*.mse": "lower",
    "denoiser.buckets[].mse": "lower",
    "sampler.latent_mse": "lower",
    "sampler.frame_mse": "lower",
    "sampler.frame_psnr_db": "higher",
    "sampler.teacher_at_student_steps.latent_mse": "lower",
    "sampler.teacher_at_student_steps.frame_mse": "lower",
    "sampler.teacher_at_student_steps.frame_psnr_db": "higher",
    "cost.*.seconds_per_sample": "lower",
    "cost.*.forwards_per_sample": "lower",
    "cost.speedup_seconds": "higher",
    "cost.speedup_forwards": "higher",
}


def _noop() -> None:
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
    sampled by distill.few_step.sample_few_step; None = the teacher's scheduler in WanPipeline."""

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


# ---------------------------------------------------------------------------------------------
# Small helpers
# ---------------------------------------------------------------------------------------------


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)  # timings must include the queued GPU work


@contextlib.contextmanager
def count_forwards(*models: torch.nn.Module) -> Iterator[list[int]]:
    """Count the calls of `models` inside the block: `with count_forwards(m) as n: ...; n[0]`."""
    counter = [0]

    def hook(*_: Any) -> None:
        counter[0] += 1

    handles = [m.register_forward_pre_hook(hook) for m in models]
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


# ---------------------------------------------------------------------------------------------
# The teacher's side
# ---------------------------------------------------------------------------------------------


def build_reference(
    high: torch.nn.Module,
    low: torch.nn.Module,
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
) -> TeacherReference:
    """Sample this rank's prompts with the teacher (both experts, its guidance) and, with
    `with_probes`, its guided velocities at the denoiser probes.

    `conds` maps a global prompt index to its zero-padded embedding (L, D) (this rank's indices
    suffice); `negative` is the zero-padded negative-prompt embedding (L, D).
    """
    items = rank_share(num_prompts, rank, world_size)
    shape = info.latent_shape(settings.height, settings.width, settings.num_frames)
    pipe = teacher_pipeline(high, low, info.boundary_ratio, load_scheduler(info.path))
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
        )
        uncond = negative.to(device, torch.float32)
        targets = []
        for (index, _), x0 in zip(items, latents):
            x_t = probe_inputs(x0, timesteps, probe_seed(settings.seed, index))
            cond = _cond(conds, index).to(device, torch.float32)
            chunks = [
                teacher.velocity(x.to(device), t, cond.expand(len(t), -1, -1).contiguous(), uncond).cpu()
                for x, t in zip(x_t.split(settings.probe_batch), timesteps.split(settings.probe_batch))
            ]
            targets.append(torch.cat(chunks))
    return TeacherReference(items, latents, seconds, forwards, timesteps, targets, short)


# ---------------------------------------------------------------------------------------------
# The student's side
# ---------------------------------------------------------------------------------------------


@torch.no_grad()
def denoiser_errors(
    student: torch.nn.Module,
    x_t: torch.Tensor,
    timesteps: torch.Tensor,
    cond: torch.Tensor,
    targets: torch.Tensor,
    device: torch.device,
    batch: int,
) -> list[list[float]]:
    """[t, mse, mean(target^2)] for each probe: the student's velocity against the guided teacher's."""
    dtype = compute_dtype(student)
    rows = []
    for x, t, target in zip(x_t.split(batch), timesteps.split(batch), targets.split(batch)):
        prediction = student(
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
) -> list[dict[str, Any]]:
    """One record per prompt of this rank: sampler errors, cost and (with probes) denoiser errors.

    The student must be in eval mode; it samples with guidance 1 from the same noise as the teacher,
    with its own scheduler if `settings.student_scheduler` names one (a few-step student).
    """
    run = student_sampler(student, info, conds, settings)
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
    _add_frame_errors(records, info.path, device)
    return records


def student_sampler(
    student: torch.nn.Module,
    info: TeacherInfo,
    conds: Mapping[int, torch.Tensor],
    settings: EvalSettings,
) -> Callable[[int, int], torch.Tensor]:
    """`run(prompt index, steps) -> final latent (C, F, h, w)` of the student at guidance 1, from the
    teacher's starting noise: in WanPipeline with the teacher's scheduler, or, for a few-step student,
    with its own scheduler (the rollout it was trained on, re-noising from seed + index)."""
    from distill.few_step import sample_few_step
    from distill.sampling import scheduler_from_config

    shape = info.latent_shape(settings.height, settings.width, settings.num_frames)
    if settings.student_scheduler is None:
        pipe = student_pipeline(student, load_scheduler(info.path))

        def run(index: int, steps: int) -> torch.Tensor:
            noise = initial_noise(shape, settings.seed + index)
            return sample_latents(pipe, noise, _cond(conds, index), None, steps, 1.0)

        return run

    scheduler = scheduler_from_config(settings.student_scheduler)

    def run_few_step(index: int, steps: int) -> torch.Tensor:
        seed = settings.seed + index
        noise = initial_noise(shape, seed)
        latent = sample_few_step(student, scheduler, steps, _cond(conds, index), shape, seed, noise)
        return latent[0].cpu()

    return run_few_step


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


# ---------------------------------------------------------------------------------------------
# Summary and files
# ---------------------------------------------------------------------------------------------


def _mean(values: Sequence[float]) -> float:
    return float(np.mean(values)) if len(values) else float("nan")


def _denoiser_summary(probes: list[list[float]], num_buckets: int, boundary: float) -> dict[str, Any]:
    t = np.array([p[0] for p in probes])
    mse = np.array([p[1] for p in probes])
    power = np.array([p[2] for p in probes])
    width = NUM_TRAIN_TIMESTEPS / num_buckets
    bucket = np.minimum((t // width).astype(int), num_buckets - 1)
    buckets = []
    for b in range(num_buckets):
        rows = bucket == b
        buckets.append(
            {
                "t_min": b * width,
                "t_max": (b + 1) * width,
                "count": int(rows.sum()),
                "mse": _mean(mse[rows]),
                "relative_mse": float(mse[rows].sum() / max(power[rows].sum(), 1e-12))
                if rows.any()
                else None,
            }
        )
    high = t >= boundary
    return {
        "mse": _mean(mse),
        "relative_mse": float(mse.sum() / max(power.sum(), 1e-12)),
        "count": int(len(mse)),
        "by_expert": {
            "high_noise": {
                "t_range": [boundary, NUM_TRAIN_TIMESTEPS],
                "count": int(high.sum()),
                "mse": _mean(mse[high]),
            },
            "low_noise": {"t_range": [0.0, boundary], "count": int((~high).sum()), "mse": _mean(mse[~high])},
        },
        "buckets": buckets,
    }


def summarize(
    records: Sequence[dict[str, Any]],
    settings: EvalSettings,
    boundary_ratio: float,
    extra: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """The eval.json content from the per-prompt records of all ranks."""
    records = sorted(records, key=lambda r: r["index"])
    teacher_s = _mean([r["teacher_seconds"] for r in records])
    student_s = _mean([r["student_seconds"] for r in records])
    teacher_f = _mean([r["teacher_forwards"] for r in records])
    student_f = _mean([r["student_forwards"] for r in records])
    boundary = boundary_ratio * NUM_TRAIN_TIMESTEPS
    probes = [p for r in records for p in r["probes"]]
    result: dict[str, Any] = dict(extra or {})
    result.update(
        {
            "num_prompts": len(records),
            "boundary_timestep": boundary,
            "settings": asdict(settings),
            "denoiser": _denoiser_summary(probes, settings.num_buckets, boundary) if probes else None,
            "sampler": {
                "student_steps": settings.steps_of_student,
                "teacher_steps": settings.steps,
                "latent_mse": _mean([r["latent_mse"] for r in records]),
                "frame_mse": _mean([r["frame_mse"] for r in records]),
                "frame_psnr_db": _mean([r["frame_psnr_db"] for r in records]),
                "per_prompt": [
                    {k: r[k] for k in ("index", "prompt", "latent_mse", "frame_mse", "frame_psnr_db")}
                    for r in records
                ],
            },
            "cost": {
                "teacher": {
                    "seconds_per_sample": teacher_s,
                    "forwards_per_sample": teacher_f,
                    "steps": settings.steps,
                    "guidance_scale": [settings.guidance_scale, settings.guidance_scale_2],
                },
                "student": {
                    "seconds_per_sample": student_s,
                    "forwards_per_sample": student_f,
                    "steps": settings.steps_of_student,
                    "guidance_scale": [1.0],
                    "scheduler": (settings.student_scheduler or {}).get("_class_name", "the teacher's"),
                },
                "speedup_seconds": teacher_s / max(student_s, 1e-12),
                "speedup_forwards": teacher_f / max(student_f, 1e-12),
            },
            "better": BETTER,
        }
    )
    if records and "teacher_short_latent_mse" in records[0]:
        result["sampler"]["teacher_at_student_steps"] = {
            "steps": settings.teacher_short_steps,
            "latent_mse": _mean([r["teacher_short_latent_mse"] for r in records]),
            "frame_mse": _mean([r["teacher_short_frame_mse"] for r in records]),
            "frame_psnr_db": _mean([r["teacher_short_frame_psnr_db"] for r in records]),
        }
        result["cost"]["teacher_at_student_steps"] = {
            "seconds_per_sample": _mean([r["teacher_short_seconds"] for r in records]),
            "forwards_per_sample": _mean([r["teacher_short_forwards"] for r in records]),
            "steps": settings.teacher_short_steps,
            "guidance_scale": [settings.guidance_scale, settings.guidance_scale_2],
        }
    return result


def flat_metrics(result: Mapping[str, Any], prefix: str = "eval/") -> dict[str, float]:
    """The headline numbers of an eval.json dict as flat scalars (for metrics files and wandb)."""
    metrics = {
        "latent_mse": result["sampler"]["latent_mse"],
        "frame_mse": result["sampler"]["frame_mse"],
        "frame_psnr_db": result["sampler"]["frame_psnr_db"],
        "speedup_seconds": result["cost"]["speedup_seconds"],
        "speedup_forwards": result["cost"]["speedup_forwards"],
    }
    short = result["sampler"].get("teacher_at_student_steps")
    if short:  # the baseline a few-step student has to beat
        metrics["teacher_at_student_steps_latent_mse"] = short["latent_mse"]
        metrics["teacher_at_student_steps_frame_psnr_db"] = short["frame_psnr_db"]
    denoiser = result.get("denoiser")
    if denoiser:
        metrics["denoiser_mse"] = denoiser["mse"]
        metrics["denoiser_relative_mse"] = denoiser["relative_mse"]
        metrics["denoiser_mse_high_noise"] = denoiser["by_expert"]["high_noise"]["mse"]
        metrics["denoiser_mse_low_noise"] = denoiser["by_expert"]["low_noise"]["mse"]
    return {prefix + k: float(v) for k, v in metrics.items()}


def write_report(result: Mapping[str, Any], output_dir: str | Path) -> list[Path]:
    """eval.json and eval.png in `output_dir`."""
    from distill.plots import plot_eval

    output_dir = Path(output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    path = output_dir / "eval.json"
    tmp = path.with_name(f".eval.json.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(result, indent=2) + "\n")
    os.replace(tmp, path)
    files = [path]
    if result.get("denoiser"):
        files.append(plot_eval(dict(result), output_dir / "eval.png"))
    return files


def gather_and_write(
    records: list[dict[str, Any]],
    settings: EvalSettings,
    boundary_ratio: float,
    output_dir: str | Path,
    *,
    rank: int = 0,
    world_size: int = 1,
    barrier: Callable[[], None] = _noop,
    extra: Mapping[str, Any] | None = None,
) -> dict[str, Any] | None:
    """Every rank hands in its records through a file; rank 0 writes the report and returns it.

    Files rather than a collective: it works with any process group (or none) and the partial
    results survive for inspection if rank 0 fails. Other ranks return None.
    """
    output_dir = Path(output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    part = output_dir / f".eval_part_rank{rank}.json"
    tmp = part.with_name(part.name + ".tmp")
    tmp.write_text(json.dumps(records))
    os.replace(tmp, part)
    barrier()
    if rank != 0:
        return None
    parts = [output_dir / f".eval_part_rank{r}.json" for r in range(world_size)]
    everything = [record for p in parts for record in json.loads(p.read_text())]
    result = summarize(everything, settings, boundary_ratio, extra)
    write_report(result, output_dir)
    for p in parts:
        p.unlink()
    return result


# ---------------------------------------------------------------------------------------------
# In-process entry point
# ---------------------------------------------------------------------------------------------


def evaluate_student(
    student: torch.nn.Module,
    high: torch.nn.Module,
    low: torch.nn.Module,
    info: TeacherInfo,
    embeddings: Mapping[str, torch.Tensor],
    negative: torch.Tensor,
    prompts: Sequence[str],
    settings: EvalSettings,
    output_dir: str | Path,
    device: torch.device,
    *,
    rank: int = 0,
    world_size: int = 1,
    barrier: Callable[[], None] = _noop,
    extra: Mapping[str, Any] | None = None,
) -> dict[str, Any] | None:
    """The whole report in-process: teacher reference, student comparison, eval.json + eval.png.

    `embeddings` maps each prompt to its zero-padded embedding (L, D), `negative` is the padded
    negative-prompt embedding. The student is used as given (put it in eval mode, with EMA
    weights if wanted). Returns the eval.json dict on rank 0 and None elsewhere.
    """
    conds = {i: embeddings[p] for i, p in enumerate(prompts)}
    reference = build_reference(
        high, low, info, conds, negative, len(prompts), settings, device, rank=rank, world_size=world_size
    )
    records = compare_student(student, reference, info, conds, prompts, settings, device)
    return gather_and_write(
        records,
        settings,
        info.boundary_ratio,
        output_dir,
        rank=rank,
        world_size=world_size,
        barrier=barrier,
        extra=extra,
    )


# ---------------------------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m distill.evaluate",
        description="Compare a distilled student with the Wan 2.2 teacher: eval.json and eval.png.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--student", required=True, help="The exported student folder (OUTPUT/student).")
    parser.add_argument(
        "--teacher_path",
        help="The Wan 2.2 A14B teacher (diffusers folder or hub id); default: the one the student's run used.",
    )
    parser.add_argument(
        "--prompts", required=True, help="Prompt file (.txt, .jsonl or .csv), ideally held out."
    )
    parser.add_argument("--output_dir", required=True, help="Where eval.json and eval.png go.")
    defaults = EvalSettings()
    run = "default: the student's run_settings.json, else"
    parser.add_argument("--height", type=int, help=f"Pixels ({run} {defaults.height}).")
    parser.add_argument("--width", type=int, help=f"Pixels ({run} {defaults.width}).")
    parser.add_argument(
        "--num_frames", type=int, help=f"1 = image, 4k+1 = video ({run} {defaults.num_frames})."
    )
    parser.add_argument(
        "--steps", type=int, help=f"Student sampler steps ({run} {defaults.steps}; a dmd student's K)."
    )
    parser.add_argument(
        "--teacher_steps",
        type=int,
        help="Teacher sampler steps (default: --steps for a velocity student; for a few-step student "
        "the teacher steps of its run, also sampled at --steps for comparison).",
    )
    parser.add_argument("--seed", type=int, help=f"Prompt i uses seed + i ({run} {defaults.seed}).")
    parser.add_argument("--num_buckets", type=int, default=defaults.num_buckets)
    parser.add_argument("--samples_per_bucket", type=int, default=defaults.samples_per_bucket)
    parser.add_argument(
        "--guidance_scale",
        type=finite_float,
        help=f"Teacher, high-noise expert ({run} {defaults.guidance_scale}).",
    )
    parser.add_argument(
        "--guidance_scale_2",
        type=finite_float,
        help=f"Teacher, low-noise expert ({run} {defaults.guidance_scale_2}).",
    )
    parser.add_argument(
        "--batch_size", type=int, default=defaults.probe_batch, help="Noised inputs per forward (memory)."
    )
    parser.add_argument(
        "--negative_prompt", help="Teacher's negative prompt (default: the run's, else empty)."
    )
    parser.add_argument("--max_prompts", type=int, default=None, help="Use only the first N prompts.")
    parser.add_argument(
        "--max_sequence_length",
        type=int,
        help=f"Prompt padding length; keep the training value ({run} {DEFAULT_MAX_SEQUENCE_LENGTH}).",
    )
    from distill.toy.evaluation import EVAL_PROMPTS

    parser.add_argument(
        "--toy_prompts",
        type=int,
        default=EVAL_PROMPTS,
        help=f"Toy teacher only: world prompts scored, one sample each ({EVAL_PROMPTS} = all of them).",
    )
    parser.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N.")
    parser.add_argument(
        "--dtype",
        default="auto",
        choices=("auto", "float32", "float16", "bfloat16"),
        help="Model dtype for teacher and student; auto = bfloat16 on CUDA, float32 on CPU.",
    )
    return parser


def resolve_defaults(args: argparse.Namespace) -> tuple[RunSettings, Path] | None:
    """Fill every setting left out (None) from the student's run_settings.json (else the built-in
    defaults); returns what was found."""
    found = find_run_settings(args.student)
    fallback = EvalSettings()
    if found is None:
        warn_without_run_settings(
            args.student, fallback.height, fallback.width, fallback.steps, DEFAULT_MAX_SEQUENCE_LENGTH
        )
    run = found[0] if found else None
    defaults = {
        "teacher_path": run.teacher_path if run else None,
        "height": run.height if run else fallback.height,
        "width": run.width if run else fallback.width,
        "num_frames": run.num_frames if run else fallback.num_frames,
        "steps": run.num_inference_steps if run else fallback.steps,
        "seed": run.sample_seed if run else fallback.seed,
        "guidance_scale": run.teacher_guidance_scale if run else fallback.guidance_scale,
        "guidance_scale_2": run.teacher_guidance_scale_2 if run else fallback.guidance_scale_2,
        "negative_prompt": run.negative_prompt if run else "",
        "max_sequence_length": run.max_sequence_length if run else DEFAULT_MAX_SEQUENCE_LENGTH,
    }
    fill_left_out_flags(args, defaults, found[1] if found else None)
    # A few-step student samples with its own scheduler; its teacher at the run's full step count.
    args.student_scheduler = run.scheduler if run else None
    if args.teacher_steps is None:
        args.teacher_steps = run.teacher_sample_steps if run and run.scheduler else args.steps
    return found


def run_cli(args: argparse.Namespace) -> dict[str, Any]:
    from distill.data import read_prompts
    from distill.generate import (
        load_student,
        pick_device,
        require_student_folder,
        student_limits,
        teacher_limits,
        trained_size_fix,
    )
    from distill.output_dir import writable_folder
    from distill.sampling import check_sample_size, encode_prompts
    from distill.teacher import inspect_teacher, load_expert

    student_dir = require_student_folder(args.student, teacher_only=False)
    writable_folder(args.output_dir, "--output_dir", create=False)  # before anything loads or samples
    found = resolve_defaults(args)
    for name in (
        "steps",
        "teacher_steps",
        "max_sequence_length",
        "num_buckets",
        "samples_per_bucket",
        "batch_size",
    ):
        if getattr(args, name) <= 0:
            raise DistillError(
                f"--{name} must be a positive integer, got {getattr(args, name)}",
                fixes=[f"use --{name} 1 or more"],
                stage=Stage.CONFIG,
            )
    info = inspect_teacher(args.teacher_path)
    check_sample_size(
        args.height,
        args.width,
        args.num_frames,
        info.vae_scale_spatial,
        info.vae_scale_temporal,
        [student_limits(student_dir), teacher_limits(info)],
        fixes=trained_size_fix(found),
    )
    logger.info(
        "evaluating at %dx%d, %d frame(s), student %d steps (%s), teacher %d steps, teacher guidance %s / %s, "
        "max_sequence_length %d (%s)",
        args.height,
        args.width,
        args.num_frames,
        args.steps,
        (args.student_scheduler or {}).get("_class_name", "the teacher's scheduler"),
        args.teacher_steps,
        args.guidance_scale,
        args.guidance_scale_2,
        args.max_sequence_length,
        f"defaults from {found[1]}; flags override" if found else "flags and built-in defaults",
    )
    prompts = read_prompts(args.prompts, "--prompts")[: args.max_prompts]
    device = pick_device(args.device)
    dtype = resolve_dtype(args.dtype, device)
    student = load_student(student_dir, info, device, dtype)
    embeddings = encode_prompts(
        info.path, [*prompts, args.negative_prompt], args.max_sequence_length, device, dtype
    )
    high = load_expert(info, "transformer", dtype).to(device)
    low = load_expert(info, "transformer_2", dtype).to(device)
    settings = EvalSettings(
        height=args.height,
        width=args.width,
        num_frames=args.num_frames,
        steps=args.teacher_steps,
        seed=args.seed,
        num_buckets=args.num_buckets,
        samples_per_bucket=args.samples_per_bucket,
        guidance_scale=args.guidance_scale,
        guidance_scale_2=args.guidance_scale_2,
        probe_batch=args.batch_size,
        student_steps=args.steps,
        student_scheduler=args.student_scheduler,
    )
    extra = {
        "student": str(student_dir.resolve()),
        "teacher": str(info.path),
        "prompts": str(args.prompts),
        "step": None,
    }
    result = evaluate_student(
        student,
        high,
        low,
        info,
        embeddings,
        embeddings[args.negative_prompt],
        prompts,
        settings,
        args.output_dir,
        device,
        extra=extra,
    )
    # A teacher trained on the toy world (toy_world.json) can also be scored by what its pictures show.
    from distill.toy.evaluation import add_toy_report

    return add_toy_report(
        result, info.path, student, high, low, settings, args.output_dir, count=args.toy_prompts
    )


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        result = run_cli(args)
    except DistillError as error:
        return report(error)
    denoiser, sampler, cost = result["denoiser"], result["sampler"], result["cost"]
    short = sampler.get("teacher_at_student_steps")
    if short:
        print(
            f"student at {sampler['student_steps']} steps: latent MSE {sampler['latent_mse']:.4g} to the teacher "
            f"at {sampler['teacher_steps']}; the teacher itself at {short['steps']} steps: {short['latent_mse']:.4g}"
        )
    print(
        f"denoiser MSE {denoiser['mse']:.4g} (high-noise {denoiser['by_expert']['high_noise']['mse']:.4g}, "
        f"low-noise {denoiser['by_expert']['low_noise']['mse']:.4g}); sampler latent MSE "
        f"{sampler['latent_mse']:.4g}, frame PSNR {sampler['frame_psnr_db']:.2f} dB; speed-up "
        f"{cost['speedup_seconds']:.2f}x time, {cost['speedup_forwards']:.1f}x forwards\n"
        f"wrote {Path(args.output_dir) / 'eval.json'} and eval.png"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
