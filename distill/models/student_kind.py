"""Which Wan 2.2 model a student belongs to, and an image-to-video student started from a text-to-video one.

A student takes its teacher's input and gives its teacher's output, so its channels say which kind
of teacher (models/teacher_kind.py) it was made for: 16 in / 16 out is Wan2.2-T2V-A14B, 36 in / 16
out is Wan2.2-I2V-A14B, 48 in / 48 out is Wan2.2-TI2V-5B (the latent channels of its own VAE, in
both of its modes: its image enters by replacing latent frame 0, not as extra channels). LoRA adapters have the same shapes on both models' experts, so what their
folder or its run recorded is the only way to tell (`kind_named` reads such a record).

An image-to-video input is the 16 noisy latent channels followed by the condition
(models/conditioning.py). A text-to-video model whose patch embedding gets zero weights for the
condition channels therefore computes exactly what it computed before, on the noisy channels, and
its image-to-video training starts from everything it already knows (`widen_patch_embedding`).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from distill.models.conditioning import NOISY_CHANNELS, condition_channels
from distill.models.teacher_kind import I2V_A14B, KINDS, T2V_A14B, TI2V_5B, TeacherKind
from distill.ops.errors import DistillError, Stage

logger = logging.getLogger(__name__)

# The shipped student configs of each kind: the Wan2.1-T2V-1.3B shape, then the tiny test student.
SHIPPED_CONFIGS = {
    T2V_A14B.name: ("config/student_config.json", "config/student_tiny.json"),
    I2V_A14B.name: ("config/student_config_i2v.json", "config/student_tiny_i2v.json"),
    TI2V_5B.name: ("config/student_config_ti2v.json", "config/student_tiny_ti2v.json"),
}


def channels_of(config: Mapping[str, Any]) -> tuple[Any, Any]:
    """(in_channels, out_channels) of a WanTransformer3DModel config as the model builds them: a
    missing key is diffusers' default (16), a null out_channels is in_channels."""
    in_channels = config.get("in_channels", NOISY_CHANNELS)
    return in_channels, config.get("out_channels") or in_channels


def config_kind(config: Mapping[str, Any]) -> TeacherKind | None:
    """The Wan 2.2 model whose transformers take and give the channels of `config`, or None."""
    channels = channels_of(config)
    return next((k for k in KINDS if (k.in_channels, k.out_channels) == channels), None)


def kind_taking(in_channels: Any, besides: TeacherKind | None = None) -> TeacherKind | None:
    """The Wan 2.2 model (other than `besides`) whose transformers take `in_channels` input channels."""
    return next((k for k in KINDS if k.in_channels == in_channels and k != besides), None)


def kind_named(value: Any) -> TeacherKind | None:
    """The kind a record names: its short name (i2v-a14b), its model name (Wan2.2-I2V-A14B) or a hub
    id of either layout (Wan-AI/Wan2.2-I2V-A14B-Diffusers, Wan-AI/Wan2.2-I2V-A14B); None otherwise."""
    if not isinstance(value, str):
        return None
    said = value.strip().lower().removesuffix("-diffusers")
    for kind in KINDS:
        if said in (kind.name, kind.model.lower(), kind.repo_id.lower().removesuffix("-diffusers")):
            return kind
    return None


def shipped_configs(kind: TeacherKind) -> str:
    """The shipped student configs written for `kind`, in words ("" when none ships)."""
    if kind.name not in SHIPPED_CONFIGS:
        return ""
    shape, tiny = SHIPPED_CONFIGS[kind.name]
    return f"{shape} (the Wan2.1-T2V-1.3B shape) or {tiny} (the tiny test student)"


def described(kind: TeacherKind) -> str:
    """`kind` and its input in words, for messages: "Wan2.2-I2V-A14B (image to video: 36 input
    channels, ...)"."""
    return f"{kind.model} ({kind.task}: {kind.in_channels} input channels, {kind.inputs})"


def widens_to(config: Mapping[str, Any], teacher_config: Mapping[str, Any]) -> bool:
    """Whether `config` is a transformer of the noisy latents alone (a text-to-video model) and the
    teacher's input adds condition channels after them: `widen_patch_embedding` then fits it to the
    teacher. Only the channels are judged here; text width and patch grid are checked as for any
    student."""
    teacher = config_kind(teacher_config)
    if teacher is None or condition_channels(teacher) == 0:
        return False
    return channels_of(config) == (teacher.out_channels, teacher.out_channels)


