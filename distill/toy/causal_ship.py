"""The shipped causal streaming students of the toy clip teacher and their records: a separate student
(assets/toy_student_causal/) and a causal LoRA of the teacher's experts (assets/toy_student_causal_lora/).

    python -m distill.toy.causal_ship                         # the record's table and bars
    python -m distill.toy.causal_ship --retrain               # train it again (~12 min on 2 cores), score it, ship it
    python -m distill.toy.causal_ship --rescore               # score the shipped student again, rewrite its record
    python -m distill.toy.causal_ship --student lora ...      # the same for the causal LoRA (~15 min to retrain)

The recipes are distill/toy/causal_students.py's, each with chunks of 1 latent frame:

- the separate student: from the shipped bidirectional 4-step dmd clip student, 400 steps of ode_init
  then 40 of self_forcing, on the first 512 clip prompts' teacher samples;
- the LoRA: from the shipped bidirectional clip LoRA (assets/toy_student_clips_lora), 300 steps of
  self_forcing of the high-noise expert's adapters, then 300 of the low-noise expert's with the high
  one's held (`--expert_phase`), data-free on the first 512 clip prompts.

Each record holds its training commands and the student streamed (4 steps a chunk, the KV cache window
of generate --stream) on the world's 216 scored clip prompts, prompt i from seed i, with which prompts
it got right:

- at the trained length, decoded by the teacher's VAE, against the bars the exit code follows:
  accuracy >= 0.9 x the bidirectional student's it starts from at 4 steps (that student's own record,
  the same prompts and noise), and motion ratio 0.85-1.15;
- 3x longer (33 frames), decoded by the toy world's stream reader (distill/toy/stream_reader.py: the
  teacher's toy VAE cannot decode past the trained 9 frames) and scored by `score_stream`, against the
  issue's 3x bars: identity held in >= 90% of the streams, motion ratio 0.85-1.15, each shown beside
  what the world's own streams read through the same reader. Printed, not part of the exit code: the
  shipped students miss them (docs/streaming.md says how, and why).

CI streams each shipped student again and holds it to its record and bars (tests/test_toy_shipped_causal.py);
`make proofs` trains each again from scratch.
"""

from __future__ import annotations

import json
import shlex
import shutil
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from distill.ops.command import Parser, PathAction, entry_point
from distill.ops.paths import Kind
from distill.toy.t2v_students import ACCURACY_SHARE, MOTION_RANGE  # the clip students' bars

REPO = Path(__file__).resolve().parents[2]
RECORD_FILE = "toy_student.json"
TEACHER_REF = "outputs/toy-wan"  # where the demos write the toy teacher
STEPS = 4


def student_stage_args(
    teacher: Path | str, out: Path | str, cache: Path | str | None = None, start: Path | None = None
) -> list[list[str]]:
    """The separate student's two stages: ode_init from `start` (the shipped dmd clip student), then
    self_forcing from its export (OUT/ode_init/student)."""
    from distill.toy import causal_students as recipe

    ode = recipe.train_args(
        teacher,
        out,
        "ode_init",
        start or recipe.SHIPPED_DMD,
        recipe.CHUNK,
        recipe.ODE_STEPS,
        recipe.ode_init_extra(),
        cache,
    )
    forcing = recipe.train_args(
        teacher,
        out,
        "self_forcing",
        Path(out) / "ode_init" / "student",
        recipe.CHUNK,
        recipe.SELF_FORCING_STEPS,
        recipe.self_forcing_extra(),
        cache,
    )
    return [ode, forcing]


def lora_stage_args(
    teacher: Path | str, out: Path | str, cache: Path | str | None = None, start: Path | None = None
) -> list[list[str]]:
    """The causal LoRA's two phases: the high-noise expert's adapters from `start` (the shipped
    bidirectional clip LoRA), then the low-noise expert's from the high phase's (OUT/high/lora)."""
    from distill.toy import causal_students as recipe

    high, low = recipe.LORA_PHASES
    return [
        recipe.lora_phase_args(teacher, out, high, start or recipe.SHIPPED_LORA, cache),
        recipe.lora_phase_args(teacher, out, low, Path(out) / high / "lora", cache),
    ]


