"""Few-step students of the toy text-to-video teacher, scored as the teacher is, on pictures (colour,
shape, position and background all right) or on clips (and the motion: direction, speed, motion ratio).

    python -m distill.toy.t2v_students --teacher outputs/toy-wan --student dmd=outputs/demo/student
    python -m distill.toy.t2v_students --teacher outputs/toy-wan --clips --student outputs/demo-clips/student

A student is an exported dmd student folder (`OUTPUT/student`: one model for every step) or a LoRA
run's adapters (`OUTPUT/lora`: the teacher's own experts with them). Every model samples through stock
`WanPipeline` (distill.toy.evaluation.sample_pictures) on the world's scored prompts, the same noise
for all: the teacher at its full steps and at 4 and 1 step (its own guidance, its own scheduler),
each student at 4 and 1 step (guidance 1, its own few-step scheduler). Each row keeps which prompts
it got right (`correct`), so a later scoring can be compared sample by sample.

The bars a few-step student must clear, against the teacher on the same prompts and noise:
- pictures: accuracy at least 0.9x the teacher's at its full steps and 0.15 above the teacher's at 4
  steps (what fewer steps cost it), diversity gap at most twice the teacher's;
- clips: accuracy at least 0.9x the teacher's, motion ratio 0.85-1.15 (no slow motion), diversity
  gap at most twice the teacher's, direction right in 9 of 10 clips, and at one step 0.3 above the
  teacher at one step. Not asked on clips: beating the teacher at 4 steps, which at its clip
  guidance is as good as at 20 (docs/toy-world.md, the moving world).
"""

from __future__ import annotations

import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from distill.ops.command import Parser, PathAction, entry_point, integer
from distill.ops.paths import Kind
from distill.toy import world
from distill.toy.evaluation import (
    EVAL_CLIP_PROMPTS,
    EVAL_PROMPTS,
    eval_prompts,
    load_experts,
    load_parts,
    sample_pictures,
    score_pictures,
    score_table,
)

STEPS = (4, 1)
"""Steps every model is scored at besides the teacher's full count."""
ACCURACY_SHARE = 0.9
"""Accuracy at 4 steps: at least this share of the teacher's at its full steps."""
FOUR_STEP_LEAD = 0.15
"""Pictures: accuracy at 4 steps at least the teacher's at 4 steps plus this."""
MOTION_RANGE = (0.85, 1.15)
DIVERSITY_FACTOR = 2.0
"""Diversity gap: at most this many times the teacher's (full steps)."""
DIRECTION_FLOOR = 0.9
ONE_STEP_LEAD = 0.3
"""Clips: accuracy at one step at least the teacher's at one step plus this."""
FIGURES = ("accuracy", "correct", "per_attribute", "diversity_gap", "motion_ratio", "identity", "count")


def scored_prompts(clips: bool, count: int | None = None) -> list[str]:
    """The world's scored prompts: all 216 pictures, or 216 clips (each motion 24 times)."""
    return eval_prompts(count or (EVAL_CLIP_PROMPTS if clips else EVAL_PROMPTS), clips=clips)


def student_models(folder: str | Path, teacher: str | Path) -> tuple[dict[str, Any], Any]:
    """sample_pictures' model arguments for a student folder (a LoRA run's adapters on the teacher's
    experts, or one model), and its few-step scheduler (None: the teacher's)."""
    from diffusers import WanTransformer3DModel

    from distill.models.few_step import load_few_step_scheduler
    from distill.models.lora_files import is_lora_folder
    from distill.models.teacher import inspect_teacher
    from distill.sample.student_folder import load_lora_student

    if is_lora_folder(folder):
        student, _, _ = load_lora_student(
            folder, inspect_teacher(str(teacher)), torch.device("cpu"), torch.float32
        )
        high, low = student.sampling_experts()
        models = {"transformer": high, "transformer_2": low}
    else:
        models = {"transformer": WanTransformer3DModel.from_pretrained(folder).eval()}
    return models, load_few_step_scheduler(folder)


def row(model: str, steps: int, guidance: Sequence[float], result: Mapping[str, Any]) -> dict[str, Any]:
    return {
        "model": model,
        "steps": steps,
        "guidance": list(guidance),
        **{k: result[k] for k in FIGURES if k in result},
    }


def teacher_rows(
    teacher: str | Path, clips: bool, count: int | None = None, steps: Sequence[int] | None = None
) -> list[dict[str, Any]]:
    """The teacher at its own guidance, at its full steps and at STEPS (or `steps`), on the scored prompts."""
    description = world.read_world(teacher) or {}
    guidance = world.guidance_of(description, clips)
    full = int(description.get("sample_steps", 20))
    prompts = scored_prompts(clips, count)
    high, low = load_experts(teacher)
    parts = load_parts(teacher)
    frames = world.CLIP_FRAMES if clips else 1
    rows = []
    for n in steps or dict.fromkeys((full, *STEPS)):
        samples = sample_pictures(
            teacher,
            prompts,
            transformer=high,
            transformer_2=low,
            steps=n,
            guidance_scale=guidance[0],
            guidance_scale_2=guidance[1],
            num_frames=frames,
            parts=parts,
        )
        rows.append(row("teacher", n, guidance, score_pictures(samples, prompts)))
    return rows


