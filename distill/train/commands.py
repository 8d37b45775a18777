"""The command lines a failure banner suggests: the user's own argv with one flag changed or added,
under the launcher they used (python or torchrun), so a fix can be copied and run as it is."""

from __future__ import annotations

import os
import shlex

from distill.ops.errors import DistillError, current_rank


def rewrite(argv: list[str], flag: str, value: str | None = None) -> list[str]:
    """argv with `flag` set (to `value`, or as a switch), dropping earlier settings of it.

    `--flag v`, `--flag=v` and a switch's `--no-flag` form are all removed first.
    """
    negated = "--no-" + flag[2:]
    out, skip = [], False
    for i, arg in enumerate(argv):
        if skip:
            skip = False
            continue
        if arg in (flag, negated) or arg.startswith(flag + "="):
            # `--flag value`: also drop the value, unless the next word is another flag (a switch)
            skip = arg == flag and i + 1 < len(argv) and not argv[i + 1].startswith("--")
            continue
        out.append(arg)
    return out + ([flag] if value is None else [flag, value])


def without(argv: list[str], *flags: str) -> list[str]:
    """argv with every setting of `flags` removed (value-taking or switch)."""
    for flag in flags:
        argv = rewrite(argv, flag)[:-1]
    return argv


def launcher() -> str:
    """How this run was started, for a corrected command: torchrun with the same shape, or python."""
    if current_rank() is None:
        return "python train_distillation.py"
    local = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE", "1")))
    nodes = int(os.environ.get("WORLD_SIZE", str(local))) // max(local, 1)
    if nodes > 1:
        return f"torchrun --nnodes={nodes} --nproc_per_node={local} ... train_distillation.py"
    return f"torchrun --standalone --nproc_per_node={local} train_distillation.py"


def command(argv: list[str]) -> str:
    return " ".join([launcher(), shlex.join(argv)]).rstrip()


def config_of(argv: list[str]):  # noqa: ANN202 - TrainConfig, imported lazily (config imports errors)
    """The run's settings as the trainer resolved them, or None when argv is not a trainer command line."""
    from distill.config.cli import parse_config

    try:
        return parse_config(argv)
    except (DistillError, SystemExit):
        return None


def parses(argv: list[str]) -> bool:
    return config_of(argv) is not None


def config_file_values(argv: list[str]) -> dict:
    from distill.config.cli import load_config_file

    path = next((argv[i + 1] for i, a in enumerate(argv[:-1]) if a == "--config"), None)
    path = path or next((a.split("=", 1)[1] for a in argv if a.startswith("--config=")), None)
    try:
        return load_config_file(path) if path else {}
    except DistillError:
        return {}


def set_placement(argv: list[str], placement: str) -> list[str]:
    """argv with the teacher placement set to `placement`, whatever spelling the user had used.

    --teacher_on_cpu and --teacher_device_strategy are aliases that conflict with a different
    --teacher_placement, on the command line or in a --config file, so they are removed or
    overridden to agree.
    """
    argv = without(argv, "--teacher_on_cpu", "--teacher_device_strategy")
    argv = rewrite(argv, "--teacher_placement", placement)
    from_file = config_file_values(argv)
    if from_file.get("teacher_on_cpu") and placement != "cpu":
        argv.append("--no-teacher_on_cpu")
    if from_file.get("teacher_device_strategy") is not None:
        argv += ["--teacher_device_strategy", {"cpu": "cpu", "shard": "balanced"}.get(placement, "auto")]
    return argv


def first_line(exc: BaseException) -> str:
    """The first line of an exception's message (empty for none)."""
    text = str(exc).strip()
    return text.splitlines()[0] if text else ""
