"""Recognising an original-layout Wan 2.2 folder: its file names, what a complete one holds, and a
fingerprint of its files (which converted cache belongs to which download)."""

from __future__ import annotations

import hashlib
import json
import zipfile
from pathlib import Path

from distill.models.layout import (
    ORIGINAL_COMPONENTS,
    ORIGINAL_REQUIRED,
    missing_components,
    present_entries,
)
from distill.ops.errors import DistillError, Stage

T5_FILE = "models_t5_umt5-xxl-enc-bf16.pth"


VAE_FILE = "Wan2.1_VAE.pth"


TOKENIZER_DIR = "google/umt5-xxl"


CONFIGURATION_FILE = "configuration.json"


# diffusers' WanPipeline names -> the original folders (transformer is the HIGH-noise expert).
EXPERT_DIRS = {"transformer": "high_noise_model", "transformer_2": "low_noise_model"}


WEIGHTS_NAME = "diffusion_pytorch_model"


# The original release keeps these in Wan's Python config (wan/configs/wan_t2v_A14B.py), not in
# any file, so a conversion has to supply them.
A14B_BOUNDARY_RATIO = 0.875


# Wan's T5RelativeEmbedding hard-codes max_dist=128; the bucket count is in the weights.
T5_MAX_DISTANCE = 128


# The scheduler of Wan-AI/Wan2.2-T2V-A14B-Diffusers (Wan's own sampler uses shift 12 instead).
FLOW_SHIFT = 3.0


CONVERT_DIR_ENV = "WAN_DISTILL_CONVERT_DIR"


MARKER = "converted_from_original.json"


# Bump when the conversion output changes, so cached conversions are redone.
CONVERTER_VERSION = 1


def looks_original(folder: str | Path) -> bool:
    """True for a folder holding any part of the original layout and no diffusers model_index.json."""
    folder = Path(folder)
    if (folder / "model_index.json").is_file():
        return False
    return len(missing_components(folder, ORIGINAL_COMPONENTS)) < len(ORIGINAL_COMPONENTS)


def original_problems(folder: str | Path) -> list[str]:
    """Everything that would stop `folder` from converting (empty when it is complete)."""
    folder = Path(folder)
    problems = [f"missing {name}" for name in missing_components(folder, ORIGINAL_REQUIRED)]
    for name in (T5_FILE, VAE_FILE):
        path = folder / name
        # torch.save writes a zip whose directory sits at the very end: a cut file has none.
        if path.is_file() and not zipfile.is_zipfile(path):
            problems.append(f"{name} is not a complete torch checkpoint (truncated or not a .pth)")
    tokenizer = folder / TOKENIZER_DIR
    if tokenizer.is_dir() and not any((tokenizer / v).is_file() for v in ("tokenizer.json", "spiece.model")):
        problems.append(f"{TOKENIZER_DIR}/ has no vocabulary (tokenizer.json or spiece.model)")
    for expert in EXPERT_DIRS.values():
        if (folder / expert).is_dir():
            problems += _expert_problems(folder / expert)
    return problems


def _expert_problems(folder: Path) -> list[str]:
    from distill.models.layout import safetensors_problem

    name = folder.name
    problems = [] if (folder / "config.json").is_file() else [f"{name}/config.json is missing"]
    try:
        shards = expert_shards(folder)
    except DistillError as error:
        return [*problems, error.details]
    if not shards:
        return [*problems, f"{name}/ has no weight files (*.safetensors)"]
    for shard in shards:
        if not shard.is_file():
            problems.append(f"{name}/{shard.name} is missing (listed in its index)")
        elif problem := safetensors_problem(shard):
            problems.append(f"{name}/{shard.name} is damaged: {problem}")
    return problems


def expert_shards(folder: Path) -> list[Path]:
    """The safetensors files of an expert folder: those its index names, else all of them."""
    indexes = sorted(folder.glob("*.safetensors.index.json"))
    if not indexes:
        return sorted(folder.glob("*.safetensors"))
    try:
        names = sorted(set(json.loads(indexes[0].read_text())["weight_map"].values()))
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as error:
        raise DistillError(
            f"cannot read the index of {folder}",
            f"{folder.name}/{indexes[0].name} does not parse: {error}",
            stage=Stage.TEACHER_LOAD,
        ) from None
    return [folder / n for n in names]


def incomplete_error(folder: Path, problems: list[str]) -> DistillError:
    return DistillError(
        f"the ORIGINAL Wan layout at {folder} is incomplete",
        "Problems:\n"
        + "\n".join(f"- {p}" for p in problems)
        + f"\nExpected: {CONFIGURATION_FILE} (optional), {', '.join(ORIGINAL_REQUIRED)}"
        + f"\nFound: {', '.join(present_entries(folder)) or 'nothing'}",
        causes=["the download or copy was interrupted", "only some files of the release were copied"],
        fixes=[
            f"resume the download: hf download Wan-AI/Wan2.2-T2V-A14B --local-dir {folder}",
            "or use the diffusers layout: python download_wan.py --local_dir models/Wan2.2-T2V-A14B-Diffusers",
        ],
        stage=Stage.TEACHER_LOAD,
    )


def source_fingerprint(folder: Path) -> str:
    """A content key of an original folder: names, sizes and the first and last MiB of each file
    (cheap on 70 GB, yet two different checkpoints never share a conversion)."""
    digest = hashlib.sha256(f"converter {CONVERTER_VERSION}".encode())
    entries = [CONFIGURATION_FILE, *ORIGINAL_REQUIRED]
    files = [folder / e for e in entries if (folder / e).is_file()]
    files += [p for e in entries if (folder / e).is_dir() for p in (folder / e).rglob("*") if p.is_file()]
    for file in sorted(files):
        size = file.stat().st_size
        digest.update(f"{file.relative_to(folder).as_posix()}:{size}".encode())
        with file.open("rb") as handle:
            digest.update(handle.read(1 << 20))
            if size > 2 << 20:
                handle.seek(-(1 << 20), 2)
                digest.update(handle.read())
    return digest.hexdigest()[:16]
