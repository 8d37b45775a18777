"""dmd and LoRA on the text-or-image-to-video teacher (the tiny random Wan2.2-TI2V-5B: one transformer,
no boundary, a timestep per token, the image's latent frame at frame 0 in image mode).

The few-step sampler equals the stock pipeline of each mode (WanPipeline / WanImageToVideoPipeline
with expand_timesteps) and holds the image at frame 0; no dmd loss (distribution matching, critic,
regression) depends on a prediction at the frame the image fixes, while each depends on the others;
dmd (into a small student, and as LoRA with an adapter or a full critic) and velocity + LoRA train in
both modes and write their outputs; the LoRA files hold one transformer's adapters (diffusers and
Wan keys) that stock diffusers loads with `load_lora_weights` and samples as our sampler does; a
phase of a second expert and adapters made for two experts are refused by name."""

from __future__ import annotations

import contextlib
import copy
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import REPO, train_args
from diffusers import WanImageToVideoPipeline, WanPipeline
from diffusers.utils import load_image
from PIL import Image
from safetensors.torch import load_file
from torch import nn

from distill.config.cli import parse_config
from distill.data.images import ImagePreprocessor
from distill.models.conditioning import Condition, image_condition, loss_weight
from distill.models.few_step import few_step_scheduler, load_few_step_scheduler, sample_few_step
from distill.models.guided_teacher import GuidedTeacher
from distill.models.lora import ONE_EXPERT, STUDENT_ADAPTER, LoraExperts, LoraShape
from distill.models.lora_files import FILES, ONE_FILE, WAN_FORMAT_DIR, write_lora_folder
from distill.models.lora_folder import check_lora_folder, read_lora_folder
from distill.models.pipelines import load_vae, scheduler_from_config
from distill.models.teacher import inspect_teacher, load_experts
from distill.models.teacher_kind import T2V_A14B, TI2V_5B
from distill.models.tiny import write_tiny_teacher
from distill.ops.errors import DistillError
from distill.sample.lora_fit import check_fits_teacher
from distill.sample.run_settings import read_run_settings
from distill.sample.student_folder import load_student
from distill.train.methods.base import BatchRandomness, MethodEnv
from distill.train.methods.dmd import DmdMethod, dmd_gradient, dmd_loss
from distill.train.methods.velocity import VelocityMethod
from distill.train.trainer import Distiller
from train_distillation import main as train

pytestmark = pytest.mark.usefixtures("one_thread")

# 32 x 32 pixels through the Wan2.2 VAE (16x): 2 x 2 latents, 2 latent frames, one token per frame.
SIZE, FRAMES, STEPS, LENGTH = 32, 5, 2, 16
PROMPTS = ("a red ball rolling to the left", "a blue box falling")
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("ti2v_methods")
    teacher = write_tiny_teacher(root / "Wan2.2-TI2V-5B-Diffusers", seed=0, kind=TI2V_5B)
    (root / "images").mkdir()
    lines = []
    for i, prompt in enumerate(PROMPTS):
        pixels = np.random.default_rng(i).integers(0, 256, size=(SIZE, SIZE, 3), dtype=np.uint8)
        Image.fromarray(pixels).save(root / "images" / f"{i}.png")
        lines.append(json.dumps({"prompt": prompt, "image": f"images/{i}.png"}))
    (root / "pairs.jsonl").write_text("\n".join(lines) + "\n")
    (root / "prompts.txt").write_text("\n".join(PROMPTS) + "\n")
    expert = json.loads((teacher / "transformer" / "config.json").read_text())
    config = json.loads((REPO / "config" / "student_tiny.json").read_text())
    student = {**config, "in_channels": 48, "out_channels": 48, "text_dim": expert["text_dim"]}
    (root / "student.json").write_text(json.dumps(student))
    return {"root": root, "teacher": teacher, "student": root / "student.json"}