@torch.no_grad()
def widen_patch_embedding(model: nn.Module, in_channels: int, source: str = "the student") -> nn.Module:
    """`model` (a WanTransformer3DModel of the noisy latents) taking `in_channels` input channels: its
    patch embedding keeps its weights for the first channels and gets zero weights for the new ones,
    so its output does not depend on them and it starts as exactly the model it was. The config says
    the new channel count (out_channels written out, so a rebuilt model keeps its 16 outputs)."""
    old = model.patch_embedding
    added = in_channels - old.in_channels
    if added <= 0:
        raise ValueError(
            f"{source} already takes {old.in_channels} input channels, not fewer than {in_channels}"
        )
    new = nn.Conv3d(
        in_channels,
        old.out_channels,
        kernel_size=old.kernel_size,
        stride=old.stride,
        padding=old.padding,
        bias=old.bias is not None,
        device=old.weight.device,
        dtype=old.weight.dtype,
    )
    new.weight.zero_()
    new.weight[:, : old.in_channels].copy_(old.weight)
    new.weight.requires_grad_(old.weight.requires_grad)
    if old.bias is not None:
        new.bias.copy_(old.bias)
        new.bias.requires_grad_(old.bias.requires_grad)
    model.patch_embedding = new
    out_channels = model.config.out_channels or old.in_channels
    model.register_to_config(in_channels=in_channels, out_channels=out_channels)
    logger.info(
        "%s takes %d input channels (the noisy latents); the teacher's input has %d more after them: "
        "its patch embedding is widened to %d channels with zero weights for the %d new ones, so it "
        "starts as exactly that model on the noisy latents and learns to read the condition",
        source,
        old.in_channels,
        added,
        in_channels,
        added,
    )
    return model


# ----------------------------------------------------------------------------------------------
# What student-config messages add for a teacher of another kind (student_config.teacher_mismatches)
# ----------------------------------------------------------------------------------------------


def conditioned(kind: TeacherKind | None) -> bool:
    """Whether `kind`'s input adds a condition to the noisy latents (image to video)."""
    return kind is not None and condition_channels(kind) > 0


def kind_reason(key: str, value: Any, expected: Any, teacher_config: Mapping[str, Any], plain: str) -> str:
    """Why `key` (= `value` in a student config) must be the teacher's `expected`: `plain`, the words
    for a teacher of the noisy latents alone, unless the teacher's input adds a condition (then what
    it is made of) or `value` is another model's input (then which model the config is written for)."""
    teacher = config_kind(teacher_config)
    if key != "in_channels" or teacher is None:
        return plain
    reason = plain
    if conditioned(teacher):
        reason = (
            f"the {teacher.model} teacher's input is {teacher.inputs} ({expected} channels), and the "
            "student is trained and sampled on that same input"
        )
    other = kind_taking(value, besides=teacher)
    if other is not None:
        reason += (
            f"; {value} input channels are what {other.model} takes ({other.task}): the config is written "
            f"for that model, not for this {teacher.model} teacher ({teacher.task})"
        )
    return reason


def kind_fix(
    key: str, file_key: str, value: Any, teacher_config: Mapping[str, Any], plain: str, where: str
) -> str:
    """The fix of a key that must equal the teacher's: `plain` ("Set ... in FILE"), and the shipped
    configs of the teacher's model when the config was written for another model or the teacher
    takes a condition. The origin's `num_channels` sets input and output alike, so for a teacher
    whose input is wider than its output it is replaced by the two keys."""
    teacher = config_kind(teacher_config)
    fix = plain
    if file_key == "num_channels" and conditioned(teacher):
        in_channels, out_channels = channels_of(teacher_config)
        fix = f'Replace "num_channels" with "in_channels": {in_channels}, "out_channels": {out_channels} in {where}'
    other_model = (
        key == "in_channels" and teacher is not None and kind_taking(value, besides=teacher) is not None
    )
    if teacher is not None and (other_model or conditioned(teacher)) and shipped_configs(teacher):
        # A shipped config of another model is best left as it is: the teacher's own come first.
        return f"Use {shipped_configs(teacher)}, written for {teacher.model}; or {fix[0].lower()}{fix[1:]}."
    return fix + "."


def written_for_error(
    path: Any,
    values: Mapping[str, Any],
    teacher_config: Mapping[str, Any],
    mismatches: list[str],
    fixes: list[str],
) -> DistillError | None:
    """The refusal of a student config whose input channels are another Wan 2.2 model's (a
    text-to-video config given with an image-to-video teacher, or the reverse), naming both models;
    None for any other mismatch (the plain "does not match the teacher")."""
    teacher = config_kind(teacher_config)
    written_for = kind_taking(values.get("in_channels"), besides=teacher) if teacher else None
    if teacher is None or written_for is None:
        return None
    return DistillError(
        f"Student config {path} is written for {written_for.model}, not for this {teacher.model} teacher",
        "\n".join(mismatches),
        causes=[
            f"A config of a {written_for.model} student ({written_for.task}, {written_for.in_channels} input "
            f"channels) given with the {teacher.model} teacher ({teacher.task}, {teacher.in_channels} input "
            "channels)."
        ],
        fixes=fixes,
        stage=Stage.CONFIG,
    )
