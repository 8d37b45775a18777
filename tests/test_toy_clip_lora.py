"""Fewer steps on VIDEO without losing the motion: a 4-step LoRA of the toy teacher's own experts,
trained by dmd on the moving world's clips, against the teacher itself on the same prompts and noise.

A fresh LoRA student IS the teacher, so it starts where motion is right; the small dmd student
keeps its motion when it starts from the teacher's high-noise expert too (tests/test_toy_clip_dmd.py)."""

from __future__ import annotations

import pytest
import torch
from conftest import assert_clips_keep_up_with_the_teacher, clip_guidance, clip_prompt_file, train_args

from distill.config.cli import parse_config
from distill.models.few_step import load_few_step_scheduler
from distill.models.teacher import inspect_teacher
from distill.sample.student_folder import load_lora_student
from distill.toy.evaluation import eval_prompts, sample_pictures, score_pictures
from distill.toy.world import CLIP_FRAMES
from distill.train.trainer import Distiller

pytestmark = [pytest.mark.long, pytest.mark.usefixtures("one_thread")]
PROMPTS = 144  # clip prompts scored: each of the 9 motions 16 times


@pytest.fixture(scope="module")
def clip_lora_run(toy_teacher, tmp_path_factory):
    """docs/toy-world.md's LoRA run on clips, shortened from 300 steps to 100, on 432 of the prompts."""
    out = tmp_path_factory.mktemp("toy_clip_lora")
    args = train_args(
        toy_teacher,
        out / "run",
        out / "cache",
        method="dmd",
        student_config=None,
        student_init=None,  # the student is the teacher's experts
        student_lora_rank=16,
        data_path=clip_prompt_file(out),
        max_prompts=None,
        height=32,
        width=32,
        num_frames=CLIP_FRAMES,
        teacher_sample_steps=2,  # the cached latents only feed the metrics (dmd inputs are simulated)
        batch_size=16,
        num_steps=100,  # a fresh LoRA student is the teacher: the suite's time budget is the limit
        lr=None,  # the LoRA dmd defaults: 1e-4 for the adapters and the critic's, constant
        critic_updates=5,
        student_steps=4,
        log_every=50,
        **clip_guidance(toy_teacher),  # the real score: the teacher at its own clip guidance
    )
    return Distiller(parse_config(args)).run()


def test_a_four_step_lora_on_clips_keeps_up_with_the_teacher_and_its_motion(
    toy_teacher, clip_lora_run, toy_teacher_clip_scores
):
    info = inspect_teacher(str(toy_teacher))
    student, _, _ = load_lora_student(clip_lora_run.student_dir, info, torch.device("cpu"), torch.float32)
    prompts = eval_prompts(PROMPTS, clips=True)
    student_high, student_low = student.sampling_experts()
    lora = {
        steps: score_pictures(
            sample_pictures(
                toy_teacher,
                prompts,
                transformer=student_high,
                transformer_2=student_low,
                steps=steps,
                scheduler=load_few_step_scheduler(clip_lora_run.student_dir),
                num_frames=CLIP_FRAMES,
            ),
            prompts,
        )
        for steps in (4, 1)
    }
    # Measured (216 clip prompts, 300 dmd steps on all 1,944): LoRA 0.88 at 4 steps and 0.87 at one,
    # motion ratio 1.03, diversity gap 0.42; the teacher 0.91 at 20 steps, 0.27 at one.
    assert_clips_keep_up_with_the_teacher(toy_teacher_clip_scores, prompts, lora[4], lora[1])
