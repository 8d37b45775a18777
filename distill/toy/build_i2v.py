"""Grow the toy image-to-video teacher (Wan2.2-I2V-A14B layout) from the shipped toy T2V teacher.

    python -m distill.toy.build_i2v --retrain --device cuda   # rebuild assets/toy_i2v_teacher/ (~7 min
                                                       # on one GPU; ~1 h on one CPU thread)
    python -m distill.toy.build_i2v --retrain --from assets/toy_i2v_teacher --decoder_steps 0 \
        --expert_steps 2000 --expert_lr 4e-4 --num_clips 2048 --motion_batch 96 --named_batch 32
                                                       # train its experts further (what the shipped
                                                       # one had after the first command; ~1 h, one thread)
    python -m distill.toy.build_i2v --retrain --vae_from outputs/toy_i2v_vae --decoder_steps 0
                                                       # reuse a refit decoder (`decoder_refit`)
    python download_wan.py --toy DIR --toy_kind i2v    # a teacher folder from the shipped weights

What it does, in order (each part keeps what the toy teacher already knows):
1. The VAE: the toy teacher's, with only its decoder refit (`decoder_refit`; the encoder frozen, so
   every latent, latents_mean / latents_std and the experts stay valid); the build stops unless its
   round trip of the world's own clips then adheres to their frame 0 (image_score) on at least
   decoder_refit.ADHERENCE_GATE.
2. The text: the toy teacher's fixed random UMT5 and tokenizer, plus a piece (and an encoder row)
   for each word of image_score.MOTION_SUBJECT the tokenizer lacks ("shape"), appended last, so
   every world prompt keeps its ids and embedding.
3. The experts: the toy teacher's two, each patch embedding widened to I2V-A14B's 36 input channels
   with zero weights for the 20 new ones (`student_kind.widen_patch_embedding`), so training starts
   from the T2V teacher exactly; then flow matching as `build` trains them (same sigma range per
   expert around the I2V boundary, text dropout) on the world's clips, each conditioned on its own
   frame 0 exactly as `image_condition(kind=I2V_A14B)` (and so WanImageToVideoPipeline) makes it:
   mask + the latent of [image, then zero (mid-grey) frames]. The prompt is the motion only ("the shape moving
   leftward fast") for most clips, so the image alone decides colour, shape, size, place and
   background, and the full clip prompt for the rest.
4. Saved with stock WanImageToVideoPipeline.save_pretrained (no image encoder, as the published
   model), boundary_ratio I2V_A14B's 0.9, plus toy_world.json with the held-out score
   (`i2v_evaluation`).
"""

from __future__ import annotations

import json
import sys
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch

from distill.ops.command import Parser, PathAction, entry_point, integer, number
from distill.ops.errors import DistillError, Stage, report
from distill.ops.paths import Kind
from distill.toy import world
from distill.toy.build import build_tokenizer, encode_texts, forget_source_paths, grow_text_encoder
from distill.toy.decoder_refit import ADHERENCE_GATE, refit_decoder, round_trip_adherence
from distill.toy.expert_training import train_experts
from distill.toy.grow import EXPERT_FOLDERS
from distill.toy.image_score import MOTION_SUBJECT, motion_prompt
from distill.toy.recipe import Recipe
from distill.toy.render import render_clips
from distill.toy.shipped import ASSETS, I2V_ASSETS, staged_folder
from distill.toy.text_padding import fold_padding
from distill.toy.vae_fit import encode_scenes, to_vae_input


@dataclass(frozen=True)
class I2VRecipe:
    """What decides the I2V teacher's weights beyond the T2V teacher it grows from (toy_world.json)."""

    seed: int = 0
    boundary_ratio: float = 0.9
    """I2V-A14B's published switch; the T2V experts trained 0.03 past 0.875 both ways, so both
    already know the noise on either side of 0.9."""
    decoder_steps: int = 812
    """The shipped teacher's first stage ran 812 decoder and 996 expert steps: what fitted ~2.5 min of
    one GPU; the steps, not the minutes, are what the rebuild repeats."""
    decoder_lr: float = 3e-4
    decoder_batch: int = 16
    """Clips per decoder step."""
    num_clips: int = 4096
    """Clips encoded once (latents and image conditions) for the experts' training."""
    motion_batch: int = 192
    """Clips per expert step prompted by their motion only."""
    named_batch: int = 64
    """Clips per expert step prompted by the world's full clip prompt."""
    expert_steps: int = 996
    expert_lr: float = 5e-4
    text_dropout: float = 0.15
    sample_steps: int = 20
    guidance_scale: float = 3.0
    guidance_scale_2: float = 1.5


