"""Which Wan 2.2 model a teacher folder holds, read from its own files (JSON only: no torch here).

Wan 2.2 has three models, and every download says which one it is:
- diffusers layout: model_index.json (`_class_name`, `expand_timesteps`, whether it lists a
  `transformer_2`) and transformer/config.json (`in_channels`, `out_channels`);
- original Wan layout: the expert's config.json (`model_type`, `in_dim`), in high_noise_model/ for
  the two-expert models and at the top of the folder for TI2V-5B.
The kind is never taken from a flag: a flag can name the wrong model, the files cannot. Each kind
is plain data that loading, conditioning and the pipelines read; this version distils the two
A14B models (text to video, image to video), so `refuse_undistillable` turns the 5B into the
teacher-load banner before anything else is checked (a 5B folder is not "missing transformer_2/",
it is another model).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from distill.models.original.detect import looks_original
from distill.ops.errors import DistillError, Stage

INDEX = "model_index.json"
TRANSFORMER_CONFIG = "transformer/config.json"
# Where the original layout keeps its model's WanModel config: the high-noise expert of the A14B
# models, the one transformer of TI2V-5B.
ORIGINAL_CONFIGS = ("high_noise_model/config.json", "config.json")


@dataclass(frozen=True)
class TeacherKind:
    """One Wan 2.2 model: what the trainer, the conditioning and the pipelines need to know of it."""

    name: str
    """Short id: t2v-a14b, i2v-a14b, ti2v-5b."""
    model: str
    """The model's published name."""
    task: str
    """What it generates from: text to video, image to video, text or image to video."""
    repo_id: str
    """Its diffusers-layout repository on the Hugging Face hub."""
    pipeline_classes: tuple[str, ...]
    """Stock diffusers pipelines that load it; the first is the `_class_name` its repository saves."""
    experts: int
    """Transformers routed by timestep: 2 (transformer = high noise, transformer_2 = low noise) or 1."""
    in_channels: int
    """The transformer's input channels: the noisy latents, then whatever the condition adds."""
    out_channels: int
    """The transformer's output channels: the velocity of the noisy latents only."""
    per_token_timesteps: bool
    """model_index.json `expand_timesteps`: a timestep per latent token (the image's tokens at 0)."""
    boundary_ratio: float | None
    """Its published expert switch (t >= ratio * 1000 runs `transformer`); None with one transformer."""
    original_model_type: str
    """`model_type` in the original layout's config.json."""
    inputs: str
    """How its input channels are made up, in words (for messages)."""
    distillable: bool
    """Whether this version's teacher, students, methods and samplers handle it."""
    starting_points: tuple[str, ...] = ()
    """Published transformers a student of this kind can start from with --student_init (a
    text-to-video one's input is widened for an image-to-video teacher); none fits TI2V-5B's 48
    channels but the teacher's own blocks."""

    @property
    def pipeline_class(self) -> str:
        return self.pipeline_classes[0]

    @property
    def preset(self) -> str:
        """Its `download_wan.py --preset` name."""
        return self.model.lower()

    @property
    def short(self) -> str:
        """Its `download_wan.py --tiny_kind` / `--toy_kind` value: t2v, i2v, ti2v."""
        return self.name.split("-")[0]

    @property
    def default_folder(self) -> str:
        """Where `download_wan.py --preset` puts it without --local_dir."""
        return f"models/{self.repo_id.split('/')[1]}"

    def download_command(self, local_dir: str | Path | None = None, configs_only: bool = False) -> str:
        """The command that downloads (or resumes the download of) this model into `local_dir`: every
        fix that names a download is built here, so none names another model's preset."""
        folder = f" --local_dir {local_dir}" if local_dir is not None else ""
        return f"python download_wan.py --preset {self.preset}{folder}{' --configs_only' if configs_only else ''}"

    def tiny_command(self, folder: str | Path | None = None) -> str:
        """The command that writes a tiny random teacher of this model (no network)."""
        default = "outputs/tiny_teacher" if self == T2V_A14B else f"outputs/tiny_{self.short}_teacher"
        where = folder if folder is not None else default
        return f"python download_wan.py --tiny {where}" + (
            "" if self == T2V_A14B else f" --tiny_kind {self.short}"
        )


