"""An image-to-video run's exports work with stock diffusers and no glue: pipeline/ (and a LoRA
run's merged/) load with WanImageToVideoPipeline.from_pretrained and sample what our own sampling of
the student gives from the same image, prompt and seed; the LoRA files load with its
load_lora_weights in both key formats; generate and evaluate take images (--image, or a prompts
file pairing them) and refuse what cannot work by naming the flag. On the tiny random I2V-A14B
teacher, students trained for real for a few steps (16x16, 5 frames)."""

from __future__ import annotations

import json
import logging
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import REPO, train_args
from diffusers import WanImageToVideoPipeline, WanTransformer3DModel
from diffusers.utils import load_image
from PIL import Image
from safetensors.torch import load_file

from distill import evaluate, generate
from distill.config.cli import parse_config
from distill.data.images import ImagePreprocessor
from distill.models.conditioning import image_condition
from distill.models.few_step import load_few_step_scheduler, sample_few_step
from distill.models.lora_files import FILES, WAN_FORMAT_DIR
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
from distill.models.teacher_kind import I2V_A14B
from distill.models.tiny import write_tiny_teacher
from distill.sample.card_code import EXAMPLE_IMAGE
from distill.sample.media import read_frames
from distill.sample.run_settings import read_run_settings
from distill.sample.student_folder import load_lora_student, load_student
from distill.train.trainer import Distiller

pytestmark = pytest.mark.usefixtures("one_thread")

SIZE, FRAMES, LENGTH, STEPS = 16, 5, 16, 2
PROMPT = "a red ball rolling to the left"
CPU = torch.device("cpu")


def _close(actual: torch.Tensor, expected: torch.Tensor, atol: float = 1e-5) -> None:
    """Equal up to float rounding, relative to the sample's scale."""
    scale = float(expected.abs().max())
    assert scale > 0
    torch.testing.assert_close(actual.float(), expected.float(), rtol=0, atol=atol * max(scale, 1.0))


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    """The teacher (named as download_wan.py names the hub repo's folder) and a prompts file pairing
    two prompts with two 16x16 images."""
    root = tmp_path_factory.mktemp("i2v_export")
    write_tiny_teacher(root / "Wan2.2-I2V-A14B-Diffusers", seed=0, kind=I2V_A14B)
    (root / "data" / "images").mkdir(parents=True)
    for i in range(2):
        pixels = np.random.default_rng(i).integers(0, 256, size=(SIZE, SIZE, 3), dtype=np.uint8)
        Image.fromarray(pixels).save(root / "data" / "images" / f"{i}.png")
    lines = [{"prompt": PROMPT, "image": "images/0.png"}, {"prompt": "a blue box", "image": "images/1.png"}]
    (root / "data" / "pairs.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    config = json.loads((REPO / "config" / "student_tiny.json").read_text())
    (root / "student_i2v.json").write_text(json.dumps({**config, "in_channels": 36}))
    return root


def _train(root: Path, name: str, **overrides: object) -> Path:
    """A short real run on the I2V teacher; its export's log lines are kept in <out>/export.log."""
    out = root / name
    args = train_args(
        root / "Wan2.2-I2V-A14B-Diffusers",
        out,
        root / "cache",
        data_path=root / "data" / "pairs.jsonl",
        height=SIZE,
        width=SIZE,
        num_frames=FRAMES,
        max_sequence_length=LENGTH,
        sample_steps=STEPS,
        num_steps=3,
        **overrides,
    )
    return run_keeping_export_log(args, out)


def run_keeping_export_log(args: list[str], out: Path) -> Path:
    """Train with `args` in this process; the export's log lines are kept in <out>/export.log."""
    lines: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())  # type: ignore[method-assign]
    logger = logging.getLogger("distill.train.export")
    logger.addHandler(handler)
    old_level = logger.level
    logger.setLevel(logging.INFO)
    try:
        Distiller(parse_config(args)).run()
    finally:
        logger.removeHandler(handler)
        logger.setLevel(old_level)
    (out / "export.log").write_text("\n".join(lines))
    return out


