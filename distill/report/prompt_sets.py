"""The prompts the monitor samples and reports on while training, and for an image-to-video teacher
the image each prompt's video starts from.

A text-to-video run reads a prompt file (default: the held-out data/sample_prompts.txt). An
image-to-video run (an I2V-A14B teacher, or TI2V-5B on data that pairs images) needs prompts paired
with images (`.jsonl` / `.csv` / `.tsv` with `prompt` and `image`, distill/data/images.py), which no
shipped file can hold for the user's data: the flag must name one, and a file without images is
refused naming it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from distill.data.images import ImagePreprocessor, read_image_prompts
from distill.data.samples import read_text_prompts, takes_images
from distill.models.teacher import TeacherInfo
from distill.ops.errors import DistillError, Stage
from distill.report.measures import TeacherReference

DEFAULT_SAMPLE_PROMPTS = Path(__file__).resolve().parents[2] / "data" / "sample_prompts.txt"


@dataclass(eq=False)  # compared by identity: the sample and eval sets may be one object
class PromptSet:
    prompts: list[str]
    conds: dict[int, torch.Tensor] = field(default_factory=dict)
    reference: TeacherReference | None = None
    # Image to video: prompt index -> its first frame, (1, 3, H, W) in [-1, 1] at the sample size.
    images: dict[int, torch.Tensor] | None = None


def read_prompt_set(
    path: str | Path | None,
    flag: str,
    info: TeacherInfo,
    height: int,
    width: int,
    image: bool | None = None,
    data_path: str | Path | None = None,
) -> PromptSet:
    """The prompts of `path` (None: the default held-out file) for `--flag`, with their images
    preprocessed as the stock pipeline does when the run turns images into videos. `image` is the
    run's mode (TI2V-5B: its data's); None: the teacher's own (image to video for I2V-A14B).
    A text-mode run refuses a file that pairs images (`data_path`, the run's data, says why it is
    in text mode)."""
    if image is None:
        image = takes_images(info.kind)
    if image:
        if path is None:
            who = (
                f"an image-to-video teacher ({info.kind.model})"
                if takes_images(info.kind)
                else f"an image-to-video run ({info.kind.model} in image mode: the run's --data_path pairs images)"
            )
            raise DistillError(
                f"--{flag}: {who} samples each prompt from its image, and the default sample prompts have none",
                fixes=[
                    f"pass --{flag} with held-out pairs: a .jsonl of "
                    '{"prompt": "...", "image": "images/0.png"} lines (paths relative to the file)'
                ],
                stage=Stage.CONFIG,
            )
        pairs = read_image_prompts(_found(Path(path), flag), f"--{flag}")
        preprocess = ImagePreprocessor(height, width, info.vae_scale_spatial, f"--{flag}")
        return PromptSet([p.prompt for p in pairs], images={i: preprocess(p) for i, p in enumerate(pairs)})
    found = _found(Path(path) if path else DEFAULT_SAMPLE_PROMPTS, flag)
    return PromptSet(read_text_prompts(found, info.kind, f"--{flag}", data_path))


def _found(path: Path, flag: str) -> Path:
    shipped = DEFAULT_SAMPLE_PROMPTS.parents[1] / path
    if not path.exists() and not path.is_absolute() and shipped.is_file():
        return shipped  # "data/sample_prompts.txt" also works when launched from another folder
    if not path.exists():
        raise DistillError(
            f"--{flag} {path}: file not found",
            fixes=[f"check the path, or leave --{flag} out to use {DEFAULT_SAMPLE_PROMPTS.name} (held out)"],
            stage=Stage.CONFIG,
        )
    return path
