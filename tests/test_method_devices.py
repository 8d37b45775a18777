"""Every tensor a method hands the loop lives on the training device.

CI has no GPU, so the training device here is `meta`: the models, the teacher and the method's
environment move there, and any tensor a method makes on the CPU by mistake (which a CUDA run
meets as "Expected all tensors to be on the same device" at its first step) shows up as off-device.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import train_args
from test_dmd import inputs, make_method

from distill.config.cli import parse_config
from distill.train.methods.base import UpdateLoss
from distill.train.methods.velocity import VelocityMethod

META = torch.device("meta")


def move_to_meta(method, rng) -> None:
    env = method.env
    for model in method.models.values():
        model.to(META)
    env.teacher.high.to(META)
    env.teacher.low.to(META)
    env.teacher.device = env.device = rng.on = META
    env.negative = env.negative.to(META)


def velocity_method(tiny_teacher):
    dmd, models, rng = make_method(tiny_teacher)
    cfg = parse_config(train_args(tiny_teacher, Path("unused"), Path("unused")))
    return VelocityMethod(cfg, dmd.env, {"student": models["student"]}), rng


@pytest.mark.parametrize(
    ("method_name", "update"), [("velocity", "student"), ("dmd", "student"), ("dmd", "critic")]
)
def test_each_update_returns_its_tensors_on_the_training_device(tiny_teacher, method_name, update):
    if method_name == "dmd":
        method, _, rng = make_method(tiny_teacher, regression_weight=0.5)
    else:
        method, rng = velocity_method(tiny_teacher)
    move_to_meta(method, rng)
    x0, cond, _ = inputs(2)
    out = method.loss(update, {"x0": x0, "cond": cond, "noise": torch.randn_like(x0)}, rng)
    assert out.losses.device == META
    assert out.off_device(META) == []


def test_a_stray_cpu_tensor_is_named_with_its_device():
    out = UpdateLoss(
        torch.zeros(2, device=META), torch.zeros(2, dtype=torch.bool), {"x": torch.zeros(2, device=META)}
    )
    assert out.off_device(META) == ["high_noise (cpu)"]
    assert out.off_device(torch.device("cpu")) == ["losses (meta)", "x (meta)"]
