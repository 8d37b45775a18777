"""Advice walked: for each banner of bad input on the image-to-video and TI2V surfaces, the first fix
offered is applied as written and the program gets past that error. A fix is built for the teacher
kind at hand (distill/models/teacher_kind.py: its download preset, its tiny teacher, the students it
accepts; the size its files allow), so none names another model or a flag that cannot work.

Downloads are the one thing that cannot run here: the Hub is replaced by a copy of a tiny teacher of
the model the fix names (test_download_wan.fake_snapshot), which proves the fix asks for that model."""

from __future__ import annotations

import fnmatch
import json
import shlex
import shutil
from pathlib import Path

import pytest
from conftest import REPO, train_args
from test_download_wan import fake_snapshot
from test_i2v_training import PROMPTS, write_pairs

import download_wan
from distill import doctor, evaluate
from distill.config.cli import parse_config
from distill.models.layout import CONFIG_PATTERNS
from distill.models.teacher_kind import I2V_A14B, TI2V_5B, read_teacher_kind
from distill.models.tiny import write_tiny_original_teacher, write_tiny_teacher
from distill.train.trainer import Distiller
from train_distillation import main as train

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("fix_walk")
    return {
        "i2v": write_tiny_teacher(root / "i2v", seed=0, kind=I2V_A14B),
        "ti2v": write_tiny_teacher(root / "ti2v", seed=0, kind=TI2V_5B),
        "pairs16": write_pairs(root / "pairs16", count=2, size=16),
        "pairs32": write_pairs(root / "pairs32", count=2, size=32),
        "root": root,
    }


def fixes(err: str) -> list[str]:
    """The banner's fixes, in order (the text after "N. ")."""
    assert "Traceback" not in err and "How to fix:" in err, err
    lines = err.split("How to fix:", 1)[1].splitlines()
    return [line.strip().split(". ", 1)[1] for line in lines if line.strip()[:2].rstrip(".").isdigit()]


def download_argv(fix: str) -> list[str]:
    """The arguments of the `python download_wan.py ...` command a fix names (comments dropped)."""
    return shlex.split(fix.split("python download_wan.py", 1)[1].split("#", 1)[0])


def ti2v_args(world: dict[str, Path], out: Path, **overrides: object) -> list[str]:
    settings: dict[str, object] = dict(
        student_config=REPO / "config" / "student_tiny_ti2v.json",
        data_path=world["pairs32"],
        height=32,
        width=32,
        num_frames=5,
        guidance_scale=5,
        teacher_sample_steps=1,
        max_prompts=2,
        num_steps=1,
    )
    settings.update(overrides)
    return train_args(world["ti2v"], out, world["root"] / "cache_ti2v", **settings)


def i2v_args(world: dict[str, Path], out: Path, data: Path, **overrides: object) -> list[str]:
    settings: dict[str, object] = dict(
        student_config=REPO / "config" / "student_tiny_i2v.json",
        data_path=data,
        num_frames=5,
        teacher_sample_steps=1,
        max_prompts=2,
        num_steps=1,
        checkpoint_every=1,
    )
    settings.update(overrides)
    return train_args(world["i2v"], out, world["root"] / "cache_i2v", **settings)


def test_ti2v_size_advice_is_a_size_ti2v_takes(world, tmp_path, capsys) -> None:
    assert train(ti2v_args(world, tmp_path / "out", height=24, dry_run=True)) == 3
    first = fixes(capsys.readouterr().err)[0]
    assert first == "use --height 32"  # 16 x the Wan2.2 VAE's stride 16 x patch 2, not the A14B's 16
    assert train(ti2v_args(world, tmp_path / "out", height=32, dry_run=True)) == 0


def test_an_incomplete_i2v_folder_points_at_the_i2v_download(world, tmp_path, monkeypatch, capsys) -> None:
    folder = tmp_path / "i2v"
    shutil.copytree(world["i2v"], folder)
    shutil.rmtree(folder / "transformer_2")
    seen = fake_snapshot(monkeypatch, world["i2v"])
    assert download_wan.main(["--verify", str(folder)]) == 5
    verify_fix = fixes(capsys.readouterr().err)[0]
    assert doctor.main(["--teacher_path", str(folder)]) == 1
    doctor_fix = next(line for line in capsys.readouterr().out.splitlines() if "FAIL teacher" in line)
    for fix in (verify_fix, doctor_fix.split("-- fix: ", 1)[1]):
        assert "--preset wan2.2-i2v-a14b" in fix and str(folder) in fix, fix
    assert download_wan.main(download_argv(verify_fix)) == 0  # resumes into the folder: nothing refused
    assert seen["repo_id"] == I2V_A14B.repo_id and Path(seen["local_dir"]) == folder
    assert download_wan.main(["--verify", str(folder)]) == 0
    assert doctor.main(["--teacher_path", str(folder)]) == 0


def test_an_incomplete_original_i2v_folder_names_its_own_release(world, tmp_path, capsys) -> None:
    complete = write_tiny_original_teacher(tmp_path / "original", seed=0, kind=I2V_A14B)
    folder = tmp_path / "broken"
    shutil.copytree(complete, folder)
    shutil.rmtree(folder / "low_noise_model")
    assert download_wan.main(["--convert", str(folder), str(tmp_path / "converted")]) == 5
    first, second = fixes(capsys.readouterr().err)[:2]
    assert first == f"resume the download: hf download Wan-AI/Wan2.2-I2V-A14B --local-dir {folder.absolute()}"
    assert download_argv(second) == ["--preset", "wan2.2-i2v-a14b"]
    shutil.copytree(complete / "low_noise_model", folder / "low_noise_model")  # what that download fetches
    assert download_wan.main(["--convert", str(folder), str(tmp_path / "converted")]) == 0
    assert read_teacher_kind(tmp_path / "converted").kind == I2V_A14B


