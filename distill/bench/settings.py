"""The benchmark's presets (cpu-tiny, cpu-small, gpu-1.3b, gpu-14b-slice) and the A14B teacher shapes
they scale down; `BenchSettings` is one resolved preset with the command line's overrides."""

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
    "gpu-1.3b": {
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
