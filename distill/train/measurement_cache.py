"""The memory plan's measurements, kept on disk so a run measures each model use only once.

Every run on an accelerator logs its plan (a CPU run leaves it to --dry_run), and the plan runs the
real model on fake tensors (`activations`): a few
seconds per model use, the same numbers every time for the same code and libraries. A run that resumes,
a rank restarted by torchrun and a second `--dry_run` of a recipe all read them back instead.

The folder is $WAN_DISTILL_PLAN_CACHE, else ~/.cache/wan-distill/plan ($XDG_CACHE_HOME honoured).
Each entry is named by a hash of what was measured and of the code that measured it: this package's
source and the versions of torch, diffusers and peft, so an upgrade or an edit measures afresh and
never reads a number another version measured. An entry that cannot be read is measured again; a
folder that cannot be written (read-only home, full disk) costs only the time.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import tempfile
from collections.abc import Callable
from importlib import metadata
from pathlib import Path

logger = logging.getLogger(__name__)

PLAN_CACHE_ENV = "WAN_DISTILL_PLAN_CACHE"
PACKAGE = Path(__file__).resolve().parents[1]
LIBRARIES = ("torch", "diffusers", "peft")


def cache_root() -> Path:
    """$WAN_DISTILL_PLAN_CACHE, else the user cache's wan-distill/plan."""
    if os.environ.get(PLAN_CACHE_ENV):
        return Path(os.environ[PLAN_CACHE_ENV]).expanduser()
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "wan-distill" / "plan"


@functools.cache
def code_fingerprint() -> str:
    """A hash of this package's Python source and of the measuring libraries' versions."""
    digest = hashlib.sha256()
    for name in LIBRARIES:
        digest.update(f"{name}={_version(name)}\n".encode())
    for path in sorted(PACKAGE.rglob("*.py")):
        digest.update(str(path.relative_to(PACKAGE)).encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()


def _version(name: str) -> str:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return "absent"


def entry_path(key: str) -> Path:
    """The file of the measurement named `key` under this code."""
    name = hashlib.sha256(f"{code_fingerprint()}\n{key}".encode()).hexdigest()[:32]
    return cache_root() / f"{name}.json"


def cached_measurement(key: str, measure: Callable[[], tuple[float, ...]]) -> tuple[float, ...]:
    """The numbers `measure` returns for `key`: read from the cache folder when an earlier process
    measured them under the same code, else measured now and stored."""
    path = entry_path(key)
    try:
        stored = json.loads(path.read_text())
        if stored["key"] == key:
            return tuple(float(value) for value in stored["values"])
    except (OSError, ValueError, KeyError, TypeError):
        pass  # absent or unreadable: measured again below
    values = tuple(float(value) for value in measure())
    _store(path, {"key": key, "values": list(values)})
    return values


def _store(path: Path, entry: dict) -> None:
    """Write `entry` whole or not at all (a temporary file renamed over the name), so a process that
    reads at the same moment sees the old entry or the new one, never half of one."""
    temporary: Path | None = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=path.parent, suffix=".tmp", delete=False) as handle:
            temporary = Path(handle.name)
            json.dump(entry, handle)
        os.replace(temporary, path)
    except OSError as error:
        logger.debug("plan measurement not cached in %s: %s", path.parent, error)
        if temporary is not None:
            temporary.unlink(missing_ok=True)
