"""The shipped 4-step students of the toy text-to-video teacher meet every bar, scored again here.

assets/toy_student_{dmd,lora,clips_dmd,clips_lora}/ are the runs of the README's and the docs' toy
commands (`python -m distill.toy.t2v_ship --retrain KIND`; `make proofs` trains them all again from
scratch), each with its record: the command, every row of its evaluation (with which prompts each row
got right) and its bars. These tests score each shipped student again on all of the world's 216
scored prompts with the code of today (seconds, not the minutes of training them), hold it to its
record sample by sample, and to the full bars against the teacher's recorded rows; the teacher's rows
are checked against what it draws today on a slice of the same prompts. That training moves these
scores is proven by short runs (tests/test_toy_methods_*.py).
"""

from __future__ import annotations

import json

import pytest
from conftest import REPO

from distill.sample.run_settings import read_run_settings
from distill.toy.t2v_ship import ASSETS, CLIPS, EXPORTED, RECIPES, RECORD_FILE, TEACHER_REF, command
from distill.toy.t2v_students import bars, find_row, mismatches, student_rows, teacher_rows, unmet

pytestmark = pytest.mark.usefixtures("one_thread")
KINDS = sorted(ASSETS)
# Samples allowed to read differently from the record: another CPU rounds some sums otherwise, and a
# sample on the edge of a colour or a class can flip. Measured on the machine that shipped them: 0.
FLIPS = 2
TEACHER_SLICE = 48  # the teacher's prompts drawn again (the first of the scored ones)


def record_of(kind: str) -> dict:
    return json.loads((ASSETS[kind] / RECORD_FILE).read_text())


@pytest.fixture(scope="module")
def rescored(toy_teacher) -> dict[str, list[dict]]:
    """Each shipped student's rows, sampled and scored today (clips: 4 and 1 step; pictures: 4)."""
    return {
        kind: student_rows(
            toy_teacher, kind, ASSETS[kind], kind in CLIPS, steps=(4, 1) if kind in CLIPS else (4,)
        )
        for kind in KINDS
    }


@pytest.mark.parametrize("kind", KINDS)
def test_a_shipped_student_scores_today_what_its_record_says(rescored, kind):
    recorded = record_of(kind)["evaluation"]["rows"]
    for row in rescored[kind]:
        was = find_row(recorded, kind, row["steps"])
        assert mismatches(row["correct"], was["correct"]) <= FLIPS, (
            kind,
            row["steps"],
            row["accuracy"],
            was["accuracy"],
        )
        if kind in CLIPS:
            assert row["motion_ratio"] == pytest.approx(was["motion_ratio"], abs=0.03)


@pytest.mark.parametrize("kind", KINDS)
def test_a_shipped_student_meets_every_bar_against_the_teacher(rescored, kind):
    """Pictures: accuracy >= 0.9x the teacher's at 20 steps and 0.15 above it at 4 steps, diversity gap
    <= 2x; clips: >= 0.9x, motion ratio 0.85-1.15, gap <= 2x, direction >= 0.9, and at one step 0.3
    above the teacher at one step (distill.toy.t2v_students)."""
    recorded = record_of(kind)["evaluation"]["rows"]
    teacher = [row for row in recorded if row["model"] == "teacher"]
    today = {row["steps"]: row for row in rescored[kind]}
    student = [today.get(row["steps"], row) for row in recorded if row["model"] == kind]
    found = bars(teacher + student, kind, kind in CLIPS)
    assert not unmet(found), found
    assert set(found) >= (
        {"accuracy", "diversity_gap"}
        | ({"motion_ratio", "one_step_lead"} if kind in CLIPS else {"four_step_lead"})
    )


