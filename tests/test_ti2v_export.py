"""A Wan2.2-TI2V-5B run's exports and tools, in both of its modes: the pipeline/ folder of a text-mode
run loads in stock WanPipeline and that of an image-mode run in stock WanImageToVideoPipeline (both
expand_timesteps, one transformer, no boundary), and each samples what our own sampling of the
student gives from the same noise, prompt (and image); the run records its mode, and generate,
evaluate, the monitor, --verify and doctor work on the TI2V teacher and student and refuse inputs of
the other mode, a student of another Wan 2.2 model, or a frame count that is not 4k+1, naming the fix.
On the tiny random TI2V teacher, students trained for real for a few steps (32x32, 5 frames)."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import REPO, train_args
from diffusers import WanImageToVideoPipeline, WanPipeline, WanTransformer3DModel
from diffusers.utils import load_image
from PIL import Image
from safetensors import safe_open
from test_i2v_export import run_keeping_export_log

from distill import doctor, evaluate, generate
from distill.config.cli import parse_config
from distill.data.images import ImagePreprocessor
from distill.models.pipelines import (
    encode_prompts,
    initial_noise,
    load_scheduler,
    load_vae,
    sample_latents,
    scheduler_from_config,
    student_pipeline,
)
from distill.models.teacher import inspect_teacher
from distill.models.teacher_kind import TI2V_5B
from distill.models.tiny import write_tiny_teacher
from distill.ops.errors import DistillError
from distill.sample.card_code import EXAMPLE_IMAGE
from distill.sample.image_inputs import collect_prompts, prompt_images, recorded_mode
from distill.sample.media import read_frames
from distill.sample.run_settings import read_run_settings
from distill.sample.student_folder import load_student
from distill.train.trainer import Distiller

pytestmark = [pytest.mark.usefixtures("one_thread"), pytest.mark.long]

# 32 pixels: the Wan2.2 VAE's 16x and the patch's 2 make latents 48 x 2 x 2 x 2 (2 tokens per frame).
SIZE, FRAMES, LENGTH, STEPS = 32, 5, 16, 2
PROMPT = "a red ball rolling to the left"
CPU = torch.device("cpu")
TEACHER = "Wan2.2-TI2V-5B-Diffusers"


def _close(actual: torch.Tensor, expected: torch.Tensor, atol: float = 1e-5) -> None:
    """Equal up to float rounding, relative to the sample's scale."""
    scale = float(expected.abs().max())
    assert scale > 0
    torch.testing.assert_close(actual.float(), expected.float(), rtol=0, atol=atol * max(scale, 1.0))


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    """The teacher (named as download_wan.py names the hub repo's folder), two prompts paired with
    two 32x32 images and the same prompts without them."""
    root = tmp_path_factory.mktemp("ti2v_export")
    write_tiny_teacher(root / TEACHER, seed=0, kind=TI2V_5B)
    (root / "data" / "images").mkdir(parents=True)
    for i in range(2):
        pixels = np.random.default_rng(i).integers(0, 256, size=(SIZE, SIZE, 3), dtype=np.uint8)
        Image.fromarray(pixels).save(root / "data" / "images" / f"{i}.png")
    lines = [{"prompt": PROMPT, "image": "images/0.png"}, {"prompt": "a blue box", "image": "images/1.png"}]
    (root / "data" / "pairs.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    (root / "data" / "prompts.txt").write_text(f"{PROMPT}\na blue box\n")
    return root


def _train(root: Path, name: str, data: str, **overrides: object) -> Path:
    """A short real run on the TI2V teacher; its export's log lines are kept in <out>/export.log."""
    out = root / name
    overrides = {"student_config": REPO / "config" / "student_tiny_ti2v.json", "num_steps": 3, **overrides}
    args = train_args(
        root / TEACHER,
        out,
        root / "cache",
        data_path=root / "data" / data,
        height=SIZE,
        width=SIZE,
        num_frames=FRAMES,
        max_sequence_length=LENGTH,
        sample_steps=STEPS,
        **overrides,
    )
    return run_keeping_export_log(args, out)


@pytest.fixture(scope="module")
def text_run(root: Path) -> Path:
    # The original layout too: Wan's own code reads model_type ti2v from it; samples from held-out text.
    prompts = root / "data" / "prompts.txt"
    return _train(
        root, "text", "prompts.txt", export_formats="diffusers,original", save_samples=True, sample_interval=3,
        sample_prompts=prompts,
    )  # fmt: skip


@pytest.fixture(scope="module")
def image_run(root: Path) -> Path:
    # Samples and a report while training, each prompt from its held-out image (as I2V does).
    pairs = root / "data" / "pairs.jsonl"
    return _train(
        root,
        "image",
        "pairs.jsonl",
        save_samples=True,
        sample_interval=3,
        eval_interval=3,
        sample_prompts=pairs,
    )


@pytest.fixture(scope="module")
def lora_run(root: Path) -> Path:
    # A 4-step-style LoRA of the one transformer, image mode, merged too; a large rate moves it.
    return _train(
        root, "lora", "pairs.jsonl", method="dmd", student_lora_rank=4, student_config=None, student_init=None,
        student_steps=STEPS, critic_updates=1, lr=1e-2, num_steps=2, export_formats="diffusers,merged",
    )  # fmt: skip


def _stock(pipe, seed: int, image_file: Path | None = None, stochastic: bool = False) -> torch.Tensor:
    """The stock pipeline's final latent for PROMPT (and the image file) and seed, as the model card
    calls it; a few-step scheduler re-noises from the global RNG, seeded the way generate seeds it."""
    pipe.set_progress_bar_config(disable=True)
    extra = {"image": load_image(str(image_file))} if image_file is not None else {}
    generator = torch.Generator("cpu").manual_seed(seed)
    if stochastic:
        torch.manual_seed(seed)
        generator = None
    return pipe(
        prompt=PROMPT,
        height=SIZE,
        width=SIZE,
        num_frames=FRAMES,
        num_inference_steps=STEPS,
        guidance_scale=1.0,
        max_sequence_length=LENGTH,
        generator=generator,
        output_type="latent",
        **extra,
    ).frames[0]


def _ours(root: Path, out: Path, seed: int, image: bool) -> torch.Tensor:
    """Our own sampling of the exported student: the prompt's cached-style embedding, the image
    preprocessed as the data layer does, the stock pipeline class of the mode built in code."""
    info = inspect_teacher(read_run_settings(out / "run_settings.json").teacher_path)
    embeds = encode_prompts(info.path, [PROMPT], LENGTH, CPU, torch.float32)[PROMPT]
    student = load_student(out / "student", info, CPU, torch.float32)
    pixels = None
    if image:
        preprocess = ImagePreprocessor(SIZE, SIZE, info.vae_scale_spatial)
        picture = load_image(str(root / "data" / "images" / "0.png"))
        pixels = preprocess.processor.preprocess(picture, height=SIZE, width=SIZE)
    vae = load_vae(info.path, CPU) if image else None
    pipe = student_pipeline(student, load_scheduler(info.path), TI2V_5B, image=image, vae=vae)
    noise = initial_noise(info.latent_shape(SIZE, SIZE, FRAMES), seed)
    return sample_latents(pipe, noise, embeds, None, STEPS, 1.0, image=pixels)


def _generate_latent(argv: list[str]) -> torch.Tensor:
    """distill.generate's own sample of its first prompt (its defaults, mode, images and pipeline)."""
    args = generate.build_parser().parse_args([*argv, "--output", "unused.mp4"])
    found = generate.resolve_defaults(args)
    info = inspect_teacher(args.teacher_path)
    generate.one_transformer_guidance(args, info, {})
    images = prompt_images(
        info.kind, info.path, len(args.prompt or []), args.image, args.prompts_file,
        args.height, args.width, info.vae_scale_spatial,
        run_mode=None if args.teacher_only else recorded_mode(info.kind, found),
    )  # fmt: skip
    pipe = generate.build_pipeline(
        args, info, CPU, torch.float32, found[0] if found else None, image=images is not None
    )
    prompts = collect_prompts(args.prompt, args.prompts_file)
    return generate.render(pipe, args, prompts[0], args.seed, "latent", image=images[0] if images else None)


def _index(out: Path) -> dict:
    return json.loads((out / "pipeline" / "model_index.json").read_text())


def test_text_mode_pipeline_folder_is_stock_wan_pipeline_and_samples_as_the_student(
    root, text_run, tmp_path, monkeypatch
):
    out = text_run
    index = _index(out)
    assert index["_class_name"] == "WanPipeline" and index["expand_timesteps"] is True
    assert index["transformer_2"] == [None, None] and index["boundary_ratio"] is None
    assert "image_encoder" not in index
    log = (out / "export.log").read_text()
    assert "WanPipeline.from_pretrained" in log and "text mode" in log and "WanImageToVideo" not in log
    settings = read_run_settings(out / "run_settings.json")
    assert settings.pipeline_class == "WanPipeline" and not settings.takes_image
    assert settings.teacher_kind == "ti2v-5b" and settings.boundary_ratio is None
    assert settings.teacher_guidance_scale_2 is None  # one transformer, one guidance
    card = (out / "pipeline" / "README.md").read_text()
    assert (
        "# Wan 2.2 TI2V-5B (text to video) distilled student" in card
        and "pipeline_tag: text-to-video" in card
    )
    assert (
        "WanImageToVideoPipeline.from_pretrained" not in card and "one transformer at every timestep" in card
    )
    with safe_open(str(out / "student_original.safetensors"), "pt") as original:
        config = json.loads(original.metadata()["config"])
    assert (config["model_type"], config["in_dim"], config["out_dim"]) == ("ti2v", 48, 48)

    pipe = WanPipeline.from_pretrained(out / "pipeline")
    assert pipe.transformer_2 is None and pipe.config.expand_timesteps is True
    stock = _stock(pipe, 5)
    _close(_ours(root, out, 5, image=False), stock)
    _close(_generate_latent(["--student", str(out / "student"), "--prompt", PROMPT, "--seed", "5"]), stock)
    # the card's call runs as printed: WanPipeline on the folder, no image
    code = re.search(r"```python\n(.*?)```", card, re.S).group(1)
    assert "WanPipeline.from_pretrained" in code and "image=" not in code
    monkeypatch.chdir(tmp_path)
    exec(code, {"__name__": "card"})
    assert read_frames(tmp_path / "sample.mp4").shape == (FRAMES, SIZE, SIZE, 3)


def test_image_mode_pipeline_folder_is_stock_i2v_and_samples_as_the_student(
    root, image_run, tmp_path, monkeypatch
):
    out, image = image_run, root / "data" / "images" / "0.png"
    index = _index(out)
    assert index["_class_name"] == "WanImageToVideoPipeline" and index["expand_timesteps"] is True
    assert index["transformer_2"] == index["image_encoder"] == index["image_processor"] == [None, None]
    assert index["boundary_ratio"] is None
    log = (out / "export.log").read_text()
    assert "WanImageToVideoPipeline.from_pretrained" in log and "image mode" in log and "image=" in log
    settings = read_run_settings(out / "run_settings.json")
    assert settings.pipeline_class == "WanImageToVideoPipeline" and settings.teacher_kind == "ti2v-5b"

    pipe = WanImageToVideoPipeline.from_pretrained(out / "pipeline")
    assert pipe.transformer_2 is None and pipe.config.expand_timesteps is True
    stock = _stock(pipe, 5, image)
    ours = _ours(root, out, 5, image=True)
    _close(ours, stock)
    # frame 0 is the image's latent: the student's prediction never touches it
    vae = load_vae(root / TEACHER, CPU)
    pixels = ImagePreprocessor(SIZE, SIZE, 16).processor.preprocess(
        load_image(str(image)), height=SIZE, width=SIZE
    )
    image_latent = vae.encode(pixels.unsqueeze(2)).latent_dist.mode()[0, :, 0]
    _close(ours[:, 0], image_latent, atol=1e-4)
    student = ["--student", str(out / "student"), "--seed", "5"]
    _close(_generate_latent([*student, "--prompt", PROMPT, "--image", str(image)]), stock)
    _close(_generate_latent([*student, "--prompts_file", str(root / "data" / "pairs.jsonl")]), stock)

    # the cards' calls run as printed, with the image: the pipeline folder and the student in the
    # teacher's folder sample alike
    monkeypatch.chdir(tmp_path)
    shutil.copy(image, tmp_path / EXAMPLE_IMAGE)
    frames = {}
    for name in ("pipeline", "student"):
        card = (out / name / "README.md").read_text()
        assert "# Wan 2.2 TI2V-5B (image to video) distilled student" in card
        code = re.search(r"```python\n(.*?)```", card, re.S).group(1)
        assert "WanImageToVideoPipeline.from_pretrained" in code and "image=image" in code
        exec(code, {"__name__": "card"})
        frames[name] = read_frames(tmp_path / "sample.mp4")
    assert frames["pipeline"].shape == (FRAMES, SIZE, SIZE, 3)
    np.testing.assert_array_equal(frames["pipeline"], frames["student"])


def test_the_monitor_samples_a_text_mode_run(text_run):
    samples = text_run / "samples"
    assert read_frames(samples / "step_00000003_prompt_01.mp4").shape == (FRAMES, SIZE, SIZE, 3)
    assert (samples / "teacher_prompt_00.mp4").is_file() and (samples / "grid_step_00000003.png").is_file()


def test_the_monitor_samples_and_reports_an_image_mode_run_with_one_transformer(root, image_run):
    samples = image_run / "samples"
    assert sorted(p.name for p in samples.glob("teacher_prompt_*.mp4")) == [
        "teacher_prompt_00.mp4",
        "teacher_prompt_01.mp4",
    ]
    assert (samples / "grid_step_00000003.png").is_file() and (
        samples / "step_00000003_prompt_01.mp4"
    ).is_file()
    result = json.loads((image_run / "eval" / "step_00000003" / "eval.json").read_text())
    assert result["boundary_timestep"] is None and list(result["denoiser"]["by_expert"]) == ["transformer"]
    assert result["cost"]["teacher"]["guidance_scale"] == [4.0]
    assert result["cost"]["teacher"]["forwards_per_sample"] == 2 * STEPS  # one transformer, guided
    assert np.isfinite(result["sampler"]["latent_mse"]) and result["num_prompts"] == 2
    assert read_frames(samples / "step_00000003_prompt_00.mp4").shape == (FRAMES, SIZE, SIZE, 3)


def test_the_default_sample_prompts_are_refused_for_an_image_mode_run(root, tmp_path):
    args = train_args(
        root / TEACHER, tmp_path / "out", tmp_path / "cache", student_config=REPO / "config/student_tiny_ti2v.json",
        data_path=root / "data" / "pairs.jsonl", height=SIZE, width=SIZE, num_frames=FRAMES, save_samples=True,
    )  # fmt: skip
    with pytest.raises(DistillError) as refused:
        Distiller(parse_config(args))
    assert "--sample_prompts" in refused.value.title and "image mode" in refused.value.title


def test_generate_and_evaluate_run_on_the_ti2v_teacher_and_students(
    root, text_run, image_run, tmp_path, capsys
):
    image = str(root / "data" / "images" / "1.png")
    teacher = ["--teacher_only", "--teacher_path", str(root / TEACHER), "--steps", "2", "--prompt", PROMPT]
    sizes = [
        "--height",
        str(SIZE),
        "--width",
        str(SIZE),
        "--num_frames",
        str(FRAMES),
        "--max_sequence_length",
        "16",
    ]
    assert generate.main([*teacher, *sizes, "--output", str(tmp_path / "text.mp4")]) == 0
    assert generate.main([*teacher, *sizes, "--image", image, "--output", str(tmp_path / "image.mp4")]) == 0
    assert read_frames(tmp_path / "image.mp4").shape == (FRAMES, SIZE, SIZE, 3)
    assert (
        generate.main(
            ["--student", str(text_run / "student"), "--prompt", PROMPT, "--output", str(tmp_path / "s.mp4")]
        )
        == 0
    )
    # the text-mode student's clip continued from its last frame by the image-mode one (--continue_with)
    chained = tmp_path / "chained.mp4"
    text_then_image = ["--student", str(text_run / "student"), "--continue_with", str(image_run / "student")]
    assert generate.main([*text_then_image, "--prompt", PROMPT, "--num_frames", str(3 * FRAMES - 2),
                          "--output", str(chained)]) == 0  # fmt: skip
    assert read_frames(chained).shape == (3 * FRAMES - 2, SIZE, SIZE, 3)  # a clip, then two hops
    capsys.readouterr()

    argv = ["--num_buckets", "2", "--teacher_steps", "2", "--steps", "2"]
    text = ["--student", str(text_run / "student"), "--prompts", str(root / "data" / "prompts.txt")]
    assert evaluate.main([*text, *argv, "--output_dir", str(tmp_path / "eval_text")]) == 0
    printed = capsys.readouterr().out
    assert "high-noise" not in printed and "denoiser MSE" in printed
    result = json.loads((tmp_path / "eval_text" / "eval.json").read_text())
    assert result["boundary_timestep"] is None and list(result["denoiser"]["by_expert"]) == ["transformer"]
    assert (tmp_path / "eval_text" / "eval.png").is_file()
    pairs = ["--student", str(image_run / "student"), "--prompts", str(root / "data" / "pairs.jsonl")]
    assert evaluate.main([*pairs, *argv, "--output_dir", str(tmp_path / "eval_image")]) == 0
    result = json.loads((tmp_path / "eval_image" / "eval.json").read_text())
    # prompt 0 from its image, seed 0: the stock teacher (its guidance) against the stock student
    stock_teacher = WanImageToVideoPipeline.from_pretrained(root / TEACHER)
    stock_teacher.set_progress_bar_config(disable=True)
    expected_teacher = stock_teacher(
        image=load_image(str(root / "data" / "images" / "0.png")), prompt=PROMPT, negative_prompt="",
        height=SIZE, width=SIZE, num_frames=FRAMES, num_inference_steps=2, guidance_scale=4.0,
        max_sequence_length=LENGTH, generator=torch.Generator("cpu").manual_seed(0), output_type="latent",
    ).frames[0]  # fmt: skip
    student = _stock(
        WanImageToVideoPipeline.from_pretrained(image_run / "pipeline"), 0, root / "data/images/0.png"
    )
    recorded = result["sampler"]["per_prompt"][0]["latent_mse"]
    assert recorded == pytest.approx(float((student - expected_teacher).pow(2).mean()), rel=1e-4)


def _refused(main, argv: list[str], capsys) -> str:
    assert main(argv) != 0
    err = capsys.readouterr().err
    assert "Traceback" not in err and "ERROR" in err
    return err


def test_inputs_of_the_other_mode_are_refused_naming_the_runs_mode(
    root, text_run, image_run, tmp_path, capsys
):
    image = str(root / "data" / "images" / "0.png")
    out = ["--output", str(tmp_path / "never.mp4")]
    err = _refused(
        generate.main,
        ["--student", str(text_run / "student"), "--prompt", PROMPT, "--image", image, *out],
        capsys,
    )
    assert "distilled from Wan2.2-TI2V-5B in text mode" in err and "leave out --image" in err
    assert str(text_run / "student" / "run_settings.json") in err
    err = _refused(generate.main, ["--student", str(image_run / "student"), "--prompt", PROMPT, *out], capsys)
    assert "--image is required" in err and "in image mode" in err and "--image FIRST_FRAME.png" in err
    pairs = ["--prompts_file", str(root / "data" / "pairs.jsonl"), "--output", str(tmp_path / "never")]
    err = _refused(generate.main, ["--student", str(text_run / "student"), *pairs], capsys)
    assert "text mode" in err and "pairs.jsonl" in err
    text_continues = ["--continue_with", str(text_run / "student"), "--num_frames", str(2 * FRAMES - 1)]
    err = _refused(generate.main, ["--student", str(text_run / "student"), "--prompt", PROMPT,
                                   *text_continues, *out], capsys)  # fmt: skip
    assert "is a text-to-video student: it cannot go on from a frame" in err and "in text mode" in err
    evaluate_argv = ["--output_dir", str(tmp_path / "never_eval")]
    err = _refused(evaluate.main, ["--student", str(image_run / "student"), "--prompts",
                                   str(root / "data" / "prompts.txt"), *evaluate_argv], capsys)  # fmt: skip
    assert "--prompts must pair each prompt with an image" in err and "image mode" in err
    err = _refused(evaluate.main, ["--student", str(text_run / "student"), "--prompts",
                                   str(root / "data" / "pairs.jsonl"), *evaluate_argv], capsys)  # fmt: skip
    assert "text mode" in err


def test_a_student_of_another_model_a_second_guidance_and_bad_frames_are_refused(
    root, text_run, tiny_teacher, tmp_path, capsys
):
    # A 16-channel (T2V-A14B) student with the 48-channel TI2V teacher, and the reverse.
    config = json.loads((REPO / "config" / "student_tiny.json").read_text())
    config.pop("_class_name")
    WanTransformer3DModel(**config).save_pretrained(tmp_path / "t2v_student")
    sizes = ["--height", str(SIZE), "--width", str(SIZE), "--num_frames", str(FRAMES)]
    out = ["--output", str(tmp_path / "never.mp4")]
    err = _refused(generate.main, ["--student", str(tmp_path / "t2v_student"), "--teacher_path",
                                   str(root / TEACHER), "--prompt", PROMPT, *sizes, *out], capsys)  # fmt: skip
    assert "a Wan2.2-T2V-A14B student" in err and "Wan2.2-TI2V-5B teacher" in err
    assert "latent channels differ: the student predicts 16, this teacher's VAE makes 48" in err
    assert "--teacher_path Wan-AI/Wan2.2-T2V-A14B-Diffusers" in err
    err = _refused(generate.main, ["--student", str(text_run / "student"), "--teacher_path", str(tiny_teacher),
                                   "--prompt", PROMPT, "--height", "16", "--width", "16", *out], capsys)  # fmt: skip
    assert "a Wan2.2-TI2V-5B student" in err and f"--teacher_path {root / TEACHER}" in err
    teacher = ["--teacher_only", "--teacher_path", str(root / TEACHER), "--prompt", PROMPT, *sizes, *out]
    err = _refused(generate.main, [*teacher, "--guidance_2", "2"], capsys)
    assert "--guidance_2" in err and "one transformer" in err and "drop --guidance_2" in err
    err = _refused(generate.main, [*teacher[:-6], "--num_frames", "6", *out], capsys)
    assert "--num_frames must be 4k+1" in err and "--num_frames 5" in err
    # training: an A14B student config with the TI2V teacher names the TI2V configs
    for config, model in (
        ("student_tiny.json", "Wan2.2-T2V-A14B"),
        ("student_tiny_i2v.json", "Wan2.2-I2V-A14B"),
    ):
        args = train_args(root / TEACHER, tmp_path / "o", tmp_path / "c", student_config=REPO / "config" / config,
                          height=SIZE, width=SIZE, num_frames=FRAMES)  # fmt: skip
        with pytest.raises(DistillError) as refused:
            Distiller(parse_config(args))
        assert f"is written for {model}, not for this Wan2.2-TI2V-5B teacher" in refused.value.title
        assert "config/student_tiny_ti2v.json" in refused.value.fixes[0]
    err = _refused(evaluate.main, ["--student", str(text_run / "student"), "--prompts", str(root / "data/prompts.txt"),
                                   "--guidance_scale_2", "2", "--output_dir", str(tmp_path / "e")], capsys)  # fmt: skip
    assert "--guidance_scale_2" in err and "one transformer" in err


def test_verify_preset_and_doctor_know_the_one_transformer_layout(root, tmp_path, capsys):
    import download_wan

    assert download_wan.main(["--verify", str(root / TEACHER)]) == 0
    said = capsys.readouterr().out
    assert "OK:" in said and "Wan2.2-TI2V-5B" in said and "transformer_2" not in said
    assert download_wan.teacher_problems(root / TEACHER) == []
    broken = tmp_path / TEACHER
    shutil.copytree(root / TEACHER, broken)
    shutil.rmtree(broken / "transformer")
    assert download_wan.main(["--verify", str(broken)]) != 0
    err = capsys.readouterr().err
    assert "missing transformer/" in err and "transformer_2" not in err
    preset = download_wan.PRESETS["wan2.2-ti2v-5b"]
    assert preset.repo_id == "Wan-AI/Wan2.2-TI2V-5B-Diffusers" and "transformer_2/" not in preset.required
    # what a download of the preset checks when it ends: the whole one-transformer teacher
    assert download_wan._check_download(preset, root / TEACHER) == 0
    with pytest.raises(DistillError, match="incomplete"):
        download_wan._check_download(preset, broken)
    assert doctor.main(["--teacher_path", str(root / TEACHER)]) == 0
    assert "Wan2.2-TI2V-5B" in capsys.readouterr().out


def test_a_lora_of_the_one_transformer_loads_in_stock_i2v_and_merged_samples_alike(root, lora_run):
    out, image = lora_run, root / "data" / "images" / "0.png"
    assert sorted(p.name for p in (out / "lora").glob("*.safetensors")) == ["lora.safetensors"]
    assert "LoRA adapters for the one transformer" in (out / "export.log").read_text()
    code = re.search(r"```python\n(.*?)```", (out / "lora" / "README.md").read_text(), re.S).group(1)
    assert 'weight_name="lora.safetensors"' in code and "load_into_transformer_2" not in code
    assert "WanImageToVideoPipeline.from_pretrained" in code
    ours = _generate_latent(
        ["--student", str(out / "lora"), "--prompt", PROMPT, "--image", str(image), "--seed", "7"]
    )
    settings = read_run_settings(out / "lora" / "run_settings.json")
    stock = WanImageToVideoPipeline.from_pretrained(root / TEACHER)
    stock.load_lora_weights(str(out / "lora"), weight_name="lora.safetensors", adapter_name="fast")
    stock.scheduler = scheduler_from_config(settings.scheduler)
    _close(_stock(stock, 7, image, stochastic=True), ours)
    merged = WanImageToVideoPipeline.from_pretrained(out / "merged")
    assert merged.transformer_2 is None and merged.config.expand_timesteps is True
    _close(_stock(merged, 7, image, stochastic=True), ours, atol=1e-4)  # W + BA rounds once more
    argv = ["--student", str(out / "merged"), "--prompt", PROMPT, "--image", str(image), "--seed", "7"]
    _close(_generate_latent(argv), ours, atol=1e-4)  # generate takes the one merged transformer too
    teacher_alone = WanImageToVideoPipeline.from_pretrained(root / TEACHER)
    teacher_alone.scheduler = scheduler_from_config(settings.scheduler)
    assert float((_stock(teacher_alone, 7, image, stochastic=True) - ours).abs().max()) > 1e-3
