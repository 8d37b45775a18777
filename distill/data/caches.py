"""The two caches built from the prompts: prompt embeddings and the teacher's clean latents.

Both caches are folders of one safetensors file per prompt (named by a hash of the prompt text)
plus a `settings.json` saying what produced them. A cache built by another teacher or with other
settings is refused with the folder to delete, never silently mixed. Files are written to a
temporary name and renamed, so an interrupted build resumes where it stopped.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from distill.ops.errors import DistillError, Stage
from distill.ops.files import atomic_write_text

logger = logging.getLogger(__name__)


# ---------------------------------------------------------------------------------------------
# Prompt files
# ---------------------------------------------------------------------------------------------


def prompt_key(prompt: str) -> str:
    return hashlib.sha256(prompt.encode("utf-8")).hexdigest()[:32]


# ---------------------------------------------------------------------------------------------
# Caches
# ---------------------------------------------------------------------------------------------


class TensorCache:
    """One safetensors file per prompt in `folder`, valid only for the `settings` it was built with."""

    def __init__(self, folder: str | Path, settings: dict[str, Any], what: str) -> None:
        self.folder = Path(folder)
        self.settings = settings
        self.what = what

    def open(self) -> TensorCache:
        """Create the folder, or check that an existing one was built with the same settings."""
        marker = self.folder / "settings.json"
        if marker.is_file():
            previous = json.loads(marker.read_text())
            if previous != self.settings:
                changed = sorted(
                    k for k in set(previous) | set(self.settings) if previous.get(k) != self.settings.get(k)
                )
                details = "\n".join(
                    f"{k}: cache has {previous.get(k)!r}, this run has {self.settings.get(k)!r}"
                    for k in changed
                )
                raise DistillError(
                    f"the {self.what} cache in {self.folder} was built with other settings",
                    details,
                    fixes=[
                        f"delete {self.folder} to rebuild it with the current settings",
                        "or pass another --cache_dir to keep both",
                    ],
                    stage=Stage.DATA,
                )
        else:
            self.folder.mkdir(parents=True, exist_ok=True)
            atomic_write_text(marker, json.dumps(self.settings, indent=2, sort_keys=True))
        return self

    def path(self, prompt: str) -> Path:
        return self.folder / f"{prompt_key(prompt)}.safetensors"

    def missing(self, prompts: Sequence[str]) -> list[str]:
        return [p for p in dict.fromkeys(prompts) if not self.path(p).is_file()]

    def put(self, prompt: str, tensor: torch.Tensor) -> None:
        target = self.path(prompt)
        tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
        save_file({"value": tensor.detach().contiguous().cpu()}, str(tmp), metadata={"prompt": prompt})
        os.replace(tmp, target)

    def get(self, prompt: str) -> torch.Tensor:
        try:
            return load_file(str(self.path(prompt)))["value"]
        except Exception as exc:
            raise DistillError(
                f"the {self.what} cache entry for a prompt is unreadable: {self.path(prompt)}",
                f"{type(exc).__name__}: {exc}",
                fixes=[f"delete {self.path(prompt)}; it is rebuilt on the next run"],
                stage=Stage.DATA,
            ) from None


def fill_cache(
    cache: TensorCache,
    prompts: Sequence[str],
    compute: Callable[[list[str]], list[torch.Tensor]],
    batch_size: int = 1,
    progress: Callable[[int], None] | None = None,
) -> int:
    """Compute the entries `cache` lacks, `batch_size` prompts at a time. Returns how many were built."""
    todo = cache.missing(prompts)
    for start in range(0, len(todo), batch_size):
        chunk = todo[start : start + batch_size]
        for prompt, value in zip(chunk, compute(chunk)):
            cache.put(prompt, value)
        if progress:
            progress(len(chunk))
    return len(todo)