@pytest.mark.parametrize("clips", [False, True], ids=["pictures", "clips"])
def test_the_teachers_recorded_rows_are_what_it_draws_today(toy_teacher, clips):
    """The bars compare with the teacher's recorded rows: on the first TEACHER_SLICE prompts the
    teacher draws today what they say, at its full steps and at 4 and 1."""
    kind = "clips_dmd" if clips else "dmd"
    recorded = [row for row in record_of(kind)["evaluation"]["rows"] if row["model"] == "teacher"]
    today = teacher_rows(toy_teacher, clips, count=TEACHER_SLICE, steps=[row["steps"] for row in recorded])
    for row, was in zip(today, recorded):
        assert mismatches(row["correct"], was["correct"][:TEACHER_SLICE]) <= FLIPS, (
            row["steps"],
            row["accuracy"],
        )
    other = "clips_lora" if clips else "lora"  # both students of a world are held to the same teacher rows
    others = [r for r in record_of(other)["evaluation"]["rows"] if r["model"] == "teacher"]
    assert [r["steps"] for r in others] == [r["steps"] for r in recorded]
    assert all(mismatches(a["correct"], b["correct"]) <= FLIPS for a, b in zip(others, recorded))


@pytest.mark.parametrize("kind", KINDS)
def test_a_shipped_student_is_what_its_recorded_command_makes(kind):
    """The record's command is the recipe of today's code, the run settings say what it asked for,
    and the folder is small enough to ship."""
    record = record_of(kind)
    assert record["command"] == command(kind)
    assert record["rebuild"] == f"python -m distill.toy.t2v_ship --retrain {kind}"
    wanted = RECIPES[kind]
    settings = read_run_settings(ASSETS[kind] / "run_settings.json")
    assert settings.method == wanted["method"] and settings.trained_steps == wanted["num_steps"]
    assert settings.num_frames == wanted["num_frames"] and settings.teacher_path == TEACHER_REF
    guidance = (wanted.get("guidance_scale", 4.0), wanted.get("guidance_scale_2", 3.0))
    assert (settings.teacher_guidance_scale, settings.teacher_guidance_scale_2) == guidance
    assert record["evaluation"]["count"] == 216 and record["evaluation"]["bars"]
    files = [p for p in ASSETS[kind].rglob("*") if p.is_file()]
    assert sum(p.stat().st_size for p in files) < 3 * 2**20
    assert (EXPORTED[kind] == "lora") == (ASSETS[kind] / "adapter_config.json").is_file()


@pytest.mark.parametrize("target, kind", [("demo", "dmd"), ("demo-clips", "clips_dmd")])
def test_make_demo_trains_what_the_shipped_student_records(target, kind):
    """The demo's training command carries every flag of the recipe, with its value."""
    makefile = (REPO / "Makefile").read_text()
    block = makefile.split(f"\n{target}:", 1)[1].split("\n\n", 1)[0]
    trained = " ".join(
        block.split("train_distillation.py", 1)[1].split("\n\t$(DEMO_ENV)", 1)[0].replace("\\", " ").split()
    )
    for key, value in RECIPES[kind].items():
        if key != "seed":  # the demo's SEED: 0 unless given
            assert f"--{key} {value} " in trained + " ", (target, key)


def test_the_shipped_lora_loads_in_stock_wan_pipeline_and_draws_what_ours_does(toy_teacher):
    """The files as users load them: stock WanPipeline + load_lora_weights, not our loader."""
    from diffusers import WanPipeline

    from distill.models.few_step import load_few_step_scheduler
    from distill.models.lora_files import FILES
    from distill.toy.evaluation import eval_prompts, sample_pictures, score_pictures

    folder = ASSETS["lora"]
    pipe = WanPipeline.from_pretrained(str(toy_teacher))
    pipe.load_lora_weights(str(folder), weight_name=FILES["high"], adapter_name="fast")
    pipe.load_lora_weights(
        str(folder), weight_name=FILES["low"], adapter_name="fast_2", load_into_transformer_2=True
    )
    prompts = eval_prompts(48)
    stock = score_pictures(
        sample_pictures(
            toy_teacher,
            prompts,
            transformer=pipe.transformer,
            transformer_2=pipe.transformer_2,
            steps=4,
            scheduler=load_few_step_scheduler(folder),
        ),
        prompts,
    )
    ours = find_row(record_of("lora")["evaluation"]["rows"], "lora", 4)
    assert mismatches(stock["correct"], ours["correct"][:48]) <= FLIPS