def i2v_tokenizer() -> Any:
    """The toy tokenizer with MOTION_SUBJECT's words as pieces (appended: old ids unchanged)."""
    return build_tokenizer(clips=True, extra_words=tuple(MOTION_SUBJECT.split()))


def load_parts(source: Path, recipe: I2VRecipe, vae_from: Path | None = None) -> dict[str, Any]:
    """The T2V toy teacher's parts, grown for image to video (text rows, widened experts)."""
    from diffusers import AutoencoderKLWan, UniPCMultistepScheduler, WanTransformer3DModel
    from transformers import UMT5EncoderModel

    from distill.models.student_kind import widen_patch_embedding
    from distill.models.teacher_kind import I2V_A14B

    tokenizer = i2v_tokenizer()
    text_encoder = UMT5EncoderModel.from_pretrained(source / "text_encoder").eval()
    # Rows for the new words drawn like the encoder's own; a seed of their own (not the T2V build's).
    text_encoder = grow_text_encoder(text_encoder, len(tokenizer), recipe.seed * 1000 + 38)
    vae_folder = Path(vae_from) if vae_from is not None else source / "vae"
    if (vae_folder / "vae").is_dir():
        vae_folder = vae_folder / "vae"
    parts = {
        "tokenizer": tokenizer,
        "text_encoder": text_encoder,
        "vae": AutoencoderKLWan.from_pretrained(vae_folder).eval(),
        "scheduler": UniPCMultistepScheduler.from_pretrained(source / "scheduler"),
    }
    for name in EXPERT_FOLDERS.values():
        expert = WanTransformer3DModel.from_pretrained(source / name)
        if expert.config.in_channels != I2V_A14B.in_channels:  # an I2V teacher's trains on as it is
            expert = widen_patch_embedding(expert, I2V_A14B.in_channels, source=f"{source}/{name}")
        parts[name] = expert
    return parts


@torch.no_grad()
def image_training_data(
    vae: Any, count: int, seed: int, recipe: Recipe
) -> tuple[torch.Tensor, torch.Tensor, list[world.Scene]]:
    """`count` world clips: their normalised latents (N, 16, 3, h, w), the I2V condition of their own
    frame 0 (N, 20, 3, h, w) as image_condition(kind=I2V_A14B) makes it, and their scenes."""
    from distill.models.conditioning import image_condition
    from distill.models.teacher_kind import I2V_A14B

    scenes = world.sample_scenes(count, seed, clips=True)
    latents = encode_scenes(vae, scenes, recipe)
    conditions = []
    for start in range(0, count, 64):
        chunk = scenes[start : start + 64]
        first = to_vae_input(render_clips(chunk, recipe.size, recipe.clip_frames))[:, :, 0]
        conditions.append(image_condition(vae, first, recipe.clip_frames, kind=I2V_A14B).channels)
    return latents, torch.cat(conditions), scenes


def base_recipe(source: Path, recipe: I2VRecipe) -> Recipe:
    """The toy recipe the experts train by: the source teacher's, with the I2V boundary, steps and
    rate (both experts train)."""
    t2v = json.loads((source / world.WORLD_FILE).read_text())
    return replace(
        Recipe(**{**t2v["recipe"], "trained_experts": ("high", "low")}),
        seed=recipe.seed,
        boundary_ratio=recipe.boundary_ratio,
        expert_steps=recipe.expert_steps,
        expert_lr=recipe.expert_lr,
        text_dropout=recipe.text_dropout,
    )


