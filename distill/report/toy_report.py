"""The toy world's entry of the report: when the teacher folder holds `toy_world.json`, teacher and
student are sampled on the world's prompts and scored by what their pictures show (distill.toy)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from distill.ops.errors import DistillError, Stage
from distill.toy import world
from distill.toy.evaluation import EVAL_PROMPTS, score_table, toy_report


def toy_prompt_count(requested: int | None, teacher_path: str | Path) -> int:
    """How many world prompts the report scores: `requested` (--toy_prompts; None = all of them),
    checked before anything is sampled. Refused for a teacher that is not a toy one (nothing would
    be scored), and above the world's distinct prompts (the rest would repeat them)."""
    if world.read_world(teacher_path) is None:
        if requested is not None:
            raise DistillError(
                f"--toy_prompts needs a toy teacher: {teacher_path} has no {world.WORLD_FILE}",
                "Only a teacher trained on the toy world is scored by what its pictures show; this "
                "evaluation writes the denoiser, sampler and cost report only.",
                fixes=["drop --toy_prompts"],
                stage=Stage.CONFIG,
            )
        return EVAL_PROMPTS
    distinct = len(world.all_prompts())
    count = min(EVAL_PROMPTS, distinct) if requested is None else requested
    if not 1 <= count <= distinct:
        raise DistillError(
            f"--toy_prompts must lie between 1 and {distinct} (the toy world's distinct prompts), got {count}",
            "Each prompt is sampled once; beyond the world's prompts they would repeat, costing time and "
            "adding nothing to the score.",
            fixes=[f"use --toy_prompts {distinct} (all of them), or fewer for a quicker check"],
            stage=Stage.CONFIG,
        )
    return count


def add_toy_report(
    result: dict[str, Any] | None,
    teacher_path: str | Path,
    student: torch.nn.Module,
    high: torch.nn.Module,
    low: torch.nn.Module,
    settings: Any,
    output_dir: str | Path,
    count: int = EVAL_PROMPTS,
) -> dict[str, Any] | None:
    """Add `toy` to an eval.json dict (and rewrite eval.json / eval.png) when the teacher is a toy
    one; otherwise return `result` unchanged. `settings` is the report's EvalSettings; `count`
    prompts of the world are sampled once each."""
    if result is None or world.read_world(teacher_path) is None:
        return result
    from distill.models.pipelines import scheduler_from_config
    from distill.report.summary import write_report

    # The student at its own steps and scheduler (a dmd student's K-step one), the teacher at both.
    own = settings.student_scheduler
    result["toy"] = toy_report(
        teacher_path,
        student,
        high,
        low,
        student_steps=settings.steps_of_student,
        student_scheduler=scheduler_from_config(own) if own else None,
        guidance_scale=settings.guidance_scale,
        guidance_scale_2=settings.guidance_scale_2,
        seed=settings.seed,
        count=count,
        num_frames=settings.num_frames,
        show=(lambda prompts, rows: write_toy_clips(output_dir, prompts, rows))
        if settings.num_frames > 1
        else None,
    )
    write_report(result, output_dir)
    return result


# The report's toy rows, in the order the table shows them, with the name each row is shown under.
TOY_ROWS = (
    ("teacher", "teacher"),
    ("teacher_at_student_steps", "teacher at the student's steps"),
    ("student", "student"),
)


def toy_table(toy: dict[str, Any]) -> str:
    """The toy world's scores of an eval.json ("toy") as the docs' tables show them: accuracy and
    diversity gap per model, and for clips direction, speed and motion ratio. The report's
    denoiser and sampler MSEs compare samples to the teacher's one by one, which a dmd student is not
    trained to match: these scores are what says whether it draws the world."""
    rows = [
        toy[key] | {"model": name, "guidance": toy[key]["guidance_scale"]}
        for key, name in TOY_ROWS
        if key in toy
    ]
    clips = toy.get("num_frames", 1) > 1
    count = rows[0]["count"] if rows else 0
    return (
        f"toy world, {count} {'clip ' if clips else ''}prompts, the same noise for every row:\n"
        + score_table(rows, clips)
    )


MEDIA_COLUMNS = 8


def write_toy_clips(
    folder: str | Path, prompts: Sequence[str], rows: Sequence[tuple[str, np.ndarray]]
) -> None:
    """toy_clips.gif (the rows play side by side: same prompts, same noise) and toy_clips.png (a strip
    of frames per clip under its prompt) of the first MEDIA_COLUMNS prompts."""
    from distill.sample.media import frame_strip, write_grid, write_side_by_side_gif

    folder = Path(folder)
    shown = [(label, list(clips[:MEDIA_COLUMNS])) for label, clips in rows]
    write_side_by_side_gif(shown, folder / "toy_clips.gif")
    write_grid(
        [(label.replace(" ", "\n", 1), [frame_strip(clip) for clip in clips]) for label, clips in shown],
        folder / "toy_clips.png",
        prompts=list(prompts[:MEDIA_COLUMNS]),
        title="toy world clips: 5 frames, first to last, left to right (same noise in every row)",
    )
