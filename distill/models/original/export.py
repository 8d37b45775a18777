"""Writing the original layout: a whole teacher (the tiny one) or a student as one safetensors file
in Wan's key names, with the config Wan's code reads."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from distill.models.original.configs import WAN22_LATENTS_MEAN, WAN22_LATENTS_STD, original_expert_config
from distill.models.original.convert import read_json, shard_names, write_index
from distill.models.original.detect import (
    A14B_BOUNDARY_RATIO,
    CONFIGURATION_FILE,
    FLOW_SHIFT,
    FLOW_SHIFTS,
    MODEL_CONFIG,
    ONE_MODEL,
    T5_FILE,
    TOKENIZER_DIR,
    TWO_EXPERTS,
    expert_shards,
)
from distill.models.original.keymaps import (
    t5_to_original,
    transformer_to_original,
    vae22_to_original,
    vae_to_original,
)
from distill.models.student_kind import config_kind
from distill.models.teacher_kind import T2V_A14B, TeacherKind
from distill.ops.errors import DistillError, Stage

if TYPE_CHECKING:  # torch costs seconds to import; only the annotations name it here
    import torch


def save_original_layout(
    pipe: Any,
    folder: Path,
    boundary_ratio: float,
    shards_per_expert: int = 2,
    kind: TeacherKind = T2V_A14B,
) -> None:
    """Write an in-memory pipeline of `kind` in its original release layout: tokenizer, T5, VAE and
    two experts in their folders (WanPipeline or WanImageToVideoPipeline without image encoder), or
    for TI2V-5B (WanPipeline with expand_timesteps) the Wan2.2 VAE and the one WanModel at the top."""
    import torch

    layout = ONE_MODEL if kind.experts == 1 else TWO_EXPERTS
    config: dict[str, Any] = {"framework": "Pytorch", "task": kind.task.replace(" ", "-")}
    if kind.experts == 2 and boundary_ratio != (kind.boundary_ratio or A14B_BOUNDARY_RATIO):
        # the release relies on Wan's code for the model's own switch (0.875 T2V, 0.9 I2V)
        config["boundary_ratio"] = boundary_ratio
    flow_shift = float(pipe.scheduler.config.flow_shift)
    if flow_shift != FLOW_SHIFTS.get(kind.original_model_type, FLOW_SHIFT):
        # and for its sampler's shift, which the conversion gives the diffusers scheduler
        config["flow_shift"] = flow_shift
    if layout is ONE_MODEL:
        # and for the Wan2.2 VAE's latent statistics, which Wan's code hard-codes (a random VAE has its own)
        for key, published in (("latents_mean", WAN22_LATENTS_MEAN), ("latents_std", WAN22_LATENTS_STD)):
            if list(pipe.vae.config[key]) != list(published):
                config[f"vae_{key}"] = list(pipe.vae.config[key])
    (folder / CONFIGURATION_FILE).write_text(json.dumps(config, indent=2) + "\n")
    pipe.tokenizer.save_pretrained(folder / TOKENIZER_DIR)
    torch.save(_plain(t5_to_original(pipe.text_encoder.state_dict())), folder / T5_FILE)
    vae_blocks = int(pipe.vae.config.num_res_blocks)
    to_original = vae22_to_original if layout is ONE_MODEL else vae_to_original
    torch.save(_plain(to_original(pipe.vae.state_dict(), vae_blocks)), folder / layout.vae_file)
    for component, sub in layout.models.items():
        model = getattr(pipe, component)
        out = folder / sub
        out.mkdir(exist_ok=not sub)
        model_config = original_expert_config(model.config, kind.original_model_type)
        (out / MODEL_CONFIG).write_text(json.dumps(model_config, indent=2) + "\n")
        _save_sharded(transformer_to_original(model.state_dict()), out, shards_per_expert)


def _plain(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.detach().cpu().contiguous() for k, v in state.items()}


def _save_sharded(state: Mapping[str, torch.Tensor], folder: Path, count: int) -> None:
    """Split the tensors, in order, into `count` files of about equal size, plus the index."""
    from safetensors.torch import save_file

    state = _plain(state)
    total = sum(t.numel() * t.element_size() for t in state.values())
    names = shard_names(count)
    groups: list[dict[str, torch.Tensor]] = [{} for _ in names]
    seen = 0
    for key, tensor in state.items():
        groups[min(count - 1, seen * count // max(total, 1))][key] = tensor
        seen += tensor.numel() * tensor.element_size()
    for name, group in zip(names, groups):
        save_file(group, folder / name, metadata={"format": "pt"})
    if count > 1:
        write_index(folder, {k: n for n, g in zip(names, groups) for k in g}, total)


def export_original(student: Any, out_file: str | Path) -> Path:
    """Write a student (a WanTransformer3DModel or its diffusers folder) as ONE safetensors file
    with the original Wan key names, the format Wan's own code and ComfyUI load. The original
    config.json rides along in the file's metadata. Written aside, then renamed into place.

    Reload with diffusers: WanTransformer3DModel.from_single_file(out_file, config=<student folder>).
    """
    from safetensors.torch import save_file

    config, state = _student_weights(student)
    # The model type Wan's code reads from the config: the one whose input the student takes
    # (a 36-channel student is an image-to-video model, "i2v").
    kind = config_kind(config) or T2V_A14B
    metadata = {
        "format": "pt",
        "config": json.dumps(original_expert_config(config, kind.original_model_type)),
    }
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
        return read_json(folder / "config.json"), state
    from distill.models.student import unwrap_model

    model = unwrap_model(student)
    if any(type(p).__name__ == "DTensor" for p in model.parameters()):
        raise DistillError(
            "Cannot export a sharded (FSDP) student directly",
            "Export the gathered full model, or pass the exported student/ folder.",
            stage=Stage.INTERNAL,
        )
    return model.config, model.state_dict()
