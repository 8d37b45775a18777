"""The text-or-image-to-video teacher (Wan2.2-TI2V-5B: one transformer, the 48-channel Wan2.2 VAE,
a timestep per token) equals its stock pipelines in both modes: WanPipeline with expand_timesteps
for text, WanImageToVideoPipeline with expand_timesteps for an image. Checked on the tiny random
TI2V teacher: the condition built from an image, each forward's input and per-token timestep, the
guided prediction at every step of a sampling run, and the blended clean latents."""

import numpy as np
import pytest
import torch
from diffusers import WanImageToVideoPipeline, WanPipeline, WanTransformer3DModel
from PIL import Image

from distill.models.conditioning import (
    Condition,
    blend_latents,
    conditioned,
    image_condition,
    loss_weight,
    model_input,
    model_timestep,
)
from distill.models.guided_teacher import GuidedTeacher
from distill.models.pipelines import initial_noise, load_scheduler, load_vae
from distill.models.teacher_kind import I2V_A14B, T2V_A14B, TI2V_5B
from distill.models.tiny import write_tiny_teacher

HEIGHT, WIDTH, FRAMES = 64, 64, 5  # latents 48 x 2 x 4 x 4 (Wan2.2 VAE: 16x spatial), 8 tokens
LATENT = (48, 2, 4, 4)
STEPS = 4
GUIDANCE = 5.0
TEXT_LEN = 6

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def parts(tmp_path_factory):
    path = write_tiny_teacher(tmp_path_factory.mktemp("ti2v") / "teacher", seed=0, kind=TI2V_5B)
    transformer = WanTransformer3DModel.from_pretrained(path, subfolder="transformer").eval()
    vae = load_vae(path, torch.device("cpu"))
    gen = torch.Generator().manual_seed(0)
    # The tiny VAE's statistics are mean 0 / std 1; the real one's are not, and the normalisation
    # must be the pipeline's: give this one statistics of its own (the pipeline reads them too).
    vae.register_to_config(
        latents_mean=(torch.randn(48, generator=gen) * 0.3).tolist(),
        latents_std=(torch.rand(48, generator=gen) + 0.5).tolist(),
    )
    text_dim = transformer.config.text_dim
    cond = torch.randn(1, TEXT_LEN, text_dim, generator=gen)
    uncond = torch.randn(1, TEXT_LEN, text_dim, generator=gen)
    return path, transformer, vae, cond, uncond


def _pipe(parts, image: bool):
    path, transformer, vae, _, _ = parts
    cls = WanImageToVideoPipeline if image else WanPipeline
    pipe = cls(
        tokenizer=None,
        text_encoder=None,
        vae=vae,
        scheduler=load_scheduler(path),
        transformer=transformer,
        transformer_2=None,
        boundary_ratio=None,
        expand_timesteps=True,
    )
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _teacher(parts, lockstep: bool = False) -> GuidedTeacher:
    _, transformer, *_ = parts
    # One transformer: no second expert, no boundary; guidance_low is never used.
    return GuidedTeacher(
        transformer, None, None, GUIDANCE, 1.0, torch.device("cpu"), torch.float32, lockstep, TI2V_5B
    )


def _image(seed: int) -> Image.Image:
    pixels = np.random.default_rng(seed).integers(0, 256, size=(HEIGHT, WIDTH, 3), dtype=np.uint8)
    return Image.fromarray(pixels)


def _preprocessed(pipe, image: Image.Image) -> torch.Tensor:
    return pipe.video_processor.preprocess(image, height=HEIGHT, width=WIDTH)


def _noise(seed: int = 3) -> torch.Tensor:
    return initial_noise(LATENT, seed)


def _assert_relative(ours: torch.Tensor, stock: torch.Tensor) -> None:
    """Equal within 1e-5 of the stock tensor's scale. The teacher stacks its conditional and
    unconditional passes into one forward where the pipeline runs two, and guidance 5 scales the
    difference of their float32 rounding (about 1e-6 of the largest value) near zero values."""
    torch.testing.assert_close(ours, stock, rtol=1e-5, atol=1e-5 * float(stock.abs().max()))


def _run(pipe, parts, noise, image=None):
    """A stock sampling run; returns its final latents and, per step, (guided prediction, t,
    latents the step was taken from, the transformer's hidden_states and timestep)."""
    *_, cond, uncond = parts
    steps, forwards = [], []
    stock_step = pipe.scheduler.step

    def capture(model_output, timestep, sample, *args, **kwargs):
        steps.append((model_output.clone(), timestep, sample.clone()))
        return stock_step(model_output, timestep, sample, *args, **kwargs)

    pipe.scheduler.step = capture
    hook = pipe.transformer.register_forward_pre_hook(
        lambda _m, _a, kw: forwards.append((kw["hidden_states"].clone(), kw["timestep"].clone())),
        with_kwargs=True,
    )
    try:
        latents = pipe(
            **({"image": image} if image is not None else {}),
            prompt_embeds=cond,
            negative_prompt_embeds=uncond,
            height=HEIGHT,
            width=WIDTH,
            num_frames=FRAMES,
            num_inference_steps=STEPS,
            guidance_scale=GUIDANCE,
            latents=noise,
            output_type="latent",
            max_sequence_length=TEXT_LEN,
        ).frames
    finally:
        hook.remove()
    assert len(steps) == STEPS and len(forwards) == 2 * STEPS  # conditional, unconditional
    # the conditional pass of each step (the unconditional one sees the same input and timestep)
    return latents, [(*step, *forwards[2 * i]) for i, step in enumerate(steps)]


