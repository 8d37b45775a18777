"""The shipped 4-step students of the toy image-to-video teacher, and the commands that make them.

    python -m distill.toy.i2v_ship --retrain stage1  # assets/toy_i2v_student_stage1/ (the dmd student's start)
    python -m distill.toy.i2v_ship --retrain dmd     # assets/toy_i2v_student_dmd/  (a small dmd student)
    python -m distill.toy.i2v_ship --retrain lora    # assets/toy_i2v_student_lora/ (a LoRA of the experts)

Each writes the training pairs (`i2v_data`, DATA), trains through the trainer with the flags of
`RECIPES` (what `command()` prints; `make demo-i2v` runs the DEMO_KINDS), scores the student on 72
held-out cases against the teacher on the same images, prompts and noise (`i2v_students`), and ships
the exported folder with RECORD_FILE: the exact command, the measured rows and the issue's bars. The
tests score the shipped students instead of training them (tests/test_toy_i2v_students.py).

The dmd student starts from the shipped stage 1 (as the text-to-video toy students do): retrain
`stage1` before `dmd` to rebuild both.

The shipped files name the teacher as TEACHER_REF (where `make demo-i2v` writes it), not the folder
they were trained from, so they carry no machine's paths.
"""

from __future__ import annotations

import json
import shlex
import shutil
import sys
from pathlib import Path
from typing import Any

from distill.ops.command import Parser, PathAction, entry_point, integer
from distill.ops.paths import Kind

REPO = Path(__file__).resolve().parents[2]
TEACHER_REF = "outputs/toy-wan-i2v"
RECORD_FILE = "toy_i2v_student.json"
ASSETS = {
    "stage1": REPO / "assets" / "toy_i2v_student_stage1",
    "dmd": REPO / "assets" / "toy_i2v_student_dmd",
    "lora": REPO / "assets" / "toy_i2v_student_lora",
}
EXPORTED = {"stage1": "student_ema", "dmd": "student", "lora": "lora"}
"""The folder of the run that is shipped: the student (stage 1: its EMA), or the LoRA adapters."""
DEMO_KINDS = ("dmd", "lora")
"""What `make demo-i2v` trains; the dmd student starts from the shipped stage 1."""
DATA = {"count": 512, "seed": 1}
"""i2v_data's pairs: 3 of 4 prompts name only the motion, as the teacher trained."""
EVAL_CASES = 72

# What every run shares: 32x32 clips of 9 frames, batch 16, seed 0.
SHAPE: dict[str, Any] = {
    "height": 32,
    "width": 32,
    "num_frames": 9,
    "batch_size": 16,
    "checkpoint_every": 0,
    "seed": 0,
}
# The dmd runs: the teacher's own clip guidance (3 / 1.5, from its toy_world.json) as the real score,
# 4 student steps.
COMMON: dict[str, Any] = {
    "method": "dmd",
    **SHAPE,
    "guidance_scale": 3,
    "guidance_scale_2": 1.5,
    "student_steps": 4,
    "critic_updates": 5,
    "log_every": 50,
}
TEACHER = "{teacher}"
"""Stands for the teacher's folder in a recipe's values (recipe() fills it in)."""
STUDENT_CONFIG = "config/student_toy_5layer_i2v.json"

RECIPES: dict[str, dict[str, Any]] = {
    # Stage 1: the low-noise expert's shape (5 layers of the teacher's 3 + 5), started as a copy of
    # it, taught the teacher's unguided velocity at every noise level on its own 20-step samples. The
    # student's shape and start decide the result (docs/toy-world.md, image to video): 3 layers from
    # the high-noise expert reached 0.58 adherence at 4 steps after the same 1,500 steps, these 5
    # layers 0.74 (the teacher at 20 steps: 0.74). dmd then adds the guidance back through its real score.
    "stage1": {
        "method": "velocity",
        **SHAPE,
        "student_config": STUDENT_CONFIG,
        "student_init": "teacher",
        "student_init_expert": "low",
        "guidance_scale": 1,
        "guidance_scale_2": 1,
        "teacher_sample_steps": 20,
        "num_steps": 1500,
        "lr": "1e-3",
        "lr_warmup_steps": 100,
        "ema_decay": 0.99,
        "log_every": 100,
    },
    # From the shipped stage 1, with a critic started as the teacher's low-noise expert (the same
    # shape): 300 steps at a gentle 1e-4 (3e-4 pulled the stage-1 student's 4-step adherence down to
    # 0.65), plus the regression onto the teacher's own 4-step samples.
    "dmd": COMMON
    | {
        "student_config": STUDENT_CONFIG,
        "student_init": "assets/toy_i2v_student_stage1",
        "critic_init": f"{TEACHER}/transformer_2",
        "teacher_sample_steps": 4,
        "regression_weight": 0.25,
        "num_steps": 300,
        "lr": "1e-4",
        "critic_lr": "3e-4",
        "lr_scheduler": "cosine",
    },
    # A fresh LoRA student is the teacher itself; the LoRA dmd defaults (1e-4, constant). Its teacher
    # latents only feed the run's drift and motion metrics (16 reference prompts).
    "lora": COMMON | {"student_lora_rank": 16, "teacher_sample_steps": 20, "num_steps": 300},
}
REPO_PATHS = ("student_config", "student_init")
"""Recipe values that name a file of this repository (relative to REPO)."""


