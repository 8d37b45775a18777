"""What a student was trained for, written beside it at export so sampling needs no guesswork.

A run writes `run_settings.json` into `<output_dir>/` (beside `student/`) and into each exported
folder (`student/`, `student_ema/`, `pipeline/`), so a folder that is copied or uploaded alone
still carries it. `python -m distill.generate` and `python -m distill.evaluate` take their
defaults from it (a flag given on the command line wins), and the model card shows the same call.

Why it matters: the student learned the teacher's *guided* velocity at one resolution, with
prompt embeddings zero-padded to one length (no attention mask, so the padding length changes
the output). WanPipeline's own defaults (guidance 5.0, 50 steps, 480x832, 512 tokens) are not
those.

A teacher with two modes (Wan2.2-TI2V-5B) is distilled in the mode of the run's data: `pipeline_class`
records it (WanImageToVideoPipeline: image to video; WanPipeline: text to video) and `teacher_kind`
names the model, so the tools refuse inputs of the other mode.

A distillation method decides how its student samples: `settings_from_run(..., num_inference_steps=4,
scheduler={...}, scheduler_note="...")` records a few-step student's own step count and scheduler.
"""

from __future__ import annotations

import json
import logging
import re
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from distill.models.teacher_kind import KINDS, T2V_A14B, TeacherKind
from distill.ops.errors import DistillError, Stage

RUN_SETTINGS_FILE = "run_settings.json"
TEXT_TO_VIDEO_PIPELINE = "WanPipeline"
IMAGE_TO_VIDEO_PIPELINE = "WanImageToVideoPipeline"
FORMAT_VERSION = 1
# Hub repositories the teacher may have come from, by folder name (download_wan.py keeps the name).
KNOWN_TEACHERS = {
    "Wan2.2-T2V-A14B-Diffusers": "Wan-AI/Wan2.2-T2V-A14B-Diffusers",
    "Wan2.2-T2V-A14B": "Wan-AI/Wan2.2-T2V-A14B",
    "Wan2.2-I2V-A14B-Diffusers": "Wan-AI/Wan2.2-I2V-A14B-Diffusers",
    "Wan2.2-I2V-A14B": "Wan-AI/Wan2.2-I2V-A14B",
    "Wan2.2-TI2V-5B-Diffusers": "Wan-AI/Wan2.2-TI2V-5B-Diffusers",
    "Wan2.2-TI2V-5B": "Wan-AI/Wan2.2-TI2V-5B",
}
# huggingface_hub's cache folder of a repo: models--ORG--NAME (hub names never hold "--").
_HUB_CACHE_FOLDER = re.compile(r"^models--(?P<org>.+?)--(?P<name>.+)$")


