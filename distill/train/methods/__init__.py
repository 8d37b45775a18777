"""Distillation methods the loop can run (`--method`). A new method is one module here plus its line below."""

from __future__ import annotations

import importlib

# --method value -> "module:class". Imported on use, so reading the config stays cheap.
METHODS = {
    "velocity": "distill.train.methods.velocity:VelocityMethod",
    "dmd": "distill.train.methods.dmd:DmdMethod",
    "ode_init": "distill.train.methods.ode_init:OdeInitMethod",
    "self_forcing": "distill.train.methods.self_forcing:SelfForcingMethod",
}


def method_class(name: str) -> type:
    """The Method subclass of `--method name`."""
    module, _, cls = METHODS[name].partition(":")
    return getattr(importlib.import_module(module), cls)
