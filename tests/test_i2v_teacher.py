"""The image-to-video teacher equals stock WanImageToVideoPipeline: the condition it builds from an
image, its guided prediction at every step of a sampling run across the expert boundary, and the
clean latents it samples. On the tiny random I2V-A14B teacher (two 36-channel experts, boundary 0.9)."""

import numpy as np
import pytest
import torch
from diffusers import WanTransformer3DModel
from PIL import Image

from distill.models.conditioning import Condition, image_condition, model_input
from distill.models.guided_teacher import GuidedTeacher
from distill.models.pipelines import initial_noise, load_scheduler, load_vae, sample_latents, teacher_pipeline
from distill.models.teacher_kind import I2V_A14B, T2V_A14B
from distill.models.tiny import write_tiny_teacher

HEIGHT, WIDTH, FRAMES = 32, 32, 5  # latents 16 x 2 x 4 x 4
STEPS = 6  # timesteps 999, 937 (high-noise expert), then 857 ... (low-noise expert)
GUIDANCE = (4.0, 3.0)
TEXT_LEN = 6

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def parts(tmp_path_factory):
    path = write_tiny_teacher(tmp_path_factory.mktemp("i2v") / "teacher", seed=0, kind=I2V_A14B)
    high = WanTransformer3DModel.from_pretrained(path, subfolder="transformer").eval()
    low = WanTransformer3DModel.from_pretrained(path, subfolder="transformer_2").eval()
    vae = load_vae(path, torch.device("cpu"))
    gen = torch.Generator().manual_seed(0)
    text_dim = high.config.text_dim
    cond = torch.randn(1, TEXT_LEN, text_dim, generator=gen)
    uncond = torch.randn(1, TEXT_LEN, text_dim, generator=gen)
    return path, high, low, vae, cond, uncond


def _pipe(parts):
    path, high, low, vae, _, _ = parts
    return teacher_pipeline(high, low, I2V_A14B.boundary_ratio, load_scheduler(path), kind=I2V_A14B, vae=vae)


def _image(seed: int, low: int = 0) -> Image.Image:
    # `low` 128: a bright image, no value below 0 once in [-1, 1]
    pixels = np.random.default_rng(seed).integers(low, 256, size=(HEIGHT, WIDTH, 3), dtype=np.uint8)
    return Image.fromarray(pixels)


def _preprocessed(pipe, image: Image.Image) -> torch.Tensor:
    return pipe.video_processor.preprocess(image, height=HEIGHT, width=WIDTH)


def _stock(pipe, parts, image, noise, **kwargs):
    *_, cond, uncond = parts
    return pipe(
        image=image,
        prompt_embeds=cond,
        negative_prompt_embeds=uncond,
        height=HEIGHT,
        width=WIDTH,
        num_frames=FRAMES,
        num_inference_steps=STEPS,
        guidance_scale=GUIDANCE[0],
        guidance_scale_2=GUIDANCE[1],
        latents=noise,
        output_type="latent",
        max_sequence_length=TEXT_LEN,
        **kwargs,
    ).frames


