"""The one overwrite rule (distill/ops/replace.py), for every command that writes a whole folder: a
folder that holds something is never replaced without the flag that says so, and never by another
model; a rerun that writes the very same files keeps them. Each refusal names the folder and what it
holds, changes nothing, and its first fix (a new folder) is then accepted."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from test_download_wan import fake_snapshot, run_main

import download_wan
from distill.models.teacher_kind import I2V_A14B, read_teacher_kind
from distill.toy import i2v_data


@pytest.fixture(scope="module")
def toy_i2v(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The toy image-to-video teacher, as `download_wan.py --toy DIR --toy_kind i2v` writes it."""
    folder = tmp_path_factory.mktemp("toy_i2v") / "teacher"
    assert download_wan.main(["--toy", str(folder), "--toy_kind", "i2v"]) == 0
    return folder


def first_fix_folder(err: str, flag: str) -> Path:
    """The folder the banner's first fix names after `flag`."""
    line = next(line for line in err.splitlines() if line.strip().startswith("1."))
    return Path(line.split(f"{flag} ", 1)[1].split()[0])


def snapshot(folder: Path) -> dict[str, bytes]:
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in folder.rglob("*") if p.is_file()}


def test_toy_refuses_to_replace_another_teacher_without_overwrite(
    capsys: pytest.CaptureFixture[str], toy_i2v: Path, tmp_path: Path
) -> None:
    folder = tmp_path / "mine"
    shutil.copytree(toy_i2v, folder)
    before = snapshot(folder)
    code, _, err = run_main(capsys, "--toy", folder)  # the T2V toy teacher by default
    assert code == 4 and "Traceback" not in err
    assert f"--toy {folder} already holds a Wan2.2-I2V-A14B teacher" in err
    assert "toy Wan2.2-T2V-A14B teacher" in err and "--overwrite" in err and "Nothing was changed" in err
    assert snapshot(folder) == before
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no staging left behind
    # The first fix, applied: a new folder.
    new = first_fix_folder(err, "--toy")
    assert not new.exists() and run_main(capsys, "--toy", new)[0] == 0
    assert read_teacher_kind(new).kind.model == "Wan2.2-T2V-A14B"
    # The flag that says so replaces it.
    assert run_main(capsys, "--toy", folder, "--overwrite")[0] == 0
    assert read_teacher_kind(folder).kind.model == "Wan2.2-T2V-A14B"


def test_rerunning_the_same_toy_command_keeps_the_folder(
    capsys: pytest.CaptureFixture[str], toy_i2v: Path, tmp_path: Path
) -> None:
    folder = tmp_path / "again"
    shutil.copytree(toy_i2v, folder)
    assert run_main(capsys, "--toy", folder, "--toy_kind", "i2v")[0] == 0  # nothing to lose: no flag
    assert read_teacher_kind(folder).kind == I2V_A14B


def test_tiny_refuses_a_teacher_of_another_model_or_seed(
    capsys: pytest.CaptureFixture[str], toy_i2v: Path, tmp_path: Path
) -> None:
    folder = tmp_path / "teacher"
    shutil.copytree(toy_i2v, folder)
    before = snapshot(folder)
    code, _, err = run_main(capsys, "--tiny", folder)
    assert code == 4 and "already holds a Wan2.2-I2V-A14B teacher" in err
    assert "tiny random Wan2.2-T2V-A14B teacher" in err and "--overwrite" in err
    assert snapshot(folder) == before
    tiny = tmp_path / "tiny"
    assert run_main(capsys, "--tiny", tiny, "--seed", "1")[0] == 0
    assert run_main(capsys, "--tiny", tiny, "--seed", "1")[0] == 0  # the same files: kept
    code, _, err = run_main(capsys, "--tiny", tiny, "--seed", "2")  # other weights: the flag says so
    assert code == 4 and "--overwrite" in err
    assert run_main(capsys, "--tiny", tiny, "--seed", "2", "--overwrite")[0] == 0


