"""What an export tells its users: run_settings.json, the model card and the size limits, on the
tiny real teacher with a student trained for real (64x64, max_sequence_length 16, EMA, evaluated)."""

from __future__ import annotations

import dataclasses
import json
import logging
import re
import shutil

import numpy as np
import pytest
import torch
from conftest import REPO, train_args
from PIL import Image

from distill import evaluate, generate
from distill.config.cli import parse_config
from distill.models.teacher import inspect_teacher
from distill.ops.errors import DistillError
from distill.report.monitor import DEFAULT_SAMPLE_PROMPTS
from distill.sample.card_code import EXAMPLE_PROMPT
from distill.sample.model_card import model_card_text, write_model_card
from distill.sample.pipeline_folder import write_pipeline_folder
from distill.sample.run_settings import read_run_settings, teacher_hub_id
from distill.train.trainer import Distiller

HEIGHT = WIDTH = 64
MAX_SEQUENCE_LENGTH = 16  # not WanPipeline's 512: sampling with 512 gives another output
SAMPLE_STEPS = 4


@pytest.fixture(scope="module")
def run(tiny_teacher, tmp_path_factory):
    """The teacher sits in a folder named like the hub repo, as download_wan.py leaves it."""
    root = tmp_path_factory.mktemp("export")
    teacher = shutil.copytree(tiny_teacher, root / "Wan2.2-T2V-A14B-Diffusers")
    args = train_args(
        teacher,
        root / "out",
        root / "cache",
        height=HEIGHT,
        width=WIDTH,
        max_sequence_length=MAX_SEQUENCE_LENGTH,
        sample_steps=SAMPLE_STEPS,
        num_steps=20,
        ema_decay=0.9,
        eval_interval=20,
    )
    result = Distiller(parse_config(args)).run()
    result.teacher = teacher
    return result


def _code_block(card: str) -> str:
    return re.search(r"```python\n(.*?)```", card, re.S).group(1)


def _pixels(path) -> np.ndarray:
    return np.asarray(Image.open(path)).astype(np.float64)


def test_run_settings_are_written_beside_and_inside_every_export(run):
    out = run.output_dir
    copies = [out, out / "student", out / "student_ema", out / "pipeline"]
    texts = {(folder / "run_settings.json").read_text() for folder in copies}
    assert len(texts) == 1  # one content everywhere
    settings = read_run_settings(out / "pipeline" / "run_settings.json")
    assert (settings.height, settings.width, settings.num_frames) == (HEIGHT, WIDTH, 1)
    assert settings.max_sequence_length == MAX_SEQUENCE_LENGTH
    assert (settings.num_inference_steps, settings.guidance_scale) == (SAMPLE_STEPS, 1.0)
    assert settings.teacher_path == str(run.teacher)
    assert settings.base_model == "Wan-AI/Wan2.2-T2V-A14B-Diffusers"
    assert settings.trained_steps == 20 and settings.method == "velocity"


def test_model_cards_carry_hub_metadata_the_exact_call_and_the_measurements(run):
    from huggingface_hub import ModelCard

    out = run.output_dir
    evaluation = json.loads((out / "eval" / "step_00000020" / "eval.json").read_text())
    assert evaluation["ema"] is True
    for name in ("student", "student_ema", "pipeline"):
        card = ModelCard.load(out / name / "README.md")
        assert card.data.library_name == "diffusers"
        assert card.data.pipeline_tag == "text-to-video"
        assert card.data.base_model == "Wan-AI/Wan2.2-T2V-A14B-Diffusers"
        assert {"wan2.2", "distillation", "velocity-distillation"} <= set(card.data.tags)
        code = _code_block(card.text)
        for argument in (
            "guidance_scale=1.0",
            f"num_inference_steps={SAMPLE_STEPS}",
            f"max_sequence_length={MAX_SEQUENCE_LENGTH}",
            f"height={HEIGHT}",
            f"width={WIDTH}",
        ):
            assert argument in code, (name, argument)
        # The run evaluated the EMA weights: their numbers go to student_ema/ and pipeline/ (which runs them).
        psnr = f"{evaluation['sampler']['frame_psnr_db']:.2f} dB"
        speedup = f"{evaluation['cost']['speedup_forwards']:.2f}x"
        if name == "student":
            assert psnr not in card.text and "No evaluation ran" in card.text
        else:
            assert psnr in card.text and speedup in card.text


def test_the_call_the_cards_show_runs_and_equals_generate_defaults(run, tmp_path, monkeypatch):
    """Both cards' code runs as written with WanPipeline and gives what distill.generate gives."""
    out = run.output_dir
    monkeypatch.chdir(tmp_path)
    rendered = {}
    for name in ("student", "pipeline"):
        exec(_code_block((out / name / "README.md").read_text()), {"__name__": "card"})
        rendered[name] = _pixels(tmp_path / "sample.png")
    assert rendered["student"].shape == (HEIGHT, WIDTH, 3)
    # pipeline/ runs the EMA student: generate with each folder and no sampling flags.
    for name, folder in (("student", "student"), ("pipeline", "student_ema")):
        target = tmp_path / f"generate_{name}.png"
        assert (
            generate.main(
                ["--student", str(out / folder), "--prompt", EXAMPLE_PROMPT, "--output", str(target)]
            )
            == 0
        )
        np.testing.assert_array_equal(_pixels(target), rendered[name])


