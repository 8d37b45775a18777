"""Streams continued by the toy image-to-video teacher from their last frame: whether the toy world has
a teacher that goes on moving a shape past the trained 9 frames. A measurement, not shipped.

    python -m distill.toy.chained_judge                 # ~2 min on one thread, 72 prompts
    python -m distill.toy.chained_judge --students      # also the shipped 4-step students chained by
                                                        # generate --continue_with, and the causal
                                                        # student re-anchored (~5 min)

A stream is started by a 9-frame clip (the world's own, the text-to-video teacher's at 20 steps, or
the shipped 4-step clip student's), then continued a clip at a time: the image-to-video teacher is
given the stream's last frame as its image and a prompt that names only the motion ("the shape moving
leftward fast"), and the 8 frames it makes after that image are appended, until the stream has 33
frames (3x the trained length). Every clip is decoded at the length the toy VAE was fitted on, so the
frames are read as they are (no stream reader) by `stream_score.score_stream`. The students' chains
are made by the product's own path, `generate --continue_with` (distill/sample/chain.py), with the same
motion-only hop prompts: the shipped clip student's clip, and the shipped causal student's stream
(`generate --stream`), each continued by the shipped 4-step I2V dmd student.

The causal students judged by the text-to-video teacher stall past the trained span (docs/streaming.md:
3x motion ratio 0.21), and so does that teacher streamed a window at a time (0.38, window_judge). A
teacher conditioned on the frame before its clip is the one the world's image-to-video data taught to
continue a motion from wherever the shape is: this module measures how far that carries a stream.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from distill.ops.command import Parser, PathAction, entry_point, integer
from distill.ops.paths import Kind
from distill.sample.chain import HOP_SEED  # hop h of clip i draws its noise from seed i + HOP_SEED * h
from distill.toy.shipped import ASSETS, I2V_ASSETS
from distill.toy.world import CLIP_FRAMES, parse_prompt

STREAM_FRAMES = 33  # 3x the trained clip's 9 frames: 9 latent frames against 3
TEACHER_GUIDANCE = (3.0, 1.5)  # both toy teachers' clip guidance (high-noise, low-noise)
TEACHER_STEPS = 20
CLIP_STUDENT = ASSETS.parent / "toy_student_clips_dmd"
I2V_STUDENT = ASSETS.parent / "toy_i2v_student_dmd"
CAUSAL_STUDENT = ASSETS.parent / "toy_student_causal"
FIGURES = ("accuracy", "identity", "motion_ratio", "late_motion_ratio")


def continue_streams(
    clips: Sequence[np.ndarray],
    prompts: Sequence[str],
    i2v_pipe: Any,
    steps: int,
    guidance: tuple[float, float],
    frames: int = STREAM_FRAMES,
) -> list[np.ndarray]:
    """Each clip (F, H, W, 3) in [0, 1] of `clips` continued to `frames` frames by `i2v_pipe` (a stock
    WanImageToVideoPipeline), a 9-frame clip at a time from the stream's last frame and the motion its
    clip prompt names; the frames after that image are appended. The clips come back unchanged in
    front, bit for bit."""
    from distill.toy.i2v_evaluation import sample_cases
    from distill.toy.image_score import ImageCase

    motions = motion_prompts(prompts)
    streams = [np.asarray(clip, dtype=np.float32) for clip in clips]
    hop = 0
    while streams[0].shape[0] < frames:
        hop += 1
        cases = [ImageCase(motion, stream[-1], None) for motion, stream in zip(motions, streams)]
        made = sample_cases(i2v_pipe, cases, steps, guidance, seed=HOP_SEED * hop)
        streams = [np.concatenate([stream, clip[1:]])[:frames] for stream, clip in zip(streams, made)]
    return streams


def world_streams(prompts: Sequence[str], frames: int, size: int = 32) -> list[np.ndarray]:
    """The world's own right `frames`-frame stream of each prompt (prompt i's unnamed variation from
    one generator of seed 0, so a shorter stream is the start of a longer one)."""
    from distill.toy.stream_score import render_stream
    from distill.toy.world import scene_for

    rng = np.random.default_rng(0)
    return [render_stream(scene_for(p, rng), frames, size) for p in prompts]


def teacher_clips(teacher: Path, prompts: Sequence[str]) -> np.ndarray:
    """The text-to-video teacher's 9-frame clips of `prompts` at its full steps and clip guidance."""
    from distill.toy.evaluation import load_experts, sample_pictures

    high, low = load_experts(teacher)
    return sample_pictures(
        teacher,
        prompts,
        transformer=high,
        transformer_2=low,
        steps=TEACHER_STEPS,
        guidance_scale=TEACHER_GUIDANCE[0],
        guidance_scale_2=TEACHER_GUIDANCE[1],
        num_frames=CLIP_FRAMES,
    )


