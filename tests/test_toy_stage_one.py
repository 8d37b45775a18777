"""The shipped stage-1 toy students (assets/toy_student_stage1/, assets/toy_student_clips_stage1/):
where the dmd students and the README's toy stage 2 start. They are what their recipe makes (the
recipe itself, cut short, ships a student here; `make proofs` trains them again in full)."""

from __future__ import annotations

import json
from pathlib import Path

from diffusers import WanTransformer3DModel

from distill.sample.run_settings import read_run_settings
from distill.toy.stage_one import ASSET, CLIP_ASSET, CLIP_RECIPE, RECIPE, TEACHER_REF
from distill.toy.stage_one import main as stage_one_main
from distill.toy.world import CLIP_FRAMES


def test_the_shipped_stage_one_is_what_the_recipe_makes():
    settings = read_run_settings(ASSET / "run_settings.json")
    assert settings.method == "velocity" and settings.trained_steps == RECIPE["num_steps"]
    assert settings.teacher_guidance_scale == settings.teacher_guidance_scale_2 == 1.0
    assert settings.teacher_path == TEACHER_REF  # no machine's paths in the shipped files
    config = WanTransformer3DModel.load_config(ASSET)
    recipe_config = json.loads(Path(RECIPE["student_config"]).read_text())
    assert {k: config[k] for k in recipe_config if not k.startswith("_")} == {
        k: v for k, v in recipe_config.items() if not k.startswith("_")
    }


def test_the_shipped_clip_stage_one_is_what_the_recipe_makes():
    settings = read_run_settings(CLIP_ASSET / "run_settings.json")
    assert settings.method == "velocity" and settings.trained_steps == CLIP_RECIPE["num_steps"]
    assert settings.num_frames == CLIP_FRAMES == CLIP_RECIPE["num_frames"]
    assert settings.teacher_guidance_scale == settings.teacher_guidance_scale_2 == 1.0
    assert settings.teacher_path == TEACHER_REF


def test_retraining_stage_one_ships_a_student_with_the_recipes_settings(tmp_path, monkeypatch):
    # The recipe itself, cut short: 3 steps on 4 prompts, 2 teacher steps for the latent cache.
    monkeypatch.setitem(RECIPE, "num_steps", 3)
    monkeypatch.setitem(RECIPE, "teacher_sample_steps", 2)
    monkeypatch.setitem(RECIPE, "max_prompts", 4)
    output = tmp_path / "shipped"
    assert stage_one_main(["--retrain", "--work_dir", str(tmp_path / "work"), "--output", str(output)]) == 0
    settings = read_run_settings(output / "run_settings.json")
    assert (settings.trained_steps, settings.teacher_guidance_scale, settings.teacher_path) == (
        3,
        1.0,
        TEACHER_REF,
    )
    card = (output / "README.md").read_text()
    assert "without guidance" in card and str(tmp_path / "work") not in card
    assert not list(tmp_path.glob(".shipped.partial-*"))  # the staging folder is gone
    WanTransformer3DModel.from_pretrained(output)  # loads as a diffusers model