@dataclass
class RunSettings:
    """How the exported student samples, and what it was distilled from."""

    teacher_path: str
    """The teacher as WanPipeline.from_pretrained loads it: a hub id or a diffusers folder (for an
    original-layout teacher, its converted copy). Tokenizer, text encoder and VAE come from it."""
    height: int
    """Training height in pixels: the student has only seen latents of this size."""
    width: int
    """Training width in pixels."""
    num_frames: int
    """Training frames per sample (1 = image mode)."""
    max_sequence_length: int
    """Rows the prompt embeddings were zero-padded to in training. WanPipeline uses no attention
    mask, so sampling with another length changes the output: pass exactly this."""
    num_inference_steps: int
    """Sampler steps the student is meant to be sampled with."""
    guidance_scale: float = 1.0
    """Guidance when sampling the student: 1.0, it learned the already guided velocity."""
    scheduler: dict[str, Any] | None = None
    """The scheduler config (with `_class_name`) the student samples with; None = the teacher's."""
    scheduler_note: str | None = None
    """One sentence on the sampler, for the model card."""
    method: str = "velocity"
    """The distillation method that made the student."""
    base_model: str | None = None
    """Hub id of the teacher when known (the model card's base_model)."""
    teacher_guidance_scale: float = 4.0
    """Guidance of the teacher's high-noise expert in training."""
    teacher_guidance_scale_2: float | None = 3.0
    """Guidance of the teacher's low-noise expert in training; None for a teacher with one transformer."""
    negative_prompt: str = ""
    """Negative prompt of the teacher's guidance in training."""
    flow_shift: float = 3.0
    """Shift of the training timestep schedule."""
    boundary_ratio: float | None = 0.875
    """The teacher's expert switch, as a fraction of 1000 timesteps; None for one transformer."""
    teacher_sample_steps: int = 40
    """Teacher sampler steps behind each clean latent."""
    sample_seed: int = 0
    """Prompt i of the run's samples started from the noise of seed sample_seed + i."""
    trained_steps: int = 0
    """Optimizer steps the exported weights have seen."""
    format: int = FORMAT_VERSION
    """Version of this file's layout."""
    pipeline_class: str = TEXT_TO_VIDEO_PIPELINE
    """The stock diffusers pipeline that samples the student: WanPipeline (text to video), or
    WanImageToVideoPipeline (image to video: every call takes `image=`, the video's first frame).
    For TI2V-5B it is the mode the run distilled: its data's."""
    teacher_kind: str | None = None
    """The teacher's model (models/teacher_kind.py short name, e.g. ti2v-5b), written for TI2V-5B
    only; None in a file: the model its pipeline_class names (WanPipeline: T2V-A14B)."""
    chunk_frames: int | None = None
    """A causal student's chunk (latent frames; its folder's causal_config.json says the same): it
    streams chunk by chunk with `python -m distill.generate --stream`. None (and then not written):
    a bidirectional student."""
    expert_phase: str | None = None
    """A LoRA run of one expert's adapters (--expert_phase high or low): the other expert's adapters
    are what the run started from (--student_lora_init, or none). None (and then not written): both
    experts' adapters trained together, or a student of its own."""
    teacher_loras: list[dict[str, Any]] = field(default_factory=list)
    """The user's LoRAs fused into the teacher it was distilled against (--teacher_lora): each one's
    file, expert (transformer = high noise, transformer_2 = low noise), scale and sha256; [] for the
    bare teacher (and then not written)."""

    @property
    def takes_image(self) -> bool:
        """Whether the student turns an image into a video (its pipeline needs `image=`)."""
        return self.pipeline_class == IMAGE_TO_VIDEO_PIPELINE

    @property
    def one_transformer(self) -> bool:
        """Whether the teacher runs one transformer at every timestep (no expert switch)."""
        return self.boundary_ratio is None

    def to_json(self) -> str:
        values = asdict(self)
        # Written only when they say something: a text-to-video A14B run's file stays what it always
        # was, and a file without them reads as WanPipeline of Wan2.2-T2V-A14B. The model is written
        # where the stock pipeline does not name it: a TI2V-5B run (WanPipeline loads it in text
        # mode, WanImageToVideoPipeline in image mode), not the A14B runs, whose files stay as they were.
        if self.pipeline_class == TEXT_TO_VIDEO_PIPELINE:
            del values["pipeline_class"]
        named = next((k for k in KINDS if k.name == self.teacher_kind), None)
        if named is None or len(named.pipeline_classes) == 1:
            del values["teacher_kind"]
        if not self.teacher_loras:
            del values["teacher_loras"]
        if self.chunk_frames is None:
            del values["chunk_frames"]
        if self.expert_phase is None:
            del values["expert_phase"]
        return json.dumps(values, indent=2, sort_keys=True) + "\n"


def teacher_hub_id(source: str, resolved: str | Path) -> str | None:
    """The hub id the teacher came from, or None: as given, from a hub-cache path, or by folder name."""
    if not Path(source).expanduser().exists() and re.fullmatch(r"[\w.-]+/[\w.-]+", source):
        return source
    for part in reversed(Path(resolved).parts):
        match = _HUB_CACHE_FOLDER.match(part)
        if match:
            return f"{match['org']}/{match['name']}"
    for candidate in (Path(source).expanduser().resolve().name, Path(resolved).name):
        if candidate in KNOWN_TEACHERS:
            return KNOWN_TEACHERS[candidate]
    return None


def loadable_teacher(source: str, resolved: str | Path) -> str:
    """What WanPipeline.from_pretrained should be given: the hub id the user named, else the absolute
    teacher folder (the converted copy for an original-layout teacher), so it works from any folder."""
    if not Path(source).expanduser().exists():
        return source  # a hub id
    return str(Path(resolved).resolve())


def pipeline_class_of(kind: TeacherKind, image: bool) -> str:
    """The stock pipeline that samples a student of `kind` in the mode `image` says (the kind's own
    for a one-mode kind)."""
    if len(kind.pipeline_classes) > 1:
        return IMAGE_TO_VIDEO_PIPELINE if image else TEXT_TO_VIDEO_PIPELINE
    return kind.pipeline_class


