"""Reading a run's settings: the command line (flags made from `TrainConfig`'s fields, the origin
project's flag names as aliases, torchrun's own flags recognised when misplaced), an optional
YAML/JSON `--config` file, the method's own defaults (dmd), and `run_config.json` written back.
Precedence: defaults < `--config FILE` < command-line flags."""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import json
import typing
from pathlib import Path
from typing import Any

from distill.config.file_values import blame_the_file, check_value, read_mapping, rename_aliases
from distill.config.flag_rules import TRAIN_DEPENDENTS, check_dependents, given_where
from distill.config.settings import (
    CRITIC_METHODS,
    TrainConfig,
    config_error,
    field_defaults,
    field_types,
)
from distill.ops.command import PathAction
from distill.ops.errors import DistillError, Stage
from distill.ops.paths import Kind, PathFlag, check_paths
from distill.ops.text_files import read_user_text

# Flags of the origin project that map onto ours, so old launch scripts keep working.
FLAG_ALIASES = {"--learning_rate": "--lr", "--epochs": "--num_epochs", "--max_steps": "--num_steps"}


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage mistake becomes our banner (rank-aware, with the fix) instead of a bare usage line."""

    def error(self, message: str) -> typing.NoReturn:
        raise DistillError(
            f"bad command line: {message}",
            fixes=["`python train_distillation.py --help` lists every flag and its values"],
            stage=Stage.ARGV,
        )


# torchrun's own flags: given after the script name they reach the trainer instead of torchrun.
TORCHRUN_FLAGS = (
    "--nproc_per_node",
    "--nproc-per-node",
    "--nnodes",
    "--node_rank",
    "--node-rank",
    "--master_addr",
    "--master-addr",
    "--master_port",
    "--master-port",
    "--standalone",
    "--rdzv_endpoint",
    "--rdzv-endpoint",
    "--rdzv_backend",
    "--rdzv-backend",
    "--rdzv_id",
    "--rdzv-id",
    "--max_restarts",
    "--max-restarts",
)


def _unknown_argument_error(unknown: list[str], flags: list[str]) -> DistillError:
    first = unknown[0]
    name = first.split("=")[0]
    if name in TORCHRUN_FLAGS:
        return DistillError(
            f"{name} is a torchrun flag, but it came after the script name, so torchrun never saw it",
            fixes=[f"put it before the script: torchrun {first} train_distillation.py ..."],
            stage=Stage.ARGV,
        )
    if not first.startswith("-"):
        looks_like_path = "/" in first or "." in Path(first).name
        hint = (
            f" It looks like a path: did you mean --config {first}, --data_path {first} or --teacher_path {first}?"
            if looks_like_path
            else ""
        )
        return DistillError(
            f"unexpected value {first!r} where a flag was expected.{hint}",
            "Every setting is given as --name value; a value without its flag (or a flag with two values) ends here.",
            fixes=[
                "put the flag name before the value",
                "`python train_distillation.py --help` lists every flag",
            ],
            stage=Stage.ARGV,
        )
    return DistillError(
        f"unrecognised argument{'s' if len(unknown) > 1 else ''}: {' '.join(unknown)}.{_did_you_mean(name, flags)}",
        fixes=["`python train_distillation.py --help` lists every flag"],
        stage=Stage.ARGV,
    )


def build_parser() -> argparse.ArgumentParser:
    """An argparse parser with one flag per TrainConfig field (defaults suppressed, see parse_config)."""
    parser = _Parser(
        prog="train_distillation.py",
        description="Distil the Wan 2.2 A14B teacher into a compact WanTransformer3DModel student.",
        argument_default=argparse.SUPPRESS,
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        allow_abbrev=False,
    )
    types = field_types()
    # Path settings are checked by kind as they are parsed (distill.ops.command.PathAction), with the
    # rules TrainConfig.validate applies to them from a config file too.
    paths = {flag.flag: flag for flag in TrainConfig(output_dir=".").path_flags()}
    for f in dataclasses.fields(TrainConfig):
        kind = types[f.name]
        base = next((a for a in typing.get_args(kind) if a is not type(None)), kind)
        help_text = f.metadata["help"] + (
            f" (default: {f.default})" if f.default not in (None, False) else ""
        )
        flags = [f"--{f.name}"] + [alias for alias, target in FLAG_ALIASES.items() if target == f"--{f.name}"]
        if base is bool:
            parser.add_argument(*flags, action=argparse.BooleanOptionalAction, help=f.metadata["help"])
        elif typing.get_origin(base) is list:  # a repeatable flag: each use adds one value
            parser.add_argument(*flags, action="append", help=help_text, metavar=f.metadata.get("metavar"))
        elif f"--{f.name}" in paths:
            rule = paths[f"--{f.name}"]
            parser.add_argument(
                *flags,
                action=PathAction,
                kind=rule.kind,
                stage=rule.stage,
                must_exist=rule.must_exist,
                suffixes=rule.suffixes,
                help=help_text,
            )
        else:
            parser.add_argument(
                *flags,
                type=base,
                choices=f.metadata["choices"],
                help=help_text,
                metavar=f.metadata.get("metavar"),
            )
    return parser


def _did_you_mean(word: str, candidates: list[str]) -> str:
    match = difflib.get_close_matches(word, candidates, n=1, cutoff=0.6)
    return f" Did you mean {match[0]}?" if match else ""


def load_config_file(path: str | Path) -> dict[str, Any]:
    """Read a YAML or JSON mapping of TrainConfig fields, refusing unknown keys with a suggestion."""
    path = Path(path)
    check_paths([PathFlag("--config", path, Kind.FILE, suffixes=(".yaml", ".yml", ".json"))])
    text = read_user_text(path, "--config")
    try:
        data = read_mapping(path, text)
    except DistillError:
        raise
    except (json.JSONDecodeError, Exception) as exc:  # yaml.YAMLError has no common base with json's
        raise DistillError(
            f"config file {path} is not valid {'JSON' if path.suffix == '.json' else 'YAML'}",
            str(exc),
            fixes=[f"fix the syntax at the position shown above in {path}"],
            stage=Stage.CONFIG,
        ) from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise DistillError(
            f"config file {path} must hold a mapping of setting: value",
            f"found a {type(data).__name__}",
            stage=Stage.CONFIG,
        )
    fields = {f.name: f for f in dataclasses.fields(TrainConfig)}
    names = list(fields)
    aliases = {alias[2:]: target[2:] for alias, target in FLAG_ALIASES.items()}
    for key in data:
        if not isinstance(key, str):
            raise DistillError(
                f"{path} has the key {key!r}, which is not a setting name",
                "YAML reads yes, no, on, off, true, false and numbers as values, even as keys.",
                fixes=["use the setting names of `python train_distillation.py --help` as keys"],
                stage=Stage.CONFIG,
            )
        if key == "config":
            raise DistillError(
                f"'config' in {path}: a config file cannot name another one",
                "It would be ignored: only the --config given on the command line is read.",
                fixes=[f"copy the settings you need into {path}, and remove the 'config' line"],
                stage=Stage.CONFIG,
            )
        if key not in names and key not in aliases:
            plain = key.lstrip("-").replace("-", "_")
            hint = (
                f" Settings in a file are written without -- and with underscores: {aliases.get(plain, plain)}:"
                if plain in names or plain in aliases
                else _did_you_mean(key, names + list(aliases))
            )
            raise DistillError(
                f"unknown setting '{key}' in {path}.{hint}",
                fixes=[
                    f"remove '{key}' or rename it; `python train_distillation.py --help` lists every setting"
                ],
                stage=Stage.CONFIG,
            )
    data = rename_aliases(data, aliases, path)
    types = field_types()
    return {
        key: check_value(key, value, types[key], fields[key].default, path) for key, value in data.items()
    }


# What --method dmd uses for the settings a command line or --config file leaves out: the rates and
# schedule of published Wan-scale DMD runs (generator 2e-6, critic 4e-7, constant). The velocity
# method's 1e-4 with cosine decay is about 50x too hot for a generator and its critic at 14B scale.
DMD_DEFAULTS: dict[str, Any] = {"lr": 2e-6, "critic_lr": 4e-7, "lr_scheduler": "constant"}
# With --student_lora_rank the generator trains adapters, which need the rate published few-step
# Wan LoRAs were trained at (1e-4); a LoRA critic takes the same, a full critic keeps DMD's own.
DMD_LORA_DEFAULTS: dict[str, Any] = {"lr": 1e-4, "critic_lr": 1e-4, "lr_scheduler": "constant"}


def parse_config(argv: list[str] | None = None) -> TrainConfig:
    """Resolve a TrainConfig from argv and an optional --config file, then validate it."""
    parser = build_parser()
    given, unknown = parser.parse_known_args(argv)
    if unknown:
        flags = [opt for action in parser._actions for opt in action.option_strings]
        raise _unknown_argument_error(unknown, flags)
    values: dict[str, Any] = {}
    if getattr(given, "config", None):
        values.update(load_config_file(given.config))
    from_file = {name: value for name, value in values.items() if name not in vars(given)}
    # What the user set, and where: a setting that acts only with another one is refused by this name.
    where = given_where(
        [k for k, v in vars(given).items() if v is not None],
        [k for k, v in values.items() if v is not None],
        getattr(given, "config", None),
    )
    values.update(vars(given))
    types = field_types()
    for name, value in list(values.items()):
        base = next((a for a in typing.get_args(types[name]) if a is not type(None)), types[name])
        base = typing.get_origin(base) or base  # list[str] is checked as a list
        if value is not None and base is float and isinstance(value, int):
            values[name] = float(value)
        elif value is not None and not isinstance(value, base):
            raise config_error(
                name, f"must be a {base.__name__}, got {value!r}", f"fix '{name}' in {given.config}"
            )
    if values.get("method") in CRITIC_METHODS:
        defaults = dict(DMD_DEFAULTS)
        if values.get("student_lora_rank"):
            defaults.update(DMD_LORA_DEFAULTS)
            if values.get("critic_lora_rank") == 0:
                defaults["critic_lr"] = DMD_DEFAULTS["critic_lr"]
        values = {**defaults, **values}
    cfg = TrainConfig(**values)
    if cfg.num_steps is None and cfg.num_epochs is None:
        cfg.num_steps = 1000
    try:
        cfg.validate()
    except DistillError as error:  # a value of the file is named as the file's, not as a flag
        if from_file:
            raise blame_the_file(error, from_file, given.config) from None
        raise
    check_dependents(cfg, where, TRAIN_DEPENDENTS, field_defaults())
    cfg.given = where  # type: ignore[misc] - per run: see TrainConfig.given
    return cfg


def save_resolved_config(cfg: TrainConfig, path: str | Path) -> None:
    Path(path).write_text(json.dumps(cfg.to_dict(), indent=2, sort_keys=True) + "\n")
