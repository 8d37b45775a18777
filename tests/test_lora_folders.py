"""LoRA folders as train (--student_lora_init), generate and evaluate (--student) meet them: every
folder the exporter writes loads in all three (lora/ and lora/comfyui/), and a damaged, edited or
foreign one is refused before any weight is applied, naming the file, the key and the fix.
Also the advice around LoRA runs and teachers: every fix names a flag the situation accepts and the
right folder."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from conftest import REPO, train_args

from distill import evaluate, generate
from distill.models.lora_files import FILES, WAN_FORMAT_DIR
from distill.models.lora_folder import check_lora_folder
from distill.models.tiny import TinyTeacherShape, write_tiny_teacher
from distill.toy import build
from train_distillation import main as train

pytestmark = pytest.mark.usefixtures("one_thread")

LORA = dict(method="velocity", student_config=None, student_init=None, student_lora_rank=4)
LORA_RUN = dict(LORA, height=32, width=32, num_steps=1, checkpoint_every=1, max_prompts=2)


def lora_run(teacher: Path, out: Path) -> Path:
    assert train(train_args(teacher, out, out.parent / "cache", **LORA_RUN)) == 0
    return out


@pytest.fixture(scope="module")
def runs(tiny_teacher: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A one-step LoRA run on the tiny teacher, and one on a wider teacher (another teacher's adapters)."""
    root = tmp_path_factory.mktemp("lora_folders")
    wider = write_tiny_teacher(root / "wider", shape=TinyTeacherShape(attention_head_dim=16))
    return {
        "teacher": tiny_teacher,
        "run": lora_run(tiny_teacher, root / "run"),
        "wider": wider,
        "wider_run": lora_run(wider, root / "wider_run"),
    }


def banner(capsys: pytest.CaptureFixture[str]) -> str:
    err = capsys.readouterr().err
    assert "Traceback" not in err and "ERROR (" in err
    return err


def generate_args(student: Path, teacher: Path, output: Path) -> list[str]:
    return ["--student", str(student), "--teacher_path", str(teacher), "--prompt", "a red square"] + [
        "--output",
        str(output),
        "--steps",
        "2",
        "--device",
        "cpu",
    ]


def evaluate_args(student: Path, teacher: Path, output_dir: Path) -> list[str]:
    return ["--student", str(student), "--teacher_path", str(teacher)] + [
        "--prompts",
        str(REPO / "data" / "static_prompts.txt"),
        "--output_dir",
        str(output_dir),
        "--max_prompts",
        "1",
        "--steps",
        "2",
        "--num_buckets",
        "1",
        "--device",
        "cpu",
    ]


def copy_of(folder: Path, dest: Path) -> Path:
    shutil.copytree(folder, dest)
    return dest


# ---------------------------------------------------------------------------------------------
# Class 2: LoRA folders and files
# ---------------------------------------------------------------------------------------------


def test_the_comfyui_copy_loads_in_train_generate_and_evaluate_as_the_same_adapters(runs, tmp_path, capsys):
    lora = runs["run"] / "lora"
    comfy = lora / WAN_FORMAT_DIR
    plain, wan = check_lora_folder(lora, "--student"), check_lora_folder(comfy, "--student")
    assert wan.wan_format and not plain.wan_format and wan.shape == plain.shape
    a, b = plain.states(), wan.states()
    assert all(a[w].keys() == b[w].keys() and all(torch.equal(a[w][k], b[w][k]) for k in a[w]) for w in a)
    out = tmp_path / "from_comfyui"
    assert (
        train(train_args(runs["teacher"], out, tmp_path / "cache", student_lora_init=comfy, **LORA_RUN)) == 0
    )
    assert (out / "lora" / FILES["high"]).is_file()
    assert generate.main(generate_args(comfy, runs["teacher"], tmp_path / "g.png")) == 0
    assert (tmp_path / "g.png").is_file()
    assert evaluate.main(evaluate_args(comfy, runs["teacher"], tmp_path / "eval")) == 0
    assert json.loads((tmp_path / "eval" / "eval.json").read_text())["student"] == str(comfy.resolve())


