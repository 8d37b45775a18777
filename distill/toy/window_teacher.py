"""A toy teacher that knows windows of long streams: the shipped toy teacher's two experts trained
further on windows of 3 latent frames cut from the world's 33-frame streams, beside its own pictures
and clips. A measuring instrument for `--rollout_frames` (docs/streaming.md), not shipped.

    python -m distill.toy.window_teacher --output_dir outputs/toy-window-teacher   # ~20 min, one thread
    python -m distill.toy.window_judge --teacher outputs/toy-window-teacher        # how it judges windows

Self-Forcing past the trained length judges a window of the student's long rollout as a clip. The
shipped toy teacher was trained on 9-frame clips only, and answers every window past a stream's start
as a clip's start (window_judge). Real Wan 2.2 was trained on 81-frame clips, whose middles look like
windows of a longer stream; this teacher is the toy world's stand-in for that: its experts also learn
flow matching on windows of the world's right streams (`stream_score.render_stream`: each clip's
motion continued at its speed per frame), encoded whole by the teacher's VAE and cut at every latent
frame after the first. The window at latent frame 0 is the world's clip itself (the VAE's encoder is
causal: a stream's first 3 latent frames are its 9-frame clip's), which the clips already teach.
Everything but the experts is the source teacher's, byte for byte; toy_world.json records the training.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import uuid
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import torch

from distill.ops.command import Parser, PathAction, entry_point, integer, number
from distill.ops.errors import DistillError, Stage
from distill.ops.paths import Kind
from distill.toy import world
from distill.toy.recipe import Recipe
from distill.toy.shipped import ASSETS
from distill.toy.window_judge import encode_streams

WINDOW = 3  # latent frames of the trained 9-frame clip
STREAM_FRAMES = 33  # 9 latent frames: windows at latent frames 1..6
# Per expert step: pictures, clips and windows side by side (the windows are what is new).
BATCHES = {"pictures": 32, "clips": 32, "windows": 64}
STEPS, LR, STREAMS, PICTURES, CLIPS = 1500, 3e-4, 2048, 4096, 2048
EXPERTS = ("transformer", "transformer_2")


def stream_windows(vae: Any, scenes: list[world.Scene], frames: int = STREAM_FRAMES) -> torch.Tensor:
    """The world's right `frames`-frame streams of `scenes`, each encoded whole by `vae`, cut into
    windows of WINDOW latent frames at every latent frame after the first: (starts x N, 16, WINDOW,
    h, w), start-major (the window at latent frame k of stream i is row (k - 1) x N + i)."""
    latents = encode_streams(vae, scenes, frames)
    return torch.cat([latents[:, :, k : k + WINDOW] for k in range(1, latents.shape[2] - WINDOW + 1)])


def source_recipe(source: Path, steps: int, lr: float, seed: int) -> Recipe:
    """The source teacher's recorded recipe, both experts trained `steps` more at `lr`."""
    recipe = Recipe(**json.loads((source / world.WORLD_FILE).read_text())["recipe"])
    return replace(
        recipe, trained_experts=("high", "low"), expert_steps=steps, expert_lr=lr, low_focus=0.0, seed=seed
    )


