"""Crashes, preemption, non-finite steps, full disks and bad input: nothing written is lost.

Real processes where the failure is about processes (signals, SIGKILL, torchrun restarts), the
tiny real teacher throughout.
"""

from __future__ import annotations

import errno
import json
import logging
import math
import os
import shutil
import sys

import pytest
import torch
from conftest import REPO, TORCHRUN, WARM_PYTHON, WARM_TORCHRUN, repo_pythonpath, run_command, train_args
from safetensors.torch import load_file

from distill.config.cli import parse_config
from distill.models.tiny import write_tiny_teacher
from distill.ops.errors import DistillError, Stage
from distill.train import checkpoint as ckpt
from distill.train.trainer import Distiller
from train_distillation import main

pytestmark = pytest.mark.long  # a minute or more in all: scheduled first (conftest.py)


def run_inprocess(args):
    return Distiller(parse_config(args)).run()


def run_process(args, fault=None, nproc=None, launcher_args=(), warm=False):
    # TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1: without it, workers restarted by --max-restarts can fail or hang
    # in init_process_group on stale keys of the shared store (torch 2.13/2.14).
    env = {
        **os.environ,
        "PYTHONPATH": repo_pythonpath(),
        "OMP_NUM_THREADS": "1",
        "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
    }
    env.pop("DISTILL_INJECT_FAULT", None)
    if fault:
        env["DISTILL_INJECT_FAULT"] = fault
    if nproc:
        # A run that checks a failure launches as users do; the others start their ranks warm (conftest).
        command = [
            *(TORCHRUN if fault or launcher_args else WARM_TORCHRUN),
            *(launcher_args or ["--standalone"]),
            f"--nproc_per_node={nproc}",
            "--shutdown-timeout=10",
            str(REPO / "train_distillation.py"),
        ]
    else:  # one process; `warm`: forked after the imports (for a run that is no failure)
        command = [*(WARM_PYTHON if warm else [sys.executable]), str(REPO / "train_distillation.py")]
    return run_command([*command, *map(str, args)], env=env, timeout=240, cwd=REPO)


def student_weights(output_dir):
    return load_file(str(output_dir / "student" / "diffusion_pytorch_model.safetensors"))


def checkpoints(output_dir):
    return [p.name for p in ckpt.complete_checkpoints(output_dir / "checkpoints")]


# ------------------------------------------------------------------------------------------------
# Preemption and crashes
# ------------------------------------------------------------------------------------------------


def test_sigterm_saves_at_current_step_and_the_rerun_ends_bitwise_equal(tiny_teacher, shared_cache, tmp_path):
    common = dict(num_steps=6, checkpoint_every=100)
    # A process of one thread as the interrupted run (there started as users do), so the float
    # arithmetic is the same.
    straight = run_process(train_args(tiny_teacher, tmp_path / "straight", shared_cache, **common), warm=True)
    assert straight.returncode == 0, straight.stderr[-2000:]

    out = tmp_path / "preempted"
    first = run_process(train_args(tiny_teacher, out, shared_cache, **common), fault="sigterm:3")
    assert first.returncode == 75, first.stderr[-2000:]
    assert "stopped by SIGTERM at step 3" in first.stdout
    assert checkpoints(out) == ["step_00000003"]
    assert not (out / "student").exists()  # an unfinished run exports nothing

    second = run_process(train_args(tiny_teacher, out, shared_cache, **common), warm=True)
    assert second.returncode == 0, second.stderr[-2000:]
    assert "resumed from" in second.stderr and "step_00000003" in second.stderr
    a, b = student_weights(tmp_path / "straight"), student_weights(out)
    assert all(torch.equal(a[k], b[k]) for k in a)


# SIGTERM on one of two ranks: tests/test_stress.py (sigterm_one_rank, twice, with its resume).


def test_kill9_of_one_worker_then_resume_auto_finishes(tiny_teacher, shared_cache, tmp_path):
    args = train_args(
        tiny_teacher, tmp_path / "killed", shared_cache, num_steps=8, batch_size=1, checkpoint_every=2
    )
    crashed = run_process(args, fault="kill:5@1", nproc=2)
    assert crashed.returncode != 0
    assert "SIGKILL" in crashed.stderr and "SECONDARY" in crashed.stderr
    assert checkpoints(tmp_path / "killed")[-1] == "step_00000004"

    resumed = run_process(args, nproc=2)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "step_00000004" in resumed.stderr and "resumed from" in resumed.stderr

    reference = run_process(
        train_args(tiny_teacher, tmp_path / "ref", shared_cache, num_steps=8, batch_size=1), nproc=2
    )
    assert reference.returncode == 0
    a, b = student_weights(tmp_path / "ref"), student_weights(tmp_path / "killed")
    assert max((a[k] - b[k]).abs().max().item() for k in a) < 1e-5


