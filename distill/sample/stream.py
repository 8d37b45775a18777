"""`generate --stream`: a causal student's clip written frame by frame as each chunk finishes, with
the time to the first frame and the frames per second reported.

    python -m distill.generate --student outputs/causal/student --stream --num_frames 33 \
        --prompt "a red ball rolls to the right" --output ball.mp4

The student must be causal (its folder holds causal_config.json: distill/models/causal). The clip is
made by the streaming sampler (distill/models/causal/streaming.py) and decoded chunk by chunk
(distill/models/causal/decode.py); each chunk's frames are appended to the MP4 as soon as they are
decoded (the file is renamed into place when the clip is complete). `--num_frames` may be longer than
the student was trained on: `--stream_window` past chunks (default: the trained clip's span) stay in
its KV cache, older ones are dropped. An image-to-video student streams too: its image enters the
first chunk, as the whole clip's condition does for the bidirectional student.

A causal LoRA student's folder (lora/: causal_config.json beside the adapters) streams too: the
teacher's experts with its adapters, each expert keeping its own KV cache; and so does its run's
merged/ export (the experts with the adapters merged in: causal_config.json in merged/ and beside
each expert's config).

Refused, with the fix: a student that is not causal (or --teacher_only, or a bidirectional LoRA run's
folder), a frame count that is not whole chunks (the counts that are are named), guidance above 1 (the causal
sampler runs one forward per step, with one cache).
"""

from __future__ import annotations

import argparse
import logging
import os
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from distill.config.flag_rules import Dependent
from distill.models.causal.layout import CAUSAL_FILE, CausalLayout, read_causal_config
from distill.models.lora_files import is_lora_folder
from distill.models.teacher import TeacherInfo
from distill.ops.command import integer
from distill.ops.errors import DistillError, Stage
from distill.sample.chain import Continuation
from distill.sample.media import FPS, to_uint8
from distill.sample.student_folder import is_merged_folder

logger = logging.getLogger(__name__)

# The past chunks a stream keeps when neither the flag nor a trained length says otherwise.
DEFAULT_WINDOW = 3


def add_stream_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--stream",
        action="store_true",
        help="Stream a causal student: frames written as each chunk finishes, time to first frame and "
        "frames per second reported; --num_frames may exceed the trained length (whole chunks).",
    )
    parser.add_argument(
        "--stream_window",
        type=integer(1),
        help="With --stream: how many past chunks the KV cache keeps (older ones are dropped); default: "
        f"the span of the clip the student was trained on, else {DEFAULT_WINDOW}.",
    )


def stream_rules() -> tuple[Dependent, ...]:
    """generate's flags that act only with --stream (distill.config.flag_rules)."""
    return (
        Dependent(
            ("stream_window",),
            lambda a: a.stream,
            "--stream",
            "it is how many past chunks the streaming sampler's KV cache keeps",
            "add --stream",
        ),
    )


