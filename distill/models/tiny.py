"""A tiny, randomly initialised Wan 2.2 T2V A14B teacher in the real diffusers on-disk layout.

Tests and the offline demo need a teacher that loads through exactly the same code path as
`Wan-AI/Wan2.2-T2V-A14B-Diffusers` (model_index.json, text_encoder/, tokenizer/, vae/,
transformer/ = high-noise expert, transformer_2/ = low-noise expert, scheduler/) but builds in
about a second on a CPU with no network. Every component is the real class with a tiny config;
the pipeline's own `save_pretrained` writes the folder, so the layout cannot drift from what
diffusers expects.

    from distill.models.tiny import write_tiny_original_teacher, write_tiny_teacher
    write_tiny_teacher("outputs/tiny_teacher", seed=0)
    write_tiny_original_teacher("outputs/tiny_teacher_original", seed=0)   # the original Wan layout

The other two Wan 2.2 models have tiny teachers in both layouts too (`kind=`, see
distill/models/teacher_kind.py): Wan2.2-I2V-A14B (WanImageToVideoPipeline, two experts with 36
input channels, no image encoder) and Wan2.2-TI2V-5B (WanPipeline with expand_timesteps, one
48-channel transformer, no transformer_2/, the Wan2.2 VAE with 48 latent channels; in the original
layout its one WanModel sits at the top of the folder beside Wan2.2_VAE.pth).

    write_tiny_teacher("outputs/tiny_i2v_teacher", seed=0, kind=I2V_A14B)
    write_tiny_original_teacher("outputs/tiny_ti2v_original", seed=0, kind=TI2V_5B)
"""

from __future__ import annotations

import hashlib
import json
import math
import shutil
import string
import unicodedata
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

import diffusers
import torch
from diffusers import AutoencoderKLWan, UniPCMultistepScheduler, WanPipeline, WanTransformer3DModel
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors
from transformers import T5TokenizerFast, UMT5Config, UMT5EncoderModel

from distill.models.layout import (
    DIFFUSERS_COMPONENTS,
    ORIGINAL_COMPONENTS,
    missing_components,
)
from distill.models.original.detect import ONE_MODEL
from distill.models.teacher_kind import (
    I2V_A14B,
    T2V_A14B,
    TI2V_5B,
    TeacherKind,
    describe_folder,
    read_teacher_kind,
)
from distill.ops.errors import DistillError, Stage
from distill.ops.replace import build_beside, put_in_place

if TYPE_CHECKING:  # importing it prints a transformers warning (CLIPImageProcessor without torchvision)
    from diffusers import WanImageToVideoPipeline

# A folder this small cannot be a real teacher (the A14B one is ~120 GB, even Wan 2.1 1.3B is
# several GB): `is_tiny_teacher` tells the tests' and demos' teachers from downloads.
_TINY_MAX_BYTES = 256 * 1024 * 1024

# The tokenizer is estimated from these prompts. They are varied so that common English
# sub-words become pieces; any other text still tokenizes through single characters.
_TOKENIZER_CORPUS = (
    "a red cube spinning slowly on a wooden table",
    "a cat walking through fresh snow at dawn",
    "a futuristic city at night with neon lights and flying cars",
    "an astronaut riding a horse on the surface of the moon",
    "waves crashing against black rocks under a stormy sky",
    "a bowl of ramen with steam rising, close-up shot",
    "two dogs playing fetch in a sunny park",
    "a drone shot over a green forest with a winding river",
    "a golden retriever puppy sleeping on a blue blanket",
    "a chef chopping vegetables in a busy restaurant kitchen",
    "timelapse of clouds moving over snowy mountains",
    "a paper boat floating down a rainy street",
    "an old man reading a newspaper on a park bench",
    "a hummingbird hovering near a bright pink flower",
    "a steam train crossing a stone bridge in autumn",
    "fireworks exploding over a harbour at midnight",
    "a little girl blowing bubbles in the garden",
    "a macro shot of dew drops on a spider web",
    "a sailboat gliding across a calm turquoise lake",
    "a robot painting a portrait in an art studio",
    "slow motion of a glass of milk spilling on the floor",
    "a fox running across a frozen field",
    "a cozy cabin with smoke curling from the chimney",
    "a skateboarder doing a trick in an empty pool",
    "a jellyfish glowing in the deep dark ocean",
    "children flying colourful kites on a windy beach",
    "a vintage car driving along a coastal road at sunset",
    "a candle flickering in a dark room",
    "a panda eating bamboo in a misty forest",
    "a busy street market in the rain, cinematic lighting",
    "a white horse galloping through tall grass",
    "an aerial view of a desert with sand dunes",
    "a violinist playing on a subway platform",
    "a cup of coffee with latte art, top-down view",
    "lightning striking a lonely tree on a hill",
    "a butterfly landing on a child's hand",
    "Close-up portrait of a woman smiling, 4K, shallow depth of field.",
    "Two people dancing in the street; the camera pans left!",
)

