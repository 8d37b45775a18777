"""What a causal student's training rollout holds in its KV cache, for the memory plan (distill/train/plan.py).

Self-Forcing makes the clip chunk by chunk on a KV cache of the chunks before (distill/models/causal);
the generator update keeps what its exit steps saw until its backward. Counted from the configs: the
cache is keys and values, sizes known exactly (tests/test_memory_plan.py holds the plan to the bytes a
real rollout's cache holds).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from distill.config.causal_rules import latent_frames
from distill.config.settings import TrainConfig
from distill.models.teacher import TeacherInfo


@dataclass(frozen=True)
class RolloutCache:
    """The KV cache of a self_forcing rollout, in bytes per rank: `live` at its fullest during a
    rollout, `kept` until the generator update's backward (what its exit steps saved)."""

    live: float = 0.0
    kept: float = 0.0


def rollout_cache(
    cfg: TrainConfig, info: TeacherInfo, student_config: dict[str, Any], teacher_dtype: torch.dtype
) -> RolloutCache:
    """What the KV cache of a causal student's training rollout holds (distill/models/causal/rollout.py).

    A chunk's keys and values: 2 x layers x width x its tokens, in the dtype the student attends in
    (16-bit under autocast, or a LoRA student's 16-bit experts), for this rank's share of the heads
    under sequence parallel, once per expert of a LoRA student (each keeps its own). The cache holds
    every chunk but the one being made (the window's chunks for a longer rollout). Until backward,
    the generator update keeps what its exit steps saw: with checkpointing each chunk's snapshot of
    the cache, which share the chunks' tensors (every chunk before the last judged one, once); without,
    the keys each exit step's attention saved (its prefix and itself, for every judged chunk)."""
    if cfg.method != "self_forcing" or not cfg.student_chunk_frames:
        return RolloutCache()
    config = info.expert_config if cfg.student_lora_rank else student_config
    width = int(config["num_attention_heads"]) * int(config["attention_head_dim"])
    sixteen_bit = cfg.mixed_precision != "no" or (
        cfg.student_lora_rank and teacher_dtype in (torch.bfloat16, torch.float16)
    )
    chunk = cfg.student_chunk_frames
    chunks = latent_frames(cfg.num_frames) // chunk  # the clip the teacher judges
    tokens = info.tokens(cfg.height, cfg.width, cfg.num_frames) // chunks  # a chunk's
    caches = info.kind.experts if cfg.student_lora_rank else 1
    per_chunk = 2.0 * int(config["num_layers"]) * width * (2 if sixteen_bit else 4) * tokens
    per_chunk *= cfg.batch_size * caches / cfg.sequence_parallel
    window = chunks - 1  # the clip's span: all but the chunk being made (generate --stream's default)
    if not cfg.longer_rollout:
        seen_by_judged = chunks - 1  # chunks 0 .. n-2
        saved = chunks * (chunks + 1) / 2  # chunk k's attention saves its k + 1 chunks' keys
    else:  # a window judged at the end of a longer stream: its chunks see `window` before them each
        seen_by_judged = window + chunks - 1
        saved = chunks * (window + 1)
    kept = seen_by_judged if cfg.gradient_checkpointing else saved
    return RolloutCache(live=window * per_chunk, kept=kept * per_chunk)