def recipe(kind: str, teacher: str | Path, absolute: bool = False) -> dict[str, Any]:
    """RECIPES[kind] for `teacher`; with `absolute`, the repository's files as absolute paths (a run
    started outside the repository)."""
    settings = {key: str(value).replace(TEACHER, str(teacher)) for key, value in RECIPES[kind].items()}
    if absolute:
        for key in REPO_PATHS:
            if key in settings and (REPO / settings[key]).exists():
                settings[key] = str(REPO / settings[key])
    return settings


def recipe_args(
    kind: str,
    teacher: str | Path,
    data: str | Path,
    output_dir: str | Path,
    cache_dir: str | Path,
    absolute: bool = False,
) -> list[str]:
    """train_distillation.py's arguments of the `kind` run (RECIPES) on `teacher` and `data`."""
    settings = {
        "teacher_path": teacher,
        "data_path": data,
        "output_dir": output_dir,
        "cache_dir": cache_dir,
        **recipe(kind, teacher, absolute),
    }
    return [item for key, value in settings.items() for item in (f"--{key}", str(value))]


def command(
    kind: str, teacher: str | Path, data: str | Path, output_dir: str | Path, cache_dir: str | Path
) -> str:
    """The `kind` run as a user types it."""
    args = recipe_args(kind, teacher, data, output_dir, cache_dir)
    return "python train_distillation.py " + " ".join(shlex.quote(a) for a in args)


def ship(kind: str, exported: str | Path, record: dict[str, Any], dest: Path | None = None) -> Path:
    """Copy a run's exported folder (its student, or its LoRA adapters) to `dest` (ASSETS[kind])
    atomically, naming the teacher as TEACHER_REF, with `record`."""
    from distill.toy.shipping import ship_student

    return ship_student(exported, ASSETS[kind] if dest is None else dest, TEACHER_REF, (RECORD_FILE, record))


def retrain(kind: str, work: Path, dest: Path | None = None, count: int = EVAL_CASES) -> Path:
    """Write the data, train the `kind` student, score it on `count` held-out cases, ship it."""
    from distill.config.cli import parse_config
    from distill.toy.i2v_data import write_i2v_data
    from distill.toy.shipped import I2V_ASSETS, write_toy_teacher
    from distill.train.trainer import Distiller

    teacher = write_toy_teacher(work / "teacher", overwrite=True, source=I2V_ASSETS)
    data = write_i2v_data(work / "data", **DATA)
    run, cache = work / kind, work / f"{kind}-cache"
    result = Distiller(parse_config(recipe_args(kind, teacher, data, run, cache, absolute=True))).run()
    assert result.student_dir is not None
    return score_and_ship(kind, teacher, run / EXPORTED[kind], dest, count)


def score_and_ship(
    kind: str, teacher: Path, exported: Path, dest: Path | None = None, count: int = EVAL_CASES
) -> Path:
    """Score the `kind` run's `exported` folder against `teacher` on `count` held-out cases and ship it
    with its record (the recipe's command as a user types it, and the measured rows)."""
    from distill.toy.i2v_students import evaluate_students, table

    report, _, _ = evaluate_students(teacher, {kind: exported}, count=count)
    refs = {
        "teacher": TEACHER_REF,
        "data": "outputs/demo-i2v/data/prompts.jsonl",
        "run": f"outputs/demo-i2v/{kind}",
    }
    record = {
        "data_command": f"python -m distill.toy.i2v_data --output outputs/demo-i2v/data --count {DATA['count']} "
        f"--seed {DATA['seed']}",
        "command": command(kind, refs["teacher"], refs["data"], refs["run"], "outputs/demo-i2v/cache"),
        "rebuild": f"python -m distill.toy.i2v_ship --retrain {kind}",
        "evaluation": {**{k: v for k, v in report.items() if k != "teacher"}, "teacher": TEACHER_REF},
        "table": table(report),
    }
    return ship(kind, exported, record, dest)


@entry_point
def main(argv: list[str] | None = None) -> int:
    parser = Parser(prog="python -m distill.toy.i2v_ship", description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--retrain", choices=sorted(RECIPES), required=True, help="which student to train and ship"
    )
    parser.add_argument(
        "--work_dir",
        action=PathAction,
        kind=Kind.OUTPUT_FOLDER,
        help="where the run goes (default outputs/toy-i2v-KIND)",
    )
    parser.add_argument(
        "--output", action=PathAction, kind=Kind.OUTPUT_FOLDER, help="where it is shipped (default assets/)"
    )
    parser.add_argument("--count", type=integer(9), default=EVAL_CASES, help="held-out cases scored")
    args = parser.parse_args(argv)
    import torch

    torch.set_num_threads(1)  # tiny models: one thread is fastest on a shared machine
    work = Path(args.work_dir or f"outputs/toy-i2v-{args.retrain}").absolute()
    if (work / args.retrain).exists():
        shutil.rmtree(work / args.retrain)  # a fresh run: the recipe is what gets shipped, not a resume
    dest = retrain(
        args.retrain, work, None if args.output is None else Path(args.output).absolute(), args.count
    )
    print(dest)
    print(json.loads((dest / RECORD_FILE).read_text())["table"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
