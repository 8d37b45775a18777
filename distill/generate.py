"""Generate images or videos with the distilled student (or with the teacher, for comparison).

    python -m distill.generate --student outputs/run1/student \
        --teacher_path models/Wan2.2-T2V-A14B-Diffusers --prompt "a red fox in the snow" --output fox.png
    python -m distill.generate ... --num_frames 81 --output fox.mp4             # video
    python -m distill.generate --teacher_path ... --teacher_only --prompts_file data/sample_prompts.txt \
        --output teacher_samples/                                                 # the teacher, for reference

The student runs alone in WanPipeline with guidance 1 (one forward per step); the tokenizer,
text encoder, VAE and scheduler come from the teacher folder. `--teacher_only` runs both teacher
experts with their guidance (4.0 / 3.0) instead. Prompt i starts from the noise of seed `--seed + i`,
the same noise as `WanPipeline(..., generator=torch.Generator("cpu").manual_seed(seed + i))`.

One prompt: --output is the file (.png for 1 frame, .mp4 otherwise; the suffix is added when
missing). Several prompts (--prompts_file, or --prompt given more than once) or an existing
folder: --output is a folder that receives prompt_00.png, prompt_01.png, ...
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from distill.errors import DistillError, Stage, report
from distill.sampling import (
    load_scheduler,
    load_text_components,
    load_vae,
    media_suffix,
    student_pipeline,
    teacher_pipeline,
    write_frames,
)
from distill.teacher import TeacherInfo, resolve_dtype

logger = logging.getLogger(__name__)


def pick_device(name: str) -> torch.device:
    """auto = the GPU when torch sees one, else the CPU; asking for CUDA without one is an error."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name != "cpu" and not name.startswith("cuda"):
        raise DistillError(
            f"--device {name}: unknown device", fixes=["use auto, cpu, cuda or cuda:N"], stage=Stage.ARGV
        )
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise DistillError(
            f"--device {name} asked for CUDA, but torch sees no GPU",
            f"torch {torch.__version__}, CUDA build: {torch.version.cuda}",
            fixes=["use --device auto (or cpu)"],
            stage=Stage.SETUP,
        )
    return torch.device(name)


def load_student(folder: str | Path, info: TeacherInfo, device: torch.device, dtype: torch.dtype) -> Any:
    """The exported student, checked against the teacher's latent and text spaces."""
    from diffusers import WanTransformer3DModel

    from distill.student import TEACHER_EQUAL_KEYS

    folder = Path(folder)
    if not (folder / "config.json").is_file():
        if folder.is_dir():
            found = ", ".join(sorted(p.name for p in folder.iterdir())) or "nothing"
            details = f"{folder} has no config.json; it holds: {found}"
        else:
            details = f"{folder} does not exist"
        raise DistillError(
            f"student folder not found: {folder}",
            details,
            causes=["training has not finished (the student is exported at the end)", "a typo in --student"],
            fixes=[
                "pass the student/ (or student_ema/) folder that train_distillation.py wrote into --output_dir",
                "or render the teacher alone with --teacher_only",
            ],
            stage=Stage.CONFIG,
        )
    try:
        student = WanTransformer3DModel.from_pretrained(folder, torch_dtype=dtype)
    except Exception as exc:
        raise DistillError(
            f"cannot load the student from {folder}",
            f"{type(exc).__name__}: {exc}",
            causes=["a truncated or foreign weight file"],
            fixes=["export the student again (a finished training run writes it)"],
            stage=Stage.SETUP,
        ) from None
    mismatched = [
        f"{key}: student {student.config.get(key)}, teacher {info.expert_config.get(key)}"
        for key in TEACHER_EQUAL_KEYS
        if list(_as_list(student.config.get(key))) != list(_as_list(info.expert_config.get(key)))
    ]
    if mismatched:
        raise DistillError(
            "the student does not fit this teacher",
            "; ".join(mismatched),
            fixes=["pass the teacher the student was distilled from"],
            stage=Stage.CONFIG,
        )
    return student.requires_grad_(False).eval().to(device)


def _as_list(value: Any) -> Sequence[Any]:
    return value if isinstance(value, list | tuple) else [value]


def output_paths(output: str | Path, count: int, num_frames: int) -> list[Path]:
    """Where each prompt's sample goes (see the module docstring)."""
    output = Path(output)
    suffix = media_suffix(num_frames)
    if count > 1 or output.is_dir():
        if output.suffix.lower() in (".png", ".mp4"):
            raise DistillError(
                f"--output {output} names a file, but there are {count} prompts",
                fixes=[f"pass a folder, e.g. --output {output.with_suffix('')}/"],
                stage=Stage.ARGV,
            )
        return [output / f"prompt_{i:02d}{suffix}" for i in range(count)]
    if output.suffix and output.suffix.lower() != suffix:
        kind = "image" if num_frames == 1 else f"{num_frames}-frame video"
        raise DistillError(
            f"--output {output}: a {kind} is written as {suffix}",
            fixes=[f"use --output {output.with_suffix(suffix)}"],
            stage=Stage.ARGV,
        )
    return [output.with_suffix(suffix)]


