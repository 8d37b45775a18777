"""Every shipped toy student trained again from scratch with its recorded command, and held to its
full bars: the long proof behind the README's toy tables (`make proofs`; not in CI, whose tests score
the shipped students and train each method briefly).

    python -m distill.toy.proofs                      # all of them (about 100 min on 2 CPU cores)
    python -m distill.toy.proofs --only dmd clips_dmd # some of them
    python -m distill.toy.proofs --ship               # and replace the shipped folders with the new runs

Students: the text-to-video ones of distill.toy.t2v_ship (dmd, lora, clips_dmd, clips_lora), the
image-to-video ones of distill.toy.i2v_ship (i2v_dmd, i2v_lora) and the velocity stage-1 students
the dmd students start from (stage1, clips_stage1: distill.toy.stage_one; i2v_stage1), and the
toy user LoRA with the speed LoRA distilled against teacher + it (user_lora: distill.toy.user_lora,
distill.toy.user_table; held to the four-row table's bars) and the causal streaming clip students, a
separate one and a causal LoRA (causal, causal_lora: distill.toy.causal_ship; held to the trained
length's bars, their 3x streams' printed). Each run goes to
outputs/proofs/NAME/; the shipped assets change only with --ship. A stage-1 student has no bars of
its own: it must score, at 4 steps of the few-step sampler on the world's 216 prompts, within 0.05 of
the shipped one it rebuilds. Prints one line per student and exits 1 when any bar is missed.

Run it before landing a change to a method, a sampler or the toy world.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable
from pathlib import Path

from distill.ops.command import Parser, PathAction, entry_point
from distill.ops.paths import Kind

STAGE_ONE_TOLERANCE = 0.05
USER_WORLD_FLOOR = 0.9


def prove_t2v(kind: str, work: Path, ship: bool) -> list[str]:
    """Retrain a text-to-video student; the bars it misses."""
    from distill.toy import t2v_ship
    from distill.toy.evaluation import score_table
    from distill.toy.t2v_students import unmet

    exported, record = t2v_ship.retrain(kind, work)
    print(score_table(record["evaluation"]["rows"], kind in t2v_ship.CLIPS))
    if ship:
        t2v_ship.ship(kind, exported, record)
    return unmet(record["evaluation"]["bars"])


def prove_i2v(kind: str, work: Path, ship: bool) -> list[str]:
    """Retrain an image-to-video student (scored on 72 held-out cases); the bars it misses."""
    from distill.toy import i2v_ship

    dest = i2v_ship.ASSETS[kind] if ship else work / "shipped"
    record = json.loads((i2v_ship.retrain(kind, work, dest) / i2v_ship.RECORD_FILE).read_text())
    print(record["table"])
    found = record["evaluation"]["bars"].get(kind, {})
    return [f"{name} {b['value']} ({b['limit']})" for name, b in found.items() if not b["met"]]


def prove_stage_one(clips: bool, work: Path, ship: bool) -> list[str]:
    """Retrain a stage-1 student; a miss when it scores more than STAGE_ONE_TOLERANCE from the shipped one."""
    from distill.config.cli import parse_config
    from distill.toy import stage_one
    from distill.toy.shipped import write_toy_teacher
    from distill.toy.t2v_students import student_rows
    from distill.train.trainer import Distiller

    teacher = write_toy_teacher(work / "teacher", overwrite=True)
    recipe = stage_one.CLIP_RECIPE if clips else stage_one.RECIPE
    shipped = stage_one.CLIP_ASSET if clips else stage_one.ASSET
    result = Distiller(
        parse_config(stage_one.recipe_args(teacher, work / "run", work / "cache", recipe))
    ).run()
    new, old = (
        student_rows(teacher, name, folder, clips, steps=(4,))[0]
        for name, folder in (("retrained", result.student_dir), ("shipped", shipped))
    )
    print(f"  at 4 steps: retrained {new['accuracy']:.2f}, shipped {old['accuracy']:.2f}")
    if ship:
        stage_one.ship(result.student_dir, shipped)
    gap = abs(new["accuracy"] - old["accuracy"])
    return (
        []
        if gap <= STAGE_ONE_TOLERANCE
        else [f"accuracy {new['accuracy']:.2f} ({old['accuracy']:.2f} shipped)"]
    )


def prove_user_lora(work: Path, ship: bool) -> list[str]:
    """Retrain the toy user LoRA and the speed LoRA distilled against teacher + it; the bars they miss
    (the teacher must draw the user's world with the new LoRA, USER_WORLD_FLOOR at 20 steps)."""
    from distill.toy import user_lora, user_table

    pair = user_lora.ASSET if ship else work / "user_lora"
    made = user_lora.retrain(work / "user-lora-work", user_lora.UserLoraRecipe(), pair)
    reference = made["teacher_20_steps"]["with_lora"]["user_world"]
    print(f"  teacher + the new user LoRA at 20 steps: {reference:.3f} in the user's world")
    exported, record = user_table.retrain(work / "speed", pair)
    print(user_table.table(record["evaluation"]["rows"]))
    if ship:
        user_table.ship(exported, record)
    missed = user_table.unmet(record["evaluation"]["bars"])
    if reference < USER_WORLD_FLOOR:
        missed.append(f"user LoRA {reference:.3f} (>= {USER_WORLD_FLOOR})")
    return missed


def prove_causal(kind: str, work: Path, ship: bool) -> list[str]:
    """Retrain a causal streaming clip student (the separate one, or the causal LoRA: both runs); the
    trained length's bars it misses."""
    from distill.toy import causal_ship

    student = causal_ship.STUDENTS[kind]
    exported, record = causal_ship.retrain(work, student)
    print(causal_ship.table(record, student))
    if ship:
        causal_ship.ship(exported, record, student)
    return causal_ship.unmet(record["evaluation"]["bars"])


def proofs() -> dict[str, Callable[[Path, bool], list[str]]]:
    """Every proof by name, stage-1 students first (the dmd students start from the shipped ones)."""
    from distill.toy import i2v_ship, t2v_ship

    found: dict[str, Callable[[Path, bool], list[str]]] = {
        "stage1": lambda work, ship: prove_stage_one(False, work, ship),
        "clips_stage1": lambda work, ship: prove_stage_one(True, work, ship),
    }
    for kind in i2v_ship.RECIPES:
        found[f"i2v_{kind}"] = lambda work, ship, kind=kind: prove_i2v(kind, work, ship)
    for kind in t2v_ship.RECIPES:
        found[kind] = lambda work, ship, kind=kind: prove_t2v(kind, work, ship)
    found["user_lora"] = prove_user_lora
    # from the shipped clips_dmd student, and from the shipped clips_lora
    found["causal"] = lambda work, ship: prove_causal("full", work, ship)
    found["causal_lora"] = lambda work, ship: prove_causal("lora", work, ship)
    return found


@entry_point
def main(argv: list[str] | None = None) -> int:
    every = proofs()
    parser = Parser(prog="python -m distill.toy.proofs", description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", nargs="+", choices=sorted(every), help="these students only")
    parser.add_argument("--ship", action="store_true", help="replace the shipped folders with the new runs")
    parser.add_argument(
        "--work_dir",
        action=PathAction,
        kind=Kind.OUTPUT_FOLDER,
        default="outputs/proofs",
        help="where the runs go",
    )
    args = parser.parse_args(argv)
    import torch

    torch.set_num_threads(1)  # tiny models: one thread is fastest on a shared machine
    missed: dict[str, list[str]] = {}
    for name in args.only or every:
        start = time.monotonic()
        print(f"== {name}", flush=True)
        missed[name] = every[name](Path(args.work_dir).absolute() / name, args.ship)
        verdict = "every bar met" if not missed[name] else "MISSED: " + "; ".join(missed[name])
        print(f"== {name}: {verdict} ({(time.monotonic() - start) / 60:.1f} min)", flush=True)
    failed = [name for name, misses in missed.items() if misses]
    print("proofs: " + ("all met" if not failed else f"bars missed by {', '.join(failed)}"))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
