"""Speed for a user's own model, on the toy world: a 4-step speed LoRA distilled against the teacher
carrying the user's LoRA, against the base speed LoRA stacked on it as users do today.

    python -m distill.toy.user_table                  # the table from the shipped pairs (`make demo-user-lora`)
    python -m distill.toy.user_table --retrain        # train the speed LoRA against the shipped user LoRA
                                                      # again and ship it (assets/toy_student_user_lora/)
    python -m distill.toy.user_table --retrain --user_lora DIR   # against another user pair (make proofs)

The user's LoRA (assets/toy_user_lora/, distill.toy.user_lora) teaches the toy teacher a palette the
base world does not have (distill.toy.user_world). On the world's 216 scored prompts, with the same
noise for every row, at two noise seeds (NOISE_SEEDS), every model sampled by stock `WanPipeline`
with its pairs loaded as adapters (distill.toy.user_stack):

1. `reference`: teacher + user LoRA, 20 steps at the teacher's guidance (4 / 3), its UniPC scheduler;
2. `base_speed`: the base 4-step speed LoRA (assets/toy_student_lora/) + the user LoRA, 4 steps,
   guidance 1: what users do today;
3. `user_speed`: the speed LoRA distilled against teacher + user LoRA (the trainer's LoRA recipe of
   distill.toy.t2v_ship plus `--teacher_lora`) + the user LoRA, 4 steps, guidance 1;
4. `user_speed_base_world`: the same speed LoRA without the user LoRA, scored in the base world (what
   it keeps of the bare model).

Rows 1-3 are scored in the user's world, row 4 in the base world. The bars (each seed on its own):
row 3 at least ACCURACY_SHARE of row 1; row 3 above row 2 on both seeds, by more than either row
moves between the seeds, and by a paired exact (McNemar) test over both seeds' samples at P_VALUE.
"""

from __future__ import annotations

import dataclasses
import json
import math
import shlex
import shutil
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from distill.ops.command import Parser, PathAction, entry_point, integer
from distill.ops.paths import Kind

REPO = Path(__file__).resolve().parents[2]
ASSET = REPO / "assets" / "toy_student_user_lora"
BASE_SPEED = REPO / "assets" / "toy_student_lora"
RECORD_FILE = "toy_student.json"
NOISE_SEEDS = (0, 1000)
"""Prompt i starts from the noise of seed + i: two disjoint sets of 216 noises."""
ACCURACY_SHARE = 0.9
P_VALUE = 0.01
ROWS = ("reference", "base_speed", "user_speed", "user_speed_base_world")
LABELS = {
    "reference": "teacher + user LoRA (the reference)",
    "base_speed": "base speed LoRA + user LoRA (what users do today)",
    "user_speed": "speed LoRA distilled against teacher + user LoRA, + user LoRA",
    "user_speed_base_world": "the same speed LoRA alone, on the base world (what it keeps)",
}
USER_LORA_REF = "assets/toy_user_lora"
"""How the shipped record names the user pair (the path `make demo-user-lora` reads it from)."""


def recipe(user_lora: str = USER_LORA_REF) -> dict[str, str]:
    """The trainer's LoRA recipe of the shipped toy speed LoRA (distill.toy.t2v_ship "lora"), with the
    teacher carrying `user_lora`."""
    from distill.toy.t2v_ship import RECIPES

    return {key: str(value) for key, value in RECIPES["lora"].items()} | {"teacher_lora": user_lora}


def recipe_args(
    teacher: str | Path, output_dir: str | Path, cache_dir: str | Path, user_lora: str
) -> list[str]:
    settings = {
        "teacher_path": teacher,
        "output_dir": output_dir,
        "cache_dir": cache_dir,
        **recipe(user_lora),
    }
    return [item for key, value in settings.items() for item in (f"--{key}", str(value))]


def command() -> str:
    """The shipped speed LoRA's run as a user types it (from the repository, on `download_wan.py --toy`'s teacher)."""
    from distill.toy.t2v_ship import TEACHER_REF

    run = "outputs/toy-user-speed-lora"
    args = recipe_args(TEACHER_REF, run, f"{run}-cache", USER_LORA_REF)
    return "python train_distillation.py " + " ".join(shlex.quote(a) for a in args)


def _row(name: str, seed: int, steps: int, guidance: Sequence[float], world: str, result: Mapping) -> dict:
    return {
        "model": name,
        "seed": seed,
        "steps": steps,
        "guidance": list(guidance),
        "world": world,
        "accuracy": result["accuracy"],
        "correct": result["correct"],
        "per_attribute": result["per_attribute"],
        "diversity_gap": result["diversity_gap"],
        "count": result["count"],
    }


