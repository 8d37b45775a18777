"""An exported student folder, as the tools meet it: checked before anything loads, loaded on the
right device and dtype, and the sizes it (or the teacher) can sample at, with the run's own
settings as the fix when a size is refused."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from distill.models.lora_files import MERGED_SUBFOLDERS, is_lora_folder
from distill.models.lora_folder import LoraFolder
from distill.models.pipelines import (
    SizeLimits,
)
from distill.models.student_kind import channels_of, config_kind, described
from distill.models.teacher import TeacherInfo
from distill.ops.errors import DistillError, Stage
from distill.sample.lora_fit import kind_at, lora_for_teacher
from distill.sample.run_settings import (
    RUN_SETTINGS_FILE,
    RunSettings,
    find_run_settings,
)

# Used only when the student's run left no run_settings.json (an older export) or for the teacher
# alone: WanPipeline's resolution, and this project's usual step count and guidance.
FALLBACK = {"height": 480, "width": 832, "num_frames": 1, "steps": 30, "max_sequence_length": 512}


TEACHER_GUIDANCE = (4.0, 3.0)


def pick_device(name: str) -> torch.device:
    """auto = the GPU when torch sees one, else the CPU; asking for CUDA without one is an error."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name != "cpu" and not name.startswith("cuda"):
        raise DistillError(
            f"--device {name}: unknown device", fixes=["use auto, cpu, cuda or cuda:N"], stage=Stage.ARGV
        )
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise DistillError(
            f"--device {name} asked for CUDA, but torch sees no GPU",
            f"torch {torch.__version__}, CUDA build: {torch.version.cuda}",
            fixes=["use --device auto (or cpu)"],
            stage=Stage.SETUP,
        )
    return torch.device(name)


def load_student(
    folder: str | Path,
    info: TeacherInfo,
    device: torch.device,
    dtype: torch.dtype,
    causal_name: str | None = None,
) -> Any:
    """The exported student, checked against the teacher's model (a student of another Wan 2.2 model
    is refused naming both) and its latent and text spaces; causal again when its folder records a
    chunk size (causal_config.json, distill/models/causal). `causal_name`: its own entries in a KV
    cache shared with another causal model (each expert of merged experts)."""
    from diffusers import WanTransformer3DModel

    from distill.models.causal.attention import make_causal
    from distill.models.causal.layout import read_causal_config
    from distill.models.student_config import TEACHER_EQUAL_KEYS

    folder = require_student_folder(folder)
    layout = read_causal_config(folder)  # before any weight loads: a damaged record fails fast
    try:  # the kind, before any weight loads; an unreadable config.json is from_pretrained's to report
        config = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError):
        config = None
    if isinstance(config, dict):
        check_student_kind(config, info, folder)
    try:
        student = WanTransformer3DModel.from_pretrained(folder, torch_dtype=dtype)
    except Exception as exc:
        raise DistillError(
            f"cannot load the student from {folder}",
            f"{type(exc).__name__}: {exc}",
            causes=["a truncated or foreign weight file"],
            fixes=["export the student again (a finished training run writes it)"],
            stage=Stage.SETUP,
        ) from None
    mismatched = [
        f"{key}: student {student.config.get(key)}, teacher {info.expert_config.get(key)}"
        for key in TEACHER_EQUAL_KEYS
        if list(_as_list(student.config.get(key))) != list(_as_list(info.expert_config.get(key)))
    ]
    if mismatched:
        raise DistillError(
            "the student does not fit this teacher",
            "; ".join(mismatched),
            fixes=["pass the teacher the student was distilled from"],
            stage=Stage.CONFIG,
        )
    if layout is not None:
        make_causal(student, layout.chunk_frames, name=causal_name)
    return student.requires_grad_(False).eval().to(device)


def load_merged_student(
    folder: str | Path, info: TeacherInfo, device: torch.device, dtype: torch.dtype
) -> Any:
    """A LoRA run's merged/ export (the experts with the student's adapters merged in) as one model
    routed by timestep, as the LoRA student itself runs: each expert checked against the teacher as
    a student is, and causal again when its subfolder records a chunk size (a causal LoRA student's),
    each with its own entries in the KV cache."""
    from distill.models.lora import ExpertCopies

    folder = Path(folder)
    subfolders = MERGED_SUBFOLDERS if info.kind.experts == 2 else {"high": MERGED_SUBFOLDERS["high"]}
    missing = [name for name in subfolders.values() if not (folder / name / "config.json").is_file()]
    if missing:
        raise DistillError(
            f"--student {folder}: merged experts without {', '.join(missing)}",
            f"this teacher ({info.kind.model}) has {info.kind.experts} expert(s): "
            f"{', '.join(subfolders.values())}",
            causes=["merged/ of another teacher's run", "an interrupted copy of the folder"],
            fixes=["pass the merged/ folder (or the lora/ folder) of a LoRA run on this teacher"],
            stage=Stage.CONFIG,
        )
    experts = {
        which: load_student(folder / name, info, device, dtype, causal_name=which)
        for which, name in subfolders.items()
    }
    model = ExpertCopies(experts["high"], experts.get("low"), info.boundary_ratio)
    return model.requires_grad_(False).eval()


