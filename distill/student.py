"""The student: a diffusers `WanTransformer3DModel` with a smaller config.

Keeping the student in the teacher's own model class means the exported folder runs in
`WanPipeline` (and anything else that reads the diffusers format) with no glue, and that the
student shares the teacher's latent space, text space, patch grid and RoPE layout by
construction. This module builds it from a JSON config (checked against the teacher before any
weights are touched), initialises it (random, from the teacher's blocks, or from a pretrained
checkpoint such as Wan2.1-T2V-1.3B) and exports it atomically.

diffusers (seconds to import) is imported on first use, so importing this module stays cheap.
"""

from __future__ import annotations

import difflib
import functools
import inspect
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from distill.errors import DistillError, Stage

if TYPE_CHECKING:
    from diffusers import WanTransformer3DModel

logger = logging.getLogger(__name__)

# Keys the student must share with the teacher expert; when a student config omits them they are
# inherited from the teacher rather than from diffusers' defaults (which describe the 14B model).
TEACHER_SHARED_KEYS = (
    "in_channels",
    "out_channels",
    "text_dim",
    "patch_size",
    "freq_dim",
    "qk_norm",
    "cross_attn_norm",
    "eps",
    "rope_max_seq_len",
)

# Of those, the ones that must be EQUAL: the student denoises the teacher's VAE latents, reads the
# teacher's UMT5 prompt embeddings, and is sampled by WanPipeline with the same VAE. The others
# may differ (only a warning), e.g. a larger rope_max_seq_len is harmless.
TEACHER_EQUAL_KEYS = ("in_channels", "out_channels", "text_dim", "patch_size")

# The origin project's (WanDistiller's WanLiteStudent) keys, translated to diffusers keys.
ORIGIN_TRANSLATED_KEYS = (
    "hidden_size",
    "depth",
    "num_heads",
    "num_channels",
    "text_encoder_output_dim",
    "mlp_ratio",
)

# Origin keys with no meaning for a WanTransformer3DModel, and why.
ORIGIN_IGNORED_KEYS = {
    "model_type": "the student is always a WanTransformer3DModel",
    "image_size": "resolution is a training setting (--height/--width), not part of the model",
    "text_max_length": "the prompt length is the text encoder's (--max_sequence_length)",
    "projection_factor": "the origin's weight projection is replaced by init_student_from_teacher",
}

# When a config sets the width the origin's way (`hidden_size`) and says nothing about the MLP
# width, use the usual DiT ratio of 4 rather than diffusers' default ffn_dim (13824, sized for
# the 5120-wide 14B model). Wan's own ratios are 5.83 (1.3B) and 2.7 (14B).
ORIGIN_DEFAULT_MLP_RATIO = 4

# Tensors whose dimensions live in a space fixed by a config key other than the model width
# (sinusoid features, image-encoder features): when that key differs between teacher and student,
# slicing would pair unrelated features, so these stay at their initial values instead.
_EXTERNAL_SPACE_TENSORS = {
    "freq_dim": ("condition_embedder.time_embedder.linear_1.weight",),
    "image_dim": ("condition_embedder.image_embedder.",),
    "pos_embed_seq_len": ("condition_embedder.image_embedder.pos_embed",),
    "added_kv_proj_dim": (".add_k_proj.weight", ".add_v_proj.weight"),
}

# `time_proj` maps the model width to 6 modulation vectors laid out as (6, width) and unflattened
# that way in the forward pass, so narrowing must slice each of the 6 chunks, not the first rows.
_SIX_CHUNK_TENSORS = ("condition_embedder.time_proj.weight", "condition_embedder.time_proj.bias")

_POSITIVE_INT_KEYS = (
    "num_attention_heads",
    "attention_head_dim",
    "in_channels",
    "text_dim",
    "freq_dim",
    "ffn_dim",
    "num_layers",
    "rope_max_seq_len",
)
_OPTIONAL_POSITIVE_INT_KEYS = ("out_channels", "image_dim", "added_kv_proj_dim", "pos_embed_seq_len")


def _wan_class() -> type[WanTransformer3DModel]:
    from diffusers import WanTransformer3DModel

    return WanTransformer3DModel


@functools.lru_cache(maxsize=1)
def _constructor_defaults() -> dict[str, Any]:
    """WanTransformer3DModel's constructor keys and defaults, read from the installed diffusers."""
    parameters = inspect.signature(_wan_class().__init__).parameters
    return {
        name: p.default
        for name, p in parameters.items()
        if name != "self" and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
    }


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _as_patch(value: Any) -> tuple[int, ...] | Any:
    """(1, p, p) for the origin's int patch size, a tuple for a JSON list; anything else as is."""
    if _is_int(value):
        return (1, value, value)
    if isinstance(value, (list, tuple)):
        return tuple(value)
    return value


