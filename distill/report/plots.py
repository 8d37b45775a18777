"""The run's pictures: the loss curve (loss.png), the student-vs-teacher report (eval.png) and
its toy-world panel (the sample grid is distill.sample.media's). matplotlib with the Agg backend, so no display is needed.

    from distill.report.plots import plot_loss; plot_loss("outputs/run1/metrics.jsonl", "outputs/run1/loss.png")
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from distill.sample.media import pyplot, save_figure

# ---------------------------------------------------------------------------------------------
# loss.png
# ---------------------------------------------------------------------------------------------


def read_metrics(metrics_jsonl: str | Path) -> list[dict[str, float]]:
    """Rows of metrics.jsonl merged by step, later values winning.

    A resumed run logs again the steps after its checkpoint, and those later rows led to the
    current weights; rows of other kinds (e.g. eval scalars) at the same step add their keys.
    A line still being written (not yet valid JSON) is skipped.
    """
    path = Path(metrics_jsonl)
    if not path.is_file():
        return []
    by_step = {}
    for line in path.read_text().splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(row, dict) and "step" in row:
            by_step.setdefault(row["step"], {}).update(row)
    return [by_step[step] for step in sorted(by_step)]


# loss.png's margins (fractions of its 7 x 4.6 in): room for the log-scale tick labels and the axis
# labels on both sides (a clip run draws the motion ratio on a second axis at the right), and below
# the step axis for the legend: inside the axes it hid the start of the curves, which is where
# they are highest.
LOSS_MARGINS = {"left": 0.14, "right": 0.89, "bottom": 0.27, "top": 0.93}


def plot_loss(metrics_jsonl: str | Path, out_png: str | Path, experts: int = 2) -> Path | None:
    """loss.png: total loss and the loss of each expert's timestep range against the step (with
    `experts` 1, a teacher of one transformer, the total alone: its one range is all of it).

    Returns None (and writes nothing) when metrics.jsonl has no rows yet.
    """
    rows = read_metrics(metrics_jsonl)
    if not rows:
        return None
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.6))
    # Fixed margins that fit the labels, rather than a layout measured on an extra draw: the plot is
    # redrawn all through a run, and measuring its bounding box first doubled the cost of each draw.
    fig.subplots_adjust(**LOSS_MARGINS)
    series = (
        ("loss", "total", "black"),
        ("loss_high_noise", "high-noise range (transformer)", "tab:red"),
        ("loss_low_noise", "low-noise range (transformer_2)", "tab:blue"),
        ("critic_loss", "critic (dmd)", "tab:green"),
    )
    if experts == 1:
        series = tuple(entry for entry in series if not entry[0].startswith("loss_"))
    dmd = any(r.get("critic_loss") is not None for r in rows)
    drawn = False
    for key, label, color in series:
        points = [(r["step"], r[key]) for r in rows if r.get(key) is not None and r[key] > 0]
        if points:
            steps, values = zip(*points)
            ax.plot(steps, values, label=label, color=color, linewidth=1.5 if key == "loss" else 1.0)
            drawn = True
    if drawn:
        ax.set_yscale("log")
    else:  # every logged step was skipped (a non-finite loss is logged as null): say so, not a blank
        ax.text(0.5, 0.5, "no finite loss logged", ha="center", va="center", transform=ax.transAxes)
    ax.set_xlabel("step")
    # dmd: "total" is the generator's DMD loss (by t' range), the critic's is flow matching
    ax.set_ylabel("loss" if dmd else "MSE to the guided teacher velocity")
    ax.set_title("dmd losses: generator and critic" if dmd else "distillation loss")
    ax.grid(True, which="both", alpha=0.3)
    motion = [(r["step"], r["latent_motion_ratio"]) for r in rows if r.get("latent_motion_ratio") is not None]
    if motion:  # a clip run: slow motion shows as this falling below 1 before any sample is drawn
        steps, values = zip(*motion)
        twin = ax.twinx()
        twin.plot(
            steps, values, color="tab:purple", linestyle="--", linewidth=1.0, label="latent motion ratio"
        )
        twin.axhline(1.0, color="tab:purple", linestyle=":", linewidth=0.8)
        twin.set_ylabel("student / teacher frame-to-frame change", color="tab:purple")
        twin.set_ylim(0, max(1.5, max(values) * 1.1))
    lines = [line for axes in fig.axes for line in axes.get_lines() if not line.get_label().startswith("_")]
    if lines:  # one legend for both axes, below the step axis
        ax.legend(
            handles=lines, loc="upper center", bbox_to_anchor=(0.5, -0.13), ncol=2, fontsize=9, frameon=False
        )
    return save_figure(fig, out_png, tight=False)


# ---------------------------------------------------------------------------------------------
# eval.png
# ---------------------------------------------------------------------------------------------


def plot_eval(result: dict[str, Any], out_png: str | Path) -> Path:
    """eval.png from an eval.json dict: denoiser MSE per timestep bucket, sampler PSNR per prompt, cost."""
    plt = pyplot()
    toy = result.get("toy")
    ratios = [2, 1.4, 1] + ([1.6] if toy else [])
    fig, axes = plt.subplots(
        1, len(ratios), figsize=(5 * len(ratios), 4), gridspec_kw={"width_ratios": ratios}
    )
    cost = result["cost"]
    _plot_denoiser(axes[0], result["denoiser"], result.get("boundary_timestep"), _guidance(cost["teacher"]))
    _plot_sampler(axes[1], result["sampler"], f"{_who('student', cost)} vs {_who('teacher', cost)}")
    _plot_cost(axes[2], cost)
    if toy:
        plot_toy(axes[3], toy)
    step = result.get("step")
    fig.suptitle("student vs teacher" + (f" at step {step}" if step is not None else ""))
    fig.tight_layout()
    return save_figure(fig, out_png, tight=False)  # laid out already: no second measuring draw


def _guidance(entry: dict[str, Any]) -> str:
    """'4 / 3' for the teacher's two experts, '5' for one transformer, '1' for a student (older
    eval.json: unknown)."""
    scales = entry.get("guidance_scale")
    return " / ".join(f"{g:g}" for g in scales) if scales else "?"


def _who(name: str, cost: dict[str, Any], sep: str = ", ") -> str:
    """A model as every label names it: which one, its steps and its guidance."""
    entry = cost[name]
    model = "teacher" if name.startswith("teacher") else "student"
    return f"{model}{sep}{entry['steps']} steps{sep}guidance {_guidance(entry)}"


def _plot_denoiser(ax: Any, denoiser: dict[str, Any], boundary: float | None, guidance: str) -> None:
    buckets = [b for b in denoiser["buckets"] if b["count"]]
    centres = [(b["t_min"] + b["t_max"]) / 2 for b in buckets]
    widths = [0.8 * (b["t_max"] - b["t_min"]) for b in buckets]
    ax.bar(centres, [b["mse"] for b in buckets], width=widths, color="tab:purple")
    experts = denoiser["by_expert"]
    by_range = ""
    if boundary is not None:  # two experts; a one-transformer teacher (TI2V-5B) has no switch
        ax.axvline(
            boundary, color="gray", linestyle="--", linewidth=1, label=f"expert switch (t = {boundary:g})"
        )
        ax.legend(loc="lower left", fontsize=8)
        by_range = (
            f"high-noise {experts['high_noise']['mse']:.4g}, low-noise {experts['low_noise']['mse']:.4g}, "
        )
    ax.set_title(
        f"denoiser: student vs teacher at guidance {guidance}, same x_t\n"
        f"MSE (lower is better): {by_range}all {denoiser['mse']:.4g}",
        fontsize=10,
    )
    ax.set_xlabel("timestep t (1000 = pure noise)")
    ax.set_ylabel("MSE(student v, guided teacher v)")
    ax.set_xlim(0, 1000)


def _plot_sampler(ax: Any, sampler: dict[str, Any], who: str) -> None:
    rows = sampler["per_prompt"]
    positions = list(range(len(rows)))
    bars = ax.bar(positions, [r["frame_psnr_db"] for r in rows], color="tab:green")
    ax.set_xticks(positions, [str(r["index"]) for r in rows])
    for bar, row in zip(bars, rows):
        ax.annotate(
            f"latent MSE\n{row['latent_mse']:.3g}",
            (bar.get_x() + bar.get_width() / 2, bar.get_height()),
            ha="center",
            va="bottom",
            fontsize=7,
        )
    ax.set_ylim(0, max([r["frame_psnr_db"] for r in rows] + [1.0]) * 1.3)  # room for the labels
    ax.set_title(
        f"sampler PSNR, same noise (higher is better)\n{who}\nmean {sampler['frame_psnr_db']:.2f} dB, "
        f"latent MSE {sampler['latent_mse']:.4g}",
        fontsize=10,
    )
    ax.set_xlabel("prompt index")
    ax.set_ylabel("PSNR of decoded frames (dB)")


def _plot_cost(ax: Any, cost: dict[str, Any]) -> None:
    names = ("teacher", "student")
    seconds = [cost[n]["seconds_per_sample"] for n in names]
    bars = ax.bar([0, 1], seconds, color=["tab:gray", "tab:orange"])
    ax.set_xticks([0, 1], [_who(n, cost, "\n") for n in names], fontsize=8)
    for bar, name in zip(bars, names):
        ax.annotate(
            f"{cost[name]['forwards_per_sample']:.0f} forwards",
            (bar.get_x() + bar.get_width() / 2, bar.get_height()),
            ha="center",
            va="bottom",
            fontsize=8,
        )
    ax.set_title(
        f"cost per sample (speed-up: higher is better)\n{cost['speedup_seconds']:.2f}x time, "
        f"{cost['speedup_forwards']:.1f}x forwards",
        fontsize=10,
    )
    ax.set_ylabel("seconds per sample")


# ---------------------------------------------------------------------------------------------
# sample grid
# ---------------------------------------------------------------------------------------------


def plot_toy(ax: Any, toy: dict[str, Any]) -> None:
    """eval.png's toy panel: accuracy and diversity gap of teacher, teacher at the student's steps, student,
    and on clips their motion ratio (1 = the world's amount of motion, below = slow motion).

    Each bar says its model, steps and guidance: with a student at the teacher's own step count the
    first two are the same samples, and must not read like two different teachers."""
    names = ("teacher", "teacher_at_student_steps", "student")
    roles = ("full steps", "student's steps", "")
    labels = [_who(n, toy, "\n") + (f"\n({role})" if role else "") for n, role in zip(names, roles)]
    positions = np.arange(len(names))
    bars = {
        "accuracy (higher is better)": ("tab:blue", [toy[n]["accuracy"] for n in names]),
        # None: no shape found at all
        "diversity gap (lower is better)": ("tab:orange", [toy[n]["diversity_gap"] or 0.0 for n in names]),
    }
    clips = any("motion_ratio" in toy[n] for n in names)
    if clips:
        ratios = [toy[n].get("motion_ratio") or 0.0 for n in names]
        bars["motion ratio (1 = the world's motion)"] = ("tab:green", ratios)
        ax.axhline(1.0, color="tab:green", linestyle="--", linewidth=0.8)
    width = 0.8 / len(bars)
    for i, (label, (colour, values)) in enumerate(bars.items()):
        shift = (i - (len(bars) - 1) / 2) * width
        ax.bar(positions + shift, values, width=width, color=colour, label=label)
        for x, value in zip(positions, values):
            ax.text(x + shift, value, f"{value:.2f}", ha="center", va="bottom", fontsize=8)
    ax.axhline(toy["chance"]["all"], color="gray", linestyle=":", linewidth=1)
    ax.set_xticks(positions, labels, fontsize=8)
    tallest = max(max(values) for _, values in bars.values())
    ax.set_ylim(0, max(1.3, tallest * 1.15))  # room for the legend above the bars
    ax.legend(loc="upper right", fontsize=7)
    what = f"clips ({toy.get('num_frames')} frames)" if clips else "pictures"
    ax.set_title(f"toy world: what the {what} show ({toy['prompts']} prompts)", fontsize=10)
