"""Every number setting must be a finite number: inf or nan is refused before anything loads."""

from __future__ import annotations

import dataclasses
import typing

import pytest
from conftest import train_args

from distill.config.cli import parse_config
from distill.config.settings import TrainConfig
from distill.ops.errors import DistillError, Stage
from train_distillation import main


def float_settings() -> list[str]:
    hints = typing.get_type_hints(TrainConfig)
    return [
        f.name
        for f in dataclasses.fields(TrainConfig)
        if float in (hints[f.name], *typing.get_args(hints[f.name]))
    ]


def test_the_float_settings_are_found():
    assert {"lr", "critic_lr", "guidance_scale", "ema_decay", "student_shift", "flow_shift"} <= set(
        float_settings()
    )


@pytest.mark.parametrize("value", ["inf", "-inf", "nan"])
@pytest.mark.parametrize("name", float_settings())
def test_a_non_finite_number_is_refused_naming_the_setting(tiny_teacher, tmp_path, name, value):
    argv = train_args(tiny_teacher, tmp_path / "out", tmp_path / "cache", method="dmd")
    with pytest.raises(DistillError) as refused:
        parse_config([*argv, f"--{name}={value}"])  # '=': argparse reads a bare -inf as a flag
    assert refused.value.stage == Stage.CONFIG and f"--{name}" in refused.value.title


def test_lr_inf_stops_before_anything_is_written_even_in_a_dry_run(tiny_teacher, tmp_path, capsys):
    for extra in ([], ["--dry_run"]):
        argv = train_args(tiny_teacher, tmp_path / "out", tmp_path / "cache", lr="inf")
        assert main([*argv, *extra]) == 3
        err = capsys.readouterr().err
        assert "ERROR (config): --lr must be a finite number, got inf" in err and "Traceback" not in err
    assert not (tmp_path / "out").exists() and not (tmp_path / "cache").exists()


def test_num_frames_two_is_pointed_at_five_for_video(tiny_teacher, tmp_path):
    with pytest.raises(DistillError) as refused:
        parse_config(train_args(tiny_teacher, tmp_path / "o", tmp_path / "c", num_frames=2))
    assert "--num_frames 1 for images or --num_frames 5 for video" in refused.value.fixes[0]


@pytest.mark.parametrize(
    ("module", "argv"),
    [
        ("generate", ["--student", "s", "--output", "o.png", "--guidance", "nan"]),
        ("evaluate", ["--student", "s", "--guidance_scale", "inf"]),
        ("bench.cli", ["--peak_tflops", "nan"]),
    ],
)
def test_the_tools_refuse_non_finite_numbers_naming_the_flag(module, argv, capsys):
    import importlib

    tool = importlib.import_module(f"distill.{module}")
    with pytest.raises(SystemExit) as exited:
        tool.main(argv)
    err = capsys.readouterr().err
    assert exited.value.code == 2 and "must be a finite number" in err and argv[-2] in err
