"""Generate images or videos with the distilled student (or with the teacher, for comparison).

    python -m distill.generate --student outputs/run1/student \
        --teacher_path models/Wan2.2-T2V-A14B-Diffusers --prompt "a red fox in the snow" --output fox.png
    python -m distill.generate ... --num_frames 81 --output fox.mp4             # video
    python -m distill.generate --teacher_path ... --teacher_only --prompts_file data/sample_prompts.txt \
        --output teacher_samples/                                                 # the teacher, for reference
    python -m distill.generate --student outputs/causal/student --stream --num_frames 33 ...  # streamed

The student runs alone in WanPipeline with guidance 1 (one forward per step); the tokenizer, text encoder,
VAE and (unless the run recorded its own) scheduler come from the teacher folder. `--teacher_only` runs
both teacher experts with their guidance (4.0 / 3.0) instead. A causal student streams with `--stream`
(distill.sample.stream): frames written as each chunk finishes, clips longer than it was trained on.
`--continue_with I2V_STUDENT` continues each clip past the student's length, hop after hop from its last
frame, with an image-to-video student (distill.sample.chain); --num_frames is then the whole clip's.

Every sampling flag left out comes from the run that made the student (`run_settings.json` in or
beside the student folder): the teacher, the training resolution and frame count, the steps and
guidance it samples with and the max_sequence_length it was trained with (the prompt padding
changes the output). A size the model cannot handle is refused before anything loads. Prompt i starts from the noise of seed `--seed + i`,
the same noise as `WanPipeline(..., generator=torch.Generator("cpu").manual_seed(seed + i))`.
A few-step (dmd) student samples with its run's K-step scheduler (in run_settings.json), K steps,
guidance 1; its re-noising is drawn from prompt i's CPU stream too, so prompt i is the same sample on
any device, and on the CPU what the stock pipeline gives after `torch.manual_seed(seed + i)` with no
generator (= distill.models.few_step.sample_few_step).

A Wan2.2-TI2V-5B student samples in the mode its run distilled (text, or image to video: its
run_settings.json records the pipeline); an image for a text-mode student, or none for an image-mode
one, is refused naming the run's mode. The TI2V-5B teacher alone (`--teacher_only`) renders text to
video, or image to video when given an image.

An image-to-video student (or teacher) turns an image into a video: `--image first.png` is the first
frame of every prompt's video, or `--prompts_file pairs.jsonl` pairs each prompt with its own image
({"prompt": "...", "image": "images/0.png"} per line, paths relative to the file); each image is
brought to the sample's size as stock WanImageToVideoPipeline does, and the sample equals that
pipeline's for the same image, prompt and seed.

The teacher's experts (--teacher_only, and under a LoRA student's adapters) carry the user's LoRAs its
run was distilled against, or those of `--teacher_lora PATH[:SCALE]` (`none`: the bare teacher), fused
as the trainer fuses them (distill.sample.teacher_loras).

One prompt: --output is the file (.png for 1 frame, .mp4 otherwise; the suffix is added when
missing). Several prompts (--prompts_file, or --prompt given more than once) or an existing
folder: --output is a folder that receives prompt_00.png, prompt_01.png, ... (clips: prompt_00.mp4,
..., and all_clips.gif, every clip side by side in one animation a browser plays).
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from distill.config.flag_rules import (
    Dependent,
    check_dependents,
    check_guidance,
    given_where,
)
from distill.models.causal.layout import read_causal_config
from distill.models.lora_files import is_lora_folder
from distill.models.pipelines import (
    check_sample_size,
)
from distill.models.teacher import empty_device_cache, resolve_dtype
from distill.ops.command import Parser, PathAction, entry_point, integer, number
from distill.ops.errors import DistillError, Stage, report
from distill.ops.output_dir import writable_folder
from distill.ops.paths import Kind, PathFlag, check_paths
from distill.sample.chain import (
    Continuation,
    add_chain_flags,
    build_continuation,
    chain_rules,
    check_continuation,
    continuation_prompts,
)
from distill.sample.image_inputs import collect_prompts, images_of, prompt_images, recorded_mode
from distill.sample.media import output_paths, write_frames, write_side_by_side_gif
from distill.sample.render_pipeline import build_pipeline, render
from distill.sample.sampling_flags import (
    check_counts,
    describe,
    one_transformer_guidance,
    resolve_defaults,
)
from distill.sample.stream import (
    OpenStream,
    add_stream_flags,
    build_streamer,
    check_stream,
    stream_all,
    stream_rules,
)
from distill.sample.student_folder import (
    FALLBACK,
    TEACHER_GUIDANCE,
    is_merged_folder,
    lora_student,
    pick_device,
    require_student_folder,
    student_limits,
    teacher_limits,
    trained_size_fix,
)
from distill.sample.teacher_loras import add_teacher_lora_flag, teacher_lora_rule, teacher_with_loras

logger = logging.getLogger(__name__)


def generate_dependents(
    args: argparse.Namespace, two_experts: bool, teacher_experts: bool
) -> tuple[Dependent, ...]:
    """generate's flags that act only with another one (distill.config.flag_rules). `two_experts`:
    the render runs two experts (the teacher's, a LoRA student's, or a LoRA run's merged ones);
    `teacher_experts`: they are the teacher's own, which the teacher's LoRAs can be fused into."""
    return (
        Dependent(
            ("guidance_2",),
            lambda _: two_experts,
            "--teacher_only or a LoRA student (OUTPUT/lora or OUTPUT/merged)",
            "it is the guidance of the teacher's low-noise expert (transformer_2); a distilled student is "
            "one model, sampled with --guidance alone",
            "use --guidance for this student",
            off={"guidance_2": 1.0},  # no guidance: what a one-model student samples with anyway
        ),
        teacher_lora_rule(teacher_experts, "--teacher_only or a LoRA student (OUTPUT/lora)"),
        Dependent(
            ("negative_prompt",),
            lambda a: a.guidance > 1.0,
            "--guidance above 1",
            "the negative prompt feeds the unconditional branch of guidance, which does not run at "
            f"guidance {args.guidance:g}",
            "set --guidance above 1",
        ),
    )


def check_flags(args: argparse.Namespace, given: dict[str, str]) -> None:
    """Guidance that would not be applied as given, and flags this render would ignore: refused."""
    teacher_experts = args.teacher_only or is_lora_folder(args.student)
    two_experts = teacher_experts or is_merged_folder(args.student)
    second = ("--guidance_2", args.guidance_2) if two_experts and args.guidance_2 is not None else None
    check_guidance(("--guidance", args.guidance), second)
    rules = (*generate_dependents(args, two_experts, teacher_experts), *stream_rules(), *chain_rules())
    check_dependents(args, given, rules)


def path_flags(args: argparse.Namespace) -> list[PathFlag]:
    """This command's paths (distill.ops.paths). --output is a file for one prompt, a folder for
    several (decided once the prompts are read), so only an existing folder is judged as a folder;
    None when nothing is written (open_stream)."""
    flags = [
        PathFlag("--student", args.student, Kind.FOLDER, must_exist=False),
        PathFlag("--teacher_path", args.teacher_path, Kind.FOLDER_OR_HUB),
        PathFlag("--prompts_file", args.prompts_file, Kind.PROMPTS),
        PathFlag("--continue_with", args.continue_with, Kind.FOLDER, must_exist=False),
        PathFlag("--continue_teacher_path", args.continue_teacher_path, Kind.FOLDER_OR_HUB),
    ]
    if args.output is not None:
        output = Kind.OUTPUT_FOLDER if Path(args.output).is_dir() else Kind.OUTPUT_FILE
        flags.append(PathFlag("--output", args.output, output, example="sample.png"))
    return flags


def prepare(args: argparse.Namespace) -> tuple[Any, list[str], list[Path], Any]:
    """Every flag resolved and checked, then (pipeline, prompts, output files, images or None)."""
    return prepare_chained(args)[:4]


def prepare_chained(
    args: argparse.Namespace,
) -> tuple[Any, list[str], list[Path], Any, Continuation | None]:
    """`prepare`'s, and the image-to-video student that continues each clip (--continue_with), else None."""
    from distill.models.teacher import inspect_teacher

    check_paths(path_flags(args), probe=False)  # kinds first; the output's folder is probed below
    if not args.teacher_only and not args.student:
        raise DistillError(
            "--student is required",
            fixes=["pass --student OUTPUT/student, or --teacher_only"],
            stage=Stage.ARGV,
        )
    if not args.teacher_only:
        require_student_folder(args.student)
    # The flags given (an empty negative prompt is the default's and changes nothing).
    given = given_where(
        name
        for name in (
            "guidance_2",
            "negative_prompt",
            "teacher_lora",
            "stream_window",
            "continue_prompt",
            "continue_teacher_path",
        )
        if getattr(args, name) not in (None, "")
    )
    total = args.num_frames  # with --continue_with: the continued clip's; the first is the student's own
    if args.continue_with:
        args.num_frames = None
    found = resolve_defaults(args)
    check_counts(args)
    check_flags(args, given)
    chain = check_continuation(args, total, first_recorded=found is not None) if args.continue_with else None
    prompts = collect_prompts(args.prompt, args.prompts_file)
    hop_prompts = continuation_prompts(prompts, args.continue_prompt) if chain else []
    written_frames = chain.plan.total if chain else args.num_frames
    targets = [] if args.output is None else output_paths(args.output, len(prompts), written_frames)
    for folder in dict.fromkeys(target.parent for target in targets):  # before anything renders
        writable_folder(folder, "--output", create=False)
    info = inspect_teacher(args.teacher_path)
    one_transformer_guidance(args, info, given)
    if args.teacher_only or is_lora_folder(args.student):  # the teacher's experts render: its LoRAs
        info = teacher_with_loras(info, args.teacher_lora, found)
    if not args.teacher_only:
        lora_student(args.student, info)  # a LoRA folder: checked whole before anything loads
    model = teacher_limits(info) if args.teacher_only else student_limits(args.student, info)
    layout = check_stream(args, info) if args.stream else None  # its frames may pass the rope table
    check_sample_size(
        args.height,
        args.width,
        1 if args.stream else args.num_frames,
        info.vae_scale_spatial,
        info.vae_scale_temporal,
        [model],
        fixes=trained_size_fix(found),
    )
    # Every image read and preprocessed before any model loads (image to video; else refused). A
    # TI2V-5B student takes the mode its run recorded; the teacher alone, the inputs' mode.
    images = prompt_images(
        info.kind,
        args.teacher_path,
        len(args.prompt or []),
        args.image,
        args.prompts_file,
        args.height,
        args.width,
        info.vae_scale_spatial,
        run_mode=None if args.teacher_only else recorded_mode(info.kind, found),
    )
    who = "teacher" if args.teacher_only else "student"
    if len(info.kind.pipeline_classes) > 1:
        who += f" ({info.kind.model}, {'image' if images is not None else 'text'} to video)"
    source = f"defaults from {found[1]}; flags override" if found else "flags and built-in defaults"
    logger.info(describe(args, who, source))
    device = pick_device(args.device)
    run = found[0] if found else None
    dtype = resolve_dtype(args.dtype, device)
    continuation = build_continuation(chain, hop_prompts, device, dtype) if chain else None
    if layout is not None:  # --stream: the causal student's streamer stands in for the pipeline
        streamer = build_streamer(args, info, device, dtype, run, layout, prompts)
        return streamer, prompts, targets, images, continuation
    if not args.teacher_only and read_causal_config(args.student) is not None:
        logger.warning(
            "%s is a causal student: --stream makes the clips it was trained to make (chunk after chunk on "
            "its KV cache); without it the pipeline denoises the whole clip at once%s",
            args.student,
            ", its adapters attending over all of it" if is_lora_folder(args.student) else "",
        )
    pipe = build_pipeline(args, info, device, dtype, run, image=images is not None)
    return pipe, prompts, targets, images, continuation


def generate(args: argparse.Namespace) -> list[Path]:
    """Render every prompt and write it; returns the written files."""
    pipe, prompts, targets, images, continuation = prepare_chained(args)
    if args.stream:  # frames written as each chunk finishes
        if continuation is not None:
            continuation.load()  # before the first stream: its load is no part of any clip's time
        return stream_all(pipe, prompts, targets, images, args.seed, continuation)
    renders = (
        render(pipe, args, p, args.seed + i, image=images_of(images, i)) for i, p in enumerate(prompts)
    )
    if continuation is not None:
        firsts = list(renders)
        del pipe, renders  # every first clip is made: its model goes before the continuing one loads
        empty_device_cache()
        renders = (continuation.extend(clip, i, args.seed + i) for i, clip in enumerate(firsts))
    written, clips = [], []
    for frames, target in zip(renders, targets):  # each file written as soon as its clip is made
        written.append(write_frames(frames, target))
        clips.append(frames)
    if len(clips[0]) > 1 and len(written) > 1:
        # Several clips: also one GIF that plays them side by side (MP4s need a player per file).
        who = "teacher" if args.teacher_only else "student"
        written.append(
            write_side_by_side_gif(
                [(f"{who} {args.steps} steps", clips)], written[0].parent / "all_clips.gif"
            )
        )
    return written


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(
        prog="python -m distill.generate",
        description="Generate with the distilled student (guidance 1) or, with --teacher_only, the teacher.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument(
        "--student",
        action=PathAction,
        kind=Kind.FOLDER,
        must_exist=False,
        help="The exported student folder (OUTPUT/student or OUTPUT/student_ema; OUTPUT/lora, or its "
        "OUTPUT/merged experts, for a LoRA run).",
    )
    run = "default: the student's run_settings.json, else"
    parser.add_argument(
        "--teacher_path",
        action=PathAction,
        kind=Kind.FOLDER_OR_HUB,
        help="The Wan 2.2 teacher (diffusers folder or hub id); default: the one the student's run used.",
    )
    parser.add_argument("--prompt", action="append", help="A prompt; may be given several times.")
    parser.add_argument(
        "--prompts_file",
        action=PathAction,
        kind=Kind.PROMPTS,
        help="More prompts, from a .txt / .jsonl / .csv file; for an image-to-video student, a .jsonl / "
        '.csv / .tsv file may pair each prompt with its image ({"prompt": "...", "image": "first.png"}), '
        "and a folder of videos or pictures captioned by .txt files of the same names pairs them too.",
    )
    parser.add_argument(
        "--image",
        help="Image to video only (Wan2.2-I2V-A14B, or Wan2.2-TI2V-5B in image mode): the first frame of "
        "every prompt's video, resized to --height x --width as WanImageToVideoPipeline does.",
    )
    parser.add_argument("--output", required=True, help="Output file (one prompt) or folder (several).")
    parser.add_argument("--height", type=integer(1), help=f"Pixels ({run} {FALLBACK['height']}).")
    parser.add_argument("--width", type=integer(1), help=f"Pixels ({run} {FALLBACK['width']}).")
    parser.add_argument(
        "--num_frames",
        type=integer(1),
        help=f"1 = image (PNG), 4k+1 = video (MP4) ({run} {FALLBACK['num_frames']}).",
    )
    parser.add_argument("--steps", type=integer(1), help=f"Sampler steps ({run} {FALLBACK['steps']}).")
    parser.add_argument("--seed", type=integer(0), default=0, help="Prompt i uses seed + i.")
    parser.add_argument(
        "--guidance",
        type=number(1.0),
        help=f"Guidance scale ({run} 1.0 for the student, {TEACHER_GUIDANCE[0]} for the teacher).",
    )
    parser.add_argument(
        "--guidance_2",
        type=number(1.0),
        help="Low-noise expert's guidance of the teacher (--teacher_only; default: the run's, else "
        f"{TEACHER_GUIDANCE[1]}) or of a LoRA student (default: --guidance); a one-model student has none.",
    )
    parser.add_argument("--negative_prompt", help="Used only when guidance > 1 (default: the run's).")
    parser.add_argument(
        "--teacher_only", action="store_true", help="Render the teacher instead of the student."
    )
    add_teacher_lora_flag(parser, "with --teacher_only, or for a LoRA student: base + these + its adapters")
    add_stream_flags(parser)
    add_chain_flags(parser)
    parser.add_argument(
        "--max_sequence_length",
        type=integer(1),
        help=f"Prompt padding length; keep the training value ({run} {FALLBACK['max_sequence_length']}).",
    )
    parser.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N.")
    parser.add_argument(
        "--dtype",
        default="auto",
        choices=("auto", "float32", "float16", "bfloat16"),
        help="Dtype of the transformers and text encoder; auto = bfloat16 on CUDA, float32 on CPU.",
    )
    return parser


def open_stream(argv: Sequence[str]) -> OpenStream:
    """A causal student opened for streaming in Python: `argv` are generate's flags (--student,
    --prompt or --prompts_file, --num_frames, --image, ...; --stream is implied), read and checked as
    `generate --stream` reads them, defaults from the student's run. Its `chunks(index, seed)` gives
    each chunk's frames as they are made. Bad input raises DistillError, naming the flag and the fix.

        stream = open_stream(["--student", "outputs/causal/student", "--prompt", "a red ball", "--num_frames", "81"])
        for frames in stream.chunks(0, seed=0):
            ...  # (F, H, W, 3) in [0, 1]: show or send them now
    """
    if any(flag == "--output" or flag.startswith("--output=") for flag in argv):
        raise DistillError(
            "open_stream writes nothing: --output has no place in its flags",
            fixes=["leave --output out and write the frames `chunks` gives where you want them"],
            stage=Stage.ARGV,
        )
    args = build_parser().parse_args([*argv, "--stream", "--output", "unused"])
    args.output = None  # nothing is written: no output file to judge
    streamer, prompts, _, images, continuation = prepare_chained(args)
    if continuation is not None:
        continuation.load()
    return OpenStream(streamer, prompts, images, continuation)


@entry_point
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
