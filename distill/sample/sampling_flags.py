"""The sampling settings a render uses (`distill.generate`, and the student that continues its clips,
distill/sample/chain.py): every flag left out filled from the student's run (run_settings.json in or
beside its folder), else built-in defaults; the counts checked; one line that says where they came from.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from distill.config.flag_rules import check_dependents, second_expert_guidance
from distill.models.teacher import TeacherInfo
from distill.ops.errors import DistillError, Stage
from distill.sample.run_settings import (
    RunSettings,
    fill_left_out_flags,
    find_run_settings,
    warn_without_run_settings,
)
from distill.sample.student_folder import FALLBACK, TEACHER_GUIDANCE


def describe(args: argparse.Namespace, who: str, source: str) -> str:
    """One line naming the settings a render uses and where they came from."""
    frames = "1 frame" if args.num_frames == 1 else f"{args.num_frames} frames"
    return (
        f"{who}: {args.height}x{args.width}, {frames}, {args.steps} steps, guidance {args.guidance}"
        f"{f' / {args.guidance_2}' if args.guidance_2 is not None else ''}, "
        f"max_sequence_length {args.max_sequence_length} ({source})"
    )


def resolve_defaults(args: argparse.Namespace) -> tuple[RunSettings, Path] | None:
    """Fill every sampling flag left out (None) from the student's run_settings.json; returns it.

    With --teacher_only and a --student, the teacher renders at the student's training size (for
    comparison) with the teacher's guidance of that run.
    """
    found = find_run_settings(args.student) if args.student else None
    run = found[0] if found else None
    if run is not None:
        defaults: dict[str, Any] = {
            "teacher_path": run.teacher_path,
            "height": run.height,
            "width": run.width,
            "num_frames": run.num_frames,
            "steps": FALLBACK["steps"] if args.teacher_only else run.num_inference_steps,
            "guidance": run.teacher_guidance_scale if args.teacher_only else run.guidance_scale,
            # A student samples with --guidance alone (a LoRA student's experts both take it).
            "guidance_2": run.teacher_guidance_scale_2 if args.teacher_only else None,
            "negative_prompt": run.negative_prompt,
            "max_sequence_length": run.max_sequence_length,
        }
    else:
        defaults = {
            **FALLBACK,
            "guidance": TEACHER_GUIDANCE[0] if args.teacher_only else 1.0,
            "guidance_2": TEACHER_GUIDANCE[1] if args.teacher_only else None,
            "negative_prompt": "",
        }
        if args.student and not args.teacher_only:
            warn_without_run_settings(
                args.student, *(FALLBACK[k] for k in ("height", "width", "steps", "max_sequence_length"))
            )
    fill_left_out_flags(args, defaults, found[1] if found else None)
    return found


def check_counts(args: argparse.Namespace) -> None:
    for name in ("steps", "max_sequence_length"):
        if getattr(args, name) <= 0:
            raise DistillError(
                f"--{name} must be a positive integer, got {getattr(args, name)}",
                fixes=[f"use --{name} 1 or more (or leave it out: the run's value is the default)"],
                stage=Stage.CONFIG,
            )
    # Before the output's suffix is judged: its advice (.png or .mp4) follows from a valid count.
    check_frame_count(args.num_frames)


def check_frame_count(num_frames: int) -> None:
    if num_frames < 1 or num_frames % 4 != 1:
        video = 4 * max(1, round((num_frames - 1) / 4)) + 1
        raise DistillError(
            f"--num_frames must be 4k+1 (the Wan VAE compresses time by 4), got {num_frames}",
            fixes=[f"--num_frames 1 for an image (.png), or --num_frames {video} for a video (.mp4)"],
            stage=Stage.CONFIG,
        )


def one_transformer_guidance(args: argparse.Namespace, info: TeacherInfo, given: dict[str, str]) -> None:
    """A teacher with one transformer (TI2V-5B) has one guidance: a --guidance_2 given for it is
    refused (the trainer's and evaluate's rule, distill.config.flag_rules.second_expert_guidance)
    unless it is 1, no guidance; the run's recorded second scale is dropped."""
    if info.kind.experts != 1:
        return
    rule = second_expert_guidance("guidance_2", info.kind.experts, info.kind.model, "--guidance")
    check_dependents(args, given, [rule], stage=Stage.ARGV)
    args.guidance_2 = None