def is_merged_folder(folder: str | Path) -> bool:
    """Whether `folder` is a LoRA run's merged/ export: each expert with the adapters merged in, a
    standalone diffusers model in the teacher's own subfolders, no LoRA file and no config.json of
    its own, and the run's run_settings.json in it or beside it (a teacher's folder has the same
    subfolders, and is not a student)."""
    folder = Path(folder)
    return (
        (folder / MERGED_SUBFOLDERS["high"] / "config.json").is_file()
        and not (folder / "config.json").is_file()
        and not is_lora_folder(folder)
        and any((where / RUN_SETTINGS_FILE).is_file() for where in (folder, folder.parent))
    )


def lora_student(folder: str | Path, info: TeacherInfo) -> LoraFolder | None:
    """The checked adapters of a LoRA run's folder (lora/, lora_ema/ or lora/comfyui/), None for a full
    student: a damaged file, an edited adapter_config.json or another teacher's adapters are refused
    here, from the files' headers, before any weight loads."""
    if not is_lora_folder(folder):
        return None
    return lora_for_teacher(folder, "--student", info)


def load_lora_student(
    folder: str | Path,
    info: TeacherInfo,
    device: torch.device,
    dtype: torch.dtype,
    adapters: LoraFolder | None = None,
) -> tuple[Any, Any, Any]:
    """(student, teacher high, teacher low or None) for a LoRA run's folder: the teacher's experts loaded once,
    the folder's adapters on them; the teacher's views run them with the adapters off. `adapters`:
    the folder as `lora_student` checked it (checked here when not given). A causal LoRA student
    (causal_config.json in the folder) is causal again while its adapters run."""
    from distill.models.causal.experts import make_student_causal
    from distill.models.causal.layout import read_causal_config
    from distill.models.lora import STUDENT_ADAPTER, LoraExperts
    from distill.models.teacher import load_experts

    layout = read_causal_config(folder)  # before any weight loads: a damaged record fails fast
    found = adapters or lora_for_teacher(folder, "--student", info)
    states = found.states()
    # both experts, or the one transformer of TI2V-5B (low None)
    high, low = (None if e is None else e.to(device) for e in load_experts(info, dtype))
    experts = LoraExperts(high, low, found.shape, None, seed=0)
    try:
        experts.load(STUDENT_ADAPTER, states)
    except (ValueError, RuntimeError) as exc:
        raise DistillError(
            f"the LoRA adapters in {folder} do not fit this teacher's experts",
            str(exc),
            fixes=["pass the teacher the adapters were trained on (--teacher_path)"],
            stage=Stage.CONFIG,
        ) from None
    if layout is not None:
        make_student_causal(experts, layout.chunk_frames)
    student = experts.model(STUDENT_ADAPTER, info.boundary_ratio).requires_grad_(False)
    teacher_high, teacher_low = experts.teacher_views()
    return student, teacher_high, teacher_low


def load_any_student(folder: str | Path, info: TeacherInfo, device: torch.device, dtype: torch.dtype) -> Any:
    """The student of any exported folder, as it samples: a LoRA run's adapters on the teacher's
    experts, a LoRA run's merged experts routed by timestep, or one model; causal again where the
    folder records a chunk size."""
    if is_lora_folder(folder):  # the teacher's experts, causal while the student's adapters run
        return load_lora_student(folder, info, device, dtype)[0]
    if is_merged_folder(folder):  # the merged experts, each causal with its own KV cache
        return load_merged_student(folder, info, device, dtype)
    return load_student(folder, info, device, dtype)


def require_student_folder(folder: str | Path, teacher_only: bool = True, flag: str = "--student") -> Path:
    """`folder` if it holds an exported student (a config.json, or a LoRA run's adapters), else a
    report saying what it holds, naming `flag`.

    `teacher_only`: whether the command has --teacher_only to offer as a way out.
    """
    folder = Path(folder)
    if (folder / "config.json").is_file() or is_lora_folder(folder) or is_merged_folder(folder):
        return folder
    if folder.is_dir():
        found = ", ".join(sorted(p.name for p in folder.iterdir())) or "nothing"
        details = f"{folder} has no config.json; it holds: {found}"
    else:
        details = f"{folder} does not exist"
    # A run's --output_dir given for the folder the run exported into it: offer that folder.
    inside = [
        folder / name
        for name in ("student", "lora", "student_ema", "lora_ema")
        if (folder / name / "config.json").is_file() or is_lora_folder(folder / name)
    ]
    raise DistillError(
        f"{flag} {folder}: student folder not found",
        details,
        causes=["training has not finished (the student is exported at the end)", f"a typo in {flag}"],
        fixes=[
            *([f"pass {inside[0]}: the student the run in {folder} exported"] if inside else []),
            "pass the student/ (or student_ema/, or lora/ for a LoRA run) folder that train_distillation.py "
            "wrote into --output_dir",
            *(["or render the teacher alone with --teacher_only"] if teacher_only else []),
        ],
        stage=Stage.CONFIG,
    )


