"""A causal 4-step student of the toy clip teacher, trained with ode_init then self_forcing, streamed on
the trained clip length and 3x longer, scored as the toy world scores clips. Not part of the suite.

    python -m distill.toy.causal_students --output_dir outputs/toy-causal    # make toy-causal

Starts from the shipped bidirectional 4-step dmd clip student (assets/toy_student_clips_dmd), makes it
causal over chunks of `--chunk` latent frames, runs `--ode_steps` of ode_init and
`--self_forcing_steps` of self_forcing (both on `--max_prompts` prompts' teacher samples; with
`--rollout_frames 33` self_forcing rolls out 3x the clip and judges a window of it), then samples
the scored clip prompts with the same noise (seed = the prompt's index) and prints and writes
results.json, one row each:

- the teacher at its 20 steps and guidance (3 / 1.5) on the trained length, the same prompts and noise;
- the bidirectional student and the causal ones streamed at the trained length (CLIP_FRAMES = 9),
  scored by `score_clips` as every toy clip student is (accuracy, motion ratio, identity = colour and
  shape held in every frame);
- the causal student streamed 3x longer (33 frames, KV cache window = the trained span in chunks),
  decoded by the stream reader (distill/toy/stream_reader.py: the toy VAE with its decoder refit on the
  world's 33-frame streams; the teacher's toy VAE was fitted on 9-frame clips and cannot decode past
  them) and scored by `distill.toy.stream_score`: a right 33-frame stream is the world's clip with its
  motion continued at the same speed per frame, so shapes leave their quadrant and often the picture,
  which `score_clips` cannot read (it reads the world's own right streams at 0.31 accuracy and 3.5x
  motion); identity = colour, shape and size held in every frame that shows the whole shape, with no
  shape lost inside the picture; motion ratio = speed per frame against the world's;
- `world through the VAE, 3x` and `world through the stream reader, 3x`: the world's own right streams
  encoded by the teacher's VAE and decoded by it, or by the reader: the best any student's latents can
  read back as through each (the teacher's VAE: 0.04 accuracy, identity 0.00; docs/streaming.md).

`first_frame_share` is the time until a stream's first chunk is decoded over the stream's whole time.
The recipe's student is shipped with its record by distill/toy/causal_ship.py.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from distill.models.causal.attention import make_causal
from distill.models.causal.decode import ChunkDecoder
from distill.models.causal.layout import CausalLayout
from distill.models.causal.streaming import stream_latents
from distill.models.few_step import load_few_step_scheduler, sample_few_step
from distill.models.pipelines import decode_latents, encode_prompts, load_vae
from distill.ops.command import Parser, entry_point, integer
from distill.sample.stream import default_window
from distill.toy.evaluation import EVAL_CLIP_PROMPTS, eval_prompts
from distill.toy.score import score_clips
from distill.toy.shipped import write_toy_teacher
from distill.toy.stream_reader import STREAM_FRAMES, load_reader, world_through
from distill.toy.stream_score import score_stream
from distill.toy.t2v_students import teacher_rows
from distill.toy.world import CLIP_FRAMES

# The recipe (see docs/streaming.md for what else was tried and what it gave).
CHUNK = 1
ODE_STEPS, ODE_LR = 400, 1e-4
SELF_FORCING_STEPS, SELF_FORCING_LR, CRITIC_LR = 40, 3e-5, 3e-4
MAX_PROMPTS = 512

# The causal LoRA's recipe: self_forcing of one expert's adapters at a time, the high-noise expert's
# first, then the low-noise expert's with the high one's held (trained jointly, both fall after about
# 300 steps; docs/streaming.md has both tables).
LORA_RANK, LORA_PHASE_STEPS, LORA_LR, LORA_CRITIC_LR = 16, 300, 3e-4, 1e-4
LORA_PHASES = ("high", "low")

ASSETS = Path(__file__).resolve().parents[2] / "assets"
SHIPPED_DMD = ASSETS / "toy_student_clips_dmd"
SHIPPED_LORA = ASSETS / "toy_student_clips_lora"
CLIP_SHAPE = [
    *("--data_path", "data/toy_video_prompts.txt", "--height", "32", "--width", "32", "--num_frames", "9"),
    *("--guidance_scale", "3", "--guidance_scale_2", "1.5", "--teacher_sample_steps", "20"),
]
RUN = [
    *("--student_steps", "4", "--log_every", "25"),
    *("--checkpoint_every", "0", "--seed", "0", "--device", "cpu"),
]
COMMON = [*CLIP_SHAPE, "--student_config", "config/student_toy_3layer.json", *RUN]


def train(
    teacher: Path,
    out: Path,
    method: str,
    start: Path,
    chunk: int,
    steps: int,
    extra: list[str],
    cache: Path | None = None,
) -> Path:
    from distill.config.cli import parse_config
    from distill.train.trainer import Distiller

    args = train_args(teacher, out, method, start, chunk, steps, extra, cache)
    began = time.time()
    result = Distiller(parse_config(args)).run()
    print(
        f"{method}: {steps} steps in {time.time() - began:.0f} s, loss {result.first_loss} -> {result.last_loss}"
    )
    return out / method / "student"


def train_args(
    teacher: Path | str,
    out: Path | str,
    method: str,
    start: Path | str,
    chunk: int,
    steps: int,
    extra: list[str],
    cache: Path | str | None = None,
) -> list[str]:
    """The trainer's arguments of one stage of the recipe (its output: OUT/METHOD)."""
    return [
        *COMMON,
        *("--teacher_path", str(teacher), "--output_dir", str(Path(out) / method), "--method", method),
        *("--cache_dir", str(cache or Path(out) / "cache"), "--student_init", str(start)),
        *("--num_steps", str(steps), "--student_chunk_frames", str(chunk), *extra),
    ]


