"""What a finished run writes: the student (student/, student_ema/, the original-layout file when
asked), or a LoRA student's adapters (lora/, lora_ema/, merged/ when asked), the scheduler a few-step
student samples with, run_settings.json and a model card in every folder, and the pipeline/ folder.
Rank 0 writes; every rank passes the same barrier."""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from distill.models.causal.attention import causal_layout
from distill.models.causal.layout import write_causal_config
from distill.models.lora import AdapterModel
from distill.models.lora_files import merged_state, write_lora_folder, write_merged_experts
from distill.models.original.export import export_original
from distill.models.student import export_student, unwrap_model
from distill.ops import distributed as dist_utils
from distill.ops.errors import DistillError
from distill.ops.files import export_failed
from distill.sample.model_card import document_export
from distill.sample.run_settings import RunSettings, settings_from_run
from distill.train import checkpoint as ckpt

if TYPE_CHECKING:
    from distill.train.loop import TrainingLoop

logger = logging.getLogger(__name__)

# Everything an export may write into <output_dir>, besides run_settings.json and README.md.
EXPORTS = (
    "student",
    "student_ema",
    "student_original.safetensors",
    "student_ema_original.safetensors",
    "pipeline",
    "lora",
    "lora_ema",
    "merged",
)
# Where exports of an earlier run in the same --output_dir go when this run does not rewrite them.
STALE = "stale_exports"


def export_names(cfg: Any, ema: bool) -> set[str]:
    """The names of EXPORTS that a run with `cfg` (and an EMA when `ema`) writes."""
    formats = cfg.export_formats.split(",")
    if cfg.student_lora_rank:
        return {"lora"} | ({"lora_ema"} if ema else set()) | ({"merged"} if "merged" in formats else set())
    names = {"student", "pipeline"} | ({"student_ema"} if ema else set())
    if "original" in formats:
        names |= {"student_original.safetensors"} | ({"student_ema_original.safetensors"} if ema else set())
    return names


def set_aside_stale_exports(output_dir: Path, written: set[str]) -> list[Path]:
    """Move the exports an earlier run left in `output_dir` that this run does not write (merged/ of
    a run continued without merged, student_ema/ of one continued without --ema_decay) into
    stale_exports/, saying so: beside this run's exports they would describe other weights. Done
    before anything is written, so the folder never holds exports that disagree."""
    moved = []
    for name in EXPORTS:
        path = output_dir / name
        if name in written or not (path.exists() or path.is_symlink()):
            continue
        aside = output_dir / STALE / name
        shown = f"{name}/" if path.is_dir() else name
        aside.parent.mkdir(exist_ok=True)
        if aside.is_dir() and not aside.is_symlink():
            shutil.rmtree(aside)  # an even older stale copy
        elif aside.exists() or aside.is_symlink():
            aside.unlink()
        os.replace(path, aside)
        logger.warning(
            "%s in %s is from an earlier export that this run does not rewrite (it writes %s): moved to "
            "%s so that it cannot be taken for this run's; delete it when no longer needed",
            shown,
            output_dir,
            ", ".join(n for n in EXPORTS if n in written),
            aside,
        )
        moved.append(aside)
    return moved


@contextlib.contextmanager
def exporting(folder: Path, loop: TrainingLoop) -> Iterator[None]:
    """A failed write of an export (a full disk, a folder that became read-only) as the banner, not
    a traceback: the checkpoints are intact and the same command exports again."""
    try:
        yield
    except DistillError:
        raise
    except Exception as err:  # OSError, or safetensors' / torch's own words for a failed write
        kept = ckpt.complete_checkpoints(ckpt.checkpoint_root(loop.output_dir))
        raise export_failed(err, folder, "", kept[-1].name if kept else None) from None


