"""One whole benchmark: warm-up, the trainer and bare steps timed in alternating blocks, the phase
pass, memory and FLOPs, gathered into the result the command prints and writes as JSON."""

from __future__ import annotations

import dataclasses
import math
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from distill.bench.bare import BareDmdLoop, BareLoop, TrainerSteps, synchronizer
from distill.bench.measures import (
    compare_teacher_placement,
    environment,
    flops_report,
    memory_report,
    model_summary,
)
from distill.bench.settings import BenchSettings
from distill.bench.setup import Setup, build_setup
from distill.bench.timing import interleaved, phase_pass, summary_ms
from distill.models.attention_backend import sdpa_choice


def run_bench(settings: BenchSettings) -> dict[str, Any]:
    """Build, warm up, time both loops interleaved, time the phases, and report."""
    if settings.workload != "distill":  # one model alone: no trainer to compare
        from distill.bench.model_step import run_model_step

        return run_model_step(settings)
    started = time.perf_counter()
    if settings.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit(f"preset {settings.preset} needs CUDA, and torch sees no GPU")
    with tempfile.TemporaryDirectory(prefix="distill-bench-") as tmp:
        setup = build_setup(settings, Path(tmp))
        sync = synchronizer(setup.device)
        blocks = math.ceil(settings.steps / settings.block)
        dmd = settings.method == "dmd"
        trainer = TrainerSteps(setup.loop, settings.critic_updates if dmd else 1)
        if dmd:
            bare: BareLoop | BareDmdLoop = BareDmdLoop(setup)
        else:
            bare = BareLoop(setup, settings.warmup + blocks * settings.block)
        for _ in range(settings.warmup):
            trainer.step()
            bare.step()
        sync()
        if setup.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(setup.device)
        trainer_times, bare_times = interleaved(trainer.step, bare.step, settings.steps, settings.block, sync)
        phases = phase_pass(trainer, settings.steps, sync, dmd)
        memory = memory_report(setup)
        placement = None
        if settings.teacher_on_cpu and setup.device.type == "cuda":
            placement = compare_teacher_placement(setup, max(3, settings.steps // 2), sync)
        result = report(setup, trainer_times, bare_times, phases, memory, placement, trainer.skipped)
    result["wall_s"] = time.perf_counter() - started
    return result


def loop_summary(times: list[float], batch: int) -> dict[str, float]:
    ms = summary_ms(times)
    return {
        "median_ms": ms["median"],
        "p10_ms": ms["p10"],
        "p90_ms": ms["p90"],
        "steps_per_s": 1e3 / ms["median"],
        "samples_per_s": batch * 1e3 / ms["median"],
    }


def report(
    setup: Setup,
    trainer_times: list[float],
    bare_times: list[float],
    phases: dict[str, list[float]],
    memory: dict[str, Any],
    placement: dict[str, Any] | None,
    skipped: int,
) -> dict[str, Any]:
    s = setup.settings
    trainer = loop_summary(trainer_times, s.batch_size)
    bare = loop_summary(bare_times, s.batch_size)
    env = environment(setup.device)
    tokens, dtype = setup.tokens_per_sample, torch.bfloat16 if s.dtype == "bfloat16" else torch.float32
    if setup.device.type == "cuda" and s.attention_backend in (None, "native"):
        # which kernel SDPA runs for the student, whose attention dominates at 81 frames
        config = setup.student_config
        env["sdpa_kernel"] = sdpa_choice(
            config["num_attention_heads"], tokens, config["attention_head_dim"], dtype, setup.device
        )
    return {
        "preset": s.preset,
        "workload": s.workload,
        "settings": dataclasses.asdict(s),
        "environment": env,
        "models": model_summary(setup),
        "steps": {
            "warmup": s.warmup,
            "block": s.block,
            "timed_trainer": len(trainer_times) * s.block,
            "timed_bare": len(bare_times) * s.block,
            "instrumented": len(phases["step"]),
            "skipped_by_trainer": skipped,
        },
        "trainer": trainer,
        "bare": bare,
        "overhead_ratio": trainer["median_ms"] / bare["median_ms"],
        "phases_ms": {name: summary_ms(values) for name, values in phases.items()},
        "memory": memory,
        "flops": flops_report(setup, trainer["median_ms"] / 1e3),
        "teacher_on_cpu": placement,
        "method": s.method,
        "train_steps_per_bench_step": s.critic_updates if s.method == "dmd" else 1,
    }
