"""The student's config: read from JSON (the diffusers keys, or the origin project's names), filled
with diffusers' defaults, validated, and checked against the teacher (what the student must share
with it: latent channels, text width, patch grid) before any weights are touched."""

from __future__ import annotations

import difflib
import functools
import inspect
import json
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from distill.models.student_kind import kind_fix, kind_reason, written_for_error
from distill.ops.errors import DistillError, Stage

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

if TYPE_CHECKING:
    from diffusers import WanTransformer3DModel

logger = logging.getLogger(__name__)


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


@functools.lru_cache(maxsize=1)
def constructor_defaults() -> dict[str, Any]:
    """WanTransformer3DModel's constructor keys and defaults, read from the installed diffusers."""
    parameters = inspect.signature(wan_class().__init__).parameters
    return {
        name: p.default
        for name, p in parameters.items()
        if name != "self" and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
    }


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def as_patch(value: Any) -> tuple[int, ...] | Any:
    """(1, p, p) for the origin's int patch size, a tuple for a JSON list; anything else as is."""
    if _is_int(value):
        return (1, value, value)
    if isinstance(value, (list, tuple)):
        return tuple(value)
    return value


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
    known = [*constructor_defaults(), *ORIGIN_TRANSLATED_KEYS, *ORIGIN_IGNORED_KEYS]
    unknown = [key for key in data if key not in known]
    if not unknown:
        return
    lines = []
    for key in unknown:
        close = difflib.get_close_matches(key, known, n=1, cutoff=0.6)
        lines.append(f"`{key}`" + (f" (did you mean `{close[0]}`?)" if close else ""))
    raise DistillError(
        "Unknown key in the student config",
        f"{path}: " + ", ".join(lines) + "\nValid keys: " + ", ".join(constructor_defaults()) + ".",
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
        if key in constructor_defaults():
            put(key, as_patch(value) if key == "patch_size" else value, key)

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
        heads = values.get("num_attention_heads", constructor_defaults()["num_attention_heads"])
        head_dim = values.get("attention_head_dim", constructor_defaults()["attention_head_dim"])
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
                f"`patch_size` = {json_repr(patch)}; it must be [t, h, w] positive integers (or an int p)"
            )
    eps = values.get("eps", 1.0)
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or eps <= 0:
        problems.append(f"`eps` = {eps!r}; it must be a positive number")
    if "cross_attn_norm" in values and not isinstance(values["cross_attn_norm"], bool):
        problems.append(f"`cross_attn_norm` = {values['cross_attn_norm']!r}; it must be true or false")
    if "qk_norm" in values and not (values["qk_norm"] is None or isinstance(values["qk_norm"], str)):
        problems.append(f"`qk_norm` = {values['qk_norm']!r}; it must be a string or null")
    return problems


def shared_value(config: Mapping[str, Any], key: str) -> Any:
    """`config[key]` as the model sees it (default filled in, patch as a tuple, null out_channels)."""
    defaults = constructor_defaults()
    value = config.get(key, defaults[key])
    if key == "out_channels" and value is None:
        # WanTransformer3DModel treats a null out_channels as in_channels.
        value = config.get("in_channels", defaults["in_channels"])
    return as_patch(value) if key == "patch_size" else value


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


def teacher_mismatches(
    values: Mapping[str, Any], teacher_config: Mapping[str, Any], source: Mapping[str, str], where: str
) -> tuple[list[str], list[str]]:
    """Problems (and fixes) for keys that must equal the teacher's, one per offending file key."""
    problems: dict[str, str] = {}
    fixes: dict[str, str] = {}
    for key in TEACHER_EQUAL_KEYS:
        value, expected = values.get(key), shared_value(teacher_config, key)
        if key == "out_channels" and value is None:
            value = values.get("in_channels")
        if value == expected:
            continue
        file_key = source.get(key, key)
        if file_key in problems:  # num_channels sets both in and out channels: say it once
            continue
        shown = list(expected) if isinstance(expected, tuple) else expected
        problems[file_key] = (
            f"{where}: `{file_key}` = {json_repr(value)} but the teacher has {key} = {json_repr(expected)}; "
            + kind_reason(key, value, shown, teacher_config, _TEACHER_REASONS[key].format(expected=shown))
            + "."
        )
        fixes[file_key] = kind_fix(
            key,
            file_key,
            value,
            teacher_config,
            f'Set "{file_key}": {json.dumps(shown)} in {where} (or delete it to inherit the teacher\'s)',
            where,
        )
    return list(problems.values()), list(fixes.values())


def json_repr(value: Any) -> str:
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

    defaults = constructor_defaults()
    inherited = []
    for key, default in defaults.items():
        if key not in values:
            if key in TEACHER_SHARED_KEYS:
                values[key] = shared_value(teacher_config, key)
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

    mismatches, fixes = teacher_mismatches(values, teacher_config, source, str(path))
    if mismatches:
        written_for = written_for_error(path, values, teacher_config, mismatches, fixes)
        if written_for is not None:
            raise written_for
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
        theirs = shared_value(teacher_config, key)
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


def wan_class() -> type[WanTransformer3DModel]:
    from diffusers import WanTransformer3DModel

    return WanTransformer3DModel
