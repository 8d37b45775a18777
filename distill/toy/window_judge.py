"""How the toy teacher judges windows of the world's own 33-frame streams: what a Self-Forcing run with
--rollout_frames asks of it, measured without training anything.

    python -m distill.toy.window_judge            # ~1 min on one thread

A rollout longer than the clip is judged a window at a time: the teacher denoises a noised window of
the clip's length and dmd moves the student along its answer. That is only as good as the teacher's
answer on windows past the clip's start. This encodes the world's right streams (stream_score's
`render_stream`, the prompts' own motion continued) with the teacher's VAE, noises windows of 3
latent frames starting at latent frame 0, 2, 4 and 6, and prints, per noise level and window:

- the teacher's error on each frame of the window (its guided clean estimate against the window,
  mean squared, over the windows' mean square): how far it would move a right stream;
- the mean change between consecutive latent frames, of the window and of the teacher's estimate:
  whether it keeps the window's motion or puts its own in.

On the window that starts the stream the teacher's answer is the window (the 9-frame clips it was
trained on). Past it the answer is rewritten, for shapes standing still as much as for moving ones
(`still`: the prompts that stand still, whose right stream holds the clip's last frame): the toy VAE's
causal encoder reaches back further than 3 latent frames, so from the 4th latent frame of a stream on
its latents are not like any the teacher was trained on, whatever the picture shows.
"""

from __future__ import annotations

import sys
from typing import Any

import numpy as np
import torch

from distill.ops.command import Parser, PathAction, entry_point, integer
from distill.ops.paths import Kind

TEACHER = "outputs/toy-wan"
WINDOW = 3  # latent frames of the trained 9-frame clip
STARTS = (0, 2, 4, 6)
SIGMAS = (0.3, 0.6, 0.9)
GUIDANCE = (3.0, 1.5)  # the toy clip students' teacher guidance (distill/toy/causal_students.py)


def stream_latents(teacher: str, prompts: list[str], frames: int) -> torch.Tensor:
    """The world's right `frames`-frame streams of `prompts` (prompt i's variation from one generator
    of seed 0), encoded by the teacher's VAE and normalised as the trainer's latents are."""
    from distill.models.pipelines import load_vae
    from distill.toy.world import scene_for

    rng = np.random.default_rng(0)
    return encode_streams(
        load_vae(teacher, torch.device("cpu")), [scene_for(p, rng) for p in prompts], frames
    )


@torch.no_grad()
def encode_streams(vae: Any, scenes: list, frames: int) -> torch.Tensor:
    """The world's right `frames`-frame streams of `scenes` (stream_score's `render_stream`), each
    encoded whole by `vae` and normalised as the trainer's latents are: (N, 16, T, h, w)."""
    from distill.toy.stream_score import render_stream

    encoded = []
    for start in range(0, len(scenes), 64):
        video = np.stack([render_stream(scene, frames) for scene in scenes[start : start + 64]])
        encoded.append(encode_frames(vae, video))
    return torch.cat(encoded)


@torch.no_grad()
def encode_frames(vae: Any, video: np.ndarray) -> torch.Tensor:
    """Clips (N, F, H, W, 3) in [0, 1], each encoded whole by `vae` and normalised as the trainer's
    latents are: (N, 16, T, h, w). A single frame is a clip's first latent frame (the encoder is causal)."""
    mean = torch.tensor(vae.config.latents_mean).view(1, -1, 1, 1, 1)
    std = torch.tensor(vae.config.latents_std).view(1, -1, 1, 1, 1)
    x = torch.from_numpy(np.ascontiguousarray(video)).permute(0, 4, 1, 2, 3) * 2.0 - 1.0
    return (vae.encode(x).latent_dist.mode() - mean) / std


def frame_change(x: torch.Tensor) -> list[float]:
    """Mean absolute change from each latent frame to the next, over the batch."""
    return [round(v, 3) for v in (x[:, :, 1:] - x[:, :, :-1]).abs().mean(dim=(0, 1, 3, 4)).tolist()]


def guided_teacher(teacher: str, prompts: list[str]) -> tuple[Any, torch.Tensor, torch.Tensor]:
    """The toy teacher's guided velocity at the clip students' guidance, with `prompts`' embeddings
    and the empty prompt's: (guided, cond (N, 512, D), negative (1, 512, D))."""
    from distill.models.guided_teacher import GuidedTeacher
    from distill.models.pipelines import encode_prompts
    from distill.models.teacher import inspect_teacher, load_expert

    embeddings = encode_prompts(teacher, [*prompts, ""], 512, torch.device("cpu"), torch.float32)
    info = inspect_teacher(teacher)
    experts = [load_expert(info, name, torch.float32).eval() for name in ("transformer", "transformer_2")]
    guided = GuidedTeacher(
        *experts, info.boundary_ratio, *GUIDANCE, torch.device("cpu"), torch.float32, kind=info.kind
    )
    return guided, torch.stack([embeddings[p] for p in prompts]), embeddings[""][None]


