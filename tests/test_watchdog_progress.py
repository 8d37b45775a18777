"""The stall watchdog hears progress from inside a step (forwards and backwards of the models), so a
slow step that computes is never taken for a hang, while a rank that stops still is.

In process, with a tiny real Wan transformer; the same under torchrun, with the `slow` and
`hang_forward` faults, is distill/stress.py's slow_step and hang_in_forward (tests/test_stress.py).
"""

from __future__ import annotations

import io
import json
import sys
import threading
import time

import pytest
import torch
from conftest import REPO

from distill.models.student import build_student
from distill.ops import watchdog
from distill.ops.errors import Stage
from distill.ops.watchdog import StallWatchdog

BLOCK_SLEEP_S = 0.4  # each block's forward and backward: far below the timeout
TIMEOUT_S = 1.5  # far below the whole forward or the whole backward (6 blocks x 0.4 s each)


@pytest.fixture
def dog(monkeypatch):
    """A running watchdog that records a stall instead of ending the process (its report goes to a
    captured stderr, and faulthandler's process-ending backstop stays off)."""
    fired = threading.Event()
    started = StallWatchdog(TIMEOUT_S, on_stall=fired.set, backstop=False).start()
    monkeypatch.setattr(watchdog, "_active", started)
    yield started, fired
    started.stop()


def capture_stderr(monkeypatch) -> io.StringIO:
    """sys.stderr as a string (set in the test body: pytest puts its own back before each test)."""
    stderr = io.StringIO()
    monkeypatch.setattr(sys, "stderr", stderr)
    return stderr


def slow_model() -> torch.nn.Module:
    """A 6-block tiny Wan transformer whose every block sleeps in its forward and in its backward."""
    config = json.loads((REPO / "config" / "student_tiny.json").read_text())
    model = build_student({**config, "num_layers": 6}, seed=0)

    def slow_forward(_module, _args):
        time.sleep(BLOCK_SLEEP_S)

    def slow_backward(_module, _args, output):
        output.register_hook(lambda grad: time.sleep(BLOCK_SLEEP_S))

    for block in model.blocks:
        block.register_forward_pre_hook(slow_forward)
        block.register_forward_hook(slow_backward)
    return model


def forward_and_backward(model: torch.nn.Module) -> None:
    out = model(
        hidden_states=torch.randn(1, 16, 1, 4, 4),
        timestep=torch.tensor([500]),
        encoder_hidden_states=torch.randn(1, 8, 32),
        return_dict=False,
    )[0]
    out.square().mean().backward()


def test_a_step_longer_than_the_timeout_survives_while_its_forwards_and_backwards_signal(dog, monkeypatch):
    started, fired = dog
    stderr = capture_stderr(monkeypatch)
    model = slow_model()
    watchdog.watch_forwards(model)
    watchdog.watch_forwards(model)  # a second call adds nothing: one set of hooks per module
    assert len(model._forward_pre_hooks) == 1 and len(model.blocks[0]._forward_pre_hooks) == 2
    assert watchdog.forward_units(model) == [model, *model.blocks]
    started.beat(Stage.TRAINING, 1)
    began = time.monotonic()
    forward_and_backward(model)
    # Twice the timeout without a beat: only the hooks' signals (the backward's among them) kept it quiet.
    assert time.monotonic() - began > 2 * TIMEOUT_S
    assert not fired.is_set()
    # Then nothing moves: a real stall, reported with the stage and step of the last beat.
    assert fired.wait(10 * TIMEOUT_S)
    assert "no progress for 1.5 s during training, step 1" in stderr.getvalue()


def test_without_the_hooks_the_same_step_is_reported_as_a_stall(dog, monkeypatch):
    _, fired = dog
    capture_stderr(monkeypatch)
    model = slow_model()
    watchdog.beat(Stage.TRAINING, 1)
    forward_and_backward(model)
    assert fired.is_set()


def test_progress_counts_only_while_armed(dog, monkeypatch):
    started, fired = dog
    stderr = capture_stderr(monkeypatch)
    started.beat(Stage.TRAINING, 2)
    started.pause()
    deadline = time.monotonic() + 2 * TIMEOUT_S
    while time.monotonic() < deadline:  # forwards of a sample round, say: paused, so nothing to watch
        watchdog.progress()
        time.sleep(0.05)
    assert not fired.is_set()
    started.beat(Stage.TRAINING, 3)
    deadline = time.monotonic() + 2 * TIMEOUT_S
    while time.monotonic() < deadline:
        watchdog.progress()
        time.sleep(0.05)
    assert not fired.is_set()
    assert fired.wait(10 * TIMEOUT_S)
    assert "during training, step 3" in stderr.getvalue()
