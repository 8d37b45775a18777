"""The one rule for writing into a folder that may already hold something.

A folder that holds something is never replaced without the flag that says so, and never by another
model. Every command that writes a whole folder (a tiny or a toy teacher, the toy training data)
builds it beside its destination and hands it to `put_in_place`:
- a missing or empty destination gets it;
- a destination that already holds exactly these files keeps them (rerunning the same command loses
  nothing, so it needs no flag: `make demo` writes the same toy teacher on every run);
- anything else is replaced only with the command's --overwrite, and otherwise refused, naming what
  the folder holds, before a byte of it changes.
A download never deletes: it adds files, so a folder that holds another model would end up holding
two. The download command reads the folder's model first and refuses it with `replace_refusal`, with
no flag to force it (a mixed folder is no model at all).
"""

from __future__ import annotations

import filecmp
import shutil
from pathlib import Path

from distill.ops.errors import DistillError, Stage
from distill.ops.files import staging_folder, swap_into_place


def holds_something(folder: Path) -> bool:
    """Whether `folder` exists and is not empty (a file in its place counts: it is not ours to replace)."""
    if not folder.is_dir():
        return folder.exists()
    return any(folder.iterdir())


def same_files(a: Path, b: Path) -> bool:
    """Whether two folders hold the same file names with the same bytes."""

    def names(root: Path) -> set[str]:
        return {p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file()}

    files = names(a)
    if files != names(b):
        return False
    return all(filecmp.cmp(a / name, b / name, shallow=False) for name in files)


def free_sibling(folder: Path) -> Path:
    """A name beside `folder` that holds nothing yet (folder-2, folder-3, ...), for a fix to name."""
    for number in range(2, 1000):
        candidate = folder.with_name(f"{folder.name}-{number}")
        if not candidate.exists():
            return candidate
    return folder.with_name(f"{folder.name}-new")


def _entries(folder: Path) -> str:
    if not folder.is_dir():
        return "it is a file"
    names = sorted(p.name + ("/" if p.is_dir() else "") for p in folder.iterdir())
    return "it contains: " + ", ".join(names[:12]) + (", ..." if len(names) > 12 else "")


def replace_refusal(
    dest: Path,
    flag: str,
    holds: str,
    writing: str,
    overwrite_flag: str | None = "--overwrite",
    new_folder: str | None = None,
) -> DistillError:
    """The banner of a folder this command would replace (or, for a download, mix another model into):
    first a new folder (always accepted; `new_folder` the whole command where the caller knows it),
    then the flag that replaces it, where the command has one."""
    fixes = [new_folder or f"write to a new folder: {flag} {free_sibling(dest)}"]
    if overwrite_flag is not None:
        fixes.append(f"or pass {overwrite_flag} to replace {dest} and everything in it")
    return DistillError(
        f"{flag} {dest} already holds {holds}: refusing to replace it with {writing}",
        f"{dest}: {_entries(dest)}. Nothing was changed.",
        fixes=fixes,
        stage=Stage.SETUP,
    )


def put_in_place(staging: Path, dest: Path, *, flag: str, holds: str, writing: str, overwrite: bool) -> bool:
    """Move the finished folder `staging` to `dest` under the rule above; True when `dest` was written,
    False when it already held these very files (then `staging` is dropped). `holds` says in words
    what `dest` holds, for the refusal. `staging` is removed whatever happens."""
    try:
        if holds_something(dest) and not overwrite:
            if dest.is_dir() and same_files(staging, dest):
                return False
            raise replace_refusal(dest, flag, holds, writing)
        if dest.exists() and not dest.is_dir():
            raise DistillError(
                f"{flag} {dest} is a file, not a folder",
                "Nothing was changed.",
                fixes=[f"write to a new folder: {flag} {free_sibling(dest)}"],
                stage=Stage.SETUP,
            )
        dest.parent.mkdir(parents=True, exist_ok=True)
        swap_into_place(staging, dest)
        return True
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def build_beside(dest: Path) -> Path:
    """A fresh folder beside `dest` to build in before `put_in_place` (same file system: one rename)."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    return staging_folder(dest)
