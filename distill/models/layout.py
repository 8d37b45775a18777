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

# A teacher with one transformer (Wan2.2-TI2V-5B) has no `transformer_2/`.
ONE_TRANSFORMER_COMPONENTS = tuple(c for c in DIFFUSERS_COMPONENTS if c != "transformer_2/")


def diffusers_components(experts: int) -> tuple[str, ...]:
    """What the diffusers folder of a teacher with `experts` transformers (2 or 1) holds."""
    return DIFFUSERS_COMPONENTS if experts == 2 else ONE_TRANSFORMER_COMPONENTS


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


# The diffusers components that hold weights (the others are configs, a tokenizer and a scheduler).
WEIGHTED_COMPONENTS = ("text_encoder", "vae", "transformer", "transformer_2")
WEIGHT_SUFFIXES = (".safetensors", ".bin")


def components_without_weights(folder: str | Path) -> list[str]:
    """The weighted components of a diffusers teacher folder that hold no weight file: all four in a
    folder fetched with `download_wan.py --configs_only`, enough for a --dry_run plan."""
    folder = Path(folder)
    return [
        f"{name}/"
        for name in WEIGHTED_COMPONENTS
        if (folder / name).is_dir()
        and not any(p.suffix in WEIGHT_SUFFIXES for p in (folder / name).iterdir() if p.is_file())
    ]


def require_weights(folder: str | Path, download: str) -> None:
    """Refuse to train from a teacher folder that holds configs but no weights (what
    `download_wan.py --configs_only` fetches for a --dry_run plan), before anything is written.
    `download`: the command that fetches its weights (the teacher kind's, TeacherKind.download_command)."""
    from distill.ops.errors import DistillError, Stage

    missing = components_without_weights(folder)
    if missing:
        raise DistillError(
            f"the teacher folder {folder} holds configs but no weights yet",
            f"No weight files in: {', '.join(missing)}. Its configs are enough for --dry_run, not for training.",
            causes=[
                "it was fetched with download_wan.py --configs_only",
                "the weight download did not finish",
            ],
            fixes=[
                f"{download}   # fetches the weights, resumable",
                f"python download_wan.py --verify {folder}   # then check it",
            ],
            stage=Stage.TEACHER_LOAD,
        )


# What `download_wan.py --configs_only` and a --dry_run given a hub id fetch (huggingface_hub
# allow_patterns, fnmatch: "*" also crosses "/"): the pipeline index and each component's config;
# no weights, no weight index, no vocabulary.
CONFIG_PATTERNS = (
    "model_index.json",
    "*/config.json",
    "*/scheduler_config.json",
    "*/tokenizer_config.json",
    "*/special_tokens_map.json",
)
