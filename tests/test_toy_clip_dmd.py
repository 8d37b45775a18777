"""Fewer steps on VIDEO, measured by what the clips show, motion included: the dmd stage of the
two-stage recipe on the moving toy world, from the shipped clip stage-1 student
(`python -m distill.toy.stage_one --retrain --clips`)."""

from __future__ import annotations

import pytest
from conftest import REPO, train_args
from diffusers import WanTransformer3DModel

from distill.config.cli import parse_config
from distill.models.few_step import load_few_step_scheduler
from distill.sample.run_settings import read_run_settings
from distill.toy.evaluation import eval_prompts, sample_pictures, score_pictures
from distill.toy.stage_one import CLIP_ASSET, CLIP_RECIPE, TEACHER_REF
from distill.toy.world import CLIP_FRAMES
from distill.train.trainer import Distiller

pytestmark = pytest.mark.usefixtures("one_thread")
STUDENT_STEPS = 4
# Clip prompts scored: each of the 9 motions 16 times.
STUDENT_PROMPTS = 144


@pytest.fixture(scope="module")
def clip_dmd_run(toy_teacher, tmp_path_factory):
    """Stage 2 of the README's clip recipe, shortened to 200 steps."""
    out = tmp_path_factory.mktemp("toy_clip_dmd")
    args = train_args(
        toy_teacher,
        out / "run",
        out / "cache",
        method="dmd",
        student_config=REPO / "config" / "student_toy_3layer.json",
        student_init=CLIP_ASSET,
        data_path=REPO / "data" / "toy_video_prompts.txt",
        max_prompts=None,
        height=32,
        width=32,
        num_frames=CLIP_FRAMES,
        # The cached teacher latents only feed the drift and motion metrics (dmd inputs are simulated).
        teacher_sample_steps=2,
        batch_size=16,
        num_steps=200,
        lr=3e-5,
        critic_lr=3e-4,
        lr_scheduler="cosine",
        critic_updates=5,
        student_steps=STUDENT_STEPS,
        log_every=50,
    )
    return Distiller(parse_config(args)).run()


def test_dmd_on_clips_improves_on_its_stage_one_and_keeps_moving(toy_teacher, clip_dmd_run):
    """Measured (README, the moving world; 216 clip prompts): the 300-step dmd student scores 0.33 at 4
    steps against its stage one's 0.23, direction 0.86 against 0.77, motion ratio 0.75. It does NOT
    yet reach the teacher at 4 steps (0.51; 0.60 at 20): the toy teacher itself is weak on clips."""
    prompts = eval_prompts(STUDENT_PROMPTS, clips=True)

    def score(path):
        model = WanTransformer3DModel.from_pretrained(path).eval()
        clips = sample_pictures(
            toy_teacher,
            prompts,
            transformer=model,
            steps=STUDENT_STEPS,
            scheduler=load_few_step_scheduler(clip_dmd_run.student_dir),
            num_frames=CLIP_FRAMES,
        )
        return score_pictures(clips, prompts)

    dmd, stage_one = score(clip_dmd_run.student_dir), score(CLIP_ASSET)
    figures = {
        name: (r["accuracy"], r["per_attribute"]["direction"], r["motion_ratio"])
        for name, r in (("dmd", dmd), ("stage_one", stage_one))
    }
    assert dmd["accuracy"] >= stage_one["accuracy"] + 0.04, figures
    assert dmd["per_attribute"]["direction"] >= stage_one["per_attribute"]["direction"], figures
    # Its clips move in the prompted direction, at most a little slower than the world's (a frozen
    # student reads 0; the teacher 1.15).
    assert dmd["per_attribute"]["direction"] >= 0.75, figures
    assert 0.5 <= dmd["motion_ratio"] <= 1.2, figures


def test_the_shipped_clip_stage_one_is_what_the_recipe_makes():
    settings = read_run_settings(CLIP_ASSET / "run_settings.json")
    assert settings.method == "velocity" and settings.trained_steps == CLIP_RECIPE["num_steps"]
    assert settings.num_frames == CLIP_FRAMES == CLIP_RECIPE["num_frames"]
    assert settings.teacher_guidance_scale == settings.teacher_guidance_scale_2 == 1.0
    assert settings.teacher_path == TEACHER_REF
