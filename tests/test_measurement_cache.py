"""The plan's measurements on disk: a later process reads what an earlier one measured under the same
code, and anything else (another code, a damaged entry, a folder it cannot write) measures afresh."""

from __future__ import annotations

import json

import pytest
from conftest import SMALL_EXPERT, train_args

from distill.train import activations, measurement_cache
from distill.train.activations import ModelUse, trained
from distill.train.measurement_cache import PLAN_CACHE_ENV, cached_measurement, entry_path
from distill.train.trainer import CPU_PLAN
from train_distillation import main

USE = ModelUse.of({**SMALL_EXPERT, "num_layers": 4}, latent_shape=(16, 1, 4, 4), text_len=5, batch=1)


@pytest.fixture
def folder(tmp_path, monkeypatch):
    monkeypatch.setenv(PLAN_CACHE_ENV, str(tmp_path / "plan"))
    activations._measure.cache_clear()  # this process's own copies: the disk is what is tested
    yield tmp_path / "plan"
    activations._measure.cache_clear()


def refuse() -> tuple[float, ...]:
    raise AssertionError("measured again")


def test_a_later_process_reads_the_measurement_instead_of_measuring(folder, monkeypatch):
    measured = trained(USE)
    assert measured.held > 0 and measured.peak > measured.held
    assert len(list(folder.glob("*.json"))) == 2  # the two probe depths
    activations._measure.cache_clear()  # as a new process starts
    monkeypatch.setattr(activations, "_measure_now", lambda *args: refuse())
    assert trained(USE) == measured


def test_the_entry_holds_its_numbers_and_is_what_is_returned(folder):
    assert cached_measurement("k", lambda: (1.5, 2)) == (1.5, 2.0)
    path = entry_path("k")
    assert json.loads(path.read_text()) == {"key": "k", "values": [1.5, 2.0]}
    path.write_text(json.dumps({"key": "k", "values": [7.0]}))
    assert cached_measurement("k", refuse) == (7.0,)


def test_another_code_measures_again(folder, monkeypatch):
    cached_measurement("k", lambda: (1.0,))
    monkeypatch.setattr(measurement_cache, "code_fingerprint", lambda: "another version")
    assert cached_measurement("k", lambda: (2.0,)) == (2.0,)
    monkeypatch.undo()
    monkeypatch.setenv(PLAN_CACHE_ENV, str(folder))
    assert cached_measurement("k", refuse) == (1.0,)  # the first entry was left as it was


@pytest.mark.parametrize("damage", ["", "{not json", '{"key": "k"}', '{"key": "other", "values": [3]}'])
def test_a_damaged_entry_is_measured_again_and_replaced(folder, damage):
    cached_measurement("k", lambda: (1.0,))
    entry_path("k").write_text(damage)
    assert cached_measurement("k", lambda: (4.0,)) == (4.0,)
    assert cached_measurement("k", refuse) == (4.0,)


def test_a_folder_that_cannot_be_written_costs_only_the_time(tmp_path, monkeypatch):
    blocked = tmp_path / "a file"
    blocked.write_text("where the folder would be")
    monkeypatch.setenv(PLAN_CACHE_ENV, str(blocked / "plan"))
    assert cached_measurement("k", lambda: (5.0,)) == (5.0,)
    assert cached_measurement("k", lambda: (6.0,)) == (6.0,)  # nothing was kept
    assert [p.name for p in tmp_path.iterdir()] == ["a file"]


def test_a_cpu_run_measures_no_plan_and_its_dry_run_does(folder, tiny_teacher, tmp_path, capsys):
    """A run on the CPU logs that its plan was not measured (it plans accelerator memory, and measuring
    costs seconds per model use); --dry_run of the same run measures and prints it."""
    args = train_args(tiny_teacher, tmp_path / "out", tmp_path / "cache", num_steps=1)
    assert main(args) == 0
    assert "plan:\nteacher placement: gpu" in (err := capsys.readouterr().err) and CPU_PLAN in err
    assert not folder.exists() or not list(folder.glob("*.json"))
    dry = train_args(tiny_teacher, tmp_path / "dry", tmp_path / "cache", num_steps=1, dry_run=True)
    assert main(dry) == 0
    assert "memory per device" in capsys.readouterr().out
    assert list(folder.glob("*.json"))  # measured
