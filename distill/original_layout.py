"""The ORIGINAL Wan 2.2 T2V A14B checkpoint layout: recognise it, convert it to the diffusers
layout once, write it (tiny teacher), and export a student in it.

    # Convert a download of Wan-AI/Wan2.2-T2V-A14B once (later loads read DST directly):
    python download_wan.py --convert models/Wan2.2-T2V-A14B models/Wan2.2-T2V-A14B-Diffusers
    # Or point the trainer at the original folder: it converts once into a cache and reuses it
    # ($WAN_DISTILL_CONVERT_DIR, default ~/.cache/wan-distill/converted):
    python train_distillation.py --teacher_path models/Wan2.2-T2V-A14B ...
    # A tiny random teacher in the original layout (tests, demos):
    python download_wan.py --tiny outputs/tiny-wan-original --layout original

The original layout (what Wan's own code and ComfyUI read):

    configuration.json                     {"framework": "Pytorch", "task": "text-to-video"} (optional)
    models_t5_umt5-xxl-enc-bf16.pth        UMT5-XXL encoder state dict in Wan's key names
    google/umt5-xxl/                       its tokenizer files
    Wan2.1_VAE.pth                         the VAE state dict in Wan's key names
    high_noise_model/, low_noise_model/    config.json (WanModel) + sharded safetensors + index

Conversion writes the diffusers layout (model_index.json, text_encoder/, tokenizer/, vae/,
transformer/ = high_noise_model, transformer_2/ = low_noise_model, scheduler/), so everything
downstream runs exactly as with Wan-AI/Wan2.2-T2V-A14B-Diffusers. The DiT and VAE key maps are
diffusers' own converters; our inverses are checked against them on every call. The T5 encoder
has no converter anywhere, so it has its own nine-rule map here. Every converted component is
checked key by key and shape by shape against the diffusers/transformers model it must load into.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import re
import shutil
import time
import uuid
import zipfile
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from distill.errors import DistillError, Stage
from distill.layout import (
    ORIGINAL_COMPONENTS,
    ORIGINAL_REQUIRED,
    missing_components,
    present_entries,
)

if TYPE_CHECKING:  # torch and diffusers cost seconds to import; checks on folders need neither
    import torch

logger = logging.getLogger(__name__)

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


# ---------------------------------------------------------------------------------------------
# Recognising the layout (JSON and file headers only: cheap and import-light)
# ---------------------------------------------------------------------------------------------


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
    from distill.layout import safetensors_problem

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


# ---------------------------------------------------------------------------------------------
# Converting on load: once per checkpoint, shared by every process that asks
# ---------------------------------------------------------------------------------------------


def default_convert_root() -> Path:
    """Where conversions go when the caller names no folder: $WAN_DISTILL_CONVERT_DIR, else the user cache."""
    if os.environ.get(CONVERT_DIR_ENV):
        return Path(os.environ[CONVERT_DIR_ENV]).expanduser()
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return cache / "wan-distill" / "converted"


def ensure_converted(src: str | Path, convert_root: str | Path | None = None) -> Path:
    """The diffusers-layout copy of the original folder `src`, converting it first if needed.

    The copy lives in `convert_root` (default: `default_convert_root()`) under a name keyed by the
    source's fingerprint, so a changed checkpoint is converted again and an unchanged one never is.
    Concurrent callers (all ranks of a torchrun job) wait on a file lock while one converts.
    """
    src = Path(src).absolute()
    problems = original_problems(src)
    if problems:
        raise incomplete_error(src, problems)
    root = Path(convert_root).expanduser().absolute() if convert_root else default_convert_root()
    dst = root / f"{src.name}-diffusers-{source_fingerprint(src)}"
    if not _is_conversion(dst):
        root.mkdir(parents=True, exist_ok=True)
        with _exclusive(root / f".{dst.name}.lock"):
            if not _is_conversion(dst):  # nobody finished it while we waited for the lock
                print(f"{src} holds the ORIGINAL Wan layout: converting it once to {dst}", flush=True)
                # Leftovers of a killed conversion (no marker, or a staging folder) can be tens of
                # GB; holding the lock, nothing else writes under this name.
                for stale in [dst, *root.glob(f".{dst.name}.partial-*")]:
                    shutil.rmtree(stale, ignore_errors=True)
                convert_original(src, dst)
                return dst
    # A log line, not a print: under torchrun every rank passes here.
    logger.info("Using the diffusers-layout conversion of %s at %s", src, dst)
    return dst


@contextlib.contextmanager
def _exclusive(lock_path: Path) -> Iterator[None]:
    """An exclusive advisory lock; where the filesystem has none, the atomic rename still keeps
    the result whole (at worst two processes convert)."""
    with lock_path.open("a") as handle:
        try:
            import fcntl

            fcntl.flock(handle, fcntl.LOCK_EX)
        except (ImportError, OSError):
            pass
        yield


def _is_conversion(folder: Path) -> bool:
    return (folder / MARKER).is_file()


def convert_original(src: str | Path, dst: str | Path) -> Path:
    """Write the diffusers layout of the original folder `src` to `dst` and return `dst`.

    Written to a hidden sibling first and renamed into place, so `dst` is complete or absent.
    A `dst` that already holds this exact conversion is kept; any other non-empty `dst` is refused.
    """
    src, dst = Path(src).absolute(), Path(dst).absolute()
    if (src / "model_index.json").is_file():
        raise DistillError(
            f"{src} is already in the diffusers layout: there is nothing to convert",
            fixes=[
                f"pass it to --teacher_path as it is; check it with python download_wan.py --verify {src}"
            ],
            stage=Stage.TEACHER_LOAD,
        )
    problems = original_problems(src)
    if problems:
        raise incomplete_error(src, problems)
    fingerprint = source_fingerprint(src)
    if dst.is_dir() and any(dst.iterdir()):
        if _is_conversion(dst) and json.loads((dst / MARKER).read_text()).get("fingerprint") == fingerprint:
            print(f"{dst} already holds the conversion of {src}")
            return dst
        raise DistillError(
            f"refusing to convert into {dst}: the folder is not empty",
            f"It contains: {', '.join(present_entries(dst)[:12])}",
            fixes=["pass a new or empty folder as DST", f"or delete {dst} first"],
            stage=Stage.TEACHER_LOAD,
        )
    dst.parent.mkdir(parents=True, exist_ok=True)
    staging = dst.parent / f".{dst.name}.partial-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    staging.mkdir()
    started = time.monotonic()
    try:
        _convert_into(src, staging)
        _write_marker(staging, src, fingerprint, time.monotonic() - started)
        os.replace(staging, dst)
    except BaseException as error:
        shutil.rmtree(staging, ignore_errors=True)
        if isinstance(error, OSError) and _is_conversion(dst):
            return dst  # another process renamed its identical conversion into place first
        if isinstance(error, DistillError | MemoryError | KeyboardInterrupt):
            raise
        raise DistillError(
            f"could not convert the original Wan teacher at {src}",
            f"{type(error).__name__}: {error}",
            causes=[
                "a damaged weight file",
                "a full disk under the destination",
                "an unsupported checkpoint",
            ],
            fixes=[
                f"python download_wan.py --convert {src} <new folder>   # shows which component fails",
                "or download the diffusers layout: python download_wan.py",
            ],
            stage=Stage.TEACHER_LOAD,
        ) from error
    print(
        f"Converted {src} to the diffusers layout at {dst} in {time.monotonic() - started:.1f} s", flush=True
    )
    return dst


def _write_marker(folder: Path, src: Path, fingerprint: str, seconds: float) -> None:
    record = {"source": str(src), "fingerprint": fingerprint, "converter": CONVERTER_VERSION}
    (folder / MARKER).write_text(json.dumps({**record, "seconds": round(seconds, 1)}, indent=2) + "\n")


def _convert_into(src: Path, out: Path) -> None:
    """Every component, the lightest first, so a problem shows before the experts (tens of GB) are read."""
    shutil.copytree(src / TOKENIZER_DIR, out / "tokenizer")
    _write_scheduler(out / "scheduler")
    convert_vae(src / VAE_FILE, out / "vae")
    convert_text_encoder(src / T5_FILE, out / "text_encoder")
    for component, expert in EXPERT_DIRS.items():
        convert_expert(src / expert, out / component)
    _write_model_index(out, _boundary_ratio(src))
    if missing_components(out):
        raise DistillError(
            "the conversion left out " + ", ".join(missing_components(out)), stage=Stage.INTERNAL
        )


def _boundary_ratio(src: Path) -> float:
    path = src / CONFIGURATION_FILE
    config = json.loads(path.read_text()) if path.is_file() else {}
    return float(config.get("boundary_ratio", A14B_BOUNDARY_RATIO))


def _write_scheduler(folder: Path) -> None:
    from diffusers import UniPCMultistepScheduler

    UniPCMultistepScheduler(
        prediction_type="flow_prediction",
        use_flow_sigmas=True,
        flow_shift=FLOW_SHIFT,
        num_train_timesteps=1000,
    ).save_pretrained(folder)


def _write_model_index(folder: Path, boundary_ratio: float) -> None:
    import diffusers

    index = {
        "_class_name": "WanPipeline",
        "_diffusers_version": diffusers.__version__,
        "boundary_ratio": boundary_ratio,
        "expand_timesteps": False,
        "scheduler": ["diffusers", "UniPCMultistepScheduler"],
        "text_encoder": ["transformers", "UMT5EncoderModel"],
        "tokenizer": ["transformers", "T5Tokenizer"],
        "transformer": ["diffusers", "WanTransformer3DModel"],
        "transformer_2": ["diffusers", "WanTransformer3DModel"],
        "vae": ["diffusers", "AutoencoderKLWan"],
    }
    (folder / "model_index.json").write_text(json.dumps(index, indent=2) + "\n")


# ---------------------------------------------------------------------------------------------
# Components, original -> diffusers
# ---------------------------------------------------------------------------------------------


def _load_pth(path: Path) -> dict[str, torch.Tensor]:
    import torch

    # mmap: the 11 GB T5 file is paged in while it is written out, never held twice.
    state = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
    if not isinstance(state, Mapping):
        raise DistillError(f"{path.name} does not hold a state dict", stage=Stage.TEACHER_LOAD)
    return dict(state)


def convert_text_encoder(pth: Path, out: Path) -> None:
    """Wan's T5 encoder .pth -> a transformers UMT5EncoderModel folder, loaded strictly."""
    from transformers import UMT5EncoderModel

    original = _load_pth(pth)
    config = umt5_config_from_original(original)
    model = _on_meta(lambda: UMT5EncoderModel(config))
    state = t5_to_transformers(original)
    tied = {"encoder.embed_tokens.weight"}  # the same tensor as shared.weight
    _check_keys(_shapes(model.state_dict(), skip=tied), _shapes(state), f"{pth.name} (T5 encoder)")
    model.load_state_dict(state, strict=False, assign=True)
    model.tie_weights()
    _save_model(model, out)


