"""Flags either do what they say or are refused with why; an output folder never holds exports that
disagree with each other or with its run_config.json, and a refused or failed export leaves no
half-moved folder (issue 36, classes 3 and 6)."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from conftest import REPO, train_args

from distill import evaluate, generate
from distill.config.cli import parse_config
from distill.models.lora import LoraShape
from distill.models.teacher import inspect_teacher
from distill.ops.errors import DistillError
from distill.report.toy_report import toy_prompt_count
from distill.toy import world
from distill.train.identity import check_identity
from train_distillation import main

PROMPTS = REPO / "data" / "static_prompts.txt"


def lora_args(teacher: Path, out: Path, cache: Path, **overrides: object) -> list[str]:
    """A one-step velocity run of a rank-2 LoRA student on two prompts."""
    settings: dict[str, object] = dict(
        student_config=None, student_lora_rank=2, num_steps=1, max_prompts=2, batch_size=1
    )
    settings.update(overrides)
    return train_args(teacher, out, cache, **settings)


@pytest.fixture(scope="module")
def lora_run(tiny_teacher, tmp_path_factory) -> tuple[Path, Path]:
    """(output_dir, cache_dir) of a finished LoRA run that exported lora/ and merged/ at step 1."""
    root = tmp_path_factory.mktemp("lora_run")
    assert main(lora_args(tiny_teacher, root / "out", root / "cache", export_formats="diffusers,merged")) == 0
    assert (root / "out" / "merged").is_dir() and (root / "out" / "lora").is_dir()
    return root / "out", root / "cache"


def copy_of(run: tuple[Path, Path], tmp_path: Path) -> Path:
    shutil.copytree(run[0], tmp_path / "out")
    return tmp_path / "out"


def contents(folder: Path) -> dict[str, bytes]:
    """Every file under `folder` but the run lock (each run writes its own pid there)."""
    return {
        str(p.relative_to(folder)): p.read_bytes()
        for p in sorted(folder.rglob("*"))
        if p.is_file() and p.name != ".run.lock"
    }


# --- class 3: flags accepted and ignored, or applied wrongly ---------------------------------------


@pytest.mark.parametrize(
    "extra, named, enabler",
    [
        (["--student_init_expert", "high"], "--student_init_expert", "--student_init teacher"),
        (["--critic_updates", "3"], "--critic_updates", "--method dmd"),
        (["--student_lora_targets", "to_q"], "--student_lora_targets", "--student_lora_rank"),
        (["--eval_prompts", str(PROMPTS)], "--eval_prompts", "--eval_interval"),
        (["--wandb_run_name", "x"], "--wandb_run_name", "--wandb_project"),
        (
            ["--guidance_scale", "1", "--guidance_scale_2", "1", "--negative_prompt", "blurry"],
            "--negative_prompt",
            "guidance",
        ),
    ],
)
def test_a_flag_that_would_be_ignored_is_refused_naming_what_enables_it(
    tiny_teacher, tmp_path, capsys, extra, named, enabler
):
    code = main(train_args(tiny_teacher, tmp_path / "out", tmp_path / "cache") + extra)
    err = capsys.readouterr().err
    assert code == 3 and "Traceback" not in err
    assert f"{named} needs" in err and enabler in err and f"drop {named}" in err
    assert not (tmp_path / "out").exists()  # refused before anything was written


# Every setting of a trainer rule (distill.config.flag_rules.TRAIN_DEPENDENTS) with a value that
# would change something if its rule were active: given without what enables it, refused.
CHANGING_VALUES = {
    "student_init_expert": "high",
    "student_lora_alpha": 8.0,
    "critic_lora_rank": 4,
    "student_lora_init": "some/lora",
    "expert_phase": "high",
    "student_lora_targets": "to_q",
    "student_steps": 2,
    "student_shift": 3.0,
    "student_shift_terminal": 0.25,
    "critic_config": str(REPO / "config" / "student_tiny.json"),
    "critic_init": "teacher",
    "critic_updates": 3,
    "critic_lr": 1e-4,
    "critic_betas": "0.9,0.99",
    "generator_betas": "0.9,0.99",
    "dmd_inputs": "data",
    "regression_weight": 0.25,
    "reference_prompts": 8,
    "rollout_frames": 33,
    "eval_prompts": str(PROMPTS),
    "eval_num_buckets": 3,
    "eval_samples_per_bucket": 2,
    "sample_interval": 10,
    "sample_prompts": str(PROMPTS),
    "sample_dir": "samples",
    "wandb_mode": "offline",
    "wandb_run_name": "x",
    "negative_prompt": "blurry",
}


def rule_settings() -> list[str]:
    from distill.config.flag_rules import TRAIN_DEPENDENTS

    return [name for rule in TRAIN_DEPENDENTS for name in rule.names]


def test_every_trainer_rule_setting_is_walked_below():
    assert sorted(rule_settings()) == sorted(CHANGING_VALUES)


@pytest.mark.parametrize("name", sorted(CHANGING_VALUES))
def test_a_rule_refuses_a_value_that_would_be_ignored_and_never_the_default_or_off_value(
    tiny_teacher, tmp_path, name
):
    """What scripts do (pass a flag at its default or at its off value, e.g. `--wandb_mode disabled`)
    is accepted without a word; a value that would do something, without what enables it, is refused.
    No guidance (1 / 1): the negative prompt's rule is inactive too."""
    from distill.config.flag_rules import TRAIN_DEPENDENTS
    from distill.config.settings import field_defaults

    base = train_args(
        tiny_teacher, tmp_path / "out", tmp_path / "cache", guidance_scale=1, guidance_scale_2=1
    )
    rule = next(rule for rule in TRAIN_DEPENDENTS if name in rule.names)
    quiet = [v for v in (field_defaults()[name], rule.off.get(name)) if v is not None]
    for value in quiet:
        cfg = parse_config([*base, f"--{name}", str(value)])
        assert getattr(cfg, name) == value
    with pytest.raises(DistillError, match=f"--{name} needs"):
        parse_config([*base, f"--{name}", str(CHANGING_VALUES[name])])
    if name == "wandb_mode":  # the off value that motivated this: switching wandb off is never refused
        assert "disabled" in quiet