T2V_A14B = TeacherKind(
    name="t2v-a14b",
    model="Wan2.2-T2V-A14B",
    task="text to video",
    repo_id="Wan-AI/Wan2.2-T2V-A14B-Diffusers",
    pipeline_classes=("WanPipeline",),
    experts=2,
    in_channels=16,
    out_channels=16,
    per_token_timesteps=False,
    boundary_ratio=0.875,
    original_model_type="t2v",
    inputs="16 noisy latent channels",
    distillable=True,
    starting_points=("Wan-AI/Wan2.1-T2V-1.3B-Diffusers",),
)
I2V_A14B = TeacherKind(
    name="i2v-a14b",
    model="Wan2.2-I2V-A14B",
    task="image to video",
    repo_id="Wan-AI/Wan2.2-I2V-A14B-Diffusers",
    pipeline_classes=("WanImageToVideoPipeline",),
    experts=2,
    in_channels=36,
    out_channels=16,
    per_token_timesteps=False,
    boundary_ratio=0.9,
    original_model_type="i2v",
    inputs="16 noisy latent channels, a 4-channel first-frame mask and the image's 16-channel latent",
    distillable=True,
    # A text-to-video transformer starts it: its patch embedding is widened (models/student_kind.py).
    starting_points=("Wan-AI/Wan2.1-T2V-1.3B-Diffusers",),
)
TI2V_5B = TeacherKind(
    name="ti2v-5b",
    model="Wan2.2-TI2V-5B",
    task="text or image to video",
    repo_id="Wan-AI/Wan2.2-TI2V-5B-Diffusers",
    # Its repository saves WanPipeline; WanImageToVideoPipeline loads it for image input.
    pipeline_classes=("WanPipeline", "WanImageToVideoPipeline"),
    experts=1,
    in_channels=48,
    out_channels=48,
    per_token_timesteps=True,
    boundary_ratio=None,
    original_model_type="ti2v",
    inputs="48 latent channels of the Wan2.2 VAE, the first frame's tokens at timestep 0",
    distillable=True,
)
KINDS = (T2V_A14B, I2V_A14B, TI2V_5B)


@dataclass(frozen=True)
class KindReading:
    """A kind and the file keys it was read from ("model_index.json: _class_name = WanPipeline")."""

    kind: TeacherKind
    evidence: tuple[str, ...]
    experts: int | None = None
    """The transformers the files list (1 or 2), where they say: Wan2.1's one-transformer text-to-video
    models read as the text-to-video kind, and only this tells them from the A14B teacher."""


def read_teacher_kind(folder: str | Path) -> KindReading | None:
    """The kind of the teacher in `folder` (either layout), or None where its files do not say (no
    model_index.json or expert config, unreadable JSON, an unknown pipeline class): the layout
    checks that follow report those. Files that name two different kinds are refused here."""
    folder = Path(folder)
    if (folder / INDEX).is_file():
        return _read_diffusers(folder)
    if looks_original(folder):
        return _read_original(folder)
    return None


def student_starts(kind: TeacherKind, flag: str = "--student_init") -> list[str]:
    """The starting points a student of `kind` accepts, as fixes, the one that needs no download
    first: the teacher's own blocks, a student of a run on this model, then the published
    transformers that fit it (none fits TI2V-5B, so none is named for it)."""
    widened = " (its input is widened)" if kind.in_channels != kind.out_channels else ""
    return [
        f"start from this teacher's own blocks: {flag} teacher",
        f"or from a student of {kind.model}: {flag} <the student/ folder of a run on a {kind.model} teacher>",
        *(
            f"or from a published transformer that fits it: {flag} {repo}{widened}"
            for repo in kind.starting_points
        ),
    ]


def folder_kind(folder: str | Path) -> TeacherKind | None:
    """The kind `folder`'s files name, for advice: None where they name none or disagree (the
    reading that refuses those is `read_teacher_kind`)."""
    try:
        reading = read_teacher_kind(folder)
    except DistillError:
        return None
    return reading.kind if reading is not None else None