def ode_init_extra(lr: float | str = ODE_LR, max_prompts: int = MAX_PROMPTS) -> list[str]:
    return ["--batch_size", "16", "--lr", str(lr), "--max_prompts", str(max_prompts)]


def self_forcing_extra(
    lr: float | str = SELF_FORCING_LR,
    critic_lr: float | str = CRITIC_LR,
    max_prompts: int = MAX_PROMPTS,
    rollout_frames: int | None = None,
) -> list[str]:
    return [
        *("--batch_size", "8", "--lr", str(lr), "--critic_lr", str(critic_lr)),
        *("--critic_updates", "5", "--max_prompts", str(max_prompts)),
        *(("--rollout_frames", str(rollout_frames)) if rollout_frames else ()),
    ]


def lora_phase_args(
    teacher: Path | str, out: Path | str, phase: str, start: Path | str, cache: Path | str | None = None
) -> list[str]:
    """The trainer's arguments of one phase of the causal LoRA's recipe (its output: OUT/PHASE): the
    adapters of `start` (the shipped bidirectional clip LoRA, or the high phase's lora/) made causal
    in chunks of CHUNK, self_forcing of the `phase` expert's, data-free on MAX_PROMPTS prompts."""
    return [
        *CLIP_SHAPE,
        *RUN,
        *("--teacher_path", str(teacher), "--output_dir", str(Path(out) / phase)),
        *("--cache_dir", str(cache or Path(out) / "cache"), "--method", "self_forcing"),
        *("--student_lora_rank", str(LORA_RANK), "--student_lora_init", str(start)),
        *("--student_chunk_frames", str(CHUNK), "--expert_phase", phase),
        *("--num_steps", str(LORA_PHASE_STEPS), *self_forcing_extra(LORA_LR, LORA_CRITIC_LR)),
    ]


def student(folder: Path, chunk: int | None) -> torch.nn.Module:
    from diffusers import WanTransformer3DModel

    model = WanTransformer3DModel.from_pretrained(folder).eval()
    return make_causal(model, chunk) if chunk else model


@torch.no_grad()
def clips(
    model: torch.nn.Module,
    scheduler: Any,
    embeds: torch.Tensor,
    frames: int,
    vae: Any,
    stream: bool,
    window: int | None = None,
) -> tuple[list, float]:
    """Each prompt's clip (seed = its index), and the mean share of a stream's time spent before its
    first chunk was decoded (time to first frame / total; 0 when not streamed)."""
    latent_frames = (frames - 1) // 4 + 1
    out, first_share = [], []
    for i in range(embeds.shape[0]):
        text = embeds[i : i + 1]
        shape = (16, latent_frames, 4, 4)
        if stream:
            began, parts, decoder = time.perf_counter(), [], ChunkDecoder(vae)
            for n, chunk in enumerate(
                stream_latents(model, scheduler, 4, text, shape, seed=i, window=window)
            ):
                parts.append(decoder(chunk.latents))
                if n == 0:
                    first = time.perf_counter() - began
            decoder.close()
            first_share.append(first / (time.perf_counter() - began))
            out.append(np.concatenate(parts))
        else:
            out.append(decode_latents(sample_few_step(model, scheduler, 4, text, shape, seed=i)[0], vae))
    return out, float(np.mean(first_share)) if first_share else 0.0


KEYS = ("accuracy", "motion_ratio", "late_motion_ratio", "identity", "frames_shown", "first_frame_share")


def scored(made: list, prompts: list[str], first_share: float) -> dict[str, Any]:
    """The trained length by score_clips (as every toy clip student), a longer stream by score_stream."""
    result = score_clips(made, prompts) if len(made[0]) == CLIP_FRAMES else score_stream(made, prompts)
    return {k: result.get(k) for k in KEYS if k in result} | {"first_frame_share": round(first_share, 3)}


