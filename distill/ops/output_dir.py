"""Output folders: writable before any work starts, and one training run at a time.

Every command checks the folders it will write to before it loads anything (`writable_folder`, or
all its path flags at once with distill.ops.paths), so a typo in an output path costs seconds, not a
rendered video or a trained model.

Two runs in one `--output_dir` (a second launch with another `--lr`, a job started twice by a
scheduler) would interleave their metrics, prune each other's checkpoints and export whichever
student finished last. Rank 0 holds an exclusive `flock` on `<output_dir>/.run.lock` for the
whole run and writes its pid, host and start time into it. The kernel drops the lock when the
process ends, however it ends, so a crashed or killed run never leaves the folder locked.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import socket
import time
from collections.abc import Iterable, Iterator
from pathlib import Path

from distill.ops.errors import DistillError, Stage
from distill.ops.paths import Kind, PathFlag, check_paths, not_writable

LOCK_NAME = ".run.lock"


def writable_folder(folder: str | Path, flag: str, create: bool = True) -> Path:
    """`folder`, proven writable, or a DistillError naming `flag`.

    The kind is checked first (distill.ops.paths: not a file, not under one). `create`: make the
    folder now. Without it nothing is left behind: a probe file is written and removed in the
    folder, or in its nearest existing parent when it does not exist yet.
    """
    folder = Path(folder)
    check_paths([PathFlag(flag, folder, Kind.OUTPUT_FOLDER)])
    if create:
        try:
            folder.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise not_writable(flag, folder, exc) from None
    return folder


def require_replaceable(output_dir: str | Path, names: Iterable[str]) -> None:
    """Refuse, before any work, outputs in `output_dir` that this run would replace but cannot.

    A run rewrites its exports and prunes its checkpoints by moving old folders aside and deleting
    them; a folder (or a folder inside it) without write permission can be neither, so the export
    would fail after the whole training. Files need nothing: they are replaced by a rename.
    """
    output_dir = Path(output_dir)
    blocked = []
    for name in names:
        top = output_dir / name
        if top.is_symlink() or not top.is_dir():
            continue
        for folder, _, _ in os.walk(top):
            if not os.access(folder, os.W_OK | os.X_OK):
                blocked.append(Path(folder))
                break
    if blocked:
        shown = " ".join(str(folder) for folder in blocked)
        raise DistillError(
            f"--output_dir {output_dir}: {', '.join(f'{p.relative_to(output_dir)}/' for p in blocked)} "
            "cannot be replaced (not writable)",
            "This run rewrites its exports and checkpoints there at the end, by moving the old folders "
            "aside; a read-only folder cannot be moved or emptied, so the export would fail after the "
            "training. Nothing was changed.",
            fixes=[f"make them writable: chmod -R u+w {shown}", "or give this run another --output_dir"],
            stage=Stage.CONFIG,
        )


@contextlib.contextmanager
def hold_output_dir(output_dir: Path) -> Iterator[None]:
    """Hold `output_dir` for this run, or raise naming the run that holds it."""
    path = output_dir / LOCK_NAME
    handle = path.open("a+")
    try:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise in_use_error(output_dir, path) from None
        handle.seek(0)
        handle.truncate()
        owner = {
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "started": time.strftime("%Y-%m-%d %H:%M:%S"),
        }
        handle.write(json.dumps(owner) + "\n")
        handle.flush()
        yield
    finally:
        handle.close()  # releases the lock


def in_use_error(output_dir: Path, path: Path) -> DistillError:
    try:
        owner = json.loads(path.read_text() or "{}")
    except (OSError, ValueError):
        owner = {}
    who = (
        f"pid {owner.get('pid', '?')} on host {owner.get('host', '?')}, started {owner.get('started', '?')}"
        if owner
        else "a run that has not written its name yet"
    )
    return DistillError(
        f"--output_dir {output_dir} is in use by another run ({who})",
        "Two runs in one folder would interleave metrics.jsonl, prune each other's checkpoints and "
        "overwrite each other's student/. Nothing was changed in the folder.",
        fixes=[
            "let that run finish (or stop it: Ctrl-C or SIGTERM saves a checkpoint), then rerun: "
            "--resume auto continues from its last checkpoint",
            "or give this run another --output_dir",
        ],
        stage=Stage.CONFIG,
    )