def test_another_teachers_adapters_are_refused_by_train_and_generate_naming_both_teachers(
    runs, tmp_path, capsys
):
    theirs = runs["wider_run"] / "lora"
    out = tmp_path / "out"
    argv = train_args(runs["teacher"], out, tmp_path / "cache", student_lora_init=theirs, **LORA_RUN)
    assert train(argv) == 3
    err = banner(capsys)
    assert (
        "made for another teacher" in err and FILES["high"] in err and "[4, 32]" in err and "[4, 24]" in err
    )
    assert f"--teacher_path {runs['wider']}" in err and "drop --student_lora_init" in err
    assert "--resume auto" not in err and not out.exists()  # refused before anything was written
    capsys.readouterr()
    assert generate.main(generate_args(theirs, runs["teacher"], tmp_path / "g.png")) == 3
    err = banner(capsys)
    assert "made for another teacher" in err and f"--teacher_path {runs['wider']}" in err
    assert not (tmp_path / "g.png").exists()


@pytest.mark.parametrize("which", ["high", "low"])
def test_a_cut_short_adapter_file_is_named_by_every_command_before_anything_loads(
    runs, tmp_path, capsys, which
):
    damaged = copy_of(runs["run"] / "lora", tmp_path / "lora")
    file = damaged / FILES[which]
    file.write_bytes(file.read_bytes()[:-64])
    before = file.read_bytes()
    commands = {
        "generate": lambda: generate.main(generate_args(damaged, runs["teacher"], tmp_path / "g.png")),
        "evaluate": lambda: evaluate.main(evaluate_args(damaged, runs["teacher"], tmp_path / "eval")),
        "train": lambda: train(
            train_args(
                runs["teacher"], tmp_path / "out", tmp_path / "cache", student_lora_init=damaged, **LORA_RUN
            )
        ),
    }
    for name, command in commands.items():
        assert command() == 3, name
        err = banner(capsys)
        assert f"{file} is damaged" in err and "cut short" in err and "copy" in err, name
    assert (
        file.read_bytes() == before and not (tmp_path / "g.png").exists() and not (tmp_path / "out").exists()
    )


@pytest.mark.parametrize(
    "edit, named",
    [
        ({"r": 8}, ['says "r": 8, but the adapters are rank 4', 'write "r": 4']),
        ({"target_modules": ["to_q", "to_k"]}, ["other target modules than the adapters hold"]),
        ({"lora_alpha": 2.0}, ["disagree on lora_alpha", 'write "lora_alpha": 4.0']),
    ],
)
def test_an_adapter_config_that_disagrees_with_the_adapters_is_named_not_blamed_on_the_teacher(
    runs, tmp_path, capsys, edit, named
):
    edited = copy_of(runs["run"] / "lora", tmp_path / "lora")
    config = edited / "adapter_config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), **edit}))
    assert evaluate.main(evaluate_args(edited, runs["teacher"], tmp_path / "eval")) == 3
    err = banner(capsys)
    assert str(config) in err and all(n in err for n in named) and "teacher" not in err.split("How to fix")[0]
    assert not (tmp_path / "eval" / "eval.json").exists()