def args_for(world: dict[str, Path], out: Path, mode: str, **overrides: object) -> list[str]:
    settings: dict[str, object] = {
        "data_path": world["root"] / ("pairs.jsonl" if mode == "image" else "prompts.txt"),
        "height": SIZE,
        "width": SIZE,
        "num_frames": FRAMES,
        "max_sequence_length": LENGTH,
        "max_prompts": 2,
        "num_steps": 3,
        **({"student_steps": STEPS, "critic_updates": 1} if overrides.get("method") == "dmd" else {}),
        # a LoRA student is the teacher's own transformer: no separate student to build or start
        **({"student_config": None, "student_init": None} if overrides.get("student_lora_rank") else {}),
        **overrides,
    }
    return train_args(world["teacher"], out, world["root"] / "cache", **settings)


def run(world: dict[str, Path], name: str, mode: str, **overrides: object) -> Path:
    out = world["root"] / name
    Distiller(parse_config(args_for(world, out, mode, **overrides))).run()
    return out


# ---------------------------------------------------------------------------------------------
# The sampler and the losses, on the tiny teacher's own transformer
# ---------------------------------------------------------------------------------------------


def image_inputs(world: dict[str, Path], index: int = 0) -> tuple[Image.Image, Condition]:
    """The image file as the stock pipeline takes it, and its condition as our layer makes it."""
    image = load_image(str(world["root"] / "images" / f"{index}.png"))
    pixels = ImagePreprocessor(SIZE, SIZE).processor.preprocess(image, height=SIZE, width=SIZE)
    vae = load_vae(world["teacher"], CPU)
    return image, image_condition(vae, pixels, FRAMES, kind=TI2V_5B)


def stock(mode: str, transformer: nn.Module, teacher: Path, image: Image.Image | None) -> object:
    """The stock pipeline of `mode` on `transformer` (expand_timesteps), with the teacher's VAE and
    the few-step scheduler; prompts go in as embeddings."""
    kind = WanImageToVideoPipeline if mode == "image" else WanPipeline
    pipe = kind(
        tokenizer=None,
        text_encoder=None,
        vae=load_vae(teacher, CPU),
        scheduler=few_step_scheduler(5.0),
        transformer=transformer,
        transformer_2=None,
        boundary_ratio=None,
        expand_timesteps=True,
    )
    pipe.set_progress_bar_config(disable=True)
    return pipe


def stock_latent(pipe: object, embeds: torch.Tensor, seed: int, image: Image.Image | None) -> torch.Tensor:
    """The stock few-step sample: the scheduler re-noises from the global RNG, seeded first."""
    torch.manual_seed(seed)
    extra = {"image": image} if image is not None else {}
    return pipe(  # type: ignore[operator]
        prompt_embeds=embeds,
        height=SIZE,
        width=SIZE,
        num_frames=FRAMES,
        num_inference_steps=STEPS,
        guidance_scale=1.0,
        output_type="latent",
        **extra,
    ).frames[0]


@pytest.mark.parametrize("mode", ["text", "image"])
def test_the_few_step_sampler_is_the_stock_pipelines_and_keeps_the_image_at_frame_0(world, mode):
    info = inspect_teacher(str(world["teacher"]))
    transformer, none = load_experts(info, torch.float32)
    assert none is None
    image, condition = image_inputs(world) if mode == "image" else (None, None)
    embeds = torch.randn(1, LENGTH, info.text_dim, generator=torch.Generator().manual_seed(1))
    shape = info.latent_shape(SIZE, SIZE, FRAMES)
    ours = sample_few_step(
        transformer, few_step_scheduler(5.0), STEPS, embeds, shape, 3, condition=condition, kind=TI2V_5B
    )[0]
    expected = stock_latent(stock(mode, transformer, world["teacher"], image), embeds, 3, image)
    same_sample(ours, expected)
    if condition is not None:  # the image's latent frame, exactly
        assert torch.equal(ours[:, :1], condition.channels[0].float())


def same_sample(ours: torch.Tensor, expected: torch.Tensor, atol: float = 1e-5) -> None:
    """Equal up to float rounding, relative to the sample's scale."""
    scale = max(float(expected.abs().max()), 1.0)
    torch.testing.assert_close(ours.float(), expected.float(), rtol=0, atol=atol * scale)