def test_text_mode_equals_wan_pipeline_at_every_step(parts):
    _, transformer, _, cond, uncond = parts
    pipe = _pipe(parts, image=False)
    final, steps = _run(pipe, parts, _noise())
    teacher = _teacher(parts)
    for guided, t, latents, hidden, timestep in steps:
        # the forward's input and its per-token timestep: all 8 tokens at t
        assert torch.equal(model_input(TI2V_5B, latents, None), hidden)
        ours_t = model_timestep(TI2V_5B, t.reshape(1), latents)
        assert ours_t.shape == (1, 8) and torch.equal(ours_t, timestep)
        ours = teacher.velocity(latents, t.reshape(1).cpu(), cond, uncond)
        _assert_relative(ours, guided)
    assert torch.equal(blend_latents(TI2V_5B, final, None), final)  # text mode: nothing to blend
    # the model wrapped for a method (text mode too: its timestep is one per token)
    latents, t = steps[1][2], steps[1][1].reshape(1)
    (direct,) = conditioned(transformer, TI2V_5B, None)(latents, t, cond)
    torch.testing.assert_close(direct, transformer(latents, model_timestep(TI2V_5B, t, latents), cond)[0])


def test_image_condition_is_the_one_the_pipeline_builds(parts):
    _, _, vae, *_ = parts
    pipe = _pipe(parts, image=True)
    built = []
    stock_prepare = pipe.prepare_latents

    def capture(*args, **kwargs):
        built.append(stock_prepare(*args, **kwargs))
        return built[-1]

    pipe.prepare_latents = capture
    _run(pipe, parts, _noise(), _image(1))
    _, stock_latent, stock_mask = built[0]
    ours = image_condition(vae, _preprocessed(pipe, _image(1)), FRAMES, kind=TI2V_5B)
    assert ours.channels.shape == (1, 48, 1, 4, 4) and ours.mask.shape == (1, 1, 2, 4, 4)
    assert torch.equal(ours.channels, stock_latent)
    assert torch.equal(ours.mask, stock_mask)  # 0 on latent frame 0 (the image), 1 after
    assert not ours.mask[:, :, 0].any() and ours.mask[:, :, 1:].all()
    other = image_condition(vae, _preprocessed(pipe, _image(2)), FRAMES, kind=TI2V_5B)
    assert not torch.equal(other.channels, stock_latent)  # the latent is the image's own


def test_image_mode_equals_wan_image_to_video_pipeline_at_every_step(parts):
    _, _, vae, cond, uncond = parts
    pipe = _pipe(parts, image=True)
    image = _image(2)
    final, steps = _run(pipe, parts, _noise(), image)
    teacher = _teacher(parts)
    condition = image_condition(vae, _preprocessed(pipe, image), FRAMES, kind=TI2V_5B)
    for guided, t, latents, hidden, timestep in steps:
        # frame 0 of the input is the image's latent; frame-0 tokens (4 of 8) at timestep 0
        assert torch.equal(model_input(TI2V_5B, latents, condition), hidden)
        ours_t = model_timestep(TI2V_5B, t.reshape(1), latents, condition)
        assert torch.equal(ours_t, timestep) and not ours_t[:, :4].any() and (ours_t[:, 4:] == t).all()
        ours = teacher.velocity(latents, t.reshape(1).cpu(), cond, uncond, condition=condition)
        _assert_relative(ours, guided)
        # without the image, the prediction is another: the check above can tell them apart
        text_mode = teacher.velocity(latents, t.reshape(1).cpu(), cond, uncond)
        assert not torch.allclose(text_mode, guided, rtol=1e-3, atol=1e-4)
    # the pipeline blends its final latents: frame 0 is the image's latent exactly
    assert torch.equal(blend_latents(TI2V_5B, steps[-1][2], condition)[:, :, :1], condition.channels)
    assert torch.equal(final[:, :, :1], condition.channels)


def test_a_sampling_run_through_the_teacher_gives_the_pipeline_latents(parts):
    """Our own loop (teacher velocity, the same scheduler, the blend) samples the pipeline's
    clean latents, whether it blends once at the end (diffusers) or after every step (Wan)."""
    path, _, vae, cond, uncond = parts
    pipe = _pipe(parts, image=True)
    image = _image(4)
    stock, _ = _run(pipe, parts, _noise(5), image)
    teacher = _teacher(parts)
    condition = image_condition(vae, _preprocessed(pipe, image), FRAMES, kind=TI2V_5B)
    for every_step in (False, True):
        scheduler = load_scheduler(path)
        scheduler.set_timesteps(STEPS)
        latents = _noise(5)
        for t in scheduler.timesteps:
            velocity = teacher.velocity(latents, t.reshape(1), cond, uncond, condition=condition)
            latents = scheduler.step(velocity, t, latents, return_dict=False)[0]
            if every_step:
                latents = blend_latents(TI2V_5B, latents, condition)
        latents = blend_latents(TI2V_5B, latents, condition)
        _assert_relative(latents, stock)


