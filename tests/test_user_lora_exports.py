"""What a speed LoRA distilled against a teacher with the user's LoRAs exports: merged/ holds base +
user + speed, and the model card's code stacks the speed LoRA and the user's pair as two adapters
(`set_adapters`), runs as written, and says how to chain them in ComfyUI."""

from __future__ import annotations

import re
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import train_args
from test_teacher_lora import write_user_lora

from distill.models.lora import stacking_adapters
from train_distillation import main as train

SCALE = 0.7


@pytest.fixture(scope="module")
def run(tiny_teacher, tmp_path_factory) -> tuple[Path, Path]:
    """(output folder, the user's pair) of a rank-4 speed LoRA distilled against teacher + pair at SCALE."""
    root = tmp_path_factory.mktemp("speed_for_user")
    pair = root / "style"
    write_user_lora(pair / "style_high_noise.safetensors", seed=1)
    write_user_lora(pair / "style_low_noise.safetensors", seed=2)
    args = train_args(
        tiny_teacher, root / "out", root / "cache", num_steps=2, max_prompts=4, student_config=None
    )
    extra = ["--student_lora_rank", "4", "--teacher_lora", f"{pair}:{SCALE}"]
    assert train([*args, *extra, "--export_formats", "diffusers,merged"]) == 0
    return root / "out", pair


def stock_stack(teacher: Path, pair: Path, lora: Path, *, fuse: bool):
    """Stock WanPipeline with the user's pair at SCALE and the speed LoRA at 1: fused into the weights
    (`fuse`), or left as four active adapters, as a user samples them."""
    from diffusers import WanPipeline

    pipe = WanPipeline.from_pretrained(teacher)
    with stacking_adapters():  # the card's code shows peft's warning (tested below); the stock stack need not
        pipe.load_lora_weights(pair, weight_name="style_high_noise.safetensors", adapter_name="user")
        pipe.load_lora_weights(
            pair,
            weight_name="style_low_noise.safetensors",
            adapter_name="user_2",
            load_into_transformer_2=True,
        )
        pipe.load_lora_weights(lora, weight_name="high_noise_lora.safetensors", adapter_name="fast")
        pipe.load_lora_weights(
            lora,
            weight_name="low_noise_lora.safetensors",
            adapter_name="fast_2",
            load_into_transformer_2=True,
        )
    pipe.set_adapters(["user", "user_2", "fast", "fast_2"], adapter_weights=[SCALE, SCALE, 1.0, 1.0])
    if fuse:
        pipe.fuse_lora(components=["transformer", "transformer_2"])
        pipe.unload_lora_weights()
    return pipe


def test_merged_holds_the_base_the_user_lora_and_the_speed_lora(run, tiny_teacher):
    from diffusers import WanTransformer3DModel

    out, pair = run
    stock = stock_stack(tiny_teacher, pair, out / "lora", fuse=True)
    bare = WanTransformer3DModel.from_pretrained(tiny_teacher / "transformer").state_dict()
    for name, expected in (("transformer", stock.transformer), ("transformer_2", stock.transformer_2)):
        merged = WanTransformer3DModel.from_pretrained(out / "merged" / name).state_dict()
        want = expected.state_dict()
        assert set(merged) == set(want), name
        for key, value in merged.items():
            torch.testing.assert_close(value, want[key], rtol=1e-5, atol=1e-6, msg=f"{name}: {key}")
    changed = [k for k, v in stock.transformer.state_dict().items() if not torch.equal(v, bare[k])]
    assert changed  # the comparison above is not between two bare teachers


def test_the_card_stacks_both_adapters_and_its_code_runs_as_written(run, tiny_teacher, tmp_path, monkeypatch):
    """The card's code loads the teacher, the speed LoRA and the user's pair as adapters, all active at
    their scales, and draws what the stock stack of the same four adapters draws."""
    from PIL import Image

    from distill.sample.model_card import write_model_card
    from distill.sample.run_settings import read_run_settings

    out, pair = run
    settings = read_run_settings(out / "lora" / "run_settings.json")
    settings.teacher_path = str(tiny_teacher)
    card = write_model_card(out / "lora", settings, "lora").read_text()
    code = re.search(r"```python\n(.*?)```", card, re.S).group(1)
    assert "pipe.set_adapters(['fast', 'fast_2', 'user_0', 'user_1']" in code
    assert f"adapter_weights=[1.0, 1.0, {SCALE}, {SCALE}]" in code
    assert "style_low_noise.safetensors', adapter_name='user_1', load_into_transformer_2=True" in code
    comfy = card.split("## With the LoRAs it was distilled against", 1)[1].split("## Training", 1)[0]
    assert (
        f"`style_high_noise.safetensors` at strength {SCALE}, then this folder's `comfyui/high_noise" in comfy
    )
    assert (
        f"`style_low_noise.safetensors` at strength {SCALE}, then this folder's `comfyui/low_noise" in comfy
    )
    monkeypatch.chdir(tmp_path)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        exec(code, {"__name__": "card"})
    # peft's "several adapters" warning reaches whoever runs the card: the card says it is intended
    assert [w for w in caught if "Already found a `peft_config`" in str(w.message)]
    assert "# peft warns that the model then holds several adapters: here that is the point" in code
    drawn = np.asarray(Image.open(tmp_path / "sample.png")).astype(np.float64)
    # The same call on the stock stack built here (the card's prompt, size, steps and seed).
    stock = stock_stack(tiny_teacher, pair, out / "lora", fuse=False)
    assert settings.scheduler is None  # a velocity run samples with the teacher's own scheduler
    prompt = re.search(r"prompt=('.*?'),", code).group(1)
    frames = stock(
        prompt=eval(prompt),
        height=settings.height,
        width=settings.width,
        num_frames=settings.num_frames,
        num_inference_steps=settings.num_inference_steps,
        guidance_scale=settings.guidance_scale,
        max_sequence_length=settings.max_sequence_length,
        generator=torch.Generator("cpu").manual_seed(0),
        output_type="np",
    ).frames[0]
    expected = (frames[0] * 255).round().astype(np.uint8).astype(np.float64)
    assert np.abs(drawn - expected).max() <= 1


def test_merged_samples_as_the_lora_on_the_fused_teacher_and_its_card_loads_nothing_more(
    run, tiny_teacher, tmp_path
):
    """merged/ already holds the user's pair: generate fuses it again for lora/ (the teacher the run
    learned), not for merged/, and both draw the same clip; merged/'s card says not to load the pair."""
    import imageio.v2 as imageio

    from distill import generate

    out, _ = run
    card = (out / "merged" / "README.md").read_text()
    assert "are in these weights too" in card and "load_lora_weights" not in card
    clips = {}
    for folder in ("lora", "merged"):
        target = tmp_path / f"{folder}.mp4"
        argv = ["--student", str(out / folder), "--prompt", "a red ball", "--num_frames", "5"]
        assert generate.main([*argv, "--height", "32", "--width", "32", "--output", str(target)]) == 0
        clips[folder] = np.stack(imageio.mimread(target)).astype(np.int16)
    assert clips["lora"].shape == clips["merged"].shape
    # The same model, rounded apart (0 levels here); the MP4 codec may spread a one-level rounding
    # flip of another CPU over a block, and a second fuse of the user's pair moves them 22 levels.
    assert np.abs(clips["lora"] - clips["merged"]).max() <= 6
