"""`python -m distill` lists what the project offers, one line each, and runs any of it by name."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest
from conftest import REPO, repo_pythonpath

from distill.__main__ import COMMANDS, main

EXPECTED = {
    "train": "python train_distillation.py",
    "generate": "python -m distill.generate",
    "evaluate": "python -m distill.evaluate",
    "bench": "python -m distill.bench",
    "gpu-check": "python -m distill.gpu_check",
    "doctor": "python -m distill.doctor",
    "stress": "python -m distill.stress",
    "download": "python download_wan.py",
    "demo": "python -m distill.demo",
}


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "distill", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": repo_pythonpath()},
        timeout=120,
    )


@pytest.mark.parametrize("args", [(), ("--help",), ("-h",)], ids=["bare", "--help", "-h"])
def test_the_commands_are_listed_with_one_line_each(args):
    proc = run(*args)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    for name, how in EXPECTED.items():
        described = [line for line in lines if line.split()[:1] == [name]]
        assert len(described) == 1 and how in described[0], (name, proc.stdout)
        assert len(described[0].split(how)[1].split()) >= 3, described  # and what it does


def test_every_listed_command_exists():
    assert set(COMMANDS) == set(EXPECTED)
    for target, _ in COMMANDS.values():
        if target.endswith(".py"):
            assert (REPO / target).is_file(), target
        else:
            assert importlib.util.find_spec(target) is not None, target


def test_a_command_runs_by_name_with_its_own_arguments():
    proc = run("demo", "--help")
    assert proc.returncode == 0 and "usage: python -m distill.demo" in proc.stdout, proc.stderr


def test_an_unknown_command_is_refused_with_the_list(capsys):
    assert main(["trian"]) == 2
    err = capsys.readouterr().err
    assert "unknown command 'trian'" in err and "train" in err


def test_the_train_line_names_every_method():
    """The list is where a user first reads what training can do: it still said "velocity or dmd"
    long after ode_init and self_forcing came."""
    from distill.config.cli import build_parser

    method = next(a for a in build_parser()._actions if a.dest == "method")
    described = COMMANDS["train"][1]
    assert len(method.choices) >= 4
    assert [m for m in method.choices if m not in described] == []
