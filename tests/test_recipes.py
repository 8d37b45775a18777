"""Every recipe in config/recipes/ is a config file the trainer reads, and what its header promises
holds: the command parses, the plan for the real teacher's sizes (A14B, TI2V-5B) fits the recipe's GPUs, the memory per GPU
and the GPU-hours the header states are the plan's (and docs/recipes.md's table says the same), the
runs this project ships stay within their compute budgets, and each recipe's stall_timeout is far
above the plan's longest stretch between two watchdog beats.

The teacher is described, not loaded: the expert's config (as in its transformer/config.json) is
enough for the plan, so the test needs no weights and no GPU."""

from __future__ import annotations

import dataclasses
import re
import shlex
from pathlib import Path

import pytest
import torch
import yaml
from conftest import A14B_EXPERT, REPO

from distill.config.cli import parse_config
from distill.models.student_config import load_student_config
from distill.models.teacher import TeacherInfo
from distill.models.teacher_kind import I2V_A14B, TI2V_5B
from distill.train.cost import STALL_MARGIN, RunCost, RunCounts, hours_text, run_cost
from distill.train.plan import GIB, HEADROOM, REFERENCE_GPU_BYTES, estimate, memory_plan, teacher_bytes

RECIPES = sorted((REPO / "config" / "recipes").glob("*.yaml"))
A14B = TeacherInfo(Path("models/Wan2.2-T2V-A14B-Diffusers"), 0.875, 3.0, A14B_EXPERT, 8, 4)
# The image-to-video teacher: the same experts with 36 input channels, its own boundary and shift.
I2V_EXPERT = {**A14B_EXPERT, "in_channels": 36, "out_channels": 16}
I2V = TeacherInfo(Path("models/Wan2.2-I2V-A14B-Diffusers"), 0.9, 5.0, I2V_EXPERT, 8, 4, kind=I2V_A14B)
# Wan-AI/Wan2.2-TI2V-5B-Diffusers transformer/config.json: one transformer of 30 layers, 24 heads x
# 128 = 3,072 wide, ffn 14,336, 48 latent channels in and out; no boundary, the Wan2.2 VAE's 16x
# spatial and 4x temporal compression, its scheduler's shift 5.
TI2V_EXPERT = {
    **A14B_EXPERT,
    "num_attention_heads": 24,
    "ffn_dim": 14336,
    "num_layers": 30,
    "in_channels": 48,
    "out_channels": 48,
}
TI2V = TeacherInfo(Path("models/Wan2.2-TI2V-5B-Diffusers"), None, 5.0, TI2V_EXPERT, 16, 4, kind=TI2V_5B)
TEACHERS = {"I2V-A14B": I2V, "TI2V-5B": TI2V, "T2V-A14B": A14B}
MEMORY = re.compile(
    r"Memory per GPU \(--dry_run plan, (\d+) ranks?, teacher (sharded|on the CPU|on the GPU)\): ([\d.]+) GiB"
)
HOURS = re.compile(r"GPU-hours \(--dry_run plan, H100 at MFU ([\d.]+)\): ([\d.]+)")
SPARE_720P = 0.10
PLACEMENT_WORDS = {"sharded": "shard", "on the CPU": "cpu", "on the GPU": "gpu"}
GPU_MEMORY = re.compile(r"^# GPU memory: (\d+) GB$", re.M)  # stated when it is not an 80 GB GPU
# The compute the shipped multi-GPU runs may take (the plan's own GPU-hours).
BUDGETS = {
    "a14b-1.3b-stage1-8x80gb": 80,
    "a14b-1.3b-stage2-dmd-8x80gb": 60,
    "a14b-lora-4step-8x80gb": 260,
    "ti2v-5b-lora-4step-8gpu": 80,
}


