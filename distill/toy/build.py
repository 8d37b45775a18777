"""Train the toy Wan 2.2 teacher on the toy world (`shipped` copies the trained one out as a teacher folder).

    python -m distill.toy.build --retrain          # refit everything into assets/toy_teacher/ (hours)
    python -m distill.toy.build --retrain --from assets/toy_teacher --vae_steps 0 --expert_steps 12000
                                                   # train the experts further on pictures and clips (~1 h)
    python -m distill.toy.build --retrain --from assets/toy_teacher --vae_steps 0 --layers 6 --ffn_dim 512
                                                   # the same with deeper, wider experts (`grow`: they
                                                   # start out computing what the shipped ones do)
    python -m distill.toy.build --retrain --from assets/toy_teacher --vae_steps 0 --layers 5 \
        --train_experts low                        # only the low-noise expert trains and grows (it sets
                                                   # a clip's speed); the high-noise one stays as it is
    python download_wan.py --toy outputs/toy-wan   # a teacher folder from the shipped weights (seconds)

Trained like the real one, in miniature, at 32 x 32 pixels, on pictures (1 frame) AND clips
(`clip_frames`, 3 latent frames), as Wan is trained on both, so one teacher serves both:

1. The text encoder is a fixed random UMT5 (a feature map) behind a tokenizer whose pieces are
   the grammar's words: the picture words first, then the clip words (so adding the clips left
   every picture prompt's embedding as it was).
2. The VAE (AutoencoderKLWan, 16 latent channels, stride 8, time stride 4) is fitted to rendered
   pictures and clips, then `latents_mean` / `latents_std` in its config are set from its latents,
   so WanPipeline's un-normalisation before decoding is right. The build stops unless the
   reconstructed clips show their motion (`vae_fit.GATE`).
3. The experts (WanTransformer3DModel) learn flow matching on the normalised latents with
   WanPipeline's conventions: x_t = (1 - s) x0 + s noise, target v = noise - x0,
   timestep = 1000 s, s on the scheduler's shifted schedule; `transformer` (high noise) on
   s >= boundary_ratio, `transformer_2` below (each a little past the boundary). The prompt is
   replaced by the empty prompt for `text_dropout` of the samples, so guidance has an
   unconditional branch to push against.

Training speed: WanPipeline pads every prompt to 512 tokens with zeros and Wan's cross-attention
has no mask, so the ~500 padding tokens are identical keys and values. Training keeps one of them
and adds log(count) to its attention logit, which gives exactly the attention over all of them
(checked before training) at a fraction of the cost. The saved experts are plain diffusers models.
"""

from __future__ import annotations

import json
import os
import shutil
import string
import sys
import uuid
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from distill.ops.command import Parser, PathAction, entry_point, integer, number
from distill.ops.errors import DistillError, Stage, report
from distill.ops.paths import Kind, PathFlag, check_paths
from distill.toy import world
from distill.toy.expert_training import FOCUS_SIGMA, train_experts
from distill.toy.grow import EXPERT_FOLDERS, expert_shape, grow_expert
from distill.toy.recipe import Recipe
from distill.toy.shipped import ASSETS
from distill.toy.starting_points import check_starting_points, toy_vae_shape
from distill.toy.text_padding import check_folding, fold_padding
from distill.toy.vae_fit import (
    GATE,
    clip_reconstruction_score,
    encode_pictures,
    encode_scenes,
    fit_vae,
    reconstruction_score,
)

MAX_SEQUENCE_LENGTH = 512  # WanPipeline's default, which the trainer uses too
_METASPACE = "\u2581"


# ---------------------------------------------------------------------------------------------
# Components
# ---------------------------------------------------------------------------------------------


def _words(prompts: list[str]) -> list[str]:
    return sorted({w for p in prompts for w in p.split()})


def build_tokenizer(clips: bool = True, extra_words: tuple[str, ...] = ()) -> Any:
    """A T5-style Unigram tokenizer whose pieces are the grammar's words (plus single characters,
    so any text still tokenizes). The clip grammar's own words come last, so a picture-only
    tokenizer (`clips=False`) gives every picture prompt the same ids; `extra_words` (those not
    already pieces) come after them, so they leave every world prompt's ids as they were."""
    from distill.models.tiny import t5_unigram_tokenizer

    pieces = [(_METASPACE + w, -2.0) for w in _words(world.all_prompts())]
    pieces += [(c, -8.0) for c in sorted(set(string.printable.strip()) | {_METASPACE})]
    if clips:
        picture_words = set(_words(world.all_prompts()))
        pieces += [(_METASPACE + w, -2.0) for w in _words(world.all_clip_prompts()) if w not in picture_words]
    known = {piece for piece, _ in pieces}
    pieces += [(_METASPACE + w, -2.0) for w in dict.fromkeys(extra_words) if _METASPACE + w not in known]
    return t5_unigram_tokenizer(pieces, MAX_SEQUENCE_LENGTH)