def test_torchrun_max_restarts_continues_from_the_latest_checkpoint(tiny_teacher, shared_cache, tmp_path):
    # The command documented in TORCHRUN_ERROR_FIXES.md (with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1, see run_process).
    launcher = ["--standalone", "--max-restarts=1"]
    args = train_args(
        tiny_teacher, tmp_path / "restarts", shared_cache, num_steps=6, batch_size=1, checkpoint_every=2
    )
    proc = run_process(args, fault="exception:4@1", nproc=2, launcher_args=launcher)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "injected exception at step 4" in proc.stderr  # the first attempt failed ...
    assert "resumed from" in proc.stderr and "step_00000002" in proc.stderr  # ... the restart resumed
    assert (tmp_path / "restarts" / "student").is_dir()


def test_truncated_newest_checkpoint_is_skipped_with_a_warning(tiny_teacher, shared_cache, tmp_path, caplog):
    out = tmp_path / "out"
    run_inprocess(train_args(tiny_teacher, out, shared_cache, num_steps=6, checkpoint_every=2, keep_last=3))
    newest = out / "checkpoints" / "step_00000006" / "student.safetensors"
    newest.write_bytes(newest.read_bytes()[:100])
    with caplog.at_level(logging.WARNING):
        result = run_inprocess(
            train_args(tiny_teacher, out, shared_cache, num_steps=8, checkpoint_every=2, keep_last=3)
        )
    assert result.resumed_from.name == "step_00000004"
    assert "skipping damaged checkpoint" in caplog.text and "step_00000006" in caplog.text
    assert result.steps == 8


def test_partial_checkpoint_folder_is_never_resumed(tiny_teacher, shared_cache, tmp_path):
    out = tmp_path / "out"
    run_inprocess(train_args(tiny_teacher, out, shared_cache, num_steps=4, checkpoint_every=2))
    (out / "checkpoints" / "step_00000004" / "COMPLETE").unlink()  # as if the save had died before its marker
    result = run_inprocess(train_args(tiny_teacher, out, shared_cache, num_steps=4, checkpoint_every=2))
    assert result.resumed_from.name == "step_00000002"


# ------------------------------------------------------------------------------------------------
# Non-finite steps and full disks
# ------------------------------------------------------------------------------------------------


def test_a_nan_step_is_skipped_and_counted_and_logs_no_made_up_loss(
    tiny_teacher, shared_cache, tmp_path, monkeypatch, capsys
):
    monkeypatch.setenv("DISTILL_INJECT_FAULT", "nan:3,nan:5")
    assert main(train_args(tiny_teacher, tmp_path / "out", shared_cache, num_steps=5)) == 0
    assert "done: 5 steps, loss" in capsys.readouterr().out
    rows = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5]
    assert [r["skipped_steps"] for r in rows] == [0, 0, 1, 1, 2]
    for row in (rows[2], rows[4]):  # a skipped step on a log step: marked, no loss, no 0.0
        assert row["skipped"] is True and row["loss"] is None and row["grad_norm"] is None, row
    for row in (rows[0], rows[1], rows[3]):
        assert "skipped" not in row and row["loss"] > 0 and row["grad_norm"] > 0, row
    assert all(torch.isfinite(v).all() for v in student_weights(tmp_path / "out").values())


def test_a_skipped_last_step_keeps_the_last_real_loss(tiny_teacher, shared_cache, tmp_path, monkeypatch):
    monkeypatch.setenv("DISTILL_INJECT_FAULT", "nan:4")
    result = run_inprocess(train_args(tiny_teacher, tmp_path / "out", shared_cache, num_steps=4))
    assert result.bad_steps == 1
    assert [h["loss"] for h in result.history][-1] is None
    assert result.last_loss == result.history[-2]["loss"] and result.last_loss > 0