def judge(teacher: str, count: int, frames: int, still: bool = False) -> list[dict[str, Any]]:
    """One row per noise level and window start (see the module's docstring), on the first `count`
    scored clip prompts (with `still`: the first `count` of those that stand still)."""
    from distill.toy.evaluation import EVAL_CLIP_PROMPTS, eval_prompts
    from distill.toy.stream_reader import STREAM_FRAMES

    prompts = eval_prompts(EVAL_CLIP_PROMPTS if still else count, clips=True)  # the scored clip prompts
    prompts = [p for p in prompts if "standing still" in p][:count] if still else prompts
    guided, cond, negative = guided_teacher(teacher, prompts)
    latents = stream_latents(teacher, prompts, frames or STREAM_FRAMES)
    generator = torch.Generator().manual_seed(0)
    rows = []
    for sigma in SIGMAS:
        noise = torch.randn(latents[:, :, :WINDOW].shape, generator=generator)
        timesteps = torch.full((count,), int(sigma * 1000), dtype=torch.int64)
        for start in STARTS:
            window = latents[:, :, start : start + WINDOW]
            noisy = (1 - sigma) * window + sigma * noise
            velocity = guided.velocity(noisy, timesteps, cond, negative)
            estimate = noisy - sigma * velocity
            error = ((estimate - window) ** 2).mean(dim=(0, 1, 3, 4)) / window.pow(2).mean()
            rows.append(
                {
                    "sigma": sigma,
                    "start": start,
                    "error": [round(v, 3) for v in error.tolist()],
                    "change": frame_change(window),
                    "teacher_change": frame_change(estimate),
                }
            )
    return rows


@torch.no_grad()
def stream_by_windows(
    guided: Any,
    cond: torch.Tensor,
    negative: torch.Tensor,
    latent_frames: int,
    steps: int,
    shift: float = 3.0,
) -> torch.Tensor:
    """The teacher's own stream of `latent_frames` (N, 16, T, 4, 4), a window at a time: the first
    WINDOW latent frames sampled as a clip, then each next frame made in a window whose first
    WINDOW - 1 frames are the stream's last ones, put back at every step at that step's noise
    (inpainting: the teacher sees the stream only through the window). Euler steps on the shifted
    flow-matching schedule; noise from one CPU generator of seed 0, drawn window by window, so a
    longer stream begins with a shorter one."""
    u = torch.linspace(1.0, 0.0, steps + 1)
    sigmas = shift * u / (1 + (shift - 1) * u)
    generator = torch.Generator().manual_seed(0)
    stream = torch.zeros(cond.shape[0], 16, latent_frames, 4, 4)
    for start in range(latent_frames - WINDOW + 1):
        known = WINDOW - 1 if start else 0
        noise = torch.randn(cond.shape[0], 16, WINDOW, 4, 4, generator=generator)
        window = next_window(guided, cond, negative, stream[:, :, start : start + known], noise, sigmas)
        stream[:, :, start + known : start + WINDOW] = window[:, :, known:]
    return stream


@torch.no_grad()
def next_window(
    guided: Any,
    cond: torch.Tensor,
    negative: torch.Tensor,
    past: torch.Tensor,
    noise: torch.Tensor,
    sigmas: torch.Tensor,
) -> torch.Tensor:
    """A window (N, 16, WINDOW, h, w) denoised from `noise` along `sigmas` whose first frames are
    `past` (N, 16, K, h, w), put back at every step at that step's noise; K = 0: a clip."""
    known = past.shape[2]
    x = noise.clone()
    for sigma, after in zip(sigmas[:-1], sigmas[1:]):
        x[:, :, :known] = (1 - sigma) * past + sigma * noise[:, :, :known]
        timesteps = torch.full((noise.shape[0],), int(sigma * 1000), dtype=torch.int64)
        x = x + (after - sigma) * guided.velocity(x, timesteps, cond, negative)
    return x


def streamed_row(teacher: str, count: int, steps: int) -> dict[str, Any]:
    """The teacher's own 33-frame streams (`stream_by_windows`) of the first `count` scored clip
    prompts, decoded by the stream reader and scored as the students' 3x streams are."""
    from distill.models.pipelines import decode_latents
    from distill.toy.evaluation import eval_prompts
    from distill.toy.stream_reader import STREAM_FRAMES, load_reader
    from distill.toy.stream_score import score_stream

    prompts = eval_prompts(count, clips=True)
    latents = stream_by_windows(*guided_teacher(teacher, prompts), (STREAM_FRAMES - 1) // 4 + 1, steps)
    reader = load_reader()
    return score_stream([decode_latents(latent, reader) for latent in latents], prompts)


@entry_point
def main(argv: list[str] | None = None) -> int:
    parser = Parser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--teacher",
        default=TEACHER,
        action=PathAction,
        kind=Kind.FOLDER,
        help="the toy teacher (make demo writes it)",
    )
    parser.add_argument("--prompts", type=integer(1), default=24, help="the first N scored clip prompts")
    parser.add_argument(
        "--stream_steps",
        type=integer(0),
        default=0,
        help="also stream the teacher itself 33 frames a window at a time in N steps a window, and score it (0: no)",
    )
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    if args.stream_steps:
        row = streamed_row(str(args.teacher), args.prompts, args.stream_steps)
        shown = {k: row[k] for k in ("accuracy", "identity", "motion_ratio", "late_motion_ratio")}
        print(f"the teacher streamed a window at a time, {args.prompts} prompts: {shown}")
    header = (
        "| noise | window from latent frame | teacher's error per frame | change: window | change: estimate |"
    )
    for still in (False, True):
        print(f"\n{'shapes standing still' if still else 'every motion'}, {args.prompts} prompts:\n{header}")
        print("|---|---|---|---|---|")
        for row in judge(str(args.teacher), args.prompts, 0, still):
            print(
                f"| {row['sigma']} | {row['start']} | {row['error']} | {row['change']} | {row['teacher_change']} |"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
