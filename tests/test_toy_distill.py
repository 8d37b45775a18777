"""Distillation measured by what the pictures show: a student distilled from the toy teacher."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import REPO, train_args
from diffusers import WanTransformer3DModel

from distill.config.cli import parse_config
from distill.evaluate import main as evaluate_main
from distill.toy.evaluation import eval_prompts, sample_pictures, score_pictures
from distill.train.trainer import Distiller

pytestmark = [pytest.mark.long, pytest.mark.usefixtures("one_thread")]
STEPS = 10  # sampler steps of the students in these tests


@pytest.fixture(scope="module")
def distilled(toy_teacher, tmp_path_factory):
    """A student distilled briefly from the toy teacher: velocity distillation at guidance 1, as
    stage 1 of the recipe learns it (the guided velocity is a harder target for a short run from
    random weights). Measured, mean attribute score on the 48 prompts below: 0.48 after these 800
    steps (0.26 untrained; 500 steps gave 0.40 on the shipped teacher and 0.41 on the previous one,
    on the bar's edge); the background is learnt first, then place, shape and colour."""
    out = tmp_path_factory.mktemp("toy_run")
    args = train_args(
        toy_teacher,
        out / "run",
        out / "cache",
        student_config=REPO / "config" / "student_toy.json",
        data_path=REPO / "data" / "toy_prompts.txt",
        max_prompts=None,  # all 216: on 8 of them 500 steps learnt the background and little else
        height=32,
        width=32,
        teacher_sample_steps=10,
        guidance_scale=1.0,
        guidance_scale_2=1.0,
        batch_size=16,
        num_steps=800,  # the suite's time budget: each 100 steps cost about 8 s
        lr=5e-3,
        lr_warmup_steps=25,
        log_every=50,
    )
    Distiller(parse_config(args)).run()
    return out / "run" / "student"


def test_distilled_student_draws_the_prompts_far_better_than_an_untrained_one(toy_teacher, distilled):
    prompts = eval_prompts(48)
    trained = WanTransformer3DModel.from_pretrained(distilled).eval()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        untrained = WanTransformer3DModel.from_config(trained.config).eval()
    scores = {
        name: score_pictures(sample_pictures(toy_teacher, prompts, transformer=model, steps=STEPS), prompts)
        for name, model in (("trained", trained), ("untrained", untrained))
    }
    # Mean over the four attributes: a short run learns the background and some of the layout long
    # before it gets all four right at once (README, The toy world, has the full-run numbers).
    mean = {name: sum(s["per_attribute"].values()) / 4 for name, s in scores.items()}
    assert mean["trained"] >= mean["untrained"] + 0.15, scores
    # Measured: 1.0 (untrained: chance, 1/3).
    assert scores["trained"]["per_attribute"]["background"] >= 0.9, scores["trained"]


def test_evaluate_adds_toy_scores_for_a_toy_teacher(toy_teacher, distilled, tmp_path):
    code = evaluate_main(
        [
            "--student",
            str(distilled),
            "--teacher_path",
            str(toy_teacher),
            "--prompts",
            str(REPO / "data" / "toy_sample_prompts.txt"),
            "--output_dir",
            str(tmp_path),
            "--height",
            "32",
            "--width",
            "32",
            "--steps",
            "4",
            "--max_prompts",
            "2",
            "--num_buckets",
            "2",
            "--toy_prompts",
            "16",
        ]
    )
    assert code == 0
    toy = json.loads((tmp_path / "eval.json").read_text())["toy"]
    assert toy["prompts"] == 16  # of the world's 216 (the default scores all of them)
    assert toy["teacher"]["steps"] > toy["teacher_at_student_steps"]["steps"] == toy["student"]["steps"] == 4
    for name in ("teacher", "teacher_at_student_steps", "student"):
        entry = toy[name]
        assert 0.0 <= entry["accuracy"] <= 1.0 and entry["diversity_gap"] >= 0.0
        assert set(entry["per_attribute"]) == {"colour", "shape", "position", "background"}
    # The teacher at its full step count is the calibrated one (README table).
    assert toy["teacher"]["per_attribute"]["background"] >= 0.9
    assert toy["teacher"]["accuracy"] > 10 * toy["chance"]["all"]
    assert (tmp_path / "eval.png").is_file()


def test_evaluate_leaves_other_teachers_without_toy_scores(tiny_teacher, tmp_path):
    from distill.report.toy_report import add_toy_report

    result = {"denoiser": None}
    assert add_toy_report(result, tiny_teacher, None, None, None, None, tmp_path) is result
    assert "toy" not in result