def test_fp16_overflow_skips_the_update_the_lr_schedule_and_the_ema(tiny_teacher, tmp_path):
    # Guidance 1e6 makes the targets, and so the student's fp16 gradients under the grad scaler's
    # initial scale of 65536, overflow: real overflows of the real fp16 path, nothing injected.
    out = tmp_path / "out"
    result = run_inprocess(
        train_args(
            tiny_teacher,
            out,
            tmp_path / "cache",
            mixed_precision="fp16",
            guidance_scale=1e6,
            guidance_scale_2=1e6,
            num_steps=4,
            max_prompts=2,
            ema_decay=0.9,
        )
    )
    final = ckpt.load_checkpoint(out / "checkpoints" / "step_00000004")
    # The scaler halves its scale at each overflow (and grows it only after 2000 clean steps).
    overflows = round(math.log2(65536 / final.state["scaler"]["scale"]))
    assert 1 <= overflows < 4, final.state["scaler"]
    applied = 4 - overflows
    assert final.state["lr_schedule"]["last_epoch"] == applied
    assert final.state["ema"]["optimization_step"] == applied
    assert {s["step"].item() for s in final.state["optimizer"]["state"].values()} == {applied}
    # Counted as skipped, logged with their (finite) loss, but not bad steps: the run went on.
    assert final.meta["skipped_steps"] == overflows == result.bad_steps
    skipped_rows = [h for h in result.history if h.get("skipped")]
    assert len(skipped_rows) == overflows
    assert all(h["loss"] > 0 and h["grad_norm"] is None for h in skipped_rows)


def test_resumed_ema_weights_move_to_the_training_device(tiny_teacher, shared_cache, tmp_path):
    from diffusers.training_utils import EMAModel

    run_inprocess(train_args(tiny_teacher, tmp_path / "out", shared_cache, num_steps=2, ema_decay=0.9))
    saved = ckpt.load_checkpoint(tmp_path / "out" / "checkpoints" / "step_00000002")
    assert all(t.device.type == "cpu" for t in saved.state["ema"]["shadow_params"])  # map_location
    shadow = [t.clone() for t in saved.state["ema"]["shadow_params"]]
    # "meta" stands in for a GPU on this CPU-only machine: any device other than the CPU.
    for device in (torch.device("meta"), torch.device("cpu")):
        ema = EMAModel([torch.nn.Parameter(torch.zeros_like(t)) for t in shadow], decay=0.9)
        ckpt.restore_ema(ema, saved.state["ema"], device)
        assert all(t.device == device for t in ema.shadow_params)
        assert ema.optimization_step == 2
    assert all(torch.equal(a, b) for a, b in zip(ema.shadow_params, shadow))


def test_consecutive_nan_steps_stop_the_run_and_keep_the_last_good_checkpoint(
    tiny_teacher, shared_cache, tmp_path, monkeypatch, capsys
):
    monkeypatch.setenv("DISTILL_INJECT_FAULT", "nan:3,nan:4,nan:5")
    code = main(
        train_args(
            tiny_teacher, tmp_path / "out", shared_cache, num_steps=8, checkpoint_every=2, max_bad_steps=3
        )
    )
    err = capsys.readouterr().err
    assert code == int(Stage.TRAINING)
    assert "3 consecutive steps had a non-finite loss or gradient" in err and "step_00000002" in err
    assert checkpoints(tmp_path / "out") == ["step_00000002"]
    good = ckpt.load_checkpoint(tmp_path / "out" / "checkpoints" / "step_00000002")
    assert all(torch.isfinite(v).all() for v in good.model.values())


def test_full_disk_during_a_save_keeps_the_previous_checkpoint(
    tiny_teacher, shared_cache, tmp_path, monkeypatch
):
    real_save, calls = torch.save, []

    def save_until_disk_is_full(obj, path, *args, **kwargs):
        calls.append(path)
        if len(calls) == 2:  # the second checkpoint hits a full disk halfway
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_save(obj, path, *args, **kwargs)

    monkeypatch.setattr(ckpt.torch, "save", save_until_disk_is_full)
    with pytest.raises(DistillError) as err:
        run_inprocess(
            train_args(tiny_teacher, tmp_path / "out", shared_cache, num_steps=6, checkpoint_every=2)
        )
    assert err.value.stage == Stage.CHECKPOINT
    assert err.value.title.startswith("the disk is full") and "step 4" in err.value.title
    assert "step_00000002" in " ".join(err.value.fixes)
    assert sorted(p.name for p in (tmp_path / "out" / "checkpoints").iterdir()) == [
        "step_00000002"
    ]  # no debris
    assert ckpt.load_checkpoint(tmp_path / "out" / "checkpoints" / "step_00000002").step == 2


