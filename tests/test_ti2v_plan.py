"""The --dry_run plan of a Wan2.2-TI2V-5B teacher: one transformer, no boundary, 48 latent channels of
the Wan2.2 VAE (16x spatial) and a timestep per token. On the tiny TI2V teacher the plan says one
transformer, counts its bytes once and puts one set of adapters on it; its FLOPs are what torch
counts on a real 48-channel model given a timestep per token, and scale with tokens as the config
says; the activation measure sees the per-token modulation; and a TI2V recipe's own dry run on the
real configs prints the figures its header states."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from conftest import REPO, SMALL_EXPERT, train_args
from test_cost import CPU_ATTENTION
from test_recipes import TI2V, TI2V_EXPERT
from torch.utils.flop_counter import FlopCounterMode

from distill.config.cli import parse_config
from distill.config.settings import TrainConfig
from distill.models.lora import LoraShape, add_adapter
from distill.models.student import build_student
from distill.models.teacher import inspect_teacher
from distill.train.activations import (
    ModelUse,
    _measure,
    _train,
    as_used,
    no_grad_peak,
    parameter_count,
    trained,
)
from distill.train.cost import (
    high_noise_share,
    longest_beat_free_seconds,
    rollout_depth,
    teacher_guided,
    teacher_passes,
)
from distill.train.flops import model_flops
from distill.train.plan import teacher_bytes, tokens_of, trained_parameters
from train_distillation import main

pytestmark = pytest.mark.usefixtures("one_thread")

SMALL_48 = {**SMALL_EXPERT, "in_channels": 48, "out_channels": 48}


@pytest.fixture(scope="module")
def ti2v_student(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny student config in the TI2V teacher's 48-channel latent space."""
    config = json.loads((REPO / "config" / "student_tiny.json").read_text())
    path = tmp_path_factory.mktemp("ti2v-student") / "student.json"
    path.write_text(json.dumps({**config, "in_channels": 48, "out_channels": 48}))
    return path


def dry_run(teacher: Path, tmp_path: Path, capsys: pytest.CaptureFixture, **settings: object) -> str:
    """The plan --dry_run prints for a 64x64, 5-frame run on `teacher` (train_args' settings otherwise)."""
    args = train_args(
        teacher, tmp_path / "out", tmp_path / "cache", height=64, width=64, num_frames=5, **settings
    )
    assert main([*args, "--dry_run"]) == 0
    return capsys.readouterr().out


def column(out: str, row: str, placement: int = 0) -> float:
    """A value of the plan's memory table (placement 0 = gpu, 1 = cpu, 2 = shard)."""
    return float(
        re.search(rf"^  {re.escape(row)}\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)", out, re.M)[placement + 1]
    )


def test_the_plan_says_one_transformer_and_counts_its_bytes_once(
    ti2v_teacher, ti2v_student, tmp_path, capsys
):
    out = dry_run(ti2v_teacher, tmp_path, capsys, student_config=ti2v_student, guidance_scale=5.0)
    assert "Wan2.2-TI2V-5B, text or image to video" in out
    assert "  model   : one transformer," in out and "at every timestep (no expert boundary)" in out
    assert "experts :" not in out and "high-noise" not in out and "transformer_2" not in out
    # 64x64, 5 frames through the Wan2.2 VAE (16x in space, 4x in time): 48 x 2 x 4 x 4, patch 1x2x2.
    assert "latents   : (48, 2, 4, 4) per sample, 8 tokens" in out
    # The teacher's sampling before step 1: every step on the one transformer, guided.
    assert "teacher forwards (all on the one transformer)" in out and "x 2 (guidance)" in out
    # The gpu column holds the transformer once: the bytes of the real model the folder loads.
    from diffusers import WanTransformer3DModel

    model = WanTransformer3DModel.from_pretrained(ti2v_teacher / "transformer")
    held = sum(p.numel() * p.element_size() for p in model.parameters())
    assert "as torch.float32" in out  # no CUDA: the teacher in float32, as diffusers loads it
    assert column(out, "teacher share") == round(held / 2**20, 2)
    assert column(out, "host RAM per rank (teacher)", placement=1) == round(held / 2**20, 2)


