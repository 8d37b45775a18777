"""A stage's models are gone the moment the stage ends, with no garbage collection.

The text encoder (with its pipeline) and the VAE are loaded for one stage and dropped after it:
reference counting frees them there, since they hold no reference cycle, and
`distill.models.teacher.empty_device_cache` gives their blocks back to the device (on the CPU it runs
no collection). Here the collector is off while a stage runs: a model left alive after it (a cycle,
or a reference kept somewhere) would hold a 14B run's text encoder or VAE for the rest of the run.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator

import pytest
import torch
from conftest import train_args

from distill.config.cli import parse_config
from distill.data.prepare import embedding_cache, fill_embedding_cache
from distill.models.pipelines import decode_with_teacher_vae, encode_prompts
from distill.models.teacher import inspect_teacher

CPU = torch.device("cpu")


def alive(kind: type) -> int:
    return sum(isinstance(thing, kind) for thing in gc.get_objects())


@pytest.fixture
def no_collection() -> Iterator[None]:
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def test_the_text_encoder_is_gone_once_the_prompts_are_encoded(tiny_teacher, tmp_path, no_collection):
    from transformers import UMT5EncoderModel

    before = alive(UMT5EncoderModel)
    embeddings = encode_prompts(tiny_teacher, ["a red cube", "a blue sphere"], 32, CPU, torch.float32)
    assert len(embeddings) == 2 and alive(UMT5EncoderModel) == before

    cfg = parse_config(train_args(tiny_teacher, tmp_path / "out", tmp_path / "cache"))
    info = inspect_teacher(str(tiny_teacher))
    cache = embedding_cache(cfg, info, torch.float32)
    built = fill_embedding_cache(cache, ["a red cube"], info, 32, CPU, torch.float32, show_progress=False)
    assert built == 1 and alive(UMT5EncoderModel) == before


def test_the_vae_is_gone_once_the_latents_are_decoded(tiny_teacher, no_collection):
    from diffusers import AutoencoderKLWan

    before = alive(AutoencoderKLWan)
    frames = decode_with_teacher_vae([torch.zeros(16, 1, 4, 4)], tiny_teacher, CPU)
    assert len(frames) == 1 and alive(AutoencoderKLWan) == before