_SPECIAL_TOKENS = ("<pad>", "</s>", "<unk>")  # ids 0, 1, 2 as in T5/UMT5
_METASPACE = "\u2581"  # SentencePiece's word-start marker
_MAX_PIECE_CHARS = 6
_MIN_PIECE_COUNT = 2


@dataclass(frozen=True)
class TinyTeacherShape:
    """Sizes of the tiny teacher. Defaults build in well under a second and save to ~0.5 MB."""

    num_layers: int = 2
    """Transformer blocks in each expert (the real A14B experts have 40)."""
    num_attention_heads: int = 2
    """Attention heads in each expert (real: 40)."""
    attention_head_dim: int = 12
    """Channels per head; must split into Wan's 3-axis rotary embedding (real: 128)."""
    ffn_dim: int = 32
    """Hidden width of each block's feed-forward layer (real: 13824)."""
    text_dim: int = 32
    """Width of the text embeddings, i.e. the UMT5 encoder's d_model (real: 4096)."""
    freq_dim: int = 256
    """Width of the sinusoidal timestep embedding (real: 256)."""
    boundary_ratio: float = 0.875
    """`transformer` (high noise) runs while t >= boundary_ratio * 1000, `transformer_2` below."""
    vae_dim_mult: tuple[int, ...] = (1, 1, 1, 1)
    """VAE width multipliers per stage (real: 1, 2, 4, 4; ORIGINAL_LAYOUT_SHAPE uses those)."""
    vae_num_res_blocks: int = 1
    """Residual blocks per VAE stage (real: 2)."""
    text_relative_max_distance: int = 32
    """UMT5 relative-attention max distance (real: 128, which Wan's own T5 code hard-codes)."""


# The original layout can only express the real structure: diffusers' VAE converter hard-codes
# the real block indices and Wan's T5 code its max distance. Same widths, so still tiny.
ORIGINAL_LAYOUT_SHAPE = TinyTeacherShape(
    vae_dim_mult=(1, 2, 4, 4), vae_num_res_blocks=2, text_relative_max_distance=128
)

# A teacher with one transformer (TI2V-5B) has no transformer_2/.
ONE_EXPERT_COMPONENTS = tuple(c for c in DIFFUSERS_COMPONENTS if c != "transformer_2/")


def tiny_shape(kind: TeacherKind = T2V_A14B) -> TinyTeacherShape:
    """The default shape of a tiny teacher of `kind`: the same sizes, the kind's own expert switch
    (I2V-A14B's boundary is 0.9; TI2V-5B has one transformer, so its boundary is unused)."""
    if kind == I2V_A14B:
        return TinyTeacherShape(boundary_ratio=I2V_A14B.boundary_ratio)
    return TinyTeacherShape()


def write_tiny_teacher(
    out_dir: str | Path,
    seed: int = 0,
    shape: TinyTeacherShape | None = None,
    *,
    kind: TeacherKind = T2V_A14B,
    overwrite: bool = False,
    flag: str = "--tiny",
) -> Path:
    """Write a random tiny Wan 2.2 teacher of `kind` (default T2V A14B) to `out_dir`, in the diffusers
    layout of that model, and return its path. `shape` defaults to `tiny_shape(kind)`.

    The same `seed` and `shape` give byte-identical weight files; a different seed gives
    different weights. The folder appears complete or not at all: everything is written to a
    temporary sibling first and renamed into place. A non-empty `out_dir` that holds anything but
    these very files is refused unless `overwrite=True` (`flag` names the option in the refusal).
    """
    out_dir = Path(out_dir).expanduser().absolute()
    staging = build_beside(out_dir)
    shape = shape if shape is not None else tiny_shape(kind)
    try:
        build_tiny_pipeline(seed, shape, kind).save_pretrained(staging, safe_serialization=True)
        _check_saved_index(staging, shape, kind)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    _put_in_place(staging, out_dir, kind, "diffusers", overwrite, flag)
    return out_dir


