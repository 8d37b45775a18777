"""`<output_dir>/pipeline/`: a folder `WanPipeline.from_pretrained` loads as it is, holding the
student as its transformer and links to the teacher's text encoder, tokenizer and VAE, so nothing
of the teacher is copied."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from distill.models.pipelines import scheduler_from_config
from distill.ops.errors import DistillError, Stage

SHARED_COMPONENTS = ("text_encoder", "tokenizer", "vae", "scheduler")


def write_pipeline_folder(
    output_dir: str | Path,
    teacher_path: str | Path,
    student_dir: str | Path,
    scheduler_config: Mapping[str, Any] | None = None,
) -> Path:
    """Write `<output_dir>/pipeline/` so `WanPipeline.from_pretrained(<output_dir>/pipeline)` loads the student.

    The folder holds a model_index.json (the teacher's, with `transformer_2` and `boundary_ratio`
    removed) and symbolic links: `transformer` -> the student folder (relative, so the run folder
    can be moved), and text_encoder / tokenizer / vae / scheduler -> the teacher's folders
    (absolute), so nothing of the teacher is copied. diffusers follows the links like folders.
    It stops working if the teacher folder moves; `distill.generate` keeps working then.
    `scheduler_config` (with `_class_name`), when given, is the student's own sampler: written into
    pipeline/scheduler/ instead of linking the teacher's.
    """
    output_dir, student_dir = Path(output_dir), Path(student_dir)
    teacher = Path(teacher_path).resolve()
    index = json.loads((teacher / "model_index.json").read_text())
    index["transformer_2"] = [None, None]
    index["boundary_ratio"] = None
    folder = output_dir / "pipeline"
    staging = output_dir / f".pipeline.{os.getpid()}.tmp"
    _remove(staging)
    staging.mkdir(parents=True)
    try:
        for name in SHARED_COMPONENTS:
            if name == "scheduler" and scheduler_config is not None:
                scheduler = scheduler_from_config(scheduler_config)
                scheduler.save_pretrained(staging / name)
                index[name] = ["diffusers", type(scheduler).__name__]
            else:
                os.symlink(teacher / name, staging / name, target_is_directory=True)
        # Relative to where the link will live once the folder is renamed into place.
        target = os.path.relpath(student_dir.resolve(), output_dir.resolve() / "pipeline")
        os.symlink(target, staging / "transformer", target_is_directory=True)
        (staging / "model_index.json").write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    except OSError as exc:
        _remove(staging)
        raise DistillError(
            f"cannot write {folder}",
            f"{type(exc).__name__}: {exc}",
            causes=["the file system does not support symbolic links"],
            fixes=["use python -m distill.generate, which needs no pipeline folder"],
            stage=Stage.CHECKPOINT,
        ) from None
    _remove(folder)
    os.replace(staging, folder)
    return folder


def _remove(path: Path) -> None:
    import shutil

    if path.is_symlink() or path.is_file():
        path.unlink()
    elif path.is_dir():
        shutil.rmtree(path)