def test_wandb_mode_disabled_trains_without_a_word(tiny_teacher, tmp_path, capsys):
    code = main(
        train_args(tiny_teacher, tmp_path / "out", tmp_path / "cache", num_steps=1, wandb_mode="disabled")
    )
    captured = capsys.readouterr()
    assert code == 0 and "--wandb" not in captured.err, captured.err[-2000:]


def test_a_default_given_in_a_config_file_is_accepted(tiny_teacher, tmp_path):
    config = tmp_path / "run.yaml"
    config.write_text("critic_updates: 5\nwandb_mode: disabled\nregression_weight: 0\n")
    cfg = parse_config(train_args(tiny_teacher, tmp_path / "out", tmp_path / "cache", config=config))
    assert (cfg.critic_updates, cfg.wandb_mode, cfg.regression_weight) == (5, "disabled", 0.0)


def test_a_dependent_setting_from_a_config_file_is_named_in_that_file(tiny_teacher, tmp_path, capsys):
    config = tmp_path / "run.yaml"
    config.write_text("critic_updates: 3\n")
    code = main(train_args(tiny_teacher, tmp_path / "out", tmp_path / "cache", config=config))
    err = capsys.readouterr().err
    assert code == 3 and f"'critic_updates' in {config} needs --method dmd" in err