def main(argv: list[str] | None = None) -> int:
    parser = Parser(description=__doc__.splitlines()[0])
    parser.add_argument("--teacher", type=Path, default=None, help="default: the shipped toy teacher")
    parser.add_argument("--output_dir", required=True, type=Path)
    parser.add_argument("--start", type=Path, default=SHIPPED_DMD, help="the student trained causal")
    parser.add_argument("--chunk", type=integer(1), default=CHUNK)
    parser.add_argument("--ode_steps", type=integer(0), default=ODE_STEPS)
    parser.add_argument("--ode_lr", default=ODE_LR)
    parser.add_argument("--self_forcing_steps", type=integer(0), default=SELF_FORCING_STEPS)
    parser.add_argument("--self_forcing_lr", default=SELF_FORCING_LR)
    parser.add_argument("--critic_lr", default=CRITIC_LR)
    parser.add_argument(
        "--rollout_frames", type=integer(1), default=None, help="self_forcing's rollout (default: the clip)"
    )
    parser.add_argument("--max_prompts", type=integer(1), default=MAX_PROMPTS)
    parser.add_argument("--prompts", type=integer(1), default=EVAL_CLIP_PROMPTS)
    parser.add_argument("--window", type=integer(1), default=None, help="KV cache window in chunks")
    parser.add_argument(
        "--cache_dir", type=Path, default=None, help="teacher latents (default: in output_dir)"
    )
    parser.add_argument("--rows", nargs="+", choices=ROWS, default=list(ROWS))
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    out = args.output_dir
    out.mkdir(parents=True, exist_ok=True)
    if args.teacher is None:
        args.teacher = write_toy_teacher(out / "teacher", overwrite=True)
    start = args.start
    if args.ode_steps:
        start = train(
            args.teacher,
            out,
            "ode_init",
            start,
            args.chunk,
            args.ode_steps,
            ode_init_extra(args.ode_lr, args.max_prompts),
            args.cache_dir,
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
            self_forcing_extra(args.self_forcing_lr, args.critic_lr, args.max_prompts, args.rollout_frames),
            args.cache_dir,
        )
    prompts = eval_prompts(args.prompts, clips=True)
    embeddings = encode_prompts(args.teacher, prompts, 512, torch.device("cpu"), torch.float32)
    embeds = torch.stack([embeddings[p] for p in prompts])
    vae = load_vae(args.teacher, torch.device("cpu"))
    readers = {"teacher": vae, "reader": load_reader()}
    long = STREAM_FRAMES
    # generate --stream's default: the past chunks of the trained clip (all but the one being made).
    window = args.window or default_window(CausalLayout(args.chunk), CLIP_FRAMES, 4)
    runs = {
        "bidirectional dmd": (SHIPPED_DMD, None, CLIP_FRAMES, False),
        "made causal, untrained": (SHIPPED_DMD, args.chunk, CLIP_FRAMES, True),
        "causal, trained": (causal, args.chunk, CLIP_FRAMES, True),
        "causal, trained, 3x": (causal, args.chunk, long, True),
    }
    results: dict[str, Any] = {"settings": {k: str(v) for k, v in vars(args).items()} | {"window": window}}
    for name in args.rows:
        if (
            name == TEACHER_ROW
        ):  # the teacher's own 20 steps on the trained length, the same prompts and noise
            (row,) = teacher_rows(args.teacher, True, count=args.prompts, steps=[TEACHER_STEPS])
            results[name] = {k: row[k] for k in KEYS if k in row}
            print(f"{name}: {results[name]}", flush=True)
            continue
        if name in FLOORS:
            results[name] = scored(world_through(readers[FLOORS[name]], prompts, long), prompts, 0.0)
            print(f"{name}: {results[name]}", flush=True)
            continue
        folder, chunk, frames, stream = runs[name]
        began = time.time()
        model = student(folder, chunk)
        # A stream longer than trained is read by the stream reader (the teacher's VAE cannot decode it).
        decoder = readers["reader"] if frames > CLIP_FRAMES else vae
        made, share = clips(model, load_few_step_scheduler(folder), embeds, frames, decoder, stream, window)
        results[name] = scored(made, prompts, share)
        print(f"{name}: {results[name]} ({time.time() - began:.0f} s)", flush=True)
    (out / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    return 0


TEACHER_STEPS = 20
TEACHER_ROW = f"teacher, {TEACHER_STEPS} steps"
ROWS = (
    TEACHER_ROW,
    "bidirectional dmd",
    "made causal, untrained",
    "causal, trained",
    "causal, trained, 3x",
    "world through the VAE, 3x",
    "world through the stream reader, 3x",
)
FLOORS = {"world through the VAE, 3x": "teacher", "world through the stream reader, 3x": "reader"}

if __name__ == "__main__":
    sys.exit(entry_point(main)())