def score_rows(
    teacher: str | Path,
    user_lora: str | Path,
    user_speed: str | Path,
    *,
    base_speed: str | Path = BASE_SPEED,
    rows: Sequence[str] = ROWS,
    seeds: Sequence[int] = NOISE_SEEDS,
    count: int | None = None,
) -> list[dict[str, Any]]:
    """`rows` (of ROWS) at every seed of `seeds`, on the first `count` scored prompts (all 216 by default)."""
    from distill.models.few_step import load_few_step_scheduler
    from distill.toy.evaluation import eval_prompts, load_parts, sample_pictures, score_pictures
    from distill.toy.user_stack import stacked_experts
    from distill.toy.user_world import score_user
    from distill.toy.world import guidance_of, read_world

    description = read_world(teacher) or {}
    guidance = guidance_of(description)
    full = int(description.get("sample_steps", 20))
    prompts = eval_prompts() if count is None else eval_prompts(count)
    parts = load_parts(teacher)
    plans = {
        "reference": ([("user", user_lora)], full, guidance, None, "user"),
        "base_speed": ([("user", user_lora), ("fast", base_speed)], 4, (1.0,), base_speed, "user"),
        "user_speed": ([("user", user_lora), ("fast", user_speed)], 4, (1.0,), user_speed, "user"),
        "user_speed_base_world": ([("fast", user_speed)], 4, (1.0,), user_speed, "base"),
    }
    found = []
    for name in rows:
        pairs, steps, scales, speed, world = plans[name]
        high, low = stacked_experts(teacher, pairs)
        scheduler = None if speed is None else load_few_step_scheduler(speed)
        for seed in seeds:
            pictures = sample_pictures(
                teacher,
                prompts,
                transformer=high,
                transformer_2=low,
                steps=steps,
                guidance_scale=scales[0],
                guidance_scale_2=scales[-1],
                seed=seed,
                scheduler=scheduler,
                parts=parts,
            )
            result = score_user(pictures, prompts) if world == "user" else score_pictures(pictures, prompts)
            found.append(_row(name, seed, steps, scales, world, result))
    return found


def find(rows: Sequence[Mapping[str, Any]], model: str, seed: int) -> Mapping[str, Any]:
    return next(r for r in rows if r["model"] == model and r["seed"] == seed)


def paired_p_value(a: str, b: str) -> float:
    """Two-sided exact McNemar test of two `correct` strings of the same samples: the chance that the
    samples only one of them gets right split at least this unevenly if both were equally good."""
    only_a = sum(x == "1" and y == "0" for x, y in zip(a, b))
    only_b = sum(x == "0" and y == "1" for x, y in zip(a, b))
    n, k = only_a + only_b, min(only_a, only_b)
    if n == 0:
        return 1.0
    tail = sum(math.comb(n, i) for i in range(k + 1)) / 2**n
    return min(1.0, 2.0 * tail)


def bars(rows: Sequence[Mapping[str, Any]]) -> dict[str, dict[str, Any]]:
    """{bar: {"value", "limit", "met"}} of the user speed LoRA against the reference and the base speed LoRA."""
    seeds = sorted({r["seed"] for r in rows})
    found: dict[str, dict[str, Any]] = {}
    for seed in seeds:
        ours, reference = find(rows, "user_speed", seed), find(rows, "reference", seed)
        floor = ACCURACY_SHARE * reference["accuracy"]
        found[f"share_seed_{seed}"] = {
            "value": ours["accuracy"],
            "limit": f">= {floor:.3f} ({ACCURACY_SHARE} x the reference)",
            "met": ours["accuracy"] >= floor,
        }
    gaps = [find(rows, "user_speed", s)["accuracy"] - find(rows, "base_speed", s)["accuracy"] for s in seeds]
    # How much a row moves when only the noise changes: the gap must be larger than that.
    noise = max(
        abs(find(rows, model, seeds[0])["accuracy"] - find(rows, model, seed)["accuracy"])
        for model in ("user_speed", "base_speed")
        for seed in seeds
    )
    found["gap_over_noise"] = {
        "value": min(gaps),
        "limit": f"> {noise:.3f} (the largest change of either row between noise seeds)",
        "met": min(gaps) > noise,
    }
    ours = "".join(find(rows, "user_speed", s)["correct"] for s in seeds)
    base = "".join(find(rows, "base_speed", s)["correct"] for s in seeds)
    p = paired_p_value(ours, base)
    found["paired_test"] = {
        "value": p,
        "limit": f"< {P_VALUE} (exact McNemar over {len(ours)} paired samples), and row 3 ahead",
        "met": p < P_VALUE and min(gaps) > 0,
    }
    return found


def unmet(found: Mapping[str, Mapping[str, Any]]) -> list[str]:
    return [f"{name} {b['value']} ({b['limit']})" for name, b in found.items() if not b["met"]]


