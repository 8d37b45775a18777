"""The fields of a prompts file's records that no reader uses: refused or named, never dropped unsaid.

A .jsonl / .csv / .tsv record is read for its `prompt` and, for image to video, its `image`
(distill/data/images.py); a run has one of every other setting. A field that asks for something
per record that no Wan 2.2 pipeline this project distils can do, or that the run sets once (a
negative prompt per prompt, a last frame), would change what the student learns if it were read,
so it is refused with the setting that does it. Any other field (`seed`, `fps`, an `id` column) is
named in one warning per file, with what sets that instead, and otherwise left alone: data sets
often carry such columns.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from distill.ops.errors import DistillError, Stage

logger = logging.getLogger(__name__)

# The fields the readers take: the prompt, and the image a video starts from.
READ_FIELDS = ("prompt", "image")

# Fields that would change what a sample asks of the teacher: why each is not taken.
REFUSED_FIELDS = {
    "negative_prompt": "a run has one negative prompt for every sample (--negative_prompt), which feeds "
    "the unconditional branch of the teacher's guidance",
    "last_image": "the Wan 2.2 pipelines this project distils start a video from one image (its first "
    "frame) and take no last frame",
}

# What sets a commonly seen ignored field instead, for the warning.
INSTEAD = {
    "seed": "each sample's noise comes from --seed and its prompt",
    "fps": "a run has no frame rate: --num_frames sets the length",
    "num_frames": "--num_frames sets every sample's length",
    "height": "--height sets every sample's size",
    "width": "--width sets every sample's size",
}

# Files already warned about in this process (every command reads a prompts file more than once).
_warned: set[tuple[Path, tuple[str, ...]]] = set()


def check_record_fields(path: Path, records: Iterable[tuple[int, Mapping[str, Any]]], flag: str) -> None:
    """Refuse a field of REFUSED_FIELDS and warn once about any other unread field of the
    (line, fields) records of `path`, the file `flag` names."""
    first_line: dict[str, int] = {}
    for line, fields in records:
        for name in fields:
            if isinstance(name, str) and name not in READ_FIELDS:
                first_line.setdefault(name, line)
    for name, why in REFUSED_FIELDS.items():
        if name in first_line:
            raise DistillError(
                f"{flag} {path}: line {first_line[name]} has a '{name}' field, which this project "
                "cannot apply per prompt",
                f"It would be ignored: {why}. Records are read for 'prompt' and 'image' only.",
                fixes=[
                    f"remove the '{name}' field from {path}"
                    + (
                        " (set the run's one negative prompt with --negative_prompt)"
                        if name == "negative_prompt"
                        else ""
                    )
                ],
                stage=Stage.DATA,
            )
    ignored = tuple(first_line)
    if not ignored or (path.resolve(), ignored) in _warned:
        return
    _warned.add((path.resolve(), ignored))
    notes = "; ".join(f"{name}: {INSTEAD[name]}" for name in ignored if name in INSTEAD)
    logger.warning(
        "%s %s: field(s) %s are not read and are ignored (first at line %d); records are read for "
        "'prompt' and 'image' only%s",
        flag,
        path,
        ", ".join(repr(name) for name in ignored),
        min(first_line.values()),
        f" ({notes})" if notes else "",
    )