def convert_vae(pth: Path, out: Path) -> None:
    """Wan2.1_VAE.pth -> an AutoencoderKLWan folder (diffusers' converter, checked strictly)."""
    from diffusers import AutoencoderKLWan
    from diffusers.loaders.single_file_utils import convert_wan_vae_to_diffusers

    original = _load_pth(pth)
    state = convert_wan_vae_to_diffusers(original)
    config = vae_config_from_original(original)
    model = _on_meta(lambda: AutoencoderKLWan(**config))
    _check_keys(_shapes(model.state_dict()), _shapes(state), f"{pth.name} (VAE)")
    model.load_state_dict(state, strict=True, assign=True)
    _save_model(model, out)


def convert_expert(folder: Path, out: Path) -> None:
    """An original expert folder -> a WanTransformer3DModel folder, one shard at a time.

    diffusers' converter only renames keys, so each shard converts on its own and memory stays at
    one shard (a few GB for A14B) instead of the whole expert (tens of GB).
    """
    from diffusers import WanTransformer3DModel
    from diffusers.loaders.single_file_utils import convert_wan_transformer_to_diffusers
    from safetensors.torch import load_file, save_file

    shards = expert_shards(folder)
    header_shapes = _safetensors_shapes(shards)
    # ComfyUI repacks prefix every key with model.diffusion_model.; the converter strips it.
    plain_shapes = {k.removeprefix("model.diffusion_model."): v for k, v in header_shapes.items()}
    config = expert_config_from_original(_read_json(folder / "config.json"), plain_shapes)
    model = _on_meta(lambda: WanTransformer3DModel(**config))
    renamed = _renamed(convert_wan_transformer_to_diffusers, header_shapes)
    # All names and shapes are checked from the headers before a single tensor is read.
    _check_keys(
        _shapes(model.state_dict()),
        {new: header_shapes[old] for new, old in renamed.items()},
        f"{folder.name}/ (expert)",
    )
    out.mkdir(parents=True)
    names = _shard_names(len(shards))
    weight_map: dict[str, str] = {}
    total = 0
    for shard, name in zip(shards, names):
        tensors = convert_wan_transformer_to_diffusers(load_file(shard))
        save_file(tensors, out / name, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, name))
        total += sum(t.numel() * t.element_size() for t in tensors.values())
        del tensors
    if len(shards) > 1:
        _write_index(out, weight_map, total)
    model.save_config(out)