@pytest.fixture(scope="module")
def velocity_run(root: Path) -> Path:
    return _train(root, "velocity", student_config=root / "student_i2v.json")


@pytest.fixture(scope="module")
def dmd_run(root: Path) -> Path:
    return _train(
        root,
        "dmd",
        method="dmd",
        student_config=root / "student_i2v.json",
        student_steps=STEPS,
        critic_updates=1,
        lr=1e-3,
    )


@pytest.fixture(scope="module")
def lora_run(root: Path) -> Path:
    # A large rate, so the adapters move well away from zero in a few steps.
    return _train(
        root,
        "lora",
        method="dmd",
        student_lora_rank=4,
        student_config=None,
        student_init=None,
        student_steps=STEPS,
        critic_updates=1,
        lr=1e-2,
        export_formats="diffusers,merged",
    )


def _stock(
    pipe, image_file: Path, seed: int, steps: int, stochastic: bool, output_type: str = "latent"
) -> torch.Tensor:
    """The stock pipeline's final latent (or frames) for the image file, PROMPT and seed, as the model
    card calls it; a few-step scheduler re-noises from the global RNG, seeded the way generate seeds it."""
    generator = torch.Generator("cpu").manual_seed(seed)
    if stochastic:
        torch.manual_seed(seed)
        generator = None
    pipe.set_progress_bar_config(disable=True)
    return pipe(
        image=load_image(str(image_file)),
        prompt=PROMPT,
        height=SIZE,
        width=SIZE,
        num_frames=FRAMES,
        num_inference_steps=steps,
        guidance_scale=1.0,
        max_sequence_length=LENGTH,
        generator=generator,
        output_type=output_type,
    ).frames[0]


def _ours(root: Path, folder: Path):
    """(teacher info, the prompt's embedding, the first image preprocessed, the VAE)."""
    info = inspect_teacher(read_run_settings(folder / "run_settings.json").teacher_path)
    embeds = encode_prompts(info.path, [PROMPT], LENGTH, CPU, torch.float32)[PROMPT]
    pixels = ImagePreprocessor(SIZE, SIZE).processor.preprocess(
        load_image(str(root / "data" / "images" / "0.png")), height=SIZE, width=SIZE
    )
    return info, embeds, pixels, load_vae(info.path, CPU)


def _generate_latent(argv: list[str], prompt_index: int = 0, output_type: str = "latent") -> torch.Tensor:
    """distill.generate's own sample (its pipeline, image reading and seeding) as a latent (or frames)."""
    args = generate.build_parser().parse_args([*argv, "--output", "unused.mp4"])
    found = generate.resolve_defaults(args)
    info = inspect_teacher(args.teacher_path)
    from distill.sample.image_inputs import prompt_images

    images = prompt_images(
        info.kind, info.path, len(args.prompt or []), args.image, args.prompts_file,
        args.height, args.width, info.vae_scale_spatial,
    )  # fmt: skip
    pipe = generate.build_pipeline(args, info, CPU, torch.float32, found[0] if found else None)
    prompts = generate.collect_prompts(args.prompt, args.prompts_file)
    seed = args.seed + prompt_index
    return generate.render(pipe, args, prompts[prompt_index], seed, output_type, image=images[prompt_index])


