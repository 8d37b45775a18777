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
from distill.data.images import PAIRED_SUFFIXES, ImagePrompt, read_image_prompts
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


def read_training_samples(
    path: str | Path, kind: TeacherKind, limit: int | None = None, flag: str = "--data_path"
) -> list[TrainingSample]:
    """The first `limit` samples of a prompts file (or captioned-video folder) for a teacher of `kind`."""
    if takes_images(kind):
        pairs = read_image_prompts(path, flag)[:limit]
        return [TrainingSample(pair.prompt, pair, image_key(pair.image)) for pair in pairs]
    records = read_prompt_records(path, flag)
    refuse_images(Path(path), kind, [(record.line, record.fields.get("image")) for record in records], flag)
    return [TrainingSample(record.prompt) for record in records[:limit]]


def refuse_images(path: Path, kind: TeacherKind, images: Sequence[tuple[int, object]], flag: str) -> None:
    """A text-to-video teacher given prompts paired with images: say so, rather than drop the images."""
    if path.suffix.lower() not in PAIRED_SUFFIXES:
        return
    paired = [(line, value) for line, value in images if isinstance(value, str) and value.strip()]
    if not paired:
        return
    line, value = paired[0]
    raise DistillError(
        f"{flag} {path} pairs prompts with images ({len(paired)} record(s); line {line}: {value!r}), "
        f"but the teacher is {kind.model}, which generates from text only",
        "Training would ignore every image: the student would not learn to start its videos from them.",
        fixes=[
            f"to distil image to video, pass the {I2V_A14B.model} teacher with --teacher_path "
            "(python download_wan.py --preset wan2.2-i2v-a14b)",
            f"to distil text to video, pass a prompts file without the image column (or drop it from {path})",
        ],
        stage=Stage.DATA,
    )
