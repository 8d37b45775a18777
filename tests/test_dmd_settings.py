"""What a bare `--method dmd` runs with: its own rates and schedule, and never a random start."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import REPO

from distill.config.cli import parse_config
from distill.ops.errors import DistillError, Stage
from train_distillation import main


def required(tmp_path: Path, teacher: Path) -> list[str]:
    return [
        "--teacher_path", str(teacher),
        "--student_config", str(REPO / "config" / "student_tiny.json"),
        "--data_path", str(REPO / "data" / "static_prompts.txt"),
        "--output_dir", str(tmp_path / "out"),
    ]  # fmt: skip


def test_a_bare_dmd_run_gets_wan_scale_rates_and_a_constant_schedule(tiny_teacher, tmp_path):
    cfg = parse_config([*required(tmp_path, tiny_teacher), "--method", "dmd", "--student_init", "teacher"])
    assert (cfg.lr, cfg.critic_lr, cfg.lr_scheduler) == (2e-6, 4e-7, "constant")
    velocity = parse_config(required(tmp_path, tiny_teacher))
    assert (velocity.lr, velocity.critic_lr, velocity.lr_scheduler) == (1e-4, None, "cosine")


def test_rates_given_on_the_command_line_or_in_a_config_file_win(tiny_teacher, tmp_path):
    base = [*required(tmp_path, tiny_teacher), "--method", "dmd", "--student_init", "teacher"]
    cfg = parse_config([*base, "--lr", "3e-5", "--lr_scheduler", "cosine"])
    assert (cfg.lr, cfg.critic_lr, cfg.lr_scheduler) == (3e-5, 4e-7, "cosine")
    config_file = tmp_path / "run.yaml"
    config_file.write_text("critic_lr: 3.0e-4\n")
    assert parse_config([*base, "--config", str(config_file)]).critic_lr == 3e-4


def test_dmd_from_a_random_start_is_refused_naming_the_flag_and_the_recipe(tiny_teacher, tmp_path, capsys):
    with pytest.raises(DistillError) as refused:
        parse_config([*required(tmp_path, tiny_teacher), "--method", "dmd"])
    assert refused.value.stage == Stage.CONFIG and "--student_init is random" in refused.value.title
    assert any("two-stage recipe" in fix for fix in refused.value.fixes)
    # From the real entry point: the config exit code, a banner, and nothing written.
    code = main([*required(tmp_path, tiny_teacher), "--method", "dmd", "--student_init", "random"])
    err = capsys.readouterr().err
    assert code == 3 and "ERROR (config)" in err and "Traceback" not in err
    assert not (tmp_path / "out").exists()


def test_a_terminal_shift_is_exported_so_that_stock_set_timesteps_reproduces_the_grid(tmp_path):
    from diffusers import FlowMatchEulerDiscreteScheduler

    from distill.models.few_step import few_step_scheduler, student_grid

    few_step_scheduler(5.0, 0.25).save_pretrained(tmp_path)
    loaded = FlowMatchEulerDiscreteScheduler.from_pretrained(tmp_path)
    loaded.set_timesteps(4)  # all WanPipeline does with it
    assert [round(float(t)) for t in loaded.timesteps] == [1000, 931, 783, 250]
    assert loaded.timesteps.tolist() == student_grid(few_step_scheduler(5.0, 0.25), 4)[0].tolist()
    assert [round(float(t)) for t in student_grid(few_step_scheduler(5.0), 4)[0]] == [1000, 910, 717, 24]


@pytest.mark.parametrize("value", ["0", "1.5", "nan"])
def test_a_terminal_shift_outside_0_1_is_refused(tiny_teacher, tmp_path, value):
    argv = [*required(tmp_path, tiny_teacher), "--method", "dmd", "--student_init", "teacher"]
    with pytest.raises(DistillError, match="--student_shift_terminal"):
        parse_config([*argv, "--student_shift_terminal", value])
