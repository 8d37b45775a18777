"""distill/bench/warning_log.py: the warnings a benchmark raised, once each, with the model code's line."""

from __future__ import annotations

import inspect
import warnings

import torch

from distill.bench.warning_log import WarningLog, warning_lines


def take_the_slow_path() -> None:
    warnings.warn("slow path taken\nsecond line", UserWarning, stacklevel=1)


def mismatched_norm() -> torch.Tensor:
    """An RMSNorm whose float32 weight meets a bfloat16 input, as the student's do under CPU autocast."""
    return torch.nn.functional.rms_norm(torch.ones(2, 8, dtype=torch.bfloat16), (8,), torch.ones(8))


def test_a_warning_in_a_loop_is_kept_once_with_the_line_that_raised_it():
    line = inspect.getsourcelines(take_the_slow_path)[1] + 1
    with WarningLog() as log:
        for _ in range(3):
            take_the_slow_path()
    assert log.entries() == [
        {"category": "UserWarning", "message": "slow path taken", "where": f"{__file__}:{line}"}
    ]
    assert warning_lines(log.entries())[0] == "warnings while it ran: 1"
    assert warning_lines([]) == ["warnings while it ran: none"]


def test_torch_s_once_per_process_warning_is_caught_after_it_was_raised_before():
    """torch raises the fused-norm warning once per process: the log still sees it, from our frame,
    and leaves torch's setting as it found it."""
    was = torch.is_warn_always_enabled()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        mismatched_norm()  # raised (and ignored) before the log opens
    with WarningLog() as log:
        mismatched_norm()
    (entry,) = log.entries()
    assert entry["message"].startswith("Mismatch dtype between input and weight")
    assert entry["where"].startswith(f"{__file__}:")  # not torch/nn/functional.py
    assert torch.is_warn_always_enabled() == was
