"""A 4-step LoRA of the toy teacher's own experts, measured by what the pictures show: dmd with the
LoRA defaults, started from the teacher itself (a fresh LoRA student is the teacher), scored from
the exported adapters as `python -m distill.evaluate` loads them."""

from __future__ import annotations

import pytest
import torch
from conftest import REPO, train_args
from diffusers import WanPipeline

from distill.config.cli import parse_config
from distill.models.few_step import load_few_step_scheduler
from distill.models.lora_files import FILES
from distill.models.teacher import inspect_teacher
from distill.sample.student_folder import load_lora_student
from distill.toy.evaluation import EVAL_PROMPTS, eval_prompts, sample_pictures, score_pictures
from distill.train.trainer import Distiller

pytestmark = [pytest.mark.long, pytest.mark.usefixtures("one_thread")]
TEACHER_PROMPTS = 96  # the teacher at 4 steps, the baseline; the student is scored on all 216


@pytest.fixture(scope="module")
def lora_run(toy_teacher, tmp_path_factory):
    """docs/lora.md's toy run shortened from 300 steps to 100 (300 scored 0.995 on all 216 prompts,
    100 scored 0.99: a fresh LoRA student is the teacher, and the gain arrives early)."""
    out = tmp_path_factory.mktemp("toy_lora")
    args = train_args(
        toy_teacher,
        out / "run",
        out / "cache",
        method="dmd",
        student_config=None,
        student_init=None,  # the student is the teacher's experts
        student_lora_rank=16,
        data_path=REPO / "data" / "toy_prompts.txt",
        max_prompts=None,  # all 216
        height=32,
        width=32,
        teacher_sample_steps=2,  # the cached latents only feed the drift metrics (dmd inputs are simulated)
        batch_size=16,
        num_steps=100,
        lr=None,  # the LoRA dmd defaults: 1e-4 for the adapters and the critic's, constant
        critic_updates=5,
        student_steps=4,
        log_every=50,
    )
    return Distiller(parse_config(args)).run()


def test_a_four_step_lora_of_the_teachers_experts_beats_the_teacher_at_four_steps(toy_teacher, lora_run):
    info = inspect_teacher(str(toy_teacher))
    student, high, low = load_lora_student(lora_run.student_dir, info, torch.device("cpu"), torch.float32)
    scheduler = load_few_step_scheduler(lora_run.student_dir)
    every, some = eval_prompts(EVAL_PROMPTS), eval_prompts(TEACHER_PROMPTS)
    lora = score_pictures(
        sample_pictures(toy_teacher, every, transformer=student, steps=4, scheduler=scheduler), every
    )
    teacher_4 = score_pictures(
        sample_pictures(
            toy_teacher,
            some,
            transformer=high,
            transformer_2=low,
            steps=4,
            guidance_scale=4.0,
            guidance_scale_2=3.0,
        ),
        some,
    )
    # measured: LoRA 0.96 after 300 steps; the teacher 1.00 at 20 steps and 0.54 at 4
    assert lora["accuracy"] >= 0.9, lora
    assert lora["accuracy"] > teacher_4["accuracy"] + 0.15, (lora["accuracy"], teacher_4["accuracy"])

    # The same files as users load them: stock WanPipeline + load_lora_weights, not our loader.
    pipe = WanPipeline.from_pretrained(str(toy_teacher))
    folder = str(lora_run.student_dir)
    pipe.load_lora_weights(folder, weight_name=FILES["high"], adapter_name="fast")
    pipe.load_lora_weights(
        folder, weight_name=FILES["low"], adapter_name="fast_2", load_into_transformer_2=True
    )
    stock = score_pictures(
        sample_pictures(
            toy_teacher,
            every,
            transformer=pipe.transformer,
            transformer_2=pipe.transformer_2,
            steps=4,
            scheduler=scheduler,
        ),
        every,
    )
    assert abs(stock["accuracy"] - lora["accuracy"]) <= 2 / len(every), (stock["accuracy"], lora["accuracy"])
