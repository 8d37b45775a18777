"""Checks a run makes before anything heavy loads (adapter ranks, the training size), and what the
teacher load is staggered by."""

from __future__ import annotations

import os
from typing import Any

from distill.config.settings import TrainConfig
from distill.models.teacher import TeacherInfo
from distill.ops.errors import DistillError, Stage


def available_host_memory() -> int:
    """Free host RAM in bytes (what a new allocation can use without swapping)."""
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        return 1 << 62  # unknown: do not stagger


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
