"""Every path a command is given, checked before any work: one list per command, one set of rules.

A command describes its path flags as `PathFlag`s (which flag, the value given, what kind of path it
must be) and calls `check_paths` before it loads a model, downloads, renders or benchmarks. A path
of the wrong kind is a DistillError that names the flag, says what is there instead and how to fix
it, so a typo costs seconds instead of a traceback after the work (or a half-written output).

The checks create and change nothing: writability is proven with a probe file made and removed at
once in the nearest existing folder, and a file given where a folder goes is left as it is.
"""

from __future__ import annotations

import difflib
import os
import tempfile
from collections.abc import Iterable
from dataclasses import dataclass
from enum import Enum
from pathlib import Path

from distill.ops.errors import DistillError, Stage


class Kind(Enum):
    """What a path flag must name."""

    OUTPUT_FOLDER = "a folder to write into (created when missing)"
    OUTPUT_FILE = "a file to write (its folder is created when missing)"
    FILE = "an existing file"
    FOLDER = "an existing folder"
    FILE_OR_FOLDER = "an existing file or folder"
    FOLDER_OR_HUB = "a local folder or a hub id"
    PROMPTS = (
        "a prompts file (.txt, .jsonl, .csv, .tsv) or a folder of videos or pictures captioned by "
        ".txt files of the same names"
    )


@dataclass(frozen=True)
class PathFlag:
    """One path a command was given, and what it must be."""

    flag: str
    """The flag as the user types it (e.g. "--cache_dir"), named in every message."""
    value: str | Path | None
    """None or "" (not given) is not checked."""
    kind: Kind
    stage: Stage = Stage.CONFIG
    """The exit code of a refusal; prompt files keep the data stage the trainer documents for them."""
    must_exist: bool = True
    """Inputs only: False leaves a missing path to the loader that explains it in its own terms (a
    student folder, LoRA adapters); the kind is still checked when something is there."""
    suffixes: tuple[str, ...] = ()
    """FILE: the kinds of file expected; a folder given instead gets one of its files offered."""
    example: str = ""
    """OUTPUT_FILE: a file name offered when a folder is given (e.g. "bench.json")."""


def check_paths(flags: Iterable[PathFlag], probe: bool = True) -> None:
    """Refuse the first path of the wrong kind; `probe`: also prove output folders writable."""
    for item in flags:
        if item.value is None or str(item.value) == "":
            continue
        path = Path(item.value)
        if item.kind is Kind.OUTPUT_FOLDER:
            _output_folder(item, path, probe)
        elif item.kind is Kind.OUTPUT_FILE:
            _output_file(item, path, probe)
        else:
            _input(item, path)


# ---------------------------------------------------------------------------------------------
# Outputs
# ---------------------------------------------------------------------------------------------


def _output_folder(item: PathFlag, path: Path, probe: bool) -> None:
    if path.is_symlink() and not path.exists():
        raise _refusal(
            item,
            path,
            f"is a link to {os.readlink(path)}, which does not exist",
            [f"create the folder it points to, or pass another {item.flag}"],
        )
    if path.exists() and not path.is_dir():
        raise _refusal(
            item,
            path,
            "is a file; a folder is needed here",
            [
                f"pass a folder (it is created when missing), e.g. {item.flag} {_beside(path)}",
                f"or move the file {path} away if it is not needed (nothing was changed)",
            ],
        )
    _no_file_above(item, path)
    if probe:
        _probe(item, path)


def _output_file(item: PathFlag, path: Path, probe: bool) -> None:
    if path.is_dir():
        name = item.example or "output"
        raise _refusal(
            item,
            path,
            "is a folder; a file name is needed here",
            [f"name a file in it, e.g. {item.flag} {path / name}"],
        )
    _no_file_above(item, path)
    if probe:
        _probe(item, path.parent)


def _probe(item: PathFlag, folder: Path) -> None:
    """A file made and removed in `folder`, or in its nearest existing parent when it is missing."""
    where = folder
    while not where.exists() and where != where.parent:
        where = where.parent
    try:
        handle, name = tempfile.mkstemp(prefix=".write-test-", dir=where)
        os.close(handle)
        os.unlink(name)
    except OSError as exc:
        raise not_writable(item.flag, item.value, exc, item.stage) from None


