"""The toy teacher's experts with LoRA pairs stacked on them as users stack them: stock `WanPipeline`,
`load_lora_weights` once per file (the high-noise file into `transformer`, the low-noise one with
`load_into_transformer_2=True`), every adapter active at strength 1 (`set_adapters`), none fused.

What the user-LoRA table samples (distill.toy.user_table) and what its test checks against our own
loader: a user's Wan/ComfyUI pair and a speed LoRA's diffusers pair are read by diffusers itself."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

SECOND = "_2"
"""Suffix of an adapter's name in the low-noise expert (diffusers names adapters per pipeline)."""


def load_pair(pipe: Any, name: str, folder: str | Path) -> list[str]:
    """Load a high/low pair (a folder as --teacher_lora reads one: our lora/ export, its comfyui/, or a
    user's pair) into `pipe`'s two experts as adapters `name` and `name`_2; returns both names."""
    from distill.models.lora import stacking_adapters
    from distill.models.teacher_lora import parse_teacher_loras

    names = []
    for lora in parse_teacher_loras([str(folder)], experts=2):
        second = lora.expert == "transformer_2"
        adapter = name + (SECOND if second else "")
        with stacking_adapters():  # what the user-LoRA table measures
            pipe.load_lora_weights(
                str(lora.path.parent),
                weight_name=lora.path.name,
                adapter_name=adapter,
                load_into_transformer_2=second,
            )
        names.append(adapter)
    return names


def stacked_pipeline(teacher: str | Path, pairs: Sequence[tuple[str, str | Path]]) -> Any:
    """Stock WanPipeline of `teacher` with every (adapter name, pair folder) of `pairs` loaded and active."""
    from diffusers import WanPipeline

    pipe = WanPipeline.from_pretrained(str(teacher))
    names = [adapter for name, folder in pairs for adapter in load_pair(pipe, name, folder)]
    if names:
        pipe.set_adapters(names, [1.0] * len(names))
    for model in (pipe.transformer, pipe.transformer_2):
        model.eval().requires_grad_(False)
    return pipe


def stacked_experts(teacher: str | Path, pairs: Sequence[tuple[str, str | Path]]) -> tuple[Any, Any]:
    """(high-noise, low-noise) experts of `stacked_pipeline`."""
    pipe = stacked_pipeline(teacher, pairs)
    return pipe.transformer, pipe.transformer_2