def settings_from_run(
    cfg: Any, info: Any, trained_steps: int, image: bool | None = None, **method: Any
) -> RunSettings:
    """The settings of a finished run (`cfg` a TrainConfig, `info` its TeacherInfo).

    `image` is the mode of a teacher with two (TI2V-5B); None: read from `cfg.data_path` as the
    trainer reads it. `method` overrides how the student samples (num_inference_steps,
    guidance_scale, scheduler, scheduler_note, method); the default is the velocity student: the
    teacher's scheduler with the run's --sample_steps at guidance 1.
    """
    from distill.sample.image_inputs import data_takes_images

    kind = getattr(info, "kind", T2V_A14B)
    if image is None:
        image = data_takes_images(kind, getattr(cfg, "data_path", None))
    values: dict[str, Any] = {
        "teacher_path": loadable_teacher(cfg.teacher_path, info.path),
        "height": cfg.height,
        "width": cfg.width,
        "num_frames": cfg.num_frames,
        "max_sequence_length": cfg.max_sequence_length,
        "num_inference_steps": cfg.sample_steps,
        "base_model": teacher_hub_id(cfg.teacher_path, info.path),
        "teacher_guidance_scale": cfg.guidance_scale,
        # One transformer has one guidance (run_checks refuses a --guidance_scale_2 for it).
        "teacher_guidance_scale_2": cfg.guidance_scale_2 if kind.experts == 2 else None,
        "negative_prompt": cfg.negative_prompt,
        "flow_shift": cfg.flow_shift if cfg.flow_shift is not None else info.flow_shift,
        "boundary_ratio": info.boundary_ratio,
        "teacher_sample_steps": cfg.teacher_sample_steps,
        "sample_seed": cfg.sample_seed,
        "trained_steps": trained_steps,
        # The teacher's kind (read from its files) and the run's mode decide the stock pipeline.
        "pipeline_class": pipeline_class_of(kind, image),
        "teacher_kind": kind.name,
        "teacher_loras": [lora.record() for lora in getattr(info, "loras", ())],
        "chunk_frames": getattr(cfg, "student_chunk_frames", None) or None,
        "expert_phase": _one_phase(getattr(cfg, "expert_phase", "both")),
    }
    unknown = set(method) - {f.name for f in fields(RunSettings)}
    if unknown:
        raise TypeError(f"unknown run settings: {sorted(unknown)}")
    values.update(method)
    return RunSettings(**values)


def _one_phase(phase: str | None) -> str | None:
    return None if phase in (None, "both") else phase


def write_run_settings(settings: RunSettings, *folders: str | Path) -> list[Path]:
    """Write run_settings.json into each folder (written aside and renamed: never half a file)."""
    written = []
    for folder in map(Path, folders):
        path = folder / RUN_SETTINGS_FILE
        tmp = path.with_name(f".{RUN_SETTINGS_FILE}.tmp")
        tmp.write_text(settings.to_json())
        tmp.replace(path)
        written.append(path)
    return written


def read_run_settings(path: str | Path) -> RunSettings:
    """Read one run_settings.json; a damaged or foreign file is refused with the file named."""
    path = Path(path)
    try:
        data = json.loads(path.read_text())
        known = {f.name for f in fields(RunSettings)}
        return RunSettings(**{k: v for k, v in data.items() if k in known})
    except (OSError, ValueError, TypeError) as exc:
        raise DistillError(
            f"cannot read {path}",
            f"{type(exc).__name__}: {exc}",
            causes=["the file was edited by hand or truncated"],
            fixes=[
                f"delete {path} and pass --height, --width, --num_frames, --steps and "
                "--max_sequence_length explicitly (the values the student was trained with)",
            ],
            stage=Stage.CONFIG,
        ) from None


def find_run_settings(model_dir: str | Path | None) -> tuple[RunSettings, Path] | None:
    """The settings of the run that exported `model_dir`: its own run_settings.json, else the one
    beside it (<output_dir>/run_settings.json); None when neither exists (an older export)."""
    if model_dir is None:
        return None
    model_dir = Path(model_dir)
    for path in (model_dir / RUN_SETTINGS_FILE, model_dir.parent / RUN_SETTINGS_FILE):
        if path.is_file():
            return read_run_settings(path), path
    return None


def warn_without_run_settings(student: Any, height: int, width: int, steps: int, max_len: int) -> None:
    """Say which stand-in values a command uses for a student that records none."""
    logging.getLogger(__name__).warning(
        "no run_settings.json in or beside %s: using %dx%d, %d steps, max_sequence_length %d; "
        "pass the values the student was trained with",
        student,
        height,
        width,
        steps,
        max_len,
    )


def fill_left_out_flags(args: Any, defaults: dict[str, Any], source: Path | None = None) -> None:
    """Give every flag the user left out (None) its default, then require a teacher: without
    run settings nothing else can name the teacher the student was distilled from.

    `source` is the run_settings.json the defaults come from: a teacher folder it records (always
    absolute) that is no longer there is reported naming that file and the flag that overrides it.
    """
    recorded_teacher = getattr(args, "teacher_path", None) is None and defaults.get("teacher_path")
    for name, value in defaults.items():
        if getattr(args, name, None) is None:
            setattr(args, name, value)
    if (
        recorded_teacher
        and source
        and Path(args.teacher_path).is_absolute()
        and not Path(args.teacher_path).exists()
    ):
        raise DistillError(
            f"the teacher recorded in {source} is not there any more: {args.teacher_path}",
            "The student's run settings name the teacher it was distilled from by the absolute folder it "
            "had at training time; the folder has been moved or deleted, or this is another machine.",
            fixes=[f"pass --teacher_path NEW_FOLDER (it overrides the teacher in {source.name})"],
            stage=Stage.CONFIG,
        )
    if not args.teacher_path:
        raise DistillError(
            "--teacher_path is required",
            "no run_settings.json in or beside the student names the teacher it was distilled from",
            fixes=[
                "pass --teacher_path models/Wan2.2-T2V-A14B-Diffusers (or the I2V-A14B / TI2V-5B folder: "
                "the teacher of the run)"
            ],
            stage=Stage.ARGV,
        )