def test_pipeline_folder_is_stock_i2v_and_samples_as_the_student_does(root, velocity_run):
    out = velocity_run
    index = json.loads((out / "pipeline" / "model_index.json").read_text())
    teacher_index = json.loads((root / "Wan2.2-I2V-A14B-Diffusers" / "model_index.json").read_text())
    assert index["_class_name"] == "WanImageToVideoPipeline"
    assert index["image_encoder"] == teacher_index["image_encoder"] == [None, None]
    assert index["image_processor"] == [None, None] and index["transformer_2"] == [None, None]
    assert (out / "pipeline" / "vae").resolve() == (root / "Wan2.2-I2V-A14B-Diffusers" / "vae").resolve()
    assert "WanImageToVideoPipeline.from_pretrained" in (out / "export.log").read_text()
    assert read_run_settings(out / "run_settings.json").pipeline_class == "WanImageToVideoPipeline"

    stock = _stock(
        WanImageToVideoPipeline.from_pretrained(out / "pipeline"), root / "data/images/0.png", 5, STEPS, False
    )
    info, embeds, pixels, vae = _ours(root, out)
    student = load_student(out / "student", info, CPU, torch.float32)
    pipe = student_pipeline(student, load_scheduler(info.path), I2V_A14B, vae=vae)
    shape = info.latent_shape(SIZE, SIZE, FRAMES)
    ours = sample_latents(pipe, initial_noise(shape, 5), embeds, None, STEPS, 1.0, image=pixels)
    _close(ours, stock)
    # generate: --image, and a prompts file pairing the same image with the prompt (seed + index)
    _close(_generate_latent(["--student", str(out / "student"), "--prompt", PROMPT, "--image",
                             str(root / "data/images/0.png"), "--seed", "5"]), stock)  # fmt: skip
    _close(_generate_latent(["--student", str(out / "student"), "--prompts_file",
                             str(root / "data/pairs.jsonl"), "--seed", "5"]), stock)  # fmt: skip
    # and the frames it writes are the stock pipeline's, in [0, 1] (the preprocessed image must not
    # leave the decoded frames in the VAE's [-1, 1])
    stock_frames = _stock(
        WanImageToVideoPipeline.from_pretrained(out / "pipeline"),
        root / "data/images/0.png",
        5,
        STEPS,
        False,
        "np",
    )
    frames = _generate_latent(["--student", str(out / "student"), "--prompt", PROMPT, "--image",
                               str(root / "data/images/0.png"), "--seed", "5"], output_type="np")  # fmt: skip
    assert frames.min() >= 0.0
    np.testing.assert_allclose(frames, stock_frames, atol=1e-4)


def test_the_cards_call_runs_with_the_image_and_generate_writes_every_prompt(
    root, velocity_run, tmp_path, monkeypatch
):
    monkeypatch.chdir(tmp_path)
    shutil.copy(root / "data/images/0.png", tmp_path / EXAMPLE_IMAGE)
    frames = {}
    for name in ("pipeline", "student"):  # pipeline/ loads alone; student/ is put in the teacher's pipeline
        card = (velocity_run / name / "README.md").read_text()
        code = _code(card)
        assert "WanImageToVideoPipeline.from_pretrained" in code and "image=image" in code
        assert "load_image" in code and "pipeline_tag: image-to-video" in card and "I2V" in card
        exec(code, {"__name__": "card"})
        frames[name] = read_frames(tmp_path / "sample.mp4")
    np.testing.assert_array_equal(frames["pipeline"], frames["student"])
    written = tmp_path / "clips"
    argv = ["--student", str(velocity_run / "student"), "--prompts_file", str(root / "data/pairs.jsonl")]
    assert generate.main([*argv, "--output", str(written)]) == 0
    assert sorted(p.name for p in written.iterdir()) == ["all_clips.gif", "prompt_00.mp4", "prompt_01.mp4"]
    teacher = ["--teacher_only", "--teacher_path", str(root / "Wan2.2-I2V-A14B-Diffusers"), "--steps", "2"]
    sizes = ["--height", "16", "--width", "16", "--num_frames", "5", "--max_sequence_length", "16"]
    image = ["--image", str(root / "data/images/1.png"), "--prompt", PROMPT]
    assert generate.main([*teacher, *sizes, *image, "--output", str(tmp_path / "teacher.mp4")]) == 0