def original_layout_shape(kind: TeacherKind = T2V_A14B) -> TinyTeacherShape:
    """ORIGINAL_LAYOUT_SHAPE with the expert switch of `kind` (I2V-A14B: 0.9)."""
    return replace(ORIGINAL_LAYOUT_SHAPE, boundary_ratio=tiny_shape(kind).boundary_ratio)


def write_tiny_original_teacher(
    out_dir: str | Path,
    seed: int = 0,
    shape: TinyTeacherShape | None = None,
    *,
    overwrite: bool = False,
    kind: TeacherKind = T2V_A14B,
    flag: str = "--tiny",
) -> Path:
    """Write the same tiny teacher as `write_tiny_teacher(out_dir, seed, shape, kind=kind)` in the
    ORIGINAL Wan layout of its release: models_t5_umt5-xxl-enc-bf16.pth and google/umt5-xxl/, then
    for the A14B models Wan2.1_VAE.pth and high_noise_model/, low_noise_model/ (config.json
    model_type t2v or i2v, two shards each), for TI2V-5B Wan2.2_VAE.pth and the WanModel at the top
    (config.json model_type ti2v, three shards as the release has). `shape` defaults to
    `original_layout_shape(kind)`. Weights stay float32 whatever the file names say, so a conversion
    can be compared exactly with the diffusers-layout teacher of the same seed, shape and kind.
    """
    from distill.models.original.export import save_original_layout

    shape = shape if shape is not None else original_layout_shape(kind)
    out_dir = Path(out_dir).expanduser().absolute()
    staging = build_beside(out_dir)
    try:
        save_original_layout(
            build_tiny_pipeline(seed, shape, kind),
            staging,
            shape.boundary_ratio,
            shards_per_expert=2 if kind.experts == 2 else 3,
            kind=kind,
        )
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    _put_in_place(staging, out_dir, kind, "original", overwrite, flag)
    return out_dir


def build_tiny_pipeline(
    seed: int = 0,
    shape: TinyTeacherShape = TinyTeacherShape(),  # noqa: B008 - frozen, so a shared default is safe
    kind: TeacherKind = T2V_A14B,
) -> WanPipeline | WanImageToVideoPipeline:
    """The tiny teacher of `kind` as an in-memory stock pipeline (what `write_tiny_teacher` saves).

    Each component is seeded by its name, so the kinds share the tokenizer and text encoder of a
    seed. I2V-A14B has no image encoder: its experts have no image cross-attention (image_dim
    None), and the stock pipeline conditions on the image's latent only, as for the published model.
    """
    tokenizer = build_tiny_tokenizer()
    experts = [
        _seeded(seed, name, lambda: _build_expert(shape, kind.in_channels, kind.out_channels))
        for name in ("transformer", "transformer_2")[: kind.experts]
    ]
    # The kind's stock pipeline, looked up by name: only an image-to-video one imports its module.
    pipeline = (
        WanPipeline if kind.pipeline_class == "WanPipeline" else getattr(diffusers, kind.pipeline_class)
    )
    return pipeline(
        tokenizer=tokenizer,
        text_encoder=_seeded(seed, "text_encoder", lambda: _build_text_encoder(len(tokenizer), shape)),
        vae=_seeded(seed, "vae", lambda: _build_wan22_vae(shape) if kind == TI2V_5B else _build_vae(shape)),
        scheduler=UniPCMultistepScheduler(
            prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=3.0, num_train_timesteps=1000
        ),
        transformer=experts[0],
        transformer_2=experts[1] if kind.experts == 2 else None,
        boundary_ratio=shape.boundary_ratio if kind.experts == 2 else None,
        expand_timesteps=kind.per_token_timesteps,
    )


