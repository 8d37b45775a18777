"""What a Wan 2.2 teacher folder must contain, and how to tell what is missing or cut short
(read from names and file headers only: no torch here)."""

from __future__ import annotations

import json
from pathlib import Path

# The diffusers layout of Wan-AI/Wan2.2-T2V-A14B-Diffusers. `transformer` is the high-noise
# expert, `transformer_2` the low-noise one (diffusers' WanPipeline convention).
DIFFUSERS_COMPONENTS = (
    "model_index.json",
    "text_encoder/",
    "tokenizer/",
    "vae/",
    "transformer/",
    "transformer_2/",
    "scheduler/",
)

# The layout of the original Wan2.2-T2V-A14B release (Wan's own code, ComfyUI).
ORIGINAL_COMPONENTS = (
    "models_t5_umt5-xxl-enc-bf16.pth",
    "Wan2.1_VAE.pth",
    "high_noise_model/",
    "low_noise_model/",
)
# Converting the original layout also needs its tokenizer folder (configuration.json is optional:
# Wan's code never reads it). Kept apart from ORIGINAL_COMPONENTS, which identifies the layout.
ORIGINAL_REQUIRED = (*ORIGINAL_COMPONENTS, "google/umt5-xxl/")


def missing_components(folder: str | Path, expected: tuple[str, ...] = DIFFUSERS_COMPONENTS) -> list[str]:
    """The entries of `expected` absent from `folder` (names ending in '/' must be folders)."""
    folder = Path(folder)
    missing = []
    for name in expected:
        path = folder / name.rstrip("/")
        present = path.is_dir() if name.endswith("/") else path.is_file()
        if not present:
            missing.append(name)
    return missing


def present_entries(folder: str | Path) -> list[str]:
    """What the folder actually holds, for error messages (folders end with '/')."""
    folder = Path(folder)
    if not folder.is_dir():
        return []
    return sorted(p.name + ("/" if p.is_dir() else "") for p in folder.iterdir())


def safetensors_problem(path: Path) -> str | None:
    """Why a safetensors file cannot be whole (truncated, garbage header), read from its header only."""
    size = path.stat().st_size
    try:
        with path.open("rb") as handle:
            header_length = int.from_bytes(handle.read(8), "little")
            if header_length <= 0 or 8 + header_length > size:
                return f"header length {header_length} does not fit in a file of {size} bytes (truncated?)"
            header = json.loads(handle.read(header_length))
    except (OSError, ValueError) as exc:
        return f"unreadable header ({type(exc).__name__}: {exc})"
    end = max((entry["data_offsets"][1] for key, entry in header.items() if key != "__metadata__"), default=0)
    if 8 + header_length + end > size:
        return f"the file is {size} bytes but its tensors need {8 + header_length + end}: it was cut short"
    return None
