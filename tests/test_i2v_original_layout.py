"""The I2V teacher in the ORIGINAL Wan layout: the tiny one (model_type i2v, in_dim 36) converts to
the diffusers WanImageToVideoPipeline layout, exactly the diffusers-layout tiny I2V teacher of the
same seed and shape, through the T2V conversion code with the kind as data.

    .venv/bin/python -m pytest -q tests/test_i2v_original_layout.py
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from diffusers import WanImageToVideoPipeline
from safetensors.torch import load_file

import download_wan
from distill.models.teacher import inspect_teacher
from distill.models.teacher_kind import I2V_A14B, read_teacher_kind
from distill.models.tiny import original_layout_shape, write_tiny_original_teacher, write_tiny_teacher

EXPERTS = {"transformer": "high_noise_model", "transformer_2": "low_noise_model"}


@pytest.fixture(scope="module")
def original(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny I2V teacher (seed 0) in the original layout. Copy it before changing anything in it."""
    return write_tiny_original_teacher(
        tmp_path_factory.mktemp("original") / "Wan2.2-I2V-A14B", seed=0, kind=I2V_A14B
    )


def _state(folder: Path) -> dict[str, torch.Tensor]:
    return {k: v for f in sorted(folder.glob("*.safetensors")) for k, v in load_file(f).items()}


def test_the_tiny_i2v_original_teacher_says_i2v_in_the_release_layout(original: Path) -> None:
    for expert in EXPERTS.values():
        config = json.loads((original / expert / "config.json").read_text())
        assert (config["model_type"], config["in_dim"], config["out_dim"]) == ("i2v", 36, 16)
    # The same VAE / T5 / tokenizer files as the T2V original layout; the release's own switch
    # (0.9) is left to Wan's code, as 0.875 is for T2V.
    for name in ("Wan2.1_VAE.pth", "models_t5_umt5-xxl-enc-bf16.pth", "google/umt5-xxl"):
        assert (original / name).exists()
    assert json.loads((original / "configuration.json").read_text()) == {
        "framework": "Pytorch",
        "task": "image-to-video",
    }
    assert read_teacher_kind(original).kind == I2V_A14B
    assert original_layout_shape(I2V_A14B).boundary_ratio == 0.9


def test_cli_converts_the_i2v_original_layout_to_the_diffusers_twin(
    original: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """--convert refused this folder before reading it (a layout operation, refused by model); a
    training run given it converts it once beside its cache, into the same diffusers twin."""
    dst = tmp_path / "Wan2.2-I2V-A14B-Diffusers"
    # --convert checks the result's layout like --verify.
    assert download_wan.main(["--convert", str(original), str(dst)]) == 0
    out = capsys.readouterr().out
    assert f"OK: {dst} is a complete Wan 2.2 diffusers teacher" in out
    assert "does not distil it yet" not in out
    index = json.loads((dst / "model_index.json").read_text())
    assert index["_class_name"] == "WanImageToVideoPipeline" and index["boundary_ratio"] == 0.9
    assert index["image_encoder"] == [None, None] and index["image_processor"] == [None, None]
    assert read_teacher_kind(dst).kind == I2V_A14B
    for component in EXPERTS:
        config = json.loads((dst / component / "config.json").read_text())
        assert (config["in_channels"], config["out_channels"], config["image_dim"]) == (36, 16, None)

    # A run reads either layout as the I2V teacher; the original is converted once, for the run.
    for teacher in (original, dst):
        info = inspect_teacher(str(teacher), convert_dir=tmp_path / "cache")
        assert info.kind == I2V_A14B and info.boundary_ratio == 0.9 and info.latent_channels == 16
    converted = inspect_teacher(str(original), convert_dir=tmp_path / "cache").path
    assert converted != original and read_teacher_kind(converted).kind == I2V_A14B
    for component in EXPERTS:
        got, want = _state(converted / component), _state(dst / component)
        assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want), component

    # The command users run writes the same folder.
    assert (
        download_wan.main(["--tiny", str(tmp_path / "cli"), "--tiny_kind", "i2v", "--layout", "original"])
        == 0
    )
    for component in ("high_noise_model", "low_noise_model"):
        assert _state(tmp_path / "cli" / component).keys() == _state(original / component).keys()
    assert read_teacher_kind(tmp_path / "cli").kind == I2V_A14B

    pipe = WanImageToVideoPipeline.from_pretrained(dst)
    assert pipe.image_encoder is None and pipe.transformer_2 is not None
    assert pipe.config.boundary_ratio == 0.9

    twin = write_tiny_teacher(tmp_path / "twin", seed=0, shape=original_layout_shape(I2V_A14B), kind=I2V_A14B)
    for component in (*EXPERTS, "vae", "text_encoder"):
        got, want = _state(dst / component), _state(twin / component)
        assert got.keys() == want.keys(), component
        for key, tensor in want.items():
            assert torch.equal(got[key], tensor), f"{component}: {key}"