def grow_text_encoder(text_encoder: Any, vocab_size: int, seed: int) -> Any:
    """Give a fixed random text encoder rows for new words (drawn like its own, from `seed`),
    leaving every existing row, and so every old prompt's embedding, unchanged."""
    old = text_encoder.get_input_embeddings().weight.shape[0]
    if vocab_size <= old:
        return text_encoder
    spread = float(text_encoder.get_input_embeddings().weight.detach().std())
    text_encoder.resize_token_embeddings(vocab_size, mean_resizing=False)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        rows = text_encoder.get_input_embeddings().weight
        rows[old:] = torch.randn(vocab_size - old, rows.shape[1], generator=generator) * spread
    return text_encoder


def build_components(recipe: Recipe) -> dict[str, Any]:
    """Untrained components, each from its own seed."""
    from diffusers import AutoencoderKLWan, UniPCMultistepScheduler, WanTransformer3DModel
    from transformers import UMT5Config, UMT5EncoderModel

    tokenizer = build_tokenizer(clips=recipe.clip_frames > 0)
    picture_vocab = len(build_tokenizer(clips=False))

    def seeded(offset: int, build: Any) -> Any:
        torch.manual_seed(recipe.seed * 1000 + offset)
        return build()

    def expert() -> Any:
        return WanTransformer3DModel(
            patch_size=(1, recipe.spatial_patch, recipe.spatial_patch),
            num_attention_heads=recipe.heads,
            attention_head_dim=recipe.head_dim,
            in_channels=16,
            out_channels=16,
            text_dim=recipe.text_dim,
            freq_dim=256,
            ffn_dim=recipe.ffn_dim,
            num_layers=recipe.layers,
            cross_attn_norm=True,
            qk_norm="rms_norm_across_heads",
            rope_max_seq_len=32,
        )

    # Sized for the picture words, then grown: the picture teacher's encoder plus the clip words.
    text_config = UMT5Config(
        vocab_size=picture_vocab,
        d_model=recipe.text_dim,
        d_kv=8,
        d_ff=64,
        num_layers=2,
        num_decoder_layers=2,
        num_heads=4,
        relative_attention_num_buckets=8,
        relative_attention_max_distance=32,
        feed_forward_proj="gated-gelu",
        pad_token_id=0,
        eos_token_id=1,
        decoder_start_token_id=0,
    )
    return {
        "tokenizer": tokenizer,
        "text_encoder": grow_text_encoder(
            seeded(1, lambda: UMT5EncoderModel(text_config)).eval(), len(tokenizer), recipe.seed * 1000 + 5
        ),
        "vae": seeded(2, lambda: AutoencoderKLWan(**toy_vae_shape(recipe))),
        "scheduler": UniPCMultistepScheduler(
            prediction_type="flow_prediction",
            use_flow_sigmas=True,
            flow_shift=recipe.flow_shift,
            num_train_timesteps=1000,
        ),
        "transformer": seeded(3, expert),
        "transformer_2": seeded(4, expert),
    }


# ---------------------------------------------------------------------------------------------
# Text: embeddings with the padding folded into one weighted token
# ---------------------------------------------------------------------------------------------


# Prompts per text-encoder call: the encoder attends over all 512 padded tokens, so encoding the
# world's ~2,600 prompts at once took ~11 GB for the attention weights alone; 64 take ~0.3 GB.
TEXT_CHUNK = 64


@torch.no_grad()
def encode_texts(tokenizer: Any, text_encoder: Any, prompts: list[str]) -> torch.Tensor:
    """(N, 512, D) zero-padded embeddings, exactly as WanPipeline.encode_prompt makes them."""
    from diffusers import WanPipeline

    pipe = WanPipeline(tokenizer=tokenizer, text_encoder=text_encoder, vae=None, scheduler=None)
    chunks = [
        pipe.encode_prompt(
            prompts[start : start + TEXT_CHUNK],
            do_classifier_free_guidance=False,
            max_sequence_length=MAX_SEQUENCE_LENGTH,
            device=torch.device("cpu"),
            dtype=torch.float32,
        )[0]
        for start in range(0, len(prompts), TEXT_CHUNK)
    ]
    return torch.cat(chunks)