# ------------------------------------------------------------------------------------------------
# Bad input, refused before heavy work and without damage
# ------------------------------------------------------------------------------------------------


def _refused(capsys, args, code, *needles):
    assert main([str(a) for a in args]) == code
    err = capsys.readouterr().err
    for needle in needles:
        assert needle in err, (needle, err)
    assert "Traceback" not in err
    return err


@pytest.mark.parametrize(
    ("override", "needles"),
    [
        ({"num_steps": 0}, ["--num_steps must be a positive integer"]),
        ({"batch_size": -1}, ["--batch_size must be a positive integer"]),
        ({"num_frames": 4}, ["--num_frames must be 4k+1", "--num_frames 5"]),
        ({"height": 100}, ["--height must be a positive multiple of 16", "--height 96"]),
        ({"boundary_ratio": 1.5}, ["--boundary_ratio must lie in (0, 1)"]),
    ],
)
def test_values_out_of_range(tiny_teacher, tmp_path, capsys, override, needles):
    _refused(capsys, train_args(tiny_teacher, tmp_path / "out", tmp_path / "c", **override), 3, *needles)
    assert not (tmp_path / "out").exists()


def test_student_heads_inconsistent_with_width(tiny_teacher, tmp_path, capsys):
    bad = tmp_path / "student.json"
    bad.write_text(json.dumps({"hidden_size": 100, "num_heads": 3, "depth": 2}))
    _refused(
        capsys,
        train_args(tiny_teacher, tmp_path / "out", tmp_path / "c", student_config=bad),
        3,
        "hidden_size",
        "num_heads",
    )


def test_config_file_not_yaml_and_unknown_key(tiny_teacher, tmp_path, capsys):
    broken = tmp_path / "run.yaml"
    broken.write_text("lr: [1e-4\nbatch_size: 2\n")
    _refused(
        capsys,
        [*train_args(tiny_teacher, tmp_path / "o", tmp_path / "c"), "--config", broken],
        3,
        "not valid YAML",
        str(broken),
    )
    typo = tmp_path / "typo.yaml"
    typo.write_text("learning_rat: 1e-4\n")
    _refused(
        capsys,
        [*train_args(tiny_teacher, tmp_path / "o", tmp_path / "c"), "--config", typo],
        3,
        "unknown setting 'learning_rat'",
    )


def test_config_file_values_apply_and_flags_win(tiny_teacher, tmp_path):
    config = tmp_path / "run.yaml"
    config.write_text("lr: 0.0005\nbatch_size: 3\nema_decay: 0.9\n")
    cfg = parse_config(
        [
            *train_args(tiny_teacher, tmp_path / "o", tmp_path / "c", batch_size=None),
            "--config",
            str(config),
            "--lr",
            "0.002",
        ]
    )
    assert (cfg.lr, cfg.batch_size, cfg.ema_decay) == (0.002, 3, 0.9)


@pytest.mark.parametrize("kind", ["missing", "empty", "latin1", "binary"])
def test_bad_prompt_files(tiny_teacher, tmp_path, capsys, kind):
    path = tmp_path / "prompts.txt"
    if kind == "empty":
        path.write_text("# only a comment\n\n")
    elif kind == "latin1":
        path.write_bytes("a caf\xe9 at night\n".encode("latin-1"))
    elif kind == "binary":
        path.write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00\x00")
    needles = {
        "missing": "file or folder not found",
        "empty": "holds no prompts",
        "latin1": "is not UTF-8 (bad byte at line 1)",
        "binary": "binary file",
    }
    _refused(
        capsys,
        train_args(tiny_teacher, tmp_path / "out", tmp_path / "c", data_path=path),
        6,
        needles[kind],
        str(path),
    )
    assert not (tmp_path / "out").exists()


def test_prompts_longer_than_the_limit_are_counted_once_and_truncated(tiny_teacher, tmp_path, caplog):
    prompts = tmp_path / "long.txt"
    prompts.write_text(
        "a cat\n"
        + "a very long prompt about a garden full of roses and tulips\n" * 1
        + "a dog on a long sandy beach at sunset with waves\n"
    )
    with caplog.at_level(logging.WARNING):
        run_inprocess(
            train_args(
                tiny_teacher,
                tmp_path / "out",
                tmp_path / "c",
                data_path=prompts,
                max_sequence_length=6,
                num_steps=1,
            )
        )
    warnings = [r.getMessage() for r in caplog.records if "longer than 6 tokens" in r.getMessage()]
    assert len(warnings) == 1 and warnings[0].startswith("2 prompt(s)")


