"""A --config file's keys and values, checked against TrainConfig's settings before they are used.

YAML (1.1, what PyYAML reads) takes some text a person means as a number or a word for something
else: `1e-3` is text (no dot), `yes` / `no` / `on` / `off` are true and false (`mixed_precision: no`
is False), an empty value is null. Each such value is refused here, naming the file, the setting and
the spelling that works, instead of failing later with a TypeError or training on 1 for `true`. The
origin project's flag names (--max_steps, ...) are accepted as keys too, as on the command line.
"""

from __future__ import annotations

import json
import re
import typing
from collections.abc import Mapping
from decimal import Decimal, InvalidOperation
from pathlib import Path
from typing import Any

from distill.ops.errors import DistillError, Stage


def read_mapping(path: Path, text: str) -> Any:
    """The file's top-level value; a key set twice is refused (the later one would silently win)."""
    if path.suffix == ".json":
        return json.loads(text, object_pairs_hook=lambda pairs: _unique(dict(pairs), pairs, path))
    import yaml

    class UniqueKeys(yaml.SafeLoader):
        def construct_mapping(self, node: Any, deep: bool = False) -> dict:
            pairs = [(self.construct_object(k, deep=deep), v) for k, v in node.value]
            keys = [key for key, _ in pairs if isinstance(key, str)]
            return _unique(super().construct_mapping(node, deep), [(k, None) for k in keys], path)

    return yaml.load(text, Loader=UniqueKeys)  # noqa: S506 - a SafeLoader


def _unique(mapping: dict, pairs: list, path: Path) -> dict:
    seen: set[str] = set()
    for key, _ in pairs:
        if key in seen:
            raise DistillError(
                f"'{key}' is set twice in {path}",
                "Only the later value would be used, silently.",
                fixes=[f"keep one '{key}:' line in {path}"],
                stage=Stage.CONFIG,
            )
        seen.add(key)
    return mapping


def rename_aliases(data: dict, aliases: Mapping[str, str], path: Path) -> dict:
    """Keys that are another name of a setting (`max_steps` for num_steps) under the setting's name."""
    out = dict(data)
    for alias, name in aliases.items():
        if alias not in out:
            continue
        if name in out:
            raise DistillError(
                f"'{alias}' and '{name}' are both set in {path}, but {alias} is another name for {name}",
                fixes=[f"keep only '{name}' in {path}"],
                stage=Stage.CONFIG,
            )
        out[name] = out.pop(alias)
    return out


def check_value(name: str, value: Any, kind: Any, default: Any, path: Path) -> Any:
    """`value` of setting `name` (type hint `kind`) as the setting takes it, or a refusal saying why."""
    optional = type(None) in typing.get_args(kind)
    base = next((a for a in typing.get_args(kind) if a is not type(None)), kind)
    where = f"'{name}' in {path}"
    keep = f"or remove the line for the default ({default})" if default is not None else "or remove the line"
    if value is None:
        if optional:
            return None
        raise _refusal(
            f"{where} is empty (null)",
            "YAML reads an empty value, null and ~ as nothing; this setting needs one.",
            f"give it a value, e.g. {name}: {_example(base, default)}, {keep}",
        )
    if typing.get_origin(base) is list:  # a repeatable setting: one value or a list of them
        values = value if isinstance(value, list) else [value]
        if all(isinstance(v, str) for v in values):
            return list(values)
        raise _refusal(
            f"{where} must be text or a list of text, got {value!r}", "", f"e.g. {name}: [a.safetensors]"
        )
    if isinstance(value, (list, dict)):
        what = "a list" if isinstance(value, list) else "a mapping"
        if base is str and isinstance(value, list) and all(isinstance(v, str) for v in value):
            fix = f"write it as one comma-separated value: {name}: {','.join(value)}"
        else:
            fix = f"give one value, e.g. {name}: {_example(base, default)}"
        raise _refusal(f"{where} is {what}; it takes one value", "", fix)
    if base is bool:
        if isinstance(value, bool):
            return value
        raise _refusal(f"{where} must be true or false, got {value!r}", "", f"write {name}: true or false")
    if isinstance(value, bool):  # before int: YAML's true is also an int to Python
        said = "true" if value else "false"
        if base is str:
            _refuse_switch_for_text(name, where, said, default)
        raise _refusal(
            f"{where} is {said}, a yes/no value; it takes a number",
            "YAML also reads yes, no, on and off as true or false.",
            f"give a number, e.g. {name}: {_example(base, default)}",
        )
    if base is int:
        if isinstance(value, int) or (isinstance(value, float) and value.is_integer()):
            return int(value)
        _refuse_number(name, where, value, "a whole number", default, path)
    if base is float:
        if isinstance(value, (int, float)):
            return float(value)
        _refuse_number(name, where, value, "a number", default, path)
    if base is str and isinstance(value, str):
        return value
    raise _refusal(
        f"{where} must be text, got the number {value!r}",
        "",
        f"quote it: {name}: '{value}'" if base is str else f"give it as {base.__name__}",
    )


