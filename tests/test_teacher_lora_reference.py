"""generate and evaluate with a teacher that carries the user's LoRAs (--teacher_lora, or the ones the
student's run was distilled against): the reference is the fused teacher, as stock diffusers fuses
the same files, and bad input is refused with the trainer's banners before anything is written."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import imageio.v2 as imageio
import pytest
import torch
from conftest import train_args
from test_teacher_lora import write_user_lora

from distill import evaluate, generate
from distill.ops.errors import Stage
from train_distillation import main as train

CONFIG = int(Stage.CONFIG)
# One 16x16 picture, 2 steps, no negative prompt; the teacher's guidance (4 / 3).
ONE_MODEL = ["--height", "16", "--width", "16", "--num_frames", "1", "--steps", "2", "--seed", "3"]
ONE_MODEL += ["--max_sequence_length", "16", "--prompt", "a red cube"]
RENDER = [*ONE_MODEL, "--guidance", "4", "--guidance_2", "3"]


@pytest.fixture(scope="module")
def run(tiny_teacher, tmp_path_factory) -> tuple[Path, Path]:
    """(student folder, the user's pair) of a run distilled against the teacher with the pair at 0.7."""
    root = tmp_path_factory.mktemp("distilled_with_lora")
    pair = root / "style"
    write_user_lora(pair / "style_high_noise.safetensors", seed=1)
    write_user_lora(pair / "style_low_noise.safetensors", seed=2)
    args = train_args(tiny_teacher, root / "out", root / "cache", num_steps=2, max_prompts=4)
    assert train([*args, "--teacher_lora", f"{pair}:0.7"]) == 0
    return root / "out" / "student", pair


def stock_latent(teacher: Path, pair: Path | None) -> torch.Tensor:
    """The same sample from stock WanPipeline, the pair loaded with load_lora_weights and fused."""
    from diffusers import WanPipeline

    pipe = WanPipeline.from_pretrained(teacher)
    if pair is not None:
        pipe.load_lora_weights(pair, weight_name="style_high_noise.safetensors", adapter_name="style")
        pipe.load_lora_weights(
            pair, weight_name="style_low_noise.safetensors", adapter_name="s2", load_into_transformer_2=True
        )
        pipe.fuse_lora(lora_scale=0.7, components=["transformer", "transformer_2"])
    return pipe(
        prompt="a red cube",
        negative_prompt="",
        height=16,
        width=16,
        num_frames=1,
        num_inference_steps=2,
        guidance_scale=4.0,
        guidance_scale_2=3.0,
        generator=torch.Generator("cpu").manual_seed(3),
        output_type="latent",
        max_sequence_length=16,
    ).frames[0]


def generate_latent(argv: list[str]) -> torch.Tensor:
    """What `python -m distill.generate ARGV` samples for its one prompt, as the final latent (the
    tiny teacher's VAE decodes a LoRA's change of the latent to less than one level of a PNG)."""
    args = generate.build_parser().parse_args([*argv, "--output", "unused.png", "--device", "cpu"])
    pipe, prompts, _, _ = generate.prepare(args)
    return generate.render(pipe, args, prompts[0], args.seed, output_type="latent")


def test_generate_renders_the_teacher_the_student_was_distilled_against(run, tiny_teacher, tmp_path, caplog):
    student, pair = run
    # No flag: the run's LoRAs (recorded in run_settings.json), said in the log.
    recorded = generate_latent(["--student", str(student), "--teacher_only", *RENDER])
    assert "the teacher carries the LoRAs the student was distilled against" in caplog.text
    # The flag, without a run: the same teacher; `none`: the bare one.
    flag = ["--teacher_path", str(tiny_teacher), "--teacher_only", *RENDER]
    given = generate_latent([*flag, "--teacher_lora", f"{pair}:0.7"])
    bare = generate_latent([*flag, "--teacher_lora", "none"])
    fused = stock_latent(tiny_teacher, pair)
    for ours in (recorded, given):  # stock diffusers' load_lora_weights + fuse_lora
        torch.testing.assert_close(ours, fused, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(bare, stock_latent(tiny_teacher, None), rtol=1e-4, atol=1e-5)
    assert (fused - bare).abs().max() > 0.1  # the LoRA changed the sample
    # The command itself writes the picture.
    assert generate.main([*flag, "--teacher_lora", f"{pair}:0.7", "--output", str(tmp_path / "a")]) == 0
    assert imageio.imread(tmp_path / "a.png").shape == (16, 16, 3)


def test_generate_refuses_bad_teacher_loras_before_anything_renders(run, tiny_teacher, tmp_path, capsys):
    student, pair = run
    half = tmp_path / "half"
    half.mkdir()
    shutil.copy(pair / "style_high_noise.safetensors", half)
    teacher = [
        "--teacher_path",
        str(tiny_teacher),
        "--teacher_only",
        *RENDER,
        "--output",
        str(tmp_path / "x"),
    ]
    cases = {
        f"{pair}:abc": "the scale 'abc' is not a finite number",
        str(half): "half a pair: the folder has a high-noise LoRA",
        str(tmp_path / "nowhere.safetensors"): "does not exist",
    }
    for spec, words in cases.items():
        assert generate.main([*teacher, "--teacher_lora", spec]) == CONFIG
        err = capsys.readouterr().err
        assert f"--teacher_lora {spec}" in err and words in err, err
    assert generate.main([*teacher, "--teacher_lora", "none", "--teacher_lora", str(pair)]) == CONFIG
    assert "pass --teacher_lora none alone" in capsys.readouterr().err
    # A full student's own weights hold the teacher it learned: the flag would be ignored.
    code = generate.main(
        ["--student", str(student), *ONE_MODEL, "--teacher_lora", str(pair), "--output", str(tmp_path / "x")]
    )
    err = capsys.readouterr().err
    assert code == CONFIG and "--teacher_lora needs --teacher_only or a LoRA student" in err, err
    assert not list(tmp_path.glob("x*"))


def evaluate_args(student: Path, out: Path) -> list[str]:
    return [
        "--student",
        str(student),
        "--prompts",
        str(Path(__file__).parents[1] / "data" / "static_prompts.txt"),
    ] + [
        "--output_dir",
        str(out),
        "--max_prompts",
        "1",
        "--steps",
        "2",
        "--num_buckets",
        "2",
        "--seed",
        "0",
    ]


def numbers(out: Path) -> tuple[float, float]:
    result = json.loads((out / "eval.json").read_text())
    return result["denoiser"]["mse"], result["sampler"]["latent_mse"]


def test_evaluate_compares_with_the_run_s_teacher_and_refuses_a_lora_gone_or_changed(run, tmp_path, capsys):
    student, pair = run
    assert evaluate.main(evaluate_args(student, tmp_path / "recorded")) == 0
    recorded = json.loads((tmp_path / "recorded" / "eval.json").read_text())
    assert [(r["expert"], r["scale"]) for r in recorded["teacher_loras"]] == [
        ("transformer", 0.7),
        ("transformer_2", 0.7),
    ]
    # The pair moved: refused naming the file, nothing written; the fix (its new place) is accepted.
    moved = tmp_path / "moved"
    shutil.copytree(pair, moved)
    shutil.rmtree(pair)
    try:
        assert evaluate.main(evaluate_args(student, tmp_path / "gone")) == CONFIG
        err = capsys.readouterr().err
        assert "style_high_noise.safetensors, a LoRA the student's teacher carried, is gone" in err, err
        # The fix names the pair again, both files (a folder is recorded as its files).
        assert (
            "--teacher_lora NEW/PATH/style_high_noise.safetensors:0.7 "
            "--teacher_lora NEW/PATH/style_low_noise.safetensors:0.7" in err
        ), err
        assert not (tmp_path / "gone" / "eval.json").exists()
        given = evaluate_args(student, tmp_path / "given")
        assert evaluate.main([*given, "--teacher_lora", f"{moved}:0.7"]) == 0
        assert numbers(tmp_path / "given") == numbers(tmp_path / "recorded")  # the same teacher
        # Changed since the run: refused naming it; --teacher_lora none is accepted (the bare teacher).
        shutil.copytree(moved, pair)
        write_user_lora(pair / "style_low_noise.safetensors", seed=5)
        assert evaluate.main(evaluate_args(student, tmp_path / "changed")) == CONFIG
        err = capsys.readouterr().err
        assert "style_low_noise.safetensors has changed since the student was distilled against it" in err, (
            err
        )
        assert evaluate.main([*evaluate_args(student, tmp_path / "bare"), "--teacher_lora", "none"]) == 0
        assert numbers(tmp_path / "bare") != numbers(tmp_path / "recorded")
        assert json.loads((tmp_path / "bare" / "eval.json").read_text())["teacher_loras"] == []
        assert (
            evaluate.main([*evaluate_args(student, tmp_path / "x"), "--teacher_lora", f"{moved}:inf"])
            == CONFIG
        )
        assert "the scale 'inf' is not a finite number" in capsys.readouterr().err
    finally:
        shutil.rmtree(pair, ignore_errors=True)
        shutil.copytree(moved, pair)


def test_a_lora_student_samples_on_the_fused_teacher_as_stock_diffusers_stacks_them(
    run, tiny_teacher, tmp_path
):
    """A speed LoRA distilled against teacher + user pair: generate runs base + user + speed, as a
    user stacks them in stock WanPipeline (the user's pair fused, then both speed adapters)."""
    from diffusers import WanPipeline

    _, pair = run
    args = train_args(
        tiny_teacher, tmp_path / "out", tmp_path / "cache", num_steps=2, max_prompts=4, student_config=None
    )
    assert train([*args, "--student_lora_rank", "4", "--teacher_lora", f"{pair}:0.7"]) == 0
    lora = tmp_path / "out" / "lora"
    ours = generate_latent(["--student", str(lora), *ONE_MODEL])  # the run's pair, by default
    bare = generate_latent(["--student", str(lora), *ONE_MODEL, "--teacher_lora", "none"])
    pipe = WanPipeline.from_pretrained(tiny_teacher)
    pipe.load_lora_weights(pair, weight_name="style_high_noise.safetensors", adapter_name="style")
    pipe.load_lora_weights(
        pair, weight_name="style_low_noise.safetensors", adapter_name="s2", load_into_transformer_2=True
    )
    pipe.fuse_lora(lora_scale=0.7, components=["transformer", "transformer_2"])
    pipe.unload_lora_weights()
    pipe.load_lora_weights(lora, weight_name="high_noise_lora.safetensors", adapter_name="fast")
    pipe.load_lora_weights(
        lora, weight_name="low_noise_lora.safetensors", adapter_name="fast_2", load_into_transformer_2=True
    )
    stock = pipe(
        prompt="a red cube",
        height=16,
        width=16,
        num_frames=1,
        num_inference_steps=2,
        guidance_scale=1.0,
        generator=torch.Generator("cpu").manual_seed(3),
        output_type="latent",
        max_sequence_length=16,
    ).frames[0]
    torch.testing.assert_close(ours, stock, rtol=1e-4, atol=1e-5)
    assert (ours - bare).abs().max() > 0.1