class ShiftedAt(nn.Module):
    """A Wan transformer whose velocity is moved by `amount` at latent frame `frame` (None: not at all)."""

    def __init__(self, model: nn.Module, frame: int | None, amount: float = 3.0) -> None:
        super().__init__()
        self.model, self.frame, self.amount = model, frame, amount

    @property
    def dtype(self) -> torch.dtype:
        return self.model.dtype

    def forward(self, hidden_states, timestep, encoder_hidden_states, return_dict=False, **kwargs):
        out = self.model(hidden_states=hidden_states, timestep=timestep,
                         encoder_hidden_states=encoder_hidden_states, return_dict=False)[0]  # fmt: skip
        if self.frame is None:
            return (out,)
        bump = torch.zeros_like(out)
        bump[:, :, self.frame] = self.amount
        return (out + bump,)


def method_losses(
    world, method: str, student_frame: int | None, critic_frame: int | None = None
) -> tuple[torch.Tensor, ...]:
    """The per-sample loss of each of `method`'s updates ("student", then "critic" for dmd) on one
    image-mode batch, the same randomness each call, with the student's and the critic's velocity
    moved at the frames given."""
    info = inspect_teacher(str(world["teacher"]))
    transformer, _ = load_experts(info, torch.float32)
    torch.manual_seed(0)
    _, condition = image_inputs(world)
    extra = {"regression_weight": 0.5} if method == "dmd" else {}
    cfg = parse_config(args_for(world, world["root"] / "unused", "image", method=method, **extra))
    teacher = GuidedTeacher(transformer, None, None, 5.0, 1.0, CPU, torch.float32, kind=TI2V_5B)
    shape = info.latent_shape(SIZE, SIZE, FRAMES)
    env = MethodEnv(teacher, torch.zeros(1, LENGTH, info.text_dim), CPU, 5.0, contextlib.nullcontext,
                    lambda: (0.0, 1.0), shape)  # fmt: skip
    models = {"student": ShiftedAt(transformer, student_frame)}
    if method == "dmd":
        models["critic"] = ShiftedAt(transformer, critic_frame)
    chosen = DmdMethod(cfg, env, models) if method == "dmd" else VelocityMethod(cfg, env, models)
    draw = torch.Generator().manual_seed(5)
    batch = {
        "cond": torch.randn(2, LENGTH, info.text_dim, generator=draw),
        "x0": torch.randn(2, *shape, generator=draw),
        "noise": torch.randn(2, *shape, generator=draw),
        "condition": condition.channels.repeat(2, 1, 1, 1, 1),
        "condition_mask": condition.mask.repeat(2, 1, 1, 1, 1),
    }
    losses = []
    for update in models:
        rng = BatchRandomness(torch.Generator().manual_seed(7), 11, 0, 1, CPU)
        with torch.no_grad():
            losses.append(chosen.loss(update, batch, rng).losses)
    return tuple(losses)


def dmd_losses(world, student_frame: int | None, critic_frame: int | None) -> tuple[torch.Tensor, ...]:
    """(generator loss, critic loss) per sample of one image-mode dmd batch."""
    return method_losses(world, "dmd", student_frame, critic_frame)


def test_the_velocity_loss_does_not_depend_on_a_prediction_at_the_image_frame(world):
    """Velocity distillation in image mode: the image's latent frame is given, not predicted, so a
    student velocity moved there changes no sample's loss; moved at frame 1, it changes every one."""
    (loss,) = method_losses(world, "velocity", None)
    assert torch.isfinite(loss).all() and float(loss.min()) > 0
    (moved_at_image,) = method_losses(world, "velocity", 0)
    assert torch.equal(moved_at_image, loss)
    (moved_after,) = method_losses(world, "velocity", 1)
    assert bool((moved_after > loss * 1.01).all())


def test_no_dmd_loss_depends_on_a_prediction_at_the_image_frame(world):
    """The generator's loss (distribution matching + regression), over its rollout, and the critic's
    denoising loss: a velocity moved at latent frame 0 (the image's) changes nothing; at frame 1 it
    changes both."""
    generator, critic = dmd_losses(world, None, None)
    assert torch.isfinite(generator).all() and torch.isfinite(critic).all() and float(critic.min()) > 0
    moved_at_image = dmd_losses(world, 0, 0)
    assert torch.equal(moved_at_image[0], generator) and torch.equal(moved_at_image[1], critic)
    moved_after = dmd_losses(world, 1, 1)
    assert not torch.allclose(moved_after[0], generator, rtol=1e-3, atol=0)
    assert not torch.allclose(moved_after[1], critic, rtol=1e-3, atol=0)