def _on_meta(build: Callable[[], Any]) -> Any:
    """Build a model without allocating or initialising weights (a 14B init would take minutes)."""
    import torch

    with torch.device("meta"):
        return build()


def _save_model(model: Any, out: Path) -> None:
    leftovers = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if leftovers:
        raise DistillError(f"no weights for {leftovers[:5]} after conversion", stage=Stage.INTERNAL)
    model.save_pretrained(out, safe_serialization=True)


def _read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as error:
        raise DistillError(f"cannot read {path}", str(error), stage=Stage.TEACHER_LOAD) from None


def _safetensors_shapes(files: Iterable[Path]) -> dict[str, tuple[int, ...]]:
    from safetensors import safe_open

    shapes = {}
    for file in files:
        with safe_open(file, framework="pt") as handle:
            for key in handle.keys():  # noqa: SIM118 - safe_open is not a Mapping
                shapes[key] = tuple(handle.get_slice(key).get_shape())
    return shapes


def _shapes(state: Mapping[str, Any], skip: Iterable[str] = ()) -> dict[str, tuple[int, ...]]:
    skip = set(skip)
    return {k: tuple(v.shape) for k, v in state.items() if k not in skip}


def _check_keys(expected: Mapping[str, tuple], got: Mapping[str, tuple], what: str) -> None:
    """Strict loading, with a message: every key present, none extra, every shape right."""
    missing = sorted(set(expected) - set(got))
    unexpected = sorted(set(got) - set(expected))
    wrong = sorted(k for k in set(expected) & set(got) if tuple(expected[k]) != tuple(got[k]))
    if not (missing or unexpected or wrong):
        return
    lines = [f"missing: {', '.join(missing[:8])}" + (" ..." if len(missing) > 8 else "")] if missing else []
    if unexpected:
        lines.append(f"unexpected: {', '.join(unexpected[:8])}" + (" ..." if len(unexpected) > 8 else ""))
    lines += [f"{k}: file {tuple(got[k])}, model {tuple(expected[k])}" for k in wrong[:8]]
    raise DistillError(
        f"{what} does not match the model it converts to",
        "\n".join(lines),
        causes=[
            "a damaged or foreign checkpoint",
            "a Wan variant this converter does not know (I2V, TI2V-5B)",
        ],
        fixes=["re-download the file", "use Wan-AI/Wan2.2-T2V-A14B-Diffusers instead"],
        stage=Stage.TEACHER_LOAD,
    )


