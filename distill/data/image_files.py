"""Reading the image a video starts from, one way for every command.

Training (`--data_path`, `--sample_prompts`, `--eval_prompts`), `distill.generate --image` and
`--prompts_file`, and `distill.evaluate --prompts` all read a condition image here, so that the same
file gives the same picture, the same refusal and the same notes everywhere:

- a picture file (anything Pillow opens) or a video (its first frame, as training has always taken
  from a folder of captioned videos);
- EXIF rotation applied, then converted to 8-bit RGB as stock `WanImageToVideoPipeline`'s
  `load_image` does, except where Pillow's own `convert("RGB")` gives a wrong picture: 16- and 32-bit
  grey comes out white, floating-point grey black, and premultiplied "La" is refused by Pillow;
  those are scaled to 8 bits here;
- what the reading changed (a later frame dropped, transparency dropped, bit depth reduced) is
  returned as notes for the caller to say, never done silently.

Refusals are `ImageFileError`s (a problem, its details and a fix); each caller adds the flag, the
prompts file and its line.
"""

from __future__ import annotations

import errno
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

# Videos whose first frame is taken as the image (read with imageio's ffmpeg, as diffusers' load_video).
VIDEO_SUFFIXES = (".mp4", ".webm", ".mov", ".mkv", ".avi")

# Picture files a folder of captioned media is searched for (any file Pillow opens is read when
# named directly; a folder needs a list, so that notes.md or a .json beside the media are not taken).
PICTURE_SUFFIXES = (".png", ".jpg", ".jpeg", ".webp", ".bmp", ".gif", ".tif", ".tiff")

IMAGE_FIX = "pass an image file (.png, .jpg, .webp) or a video (.mp4: its first frame is used)"


class ImageFileError(Exception):
    """An image file that cannot be used: what is wrong, Pillow's own words, and the fix."""

    def __init__(
        self, problem: str, details: str = "", fix: str = IMAGE_FIX, path_wrong: bool = False
    ) -> None:
        super().__init__(problem)
        self.problem = problem
        self.details = details
        self.fix = fix
        self.path_wrong = path_wrong
        """True when nothing readable is at the path (missing, a folder, a broken link), rather than a
        file whose content is wrong: a command-line path is then a usage error, not a data one."""


@dataclass(frozen=True)
class Note:
    """Something reading an image did to it that the user should know; `kind` groups notes that are
    said once per run (the first file named)."""

    kind: str
    text: str
    advice: str


def is_video(path: Path) -> bool:
    return path.suffix.lower() in VIDEO_SUFFIXES


def max_pixels() -> int:
    """The largest picture decoded: Pillow's own decompression-bomb limit (twice MAX_IMAGE_PIXELS,
    about 179 Mpixels), where it refuses to open a file: a few KB of PNG can claim 14000x14000."""
    import PIL.Image

    return 2 * int(PIL.Image.MAX_IMAGE_PIXELS or 89_478_485)


def check_image_file(path: str | Path) -> None:
    """Refuse what cannot be an image, reading the header only (a full decode happens once, when the
    image is used): a broken link, a folder, a missing file, bytes no format recognises, a picture too
    large to decode. A video is decoded when it is used."""
    import PIL.Image

    path = Path(path)
    _check_exists(path)
    if is_video(path):
        return
    try:
        with PIL.Image.open(path) as image:
            _check_size(image.width, image.height)
    except PIL.Image.DecompressionBombError as exc:
        raise _too_large(str(exc)) from None
    except PIL.UnidentifiedImageError:
        raise ImageFileError("is not an image (no image format recognises its bytes)") from None
    except OSError as exc:
        raise ImageFileError(f"cannot be read ({exc.strerror or exc})") from None


def read_image_file(path: str | Path) -> tuple[Any, list[Note]]:
    """The picture at `path` as an 8-bit RGB PIL image (a video: its first frame), and notes on what
    reading it changed. A damaged file is an ImageFileError."""
    import PIL.Image
    import PIL.ImageOps

    path = Path(path)
    check_image_file(path)
    try:
        if is_video(path):
            import imageio.v3 as iio

            # index=0 decodes the first frame only, whichever container holds the video.
            frame = PIL.Image.fromarray(np.asarray(iio.imread(path, index=0))[..., :3])
            note = Note(
                "video",
                "is a video: its first frame is used",
                "pass that frame as a picture to choose another",
            )
            return frame.convert("RGB"), [note]
        with PIL.Image.open(path) as opened:
            notes = _frames_note(opened)
            opened.seek(0)
            image = PIL.ImageOps.exif_transpose(opened)
            image.load()
            rgb, more = to_rgb(image)
            return rgb, notes + more
    except ImageFileError:
        raise
    except PIL.Image.DecompressionBombError as exc:
        raise _too_large(str(exc)) from None
    except (OSError, ValueError, SyntaxError, RuntimeError, IndexError, EOFError) as exc:
        raise ImageFileError(
            "cannot be decoded (cut short or damaged)",
            f"{type(exc).__name__}: {exc}",
            "replace the image with a complete copy",
        ) from None


