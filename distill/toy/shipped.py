"""The shipped toy teacher (assets/toy_teacher/): copied out as a teacher folder in a second, and
the staged, all-or-nothing folder writes that copying and the students' shipping share."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from distill.ops.errors import DistillError, Stage
from distill.toy import world

ASSETS = Path(__file__).resolve().parents[2] / "assets" / "toy_teacher"
I2V_ASSETS = ASSETS.parent / "toy_i2v_teacher"
TOY_TEACHERS = {
    "t2v": (ASSETS, "Wan 2.2 T2V A14B", "python -m distill.toy.build --retrain"),
    "i2v": (I2V_ASSETS, "Wan 2.2 I2V A14B", "python -m distill.toy.build_i2v --retrain"),
}
"""download_wan.py --toy_kind -> (shipped folder, the model whose layout it has, its rebuild command)."""


def write_toy_teacher(out_dir: str | Path, *, overwrite: bool = False, source: Path = ASSETS) -> Path:
    """Copy a trained toy teacher (`source`: assets/toy_teacher/, the Wan 2.2 T2V A14B one, or
    assets/toy_i2v_teacher/, I2V A14B) to `out_dir`: a teacher folder in the diffusers layout, plus
    toy_world.json. Takes about a second."""
    out_dir = Path(out_dir).expanduser().absolute()
    if not (source / world.WORLD_FILE).is_file():
        rebuild = next(
            (r for folder, _, r in TOY_TEACHERS.values() if folder == source), TOY_TEACHERS["t2v"][2]
        )
        raise DistillError(
            f"The trained toy teacher is missing from {source}",
            fixes=[f"Restore {source.name}/ from git (assets/), or rebuild it: {rebuild}"],
            stage=Stage.SETUP,
        )
    if out_dir.exists() and not out_dir.is_dir():
        raise DistillError(
            "Cannot write the toy teacher",
            f"{out_dir} exists and is a file, not a folder.",
            fixes=["Choose another output folder."],
            stage=Stage.SETUP,
        )
    if (
        out_dir.is_dir()
        and any(out_dir.iterdir())
        and not overwrite
        and not (out_dir / world.WORLD_FILE).is_file()
    ):
        raise DistillError(
            "Refusing to overwrite a folder that is not a toy teacher",
            f"{out_dir} is not empty and holds no {world.WORLD_FILE}.",
            fixes=["Choose an empty or new folder.", "Pass --overwrite to replace it anyway."],
            stage=Stage.SETUP,
        )
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    with staged_folder(out_dir) as staging:
        shutil.copytree(source, staging)
    return out_dir


@contextlib.contextmanager
def staged_folder(dest: Path) -> Iterator[Path]:
    """A not-yet-existing folder beside `dest` to build in; it replaces `dest` when the block ends
    and is removed if the block fails, so `dest` is never half written."""
    staging = dest.parent / f".{dest.name}.partial-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        yield staging
        if dest.exists():
            shutil.rmtree(dest)
        os.replace(staging, dest)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


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
