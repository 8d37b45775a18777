"""The TI2V-5B teacher in the ORIGINAL Wan layout (Wan-AI/Wan2.2-TI2V-5B: its one WanModel at the top
of the folder, config.json model_type ti2v + three shards + index, Wan2.2_VAE.pth, the T5 .pth and
google/umt5-xxl/): the tiny one is read as TI2V-5B, converts to exactly the diffusers-layout tiny
TI2V teacher of the same seed and shape (WanPipeline with expand_timesteps, one transformer, the
Wan2.2 VAE), samples the same latents in stock WanPipeline, and a damaged one is told what it misses.

    .venv/bin/python -m pytest -q tests/test_ti2v_original_layout.py
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from diffusers import AutoencoderKLWan, WanPipeline
from safetensors.torch import load_file

import download_wan
from distill.models.original.configs import WAN22_LATENTS_MEAN, WAN22_LATENTS_STD
from distill.models.original.convert import convert_original, ensure_converted
from distill.models.original.detect import (
    MARKER,
    ONE_MODEL,
    looks_original,
    original_layout,
    original_problems,
)
from distill.models.teacher import inspect_teacher
from distill.models.teacher_kind import TI2V_5B, read_teacher_kind
from distill.models.tiny import (
    is_tiny_teacher,
    original_layout_shape,
    write_tiny_original_teacher,
    write_tiny_teacher,
)
from distill.ops.errors import DistillError, Stage

pytestmark = pytest.mark.usefixtures("one_thread")

SHARDS = [f"diffusion_pytorch_model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
PROMPT = "a red cube spinning slowly on a wooden table"


@pytest.fixture(scope="module")
def original(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny TI2V teacher (seed 0) in the original layout. Copy it before changing anything in it."""
    return write_tiny_original_teacher(
        tmp_path_factory.mktemp("original") / "Wan2.2-TI2V-5B", seed=0, kind=TI2V_5B
    )