def resume_command(folder: str | Path, kind: TeacherKind | None = None) -> str:
    """The command that completes the download in `folder` with the model its files name (`kind`
    where the caller knows it): the download refuses a folder of another model, so a fix that names a
    download must name this one's preset. The text-to-video teacher where the files name none."""
    return (kind or folder_kind(folder) or T2V_A14B).download_command(folder)


def describe_folder(folder: str | Path) -> str:
    """What `folder` holds, in words, for a refusal to replace it."""
    folder = Path(folder)
    if folder.exists() and not folder.is_dir():
        return "a file"
    try:
        reading = read_teacher_kind(folder)
    except DistillError:
        return "a Wan teacher whose files disagree on the model"
    if reading is None:
        return "files of its own"
    one = reading.experts == 1 and reading.kind.experts == 2
    return (
        f"a {'one-transformer ' + reading.kind.task + ' model' if one else reading.kind.model + ' teacher'}"
    )


def refuse_undistillable(folder: str | Path, shown: str | None = None) -> KindReading | None:
    """`read_teacher_kind(folder)`, or the teacher-load banner for a kind this version cannot distil
    (naming the teacher as `shown`, e.g. the hub id whose snapshot `folder` is)."""
    reading = read_teacher_kind(folder)
    if reading is not None and not reading.kind.distillable:
        raise undistillable_error(shown or str(folder), reading)
    return reading


def undistillable_error(teacher: str, reading: KindReading) -> DistillError:
    kind = reading.kind
    distilled = [k for k in KINDS if k.distillable]
    names = " and ".join(f"{k.model} ({k.task})" for k in distilled)
    return DistillError(
        f"{teacher} holds the {kind.model} teacher ({kind.task}): this version distils {names} only",
        "Read from its files:\n"
        + "\n".join(f"- {line}" for line in reading.evidence)
        + f"\n{kind.model}: {'two experts' if kind.experts == 2 else 'one transformer'} taking "
        f"{kind.in_channels} input channels "
        f"({kind.inputs}); stock pipeline {' or '.join(kind.pipeline_classes)}.\n"
        "This version's teachers, students and samplers: "
        + "; ".join(f"{k.model}, {k.in_channels} input channels ({k.inputs})" for k in distilled)
        + ".",
        causes=[f"--teacher_path points at {kind.repo_id} (or a copy of it, in either layout)"],
        fixes=[
            f"point --teacher_path at {k.repo_id}: the hub id, or the folder `{k.download_command()}` "
            f"downloads it to ({k.default_folder})"
            for k in distilled
        ],
        stage=Stage.TEACHER_LOAD,
    )


# ---------------------------------------------------------------------------------------------
# Reading the files
# ---------------------------------------------------------------------------------------------


def _json_object(path: Path) -> dict[str, Any] | None:
    """The JSON object in `path`; None if it is missing or unreadable (the layout checks name that)."""
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return value if isinstance(value, dict) else None


def _count(value: Any) -> int | None:
    """A channel count as written, or None where it is not a whole number (the type checks name it)."""
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _listed(value: Any) -> bool:
    """Whether a model_index.json component entry names a class (`[null, null]` = left out)."""
    return isinstance(value, list) and any(part is not None for part in value)


def _disagreement(folder: Path, first: str, first_says: str, second: str, second_says: str) -> DistillError:
    return DistillError(
        f"the teacher's files disagree on which Wan 2.2 model it is: {first} against {second}",
        f"In {folder}:\n- {first}: {first_says}\n- {second}: {second_says}\n"
        "Known models: "
        + "; ".join(
            f"{k.model} ({' or '.join(k.pipeline_classes)}, in/out channels {k.in_channels}/{k.out_channels}"
            f"{', expand_timesteps true' if k.per_token_timesteps else ''})"
            for k in KINDS
        ),
        causes=[
            "a component folder or model_index.json was copied from another model",
            "a config was edited by hand",
        ],
        fixes=[
            f"download the teacher again into a new folder: python download_wan.py --local_dir "
            f"models/{T2V_A14B.repo_id.split('/')[1]}",
            f"python download_wan.py --verify {folder}",
        ],
        stage=Stage.TEACHER_LOAD,
    )