def test_the_dmd_gradient_counts_the_positions_the_weight_counts():
    """Weighted: no gradient and no share of the normaliser at frame 0; unweighted (every A14B run,
    TI2V text mode): DMD2's arithmetic exactly as before the weight existed."""
    g = torch.Generator().manual_seed(0)
    x0_hat, real, fake = (torch.randn(2, 48, 2, 2, 2, generator=g) for _ in range(3))
    mask = torch.ones(2, 1, 2, 2, 2)
    mask[:, :, 0] = 0
    weight = loss_weight(TI2V_5B, x0_hat, Condition(torch.zeros(2, 48, 1, 2, 2), mask))
    assert loss_weight(T2V_A14B, x0_hat, None) is None
    x = x0_hat.clone().requires_grad_(True)
    dmd_loss(x, dmd_gradient(x, real, fake, weight), weight).sum().backward()
    assert float(x.grad[:, :, 0].abs().max()) == 0.0 and float(x.grad[:, :, 1].abs().min()) > 0
    elsewhere = x0_hat.clone()
    elsewhere[:, :, 0] += 5.0
    real_elsewhere = real.clone()
    real_elsewhere[:, :, 0] -= 5.0
    torch.testing.assert_close(
        dmd_loss(elsewhere, dmd_gradient(elsewhere, real_elsewhere, fake, weight), weight),
        dmd_loss(x0_hat, dmd_gradient(x0_hat, real, fake, weight), weight),
        rtol=1e-6,
        atol=0,
    )
    normaliser = (x0_hat - real).abs().mean(dim=(1, 2, 3, 4), keepdim=True)
    plain = 0.5 * ((fake - real) / normaliser).pow(2).flatten(1).mean(1)
    assert torch.equal(dmd_loss(x0_hat, dmd_gradient(x0_hat, real, fake)), plain)


# ---------------------------------------------------------------------------------------------
# Runs: dmd and LoRA in both modes, their outputs, stock diffusers
# ---------------------------------------------------------------------------------------------


def finite_losses(out: Path, *names: str) -> None:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    for name in names:
        values = [row[name] for row in rows if row.get(name) is not None]
        assert values and all(np.isfinite(values)), (name, values)


@pytest.mark.long
@pytest.mark.parametrize("mode", ["text", "image"])
def test_dmd_trains_a_small_student_in_each_mode(world, mode):
    out = run(
        world, f"dmd_{mode}", mode, method="dmd", student_config=world["student"], regression_weight=0.5
    )
    finite_losses(out, "loss", "critic_loss", "regression_loss")
    assert (out / "student" / "scheduler_config.json").is_file()
    assert (out / "student" / "diffusion_pytorch_model.safetensors").is_file()
    settings = read_run_settings(out / "run_settings.json")
    assert settings.num_inference_steps == STEPS and settings.guidance_scale == 1.0
    if mode == "image":  # the exported pipeline/ samples as our sampler does, the image at frame 0
        info = inspect_teacher(str(world["teacher"]))
        image, condition = image_inputs(world, 1)
        embeds = torch.randn(1, LENGTH, info.text_dim, generator=torch.Generator().manual_seed(6))
        student = load_student(out / "student", info, CPU, torch.float32)
        scheduler = load_few_step_scheduler(out / "student")
        shape = info.latent_shape(SIZE, SIZE, FRAMES)
        ours = sample_few_step(
            student, scheduler, STEPS, embeds, shape, 9, condition=condition, kind=TI2V_5B
        )[0]
        pipe = WanImageToVideoPipeline.from_pretrained(out / "pipeline")
        assert pipe.config.expand_timesteps and pipe.scheduler.config.stochastic_sampling
        pipe.set_progress_bar_config(disable=True)
        expected = stock_latent(pipe, embeds, 9, image)
        same_sample(ours, expected)
        assert torch.equal(ours[:, :1], condition.channels[0])


