"""Few-step students of the toy image-to-video teacher, scored as the teacher is: does the clip keep its
input image, and does it keep moving?

    python -m distill.toy.i2v_students --teacher assets/toy_i2v_teacher \
        --student dmd=outputs/demo-i2v/dmd/student --student lora=outputs/demo-i2v/lora/lora \
        --count 72 --output_dir outputs/demo-i2v/eval

A student is an exported dmd student folder (`OUTPUT/student`: one transformer of the teacher's 36
input channels, replacing both experts) or a LoRA run's adapters (`OUTPUT/lora`: the teacher's own
experts with them). Every model samples through stock `WanImageToVideoPipeline` (i2v_evaluation's
`sample_cases`) on image_score's held-out cases: the same images, prompts and noise (case i: noise
seed + i; the teacher's recorded score used noise seed 0 too) for the teacher at its full steps, at 4
and at 1 step (its own guidance) and for each student at `--student_steps` (guidance 1, its own
few-step scheduler, whose re-noising is seeded per case too).

Writes report.json (every row's image score, full-prompt accuracy and diversity gap, and each issue
bar per student: `bars`), table.md (printed too) and i2v_clips.gif: one column per case (the first
eight), the rows input image, teacher at full steps, teacher at 4 steps, then each student at 4.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from distill.ops.command import Parser, PathAction, entry_point, integer
from distill.ops.errors import DistillError, Stage
from distill.ops.paths import Kind
from distill.toy.i2v_evaluation import load_pipeline, sample_cases, teacher_guidance
from distill.toy.image_score import HELD_OUT_SEED, ImageCase, motion_prompts, score_image_clips

STUDENT_STEPS = (4, 1)
TEACHER_FEW_STEPS = (4, 1)
GIF_CASES = 8
# The bars for a few-step student, against the teacher on the same cases and noise.
ADHERENCE_SHARE = 0.9
"""Image adherence at the student's steps: at least this share of the teacher's at its full steps."""
MOTION_RANGE = (0.85, 1.15)
STATIC_SLACK = 0.05
"""Static-clip rate: at most the teacher's (full steps) plus this."""
DIVERSITY_FACTOR = 2.0
"""Diversity gap: at most this many times the teacher's (full steps)."""
ONE_STEP_LEAD = 0.3
"""At one step: adherence (or full-prompt accuracy) at least the teacher's one-step plus this."""


def student_pipeline(student: str | Path, teacher_pipe: Any, teacher: str | Path, device: str = "cpu") -> Any:
    """A stock WanImageToVideoPipeline sampling `student` with the teacher's text encoder, VAE and
    tokenizer: a dmd student folder alone (no boundary), or a LoRA run's adapters on the teacher's
    two experts (switched at its boundary); the student's own few-step scheduler when it has one."""
    from diffusers import WanImageToVideoPipeline

    from distill.models.few_step import load_few_step_scheduler
    from distill.models.lora_files import is_lora_folder
    from distill.models.teacher import inspect_teacher
    from distill.sample.student_folder import load_lora_student, load_student

    info = inspect_teacher(str(teacher))
    where = torch.device(device)
    if is_lora_folder(student):
        model, _, _ = load_lora_student(student, info, where, torch.float32)
        high, low = model.sampling_experts()
        experts = {"transformer": high, "transformer_2": low, "boundary_ratio": info.boundary_ratio}
    else:
        model = load_student(student, info, where, torch.float32)
        experts = {"transformer": model, "transformer_2": None, "boundary_ratio": None}
    scheduler = load_few_step_scheduler(student)
    pipe = WanImageToVideoPipeline(
        tokenizer=teacher_pipe.tokenizer,
        text_encoder=teacher_pipe.text_encoder,
        vae=teacher_pipe.vae,
        scheduler=scheduler if scheduler is not None else teacher_pipe.scheduler,
        **experts,
    )
    pipe.set_progress_bar_config(disable=True)
    return pipe


@dataclass(frozen=True)
class Row:
    """One model at one step count, as the table shows it."""

    name: str
    steps: int
    guidance: tuple[float, float]
    scores: dict[str, Any]
    """score_image_clips' figures plus `clip_accuracy` and `diversity_gap` (score_clips on the
    cases' full prompts)."""


def score_row(clips: np.ndarray, cases: Sequence[ImageCase]) -> dict[str, Any]:
    """The figures of one row: image adherence and its parts, motion ratio, static rate, and the
    full-prompt accuracy and diversity gap of the same clips."""
    scored = score_image_clips(list(clips), cases, named_score=True)
    clip_score = scored.pop("clip_score")
    return {
        **{
            k: scored[k]
            for k in ("adherence", "parts", "motion_ratio", "static_rate", "still_leak", "frame_error")
        },
        "clip_accuracy": clip_score["accuracy"],
        "diversity_gap": clip_score["diversity_gap"],
        "count": len(cases),
    }