@pytest.mark.parametrize(
    "extra, words",
    [
        (["--guidance_scale", "-3"], "--guidance_scale must be 1 (no guidance) or more, got -3"),
        (["--guidance_scale_2", "0.5"], "--guidance_scale_2 must be 1 (no guidance) or more, got 0.5"),
        (["--guidance_scale", "1", "--guidance_scale_2", "3"], "--guidance_scale_2 3 would be ignored"),
    ],
)
def test_guidance_that_would_not_be_applied_as_given_is_refused_by_the_trainer(
    tiny_teacher, tmp_path, capsys, extra, words
):
    code = main(train_args(tiny_teacher, tmp_path / "out", tmp_path / "cache") + extra)
    err = capsys.readouterr().err
    assert code == 3 and words in err and "Traceback" not in err


def test_generate_refuses_guidance_2_and_a_negative_prompt_that_a_one_model_student_would_ignore(
    tiny_teacher, tmp_path, capsys
):
    student = tmp_path / "student"  # a one-model student's folder: refused before its weights are read
    student.mkdir()
    shutil.copy(REPO / "config" / "student_tiny.json", student / "config.json")
    common = ["--teacher_path", str(tiny_teacher), "--prompt", "a cat", "--output", str(tmp_path / "a.png")]
    assert generate.main(["--student", str(student), "--guidance_2", "7", *common]) == 3
    err = capsys.readouterr().err
    assert "--guidance_2 needs --teacher_only or a LoRA student" in err and "use --guidance" in err
    assert generate.main(["--student", str(student), "--negative_prompt", "blurry", *common]) == 3
    assert "--negative_prompt needs --guidance above 1" in capsys.readouterr().err
    # At 1 (no guidance) --guidance_2 asks for nothing: not refused (the render then fails on the
    # folder's missing weights, past the flag checks).
    generate.main(["--student", str(student), "--guidance_2", "1", *common])
    assert "--guidance_2 needs" not in capsys.readouterr().err
    assert not (tmp_path / "a.png").exists()


def test_generate_applies_guidance_2_to_a_lora_student(lora_run, capsys):
    lora = lora_run[0] / "lora"
    latents = {}
    for extra in ([], ["--guidance_2", "1.5"]):
        args = generate.build_parser().parse_args(
            ["--student", str(lora), "--prompt", "a cat", "--output", "x.png", "--guidance", "4", *extra]
        )
        found = generate.resolve_defaults(args)
        pipe = generate.build_pipeline(
            args, inspect_teacher(args.teacher_path), torch.device("cpu"), torch.float32, found[0]
        )
        latents[bool(extra)] = generate.render(pipe, args, "a cat", 0, output_type="latent")
    assert not torch.allclose(latents[False], latents[True])  # before: --guidance_2 changed nothing
    # A low-noise scale alone would be dropped by WanPipeline: refused.
    code = generate.main(["--student", str(lora), "--prompt", "a", "--output", "y.png", "--guidance_2", "3"])
    assert code == 3 and "--guidance_2 3 would be ignored: --guidance is 1" in capsys.readouterr().err


def test_lora_targets_are_kept_once_in_one_order_and_old_orders_still_resume(tiny_teacher, tmp_path):
    args = lora_args(
        tiny_teacher, tmp_path / "out", tmp_path / "cache", student_lora_targets="to_v,to_q,to_q"
    )
    assert parse_config(args).student_lora_targets == "to_q,to_v"
    assert LoraShape(2, 2.0, ("to_v", "to_q", "to_q")) == LoraShape(2, 2.0, ("to_q", "to_v"))
    lora = {"rank": 2, "alpha": 2.0, "critic_rank": None}
    older = {"identity": {"lora": {**lora, "targets": ["to_v", "to_q"]}}}  # stored as the flag spelled it
    check_identity(tmp_path, older, {"lora": {**lora, "targets": ["to_q", "to_v"]}}, force=False)
    with pytest.raises(DistillError, match="(?i)different lora"):
        check_identity(tmp_path, older, {"lora": {**lora, "targets": ["to_q"]}}, force=False)