def _shard_names(count: int) -> list[str]:
    if count == 1:
        return [f"{WEIGHTS_NAME}.safetensors"]
    return [f"{WEIGHTS_NAME}-{i:05d}-of-{count:05d}.safetensors" for i in range(1, count + 1)]


def _write_index(folder: Path, weight_map: Mapping[str, str], total_size: int) -> None:
    index = {"metadata": {"total_size": total_size}, "weight_map": dict(sorted(weight_map.items()))}
    (folder / f"{WEIGHTS_NAME}.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")


# ---------------------------------------------------------------------------------------------
# Configs: what the weights and the original config.json say, in each library's terms
# ---------------------------------------------------------------------------------------------


def umt5_config_from_original(state: Mapping[str, Any]) -> Any:
    """UMT5Config of Wan's T5 encoder, read from the weight shapes (the .pth carries no config)."""
    from transformers import UMT5Config

    vocab, d_model = state["token_embedding.weight"].shape
    layers = sum(1 for k in state if re.fullmatch(r"blocks\.\d+\.norm1\.weight", k))
    buckets, heads = state["blocks.0.pos_embedding.embedding.weight"].shape
    return UMT5Config(
        vocab_size=vocab,
        d_model=d_model,
        d_kv=state["blocks.0.attn.q.weight"].shape[0] // heads,
        d_ff=state["blocks.0.ffn.fc1.weight"].shape[0],
        num_layers=layers,
        num_decoder_layers=layers,
        num_heads=heads,
        relative_attention_num_buckets=buckets,
        relative_attention_max_distance=T5_MAX_DISTANCE,
        feed_forward_proj="gated-gelu",  # Wan's T5FeedForward: fc1(x) * gelu_tanh(gate(x))
        layer_norm_epsilon=1e-6,
        pad_token_id=0,
        eos_token_id=1,
        decoder_start_token_id=0,
    )


def vae_config_from_original(state: Mapping[str, Any]) -> dict[str, Any]:
    """AutoencoderKLWan arguments: widths from the weights; the block structure is the Wan 2.1
    VAE's (dim_mult [1,2,4,4], 2 res blocks), the only one diffusers' converter maps."""
    return {
        "base_dim": int(state["encoder.conv1.weight"].shape[0]),
        "z_dim": int(state["conv2.weight"].shape[0]),
    }