def test_a_half_copied_or_foreign_folder_is_named(runs, tmp_path, capsys):
    half = copy_of(runs["run"] / "lora", tmp_path / "half")
    (half / FILES["low"]).unlink()
    assert generate.main(generate_args(half, runs["teacher"], tmp_path / "g.png")) == 3
    assert f"{FILES['low']} is missing" in banner(capsys)
    from safetensors.torch import save_file

    foreign = copy_of(runs["run"] / "lora", tmp_path / "foreign")
    save_file({"transformer.blocks.0.norm2.lora_A.weight": torch.zeros(4, 24)}, foreign / FILES["high"])
    assert evaluate.main(evaluate_args(foreign, runs["teacher"], tmp_path / "eval")) == 3
    assert "no LoRA key of a Wan transformer: transformer.blocks.0.norm2.lora_A.weight" in banner(capsys)
    # the run's folder instead of its lora/: the adapters inside are offered
    argv = train_args(
        runs["teacher"], tmp_path / "out", tmp_path / "cache", student_lora_init=runs["run"], **LORA_RUN
    )
    assert train(argv) == 3
    assert f"pass {runs['run'] / 'lora'}" in banner(capsys)
    assert generate.main(generate_args(runs["run"], runs["teacher"], tmp_path / "g.png")) == 3
    assert f"pass {runs['run'] / 'lora'}" in banner(capsys)


# ---------------------------------------------------------------------------------------------
# Class 7: advice that names a flag the situation accepts, and the right folder
# ---------------------------------------------------------------------------------------------


def test_a_teacher_whose_model_index_is_not_json_is_verified_at_the_teacher_folder(runs, tmp_path, capsys):
    teacher = copy_of(runs["teacher"], tmp_path / "teacher")
    (teacher / "model_index.json").write_text("{not json")
    argv = [
        "--teacher_only",
        "--teacher_path",
        str(teacher),
        "--prompt",
        "x",
        "--output",
        str(tmp_path / "t.png"),
    ]
    assert generate.main(argv) == 5
    err = banner(capsys)
    assert f"download_wan.py --verify {teacher}\n" in err or f"download_wan.py --verify {teacher} " in err
    assert f"--verify {tmp_path}\n" not in err and f"--verify {tmp_path} " not in err


def checkpoints_of(out: Path) -> list[str]:
    return sorted(p.name for p in (out / "checkpoints").iterdir())


@pytest.mark.parametrize("force", [False, True])
def test_a_lora_checkpoint_resumed_with_another_rank_gets_the_lora_flags_never_student_config(
    runs, tmp_path, capsys, force
):
    out = copy_of(runs["run"], tmp_path / "run")
    kept = checkpoints_of(out)
    extra = dict(LORA_RUN, student_lora_rank=2, num_steps=2, force_resume=force)
    assert train(train_args(runs["teacher"], out, tmp_path / "cache", **extra)) == 9
    err = banner(capsys)
    assert "--student_lora_rank 4 --student_lora_alpha 4" in err and "--student_config" not in err
    assert "pass --force_resume" not in err  # adapters of another rank cannot load, forced or not
    assert checkpoints_of(out) == kept


@pytest.mark.parametrize("force", [False, True])
def test_a_full_student_run_over_a_lora_checkpoint_is_told_it_is_one_and_what_to_pass(
    runs, tmp_path, capsys, force
):
    out = copy_of(runs["run"], tmp_path / "run")
    kept = checkpoints_of(out)
    argv = train_args(runs["teacher"], out, tmp_path / "cache", num_steps=2, force_resume=force)
    assert train(argv) == 9
    err = banner(capsys)
    assert "it holds a LoRA run's adapters" in err and "_class_name" not in err
    assert "continue the LoRA run: --student_lora_rank 4" in err and "without --student_config" in err
    assert checkpoints_of(out) == kept


def test_toy_build_from_a_folder_that_is_no_toy_teacher_says_so_before_any_fitting(runs, tmp_path, capsys):
    output = tmp_path / "toy"
    assert build.main(["--retrain", "--from", str(runs["teacher"]), "--output", str(output)]) == 3
    err = banner(capsys)
    assert f"--from {runs['teacher']} is not a toy teacher" in err and "toy_world.json" in err
    assert "--vae_steps" not in err
    assert build.main(["--retrain", "--vae_from", str(runs["teacher"]), "--output", str(output)]) == 3
    err = banner(capsys)
    assert "another architecture than the toy world's" in err and "base_dim: 3 there, 8" in err
    assert not output.exists()