def check_decoder(vae: Any, log: Any = print) -> dict[str, Any]:
    """Stop unless the VAE's round trip of the world's clips adheres to their frame 0 (the gate)."""
    gate = round_trip_adherence(vae)
    log(f"vae round trip of the world's clips: adherence {gate['adherence']:.3f} {gate['parts']}")
    if gate["adherence"] < ADHERENCE_GATE:
        raise DistillError(
            "The toy VAE's decoder loses the input image",
            f"its round trip of the world's own clips adheres on {gate['adherence']:.3f}; the gate is "
            f"{ADHERENCE_GATE}",
            fixes=["Refit the decoder longer: --decoder_steps (python -m distill.toy.decoder_refit)"],
            stage=Stage.INTERNAL,
        )
    return gate


def train_i2v_experts(
    parts: dict[str, Any], recipe: I2VRecipe, base: Recipe, log: Any = print, device: str = "cpu"
) -> None:
    """Flow matching of both (widened) experts in `parts` on image-conditioned world clips, prompted
    by their motion only (recipe.motion_batch a step) and by their full prompt (named_batch). The
    encoder alone makes the data, so a decoder refit before or after changes nothing here."""
    latents, conditions, scenes = image_training_data(
        parts["vae"], recipe.num_clips, recipe.seed * 7919 + 38 * 10**5, base
    )
    motion = [motion_prompt(direction, speed) for direction, speed in world.motions()]
    prompts = [*world.all_clip_prompts(), *motion]
    index = {p: i for i, p in enumerate(prompts)}
    tokenizer, text_encoder = parts["tokenizer"], parts["text_encoder"]
    table = encode_texts(tokenizer, text_encoder, [*prompts, ""])
    lengths = [int(n) for n in tokenizer([*prompts, ""], return_length=True)["length"]]
    motion_ids = torch.tensor([index[motion_prompt(s.direction or world.STILL, s.speed)] for s in scenes])
    named_ids = torch.tensor([index[s.prompt] for s in scenes])
    data = [
        (latents, motion_ids, recipe.motion_batch, conditions),
        (latents, named_ids, recipe.named_batch, conditions),
    ]
    log(f"clips {tuple(latents.shape)}, conditions {tuple(conditions.shape)}, {len(prompts)} prompts")
    text = fold_padding(table, lengths)
    train_experts(parts["transformer"], parts["transformer_2"], data, text, base, log, device)


def save_i2v_teacher(parts: dict[str, Any], out_dir: Path, recipe: I2VRecipe, base: Recipe) -> Path:
    """The teacher folder (stock WanImageToVideoPipeline.save_pretrained) with toy_world.json."""
    from diffusers import WanImageToVideoPipeline

    pipe = WanImageToVideoPipeline(**parts, boundary_ratio=recipe.boundary_ratio)
    with staged_folder(out_dir) as staging:
        pipe.save_pretrained(staging, safe_serialization=True)
        forget_source_paths(staging)
        write_i2v_world_file(staging, recipe, base)
    return out_dir


def train_i2v(
    source: Path,
    recipe: I2VRecipe,
    out_dir: Path,
    vae_from: Path | None = None,
    log: Any = print,
    device: str = "cpu",
) -> Path:
    """Build the I2V teacher from the toy teacher in `source` into `out_dir` (replaced whole); the
    decoder's and the experts' training run on `device` (their data is made on the CPU)."""
    base = base_recipe(source, recipe)
    parts = load_parts(source, recipe, vae_from)
    if recipe.decoder_steps:
        vae = parts["vae"]
        refit_decoder(
            vae,
            recipe.decoder_steps,
            recipe.decoder_lr,
            recipe.decoder_batch,
            recipe.seed,
            log,
            device=device,
        )
        vae.save_pretrained(out_dir.parent / f"{out_dir.name}.vae")  # kept if a later part fails
    check_decoder(parts["vae"], log)
    train_i2v_experts(parts, recipe, base, log, device)
    return save_i2v_teacher(parts, out_dir, recipe, base)