def test_a_lora_plan_puts_one_adapter_set_on_the_one_transformer(ti2v_teacher, tmp_path, capsys):
    """The student's and the critic's adapters as peft adds them to the real transformer: one set each."""
    lora = dict(method="dmd", student_lora_rank=4, student_config=None, student_init=None)
    out = dry_run(ti2v_teacher, tmp_path, capsys, **lora)
    assert "student   : LoRA rank 4 (alpha 4) on the one transformer" in out
    assert "LoRA rank 4 on the same transformer" in out and "both experts" not in out

    info = inspect_teacher(str(ti2v_teacher), configs_only=True)
    assert (info.boundary_ratio, info.expert_folders) == (None, ("transformer",))
    cfg = parse_config(train_args(ti2v_teacher, tmp_path / "o", tmp_path / "c", **lora))
    model = build_student(info.expert_config, seed=0)
    adapter = sum(
        p.numel() for p in add_adapter(model, "student", LoraShape(4, 4.0, cfg.lora_targets), seed=0)
    )
    assert trained_parameters(cfg, info, info.expert_config, info.expert_config) == (adapter, adapter)
    # A full critic (--critic_lora_rank 0) is one copy of the one transformer.
    full = parse_config(train_args(ti2v_teacher, tmp_path / "o", tmp_path / "c", **lora, critic_lora_rank=0))
    critic = trained_parameters(full, info, info.expert_config, info.expert_config)[1]
    assert critic == sum(p.numel() for p in build_student(info.expert_config).parameters())


