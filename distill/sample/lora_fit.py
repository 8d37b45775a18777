"""Whether a checked LoRA folder fits a teacher's experts: the Wan 2.2 model they were trained on (the
layers of T2V-A14B and I2V-A14B adapters have the same shapes, so what the folder or its run recorded
tells them apart), then the shapes and blocks of its adapters against the teacher's, refused before any
weight is applied, naming the file, the key, both sizes and the teacher the adapters were trained on
(from the run's run_settings.json). Used by `--student_lora_init` (`lora_start`) and by generate /
evaluate (`lora_for_teacher`)."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from distill.models.lora import LoraShape, target_sizes
from distill.models.lora_folder import BLOCK_MODULES, EXPERT_FOLDERS, KIND_KEY, LoraFolder, check_lora_folder
from distill.models.student_kind import described, kind_named
from distill.models.teacher_kind import KINDS, TeacherKind, read_teacher_kind
from distill.ops.errors import DistillError, Stage
from distill.sample.run_settings import RUN_SETTINGS_FILE

logger = logging.getLogger(__name__)

# The run_settings.json key naming the stock pipeline a run's student samples with.
PIPELINE_KEY = "pipeline_class"


def lora_for_teacher(folder: str | Path, flag: str, teacher: Any) -> LoraFolder:
    """The LoRA folder `folder` (given as `flag`), checked whole and against `teacher` (a TeacherInfo)."""
    found = check_lora_folder(folder, flag)
    check_lora_kind(
        found,
        teacher,
        flag,
        [f"or pass adapters trained on {teacher.kind.model}: the lora/ folder of a LoRA run on this teacher"],
    )
    check_fits_teacher(found, teacher, flag)
    return found


def kind_at(teacher: str) -> TeacherKind | None:
    """The Wan 2.2 model of a recorded teacher: a folder by its own files, a hub id by its name; None
    when neither says (the folder is gone or damaged, an unknown name)."""
    path = Path(teacher).expanduser()
    if path.is_dir():
        try:
            reading = read_teacher_kind(path)
        except DistillError:  # files that disagree: that folder is no witness
            return None
        return reading.kind if reading else None
    return kind_named(teacher)


def recorded_kind(found: LoraFolder) -> tuple[TeacherKind, str] | None:
    """The Wan 2.2 model the adapters were trained on and where that is recorded: the folder's own
    record (KIND_KEY), else its run's run_settings.json: a KIND_KEY there, the teacher folder it names
    (read by its files), the hub id it names, or the stock pipeline its student samples with when
    written (text-to-video runs leave `pipeline_class` out, and so did image-to-video runs before it
    existed: its absence proves nothing). None when nothing says."""
    if found.recorded_kind is not None:
        kind = kind_named(found.recorded_kind[0])
        if kind is not None:
            return kind, found.recorded_kind[1]
    for path, settings in _run_settings(found.path):
        for key in (KIND_KEY, "teacher_path", "base_model", PIPELINE_KEY):
            value = settings.get(key)
            if not isinstance(value, str) or not value:
                continue
            if key == PIPELINE_KEY:  # the model with this pipeline and as many experts as the folder
                experts = len(found.experts)
                kind = next((k for k in KINDS if k.experts == experts and k.pipeline_class == value), None)
            else:
                kind = kind_at(value) if key == "teacher_path" else kind_named(value)
            if kind is not None:
                read = " (read from that teacher's files)" if Path(value).expanduser().is_dir() else ""
                return kind, f"{path}: {key} = {value}{read}"
    return None


def check_lora_kind(found: LoraFolder, teacher: Any, flag: str, extra_fixes: Sequence[str] = ()) -> None:
    """Refuse adapters trained on another Wan 2.2 model than `teacher`'s (T2V-A14B adapters on an
    I2V-A14B teacher, or the reverse): their shapes fit, but they learned another input."""
    recorded = recorded_kind(found)
    if recorded is None:
        logger.warning(
            "%s %s: nothing records which Wan 2.2 model these adapters were trained on (no %s, no "
            "%s naming a teacher that can still be read); their shapes fit %s: make sure they were "
            "trained on it",
            flag,
            found.path,
            KIND_KEY,
            RUN_SETTINGS_FILE,
            teacher.kind.model,
        )
        return
    kind, where = recorded
    if kind == teacher.kind:
        return
    their_teacher = _recorded_teacher(found.path)
    back = their_teacher[0] if their_teacher and kind_at(their_teacher[0]) == kind else kind.repo_id
    raise DistillError(
        f"{flag} {found.path}: the LoRA adapters were trained on {kind.model} ({kind.task}); this teacher "
        f"is {teacher.kind.model} ({teacher.kind.task})",
        f"recorded: {where}\n"
        f"this teacher: {teacher.path}: {described(teacher.kind)}\n"
        f"The adapters' layers have the same shapes on both models' experts, but they learned "
        f"{kind.model}'s input ({kind.inputs}).",
        causes=[
            f"--teacher_path names another model than the {kind.model} teacher the adapters were trained on"
        ],
        fixes=[f"pass the teacher they were trained on: --teacher_path {back}", *extra_fixes],
        stage=Stage.CONFIG,  # the folder a flag names: refused as a config mistake, before any work
    )


def check_fits_teacher(found: LoraFolder, teacher: Any, flag: str, extra_fixes: Sequence[str] = ()) -> None:
    """Refuse adapters whose shapes or blocks are not those of `teacher`'s experts, before any weight
    is applied, naming the file, the key, both shapes and the teacher they were trained on; first,
    adapters for two experts on a teacher with one transformer, or the reverse."""
    check_expert_count(found, teacher, flag, extra_fixes)
    for which in found.experts:
        config = _expert_config(teacher, which)
        sizes = target_sizes(config)
        layers = int(config["num_layers"])
        blocks = {int(k.split(".")[1]) for k in found.shapes[which]}
        wrong = None
        for key, shape in sorted(found.shapes[which].items(), key=lambda item: _block_order(item[0])):
            module, kind = key.rsplit(".", 2)[:2]
            fan_in, fan_out = sizes[BLOCK_MODULES[module.split(".", 2)[2]]]
            want = (found.shape.rank, fan_in) if kind == "lora_A" else (fan_out, found.shape.rank)
            if tuple(shape) != want:
                wrong = f"{found.keys[which][key]} is {list(shape)}; {EXPERT_FOLDERS[which]}/ takes {list(want)} there"
                break
        if wrong is None and blocks != set(range(layers)):
            wrong = f"the adapters cover blocks {_span(blocks)}; {EXPERT_FOLDERS[which]}/ has blocks {_span(set(range(layers)))}"
        if wrong is None:
            continue
        recorded = _recorded_teacher(found.path)
        width = config["num_attention_heads"] * config["attention_head_dim"]
        theirs = _their_size(found.shapes[which])
        details = [
            f"{found.file(which)}: {wrong}",
            f"made for experts {theirs}; this teacher's {EXPERT_FOLDERS[which]}/ is {width} wide "
            f"(feed-forward {config['ffn_dim']}), {layers} blocks",
            f"this teacher: {teacher.path}",
        ]
        if recorded:
            details.append(f"trained on: {recorded[0]} (as {recorded[1]} records)")
            if Path(recorded[0]).expanduser().resolve() == Path(teacher.path).resolve():
                details.append("the same folder: it holds another teacher now than when they were trained")
                recorded = None  # no folder to offer: the one recorded changed
        raise DistillError(
            f"{flag} {found.path}: the LoRA adapters do not fit this teacher's experts: they were made for another teacher",
            "\n".join(details),
            fixes=[
                f"pass the teacher they were trained on: --teacher_path {recorded[0] if recorded else 'TEACHER'}",
                *extra_fixes,
            ],
            stage=Stage.CONFIG,  # the folder a flag names: refused as a config mistake, before any work
        )


def check_expert_count(found: LoraFolder, teacher: Any, flag: str, extra_fixes: Sequence[str] = ()) -> None:
    """Refuse a folder with adapters for another number of experts than `teacher` has (A14B: two,
    TI2V-5B: one transformer): one file set would be left without an expert, or an expert without
    its adapters."""
    theirs, ours = len(found.experts), len(teacher.expert_folders)
    if theirs == ours:
        return
    files = ", ".join(found.file(which).name for which in found.experts)
    recorded = _recorded_teacher(found.path)

    def experts(count: int) -> str:
        return "two experts (transformer, transformer_2)" if count == 2 else "one transformer"

    raise DistillError(
        f"{flag} {found.path}: the LoRA adapters are for {experts(theirs)}; this teacher has {experts(ours)}",
        f"{found.path}: {files}\nthis teacher: {teacher.path}: {teacher.kind.model}, {experts(ours)}"
        + (f"\ntrained on: {recorded[0]} (as {recorded[1]} records)" if recorded else ""),
        causes=["the adapters were trained on another Wan 2.2 model (A14B: two experts; TI2V-5B: one)"],
        fixes=[
            f"pass the teacher they were trained on: --teacher_path {recorded[0] if recorded else 'TEACHER'}",
            *extra_fixes,
        ],
        stage=Stage.CONFIG,  # the folder a flag names: refused as a config mistake, before any work
    )


def _expert_config(teacher: Any, which: str) -> dict[str, Any]:
    if which == "high":
        return dict(teacher.expert_config)
    # The low-noise expert may be deeper than the high-noise one (the toy teacher's is).
    path = Path(teacher.path) / EXPERT_FOLDERS[which] / "config.json"
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return dict(teacher.expert_config)  # inspect_teacher checked it; a race is not this check's to judge


def _block_order(key: str) -> tuple[int, str]:
    return int(key.split(".")[1]), key


def _span(blocks: set[int]) -> str:
    if not blocks:
        return "none"
    ordered = sorted(blocks)
    contiguous = ordered == list(range(ordered[0], ordered[-1] + 1))
    return f"{ordered[0]}-{ordered[-1]}" if contiguous else ", ".join(map(str, ordered[:8]))


def _their_size(shapes: Mapping[str, tuple[int, ...]]) -> str:
    """What the adapters' shapes say of the experts they were made for."""
    width = ffn = None
    for key, shape in shapes.items():
        module, kind = key.rsplit(".", 2)[:2]
        target = BLOCK_MODULES[module.split(".", 2)[2]]
        fan_in, fan_out = (shape[1], None) if kind == "lora_A" else (None, shape[0])
        if target.startswith("to_"):  # width -> width
            width = fan_in or fan_out
        elif target == "ffn.net.0.proj":  # width -> feed-forward
            width, ffn = fan_in or width, fan_out or ffn
        else:  # ffn.net.2: feed-forward -> width
            ffn, width = fan_in or ffn, fan_out or width
    blocks = len({key.split(".")[1] for key in shapes})
    size = " ".join(
        part for part in (f"{width} wide" if width else "", f"(feed-forward {ffn})" if ffn else "") if part
    )
    return f"{size}, {blocks} blocks" if size else f"{blocks} blocks"