@pytest.fixture(scope="module")
def twin(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The same weights (seed, shape, kind) in the diffusers layout."""
    shape = original_layout_shape(TI2V_5B)
    return write_tiny_teacher(tmp_path_factory.mktemp("twin") / "teacher", seed=0, shape=shape, kind=TI2V_5B)


@pytest.fixture(scope="module")
def converted(original: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return ensure_converted(original, tmp_path_factory.mktemp("converted"))


def _state(folder: Path) -> dict[str, torch.Tensor]:
    return {k: v for f in sorted(folder.glob("*.safetensors")) for k, v in load_file(f).items()}


def _json(path: Path) -> dict:
    return json.loads(path.read_text())


def test_the_tiny_ti2v_original_teacher_has_the_release_layout_and_key_names(original: Path) -> None:
    assert looks_original(original) and original_layout(original) is ONE_MODEL
    assert original_problems(original) == []
    reading = read_teacher_kind(original)
    assert reading.kind == TI2V_5B and "config.json: model_type = ti2v" in reading.evidence
    config = _json(original / "config.json")
    assert (config["_class_name"], config["model_type"], config["in_dim"], config["out_dim"]) == (
        "WanModel",
        "ti2v",
        48,
        48,
    )
    index = _json(original / "diffusion_pytorch_model.safetensors.index.json")
    assert sorted(set(index["weight_map"].values())) == SHARDS
    assert {"head.modulation", "blocks.1.norm3.weight", "patch_embedding.weight"} <= set(index["weight_map"])
    for absent in ("Wan2.1_VAE.pth", "high_noise_model", "low_noise_model", "model_index.json"):
        assert not (original / absent).exists()
    assert (original / "google/umt5-xxl/tokenizer.json").is_file()
    # Wan's own module names (wan/modules/vae2_2.py): a stage's resample follows its residual
    # blocks (2 in an encoder stage, 3 in a decoder stage), time_conv where the stage halves time.
    vae = torch.load(original / "Wan2.2_VAE.pth", weights_only=True)
    expected = {
        "conv1.weight": (96, 96, 1, 1, 1),
        "conv2.weight": (48, 48, 1, 1, 1),
        "encoder.conv1.weight": (8, 12, 3, 3, 3),  # 2 x 2 pixel patches of 3 colours
        "encoder.downsamples.0.downsamples.2.resample.1.weight": (8, 8, 3, 3),
        "encoder.downsamples.1.downsamples.0.shortcut.weight": (16, 8, 1, 1, 1),
        "encoder.downsamples.1.downsamples.2.time_conv.weight": (16, 16, 3, 1, 1),
        "encoder.middle.1.to_qkv.weight": (96, 32, 1, 1),
        "decoder.upsamples.0.upsamples.3.time_conv.weight": (64, 32, 3, 1, 1),
        "decoder.upsamples.2.upsamples.3.resample.1.weight": (16, 16, 3, 3),
        "decoder.upsamples.3.upsamples.2.residual.6.bias": (8,),
        "decoder.head.2.weight": (12, 8, 3, 3, 3),
    }
    assert {k: tuple(vae[k].shape) for k in expected} == expected
    assert "encoder.downsamples.0.downsamples.2.time_conv.weight" not in vae  # stage 0 keeps time
    assert not any("down_blocks" in k or "resnets" in k for k in vae)


def test_conversion_equals_the_diffusers_twin_weight_for_weight(converted: Path, twin: Path) -> None:
    assert (converted / MARKER).is_file() and read_teacher_kind(converted).kind == TI2V_5B
    assert not (converted / "transformer_2").exists()
    index = _json(converted / "model_index.json")
    assert index["_class_name"] == "WanPipeline" and index["expand_timesteps"] is True
    assert index["boundary_ratio"] is None and index["transformer_2"] == [None, None]
    assert {k: v for k, v in index.items() if k != "_diffusers_version"} == {
        k: v for k, v in _json(twin / "model_index.json").items() if k != "_diffusers_version"
    }
    for component in ("transformer", "vae", "text_encoder"):
        got, want = _state(converted / component), _state(twin / component)
        assert got.keys() == want.keys(), component
        for key, tensor in want.items():
            assert torch.equal(got[key], tensor), f"{component}: {key}"
    for config in ("vae/config.json", "text_encoder/config.json", "scheduler/scheduler_config.json"):
        assert _json(converted / config) == _json(twin / config), config
    # WanModel's rope table is 1024 long; the values at the positions used are the same.
    assert {**_json(converted / "transformer/config.json"), "rope_max_seq_len": 32} == _json(
        twin / "transformer/config.json"
    )


def test_stock_wanpipeline_samples_the_same_latents_from_the_conversion_and_the_twin(
    converted: Path, twin: Path
) -> None:
    outputs = {}
    for name, folder in (("converted", converted), ("twin", twin)):
        pipe = WanPipeline.from_pretrained(folder)
        assert pipe.config.expand_timesteps is True and pipe.transformer_2 is None
        assert pipe.vae.config.z_dim == 48 and pipe.vae.config.scale_factor_spatial == 16
        outputs[name] = [
            pipe(
                PROMPT,
                height=64,
                width=64,
                num_frames=5,
                num_inference_steps=3,
                guidance_scale=5.0,  # classifier-free guidance: the text encoder's empty prompt too
                max_sequence_length=32,
                output_type=output_type,
                generator=torch.Generator().manual_seed(0),
            ).frames
            for output_type in ("latent", "pt")
        ]
    latents, video = outputs["converted"]
    assert latents.shape == (1, 48, 2, 4, 4) and video.shape == (1, 5, 3, 64, 64)
    assert latents.abs().mean() > 0.1  # a real sample, not zeros
    for got, want in zip(outputs["converted"], outputs["twin"]):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_a_run_reads_the_original_ti2v_teacher_through_its_conversion(
    original: Path, converted: Path
) -> None:
    """The trainer's entry: inspect_teacher converts the original once (the same cache) and reads the
    result as TI2V-5B, one transformer, no expert switch."""
    info = inspect_teacher(str(original), convert_dir=converted.parent)
    assert info.path == converted and info.kind == TI2V_5B
    assert info.boundary_ratio is None and info.flow_shift == 3.0  # the twin's, kept by configuration.json
    assert (info.expert_config["in_channels"], info.expert_config["out_channels"]) == (48, 48)
    assert (info.vae_scale_spatial, info.vae_scale_temporal) == (16, 4)


def test_a_release_without_our_notes_gets_the_published_shift_and_vae_statistics(
    original: Path, twin: Path, tmp_path: Path
) -> None:
    """The real release's configuration.json names no shift or statistics (Wan's code hard-codes
    them): the conversion writes those of Wan-AI/Wan2.2-TI2V-5B-Diffusers, and reads every other VAE
    setting from the weights."""
    release = shutil.copytree(original, tmp_path / "Wan2.2-TI2V-5B")
    (release / "configuration.json").write_text(json.dumps({"framework": "Pytorch", "task": "ti2v"}))
    dst = convert_original(release, tmp_path / "converted")
    assert _json(dst / "scheduler/scheduler_config.json")["flow_shift"] == 5.0
    vae = _json(dst / "vae/config.json")
    assert vae["latents_mean"] == list(WAN22_LATENTS_MEAN) and vae["latents_std"] == list(WAN22_LATENTS_STD)
    assert len(vae["latents_mean"]) == len(vae["latents_std"]) == 48
    twin_vae = _json(twin / "vae/config.json")
    assert {k: v for k, v in vae.items() if not k.startswith("latents_")} == {
        k: v for k, v in twin_vae.items() if not k.startswith("latents_")
    }
    assert (vae["dim_mult"], vae["num_res_blocks"], vae["temperal_downsample"]) == (
        [1, 2, 4, 4],
        2,
        [False, True, True],
    )


def test_converted_vae_equals_wans_own_vae2_2(original: Path, converted: Path) -> None:
    """Against Wan's own Wan2.2 VAE code, where it is importable (the Wan2.2 repository on the path)."""
    vae2_2 = pytest.importorskip(
        "wan.modules.vae2_2", reason="Wan's own code (github.com/Wan-Video/Wan2.2) is not installed"
    )
    ours = AutoencoderKLWan.from_pretrained(converted / "vae").eval()
    config = ours.config
    wan = vae2_2.WanVAE_(
        dim=config.base_dim,
        dec_dim=config.decoder_base_dim,
        z_dim=config.z_dim,
        dim_mult=list(config.dim_mult),
        num_res_blocks=config.num_res_blocks,
        temperal_downsample=list(config.temperal_downsample),
    ).eval()
    wan.load_state_dict(torch.load(original / "Wan2.2_VAE.pth", weights_only=True), strict=True)
    gen = torch.Generator().manual_seed(0)
    video = torch.rand(1, 3, 5, 32, 32, generator=gen) * 2 - 1
    z = torch.randn(1, 48, 2, 2, 2, generator=gen)
    with torch.no_grad():
        torch.testing.assert_close(
            wan.encode(video, [0, 1]), ours.encode(video).latent_dist.mean, rtol=1e-5, atol=1e-6
        )
        # Wan2_2_VAE.decode clamps to [-1, 1]; diffusers' decode does too.
        torch.testing.assert_close(
            wan.decode(z, [0, 1]).clamp(-1, 1), ours.decode(z).sample, rtol=1e-5, atol=1e-6
        )


