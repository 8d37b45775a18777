"""Few-step students of the toy image-to-video teacher: they keep the input image and keep moving.

The two students are shipped (assets/toy_i2v_student_dmd/: a dmd student of the low-noise expert's
shape that replaces both experts, started from the shipped velocity stage 1,
assets/toy_i2v_student_stage1/; assets/toy_i2v_student_lora/: a LoRA of the teacher's own experts),
made by the commands of their toy_i2v_student.json (`python -m distill.toy.i2v_ship --retrain
stage1|dmd|lora`, minutes each); these tests score them, not train them, against the teacher on the
same held-out images, prompts and noise, through stock WanImageToVideoPipeline. The run a user starts
from the data writer's file is proven here in a few steps."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from conftest import train_args
from PIL import Image

from distill.config.cli import parse_config
from distill.data.images import read_image_prompts
from distill.ops.errors import DistillError
from distill.sample.run_settings import read_run_settings
from distill.toy.i2v_data import IMAGES, PROMPTS_FILE, write_i2v_data
from distill.toy.i2v_evaluation import load_pipeline, sample_cases
from distill.toy.i2v_ship import ASSETS, DEMO_KINDS, RECIPES, RECORD_FILE, TEACHER_REF, recipe
from distill.toy.i2v_students import (
    ADHERENCE_SHARE,
    DIVERSITY_FACTOR,
    MOTION_RANGE,
    ONE_STEP_LEAD,
    STATIC_SLACK,
    evaluate_students,
    student_pipeline,
)
from distill.toy.image_score import HELD_OUT_SEED, IDENTITY_CHANCE, frame_error, motion_of, motion_prompts
from distill.toy.shipped import I2V_ASSETS
from distill.toy.world import CLIP_FRAMES, motions, parse_prompt
from distill.train.trainer import Distiller

pytestmark = pytest.mark.usefixtures("one_thread")
# One held-out case of each motion (the first of the 72 the shipped records scored), at the records'
# noise. Nine cases move a rate in steps of 0.11, so the bars below leave MARGIN (twice it for the
# one-step lead, which moved between 0.22 and 0.44 over noise seeds): on four noise seeds (0, 1000,
# 2000, 3000; the same nine images) every assertion held with at least one case (0.11) to spare.
CASES = len(motions())
MARGIN = 0.1


@pytest.fixture(scope="module")
def scored() -> dict:
    """Teacher (full steps and one step) and both shipped students (4 steps and one) on CASES cases."""
    students = {kind: ASSETS[kind] for kind in ("dmd", "lora")}
    report, _, _ = evaluate_students(I2V_ASSETS, students, count=CASES, teacher_steps=(1,))
    return {(row["model"], row["steps"]): row for row in report["rows"]}


def figures(scored: dict) -> dict:
    keys = ("adherence", "motion_ratio", "static_rate", "diversity_gap", "clip_accuracy")
    return {f"{m} {s}": tuple(round(r[k], 2) for k in keys) for (m, s), r in scored.items()}


def assert_keeps_the_motion_and_the_first_frame(student: dict, teacher: dict, shown: dict) -> None:
    """The issue's bars other than adherence: motion ratio 0.85-1.15, static clips no more than the
    teacher's + 0.05, diversity gap at most twice the teacher's (with MARGIN); frame 0 is the image
    and the track starts where the image put it."""
    low, high = MOTION_RANGE
    assert low - MARGIN / 2 <= student["motion_ratio"] <= high + MARGIN / 2, shown
    assert student["static_rate"] <= teacher["static_rate"] + STATIC_SLACK, shown
    assert student["diversity_gap"] <= DIVERSITY_FACTOR * teacher["diversity_gap"] + MARGIN, shown
    # The teacher's own start misses one of these nine cases on most noise seeds.
    assert student["parts"]["first_frame"] >= 0.9 and student["parts"]["start"] >= 0.75, student["parts"]


@pytest.mark.parametrize("kind", ["dmd", "lora"])
def test_a_shipped_four_step_student_keeps_the_image_and_the_motion(scored, kind) -> None:
    """Every bar of the issue: adherence at least 0.9x the teacher's at its full steps (72 cases: the
    LoRA 0.68, the dmd student 0.69, against the teacher's 0.74), and the rest."""
    teacher, student = scored["teacher", 20], scored[kind, 4]
    assert student["adherence"] >= ADHERENCE_SHARE * teacher["adherence"] - MARGIN, figures(scored)
    assert student["adherence"] >= IDENTITY_CHANCE + 0.3, figures(scored)  # far from the text-only failure
    assert_keeps_the_motion_and_the_first_frame(student, teacher, figures(scored))


@pytest.mark.parametrize("kind", ["dmd", "lora"])
def test_at_one_step_a_shipped_student_is_far_ahead_of_the_teacher(scored, kind) -> None:
    """Adherence or full-prompt accuracy 0.3 above the teacher's at one step (72 cases: +0.42 and
    +0.43), 2 x MARGIN less on nine cases."""
    one_step, teacher = scored[kind, 1], scored["teacher", 1]
    lead = max(one_step[k] - teacher[k] for k in ("adherence", "clip_accuracy"))
    assert lead >= ONE_STEP_LEAD - 2 * MARGIN, figures(scored)


