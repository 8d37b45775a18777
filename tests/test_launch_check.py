"""The ranks of a launch that was given `python` as its script meet before they report
(distill/ops/launch_check.py), and leave nothing behind in the temporary folder, whichever rank
torchrun stops first."""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

import pytest

from distill.ops.launch_check import wait_for_local_ranks

RUN_ID = "launch-check-test"


@pytest.fixture
def launch(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """A two-rank launch's environment with the temporary folder in tmp_path; returns the folder the
    ranks meet in."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    for name, value in {
        "TORCHELASTIC_RUN_ID": RUN_ID,
        "TORCHELASTIC_RESTART_COUNT": "0",
        "LOCAL_WORLD_SIZE": "2",
    }.items():
        monkeypatch.setenv(name, value)
    return tmp_path / f"distill-launch-{RUN_ID}-0"


@pytest.mark.parametrize("rank, other", [("1", "0"), ("0", "1")])
def test_the_rank_that_sees_every_mark_removes_the_folder(
    launch: Path, monkeypatch: pytest.MonkeyPatch, rank: str, other: str
) -> None:
    """The other rank has left its mark and was stopped before it could clean up (torchrun stops the
    ranks still running once one has failed): this rank returns at once and removes the folder."""
    launch.mkdir()
    (launch / other).touch()
    monkeypatch.setenv("LOCAL_RANK", rank)
    started = time.monotonic()
    wait_for_local_ranks(timeout=30)
    assert time.monotonic() - started < 10  # it did not wait for the timeout
    assert not launch.exists()


def test_a_rank_left_alone_removes_the_folder_after_the_timeout(
    launch: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Alone after the timeout, a rank removes the folder too: nothing is left for a later launch."""
    monkeypatch.setenv("LOCAL_RANK", "0")
    wait_for_local_ranks(timeout=0.2)
    assert not launch.exists()
