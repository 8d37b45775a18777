"""`python -m distill.evaluate` on a toy teacher adds the toy world's scores (teacher at its full steps
and at the student's, and the student); on any other teacher it adds none."""

from __future__ import annotations

import json

from conftest import REPO

from distill.evaluate import main as evaluate_main
from distill.toy.stage_one import ASSET


def test_evaluate_adds_toy_scores_for_a_toy_teacher(toy_teacher, tmp_path):
    code = evaluate_main(
        [
            "--student",
            str(ASSET),  # the shipped stage-1 student
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