def write_i2v_world_file(
    folder: Path,
    recipe: I2VRecipe,
    base: Recipe,
    calibration: dict[str, Any] | None = None,
    rebuild: str = "python -m distill.toy.build_i2v --retrain",
) -> None:
    """toy_world.json: the world, the T2V recipe grown from, the I2V recipe and its held-out score."""
    description = world.describe(
        height=base.size,
        width=base.size,
        num_frames=base.clip_frames,
        clip_frames=base.clip_frames,
        sample_steps=recipe.sample_steps,
        guidance_scale=recipe.guidance_scale,
        guidance_scale_2=recipe.guidance_scale_2,
        clip_guidance_scale=recipe.guidance_scale,
        clip_guidance_scale_2=recipe.guidance_scale_2,
        task="image to video",
        motion_prompt_example=motion_prompt("leftward", "fast"),
        recipe=asdict(base),
        i2v_recipe=asdict(recipe),
        rebuild=rebuild,
    )
    if calibration is not None:
        description["image_calibration"] = calibration
    (folder / world.WORLD_FILE).write_text(json.dumps(description, indent=2) + "\n")


@entry_point
def main(argv: list[str] | None = None) -> int:
    parser = Parser(prog="python -m distill.toy.build_i2v", description=__doc__.split("\n\n")[0])
    parser.add_argument("--retrain", action="store_true", help="train the toy I2V teacher again")
    parser.add_argument("--output", default=str(I2V_ASSETS), action=PathAction, kind=Kind.OUTPUT_FOLDER)
    parser.add_argument(
        "--from",
        dest="source",
        default=str(ASSETS),
        action=PathAction,
        kind=Kind.FOLDER,
        help="the toy T2V teacher to grow from (default: the shipped one), or a toy I2V teacher to "
        "train further (its experts, text encoder and refit VAE as they are)",
    )
    parser.add_argument(
        "--vae_from",
        action=PathAction,
        kind=Kind.FOLDER,
        help="a VAE folder whose decoder was refit already (with --decoder_steps 0)",
    )
    parser.add_argument(
        "--seed", type=integer(0), default=0, help="seed of the refit, the clips and the experts' draws"
    )
    parser.add_argument("--decoder_steps", type=integer(0), default=I2VRecipe.decoder_steps)
    parser.add_argument("--decoder_lr", type=number(0.0, above=True), default=I2VRecipe.decoder_lr)
    parser.add_argument("--decoder_batch", type=integer(1), default=I2VRecipe.decoder_batch)
    parser.add_argument("--expert_steps", type=integer(1), default=I2VRecipe.expert_steps)
    parser.add_argument("--motion_batch", type=integer(1), default=I2VRecipe.motion_batch)
    parser.add_argument("--named_batch", type=integer(1), default=I2VRecipe.named_batch)
    parser.add_argument("--expert_lr", type=number(0.0, above=True), default=I2VRecipe.expert_lr)
    parser.add_argument("--num_clips", type=integer(64), default=I2VRecipe.num_clips)
    parser.add_argument("--eval_count", type=integer(9), default=72, help="held-out cases scored at the end")
    parser.add_argument("--threads", type=integer(1), default=1)
    parser.add_argument(
        "--device", default="cpu", help="where the decoder and the experts train: cpu (default) or cuda"
    )
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    if not args.retrain:
        parser.error("pass --retrain to train the toy I2V teacher (it replaces the --output folder)")
    recipe = I2VRecipe(
        seed=args.seed,
        decoder_steps=args.decoder_steps,
        decoder_lr=args.decoder_lr,
        decoder_batch=args.decoder_batch,
        expert_steps=args.expert_steps,
        motion_batch=args.motion_batch,
        named_batch=args.named_batch,
        expert_lr=args.expert_lr,
        num_clips=args.num_clips,
    )
    command = "python -m distill.toy.build_i2v " + " ".join(argv if argv is not None else sys.argv[1:])
    try:
        log = lambda message: print(message, flush=True)  # noqa: E731 - a log that shows at once
        path = train_i2v(Path(args.source), recipe, Path(args.output), args.vae_from, log, args.device)
        from distill.toy.i2v_evaluation import evaluate_teacher

        numbers = evaluate_teacher(path, count=args.eval_count, device=args.device)
        t2v = json.loads((Path(args.source) / world.WORLD_FILE).read_text())
        base = replace(
            Recipe(**{**t2v["recipe"], "trained_experts": ("high", "low")}),
            boundary_ratio=recipe.boundary_ratio,
        )
        write_i2v_world_file(path, recipe, base, numbers, command)
        print(json.dumps(numbers, indent=2))
    except DistillError as error:
        return report(error)
    return 0


if __name__ == "__main__":
    sys.exit(main())