def bars(
    student: Mapping[str, Any],
    one_step: Mapping[str, Any] | None,
    teacher: Mapping[str, Any],
    teacher_one: Mapping[str, Any] | None,
) -> dict[str, dict[str, Any]]:
    """Each issue bar of a few-step student (`student`: at its steps; `one_step`: at one step)
    against the teacher at full steps and at one step: {bar: {"value", "limit", "met"}}."""
    found: dict[str, dict[str, Any]] = {}

    def bar(name: str, value: float | None, limit: Any, met: bool) -> None:
        found[name] = {"value": value, "limit": limit, "met": bool(met)}

    floor = ADHERENCE_SHARE * teacher["adherence"]
    bar("adherence", student["adherence"], f">= {floor:.2f}", student["adherence"] >= floor)
    ratio = student["motion_ratio"]
    bar(
        "motion_ratio",
        ratio,
        f"{MOTION_RANGE[0]}-{MOTION_RANGE[1]}",
        ratio is not None and MOTION_RANGE[0] <= ratio <= MOTION_RANGE[1],
    )
    static_limit = (teacher["static_rate"] or 0.0) + STATIC_SLACK
    bar(
        "static_rate",
        student["static_rate"],
        f"<= {static_limit:.2f}",
        (student["static_rate"] or 0.0) <= static_limit,
    )
    gap, teacher_gap = student["diversity_gap"], teacher["diversity_gap"]
    gap_limit = None if teacher_gap is None else DIVERSITY_FACTOR * teacher_gap
    bar(
        "diversity_gap",
        gap,
        None if gap_limit is None else f"<= {gap_limit:.2f}",
        gap is not None and gap_limit is not None and gap <= gap_limit,
    )
    if one_step is not None and teacher_one is not None:
        lead = {k: one_step[k] - teacher_one[k] for k in ("adherence", "clip_accuracy")}
        bar(
            "one_step_lead",
            max(lead.values()),
            f">= {ONE_STEP_LEAD} (adherence or full-prompt accuracy over the teacher's one step)",
            max(lead.values()) >= ONE_STEP_LEAD,
        )
    return found


def evaluate_students(
    teacher: str | Path,
    students: Mapping[str, str | Path],
    count: int = 72,
    seed: int = HELD_OUT_SEED,
    noise_seed: int = 0,
    student_steps: Sequence[int] = STUDENT_STEPS,
    device: str = "cpu",
    teacher_steps: Sequence[int] = TEACHER_FEW_STEPS,
) -> tuple[dict[str, Any], list[tuple[str, np.ndarray]], list[ImageCase]]:
    """Teacher (full steps and `teacher_steps`) and every student (`student_steps`) on `count`
    held-out cases, the same images, prompts and noise. Returns the report (rows and each student's
    bars), the GIF's rows (input image, teacher full, teacher at 4 when sampled, each student at its
    first steps) and the cases."""
    guidance, full = teacher_guidance(teacher)
    cases = motion_prompts(count, seed)
    teacher_pipe = load_pipeline(teacher, device)
    rows: list[Row] = []
    samples: dict[tuple[str, int], np.ndarray] = {}
    for steps in dict.fromkeys((full, *teacher_steps)):
        samples["teacher", steps] = sample_cases(teacher_pipe, cases, steps, guidance, noise_seed)
        rows.append(Row("teacher", steps, guidance, score_row(samples["teacher", steps], cases)))
    for name, folder in students.items():
        pipe = student_pipeline(folder, teacher_pipe, teacher, device)
        for steps in student_steps:
            samples[name, steps] = sample_cases(pipe, cases, steps, (1.0, 1.0), noise_seed)
            rows.append(Row(name, steps, (1.0, 1.0), score_row(samples[name, steps], cases)))
    by = {(r.name, r.steps): r.scores for r in rows}
    first = student_steps[0]
    report = {
        "teacher": str(teacher),
        "count": count,
        "seed": seed,
        "noise_seed": noise_seed,
        "rows": [{"model": r.name, "steps": r.steps, "guidance": list(r.guidance), **r.scores} for r in rows],
        "bars": {
            name: bars(by[name, first], by.get((name, 1)), by["teacher", full], by.get(("teacher", 1)))
            for name in students
        },
    }
    frames = samples["teacher", full].shape[1]
    shown = [("input image", np.stack([np.repeat(c.image[None], frames, 0) for c in cases[:GIF_CASES]]))]
    shown += [
        (f"teacher {s} steps", samples["teacher", s][:GIF_CASES])
        for s in dict.fromkeys((full, 4))
        if ("teacher", s) in samples
    ]
    shown += [(f"{name} {first} steps", samples[name, first][:GIF_CASES]) for name in students]
    return report, shown, cases


