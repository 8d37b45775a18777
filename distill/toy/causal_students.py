"""A causal 4-step student of the toy clip teacher, trained with ode_init then self_forcing, streamed on
the trained clip length and 3x longer, scored as the toy world scores clips. Not part of the suite.

    python -m distill.toy.causal_students --teacher outputs/toy-wan --output_dir outputs/toy-causal

Starts from the shipped bidirectional 4-step dmd clip student (assets/toy_student_clips_dmd), makes it
causal over chunks of `--chunk` latent frames, runs `--ode_steps` of ode_init (on `--max_prompts`
prompts' teacher samples) and `--self_forcing_steps` of self_forcing, then samples the scored clip
prompts with the same noise: the bidirectional student (9 frames), the causal student streamed at 9
frames and at 33 (3x, KV cache window = the trained span). Prints and writes results.json: accuracy,
motion ratio and identity (colour, shape and size held in every frame) of each.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

import torch

from distill.models.causal.attention import make_causal
from distill.models.causal.streaming import stream_latents
from distill.models.few_step import load_few_step_scheduler, sample_few_step
from distill.models.pipelines import decode_latents, encode_prompts, load_vae
from distill.ops.command import Parser, entry_point, integer
from distill.toy.evaluation import EVAL_CLIP_PROMPTS, eval_prompts
from distill.toy.score import score_clips

SHIPPED_DMD = Path(__file__).resolve().parents[2] / "assets" / "toy_student_clips_dmd"
COMMON = [
    *("--data_path", "data/toy_video_prompts.txt", "--height", "32", "--width", "32", "--num_frames", "9"),
    *("--guidance_scale", "3", "--guidance_scale_2", "1.5", "--teacher_sample_steps", "20"),
    *("--student_config", "config/student_toy_3layer.json", "--student_steps", "4", "--log_every", "25"),
    *("--checkpoint_every", "0", "--seed", "0", "--device", "cpu"),
]


def train(
    teacher: Path, out: Path, method: str, start: Path, chunk: int, steps: int, extra: list[str]
) -> Path:
    from distill.config.cli import parse_config
    from distill.train.trainer import Distiller

    args = [
        *COMMON,
        *("--teacher_path", str(teacher), "--output_dir", str(out / method), "--method", method),
        *("--cache_dir", str(out / "cache"), "--student_init", str(start), "--num_steps", str(steps)),
        *("--student_chunk_frames", str(chunk), *extra),
    ]
    began = time.time()
    result = Distiller(parse_config(args)).run()
    print(
        f"{method}: {steps} steps in {time.time() - began:.0f} s, loss {result.first_loss} -> {result.last_loss}"
    )
    return out / method / "student"


def student(folder: Path, chunk: int | None) -> torch.nn.Module:
    from diffusers import WanTransformer3DModel

    model = WanTransformer3DModel.from_pretrained(folder).eval()
    return make_causal(model, chunk) if chunk else model


@torch.no_grad()
def clips(
    model: torch.nn.Module, scheduler: Any, embeds: torch.Tensor, frames: int, vae: Any, stream: bool
) -> list:
    latent_frames = (frames - 1) // 4 + 1
    out = []
    for i in range(embeds.shape[0]):
        text = embeds[i : i + 1]
        shape = (16, latent_frames, 4, 4)
        if stream:
            latents = torch.cat(
                [c.latents for c in stream_latents(model, scheduler, 4, text, shape, seed=i, window=3)], dim=2
            )
        else:
            latents = sample_few_step(model, scheduler, 4, text, shape, seed=i)
        out.append(decode_latents(latents[0], vae))
    return out


def summary(scored: dict[str, Any]) -> dict[str, Any]:
    return {k: scored.get(k) for k in ("accuracy", "motion_ratio", "identity", "still_leak", "jitter")}


def main(argv: list[str] | None = None) -> int:
    parser = Parser(description=__doc__.splitlines()[0])
    parser.add_argument("--teacher", required=True, type=Path)
    parser.add_argument("--output_dir", required=True, type=Path)
    parser.add_argument("--chunk", type=integer(1), default=1)
    parser.add_argument("--ode_steps", type=integer(0), default=150)
    parser.add_argument("--self_forcing_steps", type=integer(0), default=60)
    parser.add_argument("--max_prompts", type=integer(1), default=256)
    parser.add_argument("--prompts", type=integer(1), default=EVAL_CLIP_PROMPTS)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    out = args.output_dir
    start = SHIPPED_DMD
    if args.ode_steps:
        start = train(
            args.teacher,
            out,
            "ode_init",
            start,
            args.chunk,
            args.ode_steps,
            ["--batch_size", "16", "--lr", "1e-4", "--max_prompts", str(args.max_prompts)],
        )
    causal = start
    if args.self_forcing_steps:
        causal = train(
            args.teacher,
            out,
            "self_forcing",
            start,
            args.chunk,
            args.self_forcing_steps,
            ["--batch_size", "8", "--lr", "3e-5", "--critic_lr", "3e-4", "--critic_updates", "5"],
        )
    prompts = eval_prompts(args.prompts, clips=True)
    embeddings = encode_prompts(args.teacher, prompts, 512, torch.device("cpu"), torch.float32)
    embeds = torch.stack([embeddings[p] for p in prompts])
    vae = load_vae(args.teacher, torch.device("cpu"))
    results = {}
    runs = {
        "bidirectional dmd, 9 frames": (SHIPPED_DMD, None, 9, False),
        "causal, not trained causal, 9 frames streamed": (SHIPPED_DMD, args.chunk, 9, True),
        "causal, 9 frames streamed": (causal, args.chunk, 9, True),
        "causal, 33 frames streamed (3x)": (causal, args.chunk, 33, True),
    }
    for name, (folder, chunk, frames, stream) in runs.items():
        began = time.time()
        made = clips(student(folder, chunk), load_few_step_scheduler(folder), embeds, frames, vae, stream)
        results[name] = summary(score_clips(made, prompts))
        print(f"{name}: {results[name]} ({time.time() - began:.0f} s)")
    (out / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(entry_point(main)())
