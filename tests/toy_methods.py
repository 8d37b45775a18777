"""What the short method runs of tests/test_toy_methods_*.py share: where a run starts, how it is scored.

Each of those tests starts a method from a start the repository ships whose score leaves room (the
toy teacher's high-noise expert alone, which cannot finish a picture; for a LoRA, adapters damaged on
purpose, since a fresh LoRA is the teacher, which the few-step sampler already draws near perfectly),
scores the start and the trained student on the same prompts and noise, and asks for a gain no broken
method reaches (each test's docstring says what was measured, and what a method broken on purpose
scored).
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import torch
from conftest import train_args

from distill.config.cli import parse_config
from distill.toy.evaluation import load_experts, sample_pictures, score_pictures
from distill.toy.world import CLIP_FRAMES
from distill.train.trainer import Distiller


def prompt_file(folder: Path, prompts: list[str]) -> Path:
    """A prompt file of the scored prompts: the runs train on what is scored (a run on all of the
    world's prompts would spend its time on the teacher's latents of prompts nobody scores)."""
    path = folder / "prompts.txt"
    path.write_text("\n".join(prompts) + "\n")
    return path


def train(teacher: Path, out: Path, cache: Path, data: Path, clips: bool, **settings: Any) -> Path:
    """A 32 x 32 run of batch 16 on `data`; returns the exported student (or LoRA) folder."""
    args = train_args(
        teacher,
        out,
        cache,
        data_path=data,
        max_prompts=None,
        height=32,
        width=32,
        num_frames=CLIP_FRAMES if clips else 1,
        batch_size=16,
        log_every=50,
        **settings,
    )
    return Distiller(parse_config(args)).run().student_dir


def score_models(teacher: Path, prompts: list[str], steps: int, clips: bool, **models: Any) -> dict[str, Any]:
    """The toy score of `models` (sample_pictures' transformer arguments and scheduler) on `prompts`."""
    frames = CLIP_FRAMES if clips else 1
    return score_pictures(
        sample_pictures(teacher, prompts, steps=steps, num_frames=frames, **models), prompts
    )


def score_folder(teacher: Path, folder: Path, prompts: list[str], steps: int, clips: bool) -> dict[str, Any]:
    """The toy score of an exported student or LoRA folder, sampled with its own scheduler (the
    teacher's when it has none)."""
    from distill.toy.t2v_students import student_models

    models, scheduler = student_models(folder, teacher)
    return score_models(teacher, prompts, steps, clips, scheduler=scheduler, **models)


def high_noise_expert(teacher: Path) -> torch.nn.Module:
    return load_experts(teacher)[0]


def damaged_lora(teacher: Path, out: Path, rank: int, scale: float, seed: int = 0) -> Path:
    """A LoRA folder of the teacher's two experts whose up-projections are seeded noise of std `scale`
    (a fresh adapter's are zero): the teacher with it draws wrong colours and shapes, and a LoRA run
    started from it (--student_lora_init) has something to repair. With the few-step scheduler beside
    it, so it samples as a trained LoRA does."""
    from distill.models.few_step import few_step_scheduler
    from distill.models.lora import STUDENT_ADAPTER, LoraShape, adapter_state, add_adapter
    from distill.models.lora_files import write_lora_folder
    from distill.models.teacher import inspect_teacher

    shape = LoraShape(rank, float(rank))
    generator = torch.Generator().manual_seed(seed)
    states = {}
    for which, expert in zip(("high", "low"), load_experts(teacher)):
        add_adapter(expert, STUDENT_ADAPTER, shape, seed)
        for name, parameter in expert.named_parameters():
            if f".{STUDENT_ADAPTER}." in name and ".lora_B" in name:
                parameter.data = torch.randn(parameter.shape, generator=generator) * scale
        states[which] = adapter_state(expert, STUDENT_ADAPTER)
    write_lora_folder(states, shape, out, kind=inspect_teacher(str(teacher)).kind)
    few_step_scheduler(5.0).save_pretrained(out)
    return out


def score_i2v_folder(teacher: Path, folder: Path, cases: list, steps: int) -> dict[str, Any]:
    """Image adherence (and the rest of distill.toy.i2v_students' row) of an image-to-video student
    folder (a student, a LoRA folder, or one of the teacher's experts alone) on held-out `cases`, at
    `steps` of its own scheduler (the teacher's when it has none), guidance 1."""
    from distill.toy.i2v_evaluation import sample_cases
    from distill.toy.i2v_students import score_row, student_pipeline

    pipe = student_pipeline(folder, teacher_pipeline(teacher), teacher)
    return score_row(sample_cases(pipe, cases, steps, (1.0, 1.0)), cases)


@functools.cache
def teacher_pipeline(teacher: Path) -> Any:
    """The teacher's stock pipeline, loaded once per process: every student scored against it shares
    its text encoder, and with it the prompts' embeddings (distill.toy.i2v_evaluation)."""
    from distill.toy.i2v_evaluation import load_pipeline

    return load_pipeline(teacher)