def train_window_teacher(
    source: Path,
    out_dir: Path,
    *,
    steps: int = STEPS,
    lr: float = LR,
    streams: int = STREAMS,
    pictures: int = PICTURES,
    clips: int = CLIPS,
    seed: int = 1,
    log: Any = print,
) -> Path:
    """Train `source`'s experts on pictures, clips and stream windows and write the teacher to
    `out_dir` (through a staging folder: a failure leaves nothing half written there)."""
    from diffusers import AutoencoderKLWan, WanTransformer3DModel
    from transformers import AutoTokenizer, UMT5EncoderModel

    from distill.toy.build import encode_texts
    from distill.toy.expert_training import train_experts
    from distill.toy.text_padding import fold_padding
    from distill.toy.vae_fit import encode_scenes

    recipe = source_recipe(source, steps, lr, seed)
    vae = AutoencoderKLWan.from_pretrained(source / "vae").eval()
    draws = {
        "pictures": world.sample_scenes(pictures, seed * 7919 + 11),
        "clips": world.sample_scenes(clips, seed * 7919 + 12, clips=True),
        "windows": world.sample_scenes(streams, seed * 7919 + 13, clips=True),
    }
    latents = {
        "pictures": encode_scenes(vae, draws["pictures"], replace(recipe, clip_frames=0)),
        "clips": encode_scenes(vae, draws["clips"], recipe),
        "windows": stream_windows(vae, draws["windows"]),
    }
    # Only the prompts drawn are encoded (the world has ~2,200): the empty prompt last, as
    # train_experts' text dropout expects.
    prompts = sorted({scene.prompt for scenes in draws.values() for scene in scenes})
    tokenizer = AutoTokenizer.from_pretrained(source / "tokenizer")
    text_encoder = UMT5EncoderModel.from_pretrained(source / "text_encoder").eval()
    table = encode_texts(tokenizer, text_encoder, [*prompts, ""])
    lengths = [int(n) for n in tokenizer([*prompts, ""], return_length=True)["length"]]
    index = {p: i for i, p in enumerate(prompts)}
    data = []
    for name, scenes in draws.items():
        ids = torch.tensor([index[s.prompt] for s in scenes])
        repeat = len(latents[name]) // len(scenes)  # the windows: every start of each stream
        data.append((latents[name], ids.repeat(repeat), BATCHES[name]))
    log(", ".join(f"{name} {tuple(latents[name].shape)}" for name in draws) + f", {len(prompts)} prompts")
    high, low = (WanTransformer3DModel.from_pretrained(source / name) for name in EXPERTS)
    train_experts(high, low, data, fold_padding(table, lengths), recipe, log)

    staging = out_dir.parent / f".{out_dir.name}.partial-{uuid.uuid4().hex[:8]}"
    shutil.copytree(source, staging)
    for name, expert in zip(EXPERTS, (high, low)):
        shutil.rmtree(staging / name)
        expert.save_pretrained(staging / name, safe_serialization=True)
    description = json.loads((source / world.WORLD_FILE).read_text())
    description["window_training"] = {
        "source": str(source),
        "recipe": asdict(recipe),
        "streams": streams,
        "stream_frames": STREAM_FRAMES,
        "window": WINDOW,
        "pictures": pictures,
        "clips": clips,
        "batches": BATCHES,
    }
    (staging / world.WORLD_FILE).write_text(json.dumps(description, indent=2) + "\n")
    os.replace(staging, out_dir)
    return out_dir


@entry_point
def main(argv: list[str] | None = None) -> int:
    parser = Parser(prog="python -m distill.toy.window_teacher", description=__doc__.split("\n\n")[0])
    parser.add_argument("--output_dir", required=True, type=Path, help="where the teacher folder is written")
    parser.add_argument(
        "--teacher",
        default=ASSETS,
        action=PathAction,
        kind=Kind.FOLDER,
        help="the toy teacher it starts from",
    )
    parser.add_argument("--steps", type=integer(1), default=STEPS, help="expert steps")
    parser.add_argument("--lr", type=number(0.0, above=True), default=LR, help="the experts' peak rate")
    parser.add_argument(
        "--streams", type=integer(1), default=STREAMS, help="33-frame streams cut into windows"
    )
    parser.add_argument("--pictures", type=integer(1), default=PICTURES, help="pictures trained beside them")
    parser.add_argument("--clips", type=integer(1), default=CLIPS, help="9-frame clips trained beside them")
    parser.add_argument("--seed", type=integer(0), default=1)
    args = parser.parse_args(argv)
    out = args.output_dir.expanduser().absolute()
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise DistillError(
            f"--output_dir {out} already holds files",
            "The window teacher is written to a folder of its own; nothing there is replaced.",
            fixes=[f"give another --output_dir, or remove {out} first"],
            stage=Stage.CONFIG,
        )
    if out.is_dir():
        out.rmdir()  # empty: os.replace puts the finished folder in its place
    out.parent.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(1)
    train_window_teacher(
        Path(args.teacher),
        out,
        steps=args.steps,
        lr=args.lr,
        streams=args.streams,
        pictures=args.pictures,
        clips=args.clips,
        seed=args.seed,
        log=lambda message: print(message, flush=True),
    )
    print(f"window teacher written to {out}; judge it: python -m distill.toy.window_judge --teacher {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