def to_rgb(image: Any) -> tuple[Any, list[Note]]:
    """`image` as 8-bit RGB, and what the conversion dropped or rescaled.

    Pillow's convert("RGB") is right for every 8-bit mode (1, L, P, RGB, CMYK, YCbCr, LAB, HSV, the
    alpha modes, whose alpha it drops as the stock pipeline does); wider modes are scaled here.
    """
    import PIL.Image

    notes = []
    mode = image.mode
    if mode.startswith("I;16") or mode == "I" or mode == "F":
        pixels = np.asarray(image, dtype=np.float64)
        if mode == "F":
            # Floating-point grey: [0, 1] is the usual range; anything wider is taken as 0..255.
            scale = 255.0 if pixels.size and pixels.max() <= 1.0 else 1.0
            what = "floating-point grey"
        else:
            # I;16 is 16-bit by definition; "I" (32-bit) holds 16-bit data in practice (older Pillow
            # opened 16-bit PNGs so), or 8-bit values when nothing exceeds 255.
            sixteen = mode.startswith("I;16") or (pixels.size and pixels.max() > 255)
            scale = 255.0 / 65535.0 if sixteen else 1.0
            what = "16-bit grey" if sixteen else "integer grey"
        grey = np.clip(np.rint(pixels * scale), 0, 255).astype(np.uint8)
        notes.append(
            Note(
                "depth",
                f"is {what} (mode {mode}): scaled to 8 bits",
                "save it as 8-bit to choose the scaling yourself",
            )
        )
        return PIL.Image.fromarray(grey).convert("RGB"), notes
    if mode in ("La", "RGBa"):  # premultiplied alpha: undo it first (Pillow converts La to nothing)
        image = image.convert("LA" if mode == "La" else "RGBA")
        mode = image.mode
    if _has_transparency(image):
        notes.append(
            Note(
                "alpha",
                f"has transparent pixels (mode {mode}): the transparency is dropped, as stock "
                "WanImageToVideoPipeline's load_image drops it, and they show the colour stored under them",
                "flatten it onto the background you want first",
            )
        )
    return image.convert("RGB"), notes


def _has_transparency(image: Any) -> bool:
    if image.mode in ("RGBA", "LA", "PA"):
        return image.getchannel("A").getextrema()[0] < 255
    return image.mode == "P" and "transparency" in image.info


def _frames_note(image: Any) -> list[Note]:
    frames = int(getattr(image, "n_frames", 1) or 1)
    if frames <= 1:
        return []
    kind = f"an animated {image.format or 'image'}"
    return [
        Note(
            "frames",
            f"is {kind} of {frames} frames: its first frame is used",
            "save the frame the video should start from as a single picture",
        )
    ]


def _check_exists(path: Path) -> None:
    if path.is_symlink() and not path.exists():
        target = os.readlink(path)
        try:
            path.resolve(strict=True)
            loop = False
        except RuntimeError:  # Python < 3.13 says a loop this way
            loop = True
        except OSError as exc:
            loop = exc.errno == errno.ELOOP
        what = "that points back to itself (a loop)" if loop else f"to {target}, which does not exist"
        raise ImageFileError(
            f"is a link {what}",
            fix=f"point the link at the image file (ln -sf IMAGE {path}), or name the image itself",
            path_wrong=True,
        )
    if path.is_dir():
        raise ImageFileError("is a folder, not an image file", path_wrong=True)
    if not path.is_file():
        raise ImageFileError("not found", fix="check the path", path_wrong=True)


def _check_size(width: int, height: int) -> None:
    if width * height > max_pixels():
        raise _too_large(f"{width}x{height} = {width * height} pixels")


def _too_large(details: str) -> ImageFileError:
    return ImageFileError(
        f"is too large to decode (more than {max_pixels() // 1_000_000} million pixels)",
        details,
        "scale it down to about the run's --width x --height (Wan runs at 1280x720 or less; the image "
        "is brought to the run's size anyway)",
    )