def counted(config: dict, shape: tuple[int, int, int, int], per_token: bool) -> float:
    """FLOPs torch counts for one forward of the real model on one sample."""
    model = build_student(config, seed=0).requires_grad_(False)
    tokens = shape[1] * (shape[2] // 2) * (shape[3] // 2)
    t = torch.full((1, tokens), 300.0) if per_token else torch.tensor([300])
    x, text = torch.randn(1, *shape), torch.randn(1, 7, config["text_dim"])
    with FlopCounterMode(display=False, custom_mapping=CPU_ATTENTION) as counter:
        model(hidden_states=x, timestep=t, encoder_hidden_states=text, return_dict=False)
    return counter.get_total_flops()


def test_the_flops_of_a_48_channel_model_with_a_timestep_per_token_are_what_torch_counts():
    shape = (48, 2, 8, 12)
    per_token = model_flops(SMALL_48, shape, 7, token_timesteps=True).forward
    assert per_token == counted(SMALL_48, shape, per_token=True)
    # The time embedder and projection run once per token instead of once per sample.
    per_sample = model_flops(SMALL_48, shape, 7).forward
    assert per_sample == counted(SMALL_48, shape, per_token=False) < per_token


def test_the_teacher_flops_follow_the_ti2v_config():
    """F(N) = a + b N + c N^2 in the tokens N: equally spaced token counts (1, 2, 3 latent frames at
    704x1280) give c = 4 x width x layers (self-attention's two N x N products) and b = 2 x the weights
    every token goes through, counted on the real 5B model, plus cross-attention's 4 x text x width."""
    from accelerate import init_empty_weights

    width, layers, text = 3072, 30, 512
    frames = [
        model_flops(TI2V_EXPERT, (48, f, 44, 80), text, token_timesteps=True).forward for f in (1, 2, 3)
    ]
    n = 22 * 40  # tokens of one latent frame
    assert frames[2] - 2 * frames[1] + frames[0] == 2 * 4 * width * layers * n**2
    with init_empty_weights():
        model = build_student(TI2V_EXPERT)
    per_token = (
        "patch_embedding",
        "condition_embedder.time_embedder",
        "condition_embedder.time_proj",
        "proj_out",
        *(f"attn1.{p}" for p in ("to_q", "to_k", "to_v", "to_out")),
        *(f"attn2.{p}" for p in ("to_q", "to_out")),
        "ffn",
    )
    weights = sum(
        p.numel()
        for name, p in model.named_parameters()
        if name.endswith("weight") and any(k in name for k in per_token)
    )
    linear = frames[1] - frames[0] - 4 * width * layers * (4 * n**2 - n**2)
    assert linear == n * (2 * weights + 4 * text * width * layers)
    # The 5B transformer at 704x1280x121 (27,280 tokens): about 0.52 PFLOP per forward.
    assert tokens_of(TrainConfig(height=704, width=1280, num_frames=121), TI2V) == 27280
    assert model_flops(TI2V_EXPERT, (48, 31, 44, 80), text, token_timesteps=True).forward == pytest.approx(
        5.2e14, rel=0.01
    )


def test_the_activation_measure_sees_the_timestep_per_token():
    """The fake-tensor measure with a timestep per token: it extends exactly from 2 and 3 blocks, it
    equals the same forward and backward on real tensors, and it holds each block's per-token float32
    modulation (6 x width per token) that a timestep per sample does not have."""
    small = {**SMALL_48, "num_layers": 5}
    use = ModelUse.of(
        small, latent_shape=(48, 2, 8, 12), text_len=7, batch=2, autocast="bfloat16", token_timesteps=True
    )
    extended, direct = trained(use), _measure(use, 5, True)
    assert (extended.held, extended.peak) == pytest.approx(direct, rel=1e-9)
    with torch.random.fork_rng(devices=[]):
        real = as_used(build_student(use.with_depth(3), seed=0), use)
        assert _train(real, use) == pytest.approx(_measure(use, 3, True), rel=1e-9)
    per_sample = trained(ModelUse(**{**use.__dict__, "token_timesteps": False}))
    tokens, width = 2 * 4 * 6, small["num_attention_heads"] * small["attention_head_dim"]
    modulation = use.batch * tokens * 6 * width * 4
    assert extended.held - per_sample.held >= small["num_layers"] * modulation
    assert no_grad_peak(use) > no_grad_peak(ModelUse(**{**use.__dict__, "token_timesteps": False}))


def test_no_boundary_one_transformer_takes_every_step_and_only_its_guidance_counts(tmp_path):
    # Settings as given (the command line's checks are not the point here): --guidance_scale_2 is the
    # low-noise expert's, which a teacher with one transformer does not have.
    cfg = TrainConfig(method="dmd", student_steps=4, guidance_scale=1.0, guidance_scale_2=3.0)
    assert high_noise_share(cfg, 5.0, None) == 1.0
    assert rollout_depth(cfg, None) == (0 + 1 + 2 + 3) / 4  # any of the 4 steps: no boundary splits them
    assert teacher_passes(cfg, 1.0) == 1.0 and not teacher_guided(cfg, experts=1) and teacher_guided(cfg, 2)
    guided = TrainConfig(guidance_scale=5.0)
    assert teacher_passes(guided, high_noise_share(guided, 5.0, None)) == 2.0
    # Streamed from host RAM, a forward copies the one transformer whole (two experts: half of both).
    one = teacher_bytes(TI2V, torch.bfloat16)[0]
    forward, step = {"teacher": 0.0}, {}
    seconds = longest_beat_free_seconds(guided, forward, step, "cpu", one, experts=1)[0]
    assert seconds == pytest.approx(2 * longest_beat_free_seconds(guided, forward, step, "cpu", one)[0])
    # The 5B: one transformer's bf16 bytes, not two.
    assert 4.9e9 < parameter_count(TI2V_EXPERT) < 5.1e9
    assert teacher_bytes(TI2V, torch.bfloat16)[0] < 2.2 * parameter_count(TI2V_EXPERT)


def test_a_ti2v_recipe_prints_its_headers_plan_from_the_real_configs(
    ti2v_teacher, tmp_path, monkeypatch, capsys
):
    """The one-GPU LoRA recipe's own command with --dry_run on a configs-only TI2V folder with the
    real transformer config: the memory per GPU and the GPU-hours its header states."""
    folder = tmp_path / "teacher"
    shutil.copytree(ti2v_teacher, folder, ignore=shutil.ignore_patterns("*.safetensors"))
    config = folder / "transformer" / "config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), **TI2V_EXPERT}))
    recipe = REPO / "config" / "recipes" / "ti2v-5b-lora-4step-1gpu.yaml"
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    argv = ["--config", str(recipe), "--teacher_path", str(folder), "--output_dir", str(tmp_path / "out")]
    assert main([*argv, "--dry_run"]) == 0
    out = capsys.readouterr().out
    assert "latents   : (48, 31, 44, 80) per sample, 27280 tokens" in out
    assert "model   : one transformer, 5.00 B parameters as torch.bfloat16" in out
    header = recipe.read_text()
    assert f"teacher on the GPU): {column(out, 'total'):.2f} GiB" in header
    hours = re.search(r"whole run: ([\d.]+) GPU-hours", out)[1]
    assert f"H100 at MFU 0.4): {hours} " in header and "fits an 80 GB GPU" in out and "gpu yes" in out
