"""Prompts paired with images (issue 37, items 3 and 8): the formats that pair them, every bad record
refused as a data error (exit 6) naming the prompts file, its line and the image, the stock image
preprocessing, and the image-latent cache keyed by the image's bytes."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np
import PIL.Image
import pytest
import torch

from distill.data.image_latents import fill_image_latent_cache, image_key, image_latent_cache
from distill.data.images import ImagePreprocessor, read_image_prompts
from distill.ops.errors import DistillError, Stage

HEIGHT, WIDTH = 32, 48


def picture(path: Path, width: int = WIDTH, height: int = HEIGHT, seed: int = 0, mode: str = "RGB") -> Path:
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, len(mode)), dtype=np.uint8)
    path.parent.mkdir(parents=True, exist_ok=True)
    PIL.Image.fromarray(pixels, mode).save(path)
    return path


def refused(path: Path) -> DistillError:
    with pytest.raises(DistillError) as error:
        read_image_prompts(path, "--data_path")
    assert error.value.stage == Stage.DATA  # exit 6
    assert f"--data_path {path}" in error.value.title
    return error.value


@pytest.mark.parametrize(
    "name, text",
    [
        (
            "p.jsonl",
            '{"prompt": "a cat", "image": "images/cat.png"}\n\n{"prompt": "a dog", "image": "dog.png"}\n',
        ),
        ("p.csv", 'prompt,image\n"a cat, sitting",images/cat.png\na dog,dog.png\n'),
        ("p.tsv", "image\tprompt\nimages/cat.png\ta cat, sitting\ndog.png\ta dog\n"),
    ],
)
def test_each_format_pairs_prompts_with_images_relative_to_the_file(tmp_path, name, text):
    folder = tmp_path / "data"
    picture(folder / "images" / "cat.png")
    picture(folder / "dog.png", seed=1)
    (folder / name).write_text(text)
    pairs = read_image_prompts(folder / name)
    assert [p.prompt for p in pairs] == ["a cat, sitting" if name != "p.jsonl" else "a cat", "a dog"]
    assert [p.image for p in pairs] == [folder / "images" / "cat.png", folder / "dog.png"]
    assert [p.line for p in pairs] == [1, 3] if name == "p.jsonl" else [2, 3]


@pytest.mark.parametrize(
    "name, text, words",
    [
        (
            "p.jsonl",
            '{"prompt": "a cat", "image": "cat.png"}\n{"prompt": "a dog"}\n',
            "line 2 has no 'image' field",
        ),
        ("p.jsonl", '{"prompt": "a cat", "image": null}\n', "line 1 has no image"),
        ("p.jsonl", '{"prompt": "a cat", "image": 3}\n', "line 1 has an image field that is a int"),
        ("p.csv", "prompt,image\na cat,cat.png\na dog,\n", "line 3 has an empty 'image' field"),
        ("p.csv", "prompt\na cat\n", "line 2 has no 'image' field (fields: 'prompt')"),
        ("p.tsv", "prompt\timage\na cat\n", "line 2 has no image"),
    ],
)
def test_a_record_without_an_image_is_refused_with_its_line(tmp_path, name, text, words):
    picture(tmp_path / "cat.png")
    (tmp_path / name).write_text(text)
    error = refused(tmp_path / name)
    assert words in error.title
    assert ".jsonl" in error.fixes[0] and ".csv / .tsv" in error.fixes[0]


def test_a_prompts_file_that_pairs_no_images_says_which_formats_do(tmp_path):
    (tmp_path / "p.txt").write_text("a cat\na dog\n")
    error = refused(tmp_path / "p.txt")
    assert "a .txt prompts file pairs no images" in error.title
    assert '{"prompt": "...", "image": ' in error.fixes[0] and "columns prompt and image" in error.fixes[0]


@pytest.mark.parametrize(
    "make, words",
    [
        (lambda folder: None, "not found"),
        (lambda folder: (folder / "cat.png").write_bytes(b"plain text, not a picture"), "is not an image"),
        (lambda folder: (folder / "cat.png").mkdir(), "is a folder, not an image file"),
    ],
)
def test_a_missing_or_non_image_file_is_refused_naming_the_line_and_the_image(tmp_path, make, words):
    picture(tmp_path / "dog.png")
    make(tmp_path)
    path = tmp_path / "p.jsonl"
    path.write_text("\n".join(json.dumps({"prompt": p, "image": f"{p}.png"}) for p in ("dog", "cat")))
    error = refused(path)
    assert f"line 2: image {tmp_path / 'cat.png'} {words}" in error.title


def test_a_truncated_image_is_refused_when_it_is_decoded(tmp_path):
    image = picture(tmp_path / "cat.png", width=64, height=64)
    image.write_bytes(image.read_bytes()[:200])  # the header survives, the pixels do not
    (tmp_path / "p.jsonl").write_text('{"prompt": "a cat", "image": "cat.png"}\n')
    (pair,) = read_image_prompts(tmp_path / "p.jsonl")
    with pytest.raises(DistillError) as error:
        ImagePreprocessor(HEIGHT, WIDTH)(pair)
    assert error.value.stage == Stage.DATA
    assert f"{tmp_path / 'p.jsonl'}: line 1: image {image} cannot be decoded" in error.value.title


@pytest.fixture(scope="module")
def tiny_vae(tiny_teacher: Path) -> torch.nn.Module:
    from diffusers import AutoencoderKLWan

    return AutoencoderKLWan.from_pretrained(tiny_teacher / "vae").eval()


def test_preprocessing_is_the_stock_pipelines_and_odd_sizes_are_said_once(tmp_path, tiny_vae, caplog):
    from diffusers import WanImageToVideoPipeline
    from diffusers.utils import load_image

    stock = WanImageToVideoPipeline(tokenizer=None, text_encoder=None, vae=tiny_vae, scheduler=None)
    picture(tmp_path / "wide.png", width=90, height=30, mode="RGBA")  # another aspect ratio, smaller
    picture(tmp_path / "wider.png", width=120, height=20, seed=1)
    (tmp_path / "p.csv").write_text("prompt,image\na cat,wide.png\na dog,wider.png\n")
    preprocess = ImagePreprocessor(HEIGHT, WIDTH, tiny_vae.config.scale_factor_spatial)
    with caplog.at_level(logging.WARNING, logger="distill.data.images"):
        for pair in read_image_prompts(tmp_path / "p.csv"):
            ours = preprocess(pair)
            theirs = stock.video_processor.preprocess(load_image(str(pair.image)), height=HEIGHT, width=WIDTH)
            assert ours.shape == (1, 3, HEIGHT, WIDTH)
            assert torch.equal(ours, theirs.float())
    said = [r.getMessage() for r in caplog.records if r.name == "distill.data.images"]
    assert len(said) == 3  # one per kind, for the first image only
    assert any("has transparent pixels (mode RGBA): the transparency is dropped" in s for s in said)
    assert any("90x30, another aspect ratio than the run's 48x32" in s and "line 2" in s for s in said)
    assert any("smaller than the run's 48x32" in s and "wide.png" in s for s in said)


def encoder(vae: torch.nn.Module):
    def encode(pixels: torch.Tensor) -> torch.Tensor:
        return vae.encode(pixels.unsqueeze(2)).latent_dist.mode()[0]

    return encode


def test_the_latent_cache_is_keyed_by_content_and_refuses_another_vae_or_size(tmp_path, tiny_vae):
    cat = picture(tmp_path / "cat.png")
    (tmp_path / "copy.png").write_bytes(cat.read_bytes())
    picture(tmp_path / "dog.png", seed=1)
    (tmp_path / "p.jsonl").write_text(
        "\n".join(json.dumps({"prompt": p, "image": f"{p}.png"}) for p in ("cat", "dog", "copy"))
    )
    pairs = read_image_prompts(tmp_path / "p.jsonl")
    preprocess, encode = ImagePreprocessor(HEIGHT, WIDTH), encoder(tiny_vae)
    calls = []

    def counted(pixels: torch.Tensor) -> torch.Tensor:
        calls.append(pixels)
        return encode(pixels)

    cache = image_latent_cache(tmp_path / "cache", "vae-a", HEIGHT, WIDTH, 1, torch.float32)
    keys = fill_image_latent_cache(cache, pairs, preprocess, counted)
    assert len(calls) == 2  # the copy under another name shares the cat's entry
    assert keys[tmp_path / "copy.png"] == keys[cat] == image_key(cat)
    with torch.no_grad():
        expected = encode(preprocess(pairs[0]))
    assert torch.equal(cache.get(keys[cat]), expected)
    fill_image_latent_cache(cache, pairs, preprocess, counted)
    assert len(calls) == 2  # a second run encodes nothing

    for vae, height, what in (
        ("vae-b", HEIGHT, "vae: cache has 'vae-a'"),
        ("vae-a", 64, "height: cache has 32"),
    ):
        with pytest.raises(DistillError) as error:
            image_latent_cache(tmp_path / "cache", vae, height, WIDTH, 1, torch.float32)
        assert error.value.stage == Stage.DATA
        assert "image-latent cache" in error.value.title and what in error.value.details
        assert f"delete {tmp_path / 'cache' / 'image_latents'}" in error.value.fixes[0]


def test_an_encode_that_raises_leaves_nothing_half_written(tmp_path, tiny_vae):
    for name, seed in (("a", 0), ("b", 1)):
        picture(tmp_path / f"{name}.png", seed=seed)
    (tmp_path / "p.csv").write_text("prompt,image\nfirst,a.png\nsecond,b.png\n")
    pairs = read_image_prompts(tmp_path / "p.csv")
    cache = image_latent_cache(tmp_path / "cache", "vae-a", HEIGHT, WIDTH, 1, torch.float32)
    encode = encoder(tiny_vae)

    def fails_on_the_second(pixels: torch.Tensor) -> torch.Tensor:
        if list(cache.folder.glob("*.safetensors")):
            raise torch.OutOfMemoryError("CUDA out of memory")
        return encode(pixels)

    with pytest.raises(torch.OutOfMemoryError):
        fill_image_latent_cache(cache, pairs, ImagePreprocessor(HEIGHT, WIDTH), fails_on_the_second)
    written = sorted(p.name for p in cache.folder.iterdir())
    assert written == sorted([f"{image_key(tmp_path / 'a.png')}.safetensors", "settings.json"])
    first = cache.get(image_key(tmp_path / "a.png"))
    assert first.shape[0] == 16 and torch.isfinite(first).all()


def test_a_folder_of_captioned_videos_gives_their_first_frames(tmp_path):
    from diffusers import WanImageToVideoPipeline
    from diffusers.utils import load_video

    from distill.sample.media import write_frames

    frames = np.random.default_rng(0).random((5, HEIGHT, WIDTH, 3))
    video = write_frames(frames, tmp_path / "clips" / "b_wave.mp4")
    still = picture(tmp_path / "clips" / "c_still.png")  # a captioned picture is a member too
    (tmp_path / "clips" / "c_still.txt").write_text("a still lake")
    (tmp_path / "clips" / "b_wave.txt").write_text("a wave\nbreaking\n")
    pair, lake = read_image_prompts(tmp_path / "clips")
    assert (pair.prompt, pair.image) == ("a wave breaking", video)
    assert (lake.prompt, lake.image) == ("a still lake", still)
    stock = WanImageToVideoPipeline(tokenizer=None, text_encoder=None, vae=None, scheduler=None)
    theirs = stock.video_processor.preprocess(load_video(str(video))[0], height=HEIGHT, width=WIDTH)
    assert torch.equal(ImagePreprocessor(HEIGHT, WIDTH)(pair), theirs.float())

    write_frames(frames, tmp_path / "clips" / "a_rain.mp4")
    error = refused(tmp_path / "clips")
    assert "a_rain.mp4 has no caption file a_rain.txt" in error.title
    assert f"write the caption of a_rain.mp4 in {tmp_path / 'clips' / 'a_rain.txt'}" in error.fixes[0]
