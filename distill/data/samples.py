"""What one training sample is, for each kind of teacher: a prompt, and for image to video its image.

A sample's `key` names its clean latent in the cache and seeds the teacher's noise for it: the
prompt alone for text to video (so every cache built before image to video existed stays valid),
the prompt and the image's content for image to video (the same prompt with two images is two
samples; the same image under another name is the same one).

The prompts file must suit the teacher: an image-to-video teacher needs every prompt paired with an
image (distill/data/images.py says which formats pair them); a text-to-video teacher given images
is refused rather than left to ignore them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from distill.data.image_latents import image_key
from distill.data.images import PAIRED_SUFFIXES, ImagePrompt, decode_images, read_image_prompts
from distill.data.prompts import read_prompt_records
from distill.models.conditioning import condition_channels
from distill.models.teacher_kind import I2V_A14B, TeacherKind
from distill.ops.errors import DistillError, Stage


@dataclass(frozen=True)
class TrainingSample:
    """One prompt, and the image its video starts from when the teacher turns images into videos."""

    prompt: str
    image: ImagePrompt | None = None
    image_key: str | None = None
    """The hash of the image file's bytes (distill.data.image_latents.image_key): its latent's name."""

    @property
    def key(self) -> str:
        if self.image_key is None:
            return self.prompt
        return f"{self.prompt}\n[image {self.image_key}]"


def takes_images(kind: TeacherKind) -> bool:
    """Whether a teacher of `kind` is conditioned on an image in every sample."""
    return condition_channels(kind) > 0


def accepts_images(kind: TeacherKind) -> bool:
    """Whether a teacher of `kind` can start a video from an image: always (I2V-A14B) or in its image
    mode (TI2V-5B, whose stock pipelines include WanImageToVideoPipeline)."""
    return takes_images(kind) or I2V_A14B.pipeline_class in kind.pipeline_classes


def read_training_samples(
    path: str | Path,
    kind: TeacherKind,
    limit: int | None = None,
    flag: str = "--data_path",
    for_training: bool = True,
    decode: bool = False,
) -> list[TrainingSample]:
    """The first `limit` samples of a prompts file (or captioned-video folder) for a teacher of `kind`.

    A teacher with two modes (TI2V-5B) is distilled in the mode its data says: image to video when
    the file pairs images (then every line must), text to video when it pairs none."""
    if distils_images(kind, path, flag):
        pairs = read_image_prompts(path, flag)[:limit]
        if decode:  # in full, not only each header (distill.data.images.decode_images)
            decode_images(pairs, flag)
        return [TrainingSample(pair.prompt, pair, image_key(pair.image)) for pair in pairs]
    records = read_prompt_records(path, flag, images=False)
    images = [(record.line, record.fields.get("image")) for record in records]
    refuse_images(Path(path), kind, images, flag, for_training)
    return [TrainingSample(record.prompt) for record in records[:limit]]


def distils_images(kind: TeacherKind, data_path: str | Path, flag: str = "--data_path") -> bool:
    """Whether a run of a teacher of `kind` on `data_path` distils image to video: always for
    I2V-A14B, never for T2V-A14B, and for TI2V-5B when its data pairs the prompts with images (the
    one rule of a run's mode: training, its exports and its samples all ask here)."""
    return takes_images(kind) or (accepts_images(kind) and pairs_images(Path(data_path), flag))


def pairs_images(path: Path, flag: str) -> bool:
    """Whether a prompts file (or a captioned-video folder) gives its prompts images: all of them
    (True) or none (False); a file that mixes the two is refused, naming a line of each."""
    if path.is_dir():
        return True
    if path.suffix.lower() not in PAIRED_SUFFIXES:
        return False
    records = read_prompt_records(path, flag)
    paired = [record.line for record in records if _has_image(record.fields.get("image"))]
    unpaired = [record.line for record in records if not _has_image(record.fields.get("image"))]
    if not paired and any("image" in record.fields for record in records):
        # An image column that no record fills: it says images were meant, and the mode it leaves
        # (text to video) would only show in the run's last lines. Refused like a mixed file.
        raise DistillError(
            f"{flag} {path} has an 'image' field that none of its {len(records)} prompt(s) fills",
            "A run distils one mode of a text-or-image-to-video teacher, picked by the data: image "
            "to video when every prompt has its image, text to video when none has. A file with an "
            "empty image column would be distilled as text to video, which it may not mean.",
            fixes=[
                f"to distil text to video, remove the image field from {path} (or pass its prompts as a .txt)",
                f"or, to distil image to video, give every line its image (paths relative to {path.parent})",
            ],
            stage=Stage.DATA,
        )
    if paired and unpaired:
        raise DistillError(
            f"{flag} {path} gives {len(paired)} prompt(s) an image (line {paired[0]}) and "
            f"{len(unpaired)} none (line {unpaired[0]})",
            "A run distils one mode of a text-or-image-to-video teacher: image to video when every "
            "prompt has its image, text to video when none has.",
            fixes=[
                f"give line {unpaired[0]} and every other line without one an image, to distil image to video",
                "or distil text to video from a file without images (a .txt of prompts), in a run of its own",
            ],
            stage=Stage.DATA,
        )
    return bool(paired)


def _has_image(value: object) -> bool:
    return isinstance(value, str) and bool(value.strip())


def read_text_prompts(
    path: str | Path, kind: TeacherKind, flag: str, data_path: str | Path | None
) -> list[str]:
    """The prompts of a file a text-to-video run samples beside its training data (--sample_prompts,
    --eval_prompts): a T2V-A14B run, or TI2V-5B distilled in text mode because `data_path` pairs no
    images. A file that pairs images is refused: the samples would ignore every image."""
    records = read_prompt_records(path, flag, images=False)
    images = [(record.line, record.fields.get("image")) for record in records]
    refuse_images(Path(path), kind, images, flag, data_path=data_path)
    return [record.prompt for record in records]


def refuse_images(
    path: Path,
    kind: TeacherKind,
    images: Sequence[tuple[int, object]],
    flag: str,
    for_training: bool = True,
    data_path: str | Path | None = None,
) -> None:
    """A text-to-video run given prompts paired with images: say so, rather than drop the images.
    The fixes are the command's own: training names the image-to-video teacher; the commands that
    sample (`for_training` False) name their --student, whose run decides the teacher. `data_path`:
    the run's training data, when `path` is another prompts file of the run (its samples' prompts),
    whose images a text-mode run of a two-mode teacher ignores too."""
    paired = [(line, value) for line, value in images if _has_image(value)]
    if not paired:
        return
    line, value = paired[0]
    found = (
        f"{flag} {path} pairs prompts with images ({len(paired)} record(s); "
        f"{'first' if path.is_dir() else f'line {line}'}: {value!r})"
    )
    if data_path is not None:
        mode = (
            f"this run distils {kind.model} in text mode: its --data_path {data_path} pairs no images"
            if accepts_images(kind)
            else f"the teacher is {kind.model}, which generates from text only"
        )
        raise DistillError(
            f"{found}, but {mode}",
            "The samples would ignore every image: each would be rendered from its prompt alone.",
            fixes=[
                f"pass a {flag} without images (a .txt of prompts, or {path} without its image field)",
                f"to sample from images, distil image to video: pair every prompt of --data_path with its "
                f"image, with {kind.model if accepts_images(kind) else I2V_A14B.model} as the teacher",
            ],
            stage=Stage.CONFIG,
        )
    text_only = f"pass the prompts without their images: a .txt file, one prompt per line, as {flag}"
    without_images = (
        "a .txt file of the captions (one a line)"
        if path.is_dir()
        else f"a prompts file without the image column (or drop it from {path})"
    )
    if for_training:
        details = (
            "Training would ignore every image: the student would not learn to start its videos from them."
        )
        fixes = [
            f"to distil image to video, pass the {I2V_A14B.model} teacher with --teacher_path "
            f"({I2V_A14B.download_command()})",
            f"to distil text to video, pass {without_images}",
        ]
    else:
        details = (
            "Every image would be ignored: neither that teacher nor a student distilled from it starts a "
            "video from an image."
        )
        fixes = [
            text_only,
            f"to turn images into videos, pass --student <a student distilled from {I2V_A14B.model}> (its "
            "run_settings.json names that teacher)",
        ]
    raise DistillError(
        f"{found}, but the teacher is {kind.model}, which generates from text only",
        details,
        fixes=fixes,
        stage=Stage.DATA,
    )