def test_a_batch_mixes_modes_and_keeps_each_sample_with_its_own_image(parts):
    _, _, vae, cond, uncond = parts
    pipe = _pipe(parts, image=True)
    images = torch.cat([_preprocessed(pipe, _image(s)) for s in (6, 7)])
    pictured = image_condition(vae, images, FRAMES, kind=TI2V_5B)
    # a text-mode row: its mask all 1 (nothing replaced, every token at t)
    condition = Condition(
        torch.cat([pictured.channels, torch.zeros(1, *pictured.channels.shape[1:])]),
        torch.cat([pictured.mask, torch.ones(1, *pictured.mask.shape[1:])]),
    )
    teacher = _teacher(parts)
    x = torch.randn(3, *LATENT, generator=torch.Generator().manual_seed(1))
    t = torch.tensor([950, 300, 600])
    texts = torch.cat([cond, uncond, cond])
    batch = teacher.velocity(x, t, texts, uncond, condition=condition)
    for i in range(3):
        alone = condition.select(torch.tensor([i])) if i < 2 else None
        one = teacher.velocity(x[i : i + 1], t[i : i + 1], texts[i : i + 1], uncond, condition=alone)
        # A row computed in a batch of 3 and alone sums in other orders: a few float32 ulps apart
        # (1.1e-6 on one element of 512 on a CI run); a row with another's image is off by far more.
        torch.testing.assert_close(batch[i : i + 1], one, rtol=1e-4, atol=1e-5)
    swapped = Condition(condition.channels.flip(0), condition.mask.flip(0))
    assert not torch.allclose(teacher.velocity(x, t, texts, uncond, condition=swapped), batch, atol=1e-4)


def test_the_loss_counts_what_the_condition_does_not_fix(parts):
    _, _, vae, *_ = parts
    x = torch.zeros(2, *LATENT)
    condition = image_condition(vae, torch.zeros(2, 3, HEIGHT, WIDTH), FRAMES, kind=TI2V_5B)
    weight = loss_weight(TI2V_5B, x, condition)
    assert weight.dtype == torch.float32 and (weight * x).shape == x.shape
    assert not weight[:, :, 0].any() and weight[:, :, 1:].all()  # frame 0 is the image's
    assert loss_weight(TI2V_5B, x, None) is None  # text mode: every position counts
    a14b = torch.zeros(2, 16, 2, 4, 4)
    for kind, cond in ((T2V_A14B, None), (I2V_A14B, Condition(torch.ones(2, 20, 2, 4, 4)))):
        assert loss_weight(kind, a14b, cond) is None  # I2V-A14B denoises the image's frame too


def test_one_transformer_routes_every_sample_to_it_and_refuses_half_a_pair(parts):
    _, transformer, *_ = parts
    calls = []
    hook = transformer.register_forward_pre_hook(
        lambda _m, _a, kw: calls.append(kw["hidden_states"].shape[0]), with_kwargs=True
    )
    try:
        # lockstep asked for both experts: with one transformer the second entry means nothing
        teacher = _teacher(parts, lockstep=True)
        x = torch.randn(3, *LATENT)
        text = torch.randn(3, TEXT_LEN, transformer.config.text_dim)
        teacher.velocity(x, torch.tensor([999, 500, 10]), text, text[:1], (True, True))
    finally:
        hook.remove()
    assert calls == [6]  # one forward: all three samples, conditional and unconditional stacked
    with pytest.raises(ValueError, match="boundary"):
        GuidedTeacher(transformer, None, 0.875, 4.0, 3.0, torch.device("cpu"), torch.float32)
    with pytest.raises(ValueError, match="boundary"):
        GuidedTeacher(transformer, transformer, None, 4.0, 3.0, torch.device("cpu"), torch.float32)


def test_the_conditioning_layer_checks_ti2v_conditions():
    x = torch.zeros(1, *LATENT)
    assert model_input(TI2V_5B, x, None) is x and model_input(TI2V_5B, x, Condition()) is x
    with pytest.raises(ValueError, match="both the image latent and its mask"):
        model_input(TI2V_5B, x, Condition(torch.zeros(1, 48, 1, 4, 4)))
    with pytest.raises(ValueError, match="expected channels"):
        model_input(TI2V_5B, x, Condition(torch.zeros(1, 48, 1, 4, 4), torch.ones(1, 1, 3, 4, 4)))
    with pytest.raises(ValueError, match="no condition"):
        model_input(T2V_A14B, torch.zeros(1, 16, 2, 4, 4), Condition(mask=torch.ones(1, 1, 2, 4, 4)))
    with pytest.raises(ValueError, match="takes no image"):
        image_condition(None, torch.zeros(3, HEIGHT, WIDTH), FRAMES, scale_temporal=4, kind=T2V_A14B)
