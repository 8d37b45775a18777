"""The configs of each component, read from the original checkpoint's own tensors and config.json
(the Wan2.1 and the Wan2.2 VAE, the T5 encoder, WanModel), and back: which settings the original
layout can express (a student must fit them to be exported)."""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from distill.models.original.detect import (
    MODEL_CONFIG,
    ONE_MODEL,
    T5_MAX_DISTANCE,
    OriginalLayout,
    model_folder,
    original_layout,
)
from distill.models.teacher_kind import KINDS, T2V_A14B, TI2V_5B, TeacherKind, read_teacher_kind
from distill.ops.errors import DistillError, Stage

# The models whose original layout converts: all three Wan 2.2 ones. The two-expert ones (T2V-A14B,
# I2V-A14B) share the Wan2.1 VAE and the expert folders; TI2V-5B has its one WanModel at the top of
# the folder and the Wan2.2 VAE.
CONVERTIBLE_KINDS = KINDS


def convertible_kind(src: Path) -> TeacherKind:
    """The model of the original folder `src`, read from its WanModel config.json (where none says:
    TI2V-5B in that release's shape, else T2V-A14B), refusing a model type the conversion does not
    know (S2V, Animate, ...) and a config that names the other release's shape."""
    layout = original_layout(src)
    config = model_folder(src, layout, next(iter(layout.models))) / MODEL_CONFIG
    try:
        model_type = json.loads(config.read_text()).get("model_type")
    except (OSError, ValueError, AttributeError):
        model_type = None  # a missing or damaged config is named by the completeness check
    known = {k.original_model_type: k for k in CONVERTIBLE_KINDS}
    if model_type is not None and model_type not in known:
        raise DistillError(
            f"{src} holds a Wan {model_type!r} model, which this converter does not take",
            f"{config.relative_to(src)}: model_type = {model_type}\nThe conversion takes "
            + ", ".join(f"{t} ({k.model})" for t, k in known.items()),
            fixes=[f"use one of those: {', '.join(k.repo_id for k in CONVERTIBLE_KINDS)}"],
            stage=Stage.TEACHER_LOAD,
        )
    reading = read_teacher_kind(src)
    if reading is None:
        return TI2V_5B if layout is ONE_MODEL else T2V_A14B
    if reading.kind.experts != len(layout.models):
        raise _shape_error(src, reading.kind, reading.evidence, layout)
    return reading.kind


def _shape_error(
    src: Path, kind: TeacherKind, evidence: tuple[str, ...], layout: OriginalLayout
) -> DistillError:
    folders = [f"{sub}/" if sub else "the top of the folder" for sub in layout.models.values()]
    return DistillError(
        f"{src} mixes two original Wan releases: its config says {kind.model}, its files are laid out "
        f"like {layout.release}",
        "Read from its files:\n"
        + "\n".join(f"- {line}" for line in evidence)
        + f"\n{kind.model} has {'two experts' if kind.experts == 2 else 'one transformer'}; this folder "
        f"keeps its WanModel weights in {' and '.join(folders)} beside {layout.vae_file}.",
        causes=["files of another model were copied into this folder"],
        fixes=[
            f"download the release again into a new folder: hf download {kind.repo_id.removesuffix('-Diffusers')}"
        ],
        stage=Stage.TEACHER_LOAD,
    )


# The Wan2.2 VAE's latent statistics: Wan's code (wan/modules/vae2_2.py, Wan2_2_VAE) hard-codes
# them, Wan2.2_VAE.pth does not hold them, and Wan-AI/Wan2.2-TI2V-5B-Diffusers's vae/config.json
# carries the same 48 + 48 values.
WAN22_LATENTS_MEAN = (
    -0.2289, -0.0052, -0.1323, -0.2339, -0.2799, 0.0174, 0.1838, 0.1557,
    -0.1382, 0.0542, 0.2813, 0.0891, 0.1570, -0.0098, 0.0375, -0.1825,
    -0.2246, -0.1207, -0.0698, 0.5109, 0.2665, -0.2108, -0.2158, 0.2502,
    -0.2055, -0.0322, 0.1109, 0.1567, -0.0729, 0.0899, -0.2799, -0.1230,
    -0.0313, -0.1649, 0.0117, 0.0723, -0.2839, -0.2083, -0.0520, 0.3748,
    0.0152, 0.1957, 0.1433, -0.2944, 0.3573, -0.0548, -0.1681, -0.0667,
)  # fmt: skip
WAN22_LATENTS_STD = (
    0.4765, 1.0364, 0.4514, 1.1677, 0.5313, 0.4990, 0.4818, 0.5013,
    0.8158, 1.0344, 0.5894, 1.0901, 0.6885, 0.6165, 0.8454, 0.4978,
    0.5759, 0.3523, 0.7135, 0.6804, 0.5833, 1.4146, 0.8986, 0.5659,
    0.7069, 0.5338, 0.4889, 0.4917, 0.4069, 0.4999, 0.6866, 0.4093,
    0.5709, 0.6065, 0.6415, 0.4944, 0.5726, 1.2042, 0.5458, 1.6887,
    0.3971, 1.0600, 0.3943, 0.5537, 0.5444, 0.4089, 0.7468, 0.7744,
)  # fmt: skip


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