# ---------------------------------------------------------------------------------------------
# Inputs
# ---------------------------------------------------------------------------------------------


def _input(item: PathFlag, path: Path) -> None:
    if path.exists():
        if item.kind in (Kind.FOLDER, Kind.FOLDER_OR_HUB) and not path.is_dir():
            where = " (or a hub id)" if item.kind is Kind.FOLDER_OR_HUB else ""
            raise _refusal(
                item,
                path,
                f"is a file; a folder{where} is needed here",
                [f"pass the folder itself, e.g. {item.flag} {path.parent}, if the file lies in it"],
            )
        if item.kind is Kind.FILE and path.is_dir():
            raise _refusal(item, path, "is a folder; a file is needed here", [_file_inside(item, path)])
        return
    _no_file_above(item, path)
    if item.kind is Kind.FOLDER_OR_HUB or not item.must_exist:
        return  # a hub id, or a loader that names a missing path itself
    # A prompts source is read by distill.data.prompts, which knows both files and captioned folders:
    # only its absence is judged here, so that no command refuses a folder the reader would take.
    noun = {Kind.FILE: "file", Kind.FOLDER: "folder"}.get(item.kind, "file or folder")
    raise _refusal(item, path, f"{noun} not found", [_nearby(item, path)])


def _file_inside(item: PathFlag, folder: Path) -> str:
    files = sorted(
        p.name
        for p in folder.iterdir()
        if p.is_file() and (not item.suffixes or p.suffix.lower() in item.suffixes)
    )
    if files:
        return f"pass one file, e.g. {item.flag} {folder / files[0]}"
    kinds = f" ({', '.join(item.suffixes)})" if item.suffixes else ""
    return f"pass a file{kinds}, not a folder"


def _nearby(item: PathFlag, path: Path) -> str:
    """A name close to the missing one in the same folder (a typo), else the folder that is missing."""
    parent = path.parent
    if parent.is_dir():
        close = difflib.get_close_matches(path.name, os.listdir(parent), n=1, cutoff=0.6)
        if close:
            return f"did you mean {item.flag} {parent / close[0]}?"
        return f"check the path: {parent} has no {path.name}"
    return f"check the path: the folder {parent} does not exist either"


# ---------------------------------------------------------------------------------------------
# Shared
# ---------------------------------------------------------------------------------------------


def file_above(path: Path) -> Path | None:
    """The nearest existing parent of `path` when it is not a folder (nothing can be made inside it)."""
    for parent in path.parents:
        if parent.exists() or parent.is_symlink():
            return None if parent.is_dir() else parent
    return None


def _no_file_above(item: PathFlag, path: Path) -> None:
    blocker = file_above(path)
    if blocker is not None:
        raise _refusal(
            item,
            path,
            f"{blocker} is a file, so nothing can be inside it",
            [
                f"pass a path that does not go through the file {blocker}",
                f"or move {blocker} away if it is not needed (nothing was changed)",
            ],
        )


def _beside(path: Path) -> Path:
    """A folder name next to the file `path` that is not taken yet, to offer in a fix."""
    stem = path.stem if path.suffix else f"{path.name}_dir"
    candidate = path.with_name(stem)
    number = 2
    while candidate.exists():
        candidate = path.with_name(f"{stem}_{number}")
        number += 1
    return candidate


def _refusal(item: PathFlag, path: Path, problem: str, fixes: list[str]) -> DistillError:
    return DistillError(
        f"{item.flag} {path}: {problem}",
        f"{item.flag} must be {item.kind.value}.",
        fixes=fixes,
        stage=item.stage,
    )


def not_writable(flag: str, value: object, exc: OSError, stage: Stage = Stage.CONFIG) -> DistillError:
    """The refusal of an output path the system would not let us write."""
    return DistillError(
        f"{flag} {value} is not writable",
        f"{type(exc).__name__}: {exc}",
        fixes=["choose a folder you can write to, on a disk with room for what the command writes"],
        stage=stage,
    )