def build_tiny_tokenizer() -> T5TokenizerFast:
    """A small T5-style Unigram tokenizer (`<pad>`=0, `</s>`=1, `<unk>`=2, appends `</s>`)."""
    return t5_unigram_tokenizer(_unigram_vocab(_TOKENIZER_CORPUS)[len(_SPECIAL_TOKENS) :])


def t5_unigram_tokenizer(pieces: list[tuple[str, float]], model_max_length: int = 512) -> T5TokenizerFast:
    """A T5-style tokenizer over Unigram `pieces` (piece, log-probability): the special tokens
    `<pad>`=0, `</s>`=1, `<unk>`=2 come first, and `</s>` is appended as UMT5 expects."""
    vocab = [(token, 0.0) for token in _SPECIAL_TOKENS] + pieces
    tokenizer = Tokenizer(models.Unigram(vocab, unk_id=2, byte_fallback=False))
    tokenizer.normalizer = normalizers.NFKC()
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace()
    tokenizer.decoder = decoders.Metaspace()
    tokenizer.post_processor = processors.TemplateProcessing(
        single="$A </s>", pair="$A </s> $B </s>", special_tokens=[("</s>", 1)]
    )
    tokenizer.add_special_tokens(list(_SPECIAL_TOKENS))
    return T5TokenizerFast(
        tokenizer_object=tokenizer,
        pad_token="<pad>",
        eos_token="</s>",
        unk_token="<unk>",
        extra_ids=0,  # the sentinel tokens only matter for T5's span-corruption pre-training
        model_max_length=model_max_length,
    )


def is_tiny_teacher(folder: str | Path) -> bool:
    """Whether `folder` holds a complete teacher (either layout) small enough to be a tiny one."""
    folder = Path(folder)
    if (
        missing_components(folder, ONE_EXPERT_COMPONENTS)
        and missing_components(folder, ORIGINAL_COMPONENTS)
        and missing_components(folder, ONE_MODEL.required)
    ):
        return False
    total = sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())
    return total <= _TINY_MAX_BYTES


def _unigram_vocab(corpus: Iterable[str]) -> list[tuple[str, float]]:
    """Unigram pieces and log-probabilities estimated from substring counts of `corpus`.

    tokenizers' UnigramTrainer is not deterministic across processes (its EM result changes
    piece order and scores by ~1e-4 from run to run), which would change token ids and so the
    text encoder's embedding rows. Plain counting is deterministic and good enough for a random
    model: frequent sub-words become pieces, every printable ASCII character stays encodable.
    """
    counts: Counter[str] = Counter()
    for word in _metaspace_words(corpus):
        counts.update(_substrings(word, _MAX_PIECE_CHARS))
    pieces = {p: c for p, c in counts.items() if c >= _MIN_PIECE_COUNT or len(p) == 1}
    for char in string.printable.strip() + _METASPACE:
        pieces.setdefault(char, 0)
    total = sum(pieces.values())
    # Unseen characters get half a count so they stay reachable but are never preferred.
    scored = [(piece, math.log(max(count, 0.5) / total)) for piece, count in pieces.items()]
    scored.sort(key=lambda item: (-item[1], item[0]))
    return [(token, 0.0) for token in _SPECIAL_TOKENS] + scored


def _metaspace_words(corpus: Iterable[str]) -> Iterator[str]:
    """Words as the Metaspace pre-tokenizer sees them: NFKC-normalised, prefixed with '▁'."""
    for sentence in corpus:
        for word in unicodedata.normalize("NFKC", sentence).split():
            yield _METASPACE + word


def _substrings(word: str, max_chars: int) -> Iterator[str]:
    for start in range(len(word)):
        for end in range(start + 1, min(len(word), start + max_chars) + 1):
            yield word[start:end]