def test_truncated_teacher_weights_are_refused_before_anything_is_written(tiny_teacher, tmp_path, capsys):
    teacher = tmp_path / "teacher"
    shutil.copytree(tiny_teacher, teacher)
    weights = teacher / "transformer_2" / "diffusion_pytorch_model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    _refused(
        capsys,
        train_args(teacher, tmp_path / "out", tmp_path / "c"),
        5,
        "transformer_2 weights are damaged",
        "cut short",
    )
    assert not (tmp_path / "out").exists() and not (tmp_path / "c").exists()


def test_another_runs_checkpoints_are_never_overwritten(tiny_teacher, shared_cache, tmp_path, capsys):
    out = tmp_path / "out"
    run_inprocess(train_args(tiny_teacher, out, shared_cache, num_steps=2, checkpoint_every=1))
    before = {p: p.stat().st_mtime_ns for p in (out / "checkpoints").rglob("*")}
    _refused(
        capsys,
        train_args(tiny_teacher, out, shared_cache, resume="none"),
        9,
        "already holds checkpoints",
        "--resume auto",
    )
    other = tmp_path / "other.json"
    config = json.loads((REPO / "config" / "student_tiny.json").read_text())
    other.write_text(json.dumps({**config, "num_layers": 1}))
    err = _refused(
        capsys,
        train_args(tiny_teacher, out, shared_cache, student_config=other),
        9,
        "different student config",
        "'num_layers': 2",
        f"--output_dir {out}-2",
    )
    assert "--force_resume" not in err  # another student's tensors load into no run, forced or not
    assert {p: p.stat().st_mtime_ns for p in (out / "checkpoints").rglob("*")} == before


def test_force_resume_loads_a_checkpoint_of_another_prompt_set(tiny_teacher, shared_cache, tmp_path):
    out = tmp_path / "out"
    run_inprocess(train_args(tiny_teacher, out, shared_cache, num_steps=2))
    with pytest.raises(DistillError, match="different set of prompts and images"):
        run_inprocess(train_args(tiny_teacher, out, shared_cache, num_steps=4, max_prompts=6))
    result = run_inprocess(
        train_args(tiny_teacher, out, shared_cache, num_steps=4, max_prompts=6, force_resume=True)
    )
    assert result.resumed_from.name == "step_00000002" and result.steps == 4


def test_a_checkpoint_of_another_training_target_is_refused(tiny_teacher, shared_cache, tmp_path, capsys):
    out = tmp_path / "out"
    run_inprocess(train_args(tiny_teacher, out, shared_cache, num_steps=2))
    before = {p: p.stat().st_mtime_ns for p in (out / "checkpoints").rglob("*")}
    changes = [
        ("guidance_scale", "4.0", "5.0"),
        ("guidance_scale_2", "3.0", "1.0"),
        ("negative_prompt", "''", "'blurry'"),
        ("flow_shift", "3.0", "5.0"),
        ("boundary_ratio", "0.875", "0.5"),
        ("max_sequence_length", "512", "64"),
    ]
    for name, old, new in changes:
        _refused(
            capsys,
            train_args(tiny_teacher, out, shared_cache, num_steps=4, **{name: new.strip("'")}),
            9,
            f"different training target: --{name}",
            f"checkpoint: {{'{name}': {old}}}",
            f"this run:   {{'{name}': {new}}}",
            "--force_resume",
        )
    assert {p: p.stat().st_mtime_ns for p in (out / "checkpoints").rglob("*")} == before
    # The resolved value is what counts: the teacher scheduler's flow_shift is 3.0.
    assert run_inprocess(train_args(tiny_teacher, out, shared_cache, num_steps=3, flow_shift=3.0)).steps == 3
    forced = run_inprocess(
        train_args(tiny_teacher, out, shared_cache, num_steps=4, flow_shift=5.0, force_resume=True)
    )
    assert forced.resumed_from.name == "step_00000003" and forced.steps == 4


def test_unknown_teacher_shape_still_checked(tmp_path):
    # guard: the validation above is not specific to the default tiny shape
    write_tiny_teacher(tmp_path / "t", seed=1)
    assert (tmp_path / "t" / "transformer_2").is_dir()
