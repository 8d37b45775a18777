"""A folder of captioned media as a prompts source: `clip.mp4` (or `clip.png`) with `clip.txt`.

The README and the image-to-video pages list this as one of the data formats, so every command that
takes a prompts file takes such a folder too (distill.data.prompts reads it here): each video or
picture, in name order, is one prompt, the text of the .txt file of the same name, and its image
(a video's first frame). A medium without a caption is refused naming it; a caption without a
medium is said, since a renamed video would otherwise drop out of the data unnoticed.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from distill.data.image_files import PICTURE_SUFFIXES, VIDEO_SUFFIXES
from distill.ops.errors import DistillError, Stage

logger = logging.getLogger(__name__)

# Folders whose unused captions were already said: a command reads its prompts more than once.
_SAID: set[Path] = set()

MEDIA_SUFFIXES = VIDEO_SUFFIXES + PICTURE_SUFFIXES


@dataclass(frozen=True)
class Captioned:
    """One medium of the folder and its caption."""

    medium: Path
    caption_file: Path
    caption: str


def read_captioned_folder(folder: Path, flag: str, images: bool | None = None) -> list[Captioned]:
    """Every captioned video or picture in `folder` (not its subfolders), sorted by name.

    Refused naming the file: a folder with no media (offering a prompts file inside it when there is
    one that suits the caller: `images` True, one that can pair images; False, a .txt of prompts; None,
    either), a medium without its caption, a caption that is empty, unreadable or not UTF-8.
    """
    # Hidden files are skipped: macOS leaves "._clip.mp4" beside "clip.mp4" on other file systems.
    files = sorted(p for p in folder.iterdir() if p.is_file() and not p.name.startswith("."))
    media = [p for p in files if p.suffix.lower() in MEDIA_SUFFIXES]
    if not media:
        raise _no_media(folder, files, flag, images)
    found = []
    for medium in media:
        caption_file = medium.with_suffix(".txt")
        fix = f"write the caption of {medium.name} in {caption_file} (one text), or move {medium.name} out of {folder}"
        if not caption_file.is_file():
            raise _error(flag, folder, f"{medium.name} has no caption file {caption_file.name}", fix)
        try:
            text = caption_file.read_text(encoding="utf-8-sig").strip()
        except (OSError, UnicodeDecodeError) as exc:
            reason = "is not UTF-8" if isinstance(exc, UnicodeDecodeError) else f"cannot be read ({exc})"
            raise _error(flag, caption_file, f"the caption of {medium.name} {reason}", fix) from None
        if not text:
            raise _error(flag, caption_file, f"the caption of {medium.name} is empty", fix)
        found.append(Captioned(medium, caption_file, " ".join(text.split())))
    stems = {medium.stem for medium in media}
    orphans = [p.name for p in files if p.suffix.lower() == ".txt" and p.stem not in stems]
    if orphans and folder.resolve() not in _SAID:
        _SAID.add(folder.resolve())
        logger.warning(
            "%s %s: %d caption file(s) without a video or picture of the same name are not used (%s)",
            flag,
            folder,
            len(orphans),
            ", ".join(orphans[:3]) + (", ..." if len(orphans) > 3 else ""),
        )
    return found


def _no_media(folder: Path, files: list[Path], flag: str, images: bool | None) -> DistillError:
    # A prompts file inside is offered only when the caller would take it: an image-to-video run
    # refuses a .txt, a text-to-video one a file that pairs images.
    paired = [p for p in files if p.suffix.lower() in (".jsonl", ".csv", ".tsv")]
    texts = [p for p in files if p.suffix.lower() == ".txt"]
    offer = {True: paired, False: texts, None: paired + texts}[images]
    fixes = [f"pass the prompts file itself, e.g. {flag} {offer[0]}"] if offer else []
    fixes.append(
        ("or " if fixes else "")
        + "put the videos or pictures in it, each with the .txt caption of the same name (clip.mp4 with clip.txt)"
    )
    kinds = ", ".join(MEDIA_SUFFIXES)
    return _error(
        flag, folder, f"is a folder without videos or pictures ({kinds}) to caption", fixes[0], fixes[1:]
    )


def _error(flag: str, path: Path, problem: str, fix: str, more: list[str] | None = None) -> DistillError:
    return DistillError(f"{flag} {path}: {problem}", fixes=[fix, *(more or [])], stage=Stage.DATA)
