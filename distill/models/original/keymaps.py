"""Key maps between the original layout's tensor names and diffusers'/transformers': the T5 encoder's
own nine rules, and the inverses of diffusers' DiT and VAE converters, checked against them on use."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from distill.ops.errors import DistillError, Stage

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


def renamed_keys(converter: Callable[[dict], dict], keys: Iterable[str]) -> dict[str, str]:
    """What a diffusers converter renames each key to, without touching any tensor: the
    text-to-video converters only move values between keys, so the values can be the old names."""
    return dict(converter({k: k for k in keys}))


def _check_round_trip(names: Mapping[str, str], converter: Callable[[dict], dict], what: str) -> None:
    back = renamed_keys(converter, names.values())
    wrong = [k for k, new in names.items() if back.get(k) != new]
    if wrong or len(back) != len(names):
        raise DistillError(
            f"the {what} cannot be written in the original Wan format",
            "diffusers' converter would not read these keys back: " + ", ".join(wrong[:8]),
            causes=["a block structure the original format (and diffusers' converter) does not have"],
            stage=Stage.CHECKPOINT,
        )


# The Wan2.2 VAE (TI2V-5B's Wan2.2_VAE.pth, wan/modules/vae2_2.py). diffusers' library has no
# converter for it (only a hub script), so both directions are ours, checked against each other.
# In Wan's code each encoder stage `downsamples.{i}` holds its own `downsamples` list: num_res_blocks
# residual blocks, then the resample (every stage but the last); each decoder stage
# `upsamples.{i}.upsamples` holds num_res_blocks + 1 residual blocks, then the resample. Their
# shortcuts (AvgDown3D, DupUp3D) have no weights. diffusers calls the blocks resnets.{j} and the
# resample downsampler / upsampler, without an index.
_VAE22_PREFIXES = (
    ("conv1.", "quant_conv."),
    ("conv2.", "post_quant_conv."),
    *(
        (f"{side}.{original}", f"{side}.{diffusers}")
        for side in ("encoder", "decoder")
        for original, diffusers in (
            ("conv1.", "conv_in."),
            ("head.0.", "norm_out."),
            ("head.2.", "conv_out."),
            ("middle.0.", "mid_block.resnets.0."),
            ("middle.1.", "mid_block.attentions.0."),
            ("middle.2.", "mid_block.resnets.1."),
        )
    ),
)
_VAE22_STAGE = re.compile(
    r"(encoder\.downsamples|decoder\.upsamples)\.(\d+)\.(?:downsamples|upsamples)\.(\d+)\.(.*)"
)
_VAE22_BLOCK = re.compile(
    r"(encoder\.down_blocks|decoder\.up_blocks)\.(\d+)\.(?:resnets\.(\d+)|(downsampler|upsampler))\.(.*)"
)
_VAE22_SIDES = {"encoder.downsamples": "encoder.down_blocks", "decoder.upsamples": "decoder.up_blocks"}


def _residual_to_diffusers(rest: str) -> str:
    for new, old in _VAE_RESIDUAL.items():
        if rest.startswith(old):
            return new + rest[len(old) :]
    return rest


def _vae22_key_to_diffusers(key: str) -> str | None:
    if match := _VAE22_STAGE.fullmatch(key):
        side, stage, index, rest = match.groups()
        if rest.startswith(("resample.", "time_conv.")):
            sampler = "downsampler" if side.startswith("encoder") else "upsampler"
            return f"{_VAE22_SIDES[side]}.{stage}.{sampler}.{rest}"
        return f"{_VAE22_SIDES[side]}.{stage}.resnets.{index}.{_residual_to_diffusers(rest)}"
    for original, diffusers in _VAE22_PREFIXES:
        if key.startswith(original):
            rest = key[len(original) :]
            return diffusers + (_residual_to_diffusers(rest) if "resnets" in diffusers else rest)
    return None


def _vae22_key_to_original(key: str, num_res_blocks: int) -> str | None:
    if match := _VAE22_BLOCK.fullmatch(key):
        side, stage, index, sampler, rest = match.groups()
        original = next(o for o, d in _VAE22_SIDES.items() if d == side)
        inner = original.split(".")[1]
        if sampler is None:
            return f"{original}.{stage}.{inner}.{index}.{_vae_residual(rest)}"
        # The resample follows the stage's residual blocks: num_res_blocks of them in an encoder
        # stage, one more in a decoder stage.
        position = num_res_blocks + (sampler == "upsampler")
        return f"{original}.{stage}.{inner}.{position}.{rest}"
    for original, diffusers in _VAE22_PREFIXES:
        if key.startswith(diffusers):
            rest = key[len(diffusers) :]
            return original + (_vae_residual(rest) if "resnets" in diffusers else rest)
    return None


def vae22_to_diffusers(state: Mapping[str, Any]) -> dict[str, Any]:
    """Wan2.2_VAE.pth keys -> AutoencoderKLWan keys (the Wan2.2 VAE: is_residual, 48 channels)."""
    names = {key: _vae22_key_to_diffusers(key) for key in state}
    unknown = [k for k, new in names.items() if new is None]
    if unknown:
        raise DistillError(
            "the Wan2.2 VAE checkpoint has keys no rule maps",
            ", ".join(unknown[:8]),
            causes=["a Wan2.1 VAE (Wan2.1_VAE.pth) or another model's VAE under this name"],
            stage=Stage.TEACHER_LOAD,
        )
    return {names[k]: v for k, v in state.items()}


def vae22_to_original(state: Mapping[str, Any], num_res_blocks: int = 2) -> dict[str, Any]:
    """AutoencoderKLWan keys of a Wan2.2 VAE -> Wan2.2_VAE.pth keys, checked by mapping them back."""
    names = {key: _vae22_key_to_original(key, num_res_blocks) for key in state}
    back = {k: _vae22_key_to_diffusers(new) if new is not None else None for k, new in names.items()}
    wrong = [k for k, new in back.items() if new != k]
    if wrong:
        raise DistillError(
            "the VAE cannot be written in the original Wan2.2 format",
            "no key of Wan2.2_VAE.pth maps back to: " + ", ".join(wrong[:8]),
            causes=["not a Wan2.2 VAE (AutoencoderKLWan with is_residual true)"],
            stage=Stage.CHECKPOINT,
        )
    return {names[k]: v for k, v in state.items()}
