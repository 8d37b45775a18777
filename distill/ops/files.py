"""Writing files so that a crash or a full disk never leaves a half-written one behind a complete name.

Checkpoints, exports and caches are written under a temporary name, flushed (`fsync_tree`) and renamed
into place; `disk_is_full` tells a full disk from other write failures, since torch.save and safetensors
name it in their own words.
"""

from __future__ import annotations

import errno
import os
import shutil
import tempfile
from pathlib import Path

from distill.ops.errors import DistillError, Stage


def fsync_tree(folder: Path) -> None:
    """Flush the files and the folder entry so a rename after it cannot expose empty files."""
    for path in folder.rglob("*"):
        if path.is_file():
            with open(path, "rb") as handle:
                os.fsync(handle.fileno())
    if hasattr(os, "O_DIRECTORY"):
        fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def current_umask() -> int:
    """The process umask (reading it means setting it, so it is set back at once)."""
    mask = os.umask(0)
    os.umask(mask)
    return mask


# Free space below which a failed write is put down to a full disk.
FULL_BELOW_BYTES = 64 * 1024**2


def disk_is_full(exc: BaseException, folder: Path) -> bool:
    """Whether a failed write ran out of space: torch.save says only "iostream error" and
    safetensors its own words, so the disk itself is asked too."""
    if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return True
    if "No space left" in str(exc):
        return True
    try:
        return shutil.disk_usage(folder if folder.exists() else folder.parent).free < FULL_BELOW_BYTES
    except OSError:
        return False


def export_failed(exc: BaseException, folder: Path, what: str, resume_from: str | None) -> DistillError:
    """The banner of an export whose write failed (a full disk, a folder that became read-only): the
    checkpoints are intact, so the same command resumes from `resume_from` and exports again."""
    full = disk_is_full(exc, folder.parent)
    return DistillError(
        ("the disk is full: " if full else "") + f"cannot export {what}to {folder}",
        f"{type(exc).__name__}: {exc}",
        causes=["the disk is full", "the folder is not writable"],
        fixes=[
            "free space (df -h), or make the folder writable, or point --output_dir at another disk",
            "then rerun the same command: it resumes from the last checkpoint"
            + (f" ({resume_from}) and exports" if resume_from else " and exports"),
        ],
        stage=Stage.CHECKPOINT,
    )


def atomic_write_text(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def staging_folder(out_dir: Path) -> Path:
    """A fresh folder beside `out_dir` to write into before `swap_into_place` (same file system, so
    the rename is atomic), readable like any folder the user writes (mkdtemp alone makes it 0700)."""
    staging = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    staging.chmod(0o777 & ~current_umask())
    return staging


def swap_into_place(staging: Path, out_dir: Path) -> None:
    """Rename the finished `staging` to `out_dir`; an existing `out_dir` is replaced only now. Its files
    become readable like any the user writes (some writers create them 0600 through a temporary file).
    When a rename fails (say, `out_dir` is read-only) the old `out_dir` stays where it was and the
    OSError is raised: no half-moved folders are left."""
    mode = 0o666 & ~current_umask()
    for path in staging.rglob("*"):
        if path.is_file() and not path.is_symlink():
            path.chmod(mode)
    fsync_tree(staging)
    if out_dir.exists():
        retired = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.old-", dir=out_dir.parent))
        try:
            os.replace(out_dir, retired / out_dir.name)
        except OSError:
            retired.rmdir()  # nothing was moved: leave no empty .old- folder behind
            raise
        try:
            os.replace(staging, out_dir)
        except OSError:
            os.replace(retired / out_dir.name, out_dir)  # the old folder back under its name
            retired.rmdir()
            raise
        shutil.rmtree(retired, ignore_errors=True)
    else:
        os.replace(staging, out_dir)