def test_configs_only_offline_offers_the_configs_not_the_weights(
    world, tmp_path, monkeypatch, capsys
) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    folder = tmp_path / "configs"
    argv = ["--configs_only", "--preset", "wan2.2-i2v-a14b", "--local_dir", str(folder)]
    assert download_wan.main(argv) == 5
    err = capsys.readouterr().err
    first, _, check, tiny = fixes(err)
    assert "well under a MB" in err and I2V_A14B.repo_id in first
    # The first fix, as the Hub would answer it: only the files its --include patterns name.
    words = shlex.split(first.split(": ", 1)[1].split("  (", 1)[0])
    patterns = words[words.index("--include") + 1 : words.index("--local-dir")]
    assert patterns == list(CONFIG_PATTERNS)
    for file in world["i2v"].rglob("*"):
        name = file.relative_to(world["i2v"]).as_posix()
        if file.is_file() and any(fnmatch.fnmatch(name, p) for p in patterns):
            (folder / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(file, folder / name)
    assert sum(p.stat().st_size for p in folder.rglob("*") if p.is_file()) < 2**20  # not the weights
    assert check.startswith("Check them here, without the network: HF_HUB_OFFLINE=1 ")
    assert download_wan.main(download_argv(check)) == 0
    assert (
        tiny
        == "To try the trainer without any weights: python download_wan.py --tiny outputs/tiny_i2v_teacher --tiny_kind i2v"
    )
    assert download_wan.main(download_argv(tiny)) == 0
    assert read_teacher_kind(tmp_path / "outputs" / "tiny_i2v_teacher").kind == I2V_A14B


def test_a_student_of_another_kind_for_ti2v_is_offered_starts_ti2v_takes(world, tmp_path, capsys) -> None:
    args = ti2v_args(world, tmp_path / "out", student_init=REPO / "assets" / "toy_i2v_student_stage1")
    assert train(args) == 3
    err = capsys.readouterr().err
    assert (
        "is a Wan2.2-I2V-A14B student" in err and "Wan2.1-T2V-1.3B" not in err
    )  # 16 channels: not TI2V's 48
    first = fixes(err)[0]
    assert first == "start from this teacher's own blocks: --student_init teacher"
    fixed = Distiller(parse_config(ti2v_args(world, tmp_path / "out", student_init="teacher")))
    fixed.load_teacher_experts()  # the teacher start copies the loaded transformer's blocks
    assert fixed.make_model("student").config.in_channels == 48


def test_evaluate_names_its_own_flags_for_a_paired_file(world, toy_teacher, tmp_path, capsys) -> None:
    student = REPO / "assets" / "toy_student_stage1"  # a Wan2.2-T2V-A14B student
    common = [
        "--student",
        str(student),
        "--teacher_path",
        str(toy_teacher),
        "--output_dir",
        str(tmp_path / "e"),
    ]
    quick = [
        "--steps",
        "1",
        "--teacher_steps",
        "1",
        "--max_prompts",
        "2",
        "--num_buckets",
        "1",
        "--toy_prompts",
        "1",
    ]
    assert evaluate.main([*common, "--prompts", str(world["pairs16"]), *quick]) == 6
    err = capsys.readouterr().err
    assert "--teacher_path" not in err.split("How to fix:")[1] and "Training" not in err
    first = fixes(err)[0]
    assert first == "pass the prompts without their images: a .txt file, one prompt per line, as --prompts"
    text = tmp_path / "prompts.txt"
    text.write_text(
        "\n".join(json.loads(line)["prompt"] for line in world["pairs16"].read_text().splitlines())
    )
    assert evaluate.main([*common, "--prompts", str(text), *quick]) == 0


def test_resume_on_a_changed_image_names_it_and_a_fix_that_works(world, tmp_path, capsys) -> None:
    data = tmp_path / "data"
    pairs = write_pairs(data, count=2)
    out = tmp_path / "run"
    assert train(i2v_args(world, out, pairs)) == 0
    shutil.copy(data / "images" / "0.png", data / "images" / "1.png")  # same name, other content
    capsys.readouterr()
    assert train(i2v_args(world, out, pairs, num_steps=2)) == 9
    err = capsys.readouterr().err
    assert f"{pairs} line 2 ({PROMPTS[1]!r}, image {data / 'images' / '1.png'})" in err
    assert "the same prompt, but the image's content changed" in err
    first = fixes(err)[0]
    assert first == f"start this run in another --output_dir: --output_dir {out}-2"
    Distiller(parse_config(i2v_args(world, Path(f"{out}-2"), pairs, num_steps=2))).check_output_dir()


def test_resume_into_a_finished_run_of_another_kind_offers_no_force(
    world, tiny_teacher, shared_cache, tmp_path, capsys
) -> None:
    out = tmp_path / "t2v"
    assert (
        train(train_args(tiny_teacher, out, shared_cache, num_steps=1, max_prompts=2, checkpoint_every=1))
        == 0
    )
    capsys.readouterr()
    assert train(i2v_args(world, out, world["pairs16"])) == 9
    err = capsys.readouterr().err
    assert "--force_resume" not in err and "That run is finished" in err
    assert fixes(err) == [f"start this run in another --output_dir: --output_dir {out}-2"]
    Distiller(parse_config(i2v_args(world, Path(f"{out}-2"), world["pairs16"]))).check_output_dir()