@dataclass(frozen=True)
class CausalStudent:
    """One shipped causal student: where it is shipped, the bidirectional student it starts from (whose
    4-step row its bar is a share of), its training runs and which of their folders is shipped."""

    asset: Path
    run_ref: str  # where its recorded commands write the runs
    reference: str  # distill.toy.t2v_ship's kind of the student it starts from
    stages: Callable[..., list[list[str]]]  # (teacher, out, cache, start) -> each run's arguments
    exported: str  # the shipped folder, inside the runs' folder
    rebuild: str

    def start(self) -> Path:
        from distill.toy import t2v_ship

        return t2v_ship.ASSETS[self.reference]


STUDENTS = {
    "full": CausalStudent(
        REPO / "assets" / "toy_student_causal",
        "outputs/toy-causal",
        "clips_dmd",
        student_stage_args,
        "self_forcing/student",
        "python -m distill.toy.causal_ship --retrain",
    ),
    "lora": CausalStudent(
        REPO / "assets" / "toy_student_causal_lora",
        "outputs/toy-causal-lora",
        "clips_lora",
        lora_stage_args,
        "low/lora",
        "python -m distill.toy.causal_ship --student lora --retrain",
    ),
}
FULL = STUDENTS["full"]


def commands(student: CausalStudent = FULL) -> list[str]:
    """The record's training commands, as run from the repository root."""
    ref = student.run_ref
    runs = student.stages(TEACHER_REF, ref, f"{ref}-cache", student.start().relative_to(REPO))
    return ["python train_distillation.py " + " ".join(shlex.quote(a) for a in args) for args in runs]


def streamed_clips(
    teacher: Path | str, folder: Path | str, count: int | None, frames: int, vae: Any
) -> tuple[list, list[str], float]:
    """The causal student of `folder` streamed (4 steps a chunk, generate --stream's KV cache window)
    on the first `count` (all 216) scored clip prompts, prompt i from seed i, each chunk decoded by
    `vae` as it finishes: (clips, prompts, mean share of a stream's time before its first frame)."""
    import torch

    from distill.models.causal.layout import CausalLayout
    from distill.models.few_step import load_few_step_scheduler
    from distill.models.pipelines import encode_prompts
    from distill.models.teacher import inspect_teacher
    from distill.sample.stream import default_window
    from distill.sample.student_folder import load_any_student
    from distill.toy.causal_students import CHUNK, clips
    from distill.toy.t2v_students import scored_prompts
    from distill.toy.world import CLIP_FRAMES

    prompts = scored_prompts(True, count)
    embeddings = encode_prompts(teacher, prompts, 512, torch.device("cpu"), torch.float32)
    embeds = torch.stack([embeddings[p] for p in prompts])
    info = inspect_teacher(str(teacher))
    # causal again: its folder holds causal_config.json (a LoRA folder's adapters run on the teacher's experts)
    model = load_any_student(folder, info, torch.device("cpu"), torch.float32).eval()
    window = default_window(CausalLayout(CHUNK), CLIP_FRAMES, info.vae_scale_temporal)
    made, first_share = clips(
        model, load_few_step_scheduler(folder), embeds, frames, vae, stream=True, window=window
    )
    return made, prompts, first_share


def streamed_row(teacher: Path | str, folder: Path | str, count: int | None = None) -> dict[str, Any]:
    """The causal student of `folder` streamed at the trained length, decoded by the teacher's VAE and
    scored as every toy clip student is (score_clips)."""
    import torch

    from distill.models.pipelines import load_vae
    from distill.toy.score import score_clips
    from distill.toy.t2v_students import FIGURES
    from distill.toy.world import CLIP_FRAMES

    vae = load_vae(teacher, torch.device("cpu"))
    made, prompts, first_share = streamed_clips(teacher, folder, count, CLIP_FRAMES, vae)
    result = score_clips(made, prompts)
    row = {"model": "causal", "steps": STEPS, **{k: result[k] for k in FIGURES if k in result}}
    return row | {"count": len(prompts), "first_frame_share": round(first_share, 3)}