def _noise(seed: int = 3) -> torch.Tensor:
    return initial_noise((16, (FRAMES - 1) // 4 + 1, HEIGHT // 8, WIDTH // 8), seed)


def test_image_condition_is_the_one_the_pipeline_builds(parts):
    _, high, _, vae, _, _ = parts
    pipe = _pipe(parts)
    seen = []
    hook = high.register_forward_pre_hook(
        lambda _m, _a, kw: seen.append(kw["hidden_states"].clone()), with_kwargs=True
    )
    try:
        _stock(pipe, parts, _image(1), _noise())
    finally:
        hook.remove()
    assert seen[0].shape[1] == I2V_A14B.in_channels
    ours = image_condition(vae, _preprocessed(pipe, _image(1)), FRAMES)
    assert ours.channels.shape == (1, 20, 2, 4, 4)
    assert torch.equal(ours.channels, seen[0][:, 16:])
    # mask: 1 on latent frame 0 (the image), 0 after; then the image's latent
    assert torch.equal(ours.channels[:, :4, 0], torch.ones(1, 4, 4, 4))
    assert not ours.channels[:, :4, 1:].any()


def test_guided_prediction_equals_the_pipeline_at_every_step_across_the_boundary(parts):
    _, high, low, vae, cond, uncond = parts
    pipe = _pipe(parts)
    steps = []
    stock_step = pipe.scheduler.step

    def capture(model_output, timestep, sample, *args, **kwargs):
        steps.append((model_output.clone(), timestep, sample.clone()))
        return stock_step(model_output, timestep, sample, *args, **kwargs)

    pipe.scheduler.step = capture
    _stock(pipe, parts, _image(2), _noise())
    teacher = GuidedTeacher(
        high, low, I2V_A14B.boundary_ratio, *GUIDANCE, torch.device("cpu"), torch.float32, kind=I2V_A14B
    )
    condition = image_condition(vae, _preprocessed(pipe, _image(2)), FRAMES)
    sides = set()
    for guided, t, latents in steps:
        ours = teacher.velocity(latents, t.reshape(1).cpu(), cond, uncond, condition=condition)
        torch.testing.assert_close(ours, guided, rtol=1e-5, atol=1e-6)
        sides.add(bool(t >= 900))
    assert len(steps) == STEPS and sides == {True, False}  # both experts, each with its guidance


def test_a_batch_keeps_each_sample_with_its_own_image(parts):
    _, high, low, vae, cond, uncond = parts
    pipe = _pipe(parts)
    images = torch.cat([_preprocessed(pipe, _image(s)) for s in (4, 5, 6)])
    condition = image_condition(vae, images, FRAMES)
    teacher = GuidedTeacher(
        high, low, I2V_A14B.boundary_ratio, *GUIDANCE, torch.device("cpu"), torch.float32, kind=I2V_A14B
    )
    x = torch.randn(3, 16, 2, 4, 4, generator=torch.Generator().manual_seed(1))
    t = torch.tensor([950, 300, 920])  # high, low, high: rows reordered by expert inside
    texts = torch.cat([cond, uncond, cond])
    batch = teacher.velocity(x, t, texts, uncond, condition=condition)
    for i in range(3):
        alone = image_condition(vae, images[i], FRAMES)
        one = teacher.velocity(x[i : i + 1], t[i : i + 1], texts[i : i + 1], uncond, condition=alone)
        # A row computed in a batch of 3 and alone sums in other orders: a few float32 ulps apart
        # (1.1e-6 on one element of 512 on a CI run); a row with another's image is off by far more.
        torch.testing.assert_close(batch[i : i + 1], one, rtol=1e-4, atol=1e-5)
    swapped = Condition(condition.channels.flip(0))
    assert not torch.allclose(teacher.velocity(x, t, texts, uncond, condition=swapped), batch, atol=1e-4)


def test_lockstep_placeholder_carries_the_condition_channels(parts):
    _, high, low, vae, cond, uncond = parts
    seen = []
    hook = low.register_forward_pre_hook(
        lambda _m, _a, kw: seen.append(tuple(kw["hidden_states"].shape)), with_kwargs=True
    )
    teacher = GuidedTeacher(
        high, low, I2V_A14B.boundary_ratio, *GUIDANCE, torch.device("cpu"), torch.float32, True, I2V_A14B
    )
    condition = image_condition(vae, torch.zeros(1, 3, HEIGHT, WIDTH), FRAMES)
    try:
        teacher.velocity(
            torch.randn(1, 16, 2, 4, 4), torch.tensor([990]), cond, uncond, (True, True), condition
        )
    finally:
        hook.remove()
    assert seen == [(1, I2V_A14B.in_channels, 1, 2, 2)]  # one token, all 36 channels


def test_sample_latents_with_an_image_equals_the_stock_pipeline(parts):
    *_, cond, uncond = parts
    for image in (_image(7), _image(8, low=128)):  # the second: a bright image, no negative value
        pipe = _pipe(parts)
        stock = _stock(pipe, parts, image, _noise(9))[0]
        ours = sample_latents(
            _pipe(parts), _noise(9), cond, uncond, STEPS, *GUIDANCE, image=_preprocessed(pipe, image)
        )
        assert torch.equal(ours, stock)
    with pytest.raises(ValueError, match="needs an image"):
        sample_latents(_pipe(parts), _noise(9), cond, uncond, STEPS, *GUIDANCE)


def test_the_conditioning_layer_refuses_a_condition_its_kind_does_not_take():
    x = torch.zeros(1, 16, 2, 4, 4)
    assert model_input(T2V_A14B, x, None) is x
    assert model_input(T2V_A14B, x, Condition()) is x
    with pytest.raises(ValueError, match="no condition"):
        model_input(T2V_A14B, x, Condition(torch.zeros(1, 20, 2, 4, 4)))
    with pytest.raises(ValueError, match="needs the image condition"):
        model_input(I2V_A14B, x, None)
    with pytest.raises(ValueError, match="expected"):
        model_input(I2V_A14B, x, Condition(torch.zeros(1, 20, 1, 4, 4)))
    assert model_input(I2V_A14B, x, Condition(torch.ones(1, 20, 2, 4, 4))).shape[1] == 36
