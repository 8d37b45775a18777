"""The benchmark's presets and the A14B teacher shapes they use; `BenchSettings` is one resolved preset
with the command line's overrides.

The CPU presets (cpu-tiny, cpu-small) prove the bench runs. The GPU presets name what they time: the
1.3B student's distillation step on one-frame pictures (gpu-1.3b-pictures) and on the 81-frame clips
users train at 480x832 and 720x1280 (gpu-1.3b-480p-81, gpu-1.3b-720p-81); the A14B LoRA step, one whole
40-layer expert in bf16 with rank-64 adapters, checkpointed (gpu-a14b-lora-480p-81, -720p-81); the
teacher's guided forward alone, one whole expert on cond + uncond (gpu-teacher-480p-81, -720p-81); and
a 4-layer slice of a 14B-wide student (gpu-14b-slice)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]


LATENT_CHANNELS = 16


VAE_STRIDE_SPATIAL, VAE_STRIDE_TEMPORAL = 8, 4  # Wan VAE (Wan 2.1 / 2.2 A14B)


BOUNDARY_RATIO, FLOW_SHIFT = 0.875, 3.0  # Wan2.2-T2V-A14B model_index.json / scheduler


GUIDANCE_HIGH, GUIDANCE_LOW = 4.0, 3.0


PROMPT_TOKENS = 64  # unpadded length of each cached prompt embedding; padded to --text_len


# One expert of Wan2.2-T2V-A14B (transformer/config.json); presets cut num_layers.
A14B_EXPERT: dict[str, Any] = {
    "patch_size": [1, 2, 2],
    "num_attention_heads": 40,
    "attention_head_dim": 128,
    "in_channels": 16,
    "out_channels": 16,
    "text_dim": 4096,
    "freq_dim": 256,
    "ffn_dim": 13824,
    "num_layers": 40,
    "cross_attn_norm": True,
    "qk_norm": "rms_norm_across_heads",
    "eps": 1e-06,
    "rope_max_seq_len": 1024,
}


A14B_WIDTH_STUDENT = {k: A14B_EXPERT[k] for k in ("num_attention_heads", "attention_head_dim", "ffn_dim")}


SMALL_EXPERT = {
    **A14B_EXPERT,
    "num_attention_heads": 6,
    "attention_head_dim": 64,
    "ffn_dim": 1536,
    "text_dim": 256,
    "num_layers": 4,
}


SMALL_STUDENT = {"num_attention_heads": 4, "attention_head_dim": 64, "ffn_dim": 1024, "num_layers": 4}


@dataclass
class BenchSettings:
    """One benchmark configuration: a preset with command-line overrides applied."""

    preset: str
    device: str = "cpu"
    teacher: str | dict[str, Any] = "tiny"
    """"tiny" (distill.models.tiny's teacher) or WanTransformer3DModel kwargs of each expert."""
    student: str | dict[str, Any] = "config/student_tiny.json"
    """A student config file (relative to the repo) or shape keys; the rest comes from the teacher."""
    teacher_layers: int | None = None
    student_layers: int | None = None
    batch_size: int = 4
    height: int = 32
    width: int = 32
    num_frames: int = 1
    text_len: int = 512
    dtype: str = "float32"
    """Teacher weights and student autocast dtype (the student keeps float32 master weights)."""
    steps: int = 40
    warmup: int = 3
    block: int = 1
    """Steps per timed block; the mean of a block is one sample of the step time."""
    teacher_on_cpu: bool = False
    gradient_checkpointing: bool = False
    compile: bool = False
    peak_tflops: float | None = None
    seed: int = 0
    method: str = "velocity"
    """velocity, or dmd: a bench step is then one cycle of the method, one generator update and
    --critic_updates critic updates (that many `train_step` calls)."""
    critic_updates: int = 5
    student_steps: int = 4
    workload: str = "distill"
    """distill: the trainer's step against a bare one (teacher, student, optimizer); lora: one
    teacher-shaped expert with trained adapters, forward + backward + AdamW; teacher: one expert's
    guided forward (cond + uncond), no gradient. lora and teacher time that model alone."""
    lora_rank: int = 64
    """lora: the adapters' rank (alpha = rank), on the trainer's default targets."""
    attention_backend: str | None = None
    """diffusers' attention backend of every model (distill.models.attention_backend); None: SDPA picks."""


PRESETS: dict[str, dict[str, Any]] = {
    "cpu-tiny": {"steps": 40, "warmup": 5},
    "cpu-small": {
        "teacher": SMALL_EXPERT,
        "student": SMALL_STUDENT,
        "batch_size": 2,
        "height": 256,
        "width": 256,
        "steps": 50,
        "warmup": 3,
    },
    "gpu-1.3b-pictures": {
        "device": "cuda",
        "teacher": A14B_EXPERT,
        "teacher_layers": 4,
        "student": "config/student_config.json",
        "batch_size": 4,
        "height": 480,
        "width": 832,
        "dtype": "bfloat16",
        "steps": 30,
        "warmup": 5,
        "block": 5,
    },
    "gpu-14b-slice": {
        "device": "cuda",
        "teacher": A14B_EXPERT,
        "teacher_layers": 4,
        "student": A14B_WIDTH_STUDENT,
        "student_layers": 4,
        "batch_size": 1,
        "height": 480,
        "width": 832,
        "num_frames": 17,
        "dtype": "bfloat16",
        "steps": 20,
        "warmup": 4,
        "block": 5,
    },
}


# The shapes users train: 81 frames at 480x832 (32,760 tokens a sample) and 720x1280 (75,600 tokens).
CLIPS = {"480p": (480, 832), "720p": (720, 1280)}


def clip_presets() -> dict[str, dict[str, Any]]:
    """One sample of 81 frames, checkpointed, a few long steps each: at these sizes a step takes
    seconds, so a block of one step already hides the host and a handful of steps is enough."""
    presets: dict[str, dict[str, Any]] = {}
    for name, (height, width) in CLIPS.items():
        clip = {
            "device": "cuda",
            "teacher": A14B_EXPERT,
            "batch_size": 1,
            "height": height,
            "width": width,
            "num_frames": 81,
            "dtype": "bfloat16",
            "gradient_checkpointing": True,
            "steps": 6,
            "warmup": 2,
            "block": 1,
        }
        # the student's distillation step, the teacher's experts sliced to 4 blocks as at one frame
        presets[f"gpu-1.3b-{name}-81"] = {
            **clip,
            "teacher_layers": 4,
            "student": "config/student_config.json",
        }
        # one whole expert: the plan check measured 27.9 GB above its 28.6 GB at 480p (one 80 GB GPU)
        presets[f"gpu-a14b-lora-{name}-81"] = {**clip, "workload": "lora", "lora_rank": 64}
        presets[f"gpu-teacher-{name}-81"] = {**clip, "workload": "teacher", "gradient_checkpointing": False}
    return presets


PRESETS.update(clip_presets())


# Old preset names still accepted, each with the name it became (scripts and notes use them).
ALIASES = {"gpu-1.3b": "gpu-1.3b-pictures"}
