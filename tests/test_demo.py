"""`make demo` ends with the headline: a table from eval.json and summary.png, every row and panel
saying its model, steps and guidance. The demo's own training run is timed and scored by hand (it
takes minutes); its run is shipped (assets/toy_student_dmd/) and tests/test_toy_shipped_students.py
holds it to its bars in the suite."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import imageio.v2 as imageio
import numpy as np
import pytest
from conftest import REPO

from distill import demo
from distill.config.cli import parse_config
from distill.ops.errors import DistillError
from distill.toy.stage_one import ASSET

pytestmark = pytest.mark.usefixtures("one_thread")
FEW_STEP = {
    "_class_name": "FlowMatchEulerDiscreteScheduler",
    "num_train_timesteps": 1000,
    "shift": 5.0,
    "stochastic_sampling": True,
}


def eval_result(teacher: Path | str, student: Path | str, student_steps: int = 4) -> dict:
    """An eval.json as python -m distill.evaluate writes it for a toy teacher (numbers made up)."""

    def toy(accuracy: float, steps: int, guidance: list[float]) -> dict:
        return {"accuracy": accuracy, "diversity_gap": 0.3, "steps": steps, "guidance_scale": guidance}

    def cost(forwards: float, seconds: float, steps: int, guidance: list[float]) -> dict:
        return {
            "forwards_per_sample": forwards,
            "seconds_per_sample": seconds,
            "steps": steps,
            "guidance_scale": guidance,
        }

    few = student_steps < 20
    result = {
        "teacher": str(teacher),
        "student": str(student),
        "settings": {"seed": 0, "student_scheduler": FEW_STEP if few else None},
        "toy": {
            "prompts": 216,
            "teacher": toy(0.94, 20, [4.0, 3.0]),
            "teacher_at_student_steps": toy(0.70 if few else 0.94, student_steps, [4.0, 3.0]),
            "student": toy(0.97, student_steps, [1.0]),
            "chance": {"all": 1 / 216},
        },
        "cost": {
            "teacher": cost(40, 0.09, 20, [4.0, 3.0]),
            "student": cost(student_steps, 0.009, student_steps, [1.0]),
        },
    }
    if few:
        result["cost"]["teacher_at_student_steps"] = cost(8, 0.02, student_steps, [4.0, 3.0])
    return result


def test_the_table_compares_teacher_at_full_and_at_k_steps_with_the_student():
    rows = demo.rows_of(eval_result("t", "s"))
    assert [(r.model, r.steps, r.guidance_text) for r in rows] == [
        ("teacher", 20, "4 / 3"),
        ("teacher", 4, "4 / 3"),
        ("student", 4, "1"),
    ]
    table = demo.format_table(rows, 216)
    lines = table.splitlines()
    assert "accuracy" in lines[2] and "forwards/sample" in lines[2] and "s/sample" in lines[2]
    assert lines[3].split()[-8:] == ["20", "4", "/", "3", "0.94", "0.30", "40", "0.0900"]
    assert "0.97" in lines[5] and lines[5].split()[-2:] == ["4", "0.0090"]
    assert "10x fewer transformer forwards" in table


def test_a_student_at_the_teachers_own_steps_is_not_shown_beside_the_same_teacher_twice():
    rows = demo.rows_of(eval_result("t", "s", student_steps=20))
    assert [(r.model, r.steps) for r in rows] == [("teacher", 20), ("student", 20)]
    assert "and 0.94 at 20" not in demo.format_table(rows, 216)


def test_without_toy_scores_the_summary_says_what_it_needs(tmp_path):
    result = eval_result("t", "s")
    del result["toy"]
    (tmp_path / "eval.json").write_text(json.dumps(result))
    with pytest.raises(DistillError, match="no toy-world scores"):
        demo.read_eval(tmp_path)
    assert demo.main([str(tmp_path / "nowhere")]) != 0


def test_eval_png_names_model_steps_and_guidance_on_every_toy_bar():
    from distill.report.plots import plot_toy
    from distill.sample.media import pyplot

    plt = pyplot()
    for student_steps in (4, 20):
        fig, ax = plt.subplots()
        plot_toy(ax, eval_result("t", "s", student_steps)["toy"])
        labels = [t.get_text() for t in ax.get_xticklabels()]
        plt.close(fig)
        assert len(set(labels)) == 3, labels  # never two identical labels, even at equal steps
        for label, steps, guidance in zip(
            labels, (20, student_steps, student_steps), ("4 / 3", "4 / 3", "1")
        ):
            assert f"{steps} steps" in label and f"guidance {guidance}" in label, label


def test_summary_png_rows_share_the_noise_and_say_what_they_are(toy_teacher, tmp_path, capsys):
    # The shipped stage-1 student with the K-step sampler stands in for the demo's dmd student.
    folder = tmp_path / "eval"
    folder.mkdir()
    (folder / "eval.json").write_text(json.dumps(eval_result(toy_teacher, ASSET)))
    assert demo.main([str(folder), "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "teacher, full steps" in out and "teacher at the student's steps" in out
    picture = imageio.imread(tmp_path / "summary.png")
    assert picture.ndim == 3 and (tmp_path / "summary.png").stat().st_size < 200_000

    result = demo.read_eval(folder)
    rows = demo.rows_of(result)
    prompts = [
        "a red bar in the top left on a gray background",
        "a blue column in the bottom right on a black background",
    ]
    teacher_twice = demo.sample_rows(result, [rows[0], rows[0], rows[2]], prompts, "cpu")
    assert np.array_equal(teacher_twice[0], teacher_twice[1])  # same seeds, same noise
    assert not np.array_equal(teacher_twice[0], teacher_twice[2])
    assert all(p.shape == (2, 32, 32, 3) for p in teacher_twice)
    # The teacher at its 20 guided steps draws what it is asked for.
    assert all(demo.all_right(picture, prompt) for picture, prompt in zip(teacher_twice[0], prompts))


def test_the_demo_commands_are_valid():
    """`make -n demo` as make would run it: the trainer accepts its flags, evaluate and demo theirs."""
    if shutil.which("make") is None:
        pytest.skip("make is not installed")
    printed = subprocess.run(
        ["make", "-n", "demo"], cwd=REPO, capture_output=True, text=True, check=True
    ).stdout
    commands = printed.replace("\\\n", " ").splitlines()
    train = next(c for c in commands if "train_distillation.py" in c).split()
    cfg = parse_config(train[train.index("train_distillation.py") + 1 :])
    assert (cfg.method, cfg.student_steps, str(ASSET.relative_to(REPO))) == ("dmd", 4, cfg.student_init)
    assert any("-m distill.evaluate" in c for c in commands)
    assert any(c.split()[-2:] == ["distill.demo", "outputs/demo/eval"] for c in commands)