def _run_settings(folder: Path) -> Iterator[tuple[Path, dict[str, Any]]]:
    """The run_settings.json objects of the run that wrote `folder` (in the folder, beside it, or
    beside lora/ for lora/comfyui/), nearest first; unreadable ones are skipped."""
    for path in (
        folder / RUN_SETTINGS_FILE,
        folder.parent / RUN_SETTINGS_FILE,
        folder.parent.parent / RUN_SETTINGS_FILE,
    ):
        try:
            settings = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if isinstance(settings, dict):
            yield path, settings


def _recorded_teacher(folder: Path) -> tuple[str, str] | None:
    """The teacher the run that wrote `folder` trained on, from its run_settings.json."""
    for path, settings in _run_settings(folder):
        teacher = settings.get("teacher_path")
        if isinstance(teacher, str) and teacher:
            return teacher, str(path)
    return None


def lora_start(folder: str | Path, shape: LoraShape, teacher: Any) -> LoraFolder:
    """The adapters of `folder` (--student_lora_init), checked, refused unless they have this run's
    shape and fit `teacher`'s experts; their weights are read later (`.states()`)."""
    flag = "--student_lora_init"
    found = check_lora_folder(folder, flag)
    if found.shape != shape:
        raise DistillError(
            f"{flag} {folder} has other adapters than this run asks for",
            f"there: rank {found.shape.rank}, alpha {found.shape.alpha:g}, targets {','.join(found.shape.targets)}\n"
            f"this run: rank {shape.rank}, alpha {shape.alpha:g}, targets {','.join(shape.targets)}",
            fixes=[
                "use the same --student_lora_rank, --student_lora_alpha and --student_lora_targets as that run"
            ],
            stage=Stage.CONFIG,
        )
    fresh = [f"or start fresh adapters on this teacher: drop {flag}"]
    check_lora_kind(found, teacher, flag, fresh)
    check_fits_teacher(found, teacher, flag, fresh)
    return found
