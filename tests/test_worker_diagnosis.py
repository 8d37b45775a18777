"""What died decides the report: a dead DataLoader worker is named as such, a lone process never
blames a peer, and clean-up after a failure never replaces the failure's banner."""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch

from distill.ops import workers
from distill.ops.errors import Stage, quietly
from distill.train.diagnose import failure_report


class Numbers(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 1000

    def __getitem__(self, index: int) -> torch.Tensor:
        return torch.full((4,), float(index))


@pytest.fixture
def loader_with_one_worker():
    """A real DataLoader iterator with one worker process, tracked as the training loop tracks it."""
    iterator = workers.track(iter(torch.utils.data.DataLoader(Numbers(), num_workers=1, batch_size=2)))
    next(iterator)
    yield iterator
    workers.shutdown()


@pytest.fixture
def single_process(monkeypatch):
    for name in ("WORLD_SIZE", "RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)


def test_a_reset_connection_from_a_dead_worker_is_a_data_failure_naming_the_worker(
    loader_with_one_worker, single_process
):
    (worker,) = loader_with_one_worker._workers
    os.kill(worker.pid, signal.SIGKILL)  # SIGKILL: no core-dump chatter from the worker
    # What the training process saw first in the failing runs: the worker's hand-over socket reset.
    error = failure_report(ConnectionResetError(104, "Connection reset by peer"))
    assert error.stage == Stage.DATA
    assert f"DataLoader worker (pid {worker.pid}) was killed by SIGKILL (Killed)" in error.details
    assert "ConnectionResetError" in error.details
    assert "another rank" not in error.title


def test_live_workers_do_not_turn_other_failures_into_data_failures(loader_with_one_worker, single_process):
    error = failure_report(ValueError("a bug"))
    assert error.stage == Stage.INTERNAL


def test_a_single_process_never_blames_another_rank(single_process):
    error = failure_report(ConnectionResetError(104, "Connection reset by peer"))
    assert error.stage == Stage.INTERNAL
    assert "another rank" not in error.title


def test_under_several_ranks_a_reset_connection_is_a_secondary_failure(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    error = failure_report(ConnectionResetError(104, "Connection reset by peer"))
    assert error.stage == Stage.TRAINING
    assert "lost contact with another rank" in error.title and "SECONDARY" in error.title


def test_a_failing_clean_up_step_is_one_line_and_raises_nothing(capsys, single_process):
    def join_interrupted() -> None:
        raise RuntimeError("DataLoader worker (pid 7) is killed by signal: Aborted.\nmore detail")

    quietly("stopping the stall watchdog", join_interrupted)
    err = capsys.readouterr().err
    assert err.strip() == (
        "warning: stopping the stall watchdog failed during clean-up "
        "(RuntimeError: DataLoader worker (pid 7) is killed by signal: Aborted.); ignored"
    )


def test_while_tracked_a_dying_worker_raises_nothing_until_the_loop_asks_for_a_batch(
    loader_with_one_worker, single_process
):
    (worker,) = loader_with_one_worker._workers
    os.kill(worker.pid, signal.SIGKILL)
    time.sleep(0.5)  # torch's own SIGCHLD handler would raise here, wherever the main thread is
    with pytest.raises(RuntimeError) as raised:
        for _ in range(1000):  # the batches already prefetched, then the wait that finds the death
            next(loader_with_one_worker)
    error = failure_report(raised.value)
    assert error.stage == Stage.DATA and f"pid {worker.pid}" in error.details


def test_releasing_the_loader_gives_torch_its_signal_handler_back():
    before = signal.getsignal(signal.SIGCHLD)
    iterator = workers.track(iter(torch.utils.data.DataLoader(Numbers(), num_workers=1, batch_size=2)))
    torchs = workers._silenced
    assert signal.getsignal(signal.SIGCHLD) == signal.SIG_DFL and callable(torchs)
    workers.release(iterator)
    assert signal.getsignal(signal.SIGCHLD) is torchs and not iterator._workers_status[0]
    assert before in (signal.SIG_DFL, torchs)  # the first loader of this process installs torch's


def test_a_secondary_failure_is_dated_after_the_first_for_torchruns_root_cause(tmp_path, monkeypatch):
    import json

    from distill.ops.errors import DistillError, report

    monkeypatch.setenv("WORLD_SIZE", "2")
    files = {}
    for rank, error in (
        (1, DistillError("out of memory", stage=Stage.OUT_OF_MEMORY)),
        (0, failure_report(RuntimeError("Connection closed by peer [127.0.0.1]:1"))),
    ):
        files[rank] = tmp_path / f"error-{rank}.json"
        monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(files[rank]))
        monkeypatch.setenv("RANK", str(rank))
        report(error)
    first, second = (json.loads(files[rank].read_text())["timestamp"] for rank in (1, 0))
    assert second > first  # torchrun picks the earliest, and rank 0 on a tie


def test_a_rank_killed_while_writing_its_error_file_leaves_none_half_written(tmp_path, monkeypatch):
    # torchrun parses the error file of every failed rank, and crashes (JSONDecodeError, no summary)
    # on an empty one: what a rank it SIGTERMs between opening and filling the file would leave.
    import json

    from distill.ops.errors import write_torchrun_error_file

    path = tmp_path / "error.json"
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(path))

    def killed(*args, **kwargs):
        raise KeyboardInterrupt  # stands for the signal arriving mid-write

    monkeypatch.setattr(json, "dump", killed)
    with pytest.raises(KeyboardInterrupt):
        write_torchrun_error_file("first banner")
    assert not path.exists()  # torchrun then reports the exit code alone, and does not crash
    monkeypatch.undo()
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(path))
    write_torchrun_error_file("the banner")
    assert json.loads(path.read_text())["message"] == "the banner"