def collect_prompts(prompts: Sequence[str] | None, prompts_file: str | None) -> list[str]:
    from distill.data import read_prompts

    collected = list(prompts or [])
    if prompts_file:
        if not Path(prompts_file).is_file():
            raise DistillError(
                f"--prompts_file {prompts_file}: file not found",
                fixes=["check the path; data/sample_prompts.txt ships with the project"],
                stage=Stage.ARGV,
            )
        collected += read_prompts(prompts_file)
    if not collected:
        raise DistillError(
            "no prompt given", fixes=['pass --prompt "..." or --prompts_file FILE'], stage=Stage.ARGV
        )
    return collected


def build_pipeline(
    args: argparse.Namespace, info: TeacherInfo, device: torch.device, dtype: torch.dtype
) -> Any:
    """WanPipeline with the teacher's shared components and the student (or both teacher experts)."""
    from distill.teacher import load_expert

    if not args.teacher_only:
        student = load_student(args.student, info, device, dtype)  # first: a bad --student fails fast
    tokenizer, text_encoder = load_text_components(info.path, device, dtype)
    shared = {"tokenizer": tokenizer, "text_encoder": text_encoder, "vae": load_vae(info.path, device)}
    scheduler = load_scheduler(info.path)
    if args.teacher_only:
        high = load_expert(info, "transformer", dtype).to(device)
        low = load_expert(info, "transformer_2", dtype).to(device)
        return teacher_pipeline(high, low, info.boundary_ratio, scheduler, **shared)
    return student_pipeline(student, scheduler, **shared)


def generate(args: argparse.Namespace) -> list[Path]:
    """Render every prompt and write it; returns the written files."""
    from distill.evaluate import check_sizes
    from distill.teacher import inspect_teacher

    check_sizes(args.height, args.width, args.num_frames, args.steps)
    if not args.teacher_only and not args.student:
        raise DistillError(
            "--student is required",
            fixes=["pass --student OUTPUT/student, or --teacher_only"],
            stage=Stage.ARGV,
        )
    prompts = collect_prompts(args.prompt, args.prompts_file)
    targets = output_paths(args.output, len(prompts), args.num_frames)
    info = inspect_teacher(args.teacher_path)
    device = pick_device(args.device)
    pipe = build_pipeline(args, info, device, resolve_dtype(args.dtype, device))
    guidance = args.guidance if args.guidance is not None else (4.0 if args.teacher_only else 1.0)
    extra = (
        {"guidance_scale_2": args.guidance_2 if args.guidance_2 is not None else 3.0}
        if args.teacher_only
        else {}
    )
    written = []
    for i, (prompt, target) in enumerate(zip(prompts, targets)):
        frames = pipe(
            prompt=prompt,
            negative_prompt=args.negative_prompt,
            height=args.height,
            width=args.width,
            num_frames=args.num_frames,
            num_inference_steps=args.steps,
            guidance_scale=guidance,
            generator=torch.Generator("cpu").manual_seed(args.seed + i),
            output_type="np",
            max_sequence_length=args.max_sequence_length,
            **extra,
        ).frames[0]
        written.append(write_frames(frames, target))
    return written


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m distill.generate",
        description="Generate with the distilled student (guidance 1) or, with --teacher_only, the teacher.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument(
        "--student", help="The exported student folder (OUTPUT/student or OUTPUT/student_ema)."
    )
    parser.add_argument(
        "--teacher_path", required=True, help="The Wan 2.2 A14B teacher (diffusers folder or hub id)."
    )
    parser.add_argument("--prompt", action="append", help="A prompt; may be given several times.")
    parser.add_argument("--prompts_file", help="More prompts, from a .txt / .jsonl / .csv file.")
    parser.add_argument("--output", required=True, help="Output file (one prompt) or folder (several).")
    parser.add_argument("--height", type=int, default=480)
    parser.add_argument("--width", type=int, default=832)
    parser.add_argument("--num_frames", type=int, default=1, help="1 = image (PNG), 4k+1 = video (MP4).")
    parser.add_argument("--steps", type=int, default=30, help="Sampler steps.")
    parser.add_argument("--seed", type=int, default=0, help="Prompt i uses seed + i.")
    parser.add_argument(
        "--guidance", type=float, default=None, help="Guidance scale (default 1.0 student, 4.0 teacher)."
    )
    parser.add_argument(
        "--guidance_2", type=float, default=None, help="Teacher's low-noise guidance (default 3.0)."
    )
    parser.add_argument("--negative_prompt", default="", help="Used only when guidance > 1.")
    parser.add_argument(
        "--teacher_only", action="store_true", help="Render the teacher instead of the student."
    )
    parser.add_argument("--max_sequence_length", type=int, default=512)
    parser.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N.")
    parser.add_argument(
        "--dtype",
        default="auto",
        choices=("auto", "float32", "float16", "bfloat16"),
        help="Dtype of the transformers and text encoder; auto = bfloat16 on CUDA, float32 on CPU.",
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        written = generate(args)
    except DistillError as error:
        return report(error)
    for path in written:
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
