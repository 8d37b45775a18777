"""Timing: alternating blocks of trainer and bare steps (ABBA), and a separate pass of the trainer's
step with hooks on its phases (data, teacher, student forward, backward, optimizer)."""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch

from distill.bench.bare import TrainerSteps


def time_block(step: Callable[[], None], n: int, sync: Callable[[], None]) -> float:
    """Seconds per step over `n` back-to-back steps, synchronised only at the block's ends."""
    sync()
    start = time.perf_counter()
    for _ in range(n):
        step()
    sync()
    return (time.perf_counter() - start) / n


def interleaved(
    trainer: Callable[[], None], bare: Callable[[], None], steps: int, block: int, sync: Callable[[], None]
) -> tuple[list[float], list[float]]:
    """Per-step times of both loops, in alternating blocks (trainer first, then bare first, ...)."""
    trainer_times: list[float] = []
    bare_times: list[float] = []
    for i in range(math.ceil(steps / block)):
        order = [(trainer, trainer_times), (bare, bare_times)]
        for step, times in order if i % 2 == 0 else order[::-1]:
            times.append(time_block(step, block, sync))
    return trainer_times, bare_times


class _TimedBackward:
    """What `scaler.scale(loss)` returns during the phase pass: its `.backward()` is timed."""

    def __init__(self, loss: torch.Tensor, clock: PhaseClock, name: str = "student_backward") -> None:
        self.loss, self.clock, self.name = loss, clock, name

    def backward(self, *args: Any, **kwargs: Any) -> None:
        with self.clock.phase(self.name):
            self.loss.backward(*args, **kwargs)


