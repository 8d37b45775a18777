"""`generate --continue_with`: clips longer than a student makes, continued from their last frame by an
image-to-video student.

    python -m distill.generate --student outputs/causal/student --stream \
        --continue_with outputs/i2v_dmd/student --num_frames 241 \
        --prompt "a red fox runs through the snow" --output fox.mp4

The first clip is the one --student makes at the length it was trained on (streamed chunk by chunk with
--stream). Then, hop after hop, the image-to-video student is given the clip's last frame as its image,
makes a clip of its own trained length from it, and the frames after that image are appended, until
the clip has --num_frames frames; the last hop is cut to fit. With a first clip of F frames and hops
of H, --num_frames F + k (H - 1) wastes none (Wan 2.2 at 81 frames: 161, 241, 321, ...). Each hop's
frames are written as soon as it is made; `generate --stream` reports them in its time and frames per
second.

Why a second model: a text-to-video student (causal or not) was taught to make a clip from noise, and
given its own last frame it holds the picture, while Wan2.2-I2V-A14B, and a student distilled from
it, was taught to go on from any frame: docs/streaming.md measures both in the toy world.

Hop h (1, 2, ...) of prompt i samples from seed `--seed + i + 1000 h`, so no hop repeats the noise of
another. Its prompt is --continue_prompt (given once for every prompt, or once per prompt in order),
else the prompt itself. The image-to-video student samples with its own run's settings (steps,
guidance, clip length, teacher: its run_settings.json; --continue_teacher_path overrides the teacher)
at the first clip's size. Without --stream every first clip is made before it loads, and the first
model is let go: two models that each fit the device alone fit as a chain. With --stream both are held.
"""

from __future__ import annotations

import argparse
import logging
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from distill.config.flag_rules import Dependent
from distill.data.samples import accepts_images
from distill.models.lora_files import is_lora_folder
from distill.models.pipelines import check_sample_size
from distill.models.teacher import TeacherInfo
from distill.ops.command import PathAction
from distill.ops.errors import DistillError, Stage
from distill.ops.paths import Kind
from distill.sample.image_inputs import recorded_mode
from distill.sample.render_pipeline import build_pipeline, render
from distill.sample.run_settings import RunSettings
from distill.sample.sampling_flags import (
    check_counts,
    check_frame_count,
    describe,
    one_transformer_guidance,
    resolve_defaults,
)
from distill.sample.student_folder import (
    lora_student,
    require_student_folder,
    student_limits,
    trained_size_fix,
)
from distill.sample.teacher_loras import teacher_with_loras

logger = logging.getLogger(__name__)

HOP_SEED = 1000  # hop h of the prompt sampled from seed s draws its noise from seed s + HOP_SEED * h


def add_chain_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--continue_with",
        action=PathAction,
        kind=Kind.FOLDER,
        must_exist=False,
        help="An image-to-video student (OUTPUT/student or OUTPUT/lora of a Wan2.2-I2V-A14B run) that "
        "continues each clip from its last frame until --num_frames frames (docs/streaming.md).",
    )
    parser.add_argument(
        "--continue_prompt",
        action="append",
        help="With --continue_with: the prompt its hops are given (once for every prompt, or once per "
        "prompt in order); default: the prompt itself.",
    )
    parser.add_argument(
        "--continue_teacher_path",
        action=PathAction,
        kind=Kind.FOLDER_OR_HUB,
        help="With --continue_with: the image-to-video teacher its tokenizer, text encoder and VAE come "
        "from; default: the one its run used.",
    )


def chain_rules() -> tuple[Dependent, ...]:
    """generate's flags that act only with --continue_with (distill.config.flag_rules)."""
    return (
        Dependent(
            ("continue_prompt", "continue_teacher_path"),
            lambda a: a.continue_with is not None,
            "--continue_with",
            "it is a setting of the image-to-video student that continues each clip",
            "add --continue_with IMAGE_TO_VIDEO_STUDENT",
        ),
    )