@pytest.mark.parametrize("kind", sorted(RECIPES))
def test_the_shipped_students_are_what_their_recorded_commands_make(kind) -> None:
    """Each folder's run settings say what its toy_i2v_student.json's command asked for (every flag of
    its recipe, the dmd student's start being the shipped stage 1), and the record's 72-case table is
    in it."""
    folder = ASSETS[kind]
    record = json.loads((folder / RECORD_FILE).read_text())
    wanted = recipe(kind, TEACHER_REF)
    for key, value in wanted.items():
        assert f"--{key} {value} " in record["command"] + " ", key
    settings = read_run_settings(folder / "run_settings.json")
    assert settings.method == wanted["method"] and settings.trained_steps == int(wanted["num_steps"])
    guidance = (float(wanted["guidance_scale"]), float(wanted["guidance_scale_2"]))
    assert (settings.teacher_guidance_scale, settings.teacher_guidance_scale_2) == guidance
    assert settings.num_frames == CLIP_FRAMES and settings.teacher_path == TEACHER_REF
    evaluation = record["evaluation"]
    assert evaluation["count"] >= 72 and evaluation["seed"] == HELD_OUT_SEED
    assert {(r["model"], r["steps"]) for r in evaluation["rows"]} >= {("teacher", 20), (kind, 4), (kind, 1)}
    assert sum(p.stat().st_size for p in folder.rglob("*") if p.is_file()) < 3 * 2**20


def test_the_data_writer_pairs_held_out_free_images_with_motion_and_clip_prompts(tmp_path) -> None:
    prompts = write_i2v_data(tmp_path / "data", count=16, seed=5)
    assert prompts == tmp_path / "data" / PROMPTS_FILE
    pairs = read_image_prompts(prompts)  # the trainer's own reader
    assert len(pairs) == 16 and all(p.image.parent.name == IMAGES for p in pairs)
    named = [p for p in pairs if parse_prompt(p.prompt) is not None]
    assert len(named) == 4  # 1 in 4: the full clip prompt of the same clip
    cases = motion_prompts(16, 5)
    for pair, case in zip(pairs, cases):
        assert motion_of(pair.prompt) == motion_of(case.prompt)
        image = np.asarray(Image.open(pair.image), dtype=np.float32) / 255.0
        assert frame_error(image, case.image) < 0.01  # the clip's frame 0, rounded to 8 bits
    held_out = [case.image for case in motion_prompts(16)]
    assert min(frame_error(case.image, other) for case in cases for other in held_out) > 0.0
    with pytest.raises(DistillError, match="held-out"):
        write_i2v_data(tmp_path / "refused", count=4, seed=HELD_OUT_SEED)


def test_the_data_writers_file_trains_an_i2v_dmd_student_that_the_stock_pipeline_loads(tmp_path) -> None:
    """The dmd recipe (a few steps of it, from the shipped stage 1 with the teacher's low-noise expert as
    its critic) on the toy I2V teacher from the writer's file; the exported pipeline/ samples in stock WanImageToVideoPipeline exactly as the evaluation samples the student."""
    from diffusers import WanImageToVideoPipeline

    from distill.toy.shipped import write_toy_teacher

    teacher = write_toy_teacher(tmp_path / "teacher", source=I2V_ASSETS)
    data = write_i2v_data(tmp_path / "data", count=8, seed=5)
    quick = ("num_steps", "batch_size", "log_every", "critic_updates", "teacher_sample_steps")
    settings = {k: v for k, v in recipe("dmd", teacher, absolute=True).items() if k not in quick}
    args = train_args(
        teacher,
        tmp_path / "run",
        tmp_path / "cache",
        **settings,
        data_path=data,
        max_prompts=None,
        num_steps=3,
        batch_size=2,
        critic_updates=2,
        teacher_sample_steps=2,
    )
    result = Distiller(parse_config(args)).run()
    student = tmp_path / "run" / "student"
    assert json.loads((student / "config.json").read_text())["in_channels"] == 36
    cases = motion_prompts(2)
    ours = sample_cases(student_pipeline(student, load_pipeline(teacher), teacher), cases, 4, (1.0, 1.0))
    stock = WanImageToVideoPipeline.from_pretrained(tmp_path / "run" / "pipeline", torch_dtype=torch.float32)
    stock.set_progress_bar_config(disable=True)
    theirs = sample_cases(stock, cases, 4, (1.0, 1.0))
    assert result.student_dir is not None and ours.shape == (2, CLIP_FRAMES, 32, 32, 3)
    np.testing.assert_allclose(theirs, ours, atol=1e-5)


def test_make_demo_i2v_trains_what_the_shipped_students_record() -> None:
    """Each of the demo's two training commands carries its recipe's settings (the shipped students'
    own), and only those."""
    makefile = (I2V_ASSETS.parents[1] / "Makefile").read_text()
    block = makefile.split("\ndemo-i2v:", 1)[1].split("\n\n", 1)[0]
    shared = makefile.split("\nI2V_RUN :=", 1)[1].split("\ndemo-i2v:", 1)[0]
    commands = [shared + c.split("\n\t$(DEMO_ENV)", 1)[0] for c in block.split("train_distillation.py")[1:]]
    by_kind = {
        "lora" if "--student_lora_rank" in c else "dmd": " ".join(c.replace("\\", " ").split())
        for c in commands
    }
    assert sorted(by_kind) == sorted(DEMO_KINDS)
    for kind in DEMO_KINDS:
        wanted = recipe(kind, "$(I2V_TEACHER)")
        flags = {f"--{key}" for key in wanted if key != "seed"}  # the demo's SEED: 0 unless given
        for key, value in wanted.items():
            if key != "seed":
                assert f"--{key} {value} " in by_kind[kind] + " ", (kind, key)
        given = {word for word in by_kind[kind].split() if word.startswith("--")}
        assert given - flags <= {"--teacher_path", "--data_path", "--output_dir", "--cache_dir", "--seed"}, (
            kind
        )