def test_a_few_step_student_samples_in_stock_i2v_as_its_rollout_does(root, dmd_run):
    out = dmd_run
    pipe = WanImageToVideoPipeline.from_pretrained(out / "pipeline")
    assert pipe.scheduler.config.stochastic_sampling  # the student's own sampler, not the teacher's
    stock = _stock(pipe, root / "data/images/0.png", 3, STEPS, True)
    info, embeds, pixels, vae = _ours(root, out)
    student = load_student(out / "student", info, CPU, torch.float32)
    condition = image_condition(vae, pixels, FRAMES)
    ours = sample_few_step(
        student, load_few_step_scheduler(out / "student"), STEPS, embeds[None],
        info.latent_shape(SIZE, SIZE, FRAMES), 3, condition=condition, kind=I2V_A14B,
    )[0]  # fmt: skip
    _close(ours, stock)
    argv = ["--student", str(out / "student"), "--prompt", PROMPT, "--image", str(root / "data/images/0.png")]
    _close(_generate_latent([*argv, "--seed", "3"]), stock)


def test_lora_files_and_merged_experts_load_in_stock_i2v_and_sample_as_the_lora_student(
    root, lora_run, tmp_path, monkeypatch
):
    out, teacher = lora_run, root / "Wan2.2-I2V-A14B-Diffusers"
    expert_modules = {
        name for name, _ in WanTransformer3DModel.from_pretrained(teacher / "transformer").named_modules()
    }
    for which in FILES.values():
        keys = list(load_file(str(out / "lora" / which)))
        assert keys and not [k for k in keys if re.search(r"add_k_proj|add_v_proj|norm_added_k", k)]
        modules = {k.removeprefix("transformer.").rsplit(".", 2)[0] for k in keys}
        assert modules <= expert_modules, sorted(modules - expert_modules)[:3]
        wan = load_file(str(out / "lora" / WAN_FORMAT_DIR / which))
        assert not [k for k in wan if re.search(r"\.k_img|\.v_img|norm_k_img", k)]

    info, embeds, pixels, vae = _ours(root, out)
    student, high, low = load_lora_student(out / "lora", info, CPU, torch.float32)
    scheduler = scheduler_from_config(read_run_settings(out / "lora" / "run_settings.json").scheduler)
    shape = info.latent_shape(SIZE, SIZE, FRAMES)
    condition = image_condition(vae, pixels, FRAMES)
    ours = sample_few_step(
        student, scheduler, STEPS, embeds[None], shape, 7, condition=condition, kind=I2V_A14B
    )[0]
    teacher_alone = sample_few_step(
        high, scheduler, STEPS, embeds[None], shape, 7, condition=condition, kind=I2V_A14B
    )[0]
    assert float((ours - teacher_alone).abs().max()) > 1e-3  # the adapters do something

    image = root / "data/images/0.png"
    for folder in (out / "lora", out / "lora" / WAN_FORMAT_DIR):
        pipe = WanImageToVideoPipeline.from_pretrained(teacher)
        pipe.load_lora_weights(str(folder), weight_name=FILES["high"], adapter_name="fast")
        pipe.load_lora_weights(
            str(folder), weight_name=FILES["low"], adapter_name="fast_2", load_into_transformer_2=True
        )
        pipe.scheduler = scheduler_from_config(
            read_run_settings(out / "lora" / "run_settings.json").scheduler
        )
        _close(_stock(pipe, image, 7, STEPS, True), ours)
    merged = WanImageToVideoPipeline.from_pretrained(out / "merged")
    assert merged.transformer_2 is not None and merged.config.boundary_ratio == I2V_A14B.boundary_ratio
    _close(_stock(merged, image, 7, STEPS, True), ours, atol=1e-4)  # W + BA rounds once more
    code = _code((out / "lora" / "README.md").read_text())
    assert "WanImageToVideoPipeline.from_pretrained" in code and "image=image" in code
    monkeypatch.chdir(tmp_path)
    shutil.copy(image, tmp_path / EXAMPLE_IMAGE)
    exec(code, {"__name__": "card"})  # the teacher, both adapters loaded, its few-step scheduler
    assert read_frames(tmp_path / "sample.mp4").shape == (FRAMES, SIZE, SIZE, 3)
    argv = ["--student", str(out / "lora"), "--prompt", PROMPT, "--image", str(image), "--seed", "7"]
    _close(_generate_latent(argv), ours)
    argv[1] = str(out / "merged")  # generate takes the merged experts as it takes the adapters
    _close(_generate_latent(argv), ours, atol=1e-4)


