"""When a run does not fit, the plan names the smallest --sequence_parallel degree that does
(distill/train/plan_parallel.py), one the trainer accepts, or says that none does. Planned for the real
A14B teacher's sizes from its expert config: no weights, no GPU."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import torch
from conftest import A14B_EXPERT, REPO

from distill.config.cli import parse_config
from distill.models.student_config import load_student_config
from distill.models.teacher import TeacherInfo
from distill.ops.distributed import DistContext
from distill.train.plan import HEADROOM, REFERENCE_GPU_BYTES, estimate
from distill.train.plan_parallel import at_degree, run_plan, smallest_fitting_degree, usable_degrees

A14B = TeacherInfo(Path("models/Wan2.2-T2V-A14B-Diffusers"), 0.875, 3.0, A14B_EXPERT, 8, 4)
CPU = torch.device("cpu")
USABLE = REFERENCE_GPU_BYTES * HEADROOM


def at_720p(recipe: str, *flags: str):
    return parse_config(
        [
            *("--config", str(REPO / "config" / "recipes" / recipe), "--height", "720", "--width", "1280"),
            *("--dry_run", "--plan_world_size", "8", *flags),  # planned for one node of 8 GPUs
        ]
    )


def test_a_720p_lora_run_that_does_not_fit_is_told_the_degree_that_does():
    cfg = at_720p("a14b-lora-4step-8x80gb.yaml", "--no-save_samples")
    assert (cfg.num_frames, cfg.teacher_placement, cfg.sequence_parallel) == (81, "shard", 1)
    alone = estimate(cfg, A14B, A14B_EXPERT, CPU, "shard", 8, A14B_EXPERT, 8).total
    assert alone > USABLE, "the 720p LoRA run does not fit at --sequence_parallel 1"

    # 40 heads, 75,600 tokens, 8 ranks on a node: 2, 4 and 8 split them, whatever the placement (a
    # group with no sample for a sharded expert joins the others' forwards on a placeholder).
    assert usable_degrees(cfg, A14B, A14B_EXPERT, A14B_EXPERT, 8, 8, "gpu") == [2, 4, 8]
    assert usable_degrees(cfg, A14B, A14B_EXPERT, A14B_EXPERT, 8, 8, "shard") == [2, 4, 8]
    fit = smallest_fitting_degree(
        cfg, A14B, A14B_EXPERT, A14B_EXPERT, CPU, 8, 8, "shard", REFERENCE_GPU_BYTES
    )
    assert fit.degree == 2 and fit.tried == (2,)
    # At that degree (and the accumulation that keeps the global batch of 8) the plan fits.
    planned = at_degree(cfg, fit.degree)
    assert (planned.sequence_parallel, planned.gradient_accumulation_steps) == (2, 2)
    need = estimate(planned, A14B, A14B_EXPERT, CPU, "shard", 8, A14B_EXPERT, 8).total
    assert need == fit.need <= USABLE < alone

    text = run_plan(cfg, A14B, A14B_EXPERT, A14B_EXPERT, CPU, DistContext(), ("shard", "as requested"))
    lines = text.splitlines()
    verdict = next(i for i, line in enumerate(lines) if line.startswith("fits "))
    assert "shard no" in lines[verdict]
    assert lines[verdict + 1].startswith(
        "  shard fits with --sequence_parallel 2 --gradient_accumulation_steps 2: "
    ), text
    assert "4 context groups of 2 ranks" in lines[verdict + 1]
    # With the all-to-all traffic the degree adds: what the plan of the run at that degree prints.
    hint = re.search(
        r"; all-to-all ([\d.]+ GB) sent per rank per step, ([\d.]+ s) at an assumed", lines[verdict + 1]
    )
    assert hint, lines[verdict + 1]
    at_two = run_plan(planned, A14B, A14B_EXPERT, A14B_EXPERT, CPU, DistContext(), ("shard", "as requested"))
    assert (
        f"  all-to-all (--sequence_parallel 2, Ulysses): {hint[1]} sent per rank per step: {hint[2]} at an assumed"
        in at_two
    )


def test_a_run_that_fits_gets_no_degree_and_one_that_no_degree_fits_is_told_so():
    cfg = at_720p("a14b-lora-4step-8x80gb.yaml", "--no-save_samples", "--sequence_parallel", "8")
    cfg = at_degree(cfg, 8)
    text = run_plan(cfg, A14B, A14B_EXPERT, A14B_EXPERT, CPU, DistContext(), ("shard", "as requested"))
    assert "shard yes" in text and "--sequence_parallel" not in text.split("fits ")[1].splitlines()[1]

    # The 1.3B student has 12 heads: 2 and 4 split them, 8 does not. Stage 2 at 720p with sharded
    # experts fits at 4; with a whole teacher on every GPU (53 GiB, and two trained 1.3B models with
    # AdamW and DDP buckets beside it) at no degree.
    student = load_student_config(REPO / "config" / "student_config.json", A14B_EXPERT)
    stage2 = at_720p("a14b-1.3b-stage2-dmd-8x80gb.yaml")
    assert usable_degrees(stage2, A14B, student, student, 8, 8, "gpu") == [2, 4]
    assert usable_degrees(stage2, A14B, student, student, 8, 8, "shard") == [2, 4]
    text = run_plan(stage2, A14B, student, student, CPU, DistContext(), ("shard", "as requested"))
    assert "shard no" in text and "  shard fits with --sequence_parallel 4 " in text
    whole = dataclasses.replace(stage2, teacher_placement="gpu")
    text = run_plan(whole, A14B, student, student, CPU, DistContext(), ("gpu", "as requested"))
    assert "  gpu does not fit at any --sequence_parallel degree this run can use (tried: 2, 4)" in text
    # Tokens a degree does not divide rule it out: 464x832x9 is 3 x 29 x 52 = 4,524 tokens.
    odd = parse_config(
        [
            "--config",
            str(REPO / "config/recipes/a14b-lora-4step-8x80gb.yaml"),
            "--height",
            "464",
            "--num_frames",
            "9",
        ]
    )
    assert usable_degrees(odd, A14B, A14B_EXPERT, A14B_EXPERT, 8, 8, "gpu") == [2, 4]


def test_a_causal_run_is_offered_only_the_degrees_that_split_one_chunk():
    """Self-Forcing streams a chunk a forward. At 464x848 a latent frame is 29 x 53 = 1,537 tokens, so a
    5-frame clip (2 latent frames) splits 2 ways as a chunk of 2 frames, and as chunks of 1 not at all."""
    student = load_student_config(REPO / "config" / "student_config.json", A14B_EXPERT)
    recipe = REPO / "config" / "recipes" / "a14b-1.3b-causal-self-forcing-8x80gb.yaml"

    def causal(chunk: int):
        sizes = ("--height", "464", "--width", "848", "--num_frames", "5")
        return parse_config(["--config", str(recipe), *sizes, "--student_chunk_frames", str(chunk)])

    assert usable_degrees(causal(2), A14B, student, student, 8, 8, "shard") == [2]
    assert usable_degrees(causal(1), A14B, student, student, 8, 8, "shard") == []