def _cell(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def table(report: Mapping[str, Any]) -> str:
    """The report's rows as a Markdown table."""
    head = (
        "| model | steps | guidance | adheres | frame 0 | identity | start | motion | motion ratio | static "
        "| full-prompt accuracy | diversity gap |"
    )
    lines = [head, "|---|---:|---:|" + "---:|" * 9]
    for r in report["rows"]:
        guidance = " / ".join(f"{g:g}" for g in r["guidance"])
        parts = [r["parts"][p] for p in ("first_frame", "identity", "start", "motion")]
        cells = [
            r["adherence"],
            *parts,
            r["motion_ratio"],
            r["static_rate"],
            r["clip_accuracy"],
            r["diversity_gap"],
        ]
        lines.append(f"| {r['model']} | {r['steps']} | {guidance} | " + " | ".join(map(_cell, cells)) + " |")
    return "\n".join(lines)


def bars_text(report: Mapping[str, Any]) -> str:
    """One line per student and bar: the value, the limit and whether it is met."""
    lines = []
    for name, found in report["bars"].items():
        for bar, entry in found.items():
            mark = "met" if entry["met"] else "NOT met"
            lines.append(f"{name}: {bar} {_cell(entry['value'])} (needs {entry['limit']}): {mark}")
    return "\n".join(lines)


def write_report(
    report: Mapping[str, Any], shown: Sequence[tuple[str, np.ndarray]], folder: str | Path
) -> Path:
    """report.json, table.md and i2v_clips.gif in `folder`; returns the GIF's path."""
    from distill.sample.media import write_side_by_side_gif

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "report.json").write_text(json.dumps(report, indent=2) + "\n")
    (folder / "table.md").write_text(table(report) + "\n\n" + bars_text(report) + "\n")
    return write_side_by_side_gif([(label, list(clips)) for label, clips in shown], folder / "i2v_clips.gif")


def parse_students(values: Sequence[str]) -> dict[str, Path]:
    """`name=folder` (or a bare folder, named by its run folder) per --student."""
    students: dict[str, Path] = {}
    for value in values:
        name, _, path = value.rpartition("=") if "=" in value else ("", "", value)
        folder = Path(path)
        name = name or folder.resolve().parent.name
        if not folder.is_dir():
            raise DistillError(
                f"--student {value}: {folder} is not a folder",
                fixes=["pass an exported student (OUTPUT/student) or a LoRA run's OUTPUT/lora"],
                stage=Stage.ARGV,
            )
        if name in students or name == "teacher":
            raise DistillError(
                f"--student {value}: the name {name!r} is taken",
                fixes=["name it: --student NAME=FOLDER"],
                stage=Stage.ARGV,
            )
        students[name] = folder
    return students


@entry_point
def main(argv: list[str] | None = None) -> int:
    parser = Parser(prog="python -m distill.toy.i2v_students", description=__doc__.split("\n\n")[0])
    parser.add_argument("--teacher", required=True, action=PathAction, kind=Kind.FOLDER)
    parser.add_argument(
        "--student",
        action="append",
        default=[],
        help="NAME=FOLDER: a dmd student folder or a LoRA run's lora/",
    )
    parser.add_argument("--count", type=integer(9), default=72, help="held-out cases (default 72)")
    parser.add_argument("--seed", type=integer(0), default=HELD_OUT_SEED, help="the held-out cases' seed")
    parser.add_argument("--noise_seed", type=integer(0), default=0, help="case i starts from noise seed + i")
    parser.add_argument(
        "--student_steps", type=integer(1), nargs="+", default=list(STUDENT_STEPS), help="default: 4 1"
    )
    parser.add_argument("--output_dir", required=True, action=PathAction, kind=Kind.OUTPUT_FOLDER)
    parser.add_argument("--threads", type=integer(1), default=1)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    students = parse_students(args.student)
    report, shown, _ = evaluate_students(
        args.teacher, students, args.count, args.seed, args.noise_seed, args.student_steps
    )
    gif = write_report(report, shown, args.output_dir)
    print(
        f"{args.count} held-out cases (seed {args.seed}, noise seed {args.noise_seed}): the same images, "
        "prompts and noise in every row"
    )
    print(table(report))
    print(bars_text(report))
    print(f"clips: {gif}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
