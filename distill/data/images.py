"""Prompts paired with images, for image-to-video teachers.

A `.jsonl` file with {"prompt": ..., "image": ...} per line, or a `.csv` / `.tsv` file whose header
names the columns `prompt` and `image`; image paths are relative to the prompts file. Or a folder
of videos or pictures, each captioned by the .txt file of the same name (a video's first frame is
its image). The prompts are read by distill.data.prompts (same checks, same messages, folders
included); this module adds the image: every record without one, or whose image is missing,
unreadable or not an image, is refused with the prompts file, its line and the image path, before
anything is encoded. Every image is read by distill.data.image_files, as every command reads one.

Images are brought to the run's size exactly as stock `WanImageToVideoPipeline` does (diffusers'
own VideoProcessor: stretched to height x width with Lanczos, no crop, scaled to [-1, 1]), so a
student trained on them sees what the pipeline will give it. An image of another aspect ratio or
smaller than the run's size is accepted, as the pipeline accepts it, and what is done to it is said
once per run.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from distill.data.image_files import IMAGE_FIX as IMAGE_FILE_FIX
from distill.data.image_files import ImageFileError, Note, read_image_file
from distill.data.image_files import check_image_file as check_file
from distill.data.prompts import read_prompt_records
from distill.ops.errors import DistillError, Stage

logger = logging.getLogger(__name__)

# The prompt-file formats that can pair a prompt with an image (.txt holds prompts only).
PAIRED_SUFFIXES = (".jsonl", ".csv", ".tsv")

PAIRING_FIX = (
    'pair each prompt with an image: a .jsonl file with {"prompt": "...", "image": "images/first.png"} '
    "per line, or a .csv / .tsv file whose header line names the columns prompt and image "
    "(image paths are relative to the prompts file), or a folder of videos or pictures each captioned "
    "by the .txt file of the same name (clip.mp4 with clip.txt)"
)

# The VAE's spatial stride of every Wan 2.2 A14B teacher (the stock pipeline reads it from the VAE).
WAN_VAE_SCALE_FACTOR = 8

# Aspect ratios closer than this are taken as equal: 832x480 and 1280x736 both count as the run's.
ASPECT_TOLERANCE = 0.01


@dataclass(frozen=True)
class ImagePrompt:
    """A training sample's condition: a prompt, its image, and where the pair was written."""

    prompt: str
    image: Path
    source: Path
    line: int

    @property
    def where(self) -> str:
        return f"{self.source} line {self.line}"


def _image_error(flag: str, source: Path, problem: str, fix: str, details: str = "") -> DistillError:
    return DistillError(f"{flag} {source}: {problem}", details, fixes=[fix], stage=Stage.DATA)


def read_image_prompts(path: str | Path, flag: str = "--data_path") -> list[ImagePrompt]:
    """(prompt, image) pairs from a .jsonl / .csv / .tsv prompts file, image paths relative to it, or
    from a folder of captioned videos or pictures (distill.data.captioned_folder).

    Refused (a data error naming the file and line): a file format that pairs no images, a record
    without an image, and an image that is missing or not an image file.
    """
    path = Path(path)
    if path.is_file() and path.suffix.lower() not in PAIRED_SUFFIXES:
        raise _image_error(
            flag,
            path,
            f"a {path.suffix or 'suffix-less'} prompts file pairs no images, and this teacher turns "
            "an image into a video: every prompt needs its image",
            PAIRING_FIX,
        )
    records = read_prompt_records(path, flag, images=True)
    pairs = []
    for record in records:
        value = record.fields.get("image")
        if not isinstance(value, str) or not value.strip():
            raise _image_error(
                flag,
                path,
                f"line {record.line} {_missing_image(record.fields, value)}",
                PAIRING_FIX,
            )
        # A folder's record names its image beside its caption file; a file's, relative to the file.
        source = record.source or path
        pair = ImagePrompt(
            record.prompt, source.parent / Path(value.strip()).expanduser(), source, record.line
        )
        check_image_file(pair, flag)
        pairs.append(pair)
    return pairs


def _missing_image(fields: dict[str, Any], value: Any) -> str:
    """Why a record's image field gives no image path, in the record's own terms."""
    if "image" not in fields:
        names = ", ".join(repr(name) for name in fields if name is not None) or "none"
        return f"has no 'image' field (fields: {names})"
    if value is None:  # a JSON null, or a csv row with fewer fields than its header
        return "has no image (the 'image' field is empty or missing)"
    if not isinstance(value, str):
        return f"has an image field that is a {type(value).__name__}, not a path"
    return "has an empty 'image' field"


