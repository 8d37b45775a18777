"""Shipping a trained toy student into assets/: what the ship commands share (distill.toy.stage_one,
distill.toy.i2v_ship, distill.toy.t2v_ship). A command-side module: it writes the run settings and
model card of the sample layer, so no library module imports it."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path
from typing import Any

from distill.toy.shipped import ASSETS, staged_folder


def ship_student(
    exported: str | Path,
    dest: Path,
    teacher_ref: str,
    record: tuple[str, dict[str, Any]] | None = None,
) -> Path:
    """Copy a run's exported folder (a student, or a LoRA run's adapters) to `dest`, all or nothing:
    its run settings and model card name the teacher as `teacher_ref` (where the demos put it), not
    the folder it was trained from, so the shipped files carry no machine's paths; `record` is
    (file name, what to write in it as JSON): the command that made it and what it scored."""
    from distill.models.lora_files import is_lora_folder
    from distill.sample.model_card import write_model_card
    from distill.sample.run_settings import RUN_SETTINGS_FILE, read_run_settings, write_run_settings

    repo = ASSETS.parents[1]
    with staged_folder(dest) as staging:
        shutil.copytree(exported, staging)
        settings = dataclasses.replace(
            read_run_settings(staging / RUN_SETTINGS_FILE), teacher_path=teacher_ref
        )
        write_run_settings(settings, staging)
        ref = dest.relative_to(repo) if dest.is_relative_to(repo) else dest
        folder_kind = "lora" if is_lora_folder(staging) else "transformer"
        write_model_card(staging, settings, folder_kind, folder_ref=str(ref))
        if record is not None:
            (staging / record[0]).write_text(json.dumps(record[1], indent=2) + "\n")
    return dest
