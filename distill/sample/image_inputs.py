"""The image each prompt's video starts from, for the commands that sample an image-to-video
student or teacher (`distill.generate`, `distill.evaluate`), and which mode a run of a teacher with
two (Wan2.2-TI2V-5B: text to video, or image to video) was in.

An image comes from `--image` (one image for every prompt) or from a prompts file that pairs each
prompt with its image (distill/data/images.py reads it: .jsonl, .csv, .tsv, image paths relative
to the file). Every image is read and brought to the sample's size before any model loads, exactly
as stock `WanImageToVideoPipeline` preprocesses it (diffusers' VideoProcessor), so a missing or
unreadable image is a banner naming the flag (and the file and line), never a traceback after the
models have loaded. A text-to-video teacher given an image is refused rather than left to ignore it.

A TI2V-5B run is in the mode its data says (distill/data/samples.py): image to video when its
prompts file pairs images. Its student learned that mode only, so the commands take the mode the run
recorded (`run_settings.json`: its stock pipeline) and refuse an image for a text-mode student, or
none for an image-mode one, naming the run's mode; the teacher alone takes the mode of its inputs.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from distill.data.image_files import IMAGE_FIX as IMAGE_FILE_FIX
from distill.data.image_files import ImageFileError, read_image_file
from distill.data.images import PAIRED_SUFFIXES, PAIRING_FIX, ImagePreprocessor, read_image_prompts
from distill.data.samples import accepts_images, distils_images, read_training_samples, takes_images
from distill.models.teacher_kind import I2V_A14B, TeacherKind
from distill.ops.errors import DistillError, Stage

IMAGE_FIX = "pass --image FIRST_FRAME.png: the image every prompt's video starts from"


def pairs_images(prompts_file: str | Path | None, flag: str = "--prompts_file") -> bool:
    """Whether a prompts file pairs prompts with images (a .jsonl / .csv / .tsv record with an image,
    or a folder of captioned videos, whose first frames are the images)."""
    from distill.data.prompts import read_prompt_records

    if prompts_file is not None and Path(prompts_file).is_dir():
        return True
    if prompts_file is None or Path(prompts_file).suffix.lower() not in PAIRED_SUFFIXES:
        return False
    records = read_prompt_records(prompts_file, flag)
    return any(isinstance(r.fields.get("image"), str) and r.fields["image"].strip() for r in records)


def data_takes_images(kind: TeacherKind, data_path: str | Path | None) -> bool:
    """Whether a run of a teacher of `kind` on `data_path` distilled image to video
    (distill.data.samples.distils_images; False without a data path for a kind with two modes)."""
    if data_path is None:
        return takes_images(kind)
    return distils_images(kind, data_path)


def refuse_image_for_text_teacher(kind: TeacherKind, image: str | None, teacher: str | Path) -> None:
    """`--image` with a text-to-video teacher: said, rather than the image silently dropped."""
    if image is None or accepts_images(kind):
        return
    raise DistillError(
        f"--image {image}: the teacher {teacher} is {kind.model}, which generates from text only",
        "The image would be ignored: neither that teacher nor a student distilled from it starts a "
        "video from an image.",
        fixes=[
            "leave out --image",
            f"to turn an image into a video, pass a student distilled from {I2V_A14B.model} "
            "(its run_settings.json names that teacher) or --teacher_path of that teacher",
        ],
        stage=Stage.ARGV,
    )


@dataclass(frozen=True)
class RunMode:
    """The mode a student of a two-mode teacher (TI2V-5B) was distilled in, as its run recorded it."""

    image: bool
    """True: image to video (every sample starts from an image); False: text to video."""
    source: str
    """Where it was read, for messages: "<run>/run_settings.json records the stock pipeline ..."."""


def recorded_mode(kind: TeacherKind, found: tuple[Any, Path] | None) -> RunMode | None:
    """The mode a student's run recorded (`found`: its RunSettings and run_settings.json), for a
    teacher with two modes; None for a one-mode teacher or a student without run settings."""
    if found is None or takes_images(kind) or not accepts_images(kind):
        return None
    settings, path = found
    return RunMode(bool(settings.takes_image), f"{path} records the stock pipeline {settings.pipeline_class}")


def prompt_images(
    kind: TeacherKind,
    teacher: str | Path,
    flag_prompts: int,
    image: str | None,
    prompts_file: str | Path | None,
    height: int,
    width: int,
    vae_scale_factor: int,
    file_flag: str = "--prompts_file",
    image_flag: str | None = "--image",
    run_mode: RunMode | None = None,
) -> list[torch.Tensor] | None:
    """The preprocessed image of every prompt, (1, 3, height, width) float32 in [-1, 1], in the order
    the prompts were collected (the `flag_prompts` --prompt ones first, then the file's); None when
    the render is text to video (a text-to-video teacher, which is refused any image, or TI2V-5B in
    text mode).

    `--image` gives the image of every prompt; a prompts file that pairs images gives its own, and
    then --image is refused (two sources for the same prompts' images). A command without --image
    (`image_flag` None) takes the images from the prompts file alone. For TI2V-5B, `run_mode` is the
    mode its student was distilled in (None: the teacher alone, or a student whose run recorded
    none), and images against that mode are refused naming it; without it the inputs decide.
    """
    refuse_image_for_text_teacher(kind, image, teacher)
    if not accepts_images(kind):
        if prompts_file is not None:  # a file pairing images, for a teacher that takes none: refused
            read_training_samples(prompts_file, kind, flag=file_flag, for_training=False)
        return None
    paired = pairs_images(prompts_file, file_flag)
    if not takes_images(kind):  # two modes (TI2V-5B): the run's, else the inputs'
        refuse_other_mode(kind, run_mode, image, prompts_file if paired else None, file_flag, image_flag)
        if not (run_mode.image if run_mode else image is not None or paired):
            return None
    if paired and image is not None:
        raise DistillError(
            f"--image {image} and {file_flag} {prompts_file} both give the prompts' images",
            f"{file_flag} {prompts_file} pairs each of its prompts with an image; --image would give "
            "them another one.",
            fixes=[
                f"leave out --image to use the images {prompts_file} names",
                f"or pass a prompts file without images (a .txt file) with --image {image}",
            ],
            stage=Stage.ARGV,
        )
    if image is None and not paired and image_flag is None:
        read_image_prompts(prompts_file, file_flag)  # says why the file pairs no images, with its line
    if image is None and not paired:
        raise DistillError(
            f"--image is required: the teacher {teacher} is {kind.model}, which turns an image into a video",
            "No image given (neither --image nor a prompts file that pairs images): every video "
            "starts from one.",
            fixes=[IMAGE_FIX, f"or {PAIRING_FIX}, passed with {file_flag}"],
            stage=Stage.ARGV,
        )
    if paired and flag_prompts:
        raise DistillError(
            f"--prompt has no image: {file_flag} {prompts_file} pairs its own prompts with images",
            "A prompt given with --prompt beside a file that pairs images has none of its own.",
            fixes=[f"add the prompt with its image to {prompts_file}", "or leave out --prompt"],
            stage=Stage.ARGV,
        )
    preprocess = ImagePreprocessor(height, width, vae_scale_factor, flag=file_flag)
    if paired:
        # Every image checked (missing, not an image, damaged) naming the file and its line.
        return [preprocess(pair) for pair in read_image_prompts(prompts_file, file_flag)]
    assert image is not None
    one = flag_image(image, preprocess)
    count = flag_prompts + (count_prompts(prompts_file, file_flag) if prompts_file is not None else 0)
    return [one] * count


def refuse_other_mode(
    kind: TeacherKind,
    run_mode: RunMode | None,
    image: str | None,
    paired_file: str | Path | None,
    file_flag: str,
    image_flag: str | None,
) -> None:
    """A student of a two-mode teacher given inputs of the mode it was not distilled in: it learned
    one mode only (a text-mode student never saw an image latent at frame 0; an image-mode one
    never had to make frame 0), so the render would be neither mode's."""
    if run_mode is None:
        return
    given = f"--image {image}" if image is not None else f"{file_flag} {paired_file}" if paired_file else None
    if not run_mode.image and given is not None:
        raise DistillError(
            f"{given}: the student was distilled from {kind.model} in text mode, and takes no image",
            f"{run_mode.source} (text to video: the run's prompts had no images). The student learned "
            "to make every frame from the prompt; it never saw an image in place of frame 0.",
            fixes=[
                "leave out --image"
                if image is not None
                else f"pass a {file_flag} without images (a .txt file)",
                f"to turn an image into a video, pass a student of a {kind.model} run in image mode (its "
                "--data_path paired every prompt with an image), or render the teacher with --teacher_only",
            ],
            stage=Stage.ARGV,
        )
    if run_mode.image and image is None and paired_file is None:
        pairs = f"{PAIRING_FIX}, passed with {file_flag}"
        raise DistillError(
            f"{image_flag or file_flag} {'is required' if image_flag else 'must pair each prompt with an image'}: "
            f"the student was distilled from {kind.model} in image mode, and starts every video from an image",
            f"{run_mode.source} (image to video: the run's prompts were paired with images). Without an "
            "image it would have to make frame 0, which it never learned.",
            fixes=[IMAGE_FIX if image_flag else pairs, *([f"or {pairs}"] if image_flag else [])],
            stage=Stage.ARGV,
        )


def count_prompts(prompts_file: str | Path, flag: str) -> int:
    from distill.data.prompts import read_prompts

    return len(read_prompts(prompts_file, flag))


def flag_image(image: str, preprocess: ImagePreprocessor, flag: str = "--image") -> torch.Tensor:
    """The image `--image` names, read as training reads a prompts file's images
    (distill.data.image_files) and preprocessed as the stock pipeline does, with the same notes; a
    missing, damaged or non-image file is refused naming the flag."""
    path = Path(image).expanduser()
    try:
        picture, notes = read_image_file(path)
    except ImageFileError as error:
        fixes = [error.fix] if error.fix == IMAGE_FILE_FIX else [error.fix, IMAGE_FILE_FIX]
        raise DistillError(
            f"{flag} {image}: {error.problem}",
            error.details,
            fixes=fixes,
            stage=Stage.ARGV if error.path_wrong else Stage.DATA,
        ) from None
    return preprocess.picture(picture, notes, path, flag)


def images_of(images: Sequence[torch.Tensor] | None, index: int) -> torch.Tensor | None:
    """Prompt `index`'s image, or None for a teacher that takes none."""
    return None if images is None else images[index]


def collect_prompts(prompts: Sequence[str] | None, prompts_file: str | None) -> list[str]:
    """The --prompt prompts, then those of --prompts_file (generate's order, which `prompt_images` follows)."""
    from distill.data.prompts import read_prompts

    collected = list(prompts or [])
    if prompts_file:
        if not Path(prompts_file).exists():  # a file, or a folder of captioned media
            raise DistillError(
                f"--prompts_file {prompts_file}: file not found",
                fixes=["check the path; data/sample_prompts.txt ships with the project"],
                stage=Stage.ARGV,
            )
        collected += read_prompts(prompts_file, "--prompts_file")
    if not collected:
        raise DistillError(
            "no prompt given", fixes=['pass --prompt "..." or --prompts_file FILE'], stage=Stage.ARGV
        )
    return collected