def export_run(loop: TrainingLoop) -> tuple[Path | None, Path | None]:
    """Rank 0 writes student/ (and student_ema/); the others wait for it."""
    student_dir = ema_dir = None
    student = unwrap_model(loop.student)
    if loop.ctx.is_main:
        with exporting(loop.output_dir / STALE, loop):
            set_aside_stale_exports(loop.output_dir, export_names(loop.cfg, loop.ema is not None))
    if isinstance(student, AdapterModel):  # every rank: merging sharded experts gathers them
        return export_lora(loop, student)
    if loop.ctx.is_main:
        scheduler = loop.method.export_scheduler()
        kept = ckpt.complete_checkpoints(ckpt.checkpoint_root(loop.output_dir))
        resume_from = kept[-1].name if kept else None
        student_dir = export_student(student, loop.output_dir / "student", resume_from=resume_from)
        if scheduler is not None:  # a few-step student ships the scheduler it samples with
            scheduler.save_pretrained(student_dir)
        original = "original" in loop.cfg.export_formats.split(",")
        if original:
            with exporting(loop.output_dir / "student_original.safetensors", loop):
                export_original(student_dir, loop.output_dir / "student_original.safetensors")
        if loop.ema is not None:
            params = list(student.parameters())
            loop.ema.store(params)
            loop.ema.copy_to(params)
            try:
                ema_dir = export_student(student, loop.output_dir / "student_ema", resume_from=resume_from)
                if scheduler is not None:
                    scheduler.save_pretrained(ema_dir)
                if original:
                    with exporting(loop.output_dir / "student_ema_original.safetensors", loop):
                        export_original(ema_dir, loop.output_dir / "student_ema_original.safetensors")
            finally:
                loop.ema.restore(params)
        # How the student samples: the method says (dmd: its K steps and scheduler, guidance 1).
        settings = settings_from_run(
            loop.cfg, loop.distiller.info, loop.step, image_mode(loop), **loop.method.sampling_settings()
        )
        pipeline_dir = write_pipeline(loop, ema_dir or student_dir, settings)
        document_export(loop.output_dir, settings, student_dir, ema_dir, pipeline_dir)
    dist_utils.barrier()
    return student_dir, ema_dir


def export_lora(loop: TrainingLoop, student: AdapterModel) -> tuple[Path | None, Path | None]:
    """lora/ (and lora_ema/): the student's adapters in diffusers' and Wan's key names, with the
    scheduler it samples with, run_settings.json and a model card; merged/ when asked. Called on
    every rank (merging sharded experts gathers their weights); rank 0 writes."""
    lora_dir = ema_dir = None
    if loop.ctx.is_main:
        lora_dir, ema_dir = write_adapters(loop, student)
    if "merged" in loop.cfg.export_formats.split(","):
        export_merged(loop, student)
    if loop.ctx.is_main:
        settings = settings_from_run(
            loop.cfg, loop.distiller.info, loop.step, image_mode(loop), **loop.method.sampling_settings()
        )
        merged_dir = None
        if "merged" in loop.cfg.export_formats.split(","):
            merged_dir = merged_pipeline(
                loop, settings.pipeline_class, settings.scheduler, settings.takes_image
            )
        document_export(
            loop.output_dir, settings, lora_dir, ema_dir, student_kind="lora", merged_dir=merged_dir
        )
        logger.info(
            "LoRA adapters for %s in %s (diffusers and comfyui/ key formats)",
            "the one transformer" if settings.one_transformer else "both experts",
            lora_dir,
        )
    dist_utils.barrier()
    return lora_dir, ema_dir


def write_adapters(loop: TrainingLoop, student: AdapterModel) -> tuple[Path, Path | None]:
    """lora/ and, with EMA, lora_ema/ (rank 0): a file per expert the student has (both A14B
    experts, or the one transformer of TI2V-5B)."""
    scheduler = loop.method.export_scheduler()
    shape = loop.distiller.lora.shapes[student.adapter]

    def write(folder: Path) -> Path:
        with exporting(folder, loop):
            states = {which: student.state(which) for which in student.experts}
            out = write_lora_folder(states, shape, folder, kind=loop.distiller.info.kind)
            if scheduler is not None:
                scheduler.save_pretrained(out)
            layout = causal_layout(student)
            if layout is not None:  # a causal LoRA student: what makes its experts causal again on load
                write_causal_config(out, layout)
        return out

    lora_dir, ema_dir = write(loop.output_dir / "lora"), None
    if loop.ema is not None:
        params = list(student.parameters())
        loop.ema.store(params)
        loop.ema.copy_to(params)
        try:
            ema_dir = write(loop.output_dir / "lora_ema")
        finally:
            loop.ema.restore(params)
    return lora_dir, ema_dir