# WanModel's constructor defaults (wan/modules/model.py), for keys a config.json leaves out.
_WAN_MODEL_DEFAULTS = {
    "model_type": "t2v",
    "text_len": 512,
    "in_dim": 16,
    "dim": 2048,
    "ffn_dim": 8192,
    "freq_dim": 256,
    "out_dim": 16,
    "num_heads": 16,
    "num_layers": 32,
    "eps": 1e-6,
}


def expert_config_from_original(config: Mapping[str, Any], shapes: Mapping[str, tuple]) -> dict[str, Any]:
    """WanTransformer3DModel arguments for an original WanModel config.json.

    WanModel lists patch_size, text_dim, qk_norm, cross_attn_norm and window_size in
    `ignore_for_config`, so they are never in config.json: patch_size and text_dim are read from
    the weights, the norms are always on in WanModel.
    """
    cfg = {**_WAN_MODEL_DEFAULTS, **config}
    if cfg["model_type"] != "t2v":
        raise DistillError(
            f"this expert is a Wan {cfg['model_type']!r} model; only text-to-video (t2v) teachers are supported",
            fixes=["use Wan-AI/Wan2.2-T2V-A14B"],
            stage=Stage.TEACHER_LOAD,
        )
    dim, heads = int(cfg["dim"]), int(cfg["num_heads"])
    return {
        "patch_size": tuple(shapes["patch_embedding.weight"][2:]),
        "num_attention_heads": heads,
        "attention_head_dim": dim // heads,
        "in_channels": int(cfg["in_dim"]),
        "out_channels": int(cfg["out_dim"]),
        "text_dim": int(shapes["text_embedding.0.weight"][1]),
        "freq_dim": int(cfg["freq_dim"]),
        "ffn_dim": int(cfg["ffn_dim"]),
        "num_layers": int(cfg["num_layers"]),
        "cross_attn_norm": True,
        "qk_norm": "rms_norm_across_heads",
        "eps": float(cfg["eps"]),
        "image_dim": None,
        "added_kv_proj_dim": None,
        "rope_max_seq_len": 1024,  # WanModel's rope table length
    }


def original_unsupported(config: Mapping[str, Any]) -> dict[str, Any]:
    """The settings of a WanTransformer3DModel config that WanModel cannot express, with their values.

    WanModel always has q/k RMS norms and a cross-attention norm, no image input, and patch size
    (1, 2, 2): patch_size is not in its config.json, so Wan's code builds (1, 2, 2) and then
    refuses other weights (head.head.bias expected [64]).
    """
    patch = config.get("patch_size")
    unsupported = {
        "qk_norm": (config.get("qk_norm"), "rms_norm_across_heads"),
        "cross_attn_norm": (config.get("cross_attn_norm"), True),
        "image_dim": (config.get("image_dim"), None),
        "added_kv_proj_dim": (config.get("added_kv_proj_dim"), None),
        "pos_embed_seq_len": (config.get("pos_embed_seq_len"), None),
        "patch_size": (tuple(patch) if isinstance(patch, list | tuple) else patch, (1, 2, 2)),
    }
    return {k: have for k, (have, want) in unsupported.items() if have != want}


def check_original_exportable(
    config: Mapping[str, Any], where: str = "this model", stage: Stage = Stage.CHECKPOINT
) -> None:
    """Refuse a model the original Wan format cannot hold (see original_unsupported)."""
    wrong = original_unsupported(config)
    if wrong:
        fixes = ["export it in the diffusers format only (--export_formats diffusers)"]
        if "patch_size" in wrong:
            fixes.append("or use patch_size [1, 2, 2], the only one WanModel builds")
        raise DistillError(
            f"{where} cannot be written in the original Wan format",
            f"WanModel has no equivalent of {wrong}",
            fixes=fixes,
            stage=stage,
        )


def original_expert_config(config: Mapping[str, Any]) -> dict[str, Any]:
    """The original WanModel config.json for a WanTransformer3DModel config, refusing what WanModel
    cannot express."""
    import diffusers

    check_original_exportable(config)
    heads, head_dim = int(config["num_attention_heads"]), int(config["attention_head_dim"])
    return {
        "_class_name": "WanModel",
        "_diffusers_version": diffusers.__version__,
        "model_type": "t2v",
        "text_len": 512,
        "in_dim": int(config["in_channels"]),
        "dim": heads * head_dim,
        "ffn_dim": int(config["ffn_dim"]),
        "freq_dim": int(config["freq_dim"]),
        "out_dim": int(config["out_channels"]),
        "num_heads": heads,
        "num_layers": int(config["num_layers"]),
        "eps": float(config["eps"]),
    }