def test_a_method_with_its_own_sampler_gets_a_card_and_pipeline_that_run(run, tmp_path, monkeypatch):
    """A few-step student records its steps and scheduler; card and pipeline/ then sample with them."""
    from diffusers import FlowMatchEulerDiscreteScheduler, WanPipeline

    out = run.output_dir
    settings = read_run_settings(out / "run_settings.json")
    settings.num_inference_steps = 2
    settings.scheduler = {"_class_name": "FlowMatchEulerDiscreteScheduler", "shift": 5.0}
    settings.scheduler_note = "two Euler steps at shift 5"
    folder = shutil.copytree(out / "student", tmp_path / "student")
    card = write_model_card(folder, settings, "transformer").read_text()
    assert "two Euler steps at shift 5" in card and "num_inference_steps=2" in card
    monkeypatch.chdir(tmp_path)
    exec(_code_block(card), {"__name__": "card"})
    assert _pixels(tmp_path / "sample.png").shape == (HEIGHT, WIDTH, 3)

    pipeline = write_pipeline_folder(tmp_path / "run", run.teacher, folder, settings.scheduler)
    pipe = WanPipeline.from_pretrained(pipeline)
    assert isinstance(pipe.scheduler, FlowMatchEulerDiscreteScheduler) and pipe.scheduler.config.shift == 5.0


def test_generate_uses_the_recorded_max_sequence_length(run, tmp_path, caplog):
    student = str(run.output_dir / "student")
    images = {}
    caplog.set_level(logging.INFO, logger="distill.generate")
    for label, extra in (
        ("default", []),
        ("trained", ["--max_sequence_length", "16"]),
        ("512", ["--max_sequence_length", "512"]),
    ):
        target = tmp_path / f"{label}.png"
        assert (
            generate.main(["--student", student, "--prompt", "a red cube", "--output", str(target), *extra])
            == 0
        )
        images[label] = _pixels(target)
    assert "max_sequence_length 16 (defaults from" in caplog.text
    np.testing.assert_array_equal(images["default"], images["trained"])

    # Why it matters: the padding length changes the output (no attention mask). The random tiny
    # VAE hides most of it in the PNG, so compare the final latents of generate's own render.
    args = generate.build_parser().parse_args(["--student", student, "--output", str(tmp_path / "l")])
    found = generate.resolve_defaults(args)
    info = inspect_teacher(args.teacher_path)
    pipe = generate.build_pipeline(args, info, torch.device("cpu"), torch.float32, found[0])
    recorded = generate.render(pipe, args, "a red cube", 0, output_type="latent")
    args.max_sequence_length = 512
    longer = generate.render(pipe, args, "a red cube", 0, output_type="latent")
    # Measured: 7e-4 of the latent power; float noise would be ~1e-12.
    assert (recorded - longer).pow(2).mean() > 1e-5 * recorded.pow(2).mean()


def test_evaluate_defaults_come_from_the_run(run, tmp_path):
    """No teacher, size, steps or max_sequence_length given: all from run_settings.json."""
    code = evaluate.main(
        ["--student", str(run.output_dir / "student_ema"), "--prompts", str(DEFAULT_SAMPLE_PROMPTS)]
        + ["--output_dir", str(tmp_path / "eval"), "--max_prompts", "1", "--num_buckets", "2"]
    )
    assert code == 0
    result = json.loads((tmp_path / "eval" / "eval.json").read_text())
    settings = result["settings"]
    assert (settings["height"], settings["width"], settings["steps"]) == (HEIGHT, WIDTH, SAMPLE_STEPS)
    assert result["teacher"] == str(run.teacher)


def test_sizes_the_models_cannot_handle_are_refused_before_any_work(run, tmp_path, capsys):
    # The reported crash: evaluate with its built-in 480x832 on a student that carries no run settings.
    bare = shutil.copytree(
        run.output_dir / "student", tmp_path / "bare", ignore=shutil.ignore_patterns("run_*")
    )
    code = evaluate.main(
        ["--student", str(bare), "--teacher_path", str(run.teacher), "--prompts", str(DEFAULT_SAMPLE_PROMPTS)]
        + ["--output_dir", str(tmp_path / "eval")]
    )
    err = capsys.readouterr().err
    assert code == 3 and "Traceback" not in err
    assert "--width 832 is too large for the student: 52 patches" in err and "rope_max_seq_len is 32" in err
    assert "use --width 512 or less" in err
    assert not (tmp_path / "eval").exists()

    student = str(run.output_dir / "student")
    base = ["--prompt", "a", "--output", str(tmp_path / "x.png")]
    assert generate.main(["--student", student, "--height", "528", *base]) == 3
    err = capsys.readouterr().err
    assert "--height 528 is too large for the student" in err
    assert f"--height {HEIGHT} --width {WIDTH}" in err  # the size it was trained at, first
    assert generate.main(["--student", student, "--width", "40", *base]) == 3
    assert "--width must be a positive multiple of 16, got 40" in capsys.readouterr().err
    teacher_only = ["--teacher_only", "--teacher_path", str(run.teacher), "--width", "832", *base]
    assert generate.main(teacher_only) == 3
    assert "--width 832 is too large for the teacher" in capsys.readouterr().err
    assert not (tmp_path / "x.png").exists()