# ----------------------------------------------------------------------------------------------
# Config
# ----------------------------------------------------------------------------------------------


def _resolve_config_file(path: Path) -> Path:
    """The JSON file behind `path`; a model folder (or a pipeline folder) stands for its config."""
    if path.is_dir():
        for candidate in (path / "config.json", path / "transformer" / "config.json"):
            if candidate.is_file():
                return candidate
        raise DistillError(
            "Student config folder has no config.json",
            f"{path} is a folder without config.json or transformer/config.json.",
            fixes=["Pass a JSON file, e.g. --student_config config/student_config.json."],
            stage=Stage.CONFIG,
        )
    if not path.is_file():
        raise DistillError(
            "Student config file not found",
            f"No file at {path} (resolved: {path.resolve()}).",
            causes=["A typo in the path, or a path relative to another working directory."],
            fixes=[
                "Use one of the shipped configs: config/student_config.json (Wan2.1-1.3B shape) "
                "or config/student_tiny.json (tests).",
            ],
            stage=Stage.CONFIG,
        )
    return path


def _read_json_object(path: Path) -> dict[str, Any]:
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        raise DistillError("Cannot read the student config", f"{path}: {err}", stage=Stage.CONFIG) from err
    try:
        data = json.loads(text)
    except json.JSONDecodeError as err:
        lines = text.splitlines()
        shown = lines[err.lineno - 1] if 0 < err.lineno <= len(lines) else ""
        raise DistillError(
            "Student config is not valid JSON",
            f"{path}, line {err.lineno}, column {err.colno}: {err.msg}\n"
            f"    {shown}\n    {' ' * (err.colno - 1)}^",
            causes=[
                "A trailing comma, a comment, single quotes or a missing comma (JSON allows none of these)."
            ],
            fixes=[f"Fix line {err.lineno} of {path}."],
            stage=Stage.CONFIG,
        ) from err
    if not isinstance(data, dict):
        raise DistillError(
            "Student config must be a JSON object",
            f'{path} holds a {type(data).__name__}, expected {{"key": value, ...}}.',
            stage=Stage.CONFIG,
        )
    return data


def _check_unknown_keys(data: Mapping[str, Any], path: Path) -> None:
    known = [*_constructor_defaults(), *ORIGIN_TRANSLATED_KEYS, *ORIGIN_IGNORED_KEYS]
    unknown = [key for key in data if key not in known]
    if not unknown:
        return
    lines = []
    for key in unknown:
        close = difflib.get_close_matches(key, known, n=1, cutoff=0.6)
        lines.append(f"`{key}`" + (f" (did you mean `{close[0]}`?)" if close else ""))
    raise DistillError(
        "Unknown key in the student config",
        f"{path}: " + ", ".join(lines) + "\nValid keys: " + ", ".join(_constructor_defaults()) + ".",
        fixes=[f"Rename or delete {'it' if len(unknown) == 1 else 'them'} in {path}."],
        stage=Stage.CONFIG,
    )