def vae22_config_from_original(state: Mapping[str, Any]) -> dict[str, Any]:
    """AutoencoderKLWan arguments of a Wan2.2 VAE, all read from the weight names and shapes (the
    .pth has no config; Wan's code hard-codes 160 / 256 wide, dim_mult [1, 2, 4, 4], 2 res blocks).
    The latent statistics are Wan's constants (WAN22_LATENTS_MEAN / _STD)."""
    base_dim = int(state["encoder.conv1.weight"].shape[0])
    stages = 1 + max(int(m[1]) for k in state if (m := re.match(r"encoder\.downsamples\.(\d+)\.", k)))
    first = "encoder.downsamples.{}.downsamples.0.residual.2.weight"
    dim_mult = [int(state[first.format(i)].shape[0]) // base_dim for i in range(stages)]
    num_res_blocks = sum(
        1 for k in state if re.fullmatch(r"encoder\.downsamples\.0\.downsamples\.\d+\.residual\.0\.gamma", k)
    )
    # A stage halves time where its resample has a time_conv (Wan's "downsample3d").
    temporal = [
        f"encoder.downsamples.{i}.downsamples.{num_res_blocks}.time_conv.weight" in state
        for i in range(stages - 1)
    ]
    in_channels = int(state["encoder.conv1.weight"].shape[1])
    patch_size = math.isqrt(in_channels // 3)  # the 2 x 2 pixel patches of 3 colours: 12 channels
    z_dim = int(state["conv2.weight"].shape[0])
    if z_dim != len(WAN22_LATENTS_MEAN):
        raise DistillError(
            f"this Wan2.2 VAE has {z_dim} latent channels; the Wan2.2 VAE has {len(WAN22_LATENTS_MEAN)}",
            "Its latent statistics (Wan's constants) would not fit.",
            fixes=["re-download Wan2.2_VAE.pth"],
            stage=Stage.TEACHER_LOAD,
        )
    return {
        "base_dim": base_dim,
        "decoder_base_dim": int(state["decoder.conv1.weight"].shape[0]) // dim_mult[-1],
        "z_dim": z_dim,
        "dim_mult": dim_mult,
        "num_res_blocks": num_res_blocks,
        "attn_scales": [],
        "temperal_downsample": temporal,
        "dropout": 0.0,
        "is_residual": True,
        "in_channels": in_channels,
        "out_channels": int(state["decoder.head.2.weight"].shape[0]),
        "patch_size": patch_size,
        "scale_factor_temporal": 2 ** sum(temporal),
        "scale_factor_spatial": patch_size * 2 ** (stages - 1),
        "latents_mean": list(WAN22_LATENTS_MEAN),
        "latents_std": list(WAN22_LATENTS_STD),
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
    if cfg["model_type"] not in {k.original_model_type for k in CONVERTIBLE_KINDS}:
        raise DistillError(
            f"this expert is a Wan {cfg['model_type']!r} model; the conversion takes "
            + ", ".join(f"{k.original_model_type} ({k.model})" for k in CONVERTIBLE_KINDS)
            + " experts only",
            fixes=[f"use {CONVERTIBLE_KINDS[0].repo_id}"],
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


def original_expert_config(config: Mapping[str, Any], model_type: str = "t2v") -> dict[str, Any]:
    """The original WanModel config.json for a WanTransformer3DModel config, refusing what WanModel
    cannot express. `model_type` is the model's (TeacherKind.original_model_type): the input channels
    alone do not tell Wan's code which conditioning to build."""
    import diffusers

    check_original_exportable(config)
    heads, head_dim = int(config["num_attention_heads"]), int(config["attention_head_dim"])
    return {
        "_class_name": "WanModel",
        "_diffusers_version": diffusers.__version__,
        "model_type": model_type,
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