def student_rows(
    teacher: str | Path,
    name: str,
    folder: str | Path,
    clips: bool,
    count: int | None = None,
    steps: Sequence[int] = STEPS,
) -> list[dict[str, Any]]:
    """A student (`folder`) at `steps`, guidance 1 and its own scheduler, on the scored prompts."""
    prompts = scored_prompts(clips, count)
    models, scheduler = student_models(folder, teacher)
    parts = load_parts(teacher)
    frames = world.CLIP_FRAMES if clips else 1
    return [
        row(
            name,
            n,
            (1.0,),
            score_pictures(
                sample_pictures(
                    teacher, prompts, steps=n, scheduler=scheduler, num_frames=frames, parts=parts, **models
                ),
                prompts,
            ),
        )
        for n in steps
    ]


def find_row(rows: Sequence[Mapping[str, Any]], model: str, steps: int) -> Mapping[str, Any]:
    return next(r for r in rows if r["model"] == model and r["steps"] == steps)


def bars(rows: Sequence[Mapping[str, Any]], student: str, clips: bool) -> dict[str, dict[str, Any]]:
    """Each bar of `student` against the teacher's rows: {bar: {"value", "limit", "met"}}."""
    teacher = [r for r in rows if r["model"] == "teacher"]
    full = find_row(rows, "teacher", max(r["steps"] for r in teacher))
    four, one = find_row(rows, student, 4), find_row(rows, student, 1)
    found: dict[str, dict[str, Any]] = {}

    def bar(name: str, value: float | None, limit: str, met: bool) -> None:
        found[name] = {"value": value, "limit": limit, "met": bool(met)}

    floor = ACCURACY_SHARE * full["accuracy"]
    bar("accuracy", four["accuracy"], f">= {floor:.2f}", four["accuracy"] >= floor)
    gap, gap_limit = four["diversity_gap"], DIVERSITY_FACTOR * full["diversity_gap"]
    bar("diversity_gap", gap, f"<= {gap_limit:.2f}", gap is not None and gap <= gap_limit)
    if not clips:
        lead = find_row(rows, "teacher", 4)["accuracy"] + FOUR_STEP_LEAD
        bar(
            "four_step_lead",
            four["accuracy"],
            f">= {lead:.2f} (the teacher at 4 steps + {FOUR_STEP_LEAD})",
            four["accuracy"] >= lead,
        )
        return found
    ratio = four.get("motion_ratio")
    low, high = MOTION_RANGE
    bar("motion_ratio", ratio, f"{low}-{high}", ratio is not None and low <= ratio <= high)
    direction = four["per_attribute"]["direction"]
    bar("direction", direction, f">= {DIRECTION_FLOOR}", direction >= DIRECTION_FLOOR)
    lead = find_row(rows, "teacher", 1)["accuracy"] + ONE_STEP_LEAD
    bar(
        "one_step_lead",
        one["accuracy"],
        f">= {lead:.2f} (the teacher at one step + {ONE_STEP_LEAD})",
        one["accuracy"] >= lead,
    )
    return found


def unmet(found: Mapping[str, Mapping[str, Any]]) -> list[str]:
    """The bars not met, as 'name value (limit)'."""
    return [f"{name} {b['value']} ({b['limit']})" for name, b in found.items() if not b["met"]]


def mismatches(a: str, b: str) -> int:
    """Samples scored differently by two `correct` strings of the same prompts and noise."""
    return sum(x != y for x, y in zip(a, b)) + abs(len(a) - len(b))


@entry_point
def main(argv: list[str] | None = None) -> int:
    from distill.toy.i2v_students import parse_students

    parser = Parser(prog="python -m distill.toy.t2v_students", description=__doc__.split("\n\n")[0])
    parser.add_argument("--teacher", required=True, action=PathAction, kind=Kind.FOLDER)
    parser.add_argument(
        "--student",
        action="append",
        default=[],
        help="NAME=FOLDER: a dmd student folder or a LoRA run's lora/",
    )
    parser.add_argument("--clips", action="store_true", help="score clips (9 frames) instead of pictures")
    parser.add_argument("--count", type=integer(9), default=None, help="scored prompts (default: all 216)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)  # tiny models: one thread is fastest on a shared machine
    students = parse_students(args.student)
    rows = teacher_rows(args.teacher, args.clips, args.count)
    for name, folder in students.items():
        rows += student_rows(args.teacher, name, folder, args.clips, args.count)
    print(score_table(rows, args.clips))
    for name in students:
        missed = unmet(bars(rows, name, args.clips))
        print(f"{name}: " + ("every bar met" if not missed else "bars missed: " + "; ".join(missed)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
