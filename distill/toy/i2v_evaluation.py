"""Sampling a toy image-to-video teacher with stock WanImageToVideoPipeline, and its image score.

    python -m distill.toy.i2v_evaluation --teacher assets/toy_i2v_teacher --count 72

Every case is image_score's: a held-out image (frame 0 of a world clip drawn from HELD_OUT_SEED) and a
prompt naming only the motion; each clip gets its own noise (seed + case index), so two runs with the
same seed and steps see the same noise, and so do a teacher and a student.
"""

from __future__ import annotations

import json
import sys
import weakref
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from distill.models.pipelines import encode_on_needed_tokens
from distill.ops.command import Parser, PathAction, entry_point, integer, number
from distill.ops.paths import Kind
from distill.toy import world
from distill.toy.image_score import HELD_OUT_SEED, ImageCase, motion_prompts, score_image_clips


def load_pipeline(folder: str | Path, device: str = "cpu") -> Any:
    """The stock pipeline of an image-to-video teacher folder, float32 on `device`."""
    from diffusers import WanImageToVideoPipeline

    # `dtype`, the pinned diffusers' name: `torch_dtype` on a pipeline prints a FutureWarning there. The
    # code the model cards give users keeps `torch_dtype`, which older diffusers read too.
    pipe = WanImageToVideoPipeline.from_pretrained(str(folder), dtype=torch.float32).to(device)
    pipe.set_progress_bar_config(disable=True)
    return pipe


# text encoder -> {prompt: (embedding, empty negative's)}: held as long as the encoder is.
_EMBEDDINGS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def prompt_embeddings(pipe: Any, prompt: str) -> dict[str, torch.Tensor]:
    """The pipeline's own embeddings of `prompt` and of the empty negative prompt (its default), as
    `prompt_embeds` / `negative_prompt_embeds`, kept per text encoder: the teacher and the students
    that share its encoder sample the same prompts at several step counts, and each 512-token
    encoding cost more than a few-step sample of the toy clip."""
    known = _EMBEDDINGS.setdefault(pipe.text_encoder, {})
    if prompt not in known:
        known[prompt] = encode_on_needed_tokens(pipe, [prompt], 512, pipe.text_encoder.device, negative=True)
    embedding, negative = known[prompt]
    return {"prompt_embeds": embedding, "negative_prompt_embeds": negative}


@torch.no_grad()
def sample_cases(
    pipe: Any,
    cases: Sequence[ImageCase],
    steps: int,
    guidance: tuple[float, float],
    seed: int = 0,
    frames: int = world.CLIP_FRAMES,
) -> np.ndarray:
    """Clips (N, F, H, W, 3) in [0, 1] from `pipe` for `cases`: case i's image and prompt, noise from
    seed + i, `steps` sampling steps at guidance (high-noise, low-noise)."""
    size = cases[0].image.shape[0]
    clips = []
    # One case per call: the stock pipeline encodes the image batch once per generator (or repeats
    # it per prompt), so a batch of images would pair each prompt with every image.
    for i, case in enumerate(cases):
        if getattr(pipe.scheduler.config, "stochastic_sampling", False):
            # A few-step student's scheduler re-noises from the global RNG (step() gets no
            # generator): seeded per case, so its clips do not depend on what ran before.
            torch.manual_seed(seed + i)
        out = pipe(
            # (1, 3, H, W) float in [0, 1]: the pipeline's processor maps it to [-1, 1] with no
            # rounding to uint8, so the condition is the one the teacher trained on.
            image=torch.from_numpy(case.image).permute(2, 0, 1)[None],
            **prompt_embeddings(pipe, case.prompt),
            height=size,
            width=size,
            num_frames=frames,
            num_inference_steps=steps,
            guidance_scale=guidance[0],
            # One transformer (a student replacing both experts) has no second scale to take.
            guidance_scale_2=guidance[1] if pipe.config.boundary_ratio is not None else None,
            generator=torch.Generator().manual_seed(seed + i),
            output_type="np",
        ).frames
        clips.append(np.asarray(out[0], dtype=np.float32))
    return np.stack(clips)


def teacher_guidance(folder: str | Path) -> tuple[tuple[float, float], int]:
    """The I2V toy teacher's own guidance and full step count, from its toy_world.json."""
    description = json.loads((Path(folder) / world.WORLD_FILE).read_text())
    guidance = (float(description["guidance_scale"]), float(description["guidance_scale_2"]))
    return guidance, int(description["sample_steps"])


def evaluate_teacher(
    folder: str | Path,
    count: int = 72,
    seed: int = HELD_OUT_SEED,
    steps: int | None = None,
    guidance: tuple[float, float] | None = None,
    named: bool = False,
    device: str = "cpu",
) -> dict[str, Any]:
    """image_score of the teacher in `folder` on `count` held-out cases (its own steps and guidance
    unless given); the full-prompt score of the same clips under `clip_score`."""
    own_guidance, own_steps = teacher_guidance(folder)
    steps = own_steps if steps is None else steps
    guidance = own_guidance if guidance is None else guidance
    cases = motion_prompts(count, seed, named=named)
    clips = sample_cases(load_pipeline(folder, device), cases, steps, guidance)
    scored = score_image_clips(list(clips), cases, named_score=True)
    clip_score = scored.pop("clip_score")
    return {
        "count": count,
        "seed": seed,
        "steps": steps,
        "guidance": list(guidance),
        "named_prompts": named,
        **{
            k: scored[k]
            for k in ("adherence", "parts", "motion_ratio", "static_rate", "still_leak", "frame_error")
        },
        "clip_accuracy": clip_score["accuracy"],
    }


@entry_point
def main(argv: list[str] | None = None) -> int:
    parser = Parser(prog="python -m distill.toy.i2v_evaluation", description=__doc__.split("\n\n")[0])
    parser.add_argument("--teacher", required=True, action=PathAction, kind=Kind.FOLDER)
    parser.add_argument("--count", type=integer(9), default=72)
    parser.add_argument("--seed", type=integer(0), default=HELD_OUT_SEED)
    parser.add_argument("--steps", type=integer(1))
    parser.add_argument("--guidance", type=number(0.0), nargs=2, help="high-noise and low-noise guidance")
    parser.add_argument("--named", action="store_true", help="full clip prompts instead of motion-only ones")
    parser.add_argument("--threads", type=integer(1), default=1)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    guidance = tuple(args.guidance) if args.guidance else None
    print(
        json.dumps(
            evaluate_teacher(args.teacher, args.count, args.seed, args.steps, guidance, args.named), indent=2
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