def _translate(data: Mapping[str, Any], path: Path) -> tuple[dict[str, Any], dict[str, str]]:
    """Diffusers keys from the file's keys; also which file key set each value (for messages)."""
    values: dict[str, Any] = {}
    source: dict[str, str] = {}

    def put(key: str, value: Any, file_key: str) -> None:
        if key in values and values[key] != value:
            raise DistillError(
                "Contradictory keys in the student config",
                f"{path}: `{source[key]}` gives {key} = {values[key]!r} but `{file_key}` gives {value!r}.",
                fixes=[f"Keep only one of `{source[key]}` and `{file_key}`."],
                stage=Stage.CONFIG,
            )
        values[key] = value
        source.setdefault(key, file_key)

    for key, value in data.items():
        if key in _constructor_defaults():
            put(key, _as_patch(value) if key == "patch_size" else value, key)

    ignored = [key for key in data if key in ORIGIN_IGNORED_KEYS]
    if ignored:
        logger.warning(
            "%s: ignoring origin-project keys with no meaning for a WanTransformer3DModel: %s",
            path,
            "; ".join(f"{key} ({ORIGIN_IGNORED_KEYS[key]})" for key in ignored),
        )

    renames = {
        "depth": "num_layers",
        "num_heads": "num_attention_heads",
        "text_encoder_output_dim": "text_dim",
    }
    for old, new in renames.items():
        if old in data:
            put(new, data[old], old)
    if "num_channels" in data:
        put("in_channels", data["num_channels"], "num_channels")
        put("out_channels", data["num_channels"], "num_channels")

    def positive_int(key: str) -> int:
        value = data[key]
        if not _is_int(value) or value <= 0:
            raise DistillError(
                "Invalid value in the student config",
                f"{path}: `{key}` = {value!r}; it must be a positive integer.",
                stage=Stage.CONFIG,
            )
        return value

    if "hidden_size" in data:
        hidden = positive_int("hidden_size")
        heads = values.get("num_attention_heads")
        head_dim = values.get("attention_head_dim")
        if _is_int(heads) and heads > 0:
            if hidden % heads:
                raise DistillError(
                    "hidden_size is not divisible by the number of heads",
                    f"{path}: `hidden_size` = {hidden} and `{source['num_attention_heads']}` = {heads}: "
                    f"{hidden} / {heads} is not a whole head width.",
                    fixes=[
                        f"Pick a hidden_size that is a multiple of {heads} (e.g. {heads * 128} for "
                        "Wan's 128-wide heads), or change the number of heads."
                    ],
                    stage=Stage.CONFIG,
                )
            put("attention_head_dim", hidden // heads, "hidden_size")
        elif _is_int(head_dim) and head_dim > 0 and heads is None:
            if hidden % head_dim:
                raise DistillError(
                    "hidden_size is not divisible by attention_head_dim",
                    f"{path}: `hidden_size` = {hidden}, `attention_head_dim` = {head_dim}.",
                    stage=Stage.CONFIG,
                )
            put("num_attention_heads", hidden // head_dim, "hidden_size")
        elif heads is None:
            raise DistillError(
                "hidden_size needs a number of heads",
                f"{path}: `hidden_size` = {hidden} but neither `num_heads` nor `attention_head_dim` is set.",
                fixes=[f'Add "num_heads": {max(1, hidden // 128)} (Wan uses 128-wide heads).'],
                stage=Stage.CONFIG,
            )

    if "mlp_ratio" in data or ("hidden_size" in data and "ffn_dim" not in data):
        ratio = data.get("mlp_ratio", ORIGIN_DEFAULT_MLP_RATIO)
        if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or ratio <= 0:
            raise DistillError(
                "Invalid value in the student config",
                f"{path}: `mlp_ratio` = {ratio!r}; it must be a positive number.",
                stage=Stage.CONFIG,
            )
        heads = values.get("num_attention_heads", _constructor_defaults()["num_attention_heads"])
        head_dim = values.get("attention_head_dim", _constructor_defaults()["attention_head_dim"])
        if _is_int(heads) and _is_int(head_dim):
            put(
                "ffn_dim",
                max(1, round(heads * head_dim * ratio)),
                "mlp_ratio" if "mlp_ratio" in data else "hidden_size",
            )
    return values, source


def _validation_problems(values: Mapping[str, Any], source: Mapping[str, str]) -> list[str]:
    """Type and range problems, one line each naming the key as written, the value and what is allowed."""

    def name(key: str) -> str:
        file_key = source.get(key, key)
        return f"`{key}`" if file_key == key else f"`{file_key}` (-> {key})"

    problems = []
    for key in _POSITIVE_INT_KEYS:
        if key in values and (not _is_int(values[key]) or values[key] <= 0):
            problems.append(f"{name(key)} = {values[key]!r}; it must be a positive integer")
    for key in _OPTIONAL_POSITIVE_INT_KEYS:
        value = values.get(key)
        if value is not None and (not _is_int(value) or value <= 0):
            problems.append(f"{name(key)} = {value!r}; it must be a positive integer or null")
    head_dim = values.get("attention_head_dim")
    if _is_int(head_dim) and head_dim > 0 and head_dim % 2:
        # RoPE rotates channel pairs; diffusers fails with a bare AssertionError on an odd width.
        problems.append(
            f"{name('attention_head_dim')} = {head_dim}; RoPE needs an even head width (Wan uses 128)"
        )
    if "patch_size" in values:
        patch = values["patch_size"]
        if not (isinstance(patch, tuple) and len(patch) == 3 and all(_is_int(p) and p > 0 for p in patch)):
            problems.append(
                f"`patch_size` = {_json_repr(patch)}; it must be [t, h, w] positive integers (or an int p)"
            )
    eps = values.get("eps", 1.0)
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or eps <= 0:
        problems.append(f"`eps` = {eps!r}; it must be a positive number")
    if "cross_attn_norm" in values and not isinstance(values["cross_attn_norm"], bool):
        problems.append(f"`cross_attn_norm` = {values['cross_attn_norm']!r}; it must be true or false")
    if "qk_norm" in values and not (values["qk_norm"] is None or isinstance(values["qk_norm"], str)):
        problems.append(f"`qk_norm` = {values['qk_norm']!r}; it must be a string or null")
    return problems


def _shared_value(config: Mapping[str, Any], key: str) -> Any:
    """`config[key]` as the model sees it (default filled in, patch as a tuple, null out_channels)."""
    defaults = _constructor_defaults()
    value = config.get(key, defaults[key])
    if key == "out_channels" and value is None:
        # WanTransformer3DModel treats a null out_channels as in_channels.
        value = config.get("in_channels", defaults["in_channels"])
    return _as_patch(value) if key == "patch_size" else value


# What it means when a student differs from the teacher in a shared key that need not be equal.
_SHARED_KEY_CONSEQUENCES = {
    "freq_dim": "the teacher's time-embedding input layer cannot be copied by init_student_from_teacher",
    "qk_norm": "note that diffusers' WanTransformer3DModel ignores this key (it always uses RMS norm "
    "across heads)",
    "cross_attn_norm": "the teacher's cross-attention norms cannot be copied by init_student_from_teacher",
    "eps": "the student's normalisation differs slightly from the teacher's",
    # A larger table is harmless (RoPE frequencies do not depend on its length), so only smaller warns.
    "rope_max_seq_len": "the student cannot denoise latents with more patches per axis than this",
}

_TEACHER_REASONS = {
    "in_channels": "the student denoises the teacher's VAE latents, so it must work in the teacher's "
    "{expected}-channel latent space",
    "out_channels": "the student predicts in the teacher's VAE latent space, so it must output the "
    "teacher's {expected} latent channels",
    "text_dim": "the student reads the teacher's prompt embeddings, whose width is the text encoder's "
    "({expected} for UMT5-XXL)",
    "patch_size": "the student is trained on the same latents and sampled by WanPipeline with the same "
    "VAE, so its patch grid must be the teacher's {expected}",
}


def _teacher_mismatches(
    values: Mapping[str, Any], teacher_config: Mapping[str, Any], source: Mapping[str, str], where: str
) -> tuple[list[str], list[str]]:
    """Problems (and fixes) for keys that must equal the teacher's, one per offending file key."""
    problems: dict[str, str] = {}
    fixes: dict[str, str] = {}
    for key in TEACHER_EQUAL_KEYS:
        value, expected = values.get(key), _shared_value(teacher_config, key)
        if key == "out_channels" and value is None:
            value = values.get("in_channels")
        if value == expected:
            continue
        file_key = source.get(key, key)
        if file_key in problems:  # num_channels sets both in and out channels: say it once
            continue
        shown = list(expected) if isinstance(expected, tuple) else expected
        problems[file_key] = (
            f"{where}: `{file_key}` = {_json_repr(value)} but the teacher has {key} = {_json_repr(expected)}; "
            + _TEACHER_REASONS[key].format(expected=shown)
            + "."
        )
        fixes[file_key] = (
            f'Set "{file_key}": {json.dumps(shown)} in {where} (or delete it to inherit the teacher\'s).'
        )
    return list(problems.values()), list(fixes.values())


def _json_repr(value: Any) -> str:
    """A value as it would be written in the JSON file (tuples as lists)."""
    return json.dumps(list(value) if isinstance(value, tuple) else value)


def load_student_config(path: str | Path, teacher_config: Mapping[str, Any]) -> dict[str, Any]:
    """Read, translate, complete and check a student config; returns WanTransformer3DModel kwargs.

    `path` is a JSON object of WanTransformer3DModel constructor keys (keys starting with "_" are
    ignored, so a diffusers `transformer/config.json` is itself a valid student config) and/or the
    origin project's keys (`hidden_size`, `depth`, `num_heads`, `num_channels`, int `patch_size`,
    `text_encoder_output_dim`, `mlp_ratio`). Missing keys come from `teacher_config` (the teacher
    expert's `transformer.config`) for TEACHER_SHARED_KEYS and from diffusers' defaults otherwise,
    except that a config giving `hidden_size` and no `ffn_dim`/`mlp_ratio` gets
    ffn_dim = 4 * hidden_size. Everything is checked here, before any model is built, and every
    problem raises DistillError(stage=Stage.CONFIG) naming the file, key, value and expected value.
    """
    path = _resolve_config_file(Path(path))
    raw = _read_json_object(path)
    data = {key: value for key, value in raw.items() if not key.startswith("_")}
    _check_unknown_keys(data, path)
    values, source = _translate(data, path)

    defaults = _constructor_defaults()
    inherited = []
    for key, default in defaults.items():
        if key not in values:
            if key in TEACHER_SHARED_KEYS:
                values[key] = _shared_value(teacher_config, key)
            else:
                values[key] = default
                if default is not None:  # None defaults just switch optional parts off
                    inherited.append(key)
    if values["out_channels"] is None:
        values["out_channels"] = values["in_channels"]
    if inherited:
        logger.info("%s: using diffusers defaults for %s", path, ", ".join(inherited))

    problems = [f"{path}: {line}" for line in _validation_problems(values, source)]
    if problems:
        raise DistillError(
            "Invalid student config",
            "\n".join(problems),
            fixes=[f"Edit {path}; config/student_config.json is a working example."],
            stage=Stage.CONFIG,
        )

    mismatches, fixes = _teacher_mismatches(values, teacher_config, source, str(path))
    if mismatches:
        raise DistillError(
            "Student config does not match the teacher",
            "\n".join(mismatches),
            causes=[
                "A config written for another model (the origin project's default uses 4 latent channels)."
            ],
            fixes=fixes,
            stage=Stage.CONFIG,
        )

    for key, consequence in _SHARED_KEY_CONSEQUENCES.items():
        theirs = _shared_value(teacher_config, key)
        if values[key] != theirs and not (key == "rope_max_seq_len" and values[key] > theirs):
            logger.warning(
                "%s: student %s = %r differs from the teacher's %r: allowed, but %s",
                path,
                key,
                values[key],
                theirs,
                consequence,
            )
    return {key: values[key] for key in defaults}


# ----------------------------------------------------------------------------------------------
# Building and counting
# ----------------------------------------------------------------------------------------------


def _constructor_kwargs(config: Mapping[str, Any]) -> dict[str, Any]:
    """The constructor keys of `config`; "_" keys (diffusers bookkeeping) are dropped."""
    kwargs = {key: value for key, value in config.items() if not key.startswith("_")}
    unknown = [key for key in kwargs if key not in _constructor_defaults()]
    if unknown:
        raise DistillError(
            "Not a WanTransformer3DModel config",
            f"Unknown keys: {', '.join(unknown)}.",
            fixes=["Pass the output of load_student_config (or a model's .config)."],
            stage=Stage.CONFIG,
        )
    if "patch_size" in kwargs:
        kwargs["patch_size"] = _as_patch(kwargs["patch_size"])
    return kwargs


def build_student(config: Mapping[str, Any], *, seed: int | None = None) -> WanTransformer3DModel:
    """A randomly initialised student on the CPU in float32.

    With `seed`, the initialisation is reproducible and the global RNG state is left untouched
    (so seeding the student does not shift the data or noise streams of the run).
    """
    kwargs = _constructor_kwargs(config)
    cls = _wan_class()
    if seed is None:
        return cls(**kwargs)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return cls(**kwargs)


def count_parameters(model_or_config: nn.Module | Mapping[str, Any]) -> int:
    """Number of parameters of a model, or of the model a config describes.

    A config is built on the meta device (accelerate.init_empty_weights), so even the 14B shape
    costs no memory.
    """
    if isinstance(model_or_config, nn.Module):
        return sum(p.numel() for p in unwrap_model(model_or_config).parameters())
    from accelerate import init_empty_weights

    with init_empty_weights(include_buffers=True):
        model = _wan_class()(**_constructor_kwargs(model_or_config))
    return sum(p.numel() for p in model.parameters())


def unwrap_model(model: nn.Module) -> nn.Module:
    """The model inside DDP (`.module`) and torch.compile (`._orig_mod`) wrappers."""
    while True:
        inner = getattr(model, "_orig_mod", None)
        if not isinstance(inner, nn.Module):
            inner = getattr(model, "module", None)
        if not isinstance(inner, nn.Module):
            return model
        model = inner


def _require_wan(model: nn.Module, what: str) -> WanTransformer3DModel:
    model = unwrap_model(model)
    if not isinstance(model, _wan_class()):
        raise DistillError(
            f"The {what} is not a WanTransformer3DModel",
            f"Got {type(model).__name__}.",
            stage=Stage.INTERNAL,
        )
    return model


# ----------------------------------------------------------------------------------------------
# Initialisation from the teacher
# ----------------------------------------------------------------------------------------------


def teacher_block_indices(teacher_layers: int, student_layers: int) -> list[int]:
    """Evenly spaced teacher blocks for the student: block i <- round(i * (T-1) / (S-1)).

    The first and last teacher blocks are always kept, so the student's first block reads the
    (copied) patch embedding it was trained on and its last block feeds the (copied) output
    projection. Halves round up, in integer arithmetic so the choice never depends on float
    rounding. A one-block student takes the middle block, T // 2. A student deeper than its
    teacher repeats blocks.
    """
    if student_layers == 1:
        return [teacher_layers // 2]
    span, steps = teacher_layers - 1, student_layers - 1
    return [(2 * i * span + steps) // (2 * steps) for i in range(student_layers)]


def _teacher_key(student_key: str, block_map: list[int]) -> str:
    if student_key.startswith("blocks."):
        _, index, rest = student_key.split(".", 2)
        return f"blocks.{block_map[int(index)]}.{rest}"
    return student_key


def _copy_leading(dst: torch.Tensor, src: torch.Tensor) -> None:
    """Copy the overlapping leading block of `src` into `dst` (dims may differ either way)."""
    region = tuple(slice(0, min(a, b)) for a, b in zip(dst.shape, src.shape))
    dst[region].copy_(src[region].to(device=dst.device, dtype=dst.dtype))


@torch.no_grad()
def init_student_from_teacher(
    student: WanTransformer3DModel, teacher_expert: WanTransformer3DModel
) -> dict[str, Any]:
    """Overwrite the student's weights with (a sub-block of) one teacher expert's weights.

    Blocks: the student's S blocks come from evenly spaced teacher blocks (`teacher_block_indices`).
    Everything else (patch embedding, condition embedder, output norm and projection, the
    modulation tables) is copied too. Where the student is narrower, each tensor gets the leading
    sub-block of the teacher's along every dimension: the first heads, the first FFN units, the
    first channels of the residual stream (time_proj's 6 modulation chunks are sliced one by one).
    Where the student is wider, the teacher fills the leading block and the rest keeps its random
    initialisation ("partial"). The head width must be equal, because RoPE splits each head's
    channels into time/height/width bands by head width.

    Tensors whose input space differs (another freq_dim, image_dim or added_kv_proj_dim) or that
    the teacher lacks (e.g. norm2 without cross_attn_norm) keep their initial values.
    With an identical config the student reproduces the teacher exactly. Call it before sharding
    either model (it reads full tensors). Returns a report: teacher_blocks, copied / sliced /
    partial counts, unmapped (student tensors left at their initial values) and teacher_unused
    (tensors of the non-block part and of the chosen blocks that the student had no place for).
    """
    student = _require_wan(student, "student")
    teacher = _require_wan(teacher_expert, "teacher expert")
    s_cfg, t_cfg = student.config, teacher.config

    if s_cfg.attention_head_dim != t_cfg.attention_head_dim:
        raise DistillError(
            "Cannot initialise the student from the teacher: head widths differ",
            f"student attention_head_dim = {s_cfg.attention_head_dim}, teacher = {t_cfg.attention_head_dim}. "
            "RoPE splits each head's channels into time/height/width bands by head width, so teacher "
            "heads cannot be cut to another width.",
            fixes=[
                f'Set "attention_head_dim": {t_cfg.attention_head_dim} in the student config and change '
                "num_attention_heads to set the width (e.g. hidden_size = heads * "
                f"{t_cfg.attention_head_dim}).",
                "Or use --student_init random.",
            ],
            stage=Stage.CONFIG,
        )
    mismatched = [
        f"{key}: student {_json_repr(_shared_value(s_cfg, key))}, teacher {_json_repr(_shared_value(t_cfg, key))}"
        for key in TEACHER_EQUAL_KEYS
        if _shared_value(s_cfg, key) != _shared_value(t_cfg, key)
    ]
    if mismatched:
        raise DistillError(
            "Cannot initialise the student from the teacher: different latent or text spaces",
            "; ".join(mismatched),
            fixes=["Build the student with load_student_config(path, teacher.config)."],
            stage=Stage.CONFIG,
        )
    if any(p.is_meta for p in teacher.parameters()):
        raise DistillError(
            "Cannot initialise the student from the teacher: teacher weights are not loaded",
            "Some teacher parameters are on the meta device.",
            stage=Stage.INTERNAL,
        )

    external = [
        pattern
        for key, patterns in _EXTERNAL_SPACE_TENSORS.items()
        if s_cfg.get(key) != t_cfg.get(key)
        for pattern in patterns
    ]
    block_map = teacher_block_indices(t_cfg.num_layers, s_cfg.num_layers)
    teacher_state = teacher.state_dict()
    width_s = s_cfg.num_attention_heads * s_cfg.attention_head_dim
    width_t = t_cfg.num_attention_heads * t_cfg.attention_head_dim

    report: dict[str, Any] = {
        "teacher_layers": t_cfg.num_layers,
        "student_layers": s_cfg.num_layers,
        "teacher_blocks": block_map,
        "copied": 0,
        "sliced": 0,
        "partial": 0,
        "unmapped": [],
        "teacher_unused": [],
    }
    used_teacher_keys = set()
    for key, dst in student.state_dict().items():
        src = teacher_state.get(_teacher_key(key, block_map))
        if src is None or src.ndim != dst.ndim or any(p in key for p in external):
            report["unmapped"].append(key)
            continue
        used_teacher_keys.add(_teacher_key(key, block_map))
        if dst.shape == src.shape:
            dst.copy_(src.to(device=dst.device, dtype=dst.dtype))
            report["copied"] += 1
            continue
        if key in _SIX_CHUNK_TENSORS:
            _copy_leading(dst.view(6, width_s, *dst.shape[1:]), src.view(6, width_t, *src.shape[1:]))
        else:
            _copy_leading(dst, src)
        narrower = all(a <= b for a, b in zip(dst.shape, src.shape))
        report["sliced" if narrower else "partial"] += 1

    used_blocks = {f"blocks.{index}." for index in block_map}
    report["teacher_unused"] = [
        key
        for key in teacher_state
        if key not in used_teacher_keys
        and (not key.startswith("blocks.") or key.startswith(tuple(used_blocks)))
    ]
    logger.info(
        "Student initialised from teacher blocks %s: %d tensors copied whole, %d sliced, %d partial, "
        "%d left at their initial values",
        block_map,
        report["copied"],
        report["sliced"],
        report["partial"],
        len(report["unmapped"]),
    )
    return report


# ----------------------------------------------------------------------------------------------
# Pretrained students and export
# ----------------------------------------------------------------------------------------------


def _looks_local(name: str) -> bool:
    """Whether `name` can only be a path: hub ids are exactly "owner/name"."""
    return os.path.isabs(name) or name.startswith((".", "~")) or name.count("/") != 1 or "\\" in name


def _check_pretrained_config(config: Mapping[str, Any], expected: Mapping[str, Any], where: str) -> None:
    values = {key: _shared_value(config, key) for key in TEACHER_EQUAL_KEYS}
    problems, _ = _teacher_mismatches(values, expected, {}, where)
    if problems:
        raise DistillError(
            "Pretrained student does not match the teacher",
            "\n".join(problems),
            causes=["A checkpoint of another model family (e.g. an I2V model with 36 input channels)."],
            fixes=["Use a Wan text-to-video transformer such as Wan-AI/Wan2.1-T2V-1.3B-Diffusers."],
            stage=Stage.CONFIG,
        )


def load_pretrained_student(
    path_or_repo: str, expected: Mapping[str, Any] | None = None
) -> WanTransformer3DModel:
    """Load a pretrained WanTransformer3DModel to start the student from.

    Accepts a model folder (config.json + weights), a pipeline folder with a `transformer/`
    subfolder (e.g. a downloaded Wan2.1-T2V-1.3B-Diffusers) or a hub id (its `transformer`
    subfolder first, then the repo root). With `expected` (the teacher expert's config), the
    channels, text width and patch size are checked against it from config.json alone, before
    any weights are read. The model is returned in float32 on the CPU, like `build_student`,
    whatever dtype it was stored in (the trainer keeps float32 master weights).
    """
    cls = _wan_class()
    name = str(path_or_repo)
    folder = Path(name).expanduser()
    if folder.is_dir():
        if (folder / "config.json").is_file():
            attempts = [(str(folder), None)]
        elif (folder / "transformer" / "config.json").is_file():
            attempts = [(str(folder), "transformer")]
        else:
            entries = sorted(p.name + ("/" if p.is_dir() else "") for p in folder.iterdir())
            raise DistillError(
                "No WanTransformer3DModel in the pretrained-student folder",
                f"{folder} has neither config.json nor transformer/config.json; it holds: "
                + (", ".join(entries) or "nothing"),
                fixes=[
                    "Point --student_init at the model folder or the pipeline folder that contains transformer/."
                ],
                stage=Stage.CONFIG,
            )
    elif folder.exists() or _looks_local(name):
        raise DistillError(
            "Pretrained student not found",
            f"{name} is not a folder.",
            fixes=["Check the path, or give a hub id such as Wan-AI/Wan2.1-T2V-1.3B-Diffusers."],
            stage=Stage.CONFIG,
        )
    else:
        attempts = [(name, "transformer"), (name, None)]

    failures = []
    for location, subfolder in attempts:
        where = f"{location}/{subfolder}" if subfolder else location
        try:
            config = cls.load_config(location, subfolder=subfolder)
        except Exception as err:  # hub, network and file errors all mean "not here"; reported below
            failures.append(f"{where}: {type(err).__name__}: {err}")
            continue
        class_name = config.get("_class_name", cls.__name__)
        if class_name != cls.__name__:
            raise DistillError(
                "Pretrained student is not a WanTransformer3DModel",
                f"{where}/config.json describes a {class_name}.",
                stage=Stage.CONFIG,
            )
        if expected is not None:
            _check_pretrained_config(config, expected, f"{where}/config.json")
        try:
            model = cls.from_pretrained(location, subfolder=subfolder, torch_dtype=torch.float32)
        except Exception as err:
            raise DistillError(
                "Cannot load the pretrained student's weights",
                f"{where}: {type(err).__name__}: {err}",
                causes=["An interrupted download or a truncated safetensors file."],
                fixes=["Download the model again (python download_wan.py) or delete the broken folder."],
                stage=Stage.SETUP,
            ) from err
        logger.info("Loaded pretrained student from %s (%d parameters)", where, count_parameters(model))
        return model

    raise DistillError(
        "Pretrained student not found",
        "\n".join(failures),
        causes=["No network (set HF_HUB_OFFLINE=1 and download first) or a misspelt hub id."],
        fixes=[
            "Download it first, e.g. huggingface-cli download Wan-AI/Wan2.1-T2V-1.3B-Diffusers, and pass the folder."
        ],
        stage=Stage.CONFIG,
    )


def _fsync_tree(folder: Path) -> None:
    """Flush the files and the folder entry so a rename after it cannot expose empty files."""
    for path in folder.rglob("*"):
        if path.is_file():
            with open(path, "rb") as handle:
                os.fsync(handle.fileno())
    if hasattr(os, "O_DIRECTORY"):
        fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def export_student(model: nn.Module, out_dir: str | Path) -> Path:
    """Write the student as a diffusers model folder (config.json + safetensors) at `out_dir`.

    The folder is written next to `out_dir` under a temporary name and renamed into place, so a
    crash never leaves a half-written export; an existing export is replaced only once the new
    one is complete. Call it on one rank only. Returns `out_dir`.
    """
    model = _require_wan(model, "student")
    if any(type(p).__name__ == "DTensor" for p in model.parameters()):
        raise DistillError(
            "Cannot export a sharded (FSDP) student directly",
            "Its parameters are DTensors; save_pretrained needs full tensors.",
            fixes=[
                "Gather a full state dict (get_model_state_dict with full_state_dict=True), load it into "
                "build_student(config) on rank 0 and export that."
            ],
            stage=Stage.INTERNAL,
        )
    out_dir = Path(out_dir)
    if out_dir.exists() and not out_dir.is_dir():
        raise DistillError(
            "Cannot export the student", f"{out_dir} exists and is not a folder.", stage=Stage.CHECKPOINT
        )
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    # mkdtemp creates 0700; the export must be readable like any other folder the user writes.
    staging.chmod(0o777 & ~_umask())
    try:
        model.save_pretrained(staging, safe_serialization=True)
        _fsync_tree(staging)
        if out_dir.exists():
            retired = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.old-", dir=out_dir.parent))
            os.replace(out_dir, retired / out_dir.name)
            os.replace(staging, out_dir)
            shutil.rmtree(retired, ignore_errors=True)
        else:
            os.replace(staging, out_dir)
    except Exception as err:  # OSError, or safetensors' / torch's own words for a failed write
        from distill.checkpoint import checkpoint_root, complete_checkpoints, disk_is_full

        shutil.rmtree(staging, ignore_errors=True)
        full = disk_is_full(err, out_dir.parent)
        kept = complete_checkpoints(checkpoint_root(out_dir.parent))
        raise DistillError(
            ("the disk is full: " if full else "") + f"cannot export the student to {out_dir}",
            f"{type(err).__name__}: {err}",
            causes=["the disk is full", "the folder is not writable"],
            fixes=[
                "free space (df -h) or point --output_dir at a larger, writable disk",
                "then rerun the same command: it resumes from the last checkpoint"
                + (f" ({kept[-1].name}) and exports" if kept else " and exports"),
            ],
            stage=Stage.CHECKPOINT,
        ) from None
    logger.info("Exported student to %s", out_dir)
    return out_dir
