"""Training on the text-or-image-to-video teacher (the tiny random Wan2.2-TI2V-5B: one transformer, the
48-channel Wan2.2 VAE, a timestep per token), in both of its modes, picked by the data: the caches
hold what the stock pipeline of the mode makes of each sample; a run resumes bit for bit after
SIGTERM; two ranks match one process; settings of a second expert and data that mixes the modes are
refused before anything heavy."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import REPO, preempt_then_finish, train_args
from PIL import Image
from safetensors.torch import load_file
from test_distributed import assert_same_trajectory
from test_i2v_training import PROMPTS, banner, run_process, write_pairs

from distill.config.cli import parse_config
from distill.data.image_latents import image_key
from distill.data.prepare import embedding_cache, latent_cache, open_condition_cache, prompt_seed
from distill.data.samples import TrainingSample
from distill.models.conditioning import image_condition
from distill.models.pipelines import load_scheduler, load_vae
from distill.models.teacher import inspect_teacher, load_experts
from distill.models.teacher_kind import TI2V_5B
from distill.models.tiny import write_tiny_teacher
from distill.train.trainer import Distiller
from train_distillation import main as train

pytestmark = [pytest.mark.long, pytest.mark.usefixtures("one_thread")]

# 32 x 32 pixels through the Wan2.2 VAE (16x) and 1x2x2 patches: one token per latent frame.
SIZE = dict(height=32, width=32, num_frames=5, teacher_sample_steps=2, max_prompts=4)


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("ti2v_training")
    teacher = write_tiny_teacher(root / "teacher", seed=0, kind=TI2V_5B)
    expert = json.loads((teacher / "transformer" / "config.json").read_text())
    config = json.loads((REPO / "config" / "student_tiny.json").read_text())
    student = {**config, "in_channels": 48, "out_channels": 48, "text_dim": expert["text_dim"]}
    (root / "student.json").write_text(json.dumps(student))
    pairs = write_pairs(root / "data", size=32)
    (root / "prompts.txt").write_text("\n".join(PROMPTS) + "\n")
    return {
        "teacher": teacher,
        "pairs": pairs,
        "prompts": root / "prompts.txt",
        "student": root / "student.json",
        "cache": root / "cache",
    }


def args_for(world: dict[str, Path], out: Path, mode: str = "image", **overrides: object) -> list[str]:
    settings: dict[str, object] = {
        **SIZE,
        "student_config": world["student"],
        "data_path": world["pairs" if mode == "image" else "prompts"],
        "cache_dir": world["cache"],
        "guidance_scale": 5.0,  # TI2V-5B's own
        **overrides,
    }
    return train_args(world["teacher"], out, **settings)


# ---------------------------------------------------------------------------------------------
# The caches: what the stock pipeline of each mode makes
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["text", "image"])
def test_the_caches_hold_the_stock_pipelines_latents_in_each_mode(world, tmp_path, mode):
    """Against WanPipeline / WanImageToVideoPipeline with expand_timesteps, given the image file
    itself (the pipeline resizes it): the cached clean latents are its output_type="latent"."""
    from diffusers import WanImageToVideoPipeline, WanPipeline

    cfg = parse_config(args_for(world, tmp_path / "out", mode, num_steps=1))
    result = Distiller(cfg).run()
    assert result.steps == 1 and result.conditions_built == (4 if mode == "image" else 0)
    info = inspect_teacher(str(world["teacher"]))
    transformer, second = load_experts(info, torch.float32)
    assert second is None and info.boundary_ratio is None
    vae = load_vae(info.path, torch.device("cpu"))
    pipeline_class = WanImageToVideoPipeline if mode == "image" else WanPipeline
    pipe = pipeline_class(
        tokenizer=None,
        text_encoder=None,
        vae=vae,
        scheduler=load_scheduler(info.path),
        transformer=transformer,
        transformer_2=None,
        boundary_ratio=None,
        expand_timesteps=True,
    )
    pipe.set_progress_bar_config(disable=True)
    embeddings = embedding_cache(cfg, info, torch.float32)
    clean = latent_cache(cfg, info, torch.float32, embeddings)
    conditions = open_condition_cache(cfg, info) if mode == "image" else None
    negative = embeddings.get(cfg.negative_prompt)
    for i, prompt in enumerate(PROMPTS):
        extra, key = {}, prompt
        if mode == "image":
            path = world["pairs"].parent / "images" / f"{i}.png"
            sample = TrainingSample(prompt, None, image_key(path))
            key = sample.key
            extra["image"] = Image.open(path).convert("RGB")
            pixels = torch.from_numpy(np.asarray(extra["image"], dtype=np.float32) / 127.5 - 1.0)
            pixels = pixels.permute(2, 0, 1)
            expected = image_condition(vae, pixels, 5, kind=TI2V_5B).channels[0]
            assert conditions is not None
            torch.testing.assert_close(conditions.get(sample.image_key), expected, rtol=1e-5, atol=1e-6)
        pad = padded(embeddings.get(prompt), cfg.max_sequence_length)
        stock = pipe(
            prompt_embeds=pad[None],
            negative_prompt_embeds=padded(negative, cfg.max_sequence_length)[None],
            height=32,
            width=32,
            num_frames=5,
            num_inference_steps=2,
            guidance_scale=5.0,
            generator=torch.Generator("cpu").manual_seed(prompt_seed(cfg.seed, key)),
            output_type="latent",
            max_sequence_length=cfg.max_sequence_length,
            **extra,
        ).frames[0]
        assert stock.shape == (48, 2, 2, 2)
        torch.testing.assert_close(clean.get(key), stock.float(), rtol=1e-5, atol=1e-6)


def padded(embedding: torch.Tensor, length: int) -> torch.Tensor:
    out = torch.zeros(length, embedding.shape[-1])
    out[: embedding.shape[0]] = embedding
    return out


# ---------------------------------------------------------------------------------------------
# Resume and two ranks
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "mode, method",
    [
        ("text", {}),  # velocity into the smaller 48-channel student, a timestep per token
        (
            "image",
            dict(
                method="dmd",
                student_lora_rank=4,
                student_config=None,
                student_init=None,
                regression_weight=0.5,
            ),
        ),
    ],
    ids=["text-velocity", "image-dmd-lora"],
)
def test_a_run_stopped_by_sigterm_resumes_to_the_same_weights(
    world, tmp_path, monkeypatch, capsys, mode, method
):
    common = dict(num_steps=4, checkpoint_every=100, **method)
    assert train(args_for(world, tmp_path / "straight", mode, **common)) == 0
    out = tmp_path / "preempted"
    preempt_then_finish(train, args_for(world, out, mode, **common), monkeypatch, capsys)
    lora = "student_lora_rank" in method
    # One transformer: one adapter file (no high/low pair).
    name = "lora/lora.safetensors" if lora else "student/diffusion_pytorch_model.safetensors"
    a, b = load_file(str(tmp_path / "straight" / name)), load_file(str(out / name))
    assert a and a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    if not lora:
        config = json.loads((out / "student" / "config.json").read_text())
        assert (config["in_channels"], config["out_channels"]) == (48, 48)


def test_two_ranks_match_one_process_each_sample_with_its_own_image(world, tmp_path):
    common = dict(num_steps=3, lr=1e-3, log_every=1)
    assert train(args_for(world, tmp_path / "one", batch_size=2, **common)) == 0
    two = run_process(args_for(world, tmp_path / "two", batch_size=1, **common), nproc=2)
    assert two.returncode == 0, two.stderr[-3000:]
    assert_same_trajectory([tmp_path / "one", tmp_path / "two"], first_rtol=1e-4, rtol=1e-3)


# ---------------------------------------------------------------------------------------------
# Refused before anything heavy
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "flag, value",
    [("guidance_scale_2", 2.0), ("expert_phase", "high"), ("boundary_ratio", 0.9)],
)
def test_settings_of_a_second_expert_are_refused(world, tmp_path, capsys, flag, value):
    extra: dict[str, object] = {flag: value}
    if flag == "expert_phase":  # a LoRA dmd setting: the rules that make it act must hold
        extra.update(method="dmd", student_lora_rank=4, student_config=None, student_init=None)
    assert train(args_for(world, tmp_path / "out", **extra)) in (3, 5)
    err = banner(capsys)
    assert f"--{flag}" in err and "one transformer" in err and f"drop --{flag}" in err
    assert not (tmp_path / "out").exists()


def test_a_file_that_gives_some_prompts_an_image_and_others_none_is_refused(world, tmp_path, capsys):
    lines = world["pairs"].read_text().splitlines()
    mixed = tmp_path / "mixed.jsonl"
    images = world["pairs"].parent / "images"
    rows = [json.loads(line) for line in lines]
    rows[0]["image"] = str(images / "0.png")
    rows[2] = {"prompt": rows[2]["prompt"]}  # line 3: text only
    mixed.write_text("".join(json.dumps(row) + "\n" for row in rows[:3]))
    cache = tmp_path / "cache"
    assert train(args_for(world, tmp_path / "out", data_path=mixed, cache_dir=cache)) == 6
    err = banner(capsys)
    assert "mixed.jsonl" in err and "(line 3)" in err and "distil text to video" in err
    assert not cache.exists() and not (tmp_path / "out").exists()
