"""`python -m distill.evaluate` on a toy teacher adds the toy world's scores (teacher at its full steps
and at the student's, and the student); on any other teacher it adds none."""

from __future__ import annotations

import json

from conftest import REPO

from distill.evaluate import main as evaluate_main
from distill.report.toy_report import TOY_ROWS, toy_table
from distill.toy.stage_one import ASSET


def test_evaluate_adds_toy_scores_for_a_toy_teacher(toy_teacher, tmp_path, capsys):
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
    # and prints them: the MSEs above them compare samples one by one, which says little of a dmd student
    printed = capsys.readouterr().out
    assert "toy world, 16 prompts, the same noise for every row:" in printed
    for key, name in TOY_ROWS:
        row = toy[key]
        assert f"| {name} | {row['steps']} | " in printed
        assert f" | {row['accuracy']:.2f} | {row['diversity_gap']:.2f} |\n" in printed + "\n"
    assert "motion ratio" not in printed  # pictures
    # two buckets put no probe above the boundary: the high-noise range is said to be unprobed, not "nan"
    assert (
        json.loads((tmp_path / "eval.json").read_text())["denoiser"]["by_expert"]["high_noise"]["count"] == 0
    )
    assert "high-noise not probed (no probe timestep in its range: more --num_buckets)" in printed
    assert "nan" not in printed


def scores(accuracy: float, steps: int, guidance: list[float], motion: float) -> dict:
    return {
        "accuracy": accuracy,
        "diversity_gap": 0.4,
        "per_attribute": {"direction": 1.0, "speed": 0.5},
        "motion_ratio": motion,
        "steps": steps,
        "guidance_scale": guidance,
        "count": 216,
    }


def test_the_printed_toy_table_of_clips_has_their_motion():
    toy = {
        "num_frames": 9,
        "teacher": scores(0.91, 20, [3.0, 1.5], 1.05),
        "teacher_at_student_steps": scores(0.92, 4, [3.0, 1.5], 1.04),
        "student": scores(0.88, 4, [1.0], 0.97),
    }
    lines = toy_table(toy).splitlines()
    assert lines[0] == "toy world, 216 clip prompts, the same noise for every row:"
    assert lines[1].endswith("| direction | speed | motion ratio |")
    assert lines[3:] == [
        "| teacher | 20 | 3 / 1.5 | 0.91 | 0.40 | 1.00 | 0.50 | 1.05 |",
        "| teacher at the student's steps | 4 | 3 / 1.5 | 0.92 | 0.40 | 1.00 | 0.50 | 1.04 |",
        "| student | 4 | 1 | 0.88 | 0.40 | 1.00 | 0.50 | 0.97 |",
    ]


def test_evaluate_leaves_other_teachers_without_toy_scores(tiny_teacher, tmp_path):
    from distill.report.toy_report import add_toy_report

    result = {"denoiser": None}
    assert add_toy_report(result, tiny_teacher, None, None, None, None, tmp_path) is result
    assert "toy" not in result