def _component_seed(seed: int, component: str) -> int:
    """A seed per component, so the two experts differ and adding a component changes nothing else."""
    digest = hashlib.sha256(f"{seed}:{component}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


def _seeded(seed: int, component: str, build):
    """Run `build()` under the component's seed without disturbing the caller's RNG state."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(_component_seed(seed, component))
        return build().eval()


def _build_expert(
    shape: TinyTeacherShape, in_channels: int = 16, out_channels: int = 16
) -> WanTransformer3DModel:
    return WanTransformer3DModel(
        patch_size=(1, 2, 2),
        num_attention_heads=shape.num_attention_heads,
        attention_head_dim=shape.attention_head_dim,
        in_channels=in_channels,
        out_channels=out_channels,
        text_dim=shape.text_dim,
        freq_dim=shape.freq_dim,
        ffn_dim=shape.ffn_dim,
        num_layers=shape.num_layers,
        cross_attn_norm=True,
        qk_norm="rms_norm_across_heads",
        rope_max_seq_len=32,
    )


def _build_text_encoder(vocab_size: int, shape: TinyTeacherShape) -> UMT5EncoderModel:
    config = UMT5Config(
        vocab_size=vocab_size,
        d_model=shape.text_dim,
        d_kv=8,
        d_ff=64,
        num_layers=2,
        num_decoder_layers=2,
        num_heads=4,
        relative_attention_num_buckets=8,
        relative_attention_max_distance=shape.text_relative_max_distance,
        feed_forward_proj="gated-gelu",
        pad_token_id=0,
        eos_token_id=1,
        decoder_start_token_id=0,
    )
    return UMT5EncoderModel(config)


def _build_vae(shape: TinyTeacherShape) -> AutoencoderKLWan:
    # 16 latent channels and strides 4 (time) / 8 (space), like the real Wan VAE.
    return AutoencoderKLWan(
        base_dim=3,
        z_dim=16,
        dim_mult=list(shape.vae_dim_mult),
        num_res_blocks=shape.vae_num_res_blocks,
        temperal_downsample=[False, True, True],
    )


def _build_wan22_vae(shape: TinyTeacherShape) -> AutoencoderKLWan:
    # The Wan2.2 VAE's structure (TI2V-5B): 2x2 pixel patchify into 12 channels, residual blocks,
    # 48 latent channels, strides 4 (time) / 16 (space); tiny widths. Mean 0 / std 1 per channel
    # (the real one's 48 values are its own statistics; a random VAE has none).
    return AutoencoderKLWan(
        base_dim=8,
        decoder_base_dim=8,
        z_dim=48,
        dim_mult=list(shape.vae_dim_mult),
        num_res_blocks=shape.vae_num_res_blocks,
        temperal_downsample=[False, True, True],
        is_residual=True,
        in_channels=12,
        out_channels=12,
        patch_size=2,
        scale_factor_spatial=16,
        scale_factor_temporal=4,
        latents_mean=[0.0] * 48,
        latents_std=[1.0] * 48,
    )


def _put_in_place(
    staging: Path, out_dir: Path, kind: TeacherKind, layout: str, overwrite: bool, flag: str
) -> None:
    """The built teacher into `out_dir` under the one overwrite rule (distill/ops/replace.py): a folder
    holding anything but these very files is replaced only with `overwrite`."""
    put_in_place(
        staging,
        out_dir,
        flag=flag,
        holds=describe_folder(out_dir),
        writing=f"a tiny random {kind.model} teacher ({layout} layout)",
        overwrite=overwrite,
    )


def _check_saved_index(folder: Path, shape: TinyTeacherShape, kind: TeacherKind = T2V_A14B) -> None:
    """Fail early if a diffusers change stops save_pretrained from writing the layout of `kind`."""
    index = json.loads((folder / "model_index.json").read_text())
    two = kind.experts == 2
    missing = missing_components(folder, DIFFUSERS_COMPONENTS if two else ONE_EXPERT_COMPONENTS)
    reading = read_teacher_kind(folder)
    # A model with one transformer saves `"transformer_2": [null, null]`, or nothing.
    listed = index.get("transformer_2") not in (None, [None, None])
    if (
        missing
        or index.get("boundary_ratio") != (shape.boundary_ratio if two else None)
        or listed != two
        or reading is None
        or reading.kind != kind
    ):
        raise DistillError(
            f"The tiny teacher was not saved in the {kind.model} layout",
            f"missing: {missing}; model_index.json: {json.dumps(index)}; shape: {asdict(shape)}",
            causes=[f"An installed diffusers version saves {kind.pipeline_class} differently."],
            fixes=["Install the diffusers version pinned in requirements.txt."],
            stage=Stage.INTERNAL,
        )
