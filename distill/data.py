"""Prompts, the two caches built from them, and the resumable order in which training reads them.

Both caches are folders of one safetensors file per prompt (named by a hash of the prompt text)
plus a `settings.json` saying what produced them. A cache built by another teacher or with other
settings is refused with the folder to delete, never silently mixed. Files are written to a
temporary name and renamed, so an interrupted build resumes where it stopped.
"""

from __future__ import annotations

import csv
import hashlib
import json
import logging
import os
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from distill.errors import DistillError, Stage

logger = logging.getLogger(__name__)


# ---------------------------------------------------------------------------------------------
# Prompt files
# ---------------------------------------------------------------------------------------------


def _data_error(path: Path, problem: str, fix: str, flag: str = "--data_path") -> DistillError:
    return DistillError(f"{flag} {path}: {problem}", fixes=[fix], stage=Stage.DATA)


def read_prompts(path: str | Path, flag: str = "--data_path") -> list[str]:
    """Prompts from .txt (one a line; blank and '#' lines skipped), .jsonl or .csv (a 'prompt' field).

    `flag` is the setting the path came from, named in every error.
    """
    path = Path(path)
    if path.is_dir():
        inside = sorted(p.name for p in path.iterdir() if p.suffix.lower() in (".txt", ".jsonl", ".csv"))
        raise _data_error(
            path,
            "is a folder; a prompts file is expected",
            f"pass one file, e.g. {flag} {path / inside[0]}"
            if inside
            else "pass a .txt, .jsonl or .csv file",
            flag,
        )
    if not path.is_file():
        raise _data_error(
            path, "file not found", "check the path; data/static_prompts.txt ships with the project", flag
        )
    raw = path.read_bytes()
    if b"\x00" in raw[:8192]:
        raise _data_error(
            path, "looks like a binary file, not text", "pass a UTF-8 .txt, .jsonl or .csv file", flag
        )
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        line = raw[: exc.start].count(b"\n") + 1
        raise _data_error(
            path, f"is not UTF-8 (bad byte at line {line})", "re-save the file as UTF-8", flag
        ) from None
    suffix = path.suffix.lower()
    if suffix == ".jsonl":
        prompts = _prompts_from_jsonl(path, text, flag)
    elif suffix == ".csv":
        rows = list(csv.DictReader(text.splitlines()))
        if rows and "prompt" not in rows[0]:
            raise _data_error(
                path,
                f"has no 'prompt' column (columns: {', '.join(rows[0])})",
                "name the column 'prompt'",
                flag,
            )
        prompts = [row["prompt"].strip() for row in rows]
    else:
        prompts = [line.strip() for line in text.splitlines() if not line.lstrip().startswith("#")]
    prompts = [p for p in prompts if p]
    if not prompts:
        raise _data_error(
            path, "holds no prompts", "write one prompt per line (lines starting with # are comments)", flag
        )
    return prompts


def _prompts_from_jsonl(path: Path, text: str, flag: str) -> list[str]:
    prompts = []
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise _data_error(
                path, f"line {number} is not JSON ({exc.msg})", "one JSON object per line", flag
            ) from None
        if not isinstance(record, dict) or "prompt" not in record:
            raise _data_error(
                path, f"line {number} has no 'prompt' field", 'write {"prompt": "..."} per line', flag
            )
        prompts.append(str(record["prompt"]).strip())
    return prompts


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
            _atomic_write_text(marker, json.dumps(self.settings, indent=2, sort_keys=True))
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


def _atomic_write_text(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


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


# ---------------------------------------------------------------------------------------------
# What training reads
# ---------------------------------------------------------------------------------------------


class DistillationDataset(torch.utils.data.Dataset):
    """Clean latent x0 and zero-padded prompt embedding of each training prompt, read from the caches."""

    def __init__(
        self,
        prompts: Sequence[str],
        latents: TensorCache,
        embeddings: TensorCache,
        max_length: int,
        noise_for: Callable[[str], torch.Tensor] | None = None,
    ) -> None:
        self.prompts = list(prompts)
        self.latents, self.embeddings = latents, embeddings
        self.max_length = max_length
        # With it, items also carry the initial noise the teacher sampled x0 from (its noise -> x0 pair).
        self.noise_for = noise_for

    def __len__(self) -> int:
        return len(self.prompts)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        prompt = self.prompts[index]
        item = {
            "x0": self.latents.get(prompt),
            "cond": pad_embedding(self.embeddings.get(prompt), self.max_length),
            "index": torch.tensor(index),
        }
        if self.noise_for is not None:
            item["noise"] = self.noise_for(prompt)
        return item

    def clean_latent_statistics(self, limit: int = 256) -> tuple[float, float]:
        """Mean and std over every element of the first `limit` cached clean latents (the teacher's)."""
        total = squares = count = 0.0
        for prompt in self.prompts[:limit]:
            x0 = self.latents.get(prompt).double()
            total, squares, count = (
                total + x0.sum().item(),
                squares + x0.pow(2).sum().item(),
                count + x0.numel(),
            )
        mean = total / count
        return mean, max(squares / count - mean * mean, 0.0) ** 0.5


def pad_embedding(embedding: torch.Tensor, max_length: int) -> torch.Tensor:
    """Zero-pad a (tokens, dim) embedding to max_length rows, exactly as WanPipeline pads prompts."""
    padded = embedding.new_zeros(max_length, embedding.shape[-1])
    padded[: embedding.shape[0]] = embedding[:max_length]
    return padded


class ResumableSampler(torch.utils.data.Sampler[int]):
    """This rank's share of one global stream of shuffled epochs, resumable from a sample count.

    The global stream concatenates permutations drawn from `seed + epoch`. It is cut into global
    batches of `batch_size * world_size`; rank r reads slice r of each. So the samples a step sees
    do not depend on how many processes share the global batch, and resuming needs only the
    number of global samples consumed (a DataLoader reads ahead, so the sampler's own position is
    not what training has used).
    """

    def __init__(
        self, num_items: int, seed: int, batch_size: int = 1, rank: int = 0, world_size: int = 1
    ) -> None:
        self.num_items, self.seed = num_items, seed
        self.batch_size, self.rank, self.world_size = batch_size, rank, world_size
        self.start = 0

    def start_at(self, consumed: int) -> None:
        """Continue after `consumed` global samples."""
        self.start = consumed

    def _global_stream(self, start: int) -> Iterator[int]:
        epoch, position = divmod(start, self.num_items)
        while True:
            order = torch.randperm(
                self.num_items, generator=torch.Generator().manual_seed(self.seed + epoch)
            ).tolist()
            yield from order[position:]
            epoch, position = epoch + 1, 0

    def __iter__(self) -> Iterator[int]:
        global_batch = self.batch_size * self.world_size
        for offset, index in enumerate(self._global_stream(self.start)):
            if ((self.start + offset) % global_batch) // self.batch_size == self.rank:
                yield index

    def __len__(self) -> int:
        return max(1, self.num_items // self.world_size)
