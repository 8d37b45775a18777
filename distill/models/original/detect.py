"""Recognising an original-layout Wan 2.2 folder: its file names, what a complete one holds, and a
fingerprint of its files (which converted cache belongs to which download).

The releases come in two shapes (`OriginalLayout`): the A14B models (T2V, I2V) keep two experts in
high_noise_model/ and low_noise_model/ beside Wan2.1_VAE.pth; Wan2.2-TI2V-5B keeps its one WanModel
at the top of the folder (config.json, diffusion_pytorch_model-0000N-of-00003.safetensors and their
index, what Wan's code reads with WanModel.from_pretrained(checkpoint_dir)) beside Wan2.2_VAE.pth.
Both hold models_t5_umt5-xxl-enc-bf16.pth and google/umt5-xxl/.
"""

from __future__ import annotations

import hashlib
import json
import zipfile
from dataclasses import dataclass, field
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


# TI2V-5B's VAE (48 latent channels, 16x spatial) and its WanModel config, at the top of the folder.
VAE22_FILE = "Wan2.2_VAE.pth"


MODEL_CONFIG = "config.json"


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


# The scheduler shift of each model's diffusers repository, by original model_type (TI2V-5B's:
# Wan-AI/Wan2.2-TI2V-5B-Diffusers, 5.0; Wan's own TI2V sampler uses 5.0 too); FLOW_SHIFT otherwise.
FLOW_SHIFTS = {"ti2v": 5.0}


@dataclass(frozen=True)
class OriginalLayout:
    """Where one shape of original release keeps its files."""

    release: str
    """The hub repository of this shape (for messages)."""
    vae_file: str
    """The VAE state dict."""
    models: dict[str, str] = field(hash=False)
    """diffusers component -> its WanModel folder in the release ("" = the top of the folder)."""
    required: tuple[str, ...]
    """What must be there to convert (configuration.json is optional: Wan's code never reads it)."""


TWO_EXPERTS = OriginalLayout("Wan-AI/Wan2.2-T2V-A14B", VAE_FILE, EXPERT_DIRS, ORIGINAL_REQUIRED)
ONE_MODEL = OriginalLayout(
    "Wan-AI/Wan2.2-TI2V-5B",
    VAE22_FILE,
    {"transformer": ""},
    (T5_FILE, VAE22_FILE, MODEL_CONFIG, f"{TOKENIZER_DIR}/"),
)


def original_layout(folder: str | Path) -> OriginalLayout:
    """ONE_MODEL (TI2V-5B) where the folder shows its files and no expert folder, else TWO_EXPERTS.
    Read from file names (and the top config.json's class), so a damaged folder is still told what
    its own release misses."""
    folder = Path(folder)
    if any((folder / d).is_dir() for d in EXPERT_DIRS.values()):
        return TWO_EXPERTS
    if (
        (folder / VAE22_FILE).is_file()
        or _top_wan_model(folder)
        or any(folder.glob(f"{WEIGHTS_NAME}*.safetensors"))
    ):
        return ONE_MODEL
    return TWO_EXPERTS


def _top_wan_model(folder: Path) -> bool:
    """Whether config.json at the top is Wan's own WanModel config (a diffusers transformer folder
    has _class_name WanTransformer3DModel there instead)."""
    try:
        config = json.loads((folder / MODEL_CONFIG).read_text())
    except (OSError, ValueError):
        return False
    return isinstance(config, dict) and config.get("_class_name") == "WanModel"


def model_folder(folder: Path, layout: OriginalLayout, component: str) -> Path:
    """The folder of `component`'s WanModel (config.json + shards) in an original release."""
    sub = layout.models[component]
    return folder / sub if sub else folder


def model_shards(folder: Path, layout: OriginalLayout, component: str) -> list[Path]:
    """The safetensors files of `component`'s WanModel: at the top of a TI2V-5B folder only the
    diffusion_pytorch_model ones count (anything else there is not the model)."""
    prefix = "" if layout.models[component] else WEIGHTS_NAME
    return expert_shards(model_folder(folder, layout, component), prefix)


def looks_original(folder: str | Path) -> bool:
    """True for a folder holding any part of the original layout (either shape) and no diffusers
    model_index.json."""
    folder = Path(folder)
    if (folder / "model_index.json").is_file():
        return False
    if (folder / VAE22_FILE).is_file() or _top_wan_model(folder):
        return True
    return len(missing_components(folder, ORIGINAL_COMPONENTS)) < len(ORIGINAL_COMPONENTS)


