"""The shipped stage-1 toy student: where the toy two-stage recipe's dmd stage starts.

Stage 1 of the recipe (README, "Fewer steps too") is velocity distillation of the toy teacher at
guidance 1 into `config/student_toy_3layer.json`: 6,000 steps, about 16 minutes on one core. The
dmd test and the README's toy commands start stage 2 from this student instead of training it
again, the way the toy teacher itself is shipped. Rebuild it with

    python -m distill.toy.stage_one --retrain      # or: make toy-stage1
    python -m distill.toy.stage_one --retrain --clips   # the moving world's (assets/toy_student_clips_stage1/)

which trains with the recipe below (through the trainer, like any run) and replaces
assets/toy_student_stage1/ (with --clips: the same recipe on the world's clips, CLIP_RECIPE). Its run_settings.json and model card name the teacher as
`outputs/toy-wan` (where `download_wan.py --toy` and `make demo` put it), not the folder it was
trained from, so the shipped files carry no machine's paths.
"""

from __future__ import annotations

from pathlib import Path

from distill.ops.command import Parser, PathAction, entry_point
from distill.ops.paths import Kind

REPO = Path(__file__).resolve().parents[2]
ASSET = REPO / "assets" / "toy_student_stage1"
TEACHER_REF = "outputs/toy-wan"

# The recipe (the README's stage-1 toy command). Guidance 1: the student learns the teacher's own
# velocity; dmd adds the guidance back through its real score. A student distilled from the
# guided teacher carries the guidance in its velocity and made a far worse start (README table).
RECIPE = {
    "student_config": str(REPO / "config" / "student_toy_3layer.json"),
    "data_path": str(REPO / "data" / "toy_prompts.txt"),
    "height": 32,
    "width": 32,
    "num_frames": 1,
    "teacher_sample_steps": 20,
    "guidance_scale": 1,
    "guidance_scale_2": 1,
    "batch_size": 16,
    "num_steps": 6000,
    "lr": 2e-3,
    "lr_warmup_steps": 100,
    "ema_decay": 0.99,
    "seed": 0,
    "num_workers": 0,
    "log_every": 100,
}


# The moving world: the same student and recipe on the 1,944 clip prompts, 9 frames (3 latent frames).
CLIP_ASSET = REPO / "assets" / "toy_student_clips_stage1"
CLIP_RECIPE = RECIPE | {
    "data_path": str(REPO / "data" / "toy_video_prompts.txt"),
    "num_frames": 9,
}


def recipe_args(
    teacher: str | Path, output_dir: str | Path, cache_dir: str | Path, recipe: dict | None = None
) -> list[str]:
    """train_distillation.py arguments of the stage-1 recipe (RECIPE unless `recipe`)."""
    recipe = RECIPE if recipe is None else recipe
    settings = {"teacher_path": teacher, "output_dir": output_dir, "cache_dir": cache_dir, **recipe}
    return [item for key, value in settings.items() for item in (f"--{key}", str(value))]


def ship(student_dir: str | Path, dest: Path = ASSET) -> Path:
    """Copy an exported student to `dest` (atomically), naming the teacher as TEACHER_REF."""
    from distill.toy.shipping import ship_student

    return ship_student(student_dir, dest, TEACHER_REF)


@entry_point
def main(argv: list[str] | None = None) -> int:
    parser = Parser(prog="python -m distill.toy.stage_one", description=__doc__.split("\n\n")[0])
    parser.add_argument("--retrain", action="store_true", help="train stage 1 again (~16 min) and ship it")
    parser.add_argument("--clips", action="store_true", help="the moving world's stage 1 (CLIP_RECIPE)")
    parser.add_argument(
        "--work_dir",
        action=PathAction,
        kind=Kind.OUTPUT_FOLDER,
        help="where the run itself goes (default outputs/toy-stage1[-clips])",
    )
    parser.add_argument(
        "--output",
        action=PathAction,
        kind=Kind.OUTPUT_FOLDER,
        help=f"where the student is shipped (default {ASSET} or {CLIP_ASSET})",
    )
    args = parser.parse_args(argv)
    args.output = args.output or str(CLIP_ASSET if args.clips else ASSET)
    args.work_dir = args.work_dir or ("outputs/toy-stage1-clips" if args.clips else "outputs/toy-stage1")
    if not args.retrain:
        parser.error(f"pass --retrain to train the stage-1 toy student (it replaces {args.output})")
    from distill.ops.errors import DistillError, Stage, report
    from distill.ops.paths import PathFlag, check_paths

    try:  # before the teacher is copied and 16 minutes of training start
        check_paths(
            [
                PathFlag("--work_dir", args.work_dir, Kind.OUTPUT_FOLDER),
                PathFlag("--output", args.output, Kind.OUTPUT_FOLDER),
            ]
        )
    except DistillError as error:
        return report(error)
    import torch

    from distill.config.cli import parse_config
    from distill.toy.shipped import write_toy_teacher
    from distill.train.trainer import Distiller

    torch.set_num_threads(1)  # tiny models: one thread is fastest on a shared machine
    work = Path(args.work_dir)
    try:
        teacher = write_toy_teacher(work / "teacher", overwrite=True)
        recipe = CLIP_RECIPE if args.clips else RECIPE
        result = Distiller(parse_config(recipe_args(teacher, work / "run", work / "cache", recipe))).run()
    except DistillError as error:
        # The run keeps its checkpoints in the work folder so an interrupted retrain resumes; one of
        # another teacher (the toy teacher was rebuilt since) is refused, and starting afresh is the way.
        afresh = f"start stage 1 afresh: remove {work}/ (or pass another --work_dir)"
        # The trainer's own ways out name flags this command does not take.
        error.fixes = [afresh] if error.stage == Stage.CHECKPOINT else [*error.fixes, afresh]
        return report(error)
    print(ship(result.student_dir, Path(args.output).absolute()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
