"""Round three's leftovers (issue 49, class 6): a --config file in another encoding, a --resume that
names a run's checkpoints folder instead of one checkpoint, and a command run by a Python without
the requirements. Each is a banner that names the file or flag, and its first fix is then accepted."""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO, train_args

from distill.config.cli import parse_config
from distill.ops.requirements import REQUIRED_MODULES, VENV_PYTHON
from train_distillation import main


def first_fix(err: str) -> str:
    return re.search(r"How to fix:\n\s+1\. (.*)", err).group(1)


# ---------------------------------------------------------------------------------------------
# --config in another encoding
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "encoding, words", [("latin-1", "is not UTF-8 (bad byte at line 2)"), ("utf-16", "is UTF-16 text")]
)
def test_a_config_file_in_another_encoding_is_named_and_resaving_it_works(
    tiny_teacher, tmp_path, capsys, encoding, words
):
    config = tmp_path / "run.yaml"
    text = "ema_decay: 0.9\n# le café du matin\nkeep_last: 2\n"
    config.write_bytes(text.encode(encoding))
    args = [*train_args(tiny_teacher, tmp_path / "out", tmp_path / "cache"), "--config", str(config)]
    assert main(args) == 3
    err = capsys.readouterr().err
    assert f"--config {config}: {words}" in err and "Traceback" not in err
    assert "--resume auto" not in err  # a settings file, not a failed run
    assert f"re-save {config} as UTF-8" in first_fix(err)
    config.write_text(text, encoding="utf-8")  # the fix
    cfg = parse_config(args)
    assert (cfg.ema_decay, cfg.keep_last) == (0.9, 2)


# ---------------------------------------------------------------------------------------------
# --resume <run>/checkpoints, <run>, or an interrupted step folder: refused before any work
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def finished_run(tiny_teacher, tmp_path_factory) -> tuple[Path, Path]:
    """(output folder, its cache) of a 4-step run with checkpoints at steps 2 and 4."""
    root = tmp_path_factory.mktemp("resume_targets")
    out, cache = root / "run", root / "cache"
    assert main(train_args(tiny_teacher, out, cache, num_steps=4, checkpoint_every=2)) == 0
    return out, cache


@pytest.mark.parametrize(
    "target, words",
    [
        ("checkpoints", "is a run's checkpoints folder, not one checkpoint"),
        ("run", "is a run's output folder, not one checkpoint"),
        ("interrupted", "is not a complete checkpoint (no COMPLETE marker: the save was interrupted)"),
    ],
)
def test_a_resume_that_is_no_checkpoint_is_refused_before_the_teacher_and_its_fix_resumes(
    tiny_teacher, finished_run, tmp_path, capsys, target, words
):
    out = tmp_path / "run"
    shutil.copytree(finished_run[0], out)
    named = {
        "checkpoints": out / "checkpoints",
        "run": out,
        "interrupted": out / "checkpoints" / "step_00000004",
    }[target]
    if target == "interrupted":
        (named / "COMPLETE").unlink()
    fresh_cache = tmp_path / "cache"
    args = train_args(tiny_teacher, out, fresh_cache, num_steps=6, checkpoint_every=2, resume=named)
    assert main(args) == 9
    err = capsys.readouterr().err
    assert f"{named} {words}" in err and "Traceback" not in err
    assert not fresh_cache.exists()  # nothing was encoded or sampled: the check ran first
    fix = first_fix(err)
    if target == "interrupted":
        assert fix == f"pass the newest complete one: --resume {out / 'checkpoints' / 'step_00000002'}"
    else:
        assert fix.startswith("pass one of its step_N folders: --resume ") and "--resume auto" in err
    resume_to = re.search(r"--resume (\S+)", fix).group(1)
    fixed = train_args(tiny_teacher, out, finished_run[1], num_steps=6, checkpoint_every=2, resume=resume_to)
    assert main(fixed) == 0
    assert f"resumed from {resume_to}" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------
# A Python without the requirements
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "command",
    [
        ["download_wan.py", "--tiny", "TMP/tiny"],
        ["train_distillation.py", "--teacher_path", "TMP/teacher"],
        ["-m", "distill.generate", "--prompt", "a cat"],
        ["-m", "distill.evaluate", "--student", "TMP/student"],
    ],
)
def test_a_python_without_the_requirements_is_told_to_use_the_venv(tmp_path, command):
    """`python -S` leaves site-packages out: this Python then lacks torch and diffusers, as a system
    python3 without the requirements does."""
    command = [part.replace("TMP", str(tmp_path)) for part in command]
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)}
    done = subprocess.run(
        [sys.executable, "-S", *command], cwd=REPO, env=env, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 4, done.stderr
    assert "this Python lacks the project's requirements (torch, diffusers" in done.stderr
    assert "Traceback" not in done.stderr and "No module named" not in done.stderr
    fix = first_fix(done.stderr)
    assert "make demo" in fix
    venv = VENV_PYTHON if VENV_PYTHON.exists() else ".venv/bin/python"
    assert fix.endswith(shlex.join([str(venv), *command]))


@pytest.mark.skipif(
    not VENV_PYTHON.exists(), reason="the fix names .venv/bin/python, which is not built here"
)
def test_the_venv_command_the_banner_offers_gets_past_it(tmp_path):
    """The first fix, run as given: the venv's Python runs the command (which then says what it
    thinks of the folder, not of the Python)."""
    folder = tmp_path / "no-teacher"
    command = [sys.executable, "-S", "download_wan.py", "--verify", str(folder)]
    refused = subprocess.run(command, cwd=REPO, env={"PATH": "/usr/bin:/bin"}, capture_output=True, text=True)
    fix = first_fix(refused.stderr)
    done = subprocess.run(
        shlex.split(fix.split(": ", 1)[1]), cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 5 and "lacks the project's requirements" not in done.stderr
    assert f"{folder} is not a complete Wan 2.2 diffusers teacher" in done.stderr


def test_the_checked_modules_are_the_requirements():
    listed = (REPO / "requirements.txt").read_text().lower()
    for package in REQUIRED_MODULES.values():
        assert re.search(rf"^{re.escape(package)}\b", listed, re.M), package
