"""The JSON configs of the models we read: each value must have the type its model class expects.

diffusers and transformers take a config value as it is: `"num_layers": "2"` in a teacher's
`transformer/config.json` loads, and fails much later inside the model with an error that names
neither the file nor the key. Each config is checked against the defaults of the class it
configures (their types are the contract) as soon as it is read.
"""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Any

from distill.ops.errors import DistillError, Stage


def _kind(default: Any) -> tuple[tuple[type, ...], str] | None:
    """The JSON types a value may have where the class's default is `default` (None: anything)."""
    if isinstance(default, bool):
        return (bool,), "true or false"
    if isinstance(default, int):
        return (int,), "whole number"
    if isinstance(default, float):
        return (int, float), "number"
    if isinstance(default, str):
        return (str,), "string"
    if isinstance(default, (list, tuple)):
        return (list, tuple), "list"
    return None


def class_defaults(cls: type) -> dict[str, Any]:
    """Keyword defaults of `cls`: its __init__ signature, or a transformers config's own attributes."""
    to_dict = getattr(cls, "to_dict", None)
    if to_dict is not None and hasattr(cls, "model_type"):  # a transformers PretrainedConfig
        return cls().to_dict()
    return {
        name: parameter.default
        for name, parameter in inspect.signature(cls.__init__).parameters.items()
        if parameter.default is not inspect.Parameter.empty
    }


def check_value_types(config: dict[str, Any], cls: type, path: Path, stage: Stage) -> dict[str, Any]:
    """`config` (read from `path`) unchanged, or a DistillError naming the file and the key."""
    defaults = class_defaults(cls)
    for key, value in config.items():
        kind = _kind(defaults.get(key))
        if kind is None or value is None:
            continue
        allowed, words = kind
        wrong_bool = isinstance(value, bool) and bool not in allowed
        if wrong_bool or not isinstance(value, allowed):
            example = defaults[key]
            raise DistillError(
                f'{path}: "{key}" must be a {words} (like {example!r}), got {value!r}',
                f"{path} configures a {cls.__name__}; a value of another type would fail later inside the "
                "model, far from this file.",
                fixes=[f'write "{key}" as a {words} in {path} (a quoted number is a string in JSON)'],
                stage=stage,
            )
    return config
