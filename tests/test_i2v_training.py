"""Training on the image-to-video teacher (the tiny random Wan2.2-I2V-A14B): the caches hold what
stock WanImageToVideoPipeline makes of each (prompt, image) pair; velocity, dmd and LoRA runs train
and resume bit for bit after SIGTERM; two ranks (DDP, and the teacher sharded) match one process;
prompts files that do not suit the teacher are refused before anything heavy, and a damaged image
costs nothing already cached."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import (
    REPO,
    TORCHRUN,
    WARM_TORCHRUN,
    preempt_then_finish,
    repo_pythonpath,
    run_command,
    train_args,
)
from PIL import Image
from safetensors.torch import load_file
from test_distributed import assert_same_trajectory

from distill.config.cli import parse_config
from distill.data.image_latents import image_key
from distill.data.images import ImagePreprocessor, ImagePrompt
from distill.data.prepare import embedding_cache, latent_cache, open_condition_cache, prompt_seed
from distill.data.samples import TrainingSample
from distill.models.conditioning import image_condition
from distill.models.pipelines import initial_noise, load_scheduler, load_vae, sample_latents, teacher_pipeline
from distill.models.teacher import inspect_teacher, load_expert
from distill.models.teacher_kind import I2V_A14B
from distill.models.tiny import write_tiny_teacher
from distill.train.trainer import Distiller
from train_distillation import main as train

pytestmark = [pytest.mark.long, pytest.mark.usefixtures("one_thread")]

PROMPTS = ("a red square moving left", "a blue disc moving right", "a green bar falling", "a dot rising")
SIZE = dict(height=16, width=16, num_frames=5, teacher_sample_steps=2, max_prompts=4)


def write_pairs(folder: Path, count: int = len(PROMPTS), size: int = 16) -> Path:
    """A .jsonl file pairing each prompt with its own `size` x `size` image (paths relative to the file)."""
    (folder / "images").mkdir(parents=True, exist_ok=True)
    lines = []
    for i in range(count):
        pixels = np.random.default_rng(i).integers(0, 256, size=(size, size, 3), dtype=np.uint8)
        Image.fromarray(pixels).save(folder / "images" / f"{i}.png")
        lines.append(json.dumps({"prompt": PROMPTS[i], "image": f"images/{i}.png"}))
    path = folder / "pairs.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("i2v_training")
    config = json.loads((REPO / "config" / "student_tiny.json").read_text())
    (root / "student.json").write_text(json.dumps({**config, "in_channels": 36}))
    return {
        "teacher": write_tiny_teacher(root / "teacher", seed=0, kind=I2V_A14B),
        "pairs": write_pairs(root / "data"),
        "student": root / "student.json",
        "cache": root / "cache",
    }


def args_for(world: dict[str, Path], out: Path, **overrides: object) -> list[str]:
    settings: dict[str, object] = {
        **SIZE,
        "student_config": world["student"],
        "data_path": world["pairs"],
        "cache_dir": world["cache"],
        **overrides,
    }
    return train_args(world["teacher"], out, **settings)


def run_process(
    args: list[str], fault: str | None = None, nproc: int | None = None
) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": repo_pythonpath(), "OMP_NUM_THREADS": "1"}
    env.pop("DISTILL_INJECT_FAULT", None)
    if fault:
        env["DISTILL_INJECT_FAULT"] = fault
    launcher = [*(TORCHRUN if fault else WARM_TORCHRUN), "--standalone", f"--nproc_per_node={nproc}"]
    command = [*(launcher if nproc else [sys.executable]), str(REPO / "train_distillation.py")]
    return run_command([*command, *map(str, args)], env=env, timeout=240, cwd=REPO)


def banner(capsys: pytest.CaptureFixture[str]) -> str:
    err = capsys.readouterr().err
    assert "Traceback" not in err and "ERROR (" in err
    return err


# ---------------------------------------------------------------------------------------------
# The caches: the stock pipeline's condition and clean latents
# ---------------------------------------------------------------------------------------------


def test_the_caches_hold_the_stock_pipelines_image_condition_and_clean_latents(world, tmp_path):
    cfg = parse_config(
        args_for(world, tmp_path / "out", num_steps=1, guidance_scale=3.0, guidance_scale_2=2.0)
    )
    distiller = Distiller(cfg)
    result = distiller.run()
    assert (result.conditions_built, result.latents_built) == (4, 4) and result.steps == 1
    info = inspect_teacher(str(world["teacher"]))
    vae = load_vae(info.path, torch.device("cpu"))
    preprocess = ImagePreprocessor(16, 16)
    conditions = open_condition_cache(cfg, info)
    high, low = (
        load_expert(info, "transformer", torch.float32),
        load_expert(info, "transformer_2", torch.float32),
    )
    pipe = teacher_pipeline(high, low, info.boundary_ratio, load_scheduler(info.path), I2V_A14B, vae=vae)
    embeddings = embedding_cache(cfg, info, torch.float32)
    clean = latent_cache(cfg, info, torch.float32, embeddings)
    negative = embeddings.get(cfg.negative_prompt)
    for i, prompt in enumerate(PROMPTS):
        pair = ImagePrompt(prompt, world["pairs"].parent / "images" / f"{i}.png", world["pairs"], i + 1)
        sample = TrainingSample(prompt, pair, image_key(pair.image))
        pixels = preprocess(pair)
        expected = image_condition(vae, pixels, 5).channels[0]
        assert torch.equal(conditions.get(sample.image_key), expected)
        noise = initial_noise((16, 2, 2, 2), prompt_seed(cfg.seed, sample.key))
        pad = torch.zeros(cfg.max_sequence_length, info.text_dim)
        embeds = embeddings.get(prompt)
        pad[: embeds.shape[0]] = embeds
        neg = torch.zeros_like(pad)
        neg[: negative.shape[0]] = negative
        stock = sample_latents(pipe, noise, pad, neg, 2, 3.0, 2.0, image=pixels[0])
        torch.testing.assert_close(clean.get(sample.key), stock, rtol=1e-5, atol=1e-6)
    # Another image with the same prompt is another sample: its own clean latent and seed.
    assert TrainingSample(PROMPTS[0], None, "x").key != TrainingSample(PROMPTS[0], None, "y").key


# ---------------------------------------------------------------------------------------------
# Every method trains, resumes bit for bit after SIGTERM, and exports
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "method",
    [
        dict(export_formats="diffusers,original"),  # velocity into the smaller 36-channel student
        dict(
            method="dmd",
            student_lora_rank=4,
            student_config=None,
            student_init=None,
            regression_weight=0.5,
            critic_updates=2,
        ),
    ],
    ids=["velocity", "dmd-lora"],
)
def test_a_run_stopped_by_sigterm_resumes_to_the_same_weights(world, tmp_path, monkeypatch, capsys, method):
    common = dict(num_steps=4, checkpoint_every=100, **method)
    assert train(args_for(world, tmp_path / "straight", **common)) == 0
    out = tmp_path / "preempted"
    preempt_then_finish(train, args_for(world, out, **common), monkeypatch, capsys)
    lora = "student_lora_rank" in method
    files = (
        ["lora/high_noise_lora.safetensors", "lora/low_noise_lora.safetensors"]
        if lora
        else ["student/diffusion_pytorch_model.safetensors"]
    )
    for name in files:
        a, b = load_file(str(tmp_path / "straight" / name)), load_file(str(out / name))
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), name
    if not lora:
        config = json.loads((out / "student" / "config.json").read_text())
        assert (config["in_channels"], config["out_channels"]) == (36, 16)
        # The original-layout export says what Wan's own code must build: an i2v model of 36 channels.
        from diffusers import WanTransformer3DModel
        from safetensors import safe_open

        single = out / "student_original.safetensors"
        with safe_open(str(single), "pt") as handle:
            original = json.loads(handle.metadata()["config"])
        assert (original["model_type"], original["in_dim"], original["out_dim"]) == ("i2v", 36, 16)
        reloaded = WanTransformer3DModel.from_single_file(str(single), config=str(out / "student"))
        exported = load_file(str(out / "student" / "diffusion_pytorch_model.safetensors"))
        assert all(torch.equal(reloaded.state_dict()[k], v) for k, v in exported.items())


# ---------------------------------------------------------------------------------------------
# Two ranks
# ---------------------------------------------------------------------------------------------


def test_two_ranks_with_the_teacher_sharded_match_one_process(world, tmp_path):
    """Each rank reads its rows of the global batch with their own images; the sharded experts run
    every forward in lockstep (a rank without a sample for an expert joins with a one-token
    placeholder that carries the condition channels too)."""
    lora = dict(student_lora_rank=4, student_config=None, num_steps=3, lr=1e-3, log_every=1)
    assert train(args_for(world, tmp_path / "one", batch_size=2, **lora)) == 0
    two = args_for(world, tmp_path / "two", batch_size=1, teacher_placement="shard", **lora)
    sharded = run_process(two, nproc=2)
    assert sharded.returncode == 0, sharded.stderr[-3000:]
    assert "teacher placement: shard" in sharded.stdout + sharded.stderr
    # The step-1 loss is small (adapters start at zero), so float noise of the sharded reductions is
    # a larger part of it than in a full student's loss; a sample paired with another's image is
    # off by orders of magnitude.
    assert_same_trajectory([tmp_path / "one", tmp_path / "two"], first_rtol=1e-3, rtol=1e-3)


# ---------------------------------------------------------------------------------------------
# Prompts files that do not suit the teacher; a damaged image
# ---------------------------------------------------------------------------------------------


def test_a_prompts_file_without_images_for_the_i2v_teacher_says_which_formats_pair_them(
    world, tmp_path, capsys
):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n".join(PROMPTS) + "\n")
    out, cache = tmp_path / "out", tmp_path / "cache"
    assert train(args_for(world, out, data_path=prompts, cache_dir=cache)) == 6
    err = banner(capsys)
    assert f"--data_path {prompts}" in err and "every prompt needs its image" in err
    assert '{"prompt": "...", "image": "images/first.png"}' in err
    assert not out.exists() and not cache.exists()


def test_images_for_the_text_to_video_teacher_are_refused_not_ignored(world, tiny_teacher, tmp_path, capsys):
    out, cache = tmp_path / "out", tmp_path / "cache"
    assert train(train_args(tiny_teacher, out, cache, data_path=world["pairs"])) == 6
    err = banner(capsys)
    assert "pairs prompts with images" in err and "Wan2.2-T2V-A14B, which generates from text only" in err
    assert "--preset wan2.2-i2v-a14b" in err and "without the image column" in err
    assert not out.exists() and not cache.exists()


def test_a_damaged_image_is_named_with_its_line_and_what_was_cached_stays(world, tmp_path, capsys):
    data = tmp_path / "data"
    pairs = write_pairs(data)
    cache = tmp_path / "cache"
    assert train(args_for(world, tmp_path / "first", num_steps=1, data_path=pairs, cache_dir=cache)) == 0
    built = sorted(p.name for p in cache.rglob("*.safetensors"))
    # A fifth pair whose image is cut off after its header: found when its latent is made.
    Image.fromarray(np.full((16, 16, 3), 200, dtype=np.uint8)).save(data / "images" / "4.png")
    (data / "images" / "4.png").write_bytes((data / "images" / "4.png").read_bytes()[:60])
    with pairs.open("a") as handle:
        handle.write(json.dumps({"prompt": "a fifth clip", "image": "images/4.png"}) + "\n")
    out = tmp_path / "second"
    assert train(args_for(world, out, num_steps=1, data_path=pairs, cache_dir=cache, max_prompts=5)) == 6
    err = banner(capsys)
    assert f"--data_path {pairs}: line 5: image {data / 'images' / '4.png'}" in err
    assert "replace the image with a complete copy, or remove the line" in err
    # Every entry made before is still there (the fifth prompt's embedding was added before its image failed).
    assert set(built) <= {p.name for p in cache.rglob("*.safetensors")}
    assert not list(cache.rglob("*.tmp"))


def test_samples_and_reports_while_training_start_each_prompt_from_its_image(world, tmp_path, capsys):
    """The monitor samples held-out pairs: teacher and student from the same image and noise, the
    report's probes conditioned on it; without a paired file there is nothing to start from."""
    held = write_pairs(tmp_path / "held", count=2)
    out = tmp_path / "out"
    monitor = dict(save_samples=True, sample_interval=2, sample_steps=2, eval_interval=2, num_steps=2)
    assert train(args_for(world, out, sample_prompts=held, **monitor)) == 0
    suffixes = sorted(p.name for p in (out / "samples").iterdir())
    assert "teacher_prompt_01.mp4" in suffixes and "step_00000002_prompt_01.mp4" in suffixes
    report = json.loads((out / "eval" / "step_00000002" / "eval.json").read_text())
    assert report["num_prompts"] == 2 and report["sampler"] and report["denoiser"]
    none = tmp_path / "none"
    assert train(args_for(world, none, cache_dir=tmp_path / "cache", save_samples=True)) == 3
    err = banner(capsys)
    assert "--sample_prompts: an image-to-video teacher (Wan2.2-I2V-A14B)" in err and '"image"' in err
    assert not none.exists()


def test_a_text_to_video_run_reads_and_calls_exactly_what_it_did_before(tiny_teacher):
    """What keeps text-to-video runs bit for bit: a sample's key is its prompt (the clean-latent
    cache's file names and the teacher's seeds are unchanged, so are caches built before), and a
    model conditioned on nothing is the model itself (no extra operation in any forward)."""
    from distill.data.dataset import DistillationDataset
    from distill.data.samples import read_training_samples
    from distill.models.conditioning import conditioned
    from distill.models.teacher_kind import T2V_A14B

    samples = read_training_samples(REPO / "data" / "static_prompts.txt", T2V_A14B, 5)
    assert [s.key for s in samples] == [s.prompt for s in samples] and all(s.image is None for s in samples)
    model = load_expert(inspect_teacher(str(tiny_teacher)), "transformer", torch.float32)
    assert conditioned(model, T2V_A14B, None) is model
    assert DistillationDataset(["a"], None, None, 4).samples[0] == TrainingSample("a")