def test_toy_prompts_is_checked_before_anything_is_sampled(lora_run, tmp_path, capsys):
    out = tmp_path / "eval"
    base = ["--student", str(lora_run[0] / "lora"), "--prompts", str(PROMPTS), "--output_dir", str(out)]
    assert evaluate.main([*base, "--toy_prompts", "100000"]) == 3  # the tiny teacher is no toy one
    assert "--toy_prompts needs a toy teacher" in capsys.readouterr().err and not out.exists()
    assert evaluate.main([*base, "--guidance_scale", "1", "--guidance_scale_2", "3"]) == 3
    assert "--guidance_scale_2 3 would be ignored: --guidance_scale is 1" in capsys.readouterr().err
    toy = tmp_path / "toy"
    toy.mkdir()
    (toy / world.WORLD_FILE).write_text(json.dumps(world.describe()))
    distinct = len(world.all_prompts())
    assert toy_prompt_count(None, toy) == distinct and toy_prompt_count(5, toy) == 5
    with pytest.raises(DistillError, match=f"between 1 and {distinct}") as refused:
        toy_prompt_count(100000, toy)
    assert f"--toy_prompts {distinct}" in refused.value.fixes[0]


# --- class 6: output state ---------------------------------------------------------------------------


def test_a_run_continued_without_merged_moves_the_old_merged_aside_and_says_so(
    lora_run, tiny_teacher, tmp_path, capsys
):
    out = copy_of(lora_run, tmp_path)
    old_merged = contents(out / "merged")
    assert main(lora_args(tiny_teacher, out, lora_run[1], num_steps=2)) == 0
    assert not (out / "merged").exists() and (out / "lora").is_dir()
    assert contents(out / "stale_exports" / "merged") == old_merged  # set aside, not lost
    log = capsys.readouterr().err
    assert "merged/ in" in log and "moved to" in log and str(out / "stale_exports" / "merged") in log


def test_num_steps_below_the_checkpoints_step_is_refused_with_nothing_changed(
    lora_run, tiny_teacher, tmp_path, capsys
):
    out = copy_of(lora_run, tmp_path)
    assert main(lora_args(tiny_teacher, out, lora_run[1], num_steps=2)) == 0
    before = contents(out)
    capsys.readouterr()
    assert main(lora_args(tiny_teacher, out, lora_run[1], num_steps=1)) == 9
    err = capsys.readouterr().err
    assert "is at step 2, past the end of this run (--num_steps is 1)" in err and "--num_steps 2" in err
    assert contents(out) == before  # run_config.json still says 2, the adapters are those of step 2


def test_an_export_that_cannot_replace_its_folder_leaves_the_old_one_whole(
    lora_run, tiny_teacher, tmp_path, capsys, monkeypatch
):
    out = copy_of(lora_run, tmp_path)
    old_lora = contents(out / "lora")
    real_replace = os.replace

    def refuse_to_move_lora(src, dst):  # what a read-only lora/ does to a non-root user
        if Path(src) == out / "lora":
            raise PermissionError(13, "Permission denied", str(src))
        return real_replace(src, dst)

    monkeypatch.setattr("distill.ops.files.os.replace", refuse_to_move_lora)
    code = main(lora_args(tiny_teacher, out, lora_run[1], export_formats="diffusers,merged"))
    err = capsys.readouterr().err
    assert code == 9 and f"cannot export to {out / 'lora'}" in err and "Traceback" not in err
    assert contents(out / "lora") == old_lora
    assert not [p.name for p in out.iterdir() if p.name.startswith(".lora.")]  # no half-moved folder


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only folders")
def test_a_read_only_export_is_refused_before_training(lora_run, tiny_teacher, tmp_path, capsys):
    out = copy_of(lora_run, tmp_path)
    before = contents(out)
    (out / "lora").chmod(0o555)
    try:
        code = main(lora_args(tiny_teacher, out, lora_run[1], num_steps=2))
    finally:
        (out / "lora").chmod(0o755)
    err = capsys.readouterr().err
    assert code == 3 and "lora/ cannot be replaced (not writable)" in err and "chmod -R u+w" in err
    assert contents(out) == before
