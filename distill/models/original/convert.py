"""Converting an original-layout Wan 2.2 folder into the diffusers layout, once, into a cache that
later runs reuse (`ensure_converted`), or into a folder of the user's choice (`convert_original`);
every component is checked key by key and shape by shape against the model it must load into."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from distill.models.layout import (
    diffusers_components,
    missing_components,
    present_entries,
)
from distill.models.original.configs import (
    convertible_kind,
    expert_config_from_original,
    umt5_config_from_original,
    vae22_config_from_original,
    vae_config_from_original,
)
from distill.models.original.detect import (
    A14B_BOUNDARY_RATIO,
    CONFIGURATION_FILE,
    CONVERT_DIR_ENV,
    CONVERTER_VERSION,
    FLOW_SHIFT,
    FLOW_SHIFTS,
    MARKER,
    MODEL_CONFIG,
    ONE_MODEL,
    T5_FILE,
    TOKENIZER_DIR,
    WEIGHTS_NAME,
    expert_shards,
    incomplete_error,
    model_folder,
    model_shards,
    original_layout,
    original_problems,
    source_fingerprint,
)
from distill.models.original.keymaps import renamed_keys, t5_to_transformers, vae22_to_diffusers
from distill.models.teacher_kind import T2V_A14B, TI2V_5B, TeacherKind, folder_kind
from distill.ops.errors import DistillError, Stage

if TYPE_CHECKING:  # torch and diffusers cost seconds to import; checks on folders need neither
    import torch

logger = logging.getLogger(__name__)


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
        raise _incomplete(src, problems)
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


def _incomplete(src: Path, problems: list[str]) -> DistillError:
    """The missing parts of `src`, with the release and the download of the model its config names
    (the I2V teacher has the T2V one's shape); where none says, the model of that shape."""
    kind = folder_kind(src) or (TI2V_5B if original_layout(src) is ONE_MODEL else T2V_A14B)
    return incomplete_error(src, problems, kind.repo_id.removesuffix("-Diffusers"), kind.download_command())


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
    kind = convertible_kind(src)  # from its config.json, before tens of GB are read
    problems = original_problems(src)
    if problems:
        raise _incomplete(src, problems)
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
        _convert_into(src, staging, kind)
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
                f"or download the diffusers layout: {kind.download_command()}",
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


def _convert_into(src: Path, out: Path, kind: TeacherKind = T2V_A14B) -> None:
    """Every component, the lightest first, so a problem shows before the transformers (tens of GB)
    are read."""
    layout = original_layout(src)
    config = _configuration(src)
    shutil.copytree(src / TOKENIZER_DIR, out / "tokenizer")
    # The release leaves its sampler's shift to Wan's Python config; a configuration.json may name
    # it (the tiny teachers do, to equal their diffusers twins).
    flow_shift = float(config.get("flow_shift", FLOW_SHIFTS.get(kind.original_model_type, FLOW_SHIFT)))
    _write_scheduler(out / "scheduler", flow_shift)
    if layout is ONE_MODEL:
        statistics = {k: config[f"vae_{k}"] for k in ("latents_mean", "latents_std") if f"vae_{k}" in config}
        convert_vae22(src / layout.vae_file, out / "vae", statistics)
    else:
        convert_vae(src / layout.vae_file, out / "vae")
    convert_text_encoder(src / T5_FILE, out / "text_encoder")
    for component in layout.models:
        convert_expert(
            model_folder(src, layout, component), out / component, model_shards(src, layout, component)
        )
    _write_model_index(out, _boundary_ratio(config, kind), kind)
    missing = missing_components(out, diffusers_components(kind.experts))
    if missing:
        raise DistillError("the conversion left out " + ", ".join(missing), stage=Stage.INTERNAL)


def _configuration(src: Path) -> dict[str, Any]:
    path = src / CONFIGURATION_FILE
    return read_json(path) if path.is_file() else {}


def _boundary_ratio(config: Mapping[str, Any], kind: TeacherKind = T2V_A14B) -> float | None:
    if kind.experts == 1:
        return None  # one transformer runs at every timestep
    # The release leaves the model's own switch to Wan's Python config (0.875 T2V, 0.9 I2V).
    return float(config.get("boundary_ratio", kind.boundary_ratio or A14B_BOUNDARY_RATIO))


def _write_scheduler(folder: Path, flow_shift: float = FLOW_SHIFT) -> None:
    from diffusers import UniPCMultistepScheduler

    UniPCMultistepScheduler(
        prediction_type="flow_prediction",
        use_flow_sigmas=True,
        flow_shift=flow_shift,
        num_train_timesteps=1000,
    ).save_pretrained(folder)


def _write_model_index(folder: Path, boundary_ratio: float | None, kind: TeacherKind = T2V_A14B) -> None:
    import diffusers

    two = kind.experts == 2
    index: dict[str, Any] = {
        "_class_name": kind.pipeline_class,
        "_diffusers_version": diffusers.__version__,
        "boundary_ratio": boundary_ratio,
        # TI2V-5B: a timestep per latent token, the first frame's at 0 in image mode.
        "expand_timesteps": kind.per_token_timesteps,
        "scheduler": ["diffusers", "UniPCMultistepScheduler"],
        "text_encoder": ["transformers", "UMT5EncoderModel"],
        "tokenizer": ["transformers", "T5Tokenizer"],
        "transformer": ["diffusers", "WanTransformer3DModel"],
        # As WanPipeline.save_pretrained writes a pipeline without its second transformer.
        "transformer_2": ["diffusers", "WanTransformer3DModel"] if two else [None, None],
        "vae": ["diffusers", "AutoencoderKLWan"],
    }
    # The pipeline's other optional components are left out, as its hub repository saves them
    # (WanImageToVideoPipeline: image_encoder and image_processor, which Wan2.2-I2V has none of).
    optional = getattr(diffusers, kind.pipeline_class)._optional_components
    index.update({name: [None, None] for name in optional if name not in index})
    (folder / "model_index.json").write_text(json.dumps(dict(sorted(index.items())), indent=2) + "\n")


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


def convert_vae22(pth: Path, out: Path, statistics: Mapping[str, list[float]] | None = None) -> None:
    """Wan2.2_VAE.pth -> an AutoencoderKLWan folder of the Wan2.2 VAE (our key map, checked strictly).
    `statistics` (latents_mean / latents_std) replace Wan's published ones (a tiny random VAE's)."""
    from diffusers import AutoencoderKLWan

    original = _load_pth(pth)
    state = vae22_to_diffusers(original)
    config = {**vae22_config_from_original(original), **(statistics or {})}
    model = _on_meta(lambda: AutoencoderKLWan(**config))
    _check_keys(_shapes(model.state_dict()), _shapes(state), f"{pth.name} (Wan2.2 VAE)")
    model.load_state_dict(state, strict=True, assign=True)
    _save_model(model, out)


def convert_expert(folder: Path, out: Path, shards: list[Path] | None = None) -> None:
    """An original WanModel folder (an A14B expert, or the top of a TI2V-5B release, whose `shards`
    the caller names) -> a WanTransformer3DModel folder, one shard at a time.

    diffusers' converter only renames keys, so each shard converts on its own and memory stays at
    one shard (a few GB for A14B) instead of the whole expert (tens of GB).
    """
    from diffusers import WanTransformer3DModel
    from diffusers.loaders.single_file_utils import convert_wan_transformer_to_diffusers
    from safetensors.torch import load_file, save_file

    shards = shards if shards is not None else expert_shards(folder)
    header_shapes = _safetensors_shapes(shards)
    # ComfyUI repacks prefix every key with model.diffusion_model.; the converter strips it.
    plain_shapes = {k.removeprefix("model.diffusion_model."): v for k, v in header_shapes.items()}
    config = expert_config_from_original(read_json(folder / MODEL_CONFIG), plain_shapes)
    model = _on_meta(lambda: WanTransformer3DModel(**config))
    renamed = renamed_keys(convert_wan_transformer_to_diffusers, header_shapes)
    # All names and shapes are checked from the headers before a single tensor is read.
    _check_keys(
        _shapes(model.state_dict()),
        {new: header_shapes[old] for new, old in renamed.items()},
        f"{folder.name}/ (WanModel)",
    )
    out.mkdir(parents=True)
    names = shard_names(len(shards))
    weight_map: dict[str, str] = {}
    total = 0
    for shard, name in zip(shards, names):
        tensors = convert_wan_transformer_to_diffusers(load_file(shard))
        save_file(tensors, out / name, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, name))
        total += sum(t.numel() * t.element_size() for t in tensors.values())
        del tensors
    if len(shards) > 1:
        write_index(out, weight_map, total)
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


def read_json(path: Path) -> dict[str, Any]:
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
            "a Wan variant this converter does not know (S2V, Animate)",
        ],
        fixes=["re-download the file", "or download the model's diffusers layout instead"],
        stage=Stage.TEACHER_LOAD,
    )


def shard_names(count: int) -> list[str]:
    if count == 1:
        return [f"{WEIGHTS_NAME}.safetensors"]
    return [f"{WEIGHTS_NAME}-{i:05d}-of-{count:05d}.safetensors" for i in range(1, count + 1)]


def write_index(folder: Path, weight_map: Mapping[str, str], total_size: int) -> None:
    index = {"metadata": {"total_size": total_size}, "weight_map": dict(sorted(weight_map.items()))}
    (folder / f"{WEIGHTS_NAME}.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
