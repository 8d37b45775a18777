"""eval.json and eval.png: the per-prompt records of every rank summed up into the report (what each
number means and which way is better: `python -m distill.evaluate --help`), the flat scalars the
trackers log, and `evaluate_student`, the whole report in-process."""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np
import torch

from distill.models.flow_matching import NUM_TRAIN_TIMESTEPS
from distill.models.teacher import TeacherInfo
from distill.report.measures import EvalSettings, build_reference, compare_student, no_barrier

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


def _mean(values: Sequence[float]) -> float:
    return float(np.mean(values)) if len(values) else float("nan")


def _denoiser_summary(probes: list[list[float]], num_buckets: int, boundary: float | None) -> dict[str, Any]:
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
    if boundary is None:  # one transformer (TI2V-5B): one range, named as its folder is
        by_expert = {
            "transformer": {"t_range": [0.0, NUM_TRAIN_TIMESTEPS], "count": int(len(mse)), "mse": _mean(mse)}
        }
    else:
        high = t >= boundary
        by_expert = {
            "high_noise": {
                "t_range": [boundary, NUM_TRAIN_TIMESTEPS],
                "count": int(high.sum()),
                "mse": _mean(mse[high]),
            },
            "low_noise": {"t_range": [0.0, boundary], "count": int((~high).sum()), "mse": _mean(mse[~high])},
        }
    return {
        "mse": _mean(mse),
        "relative_mse": float(mse.sum() / max(power.sum(), 1e-12)),
        "count": int(len(mse)),
        "by_expert": by_expert,
        "buckets": buckets,
    }


def summarize(
    records: Sequence[dict[str, Any]],
    settings: EvalSettings,
    boundary_ratio: float | None,
    extra: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """The eval.json content from the per-prompt records of all ranks. `boundary_ratio` None: a
    teacher with one transformer (no expert switch: `boundary_timestep` null, one guidance)."""
    records = sorted(records, key=lambda r: r["index"])
    teacher_s = _mean([r["teacher_seconds"] for r in records])
    student_s = _mean([r["student_seconds"] for r in records])
    teacher_f = _mean([r["teacher_forwards"] for r in records])
    student_f = _mean([r["student_forwards"] for r in records])
    boundary = None if boundary_ratio is None else boundary_ratio * NUM_TRAIN_TIMESTEPS
    teacher_guidance = [settings.guidance_scale]
    if boundary is not None:
        teacher_guidance.append(settings.guidance_scale_2)
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
                    "guidance_scale": teacher_guidance,
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
        for name, part in denoiser["by_expert"].items():
            if name != "transformer":  # one transformer: its range is all of denoiser_mse
                metrics[f"denoiser_mse_{name}"] = part["mse"]
    return {prefix + k: float(v) for k, v in metrics.items()}


def write_report(result: Mapping[str, Any], output_dir: str | Path) -> list[Path]:
    """eval.json and eval.png in `output_dir`."""
    from distill.report.plots import plot_eval

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
    boundary_ratio: float | None,
    output_dir: str | Path,
    *,
    rank: int = 0,
    world_size: int = 1,
    barrier: Callable[[], None] = no_barrier,
    extra: Mapping[str, Any] | None = None,
    hand_in: bool = True,
) -> dict[str, Any] | None:
    """Every rank hands in its records through a file; rank 0 writes the report and returns it.

    Files rather than a collective: it works with any process group (or none) and the partial
    results survive for inspection if rank 0 fails. Other ranks return None. `hand_in` False: a rank
    whose records another rank hands in (one of a context group's, which computed the same ones)
    only waits at the barrier with the others; `rank` is then the number its records are handed in under.
    """
    output_dir = Path(output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    if hand_in:
        part = output_dir / f".eval_part_rank{rank}.json"
        tmp = part.with_name(part.name + ".tmp")
        tmp.write_text(json.dumps(records))
        os.replace(tmp, part)
    barrier()
    if rank != 0 or not hand_in:
        return None
    parts = [output_dir / f".eval_part_rank{r}.json" for r in range(world_size)]
    everything = [record for p in parts for record in json.loads(p.read_text())]
    result = summarize(everything, settings, boundary_ratio, extra)
    write_report(result, output_dir)
    for p in parts:
        p.unlink()
    return result


def evaluate_student(
    student: torch.nn.Module,
    high: torch.nn.Module,
    low: torch.nn.Module | None,
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
    barrier: Callable[[], None] = no_barrier,
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