# ---------------------------------------------------------------------------------------------
# The whole build
# ---------------------------------------------------------------------------------------------


def experts_to_train_from(folder: Path, recipe: Recipe, log: Any = print) -> dict[str, Any]:
    """The experts of the teacher in `folder`, by folder name; the trained ones (recipe.trained_experts)
    grown to recipe.layers / recipe.ffn_dim. Only an expert that trains grows: new blocks in one that
    does not would stay zero, costing every forward and adding nothing."""
    from diffusers import WanTransformer3DModel

    experts = {}
    for offset, (short, name) in enumerate(EXPERT_FOLDERS.items()):
        expert = WanTransformer3DModel.from_pretrained(folder / name)
        shape = (expert.config.num_layers, expert.config.ffn_dim)
        if short in recipe.trained_experts and shape != (recipe.layers, recipe.ffn_dim):
            log(
                f"{name}: grown from {shape[0]} to {recipe.layers} layers, ffn_dim {shape[1]} to {recipe.ffn_dim}"
            )
            expert = grow_expert(expert, recipe.layers, recipe.ffn_dim, seed=recipe.seed * 1000 + 3 + offset)
        experts[name] = expert
    return experts


def train(
    recipe: Recipe,
    out_dir: Path,
    log: Any = print,
    vae_from: Path | None = None,
    experts_from: Path | None = None,
) -> Path:
    """Fit the VAE, train both experts and save the teacher folder (with toy_world.json) to `out_dir`.
    `vae_from` / `experts_from`: teacher folders (or a VAE folder) to start from instead of random."""
    from diffusers import AutoencoderKLWan, WanPipeline

    parts = build_components(recipe)
    tokenizer, text_encoder = parts["tokenizer"], parts["text_encoder"]
    if vae_from is not None:
        vae_folder = Path(vae_from) / "vae" if (Path(vae_from) / "vae").is_dir() else Path(vae_from)
        parts["vae"] = AutoencoderKLWan.from_pretrained(vae_folder)
    if experts_from is not None:
        parts.update(experts_to_train_from(Path(experts_from), recipe, log))
    if recipe.vae_steps > 0:
        fit_vae(parts["vae"], recipe, log)
        # The slowest part: kept beside the output, so a failure later does not cost it again.
        parts["vae"].save_pretrained(out_dir.parent / f"{out_dir.name}.vae")
    log(f"vae reconstructions: {reconstruction_score(parts['vae'], recipe)}")
    if recipe.clip_frames:  # before any latent is encoded: a VAE that loses the motion costs nothing more
        gate = clip_reconstruction_score(parts["vae"], recipe)
        log(f"vae clip reconstructions: {gate}")
        if not gate["passes_gate"]:
            raise DistillError(
                "The toy VAE loses the clips' motion",
                f"reconstructed clips score {gate}; the gate is {GATE}",
                fixes=["Fit the VAE longer: --vae_steps (from the saved one: --vae_from DIR.vae)"],
                stage=Stage.INTERNAL,
            )
    scenes = world.sample_scenes(recipe.num_latents, recipe.seed * 7919 + 10**6 + 3)
    latents = encode_pictures(parts["vae"], scenes, recipe.size)
    prompts = world.all_prompts()
    clip_scenes: list[world.Scene] = []
    if recipe.clip_frames:
        clip_scenes = world.sample_scenes(recipe.num_clip_latents, recipe.seed * 7919 + 10**6 + 6, clips=True)
        prompts = [*prompts, *world.all_clip_prompts()]
    table = encode_texts(tokenizer, text_encoder, [*prompts, ""])
    lengths = [int(n) for n in tokenizer([*prompts, ""], return_length=True)["length"]]
    difference = check_folding(parts["transformer"], table[:8], lengths[:8])
    if difference > 1e-4:
        raise DistillError(
            "Folding the prompt padding changed the experts' output",
            f"largest difference {difference:.3g}",
            causes=["The installed diffusers changed Wan's cross-attention."],
            fixes=["Install the diffusers version pinned in requirements.txt."],
            stage=Stage.INTERNAL,
        )
    index = {p: i for i, p in enumerate(prompts)}
    data = [(latents, torch.tensor([index[s.prompt] for s in scenes]), recipe.expert_batch)]
    if clip_scenes:
        clip_latents = encode_scenes(parts["vae"], clip_scenes, recipe)
        data.append(
            (clip_latents, torch.tensor([index[s.prompt] for s in clip_scenes]), recipe.expert_clip_batch)
        )
    shapes = ", ".join(str(tuple(d[0].shape)) for d in data)
    log(f"latents {shapes}, {len(prompts)} prompts, padding folding exact to {difference:.1e}")
    train_experts(
        parts["transformer"], parts["transformer_2"], data, fold_padding(table, lengths), recipe, log
    )
    pipe = WanPipeline(**parts, boundary_ratio=recipe.boundary_ratio)
    staging = out_dir.parent / f".{out_dir.name}.partial-{uuid.uuid4().hex[:8]}"
    pipe.save_pretrained(staging, safe_serialization=True)
    forget_source_paths(staging)
    write_world_file(staging, recipe)
    if out_dir.exists():
        shutil.rmtree(out_dir)
    os.replace(staging, out_dir)
    return out_dir


