"""The toy world's reader of long streams: the toy VAE with its decoder refit on the world's 3x streams.

    python -m distill.toy.stream_reader              # its record: what it reads the world's streams as
    python -m distill.toy.stream_reader --retrain    # refit it again (~27 min, one thread) and ship it

The toy teacher's VAE was fitted on CLIP_FRAMES-frame clips, and its causal decoder does not carry on
past them: the world's own right 33-frame streams, encoded and decoded by it, read back as accuracy
0.02 and identity 0.00 (docs/streaming.md), so a student's stream 3x longer than trained cannot be
judged through it. (The real Wan VAE decodes clips of any length.) Refitting only the decoder on
17-frame streams carried it right to about frame 17 and no further: its error grows with the frame
index over the decoder's whole temporal reach, so it is refit on streams of the length it reads.

This reader is a measuring instrument of the toy world, not a part of the teacher: its encoder and
quant_conv are the teacher's, untouched, so every latent means what it meant, and only what latents
decode to changes; users' streams, `make demo-stream` and every other row decode with the teacher's
own VAE. What any student's 3x stream can read back as through it is its record's floor: the world's
right streams of the scored prompts encoded and decoded by it.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch

from distill.ops.command import Parser, entry_point
from distill.toy.shipped import ASSETS as TEACHER_ASSETS
from distill.toy.stream_score import LONG_FRAMES
from distill.toy.world import scene_for

REPO = Path(__file__).resolve().parents[2]
READER = REPO / "assets" / "toy_stream_reader"
RECORD_FILE = "reader.json"
STREAM_FRAMES = LONG_FRAMES  # 33
# The refit (distill.toy.decoder_refit.refit_decoder on STREAM_FRAMES-frame streams).
STEPS, LR, BATCH = 1000, 2e-4, 8


def load_reader(folder: Path = READER) -> Any:
    from diffusers import AutoencoderKLWan

    return AutoencoderKLWan.from_pretrained(folder).eval()


def world_through(vae: Any, prompts: list[str], frames: int = STREAM_FRAMES) -> list[np.ndarray]:
    """The world's right clips (streams past CLIP_FRAMES) of `prompts` (prompt i's variation from one
    generator of seed 0, as the toy scores draw them), encoded and decoded by `vae` in one pass each:
    the best any student's latents can read back as through it."""
    from distill.toy.stream_score import render_stream

    rng = np.random.default_rng(0)
    truth = np.stack([render_stream(scene_for(p, rng), frames) for p in prompts])
    video = torch.from_numpy(truth).permute(0, 4, 1, 2, 3) * 2.0 - 1.0
    out: list[np.ndarray] = []
    with torch.no_grad():
        for i in range(0, len(prompts), 24):
            decoded = vae.decode(vae.encode(video[i : i + 24]).latent_dist.mode()).sample
            out.extend(((decoded.clamp(-1, 1) + 1) / 2).permute(0, 2, 3, 4, 1).numpy())
    return out


def floor_row(vae: Any, count: int | None = None) -> dict[str, Any]:
    """`score_stream` of the world's own 3x streams through `vae`, on the first `count` (all 216)
    scored clip prompts: the most a student's 3x stream decoded by it can read."""
    from distill.toy.evaluation import EVAL_CLIP_PROMPTS, eval_prompts
    from distill.toy.stream_score import score_stream

    prompts = eval_prompts(count or EVAL_CLIP_PROMPTS, clips=True)
    scored = score_stream(world_through(vae, prompts), prompts)
    keys = ("accuracy", "identity", "motion_ratio", "late_motion_ratio", "frames_shown", "correct", "held")
    return {k: scored[k] for k in keys} | {"count": len(prompts), "frames": STREAM_FRAMES}


def refit(log: Any = print) -> Any:
    """The toy teacher's VAE with its decoder refit on the world's STREAM_FRAMES-frame streams."""
    from diffusers import AutoencoderKLWan

    from distill.toy.decoder_refit import refit_decoder

    vae = AutoencoderKLWan.from_pretrained(TEACHER_ASSETS / "vae")
    return refit_decoder(vae, STEPS, LR, BATCH, log=log, frames=STREAM_FRAMES)


def make_record(vae: Any) -> dict[str, Any]:
    from diffusers import AutoencoderKLWan

    teacher_vae = AutoencoderKLWan.from_pretrained(TEACHER_ASSETS / "vae").eval()
    return {
        "rebuild": "python -m distill.toy.stream_reader --retrain",
        "refit": {"frames": STREAM_FRAMES, "steps": STEPS, "lr": LR, "batch": BATCH},
        "floor": floor_row(vae),
        "teacher_vae": {k: v for k, v in floor_row(teacher_vae).items() if k not in ("correct", "held")},
    }


def ship(vae: Any, record: dict[str, Any], dest: Path = READER) -> Path:
    from distill.toy.build import forget_source_paths
    from distill.toy.shipped import staged_folder

    with staged_folder(dest) as staging:
        vae.save_pretrained(staging)
        forget_source_paths(staging, "config.json")
        (staging / RECORD_FILE).write_text(json.dumps(record, indent=2) + "\n")
    return dest


def read_record(folder: Path = READER) -> dict[str, Any]:
    return json.loads((folder / RECORD_FILE).read_text())


def table(record: dict[str, Any]) -> str:
    rows = [("the teacher's VAE", record["teacher_vae"]), ("this reader", record["floor"])]
    lines = [f"the world's {STREAM_FRAMES}-frame streams through   accuracy  identity  motion"]
    lines += [
        f"{name:<35} {row['accuracy']:.3f}     {row['identity']:.3f}     {row['motion_ratio']:.3f}"
        for name, row in rows
    ]
    return "\n".join(lines)


@entry_point
def main(argv: list[str] | None = None) -> int:
    parser = Parser(prog="python -m distill.toy.stream_reader", description=__doc__.split("\n\n")[0])
    parser.add_argument("--retrain", action="store_true", help="refit it again, score it and ship it")
    args = parser.parse_args(argv)
    if args.retrain:
        torch.set_num_threads(1)
        vae = refit(log=lambda message: print(message, flush=True))
        record = make_record(vae)
        ship(vae, record)
    else:
        record = read_record()
    print(table(record))
    return 0


if __name__ == "__main__":
    sys.exit(main())
