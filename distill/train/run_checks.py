"""Checks a run makes before anything heavy loads (adapter ranks, the training size, settings the
teacher's kind has no use for), and what the teacher load is staggered by."""

from __future__ import annotations

import math
import os
from typing import Any

import torch

from distill.config.settings import TrainConfig
from distill.models.teacher import TeacherInfo
from distill.ops.errors import DistillError, Stage


def available_host_memory() -> int:
    """Free host RAM in bytes (what a new allocation can use without swapping)."""
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        return 1 << 62  # unknown: do not stagger


def teacher_load_waves(cfg: TrainConfig, info: TeacherInfo, dtype: torch.dtype) -> int:
    """How many groups of this node's ranks load the teacher one after the other.

    Each rank reads the experts into host RAM before moving them to its GPU. Eight ranks doing that
    at once with 28 GB experts is how nodes get SIGKILLed by the OOM killer without a word, so
    ranks load in waves sized to the free host memory (--teacher_load_concurrency overrides).
    """
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    if cfg.teacher_load_concurrency:
        per_wave = cfg.teacher_load_concurrency
    else:
        bytes_per_rank = info.expert_bytes(dtype)
        per_wave = max(1, int(0.8 * available_host_memory() // max(bytes_per_rank, 1)))
    return math.ceil(local_world / min(per_wave, local_world))


def check_lora_ranks(cfg: TrainConfig, expert_config: dict[str, Any]) -> None:
    """Refuse an adapter rank above what the smallest targeted layer of the experts can hold."""
    width = expert_config["num_attention_heads"] * expert_config["attention_head_dim"]
    limit = min(width, expert_config["ffn_dim"])
    ranks = {"student_lora_rank": cfg.student_lora_rank}
    if cfg.method == "dmd" and cfg.critic_adapter_rank:
        ranks["critic_lora_rank"] = cfg.critic_adapter_rank
    for flag, rank in ranks.items():
        if rank > limit:
            raise DistillError(
                f"--{flag} {rank} is larger than the teacher's layers allow ({limit})",
                f"The experts are {width} wide (ffn {expert_config['ffn_dim']}): a rank above the smaller "
                "side of a layer adds parameters without adding anything a full update could not do.",
                fixes=[f"use --{flag} {min(64, limit)} (published Wan LoRAs use 64 or less)"],
                stage=Stage.CONFIG,
            )


def check_one_transformer_settings(cfg: TrainConfig, info: TeacherInfo) -> None:
    """Refuse settings of a second expert on a teacher with one transformer (TI2V-5B): they would
    be accepted and then do nothing. (`--student_init_expert` needs no check: both of its values
    name the one transformer, whose blocks a `--student_init teacher` start copies.)"""
    if info.kind.experts != 1:
        return
    default_low = TrainConfig.__dataclass_fields__["guidance_scale_2"].default
    # A low-noise scale of 1 or less (no guidance) is harmless: the check of the two scales asks for
    # it beside --guidance_scale 1, which knows no kind.
    guided_low = cfg.guidance_scale_2 > 1.0 and cfg.guidance_scale_2 != default_low
    settings = [
        ("guidance_scale_2", guided_low, "guidance of the low-noise expert"),
        ("expert_phase", cfg.expert_phase != "both", "which expert's adapters a LoRA phase trains"),
    ]
    for flag, given, what in settings:
        if given:
            raise DistillError(
                f"--{flag} {getattr(cfg, flag)} sets the {what}, but {info.kind.model} has one "
                "transformer: it would be ignored",
                f"{info.kind.model} runs its one transformer at every timestep, with --guidance_scale.",
                fixes=[f"drop --{flag}"],
                stage=Stage.CONFIG,
            )


def check_resolution(cfg: TrainConfig, info: TeacherInfo, student_config: dict[str, Any]) -> None:
    """Refuse a training size the teacher or the student cannot denoise (see check_sample_size)."""
    from distill.models.pipelines import SizeLimits, check_sample_size

    check_sample_size(
        cfg.height,
        cfg.width,
        cfg.num_frames,
        info.vae_scale_spatial,
        info.vae_scale_temporal,
        [
            SizeLimits.of("teacher", info.expert_config, info.path / "transformer" / "config.json"),
            SizeLimits.of(
                "student", student_config, cfg.student_config or info.path / "transformer" / "config.json"
            ),
        ],
    )
