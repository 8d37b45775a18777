"""The advice in an error is right: it names the flag the user typed, and following it works."""

from __future__ import annotations

import json
import shutil

from conftest import REPO, train_args

from distill import evaluate, generate
from distill.models.tiny import write_tiny_teacher
from train_distillation import main


def test_a_folder_given_as_the_prompts_file_is_called_a_folder(tiny_teacher, tmp_path, capsys):
    assert main(train_args(tiny_teacher, tmp_path / "out", tmp_path / "c", data_path=REPO / "data")) == 6
    err = capsys.readouterr().err
    assert f"--data_path {REPO / 'data'}: is a folder" in err and "file not found" not in err
    assert f"--data_path {REPO / 'data'}/" in err  # a file inside it is offered


def exported_student(tiny_teacher, tmp_path):
    """A student folder with run settings, as training leaves it (without training)."""
    out = tmp_path / "run"
    assert main(train_args(tiny_teacher, out, tmp_path / "cache", num_steps=1)) == 0
    return out / "student"


def test_evaluate_names_its_own_flags(tiny_teacher, tmp_path, capsys):
    student = exported_student(tiny_teacher, tmp_path)
    code = evaluate.main(
        [
            "--student",
            str(student),
            "--prompts",
            str(tmp_path / "no.txt"),
            "--output_dir",
            str(tmp_path / "e"),
        ]
    )
    err = capsys.readouterr().err
    assert (
        code != 0
        and f"--prompts {tmp_path / 'no.txt'}: file or folder not found" in err
        and "--data_path" not in err
    )
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a red circle\n")
    code = evaluate.main(
        ["--student", str(tmp_path / "none"), "--prompts", str(prompts), "--output_dir", str(tmp_path / "e")]
    )
    err = capsys.readouterr().err
    assert code == 3 and "student folder not found" in err and "--teacher_only" not in err


def test_a_moved_teacher_is_named_with_the_file_that_recorded_it(tmp_path, capsys):
    teacher = write_tiny_teacher(tmp_path / "teacher", seed=0)
    student = exported_student(teacher, tmp_path)
    shutil.move(teacher, tmp_path / "moved")
    settings = student / "run_settings.json"
    common = ["--student", str(student), "--prompt", "a", "--output", str(tmp_path / "g.png")]
    assert generate.main(common) == 3
    err = capsys.readouterr().err
    assert f"the teacher recorded in {settings} is not there any more: {teacher}" in err
    assert "pass --teacher_path NEW_FOLDER" in err and "Traceback" not in err
    assert json.loads(settings.read_text())["teacher_path"] == str(teacher)
    assert generate.main([*common, "--teacher_path", str(tmp_path / "moved"), "--steps", "2"]) == 0


def test_two_frames_are_pointed_at_an_image_or_a_five_frame_video(tiny_teacher, tmp_path, capsys):
    student = exported_student(tiny_teacher, tmp_path)
    common = ["--student", str(student), "--prompt", "a", "--num_frames", "2"]
    assert generate.main([*common, "--output", str(tmp_path / "x.png")]) == 3
    err = capsys.readouterr().err
    assert "--num_frames 1 for an image (.png), or --num_frames 5 for a video (.mp4)" in err
