"""The shipped 4-step students of the toy text-to-video teacher, and the commands that make them.

    python -m distill.toy.t2v_ship --retrain dmd          # assets/toy_student_dmd/ (what `make demo` trains)
    python -m distill.toy.t2v_ship --retrain lora         # assets/toy_student_lora/ (docs/lora.md's toy run)
    python -m distill.toy.t2v_ship --retrain clips_dmd    # assets/toy_student_clips_dmd/ (`make demo-clips`)
    python -m distill.toy.t2v_ship --retrain clips_lora   # assets/toy_student_clips_lora/

Each trains through the trainer with the flags of RECIPES (the README's and the docs' commands), scores
the student against the teacher on the world's 216 scored prompts, the same noise for all
(distill.toy.t2v_students: the teacher at 20, 4 and 1 steps, the student at 4 and 1), checks the bars
and ships the exported folder with RECORD_FILE: the exact command, the rows (with which prompts each
got right) and the bars. The suite scores the shipped students instead of training them
(tests/test_toy_shipped_students.py); `make proofs` trains every one again from scratch.

The dmd student of pictures starts from the shipped stage 1 (assets/toy_student_stage1/,
`make toy-stage1`): retrain that first to rebuild both. The shipped files name the teacher as
TEACHER_REF (where the demos write it), not the folder they were trained from.
"""

from __future__ import annotations

import json
import shlex
import shutil
import sys
from pathlib import Path
from typing import Any

from distill.ops.command import Parser, PathAction, entry_point
from distill.ops.paths import Kind

REPO = Path(__file__).resolve().parents[2]
TEACHER_REF = "outputs/toy-wan"
RECORD_FILE = "toy_student.json"
ASSETS = {
    kind: REPO / "assets" / f"toy_student_{kind}" for kind in ("dmd", "lora", "clips_dmd", "clips_lora")
}
CLIPS = ("clips_dmd", "clips_lora")
EXPORTED = {"dmd": "student", "lora": "lora", "clips_dmd": "student", "clips_lora": "lora"}
"""The folder of the run that is shipped: the student, or the LoRA adapters."""

PICTURES: dict[str, Any] = {
    "method": "dmd",
    "data_path": "data/toy_prompts.txt",
    "height": 32,
    "width": 32,
    "num_frames": 1,
    "batch_size": 16,
    "num_steps": 300,
    "student_steps": 4,
    "critic_updates": 5,
    "log_every": 50,
    "checkpoint_every": 0,
    "seed": 0,
}
# Clips: 9 frames of the moving world, the teacher at its own clip guidance as the real score.
CLIP_SHAPE: dict[str, Any] = PICTURES | {
    "data_path": "data/toy_video_prompts.txt",
    "num_frames": 9,
    "guidance_scale": 3,
    "guidance_scale_2": 1.5,
}
RECIPES: dict[str, dict[str, Any]] = {
    # The two-stage recipe's stage 2 (`make demo`): from the shipped stage 1, a gentle generator rate.
    "dmd": PICTURES
    | {
        "student_config": "config/student_toy_3layer.json",
        "student_init": "assets/toy_student_stage1",
        "teacher_sample_steps": 20,
        "lr": "3e-5",
        "critic_lr": "3e-4",
        "lr_scheduler": "cosine",
    },
    # A fresh LoRA student is the teacher itself; the LoRA dmd defaults (1e-4, constant). Its teacher
    # latents only feed the run's drift metrics (16 reference prompts).
    "lora": PICTURES | {"student_lora_rank": 16, "teacher_sample_steps": 2},
    # From the teacher's high-noise expert, where a clip's layout and motion are decided (`make demo-clips`).
    "clips_dmd": CLIP_SHAPE
    | {
        "student_config": "config/student_toy_3layer.json",
        "student_init": "teacher",
        "student_init_expert": "high",
        "teacher_sample_steps": 20,
        "lr": "3e-4",
        "critic_lr": "3e-4",
        "lr_scheduler": "cosine",
    },
    "clips_lora": CLIP_SHAPE | {"student_lora_rank": 16, "teacher_sample_steps": 2},
}
REPO_PATHS = ("student_config", "student_init", "data_path")
"""Recipe values that name a file of this repository (relative to REPO)."""


def recipe(kind: str, absolute: bool = False) -> dict[str, str]:
    """RECIPES[kind] as flag values; with `absolute`, the repository's files as absolute paths (a run
    started outside the repository)."""
    settings = {key: str(value) for key, value in RECIPES[kind].items()}
    if absolute:
        for key in REPO_PATHS:
            if key in settings and (REPO / settings[key]).exists():
                settings[key] = str(REPO / settings[key])
    return settings


