"""How close is the student to the teacher? A report in eval.json and eval.png.

    python -m distill.evaluate --student outputs/run1/student \
        --prompts data/sample_prompts.txt --output_dir outputs/run1/eval \
        [--teacher_path T --height H --width W --num_frames F --steps N --teacher_steps M --seed 0
         --num_buckets 10 --samples_per_bucket 1]

An image-to-video student (Wan2.2-I2V-A14B teacher) is compared on a prompts file that pairs each
prompt with its image (.jsonl {"prompt": ..., "image": ...} per line, or .csv / .tsv with prompt and
image columns; paths relative to the file): teacher and student start each sample from that image,
preprocessed as stock WanImageToVideoPipeline does.

Every setting left out comes from the run that made the student (`run_settings.json` in or beside
the student folder): teacher, training resolution and frames, sample steps, the teacher's guidance
and negative prompt, max_sequence_length. A size the student or teacher cannot handle is refused
before anything loads.

A Wan2.2-TI2V-5B student is compared in the mode its run distilled (run_settings.json): text to
video on a prompts file, image to video on a file pairing images; the other mode is refused.

The teacher carries the user's LoRAs the student was distilled against (run_settings.json
`teacher_loras`, each file checked unchanged), or those of `--teacher_lora PATH[:SCALE]` (repeatable;
`--teacher_lora none`: the bare teacher): distill.sample.teacher_loras.

The teacher is Wan 2.2 A14B as it is meant to be used: both experts, switched at
t = boundary_ratio * 1000, each with classifier-free guidance (4.0 / 3.0); TI2V-5B runs its one
transformer at every step with --guidance_scale. The student runs alone
at guidance 1, with `--steps` steps (default: the run's). The teacher samples with `--teacher_steps`
(default: the same for a velocity student; for a few-step (dmd) student the teacher's steps of
its run, e.g. 40). A few-step student samples with its own K-step scheduler (recorded in
run_settings.json), and the teacher is then also sampled at K steps: the baseline a few-step
student has to beat. Prompt i always starts from the noise of seed `seed + i`.

What eval.json holds, and which way is better:

- `denoiser`: fidelity of the denoiser on the same inputs. x0 is the teacher's own sample for each
  prompt; for timesteps t spread evenly over [0, 1000] (`num_buckets` buckets, `samples_per_bucket`
  each) x_t = (1 - t/1000) x0 + (t/1000) noise. Each number is the mean squared error between the
  student's velocity and the guided teacher's velocity (the exact training target) at those x_t:
  `mse` over all of them, `relative_mse` = mse / mean(teacher velocity^2) (scale-free: 0 is perfect,
  1 is as far off as predicting zero), `by_expert.high_noise` (t >= boundary, where the teacher
  uses `transformer`) and `by_expert.low_noise` (t below, `transformer_2`), and `buckets`, one
  entry per timestep bucket. LOWER is better.
- `sampler`: fidelity of the whole sampler. Teacher and student sample from the same noise with
  the same scheduler and step count: `latent_mse` between their final latents (LOWER is better),
  `frame_mse` between the decoded frames in [0, 1] (LOWER is better) and `frame_psnr_db`
  = 10 log10(1 / frame_mse), averaged over prompts (HIGHER is better; capped at 100 dB when the
  frames are identical). Errors of every step add up here, so these move more slowly than the
  denoiser numbers. When the student has fewer steps than the teacher, `teacher_at_student_steps`
  holds the same three numbers for the teacher at the student's step count (same noise, its own
  scheduler and guidance) against itself at full steps.
- `cost`: per sample, for teacher and student: `seconds_per_sample` (the sampling loop only, after
  one warm-up run; the VAE decode is the same for both and left out) and `forwards_per_sample`
  (transformer calls: 2 per step for the teacher, conditional + unconditional, and 1 for the
  student), each with its own `steps`. `speedup_seconds` and `speedup_forwards` are teacher at full
  steps / student: HIGHER is better.
  Timings from the tiny CPU teacher say little about a GPU run; the forward counts hold anywhere.

This module is the command line only. The report itself is distill.report: `summary.evaluate_student`
is the same report in-process; during training `report.monitor.SampleMonitor` computes the teacher's
side once (`measures.build_reference`) and compares the student to it every --eval_interval steps.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path
from typing import Any

from distill.config.flag_rules import (
    Dependent,
    check_dependents,
    check_guidance,
    given_where,
    second_expert_guidance,
)
from distill.models.teacher import resolve_dtype
from distill.ops.command import Parser, PathAction, entry_point, integer, number
from distill.ops.errors import DistillError, Stage, report
from distill.ops.paths import Kind
from distill.report.measures import DEFAULT_MAX_SEQUENCE_LENGTH, EvalSettings
from distill.report.summary import evaluate_student
from distill.sample.image_inputs import prompt_images, recorded_mode
from distill.sample.run_settings import (
    RunSettings,
    fill_left_out_flags,
    find_run_settings,
    warn_without_run_settings,
)
from distill.sample.teacher_loras import add_teacher_lora_flag, teacher_with_loras

logger = logging.getLogger(__name__)


# ---------------------------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(
        prog="python -m distill.evaluate",
        description="Compare a distilled student with the Wan 2.2 teacher: eval.json and eval.png.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument(
        "--student",
        required=True,
        action=PathAction,
        kind=Kind.FOLDER,
        must_exist=False,
        help="The exported student folder (OUTPUT/student; OUTPUT/lora, or its OUTPUT/merged experts, "
        "for a LoRA run).",
    )
    parser.add_argument(
        "--teacher_path",
        action=PathAction,
        kind=Kind.FOLDER_OR_HUB,
        help="The Wan 2.2 teacher (diffusers folder or hub id); default: the one the student's run used.",
    )
    parser.add_argument(
        "--prompts",
        required=True,
        action=PathAction,
        kind=Kind.PROMPTS,
        help="Prompt file (.txt, .jsonl, .csv or .tsv), ideally held out; for an image-to-video student "
        "a .jsonl / .csv / .tsv pairing each prompt with its image, or a folder of captioned videos or pictures.",
    )
    parser.add_argument(
        "--output_dir",
        required=True,
        action=PathAction,
        kind=Kind.OUTPUT_FOLDER,
        help="Where eval.json and eval.png go.",
    )
    defaults = EvalSettings()
    run = "default: the student's run_settings.json, else"
    parser.add_argument("--height", type=integer(1), help=f"Pixels ({run} {defaults.height}).")
    parser.add_argument("--width", type=integer(1), help=f"Pixels ({run} {defaults.width}).")
    parser.add_argument(
        "--num_frames", type=integer(1), help=f"1 = image, 4k+1 = video ({run} {defaults.num_frames})."
    )
    parser.add_argument(
        "--steps", type=integer(1), help=f"Student sampler steps ({run} {defaults.steps}; a dmd student's K)."
    )
    parser.add_argument(
        "--teacher_steps",
        type=integer(1),
        help="Teacher sampler steps (default: --steps for a velocity student; for a few-step student "
        "the teacher steps of its run, also sampled at --steps for comparison).",
    )
    parser.add_argument("--seed", type=integer(0), help=f"Prompt i uses seed + i ({run} {defaults.seed}).")
    parser.add_argument("--num_buckets", type=integer(1), default=defaults.num_buckets)
    parser.add_argument("--samples_per_bucket", type=integer(1), default=defaults.samples_per_bucket)
    parser.add_argument(
        "--guidance_scale",
        type=number(1.0),
        help=f"Teacher, high-noise expert ({run} {defaults.guidance_scale}).",
    )
    parser.add_argument(
        "--guidance_scale_2",
        type=number(1.0),
        help=f"Teacher, low-noise expert ({run} {defaults.guidance_scale_2}); none for TI2V-5B (one transformer).",
    )
    parser.add_argument(
        "--batch_size",
        type=integer(1),
        default=defaults.probe_batch,
        help="Noised inputs per forward (memory).",
    )
    parser.add_argument(
        "--negative_prompt", help="Teacher's negative prompt (default: the run's, else empty)."
    )
    add_teacher_lora_flag(parser, "a LoRA student runs on the same fused experts")
    parser.add_argument("--max_prompts", type=integer(1), default=None, help="Use only the first N prompts.")
    parser.add_argument(
        "--max_sequence_length",
        type=integer(1),
        help=f"Prompt padding length; keep the training value ({run} {DEFAULT_MAX_SEQUENCE_LENGTH}).",
    )
    from distill.toy.evaluation import EVAL_PROMPTS

    parser.add_argument(
        "--toy_prompts",
        type=integer(1),
        help=f"Toy teacher only: world prompts scored, one sample each (default {EVAL_PROMPTS} = all of them).",
    )
    parser.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N.")
    parser.add_argument(
        "--dtype",
        default="auto",
        choices=("auto", "float32", "float16", "bfloat16"),
        help="Model dtype for teacher and student; auto = bfloat16 on CUDA, float32 on CPU.",
    )
    return parser


# evaluate's flags that act only with another one (distill.config.flag_rules).
EVALUATE_DEPENDENTS = (
    Dependent(
        ("negative_prompt",),
        lambda a: max(a.guidance_scale, a.guidance_scale_2) > 1.0,
        "a teacher guidance above 1",
        "the negative prompt feeds the unconditional branch of the teacher's guidance, which does not "
        "run at guidance 1",
        "set --guidance_scale above 1 (Wan 2.2 A14B: 4.0)",
    ),
)


def resolve_defaults(args: argparse.Namespace) -> tuple[RunSettings, Path] | None:
    """Fill every setting left out (None) from the student's run_settings.json (else the built-in
    defaults); returns what was found."""
    found = find_run_settings(args.student)
    fallback = EvalSettings()
    if found is None:
        warn_without_run_settings(
            args.student, fallback.height, fallback.width, fallback.steps, DEFAULT_MAX_SEQUENCE_LENGTH
        )
    run = found[0] if found else None
    defaults = {
        "teacher_path": run.teacher_path if run else None,
        "height": run.height if run else fallback.height,
        "width": run.width if run else fallback.width,
        "num_frames": run.num_frames if run else fallback.num_frames,
        "steps": run.num_inference_steps if run else fallback.steps,
        "seed": run.sample_seed if run else fallback.seed,
        "guidance_scale": run.teacher_guidance_scale if run else fallback.guidance_scale,
        # None recorded: a one-transformer teacher, which never reads it (inspect_teacher decides)
        "guidance_scale_2": run.teacher_guidance_scale_2
        if run and run.teacher_guidance_scale_2 is not None
        else fallback.guidance_scale_2,
        "negative_prompt": run.negative_prompt if run else "",
        "max_sequence_length": run.max_sequence_length if run else DEFAULT_MAX_SEQUENCE_LENGTH,
    }
    fill_left_out_flags(args, defaults, found[1] if found else None)
    # A few-step student samples with its own scheduler; its teacher at the run's full step count.
    args.student_scheduler = run.scheduler if run else None
    if args.teacher_steps is None:
        args.teacher_steps = run.teacher_sample_steps if run and run.scheduler else args.steps
    return found


def run_cli(args: argparse.Namespace) -> dict[str, Any]:
    from distill.data.prompts import read_prompts
    from distill.models.pipelines import check_sample_size, encode_prompts
    from distill.models.teacher import inspect_teacher, load_experts
    from distill.ops.output_dir import writable_folder
    from distill.ops.paths import Kind, PathFlag, check_paths
    from distill.report.toy_report import toy_prompt_count
    from distill.sample.student_folder import (
        is_merged_folder,
        load_lora_student,
        load_merged_student,
        load_student,
        lora_student,
        pick_device,
        require_student_folder,
        student_limits,
        teacher_limits,
        trained_size_fix,
    )

    # Every path before anything loads or samples; the student first, as the command's subject.
    check_paths([PathFlag("--student", args.student, Kind.FOLDER, must_exist=False)])
    student_dir = require_student_folder(args.student, teacher_only=False)
    check_paths(
        [
            PathFlag("--teacher_path", args.teacher_path, Kind.FOLDER_OR_HUB),
            PathFlag("--prompts", args.prompts, Kind.PROMPTS),
        ]
    )
    writable_folder(args.output_dir, "--output_dir", create=False)
    # "" changes nothing; a --guidance_scale_2 given is judged once the teacher's kind is known
    given = given_where(["negative_prompt"] if args.negative_prompt else [])
    second = given_where(["guidance_scale_2"] if args.guidance_scale_2 is not None else [])
    found = resolve_defaults(args)
    check_guidance(("--guidance_scale", args.guidance_scale), ("--guidance_scale_2", args.guidance_scale_2))
    check_dependents(args, given, EVALUATE_DEPENDENTS)
    for name in (
        "steps",
        "teacher_steps",
        "max_sequence_length",
        "num_buckets",
        "samples_per_bucket",
        "batch_size",
    ):
        if getattr(args, name) <= 0:
            raise DistillError(
                f"--{name} must be a positive integer, got {getattr(args, name)}",
                fixes=[f"use --{name} 1 or more"],
                stage=Stage.CONFIG,
            )
    info = teacher_with_loras(inspect_teacher(args.teacher_path), args.teacher_lora, found)
    # The trainer's and generate's rule: a one-transformer teacher takes no second scale but 1.
    rule = second_expert_guidance("guidance_scale_2", info.kind.experts, info.kind.model, "--guidance_scale")
    check_dependents(args, second, [rule], stage=Stage.ARGV)
    adapters = lora_student(student_dir, info)  # a LoRA folder: checked whole before anything loads
    args.toy_prompts = toy_prompt_count(args.toy_prompts, info.path)  # before anything is sampled
    check_sample_size(
        args.height,
        args.width,
        args.num_frames,
        info.vae_scale_spatial,
        info.vae_scale_temporal,
        [student_limits(student_dir, info), teacher_limits(info)],
        fixes=trained_size_fix(found),
    )
    logger.info(
        "evaluating at %dx%d, %d frame(s), student %d steps (%s), teacher %d steps, teacher guidance %s, "
        "max_sequence_length %d (%s)",
        args.height,
        args.width,
        args.num_frames,
        args.steps,
        (args.student_scheduler or {}).get("_class_name", "the teacher's scheduler"),
        args.teacher_steps,
        args.guidance_scale if info.kind.experts == 1 else f"{args.guidance_scale} / {args.guidance_scale_2}",
        args.max_sequence_length,
        f"defaults from {found[1]}; flags override" if found else "flags and built-in defaults",
    )
    prompts = read_prompts(args.prompts, "--prompts")[: args.max_prompts]
    # Image to video: each prompt's image, read and preprocessed before any model loads.
    images = prompt_images(
        info.kind,
        info.path,
        0,
        None,
        args.prompts,
        args.height,
        args.width,
        info.vae_scale_spatial,
        file_flag="--prompts",
        image_flag=None,
        run_mode=recorded_mode(info.kind, found),
    )
    device = pick_device(args.device)
    dtype = resolve_dtype(args.dtype, device)
    if adapters is not None:  # the teacher's own experts: loaded once, adapters on for the student
        student, high, low = load_lora_student(student_dir, info, device, dtype, adapters)
    elif is_merged_folder(student_dir):  # the experts with the adapters merged in; the teacher's load below
        student = load_merged_student(student_dir, info, device, dtype)
    else:
        student = load_student(student_dir, info, device, dtype)
    embeddings = encode_prompts(
        info.path, [*prompts, args.negative_prompt], args.max_sequence_length, device, dtype
    )
    if adapters is None:  # both experts, or TI2V-5B's one transformer (low None)
        high, low = (None if e is None else e.to(device) for e in load_experts(info, dtype))
    settings = EvalSettings(
        height=args.height,
        width=args.width,
        num_frames=args.num_frames,
        steps=args.teacher_steps,
        seed=args.seed,
        num_buckets=args.num_buckets,
        samples_per_bucket=args.samples_per_bucket,
        guidance_scale=args.guidance_scale,
        guidance_scale_2=args.guidance_scale_2,
        probe_batch=args.batch_size,
        student_steps=args.steps,
        student_scheduler=args.student_scheduler,
    )
    extra = {
        "student": str(student_dir.resolve()),
        "teacher": str(info.path),
        "teacher_loras": [lora.record() for lora in info.loras],
        "prompts": str(args.prompts),
        "step": None,
    }
    if images is None:
        result = evaluate_student(
            student,
            high,
            low,
            info,
            embeddings,
            embeddings[args.negative_prompt],
            prompts,
            settings,
            args.output_dir,
            device,
            extra=extra,
        )
    else:
        result = evaluate_from_images(
            student, high, low, info, embeddings, args, prompts, images, settings, device, extra
        )
    # A teacher trained on the toy world (toy_world.json) can also be scored by what its pictures show.
    from distill.report.toy_report import add_toy_report

    return add_toy_report(
        result, info.path, student, high, low, settings, args.output_dir, count=args.toy_prompts
    )


def evaluate_from_images(
    student: Any,
    high: Any,
    low: Any,
    info: Any,
    embeddings: dict[str, Any],
    args: argparse.Namespace,
    prompts: list[str],
    images: list[Any],
    settings: EvalSettings,
    device: Any,
    extra: dict[str, Any],
) -> dict[str, Any]:
    """The report of an image-to-video student: teacher and student sample each prompt from its own
    image (and the same noise); the probes see the image's condition in every forward."""
    from distill.report.measures import build_reference, compare_student
    from distill.report.summary import gather_and_write

    conds = {i: embeddings[p] for i, p in enumerate(prompts)}
    by_index = dict(enumerate(images[: len(prompts)]))
    negative = embeddings[args.negative_prompt]
    reference = build_reference(
        high, low, info, conds, negative, len(prompts), settings, device, images=by_index
    )
    records = compare_student(student, reference, info, conds, prompts, settings, device, images=by_index)
    result = gather_and_write(records, settings, info.boundary_ratio, args.output_dir, extra=extra)
    assert result is not None  # one process: rank 0
    return result