def _pair_error(pair: ImagePrompt, flag: str, error: ImageFileError) -> DistillError:
    if error.fix == IMAGE_FILE_FIX:
        fix = IMAGE_PATH_FIX
    elif pair.source.suffix.lower() == ".txt":  # a captioned folder's member: its caption is its record
        fix = f"{error.fix}, or move {pair.image.name} and {pair.source.name} out of the folder"
    else:
        fix = f"{error.fix}, or remove the line"
    return _image_error(
        flag, pair.source, f"line {pair.line}: image {pair.image} {error.problem}", fix, error.details
    )


# What to do about a record whose image file is not one (the fix image_files gives names --image).
IMAGE_PATH_FIX = "fix the image path (relative to the prompts file) or the image file, or remove the line"


def check_image_file(pair: ImagePrompt, flag: str = "--data_path") -> None:
    """Refuse a missing image, a folder, a broken link, a file no image library can identify or one
    too large to decode (header only: a full decode of every image happens once, when its latent is
    cached)."""
    try:
        check_file(pair.image)
    except ImageFileError as error:
        raise _pair_error(pair, flag, error) from None


def load_image(pair: ImagePrompt, flag: str = "--data_path") -> tuple[Any, list[Note]]:
    """The pair's image as an RGB PIL image (distill.data.image_files: EXIF rotation applied, as
    diffusers' load_image gives it to the stock pipeline), and what reading it changed; a truncated
    or damaged file is refused naming the file and line."""
    try:
        return read_image_file(pair.image)
    except ImageFileError as error:
        raise _pair_error(pair, flag, error) from None


def decode_images(pairs: list[ImagePrompt], flag: str = "--data_path") -> None:
    """Decode every pair's image in full, refusing the first that fails (naming its file and line).

    A header check passes a file cut short; a real run only decodes its images when it caches their
    latents, after the teacher has loaded. A dry run calls this so that what it validates, the real run
    can read: decoding is a few milliseconds an image, against minutes of teacher loading."""
    for pair in pairs:
        load_image(pair, flag)


class ImagePreprocessor:
    """The stock WanImageToVideoPipeline's image preprocessing at the run's size.

    Calls diffusers' VideoProcessor.preprocess itself, as the pipeline does, so the two cannot
    drift apart; it gives a (1, 3, height, width) float32 tensor in [-1, 1]. An image that the
    pipeline would stretch out of shape or enlarge is said once per kind, naming the first file.
    """

    def __init__(
        self, height: int, width: int, vae_scale_factor: int = WAN_VAE_SCALE_FACTOR, flag: str = "--data_path"
    ) -> None:
        from diffusers.video_processor import VideoProcessor

        self.height = height
        self.width = width
        self.flag = flag
        self.processor = VideoProcessor(vae_scale_factor=vae_scale_factor)
        self.said: set[str] = set()

    def __call__(self, pair: ImagePrompt) -> torch.Tensor:
        image, notes = load_image(pair, self.flag)
        return self.picture(image, notes, pair.image, pair.where)

    def picture(self, image: Any, notes: list[Note], path: Path, where: str) -> torch.Tensor:
        """`image` (read by distill.data.image_files, with its `notes`) at the run's size; what was
        done to it is said once per kind of note, naming the first file (`path`, from `where`)."""
        for note in [*notes, *self._fit_notes(image.width, image.height)]:
            if note.kind not in self.said:
                self.said.add(note.kind)
                logger.warning(
                    "image %s (%s) %s; %s. Other images like it are treated the same without another "
                    "warning.",
                    path,
                    where,
                    note.text,
                    note.advice,
                )
        return self.processor.preprocess(image, height=self.height, width=self.width).float()

    def _fit_notes(self, width: int, height: int) -> list[Note]:
        """What the stock preprocessing does to an image of this size, when it changes its look."""
        notes = []
        if abs((width * self.height) / (height * self.width) - 1) > ASPECT_TOLERANCE:
            notes.append(
                Note(
                    "aspect",
                    f"is {width}x{height}, another aspect ratio than the run's {self.width}x{self.height}: "
                    "it is stretched to that size without cropping, as stock WanImageToVideoPipeline does",
                    "crop the images to the run's aspect ratio first to keep their proportions",
                )
            )
        if width < self.width or height < self.height:
            notes.append(
                Note(
                    "smaller",
                    f"is {width}x{height}, smaller than the run's {self.width}x{self.height}: it is enlarged "
                    "(Lanczos), as stock WanImageToVideoPipeline does, and the video starts from a blurred frame",
                    "use images at least as large as --width x --height",
                )
            )
        return notes
