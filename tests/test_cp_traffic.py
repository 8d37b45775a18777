"""The all-to-all bytes the plan gives under --sequence_parallel (distill/train/cp_traffic.py): a
hand-counted small model, nothing at degree 1, a whole step of a 720p velocity run counted by hand
from its forwards, and the line the dry-run plan of a 720p recipe prints. Configs only: no weights."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import A14B_EXPERT, REPO

from distill.config.cli import parse_config
from distill.models.student_config import load_student_config
from distill.models.teacher import TeacherInfo
from distill.ops.distributed import DistContext
from distill.train.cost import RunCounts, run_cost
from distill.train.cp_traffic import (
    ALL_TO_ALL_BYTES_PER_S,
    MovedBytes,
    StepTraffic,
    model_traffic,
    moved_bytes,
    step_traffic,
    traffic_lines,
)
from distill.train.plan_parallel import at_degree, run_plan

A14B = TeacherInfo(Path("models/Wan2.2-T2V-A14B-Diffusers"), 0.875, 3.0, A14B_EXPERT, 8, 4)
# 2 blocks of 4 heads x 8 = 32 wide; the output head is 4 channels x 1x2x2 patches = 16 values a token.
SMALL = {**A14B_EXPERT, "num_layers": 2, "num_attention_heads": 4, "attention_head_dim": 8, "out_channels": 4}
BF16 = MovedBytes(2, 2, 2, 2, 2)
AUTOCAST = MovedBytes(4, 4, 2, 2, 2)  # q and k after float32 rms_norm, v and the output in bf16


def test_a_small_model_sends_what_a_hand_count_gives():
    # 16 tokens over 2 ranks: each holds 8 tokens x 32 of q, k, v and the output, sends half of each.
    two = model_traffic(SMALL, 16, 2, BF16)
    blocks = 2 * (8 * 32 // 2) * 4 * 2  # layers x elements sent x 4 tensors x 2 bytes = 2048
    gather = 8 * 16 * 1 * 2  # its 8 tokens' outputs to the 1 other rank = 256
    assert (
        (two.forward, two.backward, two.recompute) == (blocks + gather, blocks, blocks) == (2304, 2048, 2048)
    )
    assert two.trained_step(checkpointing=True) == 2304 + 2048 + 2048
    assert two.trained_step(checkpointing=False) == 2304 + 2048

    # Over 4 ranks: 4 tokens each, three quarters sent; the gather goes to 3 others.
    four = model_traffic(SMALL, 16, 4, BF16)
    assert (four.forward, four.backward) == (2 * 4 * 32 * 3 / 4 * 8 + 4 * 16 * 3 * 2, 2 * 4 * 32 * 3 / 4 * 8)
    assert (four.forward, four.backward) == (1536 + 384, 1536)

    # Under autocast q and k move as float32: 12 bytes per element of the four instead of 8.
    assert model_traffic(SMALL, 16, 2, AUTOCAST).backward == 2 * (8 * 32 // 2) * 12 == 3072


def test_nothing_moves_without_sequence_parallel():
    assert model_traffic(A14B_EXPERT, 75_600, 1, BF16).trained_step(checkpointing=True) == 0.0
    cfg = parse_config(["--config", str(REPO / "config/recipes/a14b-1.3b-stage1-720p-8x80gb.yaml")])
    assert cfg.sequence_parallel == 1
    student = load_student_config(REPO / cfg.student_config, A14B_EXPERT)
    cost = run_cost(cfg, A14B, student, None, RunCounts(64, 64, 0, 0), 8)
    assert step_traffic(cfg, A14B, student, None, cost, torch.bfloat16).bytes == 0.0


def test_a_720p_velocity_step_sends_its_forwards_traffic():
    """Stage 1 at 720p split 2 ways: per sample, one unguided teacher forward (bf16) and the student's
    forward, backward and checkpointing recompute (autocast: q, k float32); 2 micro-steps per step."""
    cfg = at_degree(
        parse_config(["--config", str(REPO / "config/recipes/a14b-1.3b-stage1-720p-8x80gb.yaml")]), 2
    )
    assert (cfg.guidance_scale, cfg.gradient_checkpointing, cfg.mixed_precision) == (1.0, True, "bf16")
    assert (cfg.batch_size, cfg.gradient_accumulation_steps) == (1, 2)
    student = load_student_config(REPO / cfg.student_config, A14B_EXPERT)
    assert (student["num_layers"], student["num_attention_heads"] * student["attention_head_dim"]) == (
        30,
        1536,
    )
    held = 75_600 // 2  # 21 x 45 x 80 tokens, half on each rank
    teacher = 40 * held * 5120 * 0.5 * 8 + held * 64 * 2
    student_step = 3 * 30 * held * 1536 * 0.5 * 12 + held * 64 * 2
    cost = run_cost(cfg, A14B, student, None, RunCounts(64, 64, 0, 0), 8)
    assert moved_bytes(cfg, torch.bfloat16)["student"] == AUTOCAST
    traffic = step_traffic(cfg, A14B, student, None, cost, torch.bfloat16)
    assert traffic.bytes == 2 * (teacher + student_step)
    assert traffic.seconds == traffic.bytes / ALL_TO_ALL_BYTES_PER_S
    # The compute beside it is the plan's training FLOPs per GPU per step.
    assert traffic.compute_seconds * cost.steps * 8 == pytest.approx(cost.gpu_hours("training") * 3600)
    assert traffic.compute_seconds > 0


def test_the_dry_run_plan_of_a_split_720p_recipe_prints_the_traffic():
    cfg = parse_config(
        [
            *("--config", str(REPO / "config/recipes/a14b-lora-4step-720p-8x80gb.yaml")),
            *("--dry_run", "--plan_world_size", "8"),
        ]
    )
    assert cfg.sequence_parallel == 8
    text = run_plan(cfg, A14B, A14B_EXPERT, A14B_EXPERT, torch.device("cpu"), DistContext(), ("shard", "x"))
    line = next(line for line in text.splitlines() if "all-to-all" in line)
    assert line.startswith(
        "  all-to-all (--sequence_parallel 8, Ulysses): 1116.6 GB sent per rank per step: "
    ), line
    assert "5.0 s at an assumed 225 GB/s" in line and "against 137.6 s of compute per step (3.6%" in line, (
        line
    )


def test_the_docs_give_the_traffic_the_plan_gives_for_the_720p_recipes():
    """docs/recipes.md's 720p table and docs/multi-gpu.md quote the plan's all-to-all figures."""
    from test_recipes import TEACHERS, planned

    table = (REPO / "docs" / "recipes.md").read_text()
    guide = " ".join((REPO / "docs" / "multi-gpu.md").read_text().split())  # lines joined
    for recipe in sorted((REPO / "config" / "recipes").glob("*720p*.yaml")):
        _, cfg, _, cost, _ = planned(recipe)
        info = next(info for name, info in TEACHERS.items() if name in cfg.teacher_path)
        if cfg.student_lora_rank:
            student = critic = info.expert_config
        else:
            student = load_student_config(REPO / cfg.student_config, info.expert_config)
            critic = load_student_config(REPO / (cfg.critic_config or cfg.student_config), info.expert_config)
            critic = critic if cfg.trains_critic else None
        traffic = step_traffic(cfg, info, student, critic, cost, torch.bfloat16)
        row = next(line for line in table.splitlines() if line.startswith(f"| `{recipe.stem}` |"))
        cell = row.rstrip(" |").rsplit("|", 1)[1].strip()
        if cfg.sequence_parallel == 1:
            assert traffic.bytes == 0 and cell == "none", row
            continue
        figures = f"{traffic.bytes / 1e9:.1f} GB: {traffic.seconds:.1f} s of {traffic.compute_seconds:.1f} s"
        assert cell == figures, f"{recipe.stem}: the plan gives {figures}"
        if recipe.stem.startswith("a14b-"):  # the guide quotes the T2V ones
            assert f"{traffic.bytes / 1e9:.1f} GB" in guide and f"{traffic.compute_seconds:.1f} s" in guide


def test_a_toy_runs_traffic_reads_in_its_own_units():
    """A tiny model sends kilobytes in nanoseconds: the line says so rather than 0.0 GB in 0.0 s."""
    (line,) = traffic_lines(StepTraffic(bytes=2304.0, compute_seconds=0.02, degree=2))
    assert "2.3 kB sent per rank per step: 1e-08 s at an assumed 225 GB/s" in line, line
    assert "against 0.02 s of compute per step (0.0%" in line, line
    assert traffic_lines(StepTraffic(bytes=0.0, compute_seconds=1.0, degree=1)) == []