def test_there_are_720p_recipes_that_split_each_clip_where_it_would_not_fit():
    """720x1280x81 (75,600 tokens a clip): the A14B LoRA (T2V and I2V) and the student's two stages,
    each on 8 x 80 GB; the runs that do not fit whole use --sequence_parallel."""
    for name, degree in {
        "a14b-lora-4step-720p-8x80gb": 8,
        "i2v-a14b-lora-4step-720p-8x80gb": 8,
        "a14b-1.3b-stage1-720p-8x80gb": 1,
        "a14b-1.3b-stage2-dmd-720p-8x80gb": 4,
    }.items():
        world, cfg, need, cost, _ = planned(REPO / "config" / "recipes" / f"{name}.yaml")
        assert (world, cfg.height, cfg.width, cfg.num_frames, cfg.sequence_parallel) == (
            8,
            720,
            1280,
            81,
            degree,
        )
        # The global batch of the 480p recipes: 8 videos per update.
        assert cost.samples_per_update == 8
        if degree > 1:  # at --sequence_parallel 1 the same run would not fit
            whole = dataclasses.replace(cfg, sequence_parallel=1, gradient_accumulation_steps=1)
            info = I2V if "i2v" in name else A14B
            student = critic = (
                info.expert_config
                if cfg.student_lora_rank
                else load_student_config(REPO / cfg.student_config, info.expert_config)
            )
            alone = estimate(whole, info, student, torch.device("cpu"), cfg.teacher_placement, 8, critic, 8)
            assert alone.total > REFERENCE_GPU_BYTES * HEADROOM > need


def header(recipe: Path) -> str:
    """The comment block the file starts with."""
    lines = recipe.read_text().splitlines()
    return "\n".join(
        line for line in lines[: next(i for i, text in enumerate(lines) if not text.startswith("#"))]
    )


def command(recipe: Path) -> tuple[int, list[str]]:
    """The header's command: its world size (torchrun's --nproc_per_node, else 1) and the trainer's arguments."""
    line = next(text.lstrip("# ") for text in header(recipe).splitlines() if "train_distillation.py" in text)
    words = shlex.split(line)
    script = words.index("train_distillation.py")
    nproc = next((int(w.split("=")[1]) for w in words[:script] if w.startswith("--nproc_per_node=")), 1)
    return nproc, words[script + 1 :]


def planned(recipe: Path) -> tuple[int, object, float, RunCost, str]:
    """(world size, config, memory per GPU in bytes, the run's cost, the memory plan's text) of the
    recipe's command, as its --dry_run prints them."""
    world, argv = command(recipe)
    cfg = parse_config([*argv[:1], str(REPO / argv[1]), *argv[2:]])
    info = next(info for name, info in TEACHERS.items() if name in cfg.teacher_path)
    expert = info.expert_config
    if cfg.student_lora_rank:  # the student (and the critic) are the teacher's experts with adapters
        student = critic = expert
    else:
        student = load_student_config(REPO / cfg.student_config, expert)
        critic = None
        if cfg.trains_critic:
            critic = load_student_config(REPO / (cfg.critic_config or cfg.student_config), expert)
            assert cfg.student_init != "random"
    cpu, node = torch.device("cpu"), min(world, 8)
    need = estimate(cfg, info, student, cpu, cfg.teacher_placement, world, critic, node).total
    counts = RunCounts.from_config(cfg)
    experts = teacher_bytes(info, torch.bfloat16)[0]
    cost = run_cost(cfg, info, student, critic, counts, world, cfg.teacher_placement, experts)
    plan = memory_plan(cfg, info, student, cpu, world, node, critic_config=critic)
    return world, cfg, need, cost, plan