def lora_student(world: dict[str, Path], folder: Path) -> nn.Module:
    """The one transformer with the folder's adapters, as our code loads them."""
    info = inspect_teacher(str(world["teacher"]))
    transformer, _ = load_experts(info, torch.float32)
    shape, states = read_lora_folder(folder)
    experts = LoraExperts(transformer, None, shape, None, seed=0)
    experts.load(STUDENT_ADAPTER, states)
    return experts.model(STUDENT_ADAPTER, None).requires_grad_(False)


def check_one_transformer_files(world: dict[str, Path], folder: Path) -> None:
    """lora/ and lora/comfyui/ hold one file each, with every block of the one transformer."""
    layers = json.loads((world["teacher"] / "transformer" / "config.json").read_text())["num_layers"]
    for sub, prefix in (
        (folder, "transformer.blocks."),
        (folder / WAN_FORMAT_DIR, "diffusion_model.blocks."),
    ):
        assert sorted(p.name for p in sub.glob("*.safetensors")) == list(ONE_FILE.values())
        keys = list(load_file(str(sub / ONE_FILE["high"])))
        assert keys and all(k.startswith(prefix) for k in keys), keys[:3]
        assert {int(k.split(".")[2]) for k in keys} == set(range(layers))
    assert check_lora_folder(folder, "test").experts == ONE_EXPERT
    assert check_lora_folder(folder / WAN_FORMAT_DIR, "test").experts == ONE_EXPERT


@pytest.mark.long
def test_dmd_lora_in_image_mode_loads_in_stock_diffusers_in_both_key_styles(world):
    out = run(world, "lora_image", "image", method="dmd", student_lora_rank=4, lr=1e-2,
              export_formats="diffusers,merged")  # fmt: skip
    finite_losses(out, "loss", "critic_loss")
    folder = out / "lora"
    check_one_transformer_files(world, folder)
    image, condition = image_inputs(world)
    info = inspect_teacher(str(world["teacher"]))
    embeds = torch.randn(1, LENGTH, info.text_dim, generator=torch.Generator().manual_seed(2))
    shape = info.latent_shape(SIZE, SIZE, FRAMES)
    scheduler = scheduler_from_config(read_run_settings(folder / "run_settings.json").scheduler)
    student = lora_student(world, folder)
    ours = sample_few_step(student, scheduler, STEPS, embeds, shape, 7, condition=condition, kind=TI2V_5B)[0]
    teacher_alone, _ = load_experts(info, torch.float32)
    plain = sample_few_step(
        teacher_alone, scheduler, STEPS, embeds, shape, 7, condition=condition, kind=TI2V_5B
    )
    assert float((ours - plain[0]).abs().max()) > 1e-4  # the adapters do something
    for files in (folder, folder / WAN_FORMAT_DIR):
        transformer, _ = load_experts(info, torch.float32)
        pipe = stock("image", transformer, world["teacher"], image)
        pipe.load_lora_weights(str(files), weight_name=ONE_FILE["high"], adapter_name="fast")
        pipe.scheduler = scheduler
        expected = stock_latent(pipe, embeds, 7, image)
        same_sample(ours, expected)
    # merged/: the one transformer with the adapters added in (W + BA rounds once more)
    assert sorted(p.name for p in (out / "merged").glob("transformer*")) == ["transformer"]
    merged = WanImageToVideoPipeline.from_pretrained(out / "merged")
    assert merged.config.expand_timesteps and merged.transformer_2 is None
    merged.scheduler = scheduler
    merged.set_progress_bar_config(disable=True)
    same_sample(ours, stock_latent(merged, embeds, 7, image), atol=1e-4)


