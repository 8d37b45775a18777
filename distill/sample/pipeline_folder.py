"""`<output_dir>/pipeline/`: a folder the teacher's stock pipeline class (`WanPipeline`, or
`WanImageToVideoPipeline` for an image-to-video teacher, or the one of a TI2V-5B run's mode) loads
with `from_pretrained` as it is,
holding the student as its transformer and links to the teacher's text encoder, tokenizer and VAE,
so nothing of the teacher is copied. The same links make a LoRA run's merged/ experts a pipeline
folder too."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from distill.models.pipelines import scheduler_from_config
from distill.ops.errors import DistillError, Stage

SHARED_COMPONENTS = ("text_encoder", "tokenizer", "vae", "scheduler")
INDEX = "model_index.json"
# What WanImageToVideoPipeline lists besides WanPipeline's components: no Wan 2.2 model has them.
IMAGE_PIPELINE_EXTRAS = ("image_encoder", "image_processor")


def write_pipeline_folder(
    output_dir: str | Path,
    teacher_path: str | Path,
    student_dir: str | Path,
    scheduler_config: Mapping[str, Any] | None = None,
    pipeline_class: str | None = None,
) -> Path:
    """Write `<output_dir>/pipeline/` so `<pipeline class>.from_pretrained(<output_dir>/pipeline)`
    loads the student.

    `pipeline_class` (default: the teacher's `_class_name`) is the run's stock pipeline: a TI2V-5B
    teacher saves WanPipeline, and a student distilled in its image mode is written as
    WanImageToVideoPipeline (with its image encoder and processor null, as no Wan 2.2 model has
    one); `expand_timesteps` stays as the teacher wrote it.

    The folder holds a model_index.json (the teacher's, with `transformer_2` and `boundary_ratio`
    removed; its `_class_name` and the image-to-video teacher's null image_encoder /
    image_processor kept as they are) and symbolic links: `transformer` -> the student folder
    (relative, so the run folder can be moved), and text_encoder / tokenizer / vae / scheduler ->
    the teacher's folders (absolute), so nothing of the teacher is copied. diffusers follows the
    links like folders. It stops working if the teacher folder moves; `distill.generate` keeps
    working then. `scheduler_config` (with `_class_name`), when given, is the student's own
    sampler: written into pipeline/scheduler/ instead of linking the teacher's.
    """
    output_dir, student_dir = Path(output_dir), Path(student_dir)
    teacher = Path(teacher_path).resolve()
    index = json.loads((teacher / INDEX).read_text())
    index["transformer_2"] = [None, None]
    index["boundary_ratio"] = None
    index = _as_class(index, pipeline_class)
    folder = output_dir / "pipeline"
    staging = output_dir / f".pipeline.{os.getpid()}.tmp"
    _remove(staging)
    staging.mkdir(parents=True)
    try:
        index.update(link_shared_components(staging, teacher, scheduler_config))
        # Relative to where the link will live once the folder is renamed into place.
        target = os.path.relpath(student_dir.resolve(), output_dir.resolve() / "pipeline")
        os.symlink(target, staging / "transformer", target_is_directory=True)
        _write_index(staging, index)
    except OSError as exc:
        _remove(staging)
        raise _no_links(folder, exc) from None
    _remove(folder)
    os.replace(staging, folder)
    return folder


def make_pipeline_of_experts(
    folder: str | Path,
    teacher_path: str | Path,
    scheduler_config: Mapping[str, Any] | None = None,
    pipeline_class: str | None = None,
) -> Path:
    """Turn `folder`, which holds transformer/ and transformer_2/ (the experts with a LoRA run's
    adapters merged in), into a folder the teacher's pipeline class loads: the teacher's
    model_index.json (both experts, its boundary) and links to its shared components, with the
    run's own scheduler when it has one, and the run's pipeline class (as `write_pipeline_folder`;
    TI2V-5B's one transformer too)."""
    folder, teacher = Path(folder), Path(teacher_path).resolve()
    index = _as_class(json.loads((teacher / INDEX).read_text()), pipeline_class)
    try:
        index.update(link_shared_components(folder, teacher, scheduler_config))
        _write_index(folder, index)
    except OSError as exc:
        raise _no_links(folder, exc) from None
    return folder


def _as_class(index: dict[str, Any], pipeline_class: str | None) -> dict[str, Any]:
    """The teacher's model_index.json as `pipeline_class` (None: as it is) saves one: a TI2V-5B
    teacher saves WanPipeline, and its image mode is WanImageToVideoPipeline, whose image encoder
    and processor no Wan 2.2 model has (null)."""
    if pipeline_class is None or pipeline_class == index.get("_class_name"):
        return index
    index["_class_name"] = pipeline_class
    for name in IMAGE_PIPELINE_EXTRAS:
        if pipeline_class == "WanImageToVideoPipeline":
            index.setdefault(name, [None, None])
        else:
            index.pop(name, None)
    return index


def link_shared_components(
    folder: Path, teacher: Path, scheduler_config: Mapping[str, Any] | None
) -> dict[str, Any]:
    """Link the teacher's shared components into `folder` (the scheduler written instead when
    `scheduler_config` is given); returns the model_index.json entries that change."""
    changed: dict[str, Any] = {}
    for name in SHARED_COMPONENTS:
        if name == "scheduler" and scheduler_config is not None:
            scheduler = scheduler_from_config(scheduler_config)
            scheduler.save_pretrained(folder / name)
            changed[name] = ["diffusers", type(scheduler).__name__]
        else:
            os.symlink(teacher / name, folder / name, target_is_directory=True)
    return changed


def _write_index(folder: Path, index: Mapping[str, Any]) -> None:
    (folder / INDEX).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")


def _no_links(folder: Path, exc: OSError) -> DistillError:
    return DistillError(
        f"cannot write {folder}",
        f"{type(exc).__name__}: {exc}",
        causes=["the file system does not support symbolic links"],
        fixes=["use python -m distill.generate, which needs no pipeline folder"],
        stage=Stage.CHECKPOINT,
    )


def _remove(path: Path) -> None:
    import shutil

    if path.is_symlink() or path.is_file():
        path.unlink()
    elif path.is_dir():
        shutil.rmtree(path)
