"""Checks a run makes before anything heavy loads (adapter ranks, the training size, settings the
teacher's kind has no use for), and what the teacher load is staggered by."""

from __future__ import annotations

import logging
import math
import os
from typing import Any

import torch

from distill.config.flag_rules import check_dependents, second_expert_guidance
from distill.config.settings import TrainConfig
from distill.models.teacher import TeacherInfo
from distill.ops.errors import DistillError, Stage

logger = logging.getLogger(__name__)


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
    if cfg.trains_critic and cfg.critic_adapter_rank:
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
    # The rule generate and evaluate apply too: any second scale the user gave, except 1 (no guidance).
    rule = second_expert_guidance("guidance_scale_2", info.kind.experts, info.kind.model, "--guidance_scale")
    check_dependents(cfg, cfg.given, [rule])
    if cfg.expert_phase != "both":
        raise DistillError(
            f"--expert_phase {cfg.expert_phase} sets which expert's adapters a LoRA phase trains, but "
            f"{info.kind.model} has one transformer: it would be ignored",
            f"{info.kind.model} runs its one transformer at every timestep, with --guidance_scale.",
            fixes=["drop --expert_phase"],
            stage=Stage.CONFIG,
        )


def check_causal_lora_method(cfg: TrainConfig, info: TeacherInfo) -> None:
    """Refuse ode_init for a causal LoRA student of a teacher with two experts: it puts each chunk at
    its own step of the grid in one forward, and the steps lie on both sides of the boundary, where
    a LoRA student is two experts (one forward runs one of them)."""
    if not (cfg.method == "ode_init" and cfg.student_lora_rank and cfg.student_chunk_frames):
        return
    if info.kind.experts == 1:
        return  # one transformer reads a timestep per token at every step
    raise DistillError(
        "--method ode_init cannot train a causal LoRA student of a teacher with two experts",
        f"ode_init puts each chunk of the clip at its own step in one forward. A LoRA student is "
        f"{info.kind.model}'s two experts, switched at timestep {info.boundary_ratio * 1000:g}, and one "
        "forward runs one expert: chunks on both sides of the boundary cannot share it.",
        fixes=[
            "train the causal LoRA student with --method self_forcing from the teacher's experts (each "
            "chunk's steps run as forwards of their own); docs/streaming.md",
            "or ode_init a separate causal student: drop --student_lora_rank and pass --student_config "
            "and --student_init teacher",
        ],
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


def check_sample_frames(cfg: TrainConfig, info: TeacherInfo, image: bool) -> None:
    """What the run's frame settings ask of its samples (`image`: they carry one), refused if they
    cannot give it: check_learned_frames, check_rollout_images."""
    check_learned_frames(cfg, info, image)
    check_rollout_images(cfg, info, image)


def check_learned_frames(cfg: TrainConfig, info: TeacherInfo, image: bool) -> None:
    """Refuse a frame count that leaves no latent frame to learn: in TI2V-5B's image mode latent
    frame 0 is the image itself, so a run of one latent frame (--num_frames 1) would train on a
    loss of 0 everywhere and export an untrained student."""
    from distill.models.conditioning import fixed_latent_frames

    fixed = fixed_latent_frames(info.kind, image)
    frames = info.latent_shape(cfg.height, cfg.width, cfg.num_frames)[1]
    if frames > fixed:
        return
    fewest = (fixed * info.vae_scale_temporal) + 1  # one latent frame after those the image fixes
    raise DistillError(
        f"--num_frames {cfg.num_frames} leaves nothing to learn: {info.kind.model} in image mode "
        "makes no frame of its own at that length",
        f"In image mode the image is latent frame 0, which the model never predicts (its tokens are at "
        f"timestep 0 and no loss counts them), and {cfg.num_frames} frame(s) make {frames} latent "
        f"frame(s) ({info.vae_scale_temporal} frames each after the first): every loss would be 0 "
        "and the exported student untrained.",
        fixes=[
            f"use --num_frames {fewest} (or more, 4k+1): the frames after the image are learned",
            "or, to distil single images, distil text to video: a --data_path without images (a .txt)",
        ],
        stage=Stage.CONFIG,
    )


def check_rollout_images(cfg: TrainConfig, info: TeacherInfo, image: bool) -> None:
    """Refuse a Self-Forcing rollout longer than the clip (--rollout_frames) for samples with an image:
    the image is the first chunk's, so a window judged past it would be judged by the teacher as a
    clip without its image (or with the wrong one)."""
    if not image or not cfg.longer_rollout:
        return
    raise DistillError(
        f"--rollout_frames {cfg.rollout_frames} cannot be combined with image-to-video samples",
        f"{info.kind.model} sees the image in a clip's first latent frame; a window of the longer "
        "rollout past it has no image the teacher could judge it against.",
        fixes=[
            "leave --rollout_frames out for image-to-video samples (the rollout is then the clip)",
            "or train the stream's length on a text-to-video teacher (a .txt --data_path)",
        ],
        stage=Stage.CONFIG,
    )


def check_pretrained_shape(
    loaded: Any, config: dict[str, Any], init: str, flag: str, name: str = "student"
) -> None:
    """Refuse a pretrained start (`flag` `init`) whose blocks are shaped unlike the `name` config."""
    shape_keys = ("num_layers", "num_attention_heads", "attention_head_dim", "ffn_dim")
    have = {k: loaded.get(k) for k in shape_keys}
    wanted = {k: config.get(k) for k in shape_keys}
    if have != wanted:
        raise DistillError(
            f"{flag} {init} has another shape than the {name} config",
            f"{init}: {have}\nconfig: {wanted}",
            fixes=[f"pass a {name} config matching {init}, or another {flag}"],
            stage=Stage.CONFIG,
        )


def check_causal_start(student_init: str, chunk_frames: int | None) -> None:
    """Refuse to train a causal student's export (its causal_config.json) as a bidirectional one:
    without --student_chunk_frames its chunk-by-chunk training would be silently undone. Another chunk
    size than the start's is allowed (it is a choice), and said."""
    from pathlib import Path

    from distill.models.causal.layout import read_causal_config

    if student_init in ("random", "teacher") or not Path(student_init).is_dir():
        return
    layout = read_causal_config(student_init)
    if layout is None:
        return
    if not chunk_frames:
        raise DistillError(
            f"--student_init {student_init} is a causal student (chunks of {layout.chunk_frames} latent "
            "frames); this run would train it bidirectionally",
            fixes=[f"add --student_chunk_frames {layout.chunk_frames} to keep training it causal"],
            stage=Stage.CONFIG,
        )
    if chunk_frames != layout.chunk_frames:
        logger.warning(
            "--student_init %s was trained with chunks of %d latent frames; this run uses %d",
            student_init,
            layout.chunk_frames,
            chunk_frames,
        )
