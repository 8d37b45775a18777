"""How every command of the project runs: its whole body, argument parsing included, under the banner.

    @entry_point
    def main(argv: list[str] | None = None) -> int:
        args = Parser(prog="python -m distill.x").parse_args(argv)   # usage mistakes: banner, exit 2
        ...                                                          # DistillError: banner, its stage

- `entry_point` wraps a command's `main(argv)`: a DistillError raised anywhere in it (parsing, a config
  file, a path check, the work itself) is reported as the banner with its stage's exit code, and any
  other exception as the "unexpected" banner (exit 10) with its traceback, so nothing a command does
  ends in a bare traceback or in an exit code that does not say which stage failed.
- `Parser` is argparse whose usage errors print the banner (exit 2, what argparse exits with).
- `integer` / `number` are the argparse types of number flags: a wrong type, inf / nan and a value
  below the flag's minimum are refused by name while parsing, before anything loads or renders.
- `PathAction` checks a path flag's kind (distill.ops.paths) as it is parsed, and tells a reader of
  the parser (tests/test_command_surface.py) which flags are paths and of what kind.
"""

from __future__ import annotations

import argparse
import functools
import math
import traceback
import typing
from collections.abc import Callable
from typing import Any, TypeVar

from distill.ops.errors import DistillError, Stage, report
from distill.ops.paths import Kind, PathFlag, check_paths

Result = TypeVar("Result")


def entry_point(main: Callable[[list[str] | None], Result]) -> Callable[[list[str] | None], Result | int]:
    """`main(argv)` with every failure ending in the banner; returns main's result or the exit code."""

    @functools.wraps(main)
    def run(argv: list[str] | None = None) -> Result | int:
        try:
            return main(argv)
        except DistillError as error:
            return report(error)
        except Exception as error:  # noqa: BLE001 - a bug still ends in the banner, with its traceback
            return report(unexpected(error, main.__module__))

    return run


def unexpected(error: BaseException, where: str) -> DistillError:
    """The banner of an exception no check foresaw: a bug to report, not a mistake in the command."""
    trace = "".join(traceback.format_exception(error)).rstrip()
    return DistillError(
        f"unexpected {type(error).__name__} in {where}",
        f"{error}\n\n{trace}",
        fixes=["report it with the traceback above and the command line you ran"],
        stage=Stage.INTERNAL,
    )


class Parser(argparse.ArgumentParser):
    """argparse whose usage mistakes (unknown flag, wrong type, missing value) print the banner.

    It still exits with argparse's own SystemExit(2): callers and scripts that expect a usage error
    to stop the command there keep working; only what is printed changes.
    """

    def error(self, message: str) -> typing.NoReturn:
        prog = f"python {self.prog}" if self.prog.endswith(".py") else self.prog
        raise SystemExit(
            report(
                DistillError(
                    f"bad command line: {message}",
                    fixes=[f"`{prog} --help` lists every flag and its values"],
                    stage=Stage.ARGV,
                )
            )
        )


# ---------------------------------------------------------------------------------------------
# Number flags
# ---------------------------------------------------------------------------------------------


def integer(minimum: int | None = 0) -> Callable[[str], int]:
    """argparse type of a whole-number flag; `minimum` (None: any) is named when a value is below it."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be a whole number, got {text!r}") from None
        _at_least(value, minimum, text)
        return value

    parse.minimum = minimum  # type: ignore[attr-defined] - read by tests/test_command_surface.py
    parse.__name__ = "integer"
    return parse


def number(minimum: float | None = 0.0, above: bool = False) -> Callable[[str], float]:
    """argparse type of a finite number flag: at least `minimum`, or above it with `above`."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be a number, got {text!r}") from None
        if not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"must be a finite number, got {text!r}")
        if above and minimum is not None and value <= minimum:
            raise argparse.ArgumentTypeError(f"must be more than {minimum:g}, got {text}")
        _at_least(value, minimum, text)
        return value

    parse.minimum = minimum  # type: ignore[attr-defined]
    parse.__name__ = "number"
    return parse


def _at_least(value: float, minimum: float | None, text: str) -> None:
    if minimum is not None and value < minimum:
        raise argparse.ArgumentTypeError(f"must be {minimum:g} or more, got {text}")


# ---------------------------------------------------------------------------------------------
# Path flags
# ---------------------------------------------------------------------------------------------


class PathAction(argparse.Action):
    """A path flag: its value is checked by kind (a stat, nothing written) as soon as it is parsed.

    `parser.add_argument("--student", action=PathAction, kind=Kind.FOLDER, must_exist=False)`; the
    keywords are PathFlag's. Writability is proven later by the command itself, before its work.
    """

    def __init__(self, option_strings: list[str], dest: str, kind: Kind, **options: Any) -> None:
        flag_options = {
            key: options.pop(key) for key in ("stage", "must_exist", "suffixes", "example") if key in options
        }
        super().__init__(option_strings, dest, **options)
        self.kind = kind
        self.flag_options = flag_options

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        flag = option_string or self.dest
        for value in values if isinstance(values, list) else [values]:
            check_paths([PathFlag(flag, value, self.kind, **self.flag_options)], probe=False)
        setattr(namespace, self.dest, values)