def test_download_refuses_a_folder_of_another_model_before_fetching(
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    toy_i2v: Path,
    tiny_teacher: Path,
    tmp_path: Path,
) -> None:
    monkeypatch.chdir(tmp_path)
    seen = fake_snapshot(monkeypatch, tiny_teacher)
    before = snapshot(toy_i2v)
    code, _, err = run_main(capsys, "--local_dir", toy_i2v)  # the T2V preset by default
    assert code == 4 and not seen, "refused before any download starts"
    assert f"--local_dir {toy_i2v} already holds a Wan2.2-I2V-A14B teacher" in err
    assert "Wan-AI/Wan2.2-T2V-A14B-Diffusers" in err and "--overwrite" not in err
    assert f"--preset wan2.2-i2v-a14b --local_dir {toy_i2v}" in err  # resuming the model it holds
    assert snapshot(toy_i2v) == before
    # The first fix, applied: the T2V teacher into a folder of its own.
    fix = next(line for line in err.splitlines() if line.strip().startswith("1.")).split(": ", 1)[1]
    argv = fix.split("download_wan.py ", 1)[1].split()
    assert download_wan.main(argv) == 0
    assert seen["repo_id"] == "Wan-AI/Wan2.2-T2V-A14B-Diffusers"
    assert read_teacher_kind(Path(seen["local_dir"])).kind.model == "Wan2.2-T2V-A14B"


def test_download_refuses_a_wan21_download_into_the_teacher(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tiny_teacher: Path
) -> None:
    """The student's start (one transformer) would overwrite the teacher's high-noise expert."""
    seen = fake_snapshot(monkeypatch, None)
    code, _, err = run_main(capsys, "--preset", "wan2.1-t2v-1.3b", "--local_dir", tiny_teacher)
    assert code == 4 and not seen
    assert "already holds a Wan2.2-T2V-A14B teacher" in err and "Wan2.1-T2V-1.3B" in err


def test_toy_data_writer_keeps_a_data_set_it_did_not_write(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    folder = tmp_path / "data"
    assert i2v_data.main(["--output", str(folder), "--count", "4", "--seed", "5"]) == 0
    before = snapshot(folder)
    assert i2v_data.main(["--output", str(folder), "--count", "4", "--seed", "5"]) == 0  # the same: kept
    capsys.readouterr()
    assert i2v_data.main(["--output", str(folder), "--count", "2", "--seed", "6"]) == 4
    err = capsys.readouterr().err
    assert f"--output {folder} already holds a data set (prompts.jsonl and 4 images)" in err
    assert "--overwrite" in err and snapshot(folder) == before
    new = first_fix_folder(err, "--output")
    assert i2v_data.main(["--output", str(new), "--count", "2", "--seed", "6"]) == 0
    assert i2v_data.main(["--output", str(folder), "--count", "2", "--seed", "6", "--overwrite"]) == 0
    lines = (folder / "prompts.jsonl").read_text().splitlines()
    assert len(lines) == 2 and sorted(p.name for p in (folder / "images").iterdir()) == [
        json.loads(line)["image"].split("/")[1] for line in lines
    ]  # no image of the old set outlives it


def test_the_make_demos_replace_the_toy_teacher_an_older_checkout_left(
    capsys: pytest.CaptureFixture[str], toy_i2v: Path, tmp_path: Path
) -> None:
    """`make demo`, `demo-clips`, `demo-i2v` and `demo-stream` own their outputs/ teacher folder: after a pull that
    changes a shipped toy teacher, the folder an older demo wrote holds other files, and the demo must
    replace it (the demos pass --overwrite) rather than stop at the overwrite rule."""
    makefile = (Path(__file__).resolve().parents[1] / "Makefile").read_text()
    commands = [
        line.split("download_wan.py", 1)[1].split() for line in makefile.splitlines() if "--toy $(" in line
    ]
    assert len(commands) == 5  # demo-stream writes both toy teachers
    for number, args in enumerate(commands):
        stale = tmp_path / f"teacher-{number}"
        shutil.copytree(toy_i2v, stale)
        (stale / "transformer" / "config.json").write_text('{"from": "an older checkout"}\n')
        argv = [str(stale) if arg.startswith("$(") else arg for arg in args]
        assert run_main(capsys, *argv)[0] == 0, argv
        assert read_teacher_kind(stale) is not None
        assert "older checkout" not in (stale / "transformer" / "config.json").read_text()
