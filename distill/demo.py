"""The end of `make demo`: the headline as a table in the terminal and as one picture, summary.png.

    python -m distill.demo outputs/demo/eval      # the folder (or eval.json) python -m distill.evaluate wrote

The table comes from that eval.json ("toy" and "cost"): the teacher at its full steps, the teacher
at the student's K steps and the student at K steps, each with its toy accuracy (all four
attributes right, on every toy prompt), diversity gap (0 = the world's own spread), transformer
forwards and seconds per sample.

summary.png (default: beside the eval folder; `--output`) shows the same three as rows, one column
per prompt (the first 8 of `--prompts`). Every row starts from the same noise (prompt i: seed + i,
the seed of the evaluation), so a column differs only by the model. Each row is labelled with its
model, steps, guidance, forwards and the accuracy from eval.json; each picture is framed green when
the toy scorer reads all four of its prompt's attributes in it, red when not.

It needs a toy teacher (a folder with toy_world.json): only the toy world can be scored by what
its pictures show.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from distill.config.settings import PROMPT_SUFFIXES
from distill.ops.command import Parser, PathAction, entry_point
from distill.ops.errors import DistillError, Stage, report
from distill.ops.paths import Kind, PathFlag, check_paths

REPO = Path(__file__).resolve().parents[1]
DEFAULT_PROMPTS = REPO / "data" / "toy_sample_prompts.txt"
PICTURES = 8


@dataclass(frozen=True)
class Row:
    """One model as the demo shows it: which one, how it samples and what it scored."""

    model: str  # "teacher" or "student"
    what: str  # its place in the comparison, for the table
    steps: int
    guidance: tuple[float, ...]  # (high-noise, low-noise) for the teacher, (1,) for the student
    accuracy: float
    diversity_gap: float | None
    forwards: float
    seconds: float

    @property
    def guidance_text(self) -> str:
        return " / ".join(f"{g:g}" for g in self.guidance)

    @property
    def label(self) -> str:
        return (
            f"{self.model}\n{self.steps} steps, guidance {self.guidance_text}\n"
            f"{self.forwards:.0f} forwards\naccuracy {self.accuracy:.2f}"
        )


def read_eval(path: str | Path) -> dict[str, Any]:
    """eval.json from its folder or its own path; refused without the toy world's scores."""
    path = Path(path)
    file = path / "eval.json" if path.is_dir() else path
    if not file.is_file():
        raise DistillError(
            f"no eval.json at {path}",
            fixes=[
                "run python -m distill.evaluate --student OUTPUT/student --prompts ... --output_dir DIR first"
            ],
            stage=Stage.CONFIG,
        )
    result = json.loads(file.read_text())
    if "toy" not in result:
        raise DistillError(
            f"{file} has no toy-world scores",
            "The summary scores pictures by what they show, which only the toy teacher's world allows.",
            fixes=["evaluate a student of the toy teacher (python download_wan.py --toy DIR)"],
            stage=Stage.CONFIG,
        )
    return result


def rows_of(result: dict[str, Any]) -> list[Row]:
    """Teacher at full steps, teacher at the student's steps (when fewer), student: from eval.json."""
    toy, cost = result["toy"], result["cost"]
    # eval.json keeps the teacher at the student's steps in "cost" only when the student has fewer.
    short_cost = cost.get("teacher_at_student_steps", cost["teacher"])
    entries = [
        ("teacher", "teacher, full steps", toy["teacher"], cost["teacher"]),
        ("teacher", "teacher at the student's steps", toy["teacher_at_student_steps"], short_cost),
        ("student", "student", toy["student"], cost["student"]),
    ]
    rows = [
        Row(
            model=model,
            what=what,
            steps=int(scores["steps"]),
            guidance=tuple(float(g) for g in scores["guidance_scale"]),
            accuracy=float(scores["accuracy"]),
            diversity_gap=scores["diversity_gap"],
            forwards=float(spent["forwards_per_sample"]),
            seconds=float(spent["seconds_per_sample"]),
        )
        for model, what, scores, spent in entries
    ]
    # A student at the teacher's own step count: the second row would repeat the first.
    return [rows[0], rows[2]] if rows[1].steps == rows[0].steps else rows


def format_table(rows: list[Row], prompts: int) -> str:
    """The terminal table and the sentence it adds up to."""
    header = ("", "steps", "guidance", "accuracy", "diversity gap", "forwards/sample", "s/sample")
    body = [
        (
            r.what,
            str(r.steps),
            r.guidance_text,
            f"{r.accuracy:.2f}",
            "-" if r.diversity_gap is None else f"{r.diversity_gap:.2f}",
            f"{r.forwards:.0f}",
            f"{r.seconds:.4f}",
        )
        for r in rows
    ]
    widths = [max(len(line[i]) for line in (header, *body)) for i in range(len(header))]

    def line(cells: tuple[str, ...]) -> str:
        return "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths)))

    teacher, student = rows[0], rows[-1]
    short = rows[1] if len(rows) == 3 else None
    verdict = (
        f"the student at {student.steps} steps: accuracy {student.accuracy:.2f}, the teacher "
        f"{teacher.accuracy:.2f} at {teacher.steps} steps"
        + (f" and {short.accuracy:.2f} at {short.steps}" if short else "")
        + f"; {teacher.forwards / student.forwards:.0f}x fewer transformer forwards than the teacher at "
        f"{teacher.steps} steps ({teacher.seconds / student.seconds:.1f}x less time)"
    )
    return "\n".join(
        [
            f"toy world, {prompts} prompts, one sample each (accuracy: all four attributes right, higher "
            "is better; diversity gap: 0 = the world's own spread, lower is better)",
            "",
            line(header),
            *(line(cells) for cells in body),
            "",
            verdict,
        ]
    )