def _by_channels(channels: tuple[int | None, int | None]) -> TeacherKind | None:
    return next((k for k in KINDS if (k.in_channels, k.out_channels) == channels), None)


def _says(kind: TeacherKind | None) -> str:
    return f"that is {kind.model}" if kind else "no Wan 2.2 model has these"


def _read_diffusers(folder: Path) -> KindReading | None:
    index = _json_object(folder / INDEX)
    if index is None:
        return None
    class_name, expand = index.get("_class_name"), index.get("expand_timesteps")
    two = _listed(index.get("transformer_2"))
    # The kinds model_index.json allows: expand_timesteps true is TI2V-5B's alone; otherwise those
    # whose stock pipeline is `_class_name` (WanPipeline also loads TI2V-5B).
    if expand is True:
        key, value = "expand_timesteps", "true"
        candidates = [k for k in KINDS if k.per_token_timesteps]
        if two:
            raise _disagreement(
                folder,
                f"{INDEX} expand_timesteps",
                f"true: that is {TI2V_5B.model}, which has one transformer",
                f"{INDEX} transformer_2",
                f"{index.get('transformer_2')}: a second transformer",
            )
    else:
        key, value = "_class_name", str(class_name)
        candidates = [k for k in KINDS if class_name in k.pipeline_classes]
    config = _json_object(folder / TRANSFORMER_CONFIG)
    channels = (
        (_count(config.get("in_channels")), _count(config.get("out_channels"))) if config else (None, None)
    )
    channel_line = f"{TRANSFORMER_CONFIG}: in_channels = {channels[0]}, out_channels = {channels[1]}"
    by_channels = _by_channels(channels)
    if not candidates:  # an unknown pipeline class: the channels alone
        return KindReading(by_channels, (channel_line,), 2 if two else 1) if by_channels is not None else None
    if None in channels:  # a configs-only or damaged folder: the index alone decides
        # (the number of transformers it lists tells WanPipeline's two kinds apart)
        kind = next((k for k in candidates if k.experts == (2 if two else 1)), candidates[0])
    elif by_channels in candidates:
        kind = by_channels
    else:
        raise _disagreement(
            folder,
            f"{INDEX} {key}",
            f"{value}: that is "
            + " or ".join(
                f"{k.model} (in/out channels {k.in_channels}/{k.out_channels})" for k in candidates
            ),
            f"{TRANSFORMER_CONFIG} in_channels/out_channels",
            f"{channels[0]}/{channels[1]}: {_says(by_channels)}",
        )
    evidence = [f"{INDEX}: {key} = {value}"]
    if not two:
        evidence.append(
            f"{INDEX}: transformer_2 not listed (one transformer"
            + (f", where {kind.model} has two)" if kind.experts == 2 else ")")
        )
    if None not in channels:
        evidence.append(channel_line)
    return KindReading(kind, tuple(evidence), 2 if two else 1)


def _read_original(folder: Path) -> KindReading | None:
    for relative in ORIGINAL_CONFIGS:
        config = _json_object(folder / relative)
        if config is not None:
            break
    else:
        return None
    model_type = config.get("model_type", "t2v")  # WanModel's default when the key is left out
    kind = next((k for k in KINDS if k.original_model_type == model_type), None)
    if kind is None:  # s2v, animate, ...: the conversion names the model type it cannot take
        return None
    said = f"{relative}: model_type = {model_type}"
    experts = 2 if relative.startswith("high_noise_model/") else 1
    in_dim = _count(config.get("in_dim"))
    if in_dim is None:
        return KindReading(kind, (said,), experts)
    if in_dim != kind.in_channels:
        raise _disagreement(
            folder,
            f"{relative} model_type",
            f"{model_type}: that is {kind.model} ({kind.in_channels} input channels)",
            f"{relative} in_dim",
            f"{in_dim}: {_says(next((k for k in KINDS if k.in_channels == in_dim), None))}",
        )
    return KindReading(kind, (said, f"{relative}: in_dim = {in_dim}"), experts)