STREAM_FIGURES = (
    "accuracy",
    "identity",
    "motion_ratio",
    "late_motion_ratio",
    "frames_shown",
    "correct",
    "held",
    "speeds",
)


def long_stream_row(teacher: Path | str, folder: Path | str, count: int | None = None) -> dict[str, Any]:
    """The causal student of `folder` streamed 3x longer than trained (STREAM_FRAMES), decoded by the
    toy world's stream reader (the teacher's toy VAE cannot decode past the trained length) and scored
    by score_stream."""
    from distill.toy.stream_reader import STREAM_FRAMES, load_reader
    from distill.toy.stream_score import score_stream

    made, prompts, first_share = streamed_clips(teacher, folder, count, STREAM_FRAMES, load_reader())
    result = score_stream(made, prompts)
    row = {
        "model": "causal",
        "steps": STEPS,
        "frames": STREAM_FRAMES,
        **{k: result[k] for k in STREAM_FIGURES},
    }
    return row | {"count": len(prompts), "first_frame_share": round(first_share, 3)}


def bidirectional_row(student: CausalStudent = FULL) -> dict[str, Any]:
    """The shipped bidirectional clip student `student` starts from, at 4 steps, from its record (the
    same prompts and noise)."""
    from distill.toy import t2v_ship
    from distill.toy.t2v_students import find_row

    record = json.loads((student.start() / t2v_ship.RECORD_FILE).read_text())
    return find_row(record["evaluation"]["rows"], student.reference, STEPS)


