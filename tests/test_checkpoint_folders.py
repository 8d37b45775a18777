"""What users put into and do to checkpoint folders: copies beside ours, damaged checkpoints named
on purpose, and disks that fill up whatever words the library that noticed uses."""

from __future__ import annotations

import shutil
from collections import namedtuple
from pathlib import Path

import pytest
from conftest import train_args

from distill.config.cli import parse_config
from distill.ops.errors import DistillError, Stage
from distill.ops.files import disk_is_full
from distill.train import checkpoint as ckpt
from distill.train.trainer import Distiller
from train_distillation import main


def run(args):
    return Distiller(parse_config(args)).run()


def test_a_users_backup_copy_beside_the_step_folders_is_left_alone(tiny_teacher, shared_cache, tmp_path):
    out = tmp_path / "out"
    run(train_args(tiny_teacher, out, shared_cache, num_steps=4, checkpoint_every=2))
    root = out / "checkpoints"
    shutil.copytree(root / "step_00000004", root / "step_00000004.bak")
    shutil.copytree(root / "step_00000002", root / "step_2 before the change")
    assert [p.name for p in ckpt.complete_checkpoints(root)] == ["step_00000002", "step_00000004"]
    result = run(train_args(tiny_teacher, out, shared_cache, num_steps=6, checkpoint_every=2))
    assert result.resumed_from.name == "step_00000004" and result.steps == 6
    assert (root / "step_00000004.bak" / "COMPLETE").is_file()  # never pruned: it is not ours


def test_resuming_a_named_damaged_checkpoint_is_a_checkpoint_failure(
    tiny_teacher, shared_cache, tmp_path, capsys
):
    out = tmp_path / "out"
    run(train_args(tiny_teacher, out, shared_cache, num_steps=4, checkpoint_every=2))
    damaged = out / "checkpoints" / "step_00000004"
    weights = damaged / "student.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])
    code = main(train_args(tiny_teacher, out, shared_cache, num_steps=6, resume=damaged))
    err = capsys.readouterr().err
    assert code == int(Stage.CHECKPOINT), err
    assert f"checkpoint {damaged} is damaged" in err and "here: step_00000002" in err
    assert "Traceback" not in err


def test_a_full_disk_is_recognised_when_torch_only_says_iostream_error(
    tiny_teacher, shared_cache, tmp_path, monkeypatch
):
    real_save = ckpt.torch.save
    calls = []

    def save_on_a_disk_that_fills(obj, path, *args, **kwargs):
        calls.append(path)
        if len(calls) == 2:
            raise RuntimeError(
                "[enforce fail at inline_container.cc:664] . unexpected pos 64 vs 0: iostream error"
            )
        return real_save(obj, path, *args, **kwargs)

    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(ckpt.torch, "save", save_on_a_disk_that_fills)
    monkeypatch.setattr(ckpt.shutil, "disk_usage", lambda _: usage(2 * 1024**2, 2 * 1024**2, 0))
    with pytest.raises(DistillError) as err:
        run(train_args(tiny_teacher, tmp_path / "out", shared_cache, num_steps=6, checkpoint_every=2))
    assert err.value.stage == Stage.CHECKPOINT and err.value.title.startswith("the disk is full")
    assert sorted(p.name for p in (tmp_path / "out" / "checkpoints").iterdir()) == ["step_00000002"]


def test_a_failed_write_on_a_disk_with_room_is_not_called_full(tmp_path):
    assert not disk_is_full(RuntimeError("iostream error"), tmp_path)


def test_force_resume_with_another_student_shape_is_refused_and_keeps_the_run_config(
    tiny_teacher, shared_cache, tmp_path, capsys
):
    import json

    from conftest import REPO

    out = tmp_path / "out"
    run(train_args(tiny_teacher, out, shared_cache, num_steps=2, checkpoint_every=2))
    run_config = (out / "run_config.json").read_text()
    other = tmp_path / "other.json"
    other.write_text(
        json.dumps({**json.loads((REPO / "config" / "student_tiny.json").read_text()), "num_layers": 1})
    )
    code = main(
        train_args(tiny_teacher, out, shared_cache, num_steps=4, student_config=other, force_resume=True)
    )
    err = capsys.readouterr().err
    assert code == int(Stage.CHECKPOINT) and "does not fit this run's models" in err
    assert "Traceback" not in err
    assert (out / "run_config.json").read_text() == run_config


def test_a_full_disk_at_export_is_named_and_leaves_no_staging_folder(tiny_teacher, tmp_path, monkeypatch):
    from conftest import REPO
    from safetensors import SafetensorError

    from distill.models.student import build_student, export_student
    from distill.models.student_config import load_student_config
    from distill.models.teacher import inspect_teacher

    config = load_student_config(
        REPO / "config" / "student_tiny.json", inspect_teacher(str(tiny_teacher)).expert_config
    )
    student = build_student(config, seed=0)

    def save_on_a_full_disk(*args, **kwargs):
        raise SafetensorError("Error while serializing: IoError(Os { code: 28, kind: StorageFull })")

    monkeypatch.setattr(student, "save_pretrained", save_on_a_full_disk)
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(ckpt.shutil, "disk_usage", lambda _: usage(2 * 1024**2, 2 * 1024**2, 0))
    with pytest.raises(DistillError) as err:
        export_student(student, tmp_path / "student")
    assert err.value.stage == Stage.CHECKPOINT
    assert err.value.title == f"the disk is full: cannot export the student to {tmp_path / 'student'}"
    assert list(tmp_path.iterdir()) == []  # no .student.tmp-* left behind


def test_a_prune_cut_short_never_leaves_a_complete_looking_checkpoint(tmp_path, monkeypatch):
    import os

    import torch

    root = tmp_path / "checkpoints"
    for step in (1, 2, 3):
        ckpt.save_checkpoint(root, step, {"w": torch.zeros(2)}, {}, {"consumed": 0}, keep_last=10)
    (root / ".tmp-step_00000009-999999").mkdir()  # a save killed long ago, by another process

    def killed_halfway(folder, ignore_errors=False):  # deletes the weights, then the process dies
        (Path(folder) / "student.safetensors").unlink()
        raise KeyboardInterrupt

    monkeypatch.setattr(ckpt.shutil, "rmtree", killed_halfway)
    with pytest.raises(KeyboardInterrupt):
        ckpt.prune(root, keep_last=2)
    monkeypatch.undo()
    assert [p.name for p in ckpt.complete_checkpoints(root)] == ["step_00000002", "step_00000003"]
    ckpt.prune(root, keep_last=2)  # the next prune clears what the killed ones left
    assert sorted(os.listdir(root)) == ["step_00000002", "step_00000003"]
