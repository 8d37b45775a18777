"""Distillation methods the loop can run (`--method`). A new method is one module here plus its line below."""

from __future__ import annotations

import importlib

# --method value -> "module:class". Imported on use, so reading the config stays cheap.
METHODS = {
    "velocity": "distill.train.methods.velocity:VelocityMethod",
    "dmd": "distill.train.methods.dmd:DmdMethod",
}


def method_class(name: str) -> type:
    """The Method subclass of `--method name`."""
    module, _, cls = METHODS[name].partition(":")
    return getattr(importlib.import_module(module), cls)