def table(rows: Sequence[Mapping[str, Any]]) -> str:
    """The markdown table: one line per model, accuracy at each seed and their mean."""
    seeds = sorted({r["seed"] for r in rows})
    head = "| model | steps | guidance | scored in | " + " | ".join(f"noise seed {s}" for s in seeds)
    lines = [head + " | mean | diversity gap |", "|---|---:|---:|---|" + "---:|" * (len(seeds) + 2)]
    for model in dict.fromkeys(r["model"] for r in rows):
        mine = [find(rows, model, s) for s in seeds]
        accuracy = [r["accuracy"] for r in mine]
        gaps = [r["diversity_gap"] for r in mine if r["diversity_gap"] is not None]
        cells = [
            LABELS.get(model, model),
            str(mine[0]["steps"]),
            " / ".join(f"{g:g}" for g in mine[0]["guidance"]),
            f"the {mine[0]['world']} world",
            *(f"{a:.3f}" for a in accuracy),
            f"**{sum(accuracy) / len(accuracy):.3f}**",
            f"{sum(gaps) / len(gaps):.2f}" if gaps else "-",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def evaluation(teacher: Path, user_lora: Path, user_speed: Path, count: int | None = None) -> dict[str, Any]:
    rows = score_rows(teacher, user_lora, user_speed, count=count)
    return {"count": rows[0]["count"], "noise_seeds": list(NOISE_SEEDS), "rows": rows, "bars": bars(rows)}


def retrain(work: Path, user_lora: Path) -> tuple[Path, dict[str, Any]]:
    """Distil the speed LoRA against the toy teacher + `user_lora` from scratch in `work`, with the
    recipe; its exported lora/ and its record (command, table rows, bars), not yet shipped."""
    from distill.config.cli import parse_config
    from distill.toy.shipped import write_toy_teacher
    from distill.train.trainer import Distiller

    teacher = write_toy_teacher(work / "teacher", overwrite=True)
    run, cache = work / "run", work / "cache"
    if run.exists():
        shutil.rmtree(run)  # a fresh run: the recipe is what gets shipped, not a resume
    args = recipe_args(teacher, run, cache, str(user_lora))
    args = [str(REPO / a) if a == recipe()["data_path"] else a for a in args]
    Distiller(parse_config(args)).run()
    exported = run / "lora"
    record = {
        "command": command(),
        "rebuild": "python -m distill.toy.user_table --retrain",
        "evaluation": evaluation(teacher, user_lora, exported),
    }
    return exported, record


def ship(exported: Path, record: dict[str, Any], dest: Path = ASSET) -> Path:
    """Ship the run's lora/ to `dest` with `record`; its run settings name the user pair as the
    repository does (USER_LORA_REF), not the folder it was read from."""
    from distill.sample.run_settings import RUN_SETTINGS_FILE, read_run_settings, write_run_settings
    from distill.toy.shipping import ship_student
    from distill.toy.t2v_ship import TEACHER_REF

    settings = read_run_settings(exported / RUN_SETTINGS_FILE)
    loras = [lora | {"file": f"{USER_LORA_REF}/{Path(lora['file']).name}"} for lora in settings.teacher_loras]
    write_run_settings(dataclasses.replace(settings, teacher_loras=loras), exported)
    return ship_student(exported, dest, TEACHER_REF, (RECORD_FILE, record))


@entry_point
def main(argv: list[str] | None = None) -> int:
    from distill.toy.user_lora import ASSET as USER_ASSET

    parser = Parser(prog="python -m distill.toy.user_table", description=__doc__.split("\n\n")[0])
    parser.add_argument("--retrain", action="store_true", help="distil the speed LoRA again and ship it")
    parser.add_argument(
        "--user_lora", action=PathAction, kind=Kind.FOLDER, help=f"the user pair (default {USER_ASSET})"
    )
    parser.add_argument(
        "--speed_lora", action=PathAction, kind=Kind.FOLDER, help=f"the speed LoRA scored (default {ASSET})"
    )
    parser.add_argument(
        "--work_dir", action=PathAction, kind=Kind.OUTPUT_FOLDER, help="where --retrain's run goes"
    )
    parser.add_argument("--count", type=integer(1), default=None, help="scored prompts (default: all 216)")
    args = parser.parse_args(argv)
    import torch

    from distill.toy.shipped import write_toy_teacher

    torch.set_num_threads(1)  # tiny models: one thread is fastest on a shared machine
    user_lora = Path(args.user_lora or USER_ASSET).absolute()
    work = Path(args.work_dir or "outputs/toy-user-speed-lora").absolute()
    if args.retrain:
        exported, record = retrain(work, user_lora)
        print(ship(exported, record))
        result = record["evaluation"]
    else:
        teacher = write_toy_teacher(work / "teacher", overwrite=True)
        result = evaluation(teacher, user_lora, Path(args.speed_lora or ASSET).absolute(), args.count)
    print(table(result["rows"]))
    missed = unmet(result["bars"])
    print("bars: " + ("all met" if not missed else "NOT MET: " + "; ".join(missed)))
    print(json.dumps({name: b["met"] for name, b in result["bars"].items()}))
    # The table is a report: a retrain (a proof) fails on a missed bar, a scoring of it does not.
    return 1 if missed and args.retrain else 0


if __name__ == "__main__":
    sys.exit(main())