def forget_source_paths(folder: Path, configs: str = "*/config.json") -> None:
    """Drop `_name_or_path` from the saved configs (`configs`, a glob in `folder`): a part loaded with
    --from records the folder it came from, and a shipped folder must carry no machine's paths."""
    for config in folder.glob(configs):
        settings = json.loads(config.read_text())
        if settings.pop("_name_or_path", None) is not None:
            config.write_text(json.dumps(settings, indent=2, sort_keys=True) + "\n")


def write_world_file(
    folder: Path,
    recipe: Recipe,
    calibration: dict[str, Any] | None = None,
    rebuild: str = "python -m distill.toy.build --retrain",
    clip_calibration: dict[str, Any] | None = None,
) -> None:
    description = world.describe(
        height=recipe.size,
        width=recipe.size,
        num_frames=1,
        clip_frames=recipe.clip_frames,
        sample_steps=recipe.sample_steps,
        guidance_scale=recipe.guidance_scale,
        guidance_scale_2=recipe.guidance_scale_2,
        clip_guidance_scale=recipe.clip_guidance_scale,
        clip_guidance_scale_2=recipe.clip_guidance_scale_2,
        recipe=asdict(recipe),
        rebuild=rebuild,
    )
    if calibration is not None:
        description["calibration"] = calibration
    if clip_calibration is not None:
        description["clip_calibration"] = clip_calibration
    (folder / world.WORLD_FILE).write_text(json.dumps(description, indent=2) + "\n")


def trained_shape(teacher: Path, trained: tuple[str, ...]) -> dict[str, int]:
    """The shape the trained experts of `teacher` start from: the largest of theirs (a smaller one
    grows to it), and their patch."""
    shapes = [expert_shape(teacher, name) for name in trained]
    return {key: max(shape[key] for shape in shapes) for key in shapes[0]}