def _refuse_number(name: str, where: str, value: Any, noun: str, default: Any, path: Path) -> typing.NoReturn:
    try:
        parsed = Decimal(str(value).strip())
    except InvalidOperation:
        parsed = None
    if isinstance(value, str) and parsed is not None and parsed.is_finite():
        if path.suffix == ".json":
            why, fix = "It is in quotes, so JSON reads it as text.", f'drop the quotes: "{name}": {value}'
        else:
            why = (
                f"YAML 1.1 reads {value} as text, not a number: a number in exponent form needs a dot "
                "and a sign in its exponent."
            )
            fix = f"write {name}: {_yaml_number(parsed)} or {name}: {format(parsed, 'f')}"
        if noun == "a whole number" and parsed != parsed.to_integral_value():
            fix = f"give a whole number, e.g. {name}: {_example(int, default)}"
        raise _refusal(f"{where} must be {noun}, got the text '{value}'", why, fix)
    raise _refusal(
        f"{where} must be {noun}, got {value!r}",
        "",
        f"give a number, e.g. {name}: {_example(float if noun == 'a number' else int, default)}",
    )


def _refuse_switch_for_text(name: str, where: str, said: str, default: Any) -> typing.NoReturn:
    raise _refusal(
        f"{where} is {said}, but it takes text",
        "YAML reads yes, no, on, off, true and false as a switch, not as the word.",
        f"quote the word, e.g. {name}: 'no'" + (f" (its default is '{default}')" if default else ""),
    )


def _yaml_number(value: Decimal) -> str:
    """`value` spelled as YAML 1.1 reads a float: a dot in the mantissa, a signed exponent."""
    mantissa, exponent = f"{value:e}".split("e")
    mantissa = mantissa.rstrip("0").rstrip(".") if "." in mantissa else mantissa
    return f"{mantissa if '.' in mantissa else mantissa + '.0'}e{int(exponent):+d}"


def _example(base: Any, default: Any) -> str:
    if default is not None:
        return str(default).lower() if isinstance(default, bool) else str(default)
    return {int: "1", float: "1.0", bool: "true"}.get(base, "VALUE")


def _refusal(title: str, details: str, fix: str) -> DistillError:
    return DistillError(title, details, fixes=[fix], stage=Stage.CONFIG)


def blame_the_file(error: DistillError, from_file: Mapping[str, Any], path: str | Path) -> DistillError:
    """`error` with each setting it names as a flag (`--name`) but that came from the config file at
    `path` named as the file's line instead: a conflict is never blamed on a flag nobody typed."""
    named = [name for name in from_file if re.search(rf"--{name}(?![\w-])", error.title)]
    if not named:
        return error
    title = error.title
    for name in named:
        value = from_file[name]
        shown = str(value).lower() if isinstance(value, bool) else str(value)
        with_value = rf"--{name} {re.escape(shown)}(?![\w.-])"
        title = re.sub(with_value, f"{name}: {shown} (in {path})", title)
        title = re.sub(rf"--{name}(?![\w-])", f"'{name}' (in {path})", title)
    settings = ", ".join(f"'{name}'" for name in named)
    error.title = title
    error.fixes = [
        *error.fixes,
        f"{settings} {'is' if len(named) == 1 else 'are'} set in {path}, not on the command line: change "
        f"{'it' if len(named) == 1 else 'them'} there, or override with "
        + ", ".join(f"--{name}" for name in named)
        + " (flags win over the file)",
    ]
    return error