# ---------------------------------------------------------------------------------------------
# Key maps
# ---------------------------------------------------------------------------------------------

# Wan's T5 encoder (wan/modules/t5.py: T5Encoder with shared_pos=False) <-> transformers'
# UMT5EncoderModel. `{i}` is a block index, `{p}` one of the attention projections. Wan's FFN is
# fc2(fc1(x) * gelu(gate(x))), and UMT5's wo(wi_1(x) * gelu(wi_0(x))): gate -> wi_0, fc1 -> wi_1.
_T5_RULES = (
    ("token_embedding.weight", "shared.weight"),
    ("blocks.{i}.norm1.weight", "encoder.block.{i}.layer.0.layer_norm.weight"),
    ("blocks.{i}.attn.{p}.weight", "encoder.block.{i}.layer.0.SelfAttention.{p}.weight"),
    (
        "blocks.{i}.pos_embedding.embedding.weight",
        "encoder.block.{i}.layer.0.SelfAttention.relative_attention_bias.weight",
    ),
    ("blocks.{i}.norm2.weight", "encoder.block.{i}.layer.1.layer_norm.weight"),
    ("blocks.{i}.ffn.gate.0.weight", "encoder.block.{i}.layer.1.DenseReluDense.wi_0.weight"),
    ("blocks.{i}.ffn.fc1.weight", "encoder.block.{i}.layer.1.DenseReluDense.wi_1.weight"),
    ("blocks.{i}.ffn.fc2.weight", "encoder.block.{i}.layer.1.DenseReluDense.wo.weight"),
    ("norm.weight", "encoder.final_layer_norm.weight"),
)


def _template_regex(template: str) -> re.Pattern[str]:
    pattern = re.escape(template).replace(r"\{i\}", r"(?P<i>\d+)").replace(r"\{p\}", r"(?P<p>[qkvo])")
    return re.compile(pattern)


_T5_FORWARD = [(_template_regex(a), b) for a, b in _T5_RULES]
_T5_BACKWARD = [(_template_regex(b), a) for a, b in _T5_RULES]


def _rename_by_rules(state: Mapping[str, Any], rules: list[tuple[re.Pattern[str], str]], what: str) -> dict:
    out, unknown = {}, []
    for key, value in state.items():
        for pattern, template in rules:
            if match := pattern.fullmatch(key):
                out[template.format(**match.groupdict())] = value
                break
        else:
            unknown.append(key)
    if unknown:
        raise DistillError(f"{what}: keys no rule maps", ", ".join(unknown[:8]), stage=Stage.TEACHER_LOAD)
    return out


def t5_to_transformers(state: Mapping[str, Any]) -> dict[str, Any]:
    """Wan T5 encoder keys -> UMT5EncoderModel keys (encoder.embed_tokens is tied to shared.weight)."""
    return _rename_by_rules(state, _T5_FORWARD, "the T5 encoder checkpoint")


def t5_to_original(state: Mapping[str, Any]) -> dict[str, Any]:
    """UMT5EncoderModel keys -> Wan's T5 encoder keys (the tied embed_tokens copy is dropped)."""
    state = {k: v for k, v in state.items() if k != "encoder.embed_tokens.weight"}
    return _rename_by_rules(state, _T5_BACKWARD, "the UMT5 encoder")


# The inverse of diffusers' convert_wan_transformer_to_diffusers for text-to-video models.
_TRANSFORMER_TO_ORIGINAL = [
    (re.compile(a), b)
    for a, b in (
        (r"^condition_embedder\.time_embedder\.linear_1\.", "time_embedding.0."),
        (r"^condition_embedder\.time_embedder\.linear_2\.", "time_embedding.2."),
        (r"^condition_embedder\.text_embedder\.linear_1\.", "text_embedding.0."),
        (r"^condition_embedder\.text_embedder\.linear_2\.", "text_embedding.2."),
        (r"^condition_embedder\.time_proj\.", "time_projection.1."),
        (r"^scale_shift_table$", "head.modulation"),
        (r"^proj_out\.", "head.head."),
        (r"^(blocks\.\d+)\.scale_shift_table$", r"\1.modulation"),
        (r"^(blocks\.\d+)\.attn1\.", r"\1.self_attn."),
        (r"^(blocks\.\d+)\.attn2\.", r"\1.cross_attn."),
        (r"\.to_q\.", ".q."),
        (r"\.to_k\.", ".k."),
        (r"\.to_v\.", ".v."),
        (r"\.to_out\.0\.", ".o."),
        # diffusers' norm2 is the cross-attention norm, WanModel's norm3 (its norm2 has no weights).
        (r"^(blocks\.\d+)\.norm2\.", r"\1.norm3."),
        (r"^(blocks\.\d+)\.ffn\.net\.0\.proj\.", r"\1.ffn.0."),
        (r"^(blocks\.\d+)\.ffn\.net\.2\.", r"\1.ffn.2."),
    )
]


