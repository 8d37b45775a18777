"""The configs of each component, read from the original checkpoint's own tensors and config.json,
and back: which settings the original layout can express (a student must fit them to be exported)."""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from distill.models.original.detect import T5_MAX_DISTANCE
from distill.models.teacher_kind import KINDS
from distill.ops.errors import DistillError, Stage

# The models whose original layout converts: the two-expert ones (T2V-A14B, I2V-A14B), which share
# the VAE, the T5 and the expert folders. TI2V-5B has one transformer and the Wan2.2 VAE.
CONVERTIBLE_KINDS = tuple(k for k in KINDS if k.experts == 2)


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
    if cfg["model_type"] not in {k.original_model_type for k in CONVERTIBLE_KINDS}:
        raise DistillError(
            f"this expert is a Wan {cfg['model_type']!r} model; the conversion takes "
            + " and ".join(f"{k.original_model_type} ({k.model})" for k in CONVERTIBLE_KINDS)
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