@entry_point
def main(argv: list[str] | None = None) -> int:
    parser = Parser(prog="python -m distill.toy.build", description=__doc__.split("\n\n")[0])
    parser.add_argument("--retrain", action="store_true", help="train the toy teacher again (minutes)")
    parser.add_argument(
        "--output",
        default=str(ASSETS),
        action=PathAction,
        kind=Kind.OUTPUT_FOLDER,
        help="where the trained teacher goes",
    )
    parser.add_argument("--seed", type=integer(0), default=0)
    parser.add_argument("--expert_steps", type=integer(1), default=Recipe.expert_steps)
    parser.add_argument("--vae_steps", type=integer(0), default=Recipe.vae_steps)
    parser.add_argument(
        "--vae_from",
        action=PathAction,
        kind=Kind.FOLDER,
        help="start from this VAE folder (fitted further for --vae_steps; 0 = use as is)",
    )
    parser.add_argument(
        "--from",
        dest="start_from",
        action=PathAction,
        kind=Kind.FOLDER,
        help="start from this toy teacher folder: its VAE (unless --vae_from) and its experts",
    )
    parser.add_argument("--expert_lr", type=number(0.0, above=True), default=Recipe.expert_lr)
    parser.add_argument(
        "--expert_clip_batch", type=integer(1), default=Recipe.expert_clip_batch, help="clips per expert step"
    )
    parser.add_argument(
        "--expert_batch", type=integer(1), default=Recipe.expert_batch, help="pictures per expert step"
    )
    parser.add_argument(
        "--train_experts",
        default=",".join(Recipe.trained_experts),
        help="which experts train: high,low (both), high or low; with --from the others stay as they are",
    )
    parser.add_argument(
        "--low_focus",
        type=number(0.0),
        default=Recipe.low_focus,
        help=f"fraction of the low-noise expert's samples drawn from sigma >= {FOCUS_SIGMA}, where a "
        "clip's speed is decided (0 = its whole range evenly)",
    )
    parser.add_argument(
        "--layers",
        type=integer(1),
        help=f"blocks per trained expert (default: the --from teacher's deepest trained one, else "
        f"{Recipe.layers}); more than the --from teacher's grows the trained experts without changing "
        "their output (an expert that does not train keeps its shape)",
    )
    parser.add_argument(
        "--ffn_dim",
        type=integer(1),
        help=f"feed-forward width of the trained experts (default: the --from teacher's widest trained "
        f"one, else {Recipe.ffn_dim})",
    )
    parser.add_argument(
        "--spatial_patch",
        type=int,
        choices=(1, 2),
        help=f"height and width of the experts' patches (default: the --from teacher's, else "
        f"{Recipe.spatial_patch}); 1 gives each latent pixel its own token",
    )
    parser.add_argument(
        "--clip_frames",
        type=integer(0),
        default=Recipe.clip_frames,
        help="frames of the clips; 0 = pictures only",
    )
    parser.add_argument(
        "--threads",
        type=integer(1),
        default=1,
        help="CPU threads (1 is fastest on a machine shared with other jobs)",
    )
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    if not args.retrain:
        parser.error("pass --retrain to train the toy teacher (it replaces the --output folder)")
    command = "python -m distill.toy.build " + " ".join(argv if argv is not None else sys.argv[1:])
    try:
        check_paths(  # before minutes of fitting: the output and both starting points
            [
                PathFlag("--output", args.output, Kind.OUTPUT_FOLDER),
                PathFlag("--from", args.start_from, Kind.FOLDER),
                PathFlag("--vae_from", args.vae_from, Kind.FOLDER),
            ]
        )
        for flag in ("layers", "ffn_dim"):
            if getattr(args, flag) is not None and getattr(args, flag) < 1:
                parser.error(f"--{flag} {getattr(args, flag)}: give a positive number")
        trained = tuple(name.strip() for name in args.train_experts.split(",") if name.strip())
        if not trained or set(trained) - {"high", "low"} or len(set(trained)) != len(trained):
            parser.error(f"--train_experts {args.train_experts!r}: give high,low (both), high or low")
        if len(trained) < 2 and not args.start_from:
            parser.error(
                f"--train_experts {args.train_experts}: the other expert would stay untrained; "
                "give --from a trained teacher, or train both"
            )
        if not 0.0 <= args.low_focus <= 1.0:
            parser.error(f"--low_focus {args.low_focus}: give a fraction between 0 and 1")
        check_starting_points(args.start_from, args.vae_from, Recipe())
        start = trained_shape(Path(args.start_from), trained) if args.start_from else {}
        layers = args.layers or start.get("layers", Recipe.layers)
        ffn_dim = args.ffn_dim or start.get("ffn_dim", Recipe.ffn_dim)
        patch = args.spatial_patch or start.get("spatial_patch", Recipe.spatial_patch)
        if layers < start.get("layers", 0) or ffn_dim < start.get("ffn_dim", 0):
            parser.error(
                f"--layers {layers} / --ffn_dim {ffn_dim}: the --from teacher's trained experts have "
                f"{start['layers']} layers and ffn_dim {start['ffn_dim']}; they can grow, not shrink"
            )
        if patch != start.get("spatial_patch", patch):
            parser.error(
                f"--spatial_patch {patch}: the --from teacher's experts were trained on patches of "
                f"{start['spatial_patch']}; leave --spatial_patch out, or train new experts (no --from; "
                "--vae_from keeps the VAE)"
            )
        recipe = Recipe(
            seed=args.seed,
            layers=layers,
            ffn_dim=ffn_dim,
            spatial_patch=patch,
            expert_steps=args.expert_steps,
            vae_steps=args.vae_steps,
            expert_lr=args.expert_lr,
            expert_clip_batch=args.expert_clip_batch,
            expert_batch=args.expert_batch,
            trained_experts=trained,
            low_focus=args.low_focus,
            clip_frames=args.clip_frames,
        )
        path = train(
            recipe,
            Path(args.output),
            vae_from=args.vae_from or args.start_from,
            experts_from=args.start_from,
        )
        from distill.toy.evaluation import calibrate

        numbers = calibrate(path)
        clip_numbers = calibrate(path, clips=True) if recipe.clip_frames else None
        write_world_file(path, recipe, numbers, command, clip_numbers)
        print(json.dumps({"pictures": numbers, "clips": clip_numbers}, indent=2))
    except DistillError as error:
        return report(error)
    return 0


if __name__ == "__main__":
    sys.exit(main())