class PhaseClock:
    """Hooks on the parts of `train_step`, each synchronised before and after, summed per step."""

    PHASES = ("data", "teacher", "student_forward", "student_backward", "optimizer")
    # dmd: the no-grad student forwards (rollouts and the critic's samples), the guided teacher's
    # (real) and the critic's (fake) score, the generator's forward/backward/AdamW and the critic's.
    DMD_PHASES = (
        "data",
        "student_sampling",
        "teacher_real_score",
        "critic_fake_score",
        "generator_forward",
        "generator_backward",
        "generator_optimizer",
        "critic_forward",
        "critic_backward",
        "critic_optimizer",
    )

    def __init__(self, sync: Callable[[], None], phases: tuple[str, ...] = PHASES) -> None:
        self.sync = sync
        self.phases = phases
        self.current: dict[str, float] = {}
        self._starts: dict[str, float] = {}

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        self.start(name)
        try:
            yield
        finally:
            self.stop(name)

    def start(self, name: str) -> None:
        self.sync()
        self._starts[name] = time.perf_counter()

    def stop(self, name: str) -> None:
        self.sync()
        self.current[name] = self.current.get(name, 0.0) + time.perf_counter() - self._starts.pop(name)

    def timed(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            with self.phase(name):
                return fn(*args, **kwargs)

        return wrapper


class _TimedIterator:
    def __init__(self, inner: Iterator[Any], clock: PhaseClock) -> None:
        self.inner, self.clock = inner, clock

    def __iter__(self) -> _TimedIterator:
        return self

    def __next__(self) -> Any:
        with self.clock.phase("data"):
            return next(self.inner)


@contextlib.contextmanager
def _phase_hooks(
    steps: TrainerSteps, clock: PhaseClock, teacher_phase: str
) -> Iterator[tuple[list[Any], list[Any]]]:
    """Time the teacher's velocity (as `teacher_phase`) and the data loading. Yields two lists the
    caller fills: hook handles, and the grad scalers whose `scale` it patched; all undone on exit."""
    teacher = steps.loop.teacher
    original_batches = steps.batches
    teacher.velocity = clock.timed(teacher_phase, teacher.velocity)
    steps.batches = _TimedIterator(original_batches, clock)
    handles: list[Any] = []
    scalers: list[Any] = []
    try:
        yield handles, scalers
    finally:
        steps.batches = original_batches
        for handle in handles:
            handle.remove()
        del teacher.velocity  # the class attributes show through again
        for scaler in scalers:
            del scaler.scale


@contextlib.contextmanager
def instrumented(steps: TrainerSteps, clock: PhaseClock) -> Iterator[None]:
    """Install the phase hooks on the loop's teacher, model, scaler and optimizer; remove them after."""
    loop = steps.loop
    scaler, model, optimizer = loop.scaler, loop.model, loop.optimizer
    with _phase_hooks(steps, clock, "teacher") as (handles, scalers):
        scalers.append(scaler)
        scale = scaler.scale
        scaler.scale = lambda loss: _TimedBackward(scale(loss), clock)
        handles += [
            model.register_forward_pre_hook(lambda *_: clock.start("student_forward")),
            model.register_forward_hook(lambda *_: clock.stop("student_forward")),
            optimizer.register_step_pre_hook(lambda *_: clock.start("optimizer")),
            optimizer.register_step_post_hook(lambda *_: clock.stop("optimizer")),
        ]
        yield


def _forward_phases(clock: PhaseClock, model: str) -> tuple[Callable[..., None], Callable[..., None]]:
    """Forward hooks of a dmd model that split its forwards by whether they carry a gradient."""
    open_forwards: list[str] = []

    def before(*_: Any) -> None:
        name = {
            ("student", True): "generator_forward",
            ("student", False): "student_sampling",
            ("critic", True): "critic_forward",
            ("critic", False): "critic_fake_score",
        }[(model, torch.is_grad_enabled())]
        open_forwards.append(name)
        clock.start(name)

    def after(*_: Any) -> None:
        clock.stop(open_forwards.pop())

    return before, after


@contextlib.contextmanager
def instrumented_dmd(steps: TrainerSteps, clock: PhaseClock) -> Iterator[None]:
    """The dmd phases: hooks on the teacher, both models (split by whether the forward carries a
    gradient), both grad scalers and both optimizers; removed after."""
    loop = steps.loop
    with _phase_hooks(steps, clock, "teacher_real_score") as (handles, scalers):
        for model in ("student", "critic"):
            before, after = _forward_phases(clock, model)
            module = loop.models[model]
            handles += [module.register_forward_pre_hook(before), module.register_forward_hook(after)]
            name = "generator" if model == "student" else "critic"
            optimizer = loop.optimizers[model]
            handles += [
                optimizer.register_step_pre_hook(lambda *_, n=name: clock.start(f"{n}_optimizer")),
                optimizer.register_step_post_hook(lambda *_, n=name: clock.stop(f"{n}_optimizer")),
            ]
            scaler = loop.scalers[model]
            scalers.append(scaler)
            scale = scaler.scale
            scaler.scale = lambda loss, scale=scale, n=name: _TimedBackward(
                scale(loss), clock, f"{n}_backward"
            )
        yield


def phase_pass(
    steps: TrainerSteps, n: int, sync: Callable[[], None], dmd: bool = False
) -> dict[str, list[float]]:
    """Seconds per phase for each of `n` instrumented trainer steps; "other" is the step's remainder."""
    clock = PhaseClock(sync, PhaseClock.DMD_PHASES if dmd else PhaseClock.PHASES)
    per_phase: dict[str, list[float]] = {name: [] for name in (*clock.phases, "other", "step")}
    with (instrumented_dmd if dmd else instrumented)(steps, clock):
        for _ in range(n):
            clock.current = {}
            total = time_block(steps.step, 1, sync)
            for name in clock.phases:
                per_phase[name].append(clock.current.get(name, 0.0))
            per_phase["other"].append(max(0.0, total - sum(clock.current.values())))
            per_phase["step"].append(total)
    return per_phase


def summary_ms(seconds: list[float]) -> dict[str, float]:
    values = np.asarray(seconds) * 1e3
    return {
        "median": float(np.median(values)),
        "p10": float(np.percentile(values, 10)),
        "p90": float(np.percentile(values, 90)),
    }