def transformer_to_original(state: Mapping[str, Any]) -> dict[str, Any]:
    """WanTransformer3DModel keys -> WanModel keys, verified against diffusers' own converter."""
    from diffusers.loaders.single_file_utils import convert_wan_transformer_to_diffusers

    names = {}
    for key in state:
        new = key
        for pattern, replacement in _TRANSFORMER_TO_ORIGINAL:
            new = pattern.sub(replacement, new)
        names[key] = new
    _check_round_trip(names, convert_wan_transformer_to_diffusers, "transformer")
    return {names[k]: v for k, v in state.items()}


def vae_to_original(state: Mapping[str, Any], num_res_blocks: int = 2) -> dict[str, Any]:
    """AutoencoderKLWan keys -> Wan VAE keys, verified against diffusers' own converter (which only
    knows the real block structure: dim_mult [1,2,4,4], 2 res blocks)."""
    from diffusers.loaders.single_file_utils import convert_wan_vae_to_diffusers

    names = {key: _vae_key_to_original(key, num_res_blocks) for key in state}
    _check_round_trip(names, convert_wan_vae_to_diffusers, "VAE")
    return {names[k]: v for k, v in state.items()}


_VAE_RESIDUAL = {
    "norm1.": "residual.0.",
    "conv1.": "residual.2.",
    "norm2.": "residual.3.",
    "conv2.": "residual.6.",
    "conv_shortcut.": "shortcut.",
}


def _vae_residual(rest: str) -> str:
    for new, old in _VAE_RESIDUAL.items():
        if rest.startswith(new):
            return old + rest[len(new) :]
    return rest  # resample.* and time_conv.* keep their names


def _vae_key_to_original(key: str, num_res_blocks: int) -> str:
    renames = {"quant_conv.": "conv1.", "post_quant_conv.": "conv2."}
    for new, old in renames.items():
        if key.startswith(new):
            return old + key[len(new) :]
    side, rest = key.split(".", 1)
    for new, old in (("conv_in.", "conv1."), ("norm_out.", "head.0."), ("conv_out.", "head.2.")):
        if rest.startswith(new):
            return f"{side}.{old}{rest[len(new) :]}"
    if match := re.match(r"mid_block\.resnets\.(\d)\.(.*)", rest):
        return f"{side}.middle.{2 * int(match[1])}.{_vae_residual(match[2])}"
    if match := re.match(r"mid_block\.attentions\.0\.(.*)", rest):
        return f"{side}.middle.1.{match[1]}"
    if match := re.match(r"down_blocks\.(\d+)\.(.*)", rest):
        return f"{side}.downsamples.{match[1]}.{_vae_residual(match[2])}"
    # The original decoder is one flat list: per stage num_res_blocks+1 res blocks, then the upsampler.
    stride = num_res_blocks + 2
    if match := re.match(r"up_blocks\.(\d+)\.resnets\.(\d+)\.(.*)", rest):
        return f"{side}.upsamples.{int(match[1]) * stride + int(match[2])}.{_vae_residual(match[3])}"
    if match := re.match(r"up_blocks\.(\d+)\.upsamplers\.0\.(.*)", rest):
        return f"{side}.upsamples.{int(match[1]) * stride + stride - 1}.{match[2]}"
    return key


def _renamed(converter: Callable[[dict], dict], keys: Iterable[str]) -> dict[str, str]:
    """What a diffusers converter renames each key to, without touching any tensor: the
    text-to-video converters only move values between keys, so the values can be the old names."""
    return dict(converter({k: k for k in keys}))


def _check_round_trip(names: Mapping[str, str], converter: Callable[[dict], dict], what: str) -> None:
    back = _renamed(converter, names.values())
    wrong = [k for k, new in names.items() if back.get(k) != new]
    if wrong or len(back) != len(names):
        raise DistillError(
            f"the {what} cannot be written in the original Wan format",
            "diffusers' converter would not read these keys back: " + ", ".join(wrong[:8]),
            causes=["a block structure the original format (and diffusers' converter) does not have"],
            stage=Stage.CHECKPOINT,
        )