def test_there_are_recipes_for_both_stages_on_one_and_on_eight_gpus():
    names = {r.stem for r in RECIPES}
    assert {
        "a14b-1.3b-stage1-8x80gb",
        "a14b-1.3b-stage2-dmd-8x80gb",
        "a14b-1.3b-stage1-1x80gb",
        "a14b-1.3b-stage2-dmd-1x80gb",
        "ti2v-5b-lora-4step-1gpu",
        "ti2v-5b-lora-4step-8gpu",
        "ti2v-5b-1.3b-stage1-1gpu",
        "ti2v-5b-1.3b-stage2-dmd-1gpu",
    } <= names


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda r: r.stem)
def test_the_recipe_parses_fits_its_gpus_and_states_the_plans_memory_and_gpu_hours(recipe: Path):
    text = header(recipe)
    assert text.startswith("# ") and "Makes " in text, "the header says what the recipe makes"
    assert "download_wan.py --configs_only" in text, "the header says how to plan before the download"
    world, argv = command(recipe)
    assert argv[:2] == ["--config", f"config/recipes/{recipe.name}"], "the command runs this very file"
    # Also with the paths a user passes on top: flags win over the file.
    moved = parse_config(["--config", str(recipe), "--teacher_path", "/data/wan", "--output_dir", "/runs/x"])
    world, cfg, need, cost, plan = planned(recipe)
    assert (moved.teacher_path, moved.output_dir, moved.method) == ("/data/wan", "/runs/x", cfg.method)

    # The plan is the one --dry_run prints: placement named (auto would depend on the machine), bf16 teacher.
    assert cfg.teacher_placement in ("gpu", "cpu", "shard") and cfg.teacher_dtype == "bfloat16"
    # Several GPUs shard the teacher, except 720p stage 2, split into context groups of 4, which
    # streams it from host RAM: sharded, it would keep less than a tenth of the memory to spare.
    assert (cfg.teacher_placement == "shard") == (world > 1) or (
        cfg.teacher_placement == "cpu" and 1 < cfg.sequence_parallel < world
    )
    gpu = GPU_MEMORY.search(text)
    capacity = float(gpu[1]) * 1e9 if gpu else REFERENCE_GPU_BYTES
    usable = capacity * HEADROOM
    assert need <= usable, f"{recipe.name}: {need / GIB:.2f} GiB per GPU, {usable / GIB:.1f} usable"
    if "720p" in recipe.stem:  # the 720p recipes keep a tenth of the usable memory to spare
        assert need <= usable * (1 - SPARE_720P), f"{recipe.name}: {1 - need / usable:.1%} to spare"
    verdict = next(line for line in plan.splitlines() if line.startswith("fits "))
    assert f"{cfg.teacher_placement} {'yes' if not gpu else 'no'}" in verdict, plan  # the plan measures 80 GB

    stated = MEMORY.search(text)
    assert stated, (
        f"{recipe.name}: the header states 'Memory per GPU (--dry_run plan, N ranks, teacher ...): X GiB'"
    )
    ranks, where, gib = int(stated[1]), PLACEMENT_WORDS[stated[2]], float(stated[3])
    assert (ranks, where) == (world, cfg.teacher_placement)
    assert gib == round(need / GIB, 2), f"the plan says {need / GIB:.2f} GiB"

    hours = HOURS.search(text)
    assert hours, f"{recipe.name}: the header states 'GPU-hours (--dry_run plan, H100 at MFU M): H'"
    assert float(hours[1]) == cfg.mfu and hours[2] == hours_text(cost.gpu_hours()), (
        f"the plan says {hours_text(cost.gpu_hours())} GPU-hours at MFU {cfg.mfu}"
    )
    if recipe.stem in BUDGETS:
        assert cost.gpu_hours() <= BUDGETS[recipe.stem]


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda r: r.stem)
def test_the_watchdog_cannot_stop_a_healthy_step_of_the_recipe(recipe: Path):
    """The watchdog beats at least once per model forward and backward: the recipe's stall_timeout,
    set in the file itself, must outlast the plan's longest beat-free stretch many times over (a step
    that runs STALL_MARGIN times slower than planned is slow, not hung)."""
    settings = yaml.safe_load(recipe.read_text())
    assert "stall_timeout" in settings, f"{recipe.name} sets stall_timeout for its step time"
    _, cfg, _, cost, _ = planned(recipe)
    assert cfg.stall_timeout * 60 >= STALL_MARGIN * cost.beat_free_seconds, (
        f"{cost.beat_free_what}: {cost.beat_free_seconds:.1f} s; stall_timeout {cfg.stall_timeout} min"
    )
    assert cfg.stall_timeout < cfg.dist_timeout, "a hang is reported before a collective times out"


def test_the_recipes_page_shows_each_recipes_plan():
    """docs/recipes.md's table: the memory per GPU and the GPU-hours of every recipe, as planned."""
    page = (REPO / "docs" / "recipes.md").read_text()
    for recipe in RECIPES:
        _, _, need, cost, _ = planned(recipe)
        row = next(line for line in page.splitlines() if line.startswith(f"| [`{recipe.name}`]"))
        cells = [cell.strip() for cell in row.split("|")]
        assert f"{need / GIB:.2f} GiB" in cells and hours_text(cost.gpu_hours()) in cells, row