def recipe_args(
    kind: str, teacher: str | Path, output_dir: str | Path, cache_dir: str | Path, absolute: bool = False
) -> list[str]:
    """train_distillation.py's arguments of the `kind` run (RECIPES) on `teacher`."""
    settings = {
        "teacher_path": teacher,
        "output_dir": output_dir,
        "cache_dir": cache_dir,
        **recipe(kind, absolute),
    }
    return [item for key, value in settings.items() for item in (f"--{key}", str(value))]


def command(kind: str) -> str:
    """The `kind` run as a user types it, on the teacher `download_wan.py --toy` writes."""
    run = f"outputs/toy-{kind.replace('_', '-')}"
    args = recipe_args(kind, TEACHER_REF, run, f"{run}-cache")
    return "python train_distillation.py " + " ".join(shlex.quote(a) for a in args)


def evaluation(teacher: Path, kind: str, exported: Path, teacher_rows: list[dict] | None = None) -> dict:
    """The record's evaluation of the `kind` student: the teacher's rows (computed unless given) and
    the student's on the world's scored prompts, and its bars."""
    from distill.toy.t2v_students import bars, scored_prompts, student_rows
    from distill.toy.t2v_students import teacher_rows as teacher_scores

    clips = kind in CLIPS
    rows = (teacher_rows or teacher_scores(teacher, clips)) + student_rows(teacher, kind, exported, clips)
    return {
        "count": len(scored_prompts(clips)),
        "noise_seed": 0,
        "rows": rows,
        "bars": bars(rows, kind, clips),
    }


def ship(kind: str, exported: str | Path, record: dict[str, Any], dest: Path | None = None) -> Path:
    """Copy a run's exported folder to `dest` (ASSETS[kind]) atomically, naming the teacher as
    TEACHER_REF, with `record`."""
    from distill.toy.shipping import ship_student

    return ship_student(exported, ASSETS[kind] if dest is None else dest, TEACHER_REF, (RECORD_FILE, record))


def retrain(kind: str, work: Path) -> tuple[Path, dict[str, Any]]:
    """Train the `kind` student from scratch with its recipe in `work`; returns its exported folder
    and its record (command and evaluation), not yet shipped."""
    from distill.config.cli import parse_config
    from distill.toy.shipped import write_toy_teacher
    from distill.train.trainer import Distiller

    teacher = write_toy_teacher(work / "teacher", overwrite=True)
    run, cache = work / kind, work / f"{kind}-cache"
    if run.exists():
        shutil.rmtree(run)  # a fresh run: the recipe is what gets shipped, not a resume
    Distiller(parse_config(recipe_args(kind, teacher, run, cache, absolute=True))).run()
    exported = run / EXPORTED[kind]
    record = {
        "command": command(kind),
        "rebuild": f"python -m distill.toy.t2v_ship --retrain {kind}",
        "evaluation": evaluation(teacher, kind, exported),
    }
    return exported, record


@entry_point
def main(argv: list[str] | None = None) -> int:
    parser = Parser(prog="python -m distill.toy.t2v_ship", description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--retrain", choices=sorted(RECIPES), required=True, help="which student to train and ship"
    )
    parser.add_argument(
        "--work_dir",
        action=PathAction,
        kind=Kind.OUTPUT_FOLDER,
        help="where the run goes (default outputs/toy-ship-KIND)",
    )
    parser.add_argument(
        "--output", action=PathAction, kind=Kind.OUTPUT_FOLDER, help="where it is shipped (default assets/)"
    )
    args = parser.parse_args(argv)
    import torch

    from distill.toy.evaluation import score_table
    from distill.toy.t2v_students import unmet

    torch.set_num_threads(1)  # tiny models: one thread is fastest on a shared machine
    work = Path(args.work_dir or f"outputs/toy-ship-{args.retrain}").absolute()
    exported, record = retrain(args.retrain, work)
    dest = ship(args.retrain, exported, record, None if args.output is None else Path(args.output).absolute())
    evaluation = record["evaluation"]
    print(dest)
    print(score_table(evaluation["rows"], args.retrain in CLIPS))
    missed = unmet(evaluation["bars"])
    print("bars: " + ("all met" if not missed else "NOT MET: " + "; ".join(missed)))
    print(json.dumps({name: b["met"] for name, b in evaluation["bars"].items()}))
    return 0 if not missed else 1


if __name__ == "__main__":
    sys.exit(main())