def test_training_refuses_sizes_the_models_cannot_handle(tiny_teacher, tmp_path):
    args = train_args(tiny_teacher, tmp_path / "out", tmp_path / "cache", height=528, device="cpu")
    with pytest.raises(DistillError, match="--height 528 is too large for the teacher") as error:
        Distiller(parse_config(args))
    assert "use --height 512 or less" in error.value.fixes
    small_rope = json.loads((REPO / "config" / "student_tiny.json").read_text()) | {"rope_max_seq_len": 4}
    (tmp_path / "student.json").write_text(json.dumps(small_rope))
    args = train_args(
        tiny_teacher,
        tmp_path / "out",
        tmp_path / "cache",
        height=128,
        student_config=tmp_path / "student.json",
    )
    with pytest.raises(DistillError, match="--height 128 is too large for the student: 8 patches"):
        Distiller(parse_config(args))
    assert not (tmp_path / "out").exists()  # refused before anything was written


def test_teacher_hub_id_and_a_card_without_one(tmp_path, run):
    from huggingface_hub import ModelCard

    assert teacher_hub_id("Wan-AI/Wan2.2-T2V-A14B-Diffusers", tmp_path) == "Wan-AI/Wan2.2-T2V-A14B-Diffusers"
    cached = tmp_path / "hub" / "models--Wan-AI--Wan2.2-T2V-A14B-Diffusers" / "snapshots" / "abc"
    cached.mkdir(parents=True)
    assert teacher_hub_id(str(cached), cached) == "Wan-AI/Wan2.2-T2V-A14B-Diffusers"
    assert teacher_hub_id(str(tmp_path), tmp_path) is None
    settings = read_run_settings(run.output_dir / "run_settings.json")
    settings.base_model = None
    card = ModelCard(model_card_text(settings, "pipeline", "outputs/run1/pipeline"))
    assert card.data.library_name == "diffusers" and card.data.base_model is None
    assert str(run.teacher) in card.text  # the card still names the teacher


def test_a_student_distilled_without_guidance_says_so_and_dmd_warns_about_one_with(run, tmp_path, caplog):
    from distill.sample.run_settings import write_run_settings
    from distill.train.methods.dmd import guided_stage_one

    guided = read_run_settings(run.output_dir / "run_settings.json")
    assert guided.teacher_guidance_scale > 1
    assert "learned the guided velocity" in model_card_text(guided, "transformer", "s")
    unguided = dataclasses.replace(guided, teacher_guidance_scale=1.0, teacher_guidance_scale_2=1.0)
    card = model_card_text(unguided, "transformer", "s")
    assert "learned the guided velocity" not in card and "without guidance" in card
    assert "stage 1 of `--method dmd`" in card
    # dmd from the guided run's student: the advice names the flags; from the unguided one: nothing.
    advice = guided_stage_one(str(run.output_dir / "student"))
    assert advice and "--guidance_scale 1 --guidance_scale_2 1" in advice
    shutil.copytree(run.output_dir / "student", tmp_path / "unguided")
    write_run_settings(unguided, tmp_path / "unguided")
    assert guided_stage_one(str(tmp_path / "unguided")) is None
    assert guided_stage_one("random") is None and guided_stage_one(str(tmp_path / "missing")) is None
    # The dmd run itself logs the advice when it starts from the guided student.
    args = train_args(
        run.teacher,
        tmp_path / "dmd",
        run.output_dir.parent / "cache",
        method="dmd",
        student_init=run.output_dir / "student",
        height=HEIGHT,
        width=WIDTH,
        max_sequence_length=MAX_SEQUENCE_LENGTH,
        num_steps=1,
    )
    with caplog.at_level(logging.WARNING, logger="distill.train.methods.dmd"):
        Distiller(parse_config(args)).run()
    assert advice in caplog.text


def test_a_text_to_video_export_names_wan_pipeline_and_records_no_pipeline_class(run):
    """Only an image-to-video run records its pipeline class: a text-to-video run's files are what
    they were before image to video existed, and its cards never ask for an image."""
    out = run.output_dir
    for folder in (out, out / "student", out / "pipeline"):
        recorded = json.loads((folder / "run_settings.json").read_text())
        assert "pipeline_class" not in recorded
        assert read_run_settings(folder / "run_settings.json").pipeline_class == "WanPipeline"
    for name in ("student", "pipeline"):
        card = (out / name / "README.md").read_text()
        assert "WanImageToVideoPipeline" not in card and "load_image" not in card and "image=" not in card
        assert "pipeline_tag: text-to-video" in card and "# Wan 2.2 T2V distilled student" in card
    assert json.loads((out / "pipeline" / "model_index.json").read_text())["_class_name"] == "WanPipeline"