def motion_prompts(prompts: Sequence[str]) -> list[str]:
    """Each clip prompt's motion alone ("the shape moving leftward fast"): what a hop is told."""
    from distill.toy.image_score import motion_prompt

    motions = []
    for prompt in prompts:
        attributes = parse_prompt(prompt)
        if attributes is None or "direction" not in attributes:
            raise ValueError(f"not a toy clip prompt: {prompt!r}")
        motions.append(motion_prompt(attributes["direction"], attributes["speed"]))
    return motions


def generated_streams(
    student: Path, teacher: Path, i2v_teacher: Path, prompts: Sequence[str], frames: int = STREAM_FRAMES
) -> list[np.ndarray]:
    """Each prompt's `frames`-frame clip as `generate --continue_with` makes it (prompt i from seed i,
    hops told its motion): `student`'s clip (streamed when it is causal), continued by the shipped
    4-step I2V dmd student; the frames as decoded, before any file rounds them."""
    from distill.generate import build_parser, open_stream, prepare_chained, render
    from distill.models.causal.layout import read_causal_config

    argv = [
        *("--student", str(student), "--teacher_path", str(teacher), "--num_frames", str(frames)),
        *("--continue_with", str(I2V_STUDENT), "--continue_teacher_path", str(i2v_teacher)),
    ]
    for prompt, motion in zip(prompts, motion_prompts(prompts)):
        argv += ["--prompt", prompt, "--continue_prompt", motion]
    if read_causal_config(student) is not None:
        stream = open_stream(argv)
        return [np.concatenate(list(stream.chunks(i, seed=i))) for i in range(len(prompts))]
    args = build_parser().parse_args([*argv, "--output", "unused"])
    args.output = None  # nothing is written
    pipe, _, _, _, continuation = prepare_chained(args)
    assert continuation is not None
    return [continuation.extend(render(pipe, args, p, i), i, i) for i, p in enumerate(prompts)]


@torch.no_grad()
def reanchored_streams(
    student: Path, teacher: Path, prompts: Sequence[str], frames: int = STREAM_FRAMES
) -> list[np.ndarray]:
    """The causal `student`'s own 9-frame stream of each prompt (seed i, 4 steps), then continued a
    clip at a time from its last frame as the image-to-video teacher continues one: that frame,
    re-encoded as an image (a clip's first latent frame), is the stream's `context` in a fresh KV cache,
    the student makes the latent frames after it (the full clip prompt), and of that clip, decoded,
    the frames after the image are appended."""
    from distill.models.causal.streaming import stream_latents
    from distill.models.few_step import load_few_step_scheduler
    from distill.models.pipelines import decode_latents, encode_prompts, load_vae
    from distill.models.teacher import inspect_teacher
    from distill.sample.student_folder import load_student
    from distill.toy.window_judge import encode_frames

    cpu = torch.device("cpu")
    model = load_student(student, inspect_teacher(str(teacher)), cpu, torch.float32)
    scheduler = load_few_step_scheduler(student)
    vae = load_vae(str(teacher), cpu)
    embeddings = encode_prompts(str(teacher), list(prompts), 512, cpu, torch.float32)
    latent_frames = (CLIP_FRAMES - 1) // 4 + 1

    def made(text: torch.Tensor, shape: tuple[int, ...], seed: int, context: Any = None) -> torch.Tensor:
        chunks = stream_latents(model, scheduler, 4, text, shape, seed, context=context)
        return torch.cat([chunk.latents for chunk in chunks], dim=2)

    streams = []
    for i, prompt in enumerate(prompts):
        text = embeddings[prompt][None]
        stream = decode_latents(made(text, (16, latent_frames, 4, 4), i)[0], vae)
        hop = 0
        while stream.shape[0] < frames:
            hop += 1
            image = encode_frames(vae, stream[None, -1:])
            after = made(text, (16, latent_frames - 1, 4, 4), HOP_SEED * hop + i, context=image)
            clip = decode_latents(torch.cat([image, after], dim=2)[0], vae)
            stream = np.concatenate([stream, clip[1:]])[:frames]
        streams.append(stream)
    return streams