def bars(row: dict[str, Any], reference: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The trained length's bars of a streamed `row` against the bidirectional `reference` row."""
    floor = ACCURACY_SHARE * reference["accuracy"]
    return {
        "accuracy": {
            "value": row["accuracy"],
            "limit": f">= {floor:.3f} ({ACCURACY_SHARE} x the bidirectional student's {reference['accuracy']:.3f})",
            "met": bool(row["accuracy"] >= floor),
        },
        "motion_ratio": motion_bar(row.get("motion_ratio")),
    }


def motion_bar(ratio: float | None, beside: str = "") -> dict[str, Any]:
    """Motion ratio within MOTION_RANGE; `beside` is added to the limit's text."""
    low, high = MOTION_RANGE
    return {
        "value": ratio,
        "limit": f"{low}-{high}{beside}",
        "met": bool(ratio is not None and low <= ratio <= high),
    }


IDENTITY_SHARE = 0.9  # the issue's: identity held in >= 90% of the 3x streams


def long_stream_bars(row: dict[str, Any], floor: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The 3x stream's bars of `row`: identity held in >= 90% of the streams, motion ratio 0.85-1.15;
    each with what the world's own streams read through the same reader (`floor`), the most a
    student's stream can."""
    reader = " (the world's own streams through the reader: {:.3f})"
    return {
        "identity": {
            "value": row["identity"],
            "limit": f">= {IDENTITY_SHARE}" + reader.format(floor["identity"]),
            "met": bool(row["identity"] >= IDENTITY_SHARE),
        },
        "motion_ratio": motion_bar(row.get("motion_ratio"), reader.format(floor["motion_ratio"])),
    }


def unmet(found: dict[str, dict[str, Any]]) -> list[str]:
    return [f"{name} {b['value']} ({b['limit']})" for name, b in found.items() if not b["met"]]


def retrain(work: Path, student: CausalStudent = FULL) -> tuple[Path, dict[str, Any]]:
    """`student`'s runs from scratch in `work`; the exported folder and its record, not yet shipped."""
    from distill.config.cli import parse_config
    from distill.toy.shipped import write_toy_teacher
    from distill.train.trainer import Distiller

    teacher = write_toy_teacher(work / "teacher", overwrite=True)
    run = work / "run"
    shutil.rmtree(run, ignore_errors=True)  # a fresh run: the recipe is what gets shipped, not a resume
    for args in student.stages(teacher, run, work / "cache"):
        Distiller(parse_config(args)).run()
    exported = run / student.exported
    return exported, make_record(teacher, exported, student)


def make_record(teacher: Path, exported: Path, student: CausalStudent = FULL) -> dict[str, Any]:
    """The record of `student`'s recipe run in `exported`: its commands, its streamed row and bars."""
    from distill.toy.stream_reader import read_record

    row = streamed_row(teacher, exported)
    evaluation = {
        "count": row["count"],
        "noise_seed": 0,
        "row": row,
        "bars": bars(row, bidirectional_row(student)),
    }
    return {
        "commands": commands(student),
        "rebuild": student.rebuild,
        "evaluation": evaluation,
        "stream_3x": long_stream_record(teacher, exported, read_record()["floor"]),
    }


def long_stream_record(teacher: Path, exported: Path, floor: dict[str, Any]) -> dict[str, Any]:
    """The 3x stream's row on all 216 prompts, and its bars against the reader's `floor`."""
    row = long_stream_row(teacher, exported)
    return {"row": row, "bars": long_stream_bars(row, floor)}


def ship(exported: Path, record: dict[str, Any], student: CausalStudent = FULL) -> Path:
    from distill.toy.shipping import ship_student

    return ship_student(exported, student.asset, TEACHER_REF, (RECORD_FILE, record))


def table(record: dict[str, Any], student: CausalStudent = FULL) -> str:
    row, reference = record["evaluation"]["row"], bidirectional_row(student)
    lines = [f"{'model':<36}accuracy  motion  identity"] + [
        f"{label:<36}{r['accuracy']:.3f}     {r['motion_ratio']:.3f}   {r['identity']:.3f}"
        for label, r in (
            (f"bidirectional {student.reference}, 4 steps", reference),
            ("causal, streamed, 4 steps", row),
        )
    ]
    lines += [_bar_line(name, b) for name, b in record["evaluation"]["bars"].items()]
    long = record.get("stream_3x")
    if long is not None:
        row = long["row"]
        lines.append(
            f"causal, streamed 3x ({row['frames']} frames, read by the stream reader): accuracy "
            f"{row['accuracy']:.3f}, motion {row['motion_ratio']:.3f}, identity {row['identity']:.3f}"
        )
        lines += [_bar_line(f"3x {name}", b) for name, b in long["bars"].items()]
    return "\n".join(lines)


def _bar_line(name: str, bar: dict[str, Any]) -> str:
    return f"bar {name}: {bar['value']:.3f} ({bar['limit']}): {'met' if bar['met'] else 'MISSED'}"


@entry_point
def main(argv: list[str] | None = None) -> int:
    parser = Parser(prog="python -m distill.toy.causal_ship", description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--student",
        choices=sorted(STUDENTS),
        default="full",
        help="the separate causal student (full) or the causal LoRA of the teacher's experts (lora)",
    )
    parser.add_argument("--retrain", action="store_true", help="train it again, score it and ship it")
    parser.add_argument(
        "--rescore",
        action="store_true",
        help="score the shipped student again with today's code and rewrite its record (no training)",
    )
    parser.add_argument(
        "--work_dir",
        action=PathAction,
        kind=Kind.OUTPUT_FOLDER,
        default="outputs/causal-ship",
        help="the runs",
    )
    args = parser.parse_args(argv)
    student = STUDENTS[args.student]
    if args.retrain:
        import torch

        torch.set_num_threads(1)
        exported, record = retrain(Path(args.work_dir).absolute(), student)
        ship(exported, record, student)
    elif args.rescore:
        import torch

        from distill.toy.shipped import write_toy_teacher

        torch.set_num_threads(1)
        teacher = write_toy_teacher(Path(args.work_dir).absolute() / "teacher", overwrite=True)
        record = make_record(teacher, student.asset, student)
        (student.asset / RECORD_FILE).write_text(json.dumps(record, indent=2) + "\n")
    else:
        record = json.loads((student.asset / RECORD_FILE).read_text())
    print(table(record, student))
    return 1 if unmet(record["evaluation"]["bars"]) else 0


if __name__ == "__main__":
    sys.exit(main())