@dataclass(frozen=True)
class ChainPlan:
    """How a clip of `total` frames is made: a first clip of `first`, then hops of `hop` frames, each
    starting from the frame before it (so each adds hop - 1)."""

    first: int
    hop: int
    total: int

    @property
    def hops(self) -> int:
        return -(-(self.total - self.first) // (self.hop - 1))

    def line(self) -> str:
        cut = self.first + self.hops * (self.hop - 1) - self.total
        return (
            f"continuing: a first clip of {self.first} frames, then {self.hops} hop(s) of {self.hop - 1} new "
            f"frames from the last frame, to {self.total} frames"
            + (f" (the last hop cut by {cut})" if cut else "")
        )


def plan_chain(total: int | None, first: int, hop: int, student: str, continuation: str) -> ChainPlan:
    """The plan of a `total`-frame clip, or a refusal naming the lengths that continue it (None: the
    user gave no --num_frames, which with --continue_with is the whole clip's length)."""
    lengths = ", ".join(str(first + k * (hop - 1)) for k in range(1, 4))
    if hop < 2:
        raise DistillError(
            f"--continue_with {continuation} makes {hop}-frame clips: nothing follows the image it starts from",
            "a hop appends the frames after its image; a student of one frame has none",
            fixes=["pass an image-to-video student trained on clips (its run's --num_frames 4k+1 above 1)"],
            stage=Stage.CONFIG,
        )
    if total is None:
        raise DistillError(
            "--continue_with needs --num_frames: how long the continued clip is",
            f"{student} makes {first} frames; each hop of {continuation} adds {hop - 1}",
            fixes=[f"add --num_frames {lengths}, ..."],
            stage=Stage.ARGV,
        )
    if total <= first:
        raise DistillError(
            f"--num_frames {total} with --continue_with: the first clip is already {first} frames",
            f"{student} makes {first} frames (its run's length); --continue_with continues a clip past it",
            fixes=[f"use --num_frames {lengths}, ... (each hop adds {hop - 1})", "or drop --continue_with"],
            stage=Stage.CONFIG,
        )
    return ChainPlan(first, hop, total)


def continuation_prompts(prompts: Sequence[str], given: Sequence[str] | None) -> list[str]:
    """Each prompt's hop prompt: --continue_prompt once for all, once per prompt, else the prompt."""
    if not given:
        return list(prompts)
    if len(given) == 1:
        return [given[0]] * len(prompts)
    if len(given) != len(prompts):
        raise DistillError(
            f"--continue_prompt given {len(given)} times for {len(prompts)} prompts",
            "it is given once (every prompt's hops) or once per prompt, in the prompts' order",
            fixes=[f"give --continue_prompt once, or {len(prompts)} times"],
            stage=Stage.ARGV,
        )
    return list(given)


def frame_as_image(frame: np.ndarray, vae_scale_factor: int) -> torch.Tensor:
    """A decoded frame (H, W, 3) in [0, 1] as the image-to-video pipeline's preprocessed image
    (1, 3, H, W) in [-1, 1], through the stock preprocessing (diffusers' VideoProcessor) with no
    rounding to 8 bits: the hop starts from the frame the first clip ended on."""
    from diffusers.video_processor import VideoProcessor

    height, width = frame.shape[:2]
    picture = torch.from_numpy(np.ascontiguousarray(frame, dtype=np.float32)).permute(2, 0, 1)[None]
    return VideoProcessor(vae_scale_factor=vae_scale_factor).preprocess(picture, height, width).float()


@dataclass(frozen=True)
class CheckedContinuation:
    """The --continue_with student, checked before any model loads."""

    args: argparse.Namespace  # its sampling settings: its run's, at the first clip's size
    info: TeacherInfo  # its teacher (with its run's LoRAs under a LoRA student's adapters)
    found: tuple[RunSettings, Path] | None  # its run settings and their file
    plan: ChainPlan


def check_continuation(
    args: argparse.Namespace, total: int | None, first_recorded: bool
) -> CheckedContinuation:
    """The --continue_with student of generate's resolved `args` (the first clip's settings), and the
    plan of a `total`-frame clip: refused before any model loads unless it starts a video from an image.
    Where no run recorded the first clip's length (`first_recorded` False: the teacher alone), it is set
    to the continuing student's, the length both were made for."""
    from distill.models.teacher import inspect_teacher

    left_to_its_run = (
        "num_frames",
        "steps",
        "guidance",
        "guidance_2",
        "negative_prompt",
        "max_sequence_length",
    )
    hop = argparse.Namespace(**vars(args))  # the first clip's size, device and dtype
    hop.student, hop.teacher_path = args.continue_with, args.continue_teacher_path
    hop.teacher_only, hop.stream, hop.teacher_lora, hop.image, hop.output = False, False, None, None, None
    for name in left_to_its_run:
        setattr(hop, name, None)
    require_student_folder(hop.student, teacher_only=False, flag="--continue_with")
    found = resolve_defaults(hop)
    check_counts(hop)
    info = inspect_teacher(hop.teacher_path)
    mode = recorded_mode(info.kind, found)
    if not accepts_images(info.kind) or (mode is not None and not mode.image):
        raise DistillError(
            f"--continue_with {args.continue_with} is a text-to-video student: it cannot go on from a frame",
            f"it was distilled from {info.kind.model}"
            + (" in text mode" if mode is not None else "")
            + "; a hop gives the continuing student the clip's last frame as the image its video starts from",
            fixes=[
                "pass an image-to-video student (of a Wan2.2-I2V-A14B run, or a Wan2.2-TI2V-5B run in image mode)",
                "or drop --continue_with",
            ],
            stage=Stage.CONFIG,
        )
    one_transformer_guidance(hop, info, {})
    if is_lora_folder(hop.student):  # the teacher's experts render under its adapters: its run's LoRAs
        info = teacher_with_loras(info, None, found)
    lora_student(hop.student, info)
    check_sample_size(
        args.height,
        args.width,
        hop.num_frames,
        info.vae_scale_spatial,
        info.vae_scale_temporal,
        [student_limits(hop.student, info)],
        fixes=trained_size_fix(found),
    )
    if total is not None:
        check_frame_count(total)
    if not first_recorded:
        args.num_frames = hop.num_frames
    first = "the teacher" if args.teacher_only else args.student
    return CheckedContinuation(
        hop, info, found, plan_chain(total, args.num_frames, hop.num_frames, first, hop.student)
    )


class Continuation:
    """An image-to-video student ready to continue clips, hop by hop, from their last frames. Its
    pipeline loads on first use (`load`): generate renders every first clip and lets go of that model
    before this one loads, so a chain of two models that each fit the device alone fits too."""

    def __init__(
        self, checked: CheckedContinuation, prompts: Sequence[str], device: torch.device, dtype: torch.dtype
    ) -> None:
        self.checked, self.device, self.dtype = checked, device, dtype
        self.args, self.plan = checked.args, checked.plan
        self.prompts = list(prompts)  # prompt i's hop prompt
        self.pipe: Any = None

    def load(self) -> Any:
        """The image-to-video student's stock pipeline, built once."""
        if self.pipe is None:
            checked = self.checked
            run = checked.found[0] if checked.found else None
            self.pipe = build_pipeline(checked.args, checked.info, self.device, self.dtype, run, image=True)
        return self.pipe

    def frames_after(self, last_frame: np.ndarray, index: int, seed: int) -> Iterator[np.ndarray]:
        """The frames that follow a first clip ending on `last_frame` (prompt `index`'s, sampled from
        `seed`), one hop's new frames at a time, until the plan's total."""
        pipe = self.load()
        made, hop = self.plan.first, 0
        while made < self.plan.total:
            hop += 1
            image = frame_as_image(last_frame, int(pipe.vae_scale_factor_spatial))
            clip = render(pipe, self.args, self.prompts[index], seed + HOP_SEED * hop, image=image)
            new = clip[1 : 1 + self.plan.total - made]
            yield new
            last_frame, made = clip[-1], made + len(new)

    def extend(self, first: np.ndarray, index: int, seed: int) -> np.ndarray:
        """The first clip (F, H, W, 3) followed by every hop's frames."""
        return np.concatenate([first, *self.frames_after(first[-1], index, seed)])


def build_continuation(
    checked: CheckedContinuation, prompts: Sequence[str], device: torch.device, dtype: torch.dtype
) -> Continuation:
    """The --continue_with student, ready to continue each prompt's clip with its hop prompt
    (`prompts`); its pipeline loads on first use."""
    found = checked.found
    logger.info(
        describe(checked.args, "continued by", f"defaults from {found[1]}" if found else "built-in defaults")
    )
    logger.info(checked.plan.line())
    return Continuation(checked, prompts, device, dtype)