@entry_point
def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        result = run_cli(args)
    except DistillError as error:
        return report(error)
    denoiser, sampler, cost = result["denoiser"], result["sampler"], result["cost"]
    short = sampler.get("teacher_at_student_steps")
    if short:
        print(
            f"student at {sampler['student_steps']} steps: latent MSE {sampler['latent_mse']:.4g} to the teacher "
            f"at {sampler['teacher_steps']}; the teacher itself at {short['steps']} steps: {short['latent_mse']:.4g}"
        )
    ranges = ", ".join(
        # A range no probe fell in has no mean (NaN in eval.json): said in words, with the fix.
        f"{name.replace('_', '-')} {part['mse']:.4g}"
        if part["count"]
        else f"{name.replace('_', '-')} not probed (no probe timestep in its range: more --num_buckets)"
        for name, part in denoiser["by_expert"].items()
        if name != "transformer"  # one transformer: its one range is the whole
    )
    print(
        f"denoiser MSE {denoiser['mse']:.4g}{f' ({ranges})' if ranges else ''}; sampler latent MSE "
        f"{sampler['latent_mse']:.4g}, frame PSNR {sampler['frame_psnr_db']:.2f} dB; speed-up "
        f"{cost['speedup_seconds']:.2f}x time, {cost['speedup_forwards']:.1f}x forwards\n"
        f"wrote {Path(args.output_dir) / 'eval.json'} and eval.png"
    )
    if "toy" in result:
        from distill.report.toy_report import toy_table

        print(toy_table(result["toy"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
