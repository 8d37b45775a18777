"""The shipped toy teacher (assets/toy_teacher/): copied out as a teacher folder in a second, and
the staged, all-or-nothing folder writes that copying and the students' shipping share."""

from __future__ import annotations

import contextlib
import os
import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path

from distill.models.teacher_kind import describe_folder
from distill.ops.errors import DistillError, Stage
from distill.ops.replace import build_beside, put_in_place
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
    # Copied beside the folder first: the one overwrite rule (distill/ops/replace.py) keeps a folder
    # that already holds this teacher, and replaces anything else only with --overwrite.
    staging = build_beside(out_dir)
    try:
        shutil.copytree(source, staging, dirs_exist_ok=True)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    put_in_place(
        staging,
        out_dir,
        flag="--toy",
        holds=describe_folder(out_dir),
        writing="the toy " + describe_folder(source).removeprefix("a "),
        overwrite=overwrite,
    )
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
