"""Training data for students of the toy image-to-video teacher: images and the prompts paired with them.

    python -m distill.toy.i2v_data --output outputs/toy-i2v-data --count 512 --seed 1

writes `images/00000.png`, ... and `prompts.jsonl`, one {"prompt": ..., "image": "images/00000.png"}
per line: the file `train_distillation.py --data_path` reads for an image-to-video teacher
(distill/data/images.py). Each image is frame 0 of a world clip, drawn as image_score draws its held-out
cases (`motion_prompts`); most prompts name only the motion ("the shape moving leftward fast", so
only the image can tell colour, shape, size, place and background), the rest (`--named_share`, 1 in
4 by default, as the teacher was trained) the world's full clip prompt of the same clip.

The world has 216 pictures, so a training set holds the same named attributes as the held-out cases;
what makes it held out is the unnamed variation (place inside the quadrant, size, hue, pace), drawn
from a seed of its own. The held-out seed (image_score.HELD_OUT_SEED) and the calibration's are
refused, so a student is never scored on the images it trained on.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import numpy as np

from distill.ops.command import Parser, PathAction, entry_point, integer, number
from distill.ops.errors import DistillError, Stage
from distill.ops.paths import Kind
from distill.ops.replace import build_beside, put_in_place
from distill.toy.image_score import CALIBRATION_SEED, HELD_OUT_SEED, motion_prompts
from distill.toy.world import CLIP_FRAMES

PROMPTS_FILE = "prompts.jsonl"
IMAGES = "images"
NAMED_SHARE = 0.25
"""Share of full clip prompts: the teacher's expert training used 64 named of 256 clips per step."""
DEFAULT_SEED = 1
RESERVED_SEEDS = {
    HELD_OUT_SEED: "image_score's held-out cases (what students and the teacher are scored on)",
    CALIBRATION_SEED: "image_score's calibration (the frame-0 threshold)",
}


def is_named(index: int, share: float) -> bool:
    """Whether case `index` gets its full clip prompt: `share` of the cases, spread evenly, so any
    run of cases holds about that share (and, with the motions cycling, every motion gets some)."""
    return int((index + 1) * share) > int(index * share)


def write_i2v_data(
    output: str | Path,
    count: int,
    seed: int = DEFAULT_SEED,
    named_share: float = NAMED_SHARE,
    size: int = 32,
    frames: int = CLIP_FRAMES,
    overwrite: bool = False,
) -> Path:
    """Write `count` (image, prompt) pairs into `output` (images/ and prompts.jsonl); returns the
    prompts file. Deterministic from `seed`; a seed of the held-out or calibration cases is refused.
    A folder holding anything but these very pairs is refused unless `overwrite`."""
    if seed in RESERVED_SEEDS:
        raise DistillError(
            f"--seed {seed} draws {RESERVED_SEEDS[seed]}",
            "A student trained on those images would be scored on its own training data.",
            fixes=[f"pass another --seed (default {DEFAULT_SEED})"],
            stage=Stage.ARGV,
        )
    if not 0.0 <= named_share <= 1.0:
        raise DistillError(
            f"--named_share must lie between 0 and 1, got {named_share}",
            stage=Stage.ARGV,
            fixes=["e.g. 0.25"],
        )
    folder = Path(output)
    # Built beside the folder and put in place under the one overwrite rule (distill/ops/replace.py):
    # a folder that already holds these very pairs is kept, anything else replaced only with
    # `overwrite` (an earlier data set's images would otherwise be rewritten in place, or outlive it).
    staging = build_beside(folder)
    try:
        _write_pairs(staging, count, seed, named_share, size, frames)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    put_in_place(
        staging,
        folder,
        flag="--output",
        holds=_holds(folder),
        writing=f"{count} pairs of seed {seed}",
        overwrite=overwrite,
    )
    return folder / PROMPTS_FILE


def _holds(folder: Path) -> str:
    """What a data folder holds, in words (for the refusal to replace it)."""
    if not (folder / PROMPTS_FILE).is_file():
        return "files of its own"
    images = sum(1 for _ in (folder / IMAGES).glob("*.png")) if (folder / IMAGES).is_dir() else 0
    return f"a data set ({PROMPTS_FILE} and {images} images)"


def _write_pairs(folder: Path, count: int, seed: int, named_share: float, size: int, frames: int) -> None:
    import imageio.v2 as imageio

    (folder / IMAGES).mkdir(parents=True, exist_ok=True)
    # The motion-only draw: the full prompt of each case is its scene's, same image, same clip.
    cases = motion_prompts(count, seed, size=size, frames=frames)
    lines = []
    for i, case in enumerate(cases):
        name = f"{IMAGES}/{i:05d}.png"
        imageio.imwrite(folder / name, (np.clip(case.image, 0.0, 1.0) * 255.0).round().astype(np.uint8))
        prompt = case.scene.prompt if is_named(i, named_share) else case.prompt
        lines.append(json.dumps({"prompt": prompt, "image": name}))
    (folder / PROMPTS_FILE).write_text("\n".join(lines) + "\n")


@entry_point
def main(argv: list[str] | None = None) -> int:
    parser = Parser(prog="python -m distill.toy.i2v_data", description=__doc__.split("\n\n")[0])
    parser.add_argument("--output", required=True, action=PathAction, kind=Kind.OUTPUT_FOLDER)
    parser.add_argument("--count", type=integer(1), default=512, help="image and prompt pairs (default 512)")
    parser.add_argument(
        "--seed", type=integer(0), default=DEFAULT_SEED, help=f"their seed (default {DEFAULT_SEED})"
    )
    parser.add_argument(
        "--named_share",
        type=number(0.0),
        default=NAMED_SHARE,
        help=f"share of full clip prompts; the rest name only the motion (default {NAMED_SHARE})",
    )
    parser.add_argument(
        "--overwrite",
        action="store_true",
        help="replace an --output folder that holds anything else (another data set, other files)",
    )
    args = parser.parse_args(argv)
    path = write_i2v_data(args.output, args.count, args.seed, args.named_share, overwrite=args.overwrite)
    print(f"wrote {args.count} image and prompt pairs: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
