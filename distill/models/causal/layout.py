"""What makes a student causal, and its record beside an exported student: `causal_config.json`.

Kept apart from the attention code (which imports diffusers) so the command-line tools can judge a
student folder, and refuse one, before anything heavy loads.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from distill.ops.errors import DistillError, Stage

# Beside an exported student's config.json: what turns the loaded model causal again. A file of its
# own rather than a config.json key, so stock diffusers loads the folder without a warning and the
# student's config stays a valid student config for every tool that reads one.
CAUSAL_FILE = "causal_config.json"


@dataclass(frozen=True)
class CausalLayout:
    """What makes a student causal: the size of the chunks its attention is causal over."""

    chunk_frames: int
    """Latent frames per chunk (each is 4 video frames, the first chunk's first one 1)."""

    def whole_chunks(self, latent_frames: int) -> bool:
        return latent_frames % self.chunk_frames == 0

    def trained_window(self, trained_latent_frames: int) -> int:
        """Past chunks a stream keeps so that each chunk sees the span it was trained on: those of the
        trained clip but the chunk being made (at least 1)."""
        return max(1, trained_latent_frames // self.chunk_frames - 1)


def check_chunk_frames(chunk_frames: Any, source: str = "chunk_frames") -> int:
    """`chunk_frames` if it is a positive whole number of latent frames, else a refusal naming `source`."""
    if isinstance(chunk_frames, bool) or not isinstance(chunk_frames, int) or chunk_frames < 1:
        raise DistillError(
            f"{source} = {chunk_frames!r}: a causal student's chunk is a positive whole number of latent frames",
            fixes=[f"set {source} to 1 or 3 (the chunk sizes of the published causal Wan students)"],
            stage=Stage.CONFIG,
        )
    return chunk_frames


def write_causal_config(folder: str | Path, layout: CausalLayout) -> Path:
    """Write `causal_config.json` into an exported student's folder (beside its config.json)."""
    path = Path(folder) / CAUSAL_FILE
    record = {
        "chunk_frames": layout.chunk_frames,
        "attention": "block-causal over chunks of chunk_frames latent frames; the weights are a "
        "WanTransformer3DModel's and stream with distill.models.causal (python -m distill.generate --stream)",
    }
    path.write_text(json.dumps(record, indent=2) + "\n")
    return path


def read_causal_config(folder: str | Path) -> CausalLayout | None:
    """The layout recorded beside an exported student, None when it has no causal_config.json."""
    path = Path(folder) / CAUSAL_FILE
    if not path.is_file():
        return None
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise DistillError(
            f"cannot read {path}",
            f"{type(exc).__name__}: {exc}",
            fixes=['write it again as {"chunk_frames": 3} (the chunk size the student was trained with)'],
            stage=Stage.CONFIG,
        ) from None
    chunk = record.get("chunk_frames") if isinstance(record, dict) else None
    return CausalLayout(check_chunk_frames(chunk, f"chunk_frames in {path}"))