@pytest.mark.long
def test_dmd_lora_with_a_full_critic_in_text_mode_loads_in_stock_wan_pipeline(world):
    out = run(world, "lora_full_critic", "text", method="dmd", student_lora_rank=4,
              critic_lora_rank=0, lr=1e-2)  # fmt: skip
    finite_losses(out, "loss", "critic_loss")
    folder = out / "lora"
    check_one_transformer_files(world, folder)
    info = inspect_teacher(str(world["teacher"]))
    embeds = torch.randn(1, LENGTH, info.text_dim, generator=torch.Generator().manual_seed(4))
    shape = info.latent_shape(SIZE, SIZE, FRAMES)
    ours = sample_few_step(lora_student(world, folder), few_step_scheduler(5.0), STEPS, embeds, shape, 5,
                           kind=TI2V_5B)[0]  # fmt: skip
    pipe = WanPipeline.from_pretrained(world["teacher"])  # expand_timesteps from its model_index.json
    assert pipe.config.expand_timesteps and pipe.transformer_2 is None
    pipe.load_lora_weights(str(folder))  # the folder's only weights file: no weight_name needed
    pipe.scheduler = few_step_scheduler(5.0)
    pipe.set_progress_bar_config(disable=True)
    expected = stock_latent(pipe, embeds, 5, None)
    same_sample(ours, expected)


@pytest.mark.long
def test_velocity_lora_trains_the_one_transformer_in_text_mode(world):
    out = run(world, "lora_velocity", "text", student_lora_rank=4, guidance_scale=5.0)
    finite_losses(out, "loss")
    check_one_transformer_files(world, out / "lora")
    states = read_lora_folder(out / "lora")[1]
    assert set(states) == {"high"} and any(
        float(v.abs().max()) > 0 for k, v in states["high"].items() if "lora_B" in k
    )  # B starts at zero: trained


# ---------------------------------------------------------------------------------------------
# Misuse
# ---------------------------------------------------------------------------------------------


def one_transformer_folder(world: dict[str, Path], out: Path) -> Path:
    """Fresh adapters (rank 4, alpha 4) of the TI2V transformer, as a TI2V LoRA run writes them."""
    info = inspect_teacher(str(world["teacher"]))
    transformer, _ = load_experts(info, torch.float32)
    student = LoraExperts(transformer, None, LoraShape(4, 4.0), None, seed=0).model(STUDENT_ADAPTER, None)
    return write_lora_folder({"high": student.state("high")}, LoraShape(4, 4.0), out, kind=TI2V_5B)


@pytest.mark.parametrize("phase", ["low", "high"])
def test_an_expert_phase_on_the_one_transformer_is_refused_naming_the_flag(world, tmp_path, capsys, phase):
    start = one_transformer_folder(world, tmp_path / "lora")  # a valid start: the phase is what is wrong
    argv = args_for(world, tmp_path / "out", "text", method="dmd", student_lora_rank=4,
                    expert_phase=phase, student_lora_init=start)  # fmt: skip
    assert train(argv) == 3
    err = capsys.readouterr().err
    assert "Traceback" not in err and f"--expert_phase {phase}" in err and "one transformer" in err
    assert "drop --expert_phase" in err and not (tmp_path / "out" / "checkpoints").exists()


def two_expert_folder(world: dict[str, Path], out: Path) -> Path:
    """Adapters for two experts of the TI2V transformer's shape, recording no teacher."""
    info = inspect_teacher(str(world["teacher"]))
    transformer, _ = load_experts(info, torch.float32)
    experts = LoraExperts(transformer, copy.deepcopy(transformer), LoraShape(4, 4.0), None, seed=0)
    student = experts.model(STUDENT_ADAPTER, 0.875)
    return write_lora_folder({w: student.state(w) for w in ("high", "low")}, LoraShape(4, 4.0), out)


def test_adapters_for_two_experts_are_refused_on_the_one_transformer(world, tmp_path):
    folder = two_expert_folder(world, tmp_path / "two")
    found = check_lora_folder(folder, "--student_lora_init")
    assert found.experts == ("high", "low")
    with pytest.raises(DistillError) as refused:
        check_fits_teacher(found, inspect_teacher(str(world["teacher"])), "--student_lora_init")
    text = str(refused.value)
    assert "two experts" in text and "one transformer" in text and "--teacher_path" in refused.value.fixes[0]
    # the files of a one-transformer run copied beside them: refused as a mix, naming both
    (folder / ONE_FILE["high"]).write_bytes((folder / FILES["high"]).read_bytes())
    with pytest.raises(DistillError) as mixed:
        check_lora_folder(folder, "--student_lora_init")
    assert ONE_FILE["high"] in str(mixed.value) and FILES["high"] in str(mixed.value)