# ---------------------------------------------------------------------------------------------
# Writing the original layout (tiny teacher) and exporting a student in the original format
# ---------------------------------------------------------------------------------------------


def save_original_layout(pipe: Any, folder: Path, boundary_ratio: float, shards_per_expert: int = 2) -> None:
    """Write an in-memory WanPipeline (tokenizer, T5, VAE, two experts) in the original layout."""
    import torch

    config: dict[str, Any] = {"framework": "Pytorch", "task": "text-to-video"}
    if boundary_ratio != A14B_BOUNDARY_RATIO:
        config["boundary_ratio"] = boundary_ratio  # the release relies on Wan's code for 0.875
    (folder / CONFIGURATION_FILE).write_text(json.dumps(config, indent=2) + "\n")
    pipe.tokenizer.save_pretrained(folder / TOKENIZER_DIR)
    torch.save(_plain(t5_to_original(pipe.text_encoder.state_dict())), folder / T5_FILE)
    vae_blocks = int(pipe.vae.config.num_res_blocks)
    torch.save(_plain(vae_to_original(pipe.vae.state_dict(), vae_blocks)), folder / VAE_FILE)
    for component, name in EXPERT_DIRS.items():
        expert = getattr(pipe, component)
        out = folder / name
        out.mkdir()
        (out / "config.json").write_text(json.dumps(original_expert_config(expert.config), indent=2) + "\n")
        _save_sharded(transformer_to_original(expert.state_dict()), out, shards_per_expert)


def _plain(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.detach().cpu().contiguous() for k, v in state.items()}


def _save_sharded(state: Mapping[str, torch.Tensor], folder: Path, count: int) -> None:
    """Split the tensors, in order, into `count` files of about equal size, plus the index."""
    from safetensors.torch import save_file

    state = _plain(state)
    total = sum(t.numel() * t.element_size() for t in state.values())
    names = _shard_names(count)
    groups: list[dict[str, torch.Tensor]] = [{} for _ in names]
    seen = 0
    for key, tensor in state.items():
        groups[min(count - 1, seen * count // max(total, 1))][key] = tensor
        seen += tensor.numel() * tensor.element_size()
    for name, group in zip(names, groups):
        save_file(group, folder / name, metadata={"format": "pt"})
    if count > 1:
        _write_index(folder, {k: n for n, g in zip(names, groups) for k in g}, total)


def export_original(student: Any, out_file: str | Path) -> Path:
    """Write a student (a WanTransformer3DModel or its diffusers folder) as ONE safetensors file
    with the original Wan key names, the format Wan's own code and ComfyUI load. The original
    config.json rides along in the file's metadata. Written aside, then renamed into place.

    Reload with diffusers: WanTransformer3DModel.from_single_file(out_file, config=<student folder>).
    """
    from safetensors.torch import save_file

    config, state = _student_weights(student)
    metadata = {"format": "pt", "config": json.dumps(original_expert_config(config))}
    tensors = _plain(transformer_to_original(state))
    out_file = Path(out_file)
    out_file.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_file.with_name(f".{out_file.name}.tmp-{os.getpid()}")
    try:
        save_file(tensors, tmp, metadata=metadata)
        with tmp.open("rb") as handle:
            os.fsync(handle.fileno())
        os.replace(tmp, out_file)
    except OSError as error:
        tmp.unlink(missing_ok=True)
        raise DistillError(
            "Cannot export the student in the original Wan format",
            f"{out_file}: {error}",
            causes=["The disk is full or the folder is not writable."],
            stage=Stage.CHECKPOINT,
        ) from error
    return out_file


def _student_weights(student: Any) -> tuple[Mapping[str, Any], Mapping[str, torch.Tensor]]:
    """(config, state dict) of a model or of a diffusers model folder."""
    if isinstance(student, str | Path):
        from safetensors.torch import load_file

        folder = Path(student)
        files = expert_shards(folder)
        if not files or not (folder / "config.json").is_file():
            raise DistillError(
                f"{folder} is not a diffusers model folder (config.json + *.safetensors)",
                stage=Stage.CHECKPOINT,
            )
        state = {k: v for f in files for k, v in load_file(f).items()}
        return _read_json(folder / "config.json"), state
    from distill.student import unwrap_model

    model = unwrap_model(student)
    if any(type(p).__name__ == "DTensor" for p in model.parameters()):
        raise DistillError(
            "Cannot export a sharded (FSDP) student directly",
            "Export the gathered full model, or pass the exported student/ folder.",
            stage=Stage.INTERNAL,
        )
    return model.config, model.state_dict()
