"""`--teacher_lora PATH[:SCALE]` in generate and evaluate: the teacher of the reference renders carries
the user's LoRAs, read, checked and fused by the trainer's own code (distill.models.teacher_lora), with
the trainer's banners for bad input.

Which LoRAs, in order:
- `--teacher_lora` given: those (repeatable; `--teacher_lora none` alone: the bare teacher);
- else the ones the student's run was distilled against (its run_settings.json `teacher_loras`): the
  reference has to be the teacher the student learned, so they are used, and the log says so. Each
  file must still be where the run read it with the content it had (its sha256): a file gone or
  changed is refused naming it, with `--teacher_lora NEW/PATH:SCALE` or `--teacher_lora none`;
- else none.

A LoRA student runs on the teacher's experts, so it carries them too (base + user + speed LoRA,
as users stack them); a full student's weights already hold the teacher it learned.
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path
from typing import Any

from distill.config.flag_rules import Dependent
from distill.models.teacher import TeacherInfo, with_loras, with_teacher_loras
from distill.models.teacher_lora import FLAG, from_records
from distill.ops.errors import DistillError, Stage
from distill.sample.run_settings import RunSettings

logger = logging.getLogger(__name__)

NONE = "none"  # --teacher_lora none: the bare teacher, whatever the run recorded


def add_teacher_lora_flag(parser: argparse.ArgumentParser, who: str) -> None:
    """The flag, as the trainer spells it; `who`: what else carries the LoRAs in this command."""
    parser.add_argument(
        FLAG,
        action="append",
        metavar="PATH[:SCALE]",
        help="The user's LoRA fused into the teacher at SCALE (1 when left out), as the trainer fuses it; "
        f"repeat for several. A .safetensors file or a folder with a high/low pair ({who}). Default: the "
        f"LoRAs the student's run was distilled against (its run_settings.json); '{FLAG} {NONE}': the bare teacher.",
    )


def teacher_lora_rule(active: bool, needs: str) -> Dependent:
    """A --teacher_lora that nothing of the render would carry (a full student): refused."""
    return Dependent(
        ("teacher_lora",),
        lambda _: active,
        needs,
        "a distilled student's own weights hold the teacher it learned; only the teacher (and a LoRA "
        "student, which runs on the teacher's experts) carries the LoRAs",
        "add --teacher_only to render the teacher with them",
    )


def _in_words(records: list[dict[str, Any]]) -> str:
    return "; ".join(f"{Path(str(r['file'])).name} on {r['expert']} at scale {r['scale']!r}" for r in records)


def _same(a: list[dict[str, Any]], b: list[dict[str, Any]]) -> bool:
    keys = ("expert", "scale", "sha256")
    return [[r.get(k) for k in keys] for r in a] == [[r.get(k) for k in keys] for r in b]


def teacher_with_loras(
    info: TeacherInfo, given: list[str] | None, found: tuple[RunSettings, Path] | None
) -> TeacherInfo:
    """`info` with the LoRAs of the reference (see the module docstring), checked before anything loads."""
    recorded = found[0].teacher_loras if found else []
    if given and NONE in given:
        if given != [NONE]:
            raise DistillError(
                f"{FLAG} {NONE} means the bare teacher, and LoRAs were given beside it",
                f"given: {', '.join(given)}",
                fixes=[f"drop {FLAG} {NONE} to fuse the others, or pass {FLAG} {NONE} alone"],
                stage=Stage.CONFIG,
            )
        if recorded:
            logger.warning(
                "%s %s: the bare teacher, not the one the student was distilled against (%s)",
                FLAG,
                NONE,
                _in_words(recorded),
            )
        return info
    if given:
        info = with_teacher_loras(info, given)
        mine = [lora.record() for lora in info.loras]
        if found and not _same(mine, recorded):
            logger.warning(
                "%s: the teacher carries %s; the student was distilled against %s (%s)",
                FLAG,
                _in_words(mine),
                _in_words(recorded) if recorded else "the bare teacher",
                found[1],
            )
        return info
    if not recorded:
        return info
    assert found is not None
    info = with_loras(info, from_records(recorded, found[1], info.kind))
    logger.info(
        "the teacher carries the LoRAs the student was distilled against (%s): %s; %s %s for the bare teacher",
        found[1],
        _in_words(recorded),
        FLAG,
        NONE,
    )
    return info
