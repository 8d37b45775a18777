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

import logging
import os
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from distill.models.student_config import (
    TEACHER_EQUAL_KEYS,
    as_patch,
    constructor_defaults,
    json_repr,
    shared_value,
    teacher_mismatches,
    wan_class,
)
from distill.models.student_kind import config_kind, described, widen_patch_embedding, widens_to
from distill.models.teacher_kind import T2V_A14B, student_starts
from distill.ops.errors import DistillError, Stage
from distill.ops.files import export_failed, staging_folder, swap_into_place

if TYPE_CHECKING:
    from diffusers import WanTransformer3DModel

logger = logging.getLogger(__name__)


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


# ----------------------------------------------------------------------------------------------
# Building and counting
# ----------------------------------------------------------------------------------------------


def _constructor_kwargs(config: Mapping[str, Any]) -> dict[str, Any]:
    """The constructor keys of `config`; "_" keys (diffusers bookkeeping) are dropped."""
    kwargs = {key: value for key, value in config.items() if not key.startswith("_")}
    unknown = [key for key in kwargs if key not in constructor_defaults()]
    if unknown:
        raise DistillError(
            "Not a WanTransformer3DModel config",
            f"Unknown keys: {', '.join(unknown)}.",
            fixes=["Pass the output of load_student_config (or a model's .config)."],
            stage=Stage.CONFIG,
        )
    if "patch_size" in kwargs:
        kwargs["patch_size"] = as_patch(kwargs["patch_size"])
    return kwargs


def build_student(config: Mapping[str, Any], *, seed: int | None = None) -> WanTransformer3DModel:
    """A randomly initialised student on the CPU in float32.

    With `seed`, the initialisation is reproducible and the global RNG state is left untouched
    (so seeding the student does not shift the data or noise streams of the run).
    """
    kwargs = _constructor_kwargs(config)
    cls = wan_class()
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
        model = wan_class()(**_constructor_kwargs(model_or_config))
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
    if not isinstance(model, wan_class()):
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
        f"{key}: student {json_repr(shared_value(s_cfg, key))}, teacher {json_repr(shared_value(t_cfg, key))}"
        for key in TEACHER_EQUAL_KEYS
        if shared_value(s_cfg, key) != shared_value(t_cfg, key)
    ]
    if mismatched:
        theirs, ours = config_kind(s_cfg), config_kind(t_cfg)
        raise DistillError(
            "Cannot initialise the student from the teacher: different latent or text spaces",
            "; ".join(mismatched)
            + (
                f"\nThe student is shaped for {described(theirs)}; the teacher is {described(ours)}."
                if theirs and ours and theirs != ours
                else ""
            ),
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


def _check_pretrained_config(
    config: Mapping[str, Any], expected: Mapping[str, Any], where: str, flag: str, name: str
) -> bool:
    """Refuse a pretrained student that cannot start a student of the teacher `expected` describes;
    True when it is a model of the noisy latents alone that the teacher's condition channels widen
    (`widen_patch_embedding`), everything else equal."""
    values = {key: shared_value(config, key) for key in TEACHER_EQUAL_KEYS}
    widen = widens_to(values, expected)
    if widen:  # judge the rest as if it took the teacher's input already
        values["in_channels"] = shared_value(expected, "in_channels")
    problems, _ = teacher_mismatches(values, expected, {}, where)
    theirs, ours = config_kind(values), config_kind(expected)
    if problems and theirs and ours and theirs != ours:
        raise DistillError(
            f"{flag} {name} is a {theirs.model} student ({theirs.task}); this teacher is {ours.model} "
            f"({ours.task})",
            "\n".join(problems) + f"\n{name}: {described(theirs)}\nthe teacher: {described(ours)}",
            causes=[f"{name} was distilled from (or is) {theirs.model}, not {ours.model}"],
            fixes=student_starts(ours, flag),
            stage=Stage.CONFIG,
        )
    if problems:
        raise DistillError(
            "Pretrained student does not match the teacher",
            "\n".join(problems),
            causes=["A checkpoint of another model family (e.g. an I2V model with 36 input channels)."],
            fixes=student_starts(ours or T2V_A14B, flag),
            stage=Stage.CONFIG,
        )
    return widen


def load_pretrained_student(
    path_or_repo: str, expected: Mapping[str, Any] | None = None, *, flag: str = "--student_init"
) -> WanTransformer3DModel:
    """Load a pretrained WanTransformer3DModel to start the student from.

    Accepts a model folder (config.json + weights), a pipeline folder with a `transformer/`
    subfolder (e.g. a downloaded Wan2.1-T2V-1.3B-Diffusers) or a hub id (its `transformer`
    subfolder first, then the repo root). With `expected` (the teacher expert's config), the
    channels, text width and patch size are checked against it from config.json alone, before
    any weights are read; a model of the noisy latents alone (a text-to-video student, Wan2.1-T2V)
    for a teacher whose input adds an image condition gets its patch embedding widened with zero
    weights for the condition channels, so it starts as exactly that model. A student of another
    Wan 2.2 model is refused naming both (`flag`: the option that named it). The model is returned
    in float32 on the CPU, like `build_student`, whatever dtype it was stored in (the trainer keeps
    float32 master weights).
    """
    cls = wan_class()
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
        widen = expected is not None and _check_pretrained_config(
            config, expected, f"{where}/config.json", flag, name
        )
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
        if widen:
            assert expected is not None
            widen_patch_embedding(model, int(shared_value(expected, "in_channels")), f"{flag} {where}")
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


def export_student(model: nn.Module, out_dir: str | Path, *, resume_from: str | None = None) -> Path:
    """Write the student as a diffusers model folder (config.json + safetensors) at `out_dir`.

    The folder is written next to `out_dir` under a temporary name and renamed into place, so a
    crash never leaves a half-written export; an existing export is replaced only once the new
    one is complete. Call it on one rank only. Returns `out_dir`. `resume_from` names the checkpoint a
    rerun would resume from, for the message when the write fails. A causal student
    (distill/models/causal) gets its chunk size written beside its config (causal_config.json): its
    weights are a plain WanTransformer3DModel's, and that file is what makes it causal again on load.
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
    staging = staging_folder(out_dir)
    try:
        model.save_pretrained(staging, safe_serialization=True)
        _record_causal(model, staging)
        swap_into_place(staging, out_dir)
    except Exception as err:  # OSError, or safetensors' / torch's own words for a failed write
        shutil.rmtree(staging, ignore_errors=True)
        raise export_failed(err, out_dir, "the student ", resume_from) from None
    logger.info("Exported student to %s", out_dir)
    return out_dir


def _record_causal(model: nn.Module, folder: Path) -> None:
    """Write the causal layout of `model` into its export folder; nothing for a bidirectional one."""
    from distill.models.causal.attention import causal_layout
    from distill.models.causal.layout import write_causal_config

    layout = causal_layout(model)
    if layout is not None:
        write_causal_config(folder, layout)