def student_limits(folder: str | Path, info: TeacherInfo) -> SizeLimits:
    """The student's size limits, from its config.json alone (nothing is loaded; a student of another
    Wan 2.2 model than the teacher is refused); a LoRA student has the teacher's experts' limits."""
    if is_lora_folder(folder):
        return SizeLimits.of(
            "student (LoRA on the teacher)", info.expert_config, info.path / "transformer" / "config.json"
        )
    if is_merged_folder(folder):
        config_file = Path(folder) / MERGED_SUBFOLDERS["high"] / "config.json"
        return SizeLimits.of("student (merged experts)", _read_config(config_file), config_file)
    config_file = require_student_folder(folder) / "config.json"
    config = _read_config(config_file)
    check_student_kind(config, info, config_file.parent)
    return SizeLimits.of("student", config, config_file)


def _read_config(config_file: Path) -> dict[str, Any]:
    try:
        config = json.loads(config_file.read_text())
    except (OSError, ValueError) as exc:
        raise DistillError(
            f"cannot read {config_file}",
            f"{type(exc).__name__}: {exc}",
            fixes=["export the student again (a finished training run writes it)"],
            stage=Stage.CONFIG,
        ) from None
    if not isinstance(config, dict):
        raise DistillError(
            f"{config_file} is not a JSON object",
            f"it holds: {str(config)[:200]}",
            fixes=["export the student again (a finished training run writes it)"],
            stage=Stage.CONFIG,
        )
    return config


def check_student_kind(config: dict[str, Any], info: TeacherInfo, folder: Path) -> None:
    """Refuse a full student of another Wan 2.2 model than the teacher (a text-to-video student with
    an image-to-video teacher, or the reverse), read from the channels of its config.json: the
    teacher's VAE, text encoder and pipeline would feed it another input than it was trained on."""
    theirs = config_kind(config)
    if theirs is None or theirs == info.kind:  # the channel checks name any other mismatch
        return
    in_channels, out_channels = channels_of(config)
    try:
        found = find_run_settings(folder)
    except DistillError:  # a damaged run_settings.json names no teacher; the refusal stands without it
        found = None
    recorded = found[0].teacher_path if found else None
    return_to = recorded if recorded and kind_at(recorded) in (theirs, None) else theirs.repo_id
    raise DistillError(
        f"--student {folder}: a {theirs.model} student ({theirs.task}) cannot sample with this "
        f"{info.kind.model} teacher ({info.kind.task})",
        f"{folder / 'config.json'}: in_channels = {in_channels}, out_channels = {out_channels}: "
        f"{described(theirs)}\n"
        f"this teacher: {info.path}: {described(info.kind)}"
        + (
            f"\nlatent channels differ: the student predicts {out_channels}, this teacher's VAE makes "
            f"{info.kind.out_channels} (no sampler can turn one into the other)"
            if out_channels != info.kind.out_channels
            else ""
        )
        + (f"\ndistilled from: {recorded} (as {found[1]} records)" if found and recorded else ""),
        causes=[
            f"--teacher_path names another model than the {theirs.model} teacher the student was distilled from"
        ],
        fixes=[
            f"pass the teacher it was distilled from: --teacher_path {return_to}",
            f"or pass a student distilled from {info.kind.model}: the student/ folder of a run on this teacher",
        ],
        stage=Stage.CONFIG,
    )


def teacher_limits(info: TeacherInfo) -> SizeLimits:
    return SizeLimits.of("teacher", info.expert_config, info.path / "transformer" / "config.json")


def trained_size_fix(found: tuple[RunSettings, Path] | None) -> list[str]:
    """The first fix of a size error: the size the student was trained at, when the run says so."""
    if found is None:
        return []
    settings, path = found
    return [
        f"sample at the size it was trained at: --height {settings.height} --width {settings.width} "
        f"--num_frames {settings.num_frames}, or leave the size flags out (they default to {path})"
    ]


def _as_list(value: Any) -> Sequence[Any]:
    return value if isinstance(value, list | tuple) else [value]