def whole_chunk_counts(layout: CausalLayout, temporal: int, near: int, count: int = 4) -> list[int]:
    """Frame counts (`temporal`k+1) that are whole chunks of `layout`, the first `count` at or above
    the smallest one below `near`."""
    step = layout.chunk_frames
    below = max(1, ((near - 1) // temporal + 1) // step)
    return [(k * step - 1) * temporal + 1 for k in range(below, below + count)]


def check_stream(args: argparse.Namespace, info: TeacherInfo) -> CausalLayout:
    """The causal layout of --student for `--stream`, or a refusal naming the flag and the fix."""
    if args.teacher_only or not args.student:
        raise DistillError(
            "--stream needs a causal student",
            "--teacher_only renders the teacher, which attends over the whole clip at once: nothing to stream",
            fixes=[
                "pass --student with a causal student's folder (it holds causal_config.json)",
                "or drop --stream",
            ],
            stage=Stage.CONFIG,
        )
    layout = read_causal_config(args.student)
    if layout is None and (is_lora_folder(args.student) or is_merged_folder(args.student)):
        what = "adapters" if is_lora_folder(args.student) else "merged experts"
        raise DistillError(
            f"--stream needs a causal student: {args.student} holds the {what} of a bidirectional "
            f"LoRA student (no {CAUSAL_FILE})",
            "its experts attend over the whole clip at once, so no frame is final before the last step "
            "of the whole clip",
            fixes=[
                "train a causal LoRA student (--student_lora_rank with --student_chunk_frames 3 and "
                "--method self_forcing: docs/streaming.md); its lora/ (and merged/) folder streams",
                "or drop --stream to sample it whole",
            ],
            stage=Stage.CONFIG,
        )
    if layout is None:
        raise DistillError(
            f"--stream needs a causal student: {args.student} is bidirectional (no {CAUSAL_FILE})",
            "a bidirectional student attends over the whole clip at once, so no frame is final before "
            "the last step of the whole clip",
            fixes=[
                "make it causal and export it again: distill.models.causal.attention.make_causal(model, 3), "
                "then distill.models.student.export_student(model, FOLDER) (a causal training run exports one)",
                "or drop --stream to sample it whole",
            ],
            stage=Stage.CONFIG,
        )
    if args.guidance > 1.0:
        raise DistillError(
            f"--stream samples at guidance 1, got --guidance {args.guidance:g}",
            "the streaming sampler runs one forward of the student per step on one KV cache; a distilled "
            "student has its guidance built in",
            fixes=["use --guidance 1 (the student's own), or drop --stream"],
            stage=Stage.CONFIG,
        )
    temporal = info.vae_scale_temporal
    latent_frames = (args.num_frames - 1) // temporal + 1
    if not layout.whole_chunks(latent_frames):
        counts = ", ".join(map(str, whole_chunk_counts(layout, temporal, args.num_frames)))
        raise DistillError(
            f"--num_frames {args.num_frames} is not whole chunks of the causal student",
            f"{args.num_frames} frames are {latent_frames} latent frames; the student makes "
            f"{layout.chunk_frames} latent frames a chunk ({CAUSAL_FILE} in {args.student})",
            fixes=[
                f"use --num_frames {counts}, ... ({temporal} x chunks x {layout.chunk_frames} - {temporal - 1})"
            ],
            stage=Stage.CONFIG,
        )
    return layout


def default_window(layout: CausalLayout, trained_frames: int | None, temporal: int) -> int:
    """Past chunks kept by default: those of the clip the student was trained on (all but the chunk
    being made, at least 1), else DEFAULT_WINDOW."""
    if trained_frames is None:
        return DEFAULT_WINDOW
    return layout.trained_window((trained_frames - 1) // temporal + 1)


@dataclass
class StreamReport:
    """How one streamed clip went (seconds from the start of its sampling)."""

    frames: int
    first_frames: int
    time_to_first_frame: float
    total: float
    chunks: int
    hops: int = 0  # clips continued from the last frame (--continue_with)

    @property
    def frames_per_second(self) -> float:
        return self.frames / self.total if self.total > 0 else float("inf")

    def line(self, index: int) -> str:
        return (
            f"prompt {index}: first {self.first_frames} frames after {self.time_to_first_frame:.2f} s "
            f"({100 * self.time_to_first_frame / max(self.total, 1e-9):.0f}% of the clip's time); "
            f"{self.frames} frames in {self.chunks} chunks"
            + (f" and {self.hops} hop(s) from the last frame" if self.hops else "")
            + f" in {self.total:.2f} s = "
            f"{self.frames_per_second:.1f} frames/s"
        )


class Streamer:
    """A causal student with the teacher's VAE and the prompts' embeddings, streaming one clip a call."""

    def __init__(
        self,
        student: Any,
        vae: Any,
        scheduler: Any,
        embeddings: dict[str, torch.Tensor],
        info: TeacherInfo,
        args: argparse.Namespace,
        window: int,
    ) -> None:
        self.student, self.vae, self.scheduler = student, vae, scheduler
        self.embeddings, self.info, self.args, self.window = embeddings, info, args, window

    def condition(self, image: torch.Tensor | None) -> Any:
        """The whole clip's image condition (cut to each chunk by the sampler), None for text."""
        if image is None:
            return None
        from distill.models.conditioning import image_condition

        return image_condition(
            self.vae,
            image,
            self.args.num_frames,
            scale_temporal=self.info.vae_scale_temporal,
            device=next(self.student.parameters()).device,
            kind=self.info.kind,
        )

    def chunks(self, prompt: str, seed: int, image: torch.Tensor | None = None) -> Iterator[np.ndarray]:
        """`prompt`'s clip from `seed`, chunk by chunk: each chunk's frames (F, H, W, 3) in [0, 1] as
        soon as it is made and decoded. `prompt` is one the streamer was built for (its embedding
        is kept); `image` the first frame of an image-to-video student, preprocessed as generate does."""
        from distill.models.causal.decode import ChunkDecoder
        from distill.models.causal.streaming import stream_latents

        args, info = self.args, self.info
        if prompt not in self.embeddings:
            raise ValueError(
                f"{prompt!r} is not one of the prompts this streamer encoded: {list(self.embeddings)}"
            )
        condition = self.condition(image)
        decoder = ChunkDecoder(self.vae)
        try:
            for chunk in stream_latents(
                self.student,
                self.scheduler,
                args.steps,
                self.embeddings[prompt][None],
                info.latent_shape(args.height, args.width, args.num_frames),
                seed,
                window=self.window,
                kind=info.kind,
                condition=condition,
            ):
                yield decoder(chunk.latents)
        finally:
            decoder.close()

    def stream(
        self,
        index: int,
        prompt: str,
        seed: int,
        target: Path,
        image: torch.Tensor | None = None,
        continuation: Continuation | None = None,
    ) -> tuple[Path, StreamReport]:
        """Stream prompt `index` (`prompt`)'s clip from `seed` into `target` (an .mp4, or a .png for
        one frame), and report its time to first frame and frames per second. With a `continuation`
        (--continue_with), each hop's frames follow the clip's in the file as soon as it is made.

        The first frames count as arrived when they are decoded, before the file gets them: the
        writer is one consumer of the stream, and the first one of a process starts ffmpeg (0.2-0.5 s
        here, against 0.04 s for the toy student's first chunk). The total is until the file is
        complete."""
        total_frames = continuation.plan.total if continuation else self.args.num_frames
        writer = _FrameWriter(target, total_frames)
        start = time.perf_counter()
        first: tuple[float, int] | None = None
        chunks = hops = 0
        try:
            for frames in self.chunks(prompt, seed, image):
                if first is None:
                    first = (time.perf_counter() - start, len(frames))
                writer.add(frames)
                chunks += 1
            if continuation is not None:
                for frames in continuation.frames_after(writer.last_frame, index, seed):
                    writer.add(frames)
                    hops += 1
            path = writer.finish()
        finally:
            writer.abandon()
        total = time.perf_counter() - start
        assert first is not None
        report = StreamReport(writer.count, first[1], first[0], total, chunks, hops)
        logger.info(report.line(index))
        return path, report


@dataclass
class OpenStream:
    """A causal student ready to stream in Python (`distill.generate.open_stream`), with the prompts
    (and first frames, image to video) it was opened for."""

    streamer: Streamer
    prompts: list[str]
    images: Sequence[torch.Tensor] | None
    continuation: Continuation | None = None

    def chunks(self, index: int = 0, seed: int = 0) -> Iterator[np.ndarray]:
        """Prompt `index`'s clip from `seed`, chunk by chunk: each chunk's frames (F, H, W, 3) in
        [0, 1] as soon as it is made (the same frames `generate --stream` writes for that seed), then
        with --continue_with each hop's new frames."""
        image = None if self.images is None else self.images[index]
        last = None
        for frames in self.streamer.chunks(self.prompts[index], seed, image):
            last = frames[-1]
            yield frames
        if self.continuation is not None and last is not None:
            yield from self.continuation.frames_after(last, index, seed)


class _FrameWriter:
    """Frames appended to an MP4 as they arrive, under a temporary name until the clip is complete;
    one frame is a PNG."""

    def __init__(self, target: Path, num_frames: int) -> None:
        self.target = target.with_suffix(".png" if num_frames == 1 else ".mp4")
        self.tmp = self.target.with_name(f".{self.target.stem}.{os.getpid()}.tmp{self.target.suffix}")
        self.writer: Any = None
        self.count = 0
        self.frames: list[np.ndarray] = []
        self.last_frame: np.ndarray | None = None  # as decoded, before 8-bit rounding: a hop starts from it

    def add(self, frames: np.ndarray) -> None:
        import imageio.v2 as imageio

        self.last_frame = frames[-1]
        pixels = to_uint8(frames)
        self.count += len(pixels)
        if self.target.suffix == ".png":
            self.frames.extend(pixels)
            return
        if self.writer is None:
            self.tmp.parent.mkdir(parents=True, exist_ok=True)  # an --output folder not made yet
            self.writer = imageio.get_writer(self.tmp, fps=FPS, macro_block_size=16)
        for frame in pixels:
            self.writer.append_data(frame)

    def finish(self) -> Path:
        import imageio.v2 as imageio

        if self.target.suffix == ".png":
            self.tmp.parent.mkdir(parents=True, exist_ok=True)
            imageio.imwrite(self.tmp, self.frames[0])
        else:
            self.writer.close()
            self.writer = None
        os.replace(self.tmp, self.target)
        return self.target

    def abandon(self) -> None:
        if self.writer is not None:
            self.writer.close()
        self.tmp.unlink(missing_ok=True)


def stream_all(
    streamer: Streamer,
    prompts: Sequence[str],
    targets: Sequence[Path],
    images: Sequence[torch.Tensor] | None,
    seed: int,
    continuation: Continuation | None = None,
) -> list[Path]:
    """Stream every prompt's clip (prompt i from seed + i) into its target, continued by
    `continuation` when given; the files written."""
    return [
        streamer.stream(i, prompt, seed + i, target, None if images is None else images[i], continuation)[0]
        for i, (prompt, target) in enumerate(zip(prompts, targets, strict=True))
    ]


def build_streamer(
    args: argparse.Namespace,
    info: TeacherInfo,
    device: torch.device,
    dtype: torch.dtype,
    run: Any,
    layout: CausalLayout,
    prompts: Sequence[str],
) -> Streamer:
    """The causal student, its scheduler, the teacher's VAE and every prompt's embedding (the text
    encoder loaded for that and freed before any clip streams)."""
    from distill.models.few_step import few_step_scheduler, load_few_step_scheduler
    from distill.models.pipelines import encode_prompts, load_vae, scheduler_from_config
    from distill.sample.student_folder import load_any_student

    student = load_any_student(args.student, info, device, dtype)
    if run is not None and run.scheduler:
        scheduler = scheduler_from_config(run.scheduler)
    else:
        scheduler = load_few_step_scheduler(args.student)
        if scheduler is None:
            scheduler = few_step_scheduler(shift=5.0)
            logger.info("no scheduler recorded with the student: streaming on the few-step grid of shift 5")
    embeddings = encode_prompts(info.path, list(prompts), args.max_sequence_length, device, dtype)
    window = args.stream_window or default_window(
        layout, run.num_frames if run else None, info.vae_scale_temporal
    )
    logger.info(
        "streaming: chunks of %d latent frames, %d steps each, KV cache window %d past chunks",
        layout.chunk_frames,
        args.steps,
        window,
    )
    return Streamer(student, load_vae(info.path, device), scheduler, embeddings, info, args, window)