def original_problems(folder: str | Path) -> list[str]:
    """Everything that would stop `folder` from converting (empty when it is complete)."""
    folder = Path(folder)
    layout = original_layout(folder)
    problems = [f"missing {name}" for name in missing_components(folder, layout.required)]
    for name in (T5_FILE, layout.vae_file):
        path = folder / name
        # torch.save writes a zip whose directory sits at the very end: a cut file has none.
        if path.is_file() and not zipfile.is_zipfile(path):
            problems.append(f"{name} is not a complete torch checkpoint (truncated or not a .pth)")
    tokenizer = folder / TOKENIZER_DIR
    if tokenizer.is_dir() and not any((tokenizer / v).is_file() for v in ("tokenizer.json", "spiece.model")):
        problems.append(f"{TOKENIZER_DIR}/ has no vocabulary (tokenizer.json or spiece.model)")
    for component, sub in layout.models.items():
        if not sub or (folder / sub).is_dir():
            problems += _model_problems(folder, layout, component)
    return problems


def _model_problems(folder: Path, layout: OriginalLayout, component: str) -> list[str]:
    from distill.models.layout import safetensors_problem

    sub = layout.models[component]
    label = f"{sub}/" if sub else ""  # the top of a TI2V-5B folder: file names alone
    # (a missing top-level config.json is already in the required list)
    problems = (
        [] if not sub or (folder / sub / MODEL_CONFIG).is_file() else [f"{label}{MODEL_CONFIG} is missing"]
    )
    try:
        shards = model_shards(folder, layout, component)
    except DistillError as error:
        return [*problems, error.details]
    if not shards:
        what = (
            f"{sub}/ has no weight files (*.safetensors)"
            if sub
            else f"no {WEIGHTS_NAME}*.safetensors (the WanModel weights)"
        )
        return [*problems, what]
    for shard in shards:
        if not shard.is_file():
            problems.append(f"{label}{shard.name} is missing (listed in its index)")
        elif problem := safetensors_problem(shard):
            problems.append(f"{label}{shard.name} is damaged: {problem}")
    return problems


def expert_shards(folder: Path, prefix: str = "") -> list[Path]:
    """The safetensors files of a model folder whose names start with `prefix`: those its index
    names, else all of them."""
    indexes = sorted(folder.glob(f"{prefix}*.safetensors.index.json"))
    if not indexes:
        return sorted(folder.glob(f"{prefix}*.safetensors"))
    try:
        names = sorted(set(json.loads(indexes[0].read_text())["weight_map"].values()))
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as error:
        raise DistillError(
            f"cannot read the index of {folder}",
            f"{folder.name}/{indexes[0].name} does not parse: {error}",
            stage=Stage.TEACHER_LOAD,
        ) from None
    return [folder / n for n in names]


def incomplete_error(folder: Path, problems: list[str], release: str, download: str) -> DistillError:
    """The banner of an original folder missing parts: `release` the hub id of the model its config
    names, `download` the command that fetches that model's diffusers layout (convert.py reads the
    kind: this module stays below teacher_kind)."""
    layout = original_layout(folder)
    expected = [f"{CONFIGURATION_FILE} (optional)", *layout.required]
    if layout is ONE_MODEL:
        expected.append(f"{WEIGHTS_NAME}-0000N-of-0000M.safetensors + {WEIGHTS_NAME}.safetensors.index.json")
    return DistillError(
        f"the ORIGINAL Wan layout at {folder} is incomplete",
        "Problems:\n"
        + "\n".join(f"- {p}" for p in problems)
        + f"\nExpected ({release}): {', '.join(expected)}"
        + f"\nFound: {', '.join(present_entries(folder)) or 'nothing'}",
        causes=["the download or copy was interrupted", "only some files of the release were copied"],
        fixes=[
            f"resume the download: hf download {release} --local-dir {folder}",
            f"or use the diffusers layout: {download}",
        ],
        stage=Stage.TEACHER_LOAD,
    )


def source_fingerprint(folder: Path) -> str:
    """A content key of an original folder: names, sizes and the first and last MiB of each file
    (cheap on 70 GB, yet two different checkpoints never share a conversion)."""
    digest = hashlib.sha256(f"converter {CONVERTER_VERSION}".encode())
    layout = original_layout(folder)
    entries = [CONFIGURATION_FILE, *layout.required]
    files = [folder / e for e in entries if (folder / e).is_file()]
    if layout is ONE_MODEL:  # the WanModel's shards and index sit at the top
        files += sorted(folder.glob(f"{WEIGHTS_NAME}*.safetensors*"))
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