def sample_rows(
    result: dict[str, Any], rows: list[Row], prompts: list[str], device: str = "auto"
) -> list[np.ndarray]:
    """Each row's pictures (N, H, W, 3) of `prompts`, prompt i from the noise of seed + i."""
    import torch

    from distill.models.pipelines import scheduler_from_config
    from distill.models.teacher import inspect_teacher
    from distill.sample.student_folder import load_student, pick_device
    from distill.toy.evaluation import load_experts, load_parts, sample_pictures

    torch_device = pick_device(device)
    info = inspect_teacher(result["teacher"])
    student = load_student(result["student"], info, torch_device, torch.float32)
    high, low = load_experts(info.path, torch_device)
    parts = load_parts(info.path, torch_device)
    settings = result["settings"]
    own = settings.get("student_scheduler")
    pictures = []
    for row in rows:
        if row.model == "teacher":
            models: dict[str, Any] = {
                "transformer": high,
                "transformer_2": low,
                "guidance_scale": row.guidance[0],
                "guidance_scale_2": row.guidance[-1],
            }
        else:  # a few-step student samples with the K-step scheduler its run exported
            models = {"transformer": student, "scheduler": scheduler_from_config(own) if own else None}
        pictures.append(
            sample_pictures(
                info.path, prompts, steps=row.steps, seed=int(settings["seed"]), parts=parts, **models
            )
        )
    return pictures


def all_right(picture: np.ndarray, prompt: str) -> bool:
    """Whether the toy scorer reads all four of the prompt's attributes in the picture."""
    from distill.toy.score import read
    from distill.toy.world import ATTRIBUTES, parse_prompt

    expected, seen = parse_prompt(prompt), read(picture).attributes
    return expected is not None and all(seen[name] == expected[name] for name in ATTRIBUTES)


def plot_summary(
    rows: list[Row], pictures: list[np.ndarray], prompts: list[str], seed: int, out_png: str | Path
) -> Path:
    """summary.png: one labelled row per model, one column per prompt, framed right (green) or wrong (red)."""
    from distill.sample.media import pyplot, save_figure

    plt = pyplot()
    fig, axes = plt.subplots(
        len(rows),
        len(prompts),
        figsize=(1.5 * len(prompts) + 2.0, 1.6 * len(rows) + 1.0),
        squeeze=False,
        gridspec_kw={"hspace": 0.1, "wspace": 0.1},
    )
    for r, (row, images) in enumerate(zip(rows, pictures)):
        for c, (image, prompt) in enumerate(zip(images, prompts)):
            ax = axes[r][c]
            ax.imshow(image, interpolation="nearest")
            ax.set_xticks([])
            ax.set_yticks([])
            colour = "tab:green" if all_right(image, prompt) else "tab:red"
            for spine in ax.spines.values():
                spine.set_edgecolor(colour)
                spine.set_linewidth(3)
            if r == 0:
                ax.set_title("\n".join(textwrap.wrap(prompt, 18)[:4]), fontsize=7)
            if c == 0:
                ax.set_ylabel(row.label, rotation=0, ha="right", va="center", fontsize=9, labelpad=10)
    last = len(prompts) - 1
    fig.suptitle(
        f"same prompts, same noise (prompt i: seed {seed} + i); accuracy: eval.json, every toy prompt\n"
        f"frame: green = all four attributes of the prompt right, red = not (prompts 0-{last})",
        fontsize=10,
        y=1.0,
        va="bottom",  # above the prompts over the first row; the saved picture grows to hold it
    )
    return save_figure(fig, out_png)


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(
        prog="python -m distill.demo",
        description="The demo's headline: a table from eval.json and summary.png (toy teacher only).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument(
        "eval",
        action=PathAction,
        kind=Kind.FILE_OR_FOLDER,
        must_exist=False,  # read_eval names a missing one, with the command that writes it
        help="The folder python -m distill.evaluate wrote (or its eval.json).",
    )
    parser.add_argument(
        "--prompts",
        default=str(DEFAULT_PROMPTS),
        action=PathAction,
        kind=Kind.FILE,
        suffixes=PROMPT_SUFFIXES,
        help=f"Toy prompts for the picture (the first {PICTURES}).",
    )
    parser.add_argument(
        "--output",
        action=PathAction,
        kind=Kind.OUTPUT_FILE,
        example="summary.png",
        help="The picture (default: summary.png beside the eval folder).",
    )
    parser.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N.")
    return parser


@entry_point
def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    try:
        from distill.data.prompts import read_prompts

        check_paths(  # before the models sample the picture
            [
                PathFlag("--prompts", args.prompts, Kind.FILE, suffixes=PROMPT_SUFFIXES),
                PathFlag("--output", args.output, Kind.OUTPUT_FILE, example="summary.png"),
            ]
        )
        result = read_eval(args.eval)
        rows = rows_of(result)
        prompts = read_prompts(args.prompts, "--prompts")[:PICTURES]
        folder = Path(args.eval) if Path(args.eval).is_dir() else Path(args.eval).parent
        out = Path(args.output) if args.output else folder.parent / "summary.png"
        pictures = sample_rows(result, rows, prompts, args.device)
        plot_summary(rows, pictures, prompts, int(result["settings"]["seed"]), out)
    except DistillError as error:
        return report(error)
    print(format_table(rows, int(result["toy"]["prompts"])))
    print(f"\npictures: {out} (then {folder / 'eval.png'})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