def test_evaluate_compares_each_prompt_from_its_image(root, dmd_run, tmp_path, capsys):
    argv = ["--student", str(dmd_run / "student"), "--num_buckets", "2", "--teacher_steps", "2"]
    pairs = str(root / "data/pairs.jsonl")
    assert evaluate.main([*argv, "--prompts", pairs, "--output_dir", str(tmp_path / "eval")]) == 0
    result = json.loads((tmp_path / "eval" / "eval.json").read_text())
    assert result["num_prompts"] == 2 and np.isfinite(result["sampler"]["latent_mse"])
    # prompt 0 from its image, seed 0: the stock teacher (its guidance) against the stock student
    teacher = WanImageToVideoPipeline.from_pretrained(root / "Wan2.2-I2V-A14B-Diffusers")
    teacher.set_progress_bar_config(disable=True)
    expected_teacher = teacher(
        image=load_image(str(root / "data/images/0.png")),
        prompt=PROMPT,
        negative_prompt="",
        height=SIZE,
        width=SIZE,
        num_frames=FRAMES,
        num_inference_steps=2,
        guidance_scale=4.0,
        guidance_scale_2=3.0,
        max_sequence_length=LENGTH,
        generator=torch.Generator("cpu").manual_seed(0),
        output_type="latent",
    ).frames[0]
    student = _stock(
        WanImageToVideoPipeline.from_pretrained(dmd_run / "pipeline"),
        root / "data/images/0.png",
        0,
        STEPS,
        True,
    )
    recorded = result["sampler"]["per_prompt"][0]["latent_mse"]
    assert recorded == pytest.approx(float((student - expected_teacher).pow(2).mean()), rel=1e-4)
    text = tmp_path / "prompts.txt"
    text.write_text(PROMPT + "\n")
    assert evaluate.main([*argv, "--prompts", str(text), "--output_dir", str(tmp_path / "e2")]) != 0
    assert "--prompts" in capsys.readouterr().err


def _code(card: str) -> str:
    return re.search(r"```python\n(.*?)```", card, re.S).group(1)


def _refused(argv: list[str], capsys, output: str = "never.mp4") -> str:
    assert generate.main([*argv, "--output", output]) != 0
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return err


def test_generate_refuses_what_cannot_work_naming_the_flag(
    root, velocity_run, tiny_teacher, tmp_path, capsys
):
    student = ["--student", str(velocity_run / "student"), "--prompt", PROMPT]
    err = _refused(student, capsys)
    assert "--image is required" in err and "Wan2.2-I2V-A14B" in err and "--prompts_file" in err
    err = _refused([*student, "--image", str(tmp_path / "nowhere.png")], capsys)
    assert "--image" in err and "nowhere.png: not found" in err
    (tmp_path / "broken.png").write_bytes(b"not an image")
    assert "--image" in _refused([*student, "--image", str(tmp_path / "broken.png")], capsys)
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"prompt": "a", "image": str(root / "data/images/0.png")}) + "\n"
                   + json.dumps({"prompt": "b", "image": "broken.png"}) + "\n")  # fmt: skip
    err = _refused(["--student", str(velocity_run / "student"), "--prompts_file", str(bad)], capsys, "never/")
    assert "--prompts_file" in err and "line 2" in err and "broken.png" in err
    both = ["--student", str(velocity_run / "student"), "--prompts_file", str(root / "data/pairs.jsonl")]
    err = _refused([*both, "--image", str(root / "data/images/0.png")], capsys, "never/")
    assert "--image" in err and "both give" in err
    t2v = [
        "--teacher_only",
        "--teacher_path",
        str(tiny_teacher),
        "--prompt",
        PROMPT,
        "--height",
        "16",
        "--width",
        "16",
    ]
    err = _refused([*t2v, "--image", str(root / "data/images/0.png")], capsys, "never.png")
    assert "--image" in err and "text only" in err
