"""Prompts paired with images, for image-to-video teachers.

A `.jsonl` file with {"prompt": ..., "image": ...} per line, or a `.csv` / `.tsv` file whose header
names the columns `prompt` and `image`; image paths are relative to the prompts file. Or a folder
of videos, each captioned by the .txt file of the same name, whose first frames are the images. The
prompts are read by distill.data.prompts (same checks, same messages); this module adds the image: every
record without one, or whose image is missing, unreadable or not an image, is refused with the
prompts file, its line and the image path, before anything is encoded.

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

from distill.data.prompts import read_prompt_records
from distill.ops.errors import DistillError, Stage

logger = logging.getLogger(__name__)

# The prompt-file formats that can pair a prompt with an image (.txt holds prompts only).
PAIRED_SUFFIXES = (".jsonl", ".csv", ".tsv")

PAIRING_FIX = (
    'pair each prompt with an image: a .jsonl file with {"prompt": "...", "image": "images/first.png"} '
    "per line, or a .csv / .tsv file whose header line names the columns prompt and image "
    "(image paths are relative to the prompts file)"
)

# Videos whose first frame is taken as the image (read with imageio's ffmpeg, as diffusers' load_video).
VIDEO_SUFFIXES = (".mp4", ".webm", ".mov", ".mkv", ".avi")

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
    """(prompt, image) pairs from a .jsonl / .csv / .tsv prompts file; image paths relative to it.

    Refused (a data error naming the file and line): a file format that pairs no images, a record
    without an image, and an image that is missing or not an image file. A folder is read as videos
    with captions (`read_video_captions`).
    """
    path = Path(path)
    if path.is_dir():
        return read_video_captions(path, flag)
    if path.is_file() and path.suffix.lower() not in PAIRED_SUFFIXES:
        raise _image_error(
            flag,
            path,
            f"a {path.suffix or 'suffix-less'} prompts file pairs no images, and this teacher turns "
            "an image into a video: every prompt needs its image",
            PAIRING_FIX,
        )
    records = read_prompt_records(path, flag)
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
        pair = ImagePrompt(record.prompt, path.parent / Path(value.strip()).expanduser(), path, record.line)
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


def check_image_file(pair: ImagePrompt, flag: str = "--data_path") -> None:
    """Refuse a missing image, a folder, or a file no image library can identify (header only: a
    full decode of every image happens once, when its latent is cached)."""
    import PIL.Image

    problem = ""
    if pair.image.is_dir():
        problem = "is a folder, not an image file"
    elif not pair.image.is_file():
        problem = "not found"
    elif pair.image.suffix.lower() in VIDEO_SUFFIXES:
        pass  # a video's first frame is decoded when its latent is cached
    else:
        try:
            with PIL.Image.open(pair.image):
                pass
        except PIL.UnidentifiedImageError:
            problem = "is not an image (no image format recognises its bytes)"
        except OSError as exc:
            problem = f"cannot be read ({exc.strerror or exc})"
    if problem:
        raise _image_error(
            flag,
            pair.source,
            f"line {pair.line}: image {pair.image} {problem}",
            "fix the image path (relative to the prompts file) or the image file, or remove the line",
        )


def load_image(pair: ImagePrompt, flag: str = "--data_path") -> Any:
    """The pair's image as an RGB PIL image, as diffusers' load_image gives it to the stock pipeline
    (EXIF rotation applied); a truncated or damaged file is refused naming the file and line."""
    import PIL.Image
    from diffusers.utils import load_image as diffusers_load_image

    try:
        if pair.image.suffix.lower() in VIDEO_SUFFIXES:
            import imageio.v3 as iio

            # index=0 decodes the first frame only, whichever container holds the video.
            return PIL.Image.fromarray(iio.imread(pair.image, index=0)).convert("RGB")
        return diffusers_load_image(str(pair.image))
    except (
        OSError,
        ValueError,
        SyntaxError,
        RuntimeError,
        IndexError,
        PIL.Image.DecompressionBombError,
    ) as exc:
        raise _image_error(
            flag,
            pair.source,
            f"line {pair.line}: image {pair.image} cannot be decoded",
            "replace the image with a complete copy, or remove the line",
            f"{type(exc).__name__}: {exc}",
        ) from None


def read_video_captions(folder: str | Path, flag: str = "--data_path") -> list[ImagePrompt]:
    """Each video in `folder` (sorted by name) with its caption, the text of the .txt file of the
    same name; the video's first frame is its image. A video without a caption is refused."""
    folder = Path(folder)
    videos = sorted(p for p in folder.iterdir() if p.is_file() and p.suffix.lower() in VIDEO_SUFFIXES)
    if not videos:
        raise _image_error(
            flag,
            folder,
            f"is a folder without videos ({', '.join(VIDEO_SUFFIXES)}) to take first frames from",
            f"pass a folder of captioned videos (clip.mp4 with clip.txt), or {PAIRING_FIX}",
        )
    pairs = []
    for video in videos:
        caption = video.with_suffix(".txt")
        fix = f"write the video's caption in {caption} (one text), or move the video out of {folder}"
        if not caption.is_file():
            raise _image_error(flag, folder, f"video {video.name} has no caption file {caption.name}", fix)
        try:
            text = caption.read_text(encoding="utf-8-sig").strip()
        except (OSError, UnicodeDecodeError) as exc:
            raise _image_error(
                flag, caption, f"the caption of {video.name} cannot be read ({exc})", fix
            ) from None
        if not text:
            raise _image_error(flag, caption, f"the caption of {video.name} is empty", fix)
        pairs.append(ImagePrompt(" ".join(text.split()), video, caption, 1))
    return pairs


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
        image = load_image(pair, self.flag)
        self._say_fit(pair, image.width, image.height)
        return self.processor.preprocess(image, height=self.height, width=self.width).float()

    def _say_fit(self, pair: ImagePrompt, width: int, height: int) -> None:
        notes = {
            "aspect": (
                abs((width * self.height) / (height * self.width) - 1) > ASPECT_TOLERANCE,
                f"is {width}x{height}, another aspect ratio than the run's {self.width}x{self.height}: "
                "it is stretched to that size without cropping, as stock WanImageToVideoPipeline does",
                "crop the images to the run's aspect ratio first to keep their proportions",
            ),
            "smaller": (
                width < self.width or height < self.height,
                f"is {width}x{height}, smaller than the run's {self.width}x{self.height}: it is enlarged "
                "(Lanczos), as stock WanImageToVideoPipeline does, and the video starts from a blurred frame",
                "use images at least as large as --width x --height",
            ),
        }
        for kind, (applies, what, advice) in notes.items():
            if applies and kind not in self.said:
                self.said.add(kind)
                logger.warning(
                    "image %s (%s) %s; %s. Other images like it are treated the same without another "
                    "warning.",
                    pair.image,
                    pair.where,
                    what,
                    advice,
                )