def test_a_damaged_ti2v_original_folder_names_what_is_missing(original: Path, tmp_path: Path) -> None:
    broken = shutil.copytree(original, tmp_path / "Wan2.2-TI2V-5B")
    (broken / "Wan2.2_VAE.pth").unlink()
    (broken / SHARDS[1]).unlink()
    t5 = broken / "models_t5_umt5-xxl-enc-bf16.pth"
    t5.write_bytes(t5.read_bytes()[: t5.stat().st_size // 2])
    assert looks_original(broken) and original_layout(broken) is ONE_MODEL  # still the 5B's release
    with pytest.raises(DistillError) as caught:
        inspect_teacher(str(broken), convert_dir=tmp_path / "converted")
    error = caught.value
    assert error.stage == Stage.TEACHER_LOAD and "ORIGINAL Wan layout" in error.title
    assert "- missing Wan2.2_VAE.pth" in error.details
    assert f"- {SHARDS[1]} is missing (listed in its index)" in error.details
    assert "models_t5_umt5-xxl-enc-bf16.pth is not a complete torch checkpoint" in error.details
    assert "Expected (Wan-AI/Wan2.2-TI2V-5B)" in error.details and "Wan2.1_VAE.pth" not in error.details
    assert "high_noise_model" not in str(error)
    assert any("hf download Wan-AI/Wan2.2-TI2V-5B --local-dir" in fix for fix in error.fixes)
    assert not (tmp_path / "converted").exists()

    # Without its config.json the folder is still the 5B's release, told so by name.
    (broken / "config.json").unlink()
    with pytest.raises(DistillError) as caught:
        convert_original(broken, tmp_path / "dst")
    assert (
        "- missing config.json" in caught.value.details and "- missing Wan2.2_VAE.pth" in caught.value.details
    )
    assert not (tmp_path / "dst").exists()


def test_a_config_of_another_release_or_model_is_refused_naming_it(original: Path, tmp_path: Path) -> None:
    mixed = shutil.copytree(original, tmp_path / "mixed")
    (mixed / "high_noise_model").mkdir()
    shutil.copy(original / "config.json", mixed / "high_noise_model" / "config.json")
    with pytest.raises(DistillError) as caught:
        convert_original(mixed, tmp_path / "dst")
    error = caught.value
    assert "mixes two original Wan releases" in error.title and "Wan2.2-TI2V-5B" in error.title
    assert "high_noise_model/config.json: model_type = ti2v" in error.details
    # A model type no Wan 2.2 kind has (S2V keeps its WanModel at the top too) is named as such, not
    # told it misses TI2V-5B's files.
    other = shutil.copytree(original, tmp_path / "Wan2.2-S2V-14B")
    (other / "config.json").write_text(json.dumps({**_json(original / "config.json"), "model_type": "s2v"}))
    (other / "Wan2.2_VAE.pth").unlink()
    with pytest.raises(DistillError) as caught:
        convert_original(other, tmp_path / "dst")
    assert (
        "holds a Wan 's2v' model" in caught.value.title
        and "config.json: model_type = s2v" in caught.value.details
    )
    assert "ti2v (Wan2.2-TI2V-5B)" in caught.value.details and "Wan2.2_VAE.pth" not in str(caught.value)
    assert not (tmp_path / "dst").exists()


def test_cli_writes_the_tiny_ti2v_original_teacher(
    original: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["--tiny", str(tmp_path / "t"), "--tiny_kind", "ti2v", "--layout", "original"]
    assert download_wan.main(argv) == 0
    out = capsys.readouterr().out
    assert "TI2V 5B teacher (seed 0, original layout)" in out and "Wan2.2_VAE.pth" in out
    written = tmp_path / "t"
    assert is_tiny_teacher(written) and read_teacher_kind(written).kind == TI2V_5B
    for name in (*SHARDS, "diffusion_pytorch_model.safetensors.index.json", "config.json", "Wan2.2_VAE.pth"):
        assert (written / name).read_bytes() == (original / name).read_bytes(), name
    assert download_wan.main(argv) == 0  # a tiny teacher is replaced without --overwrite