def export_merged(loop: TrainingLoop, student: AdapterModel) -> None:
    """merged/: the experts with the (EMA, when kept) adapters added in, recording the chunk size of a
    causal LoRA student. Every rank gathers a sharded expert's weights; rank 0 keeps and writes them."""
    params = list(student.parameters())
    if loop.ema is not None:
        loop.ema.store(params)
        loop.ema.copy_to(params)
    try:
        experts = {which: student.expert(which) for which in student.experts}
        states = {
            which: merged_state(expert, student.adapter, keep=loop.ctx.is_main)
            for which, expert in experts.items()
        }
        if loop.ctx.is_main:
            with exporting(loop.output_dir / "merged", loop):
                merged = write_merged_experts(
                    experts, student.adapter, loop.output_dir / "merged", states, causal_layout(student)
                )
            logger.info("the experts with the adapters merged in: %s", merged)
    finally:
        if loop.ema is not None:
            loop.ema.restore(params)


def merged_pipeline(
    loop: TrainingLoop, pipeline_class: str, scheduler: dict[str, Any] | None, takes_image: bool
) -> Path | None:
    """merged/ as a folder the run's pipeline class loads (rank 0): the teacher's model_index.json
    and links to its text encoder, tokenizer and VAE beside the experts, and the run's own
    scheduler, so nothing else is needed to sample with them. None when it holds the experts only
    (a file system without symbolic links)."""
    from distill.sample.pipeline_folder import make_pipeline_of_experts

    folder = loop.output_dir / "merged"
    try:
        make_pipeline_of_experts(folder, loop.distiller.info.path, scheduler, pipeline_class)
    except DistillError as exc:  # e.g. no symlinks on this file system: the experts themselves are fine
        logger.warning("merged/ holds the experts only: %s", exc.title)
        return None
    logger.info(
        "%s.from_pretrained(%r) loads the merged experts with the teacher's text encoder and VAE%s",
        pipeline_class,
        str(folder),
        " (pass image=, the first frame)" if takes_image else "",
    )
    return folder


def image_mode(loop: TrainingLoop) -> bool:
    """Whether the run distilled image to video: its samples carry images (always for I2V-A14B; for
    TI2V-5B when the data paired them: the trainer's own reading of --data_path)."""
    return any(sample.image is not None for sample in loop.distiller.samples)


def write_pipeline(loop: TrainingLoop, student_dir: Path, settings: RunSettings) -> Path | None:
    """<output_dir>/pipeline/: ready for the run's stock pipeline class (WanPipeline, or
    WanImageToVideoPipeline) from_pretrained, linking the teacher's parts (no copies)."""
    from distill.sample.pipeline_folder import write_pipeline_folder

    kind = loop.distiller.info.kind
    try:
        path = write_pipeline_folder(
            loop.output_dir,
            loop.distiller.info.path,
            student_dir,
            settings.scheduler,
            settings.pipeline_class,
        )
        # A two-mode teacher's run says its mode: the other pipeline class would load the folder too.
        mode = (
            f" ({kind.model} in {'image' if settings.takes_image else 'text'} mode)"
            if len(kind.pipeline_classes) > 1
            else ""
        )
        logger.info(
            "%s.from_pretrained(%r) loads the student%s with the teacher's text encoder and VAE "
            "(sample it as its README.md shows%s)",
            settings.pipeline_class,
            str(path),
            mode,
            "; pass image=, the first frame" if settings.takes_image else "",
        )
        return path
    except DistillError as exc:  # e.g. no symlinks on this file system: the student itself is fine
        logger.warning("no pipeline/ folder: %s (use python -m distill.generate instead)", exc.title)
        return None