def scored(name: str, streams: Sequence[np.ndarray], prompts: Sequence[str]) -> dict[str, Any]:
    from distill.toy.stream_score import score_stream

    result = score_stream(streams, prompts)
    return {"row": name, **{key: result[key] for key in FIGURES}}


def rows(teacher: Path, i2v_teacher: Path, count: int, students: bool) -> list[dict[str, Any]]:
    """The table's rows on the first `count` scored clip prompts."""
    from distill.toy.evaluation import eval_prompts
    from distill.toy.i2v_evaluation import load_pipeline

    prompts = eval_prompts(count, clips=True)
    world = world_streams(prompts, STREAM_FRAMES)
    i2v = load_pipeline(i2v_teacher)
    found = [scored("the world's right streams", world, prompts)]
    starts = {
        "the world's clip": [stream[:CLIP_FRAMES] for stream in world],
        "the teacher's clip (20 steps)": teacher_clips(teacher, prompts),
    }
    for name, clips in starts.items():
        streams = continue_streams(clips, prompts, i2v, TEACHER_STEPS, TEACHER_GUIDANCE)
        found.append(scored(f"{name}, then the I2V teacher (20 steps)", streams, prompts))
    if students:
        streams = generated_streams(CLIP_STUDENT, teacher, i2v_teacher, prompts)
        found.append(
            scored("the 4-step clip student's clip, then the 4-step I2V dmd student", streams, prompts)
        )
        streams = generated_streams(CAUSAL_STUDENT, teacher, i2v_teacher, prompts)
        found.append(scored("the causal student's stream, then the 4-step I2V dmd student", streams, prompts))
        streams = reanchored_streams(CAUSAL_STUDENT, teacher, prompts)
        found.append(
            scored("the causal student, re-anchored on its last frame at each hop", streams, prompts)
        )
    return found


@entry_point
def main(argv: list[str] | None = None) -> int:
    parser = Parser(prog="python -m distill.toy.chained_judge", description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--teacher", default=ASSETS, action=PathAction, kind=Kind.FOLDER, help="the toy teacher"
    )
    parser.add_argument(
        "--i2v_teacher",
        default=I2V_ASSETS,
        action=PathAction,
        kind=Kind.FOLDER,
        help="the toy image-to-video teacher that continues the streams",
    )
    parser.add_argument("--prompts", type=integer(9), default=72, help="the first N scored clip prompts")
    parser.add_argument(
        "--students",
        action="store_true",
        help="also the shipped 4-step clip and I2V dmd students, chained, and the causal student re-anchored",
    )
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    print(f"{STREAM_FRAMES}-frame streams, the first {args.prompts} scored clip prompts:")
    print("| stream | accuracy | identity | motion ratio | after frame 8 |\n|---|---|---|---|---|")
    for row in rows(Path(args.teacher), Path(args.i2v_teacher), args.prompts, args.students):
        print(f"| {row['row']} | " + " | ".join(f"{row[key]:.2f}" for key in FIGURES) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
