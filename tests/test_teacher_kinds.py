"""distill/models/teacher_kind.py: which Wan 2.2 model a teacher folder holds is read from its files;
the tiny I2V-A14B and TI2V-5B teachers run in their stock diffusers pipelines; a teacher of a kind
this version cannot distil, or whose files disagree, ends in the teacher-load banner in every command
that reads a teacher, before anything is written (every Wan 2.2 kind is distilled now: TI2V-5B stands in
for the next model, marked undistillable for those tests)."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import huggingface_hub
import numpy as np
import pytest
import torch
from conftest import train_args
from PIL import Image

import download_wan
from distill import doctor, generate
from distill.models.teacher_kind import I2V_A14B, T2V_A14B, TI2V_5B, read_teacher_kind
from train_distillation import main as train

KIND_TITLE = "this version distils Wan2.2-T2V-A14B (text to video) and Wan2.2-I2V-A14B (image to video) only"
FIX = "point --teacher_path at Wan-AI/Wan2.2-T2V-A14B-Diffusers"


@pytest.fixture(scope="module")
def i2v_teacher(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Wan2.2-I2V-A14B-layout teacher, written by the command users run."""
    folder = tmp_path_factory.mktemp("i2v") / "teacher"
    assert download_wan.main(["--tiny", str(folder), "--tiny_kind", "i2v"]) == 0
    return folder


@pytest.fixture
def undistillable_ti2v() -> Iterator[None]:
    """TI2V-5B marked as a kind this version cannot distil, as it was before it was supported: the
    refusal is what the next Wan model (S2V, Animate) will meet until it is."""
    object.__setattr__(TI2V_5B, "distillable", False)  # a frozen dataclass: the kinds are constants
    try:
        yield
    finally:
        object.__setattr__(TI2V_5B, "distillable", True)


def banner(capsys: pytest.CaptureFixture[str]) -> str:
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.count("ERROR (teacher load)") == 1, err
    return err


def files_of(folder: Path) -> set[str]:
    return {p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file()}


# ---------------------------------------------------------------------------------------------
# The tiny teachers are the stock pipelines' own layouts
# ---------------------------------------------------------------------------------------------


def test_the_tiny_i2v_teacher_samples_in_the_stock_image_to_video_pipeline(i2v_teacher: Path) -> None:
    from diffusers import WanImageToVideoPipeline

    index = json.loads((i2v_teacher / "model_index.json").read_text())
    assert index["_class_name"] == "WanImageToVideoPipeline" and index["boundary_ratio"] == 0.9
    assert index["image_encoder"] == [None, None] and index["image_processor"] == [None, None]
    for expert in ("transformer", "transformer_2"):
        config = json.loads((i2v_teacher / expert / "config.json").read_text())
        assert (config["in_channels"], config["out_channels"]) == (36, 16)
        assert config["image_dim"] is None and config["added_kv_proj_dim"] is None
    pipe = WanImageToVideoPipeline.from_pretrained(i2v_teacher)
    assert pipe.image_encoder is None and pipe.transformer_2 is not None
    image = Image.fromarray(np.full((16, 16, 3), 200, dtype=np.uint8))
    video = pipe(
        image=image,
        prompt="a red cube",
        height=16,
        width=16,
        num_frames=5,
        num_inference_steps=2,  # 2 steps at boundary 0.9: one on each expert
        guidance_scale=1.0,
        output_type="np",
        generator=torch.Generator().manual_seed(0),
    ).frames
    assert video.shape == (1, 5, 16, 16, 3) and np.isfinite(video).all()


def test_the_tiny_ti2v_teacher_samples_in_the_stock_pipeline(ti2v_teacher: Path) -> None:
    from diffusers import WanPipeline

    assert "transformer_2/config.json" not in files_of(ti2v_teacher)
    index = json.loads((ti2v_teacher / "model_index.json").read_text())
    assert index["_class_name"] == "WanPipeline" and index["expand_timesteps"] is True
    assert index.get("transformer_2") in (None, [None, None]) and index.get("boundary_ratio") is None
    config = json.loads((ti2v_teacher / "transformer" / "config.json").read_text())
    assert (config["in_channels"], config["out_channels"]) == (48, 48)
    vae = json.loads((ti2v_teacher / "vae" / "config.json").read_text())
    assert (vae["z_dim"], vae["is_residual"], vae["patch_size"], vae["scale_factor_spatial"]) == (
        48,
        True,
        2,
        16,
    )
    pipe = WanPipeline.from_pretrained(ti2v_teacher)
    assert pipe.transformer_2 is None and pipe.config.expand_timesteps
    video = pipe(
        prompt="a red cube",
        height=32,
        width=32,
        num_frames=5,
        num_inference_steps=1,
        guidance_scale=1.0,
        output_type="np",
        generator=torch.Generator().manual_seed(0),
    ).frames
    assert video.shape == (1, 5, 32, 32, 3) and np.isfinite(video).all()


def test_the_kind_is_read_from_each_layouts_files(
    tiny_teacher: Path, i2v_teacher: Path, ti2v_teacher: Path, tmp_path: Path
) -> None:
    assert read_teacher_kind(tiny_teacher).kind == T2V_A14B
    i2v = read_teacher_kind(i2v_teacher)
    assert i2v.kind == I2V_A14B and "model_index.json: _class_name = WanImageToVideoPipeline" in i2v.evidence
    assert "transformer/config.json: in_channels = 36, out_channels = 16" in i2v.evidence
    ti2v = read_teacher_kind(ti2v_teacher)
    assert ti2v.kind == TI2V_5B and "model_index.json: expand_timesteps = true" in ti2v.evidence
    assert (ti2v.kind.experts, ti2v.kind.per_token_timesteps, ti2v.kind.in_channels) == (1, True, 48)
    # The original layout: the expert's (or the 5B's one) WanModel config.json.
    i2v_original = original_layout(tmp_path / "i2v", "high_noise_model/config.json", "i2v", 36)
    assert read_teacher_kind(i2v_original).kind == I2V_A14B
    assert read_teacher_kind(original_layout(tmp_path / "5b", "config.json", "ti2v", 48)).kind == TI2V_5B


def original_layout(folder: Path, config: str, model_type: str, in_dim: int) -> Path:
    """The files of an original-layout download that say which model it is (the weights are not read
    before the kind is known, so they stay empty here)."""
    (folder / config).parent.mkdir(parents=True)
    (folder / config).write_text(
        json.dumps({"_class_name": "WanModel", "model_type": model_type, "in_dim": in_dim})
    )
    (folder / "models_t5_umt5-xxl-enc-bf16.pth").write_bytes(b"")
    return folder


# ---------------------------------------------------------------------------------------------
# A kind this version cannot distil: the banner, in every command, before anything is written
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "which, model, evidence",
    [("ti2v", "Wan2.2-TI2V-5B", "model_index.json: expand_timesteps = true")],
)
@pytest.mark.parametrize("dry_run", [False, True])
@pytest.mark.usefixtures("undistillable_ti2v")
def test_training_on_another_models_teacher_ends_in_the_kind_banner_writing_nothing(
    request, tmp_path, capsys, which, model, evidence, dry_run
) -> None:
    teacher = request.getfixturevalue(f"{which}_teacher")
    out, cache = tmp_path / "out", tmp_path / "cache"
    assert train(train_args(teacher, out, cache, dry_run=dry_run)) == 5
    err = banner(capsys)
    assert f"holds the {model} teacher" in err and KIND_TITLE in err and evidence in err and FIX in err
    assert "missing transformer_2" not in err and "boundary_ratio" not in err
    assert not out.exists() and not cache.exists()


@pytest.mark.usefixtures("undistillable_ti2v")
def test_generate_verify_and_doctor_refuse_it_too(i2v_teacher, ti2v_teacher, tmp_path, capsys) -> None:
    output = tmp_path / "g.png"
    argv = ["--teacher_only", "--teacher_path", str(ti2v_teacher), "--prompt", "x", "--output", str(output)]
    assert generate.main(argv) == 5
    assert "holds the Wan2.2-TI2V-5B teacher" in banner(capsys) and not output.exists()
    # --verify called the 5B folder incomplete ("missing transformer_2/"); the I2V one is a teacher now.
    assert download_wan.main(["--verify", str(ti2v_teacher)]) == 5
    err = banner(capsys)
    assert "holds the Wan2.2-TI2V-5B teacher" in err and FIX in err and "missing transformer_2" not in err
    assert download_wan.main(["--verify", str(i2v_teacher)]) == 0
    # The doctor reports its checks as lines: the teacher's names the kind and the fix.
    assert doctor.main(["--teacher_path", str(ti2v_teacher), "--backend", "gloo"]) == 1
    lines = capsys.readouterr().out.splitlines()
    line = next(x for x in lines if x.split()[1:2] == ["teacher"])
    assert line.startswith("FAIL") and "Wan2.2-TI2V-5B" in line and FIX in line


@pytest.mark.usefixtures("undistillable_ti2v")
def test_an_original_layout_of_another_model_is_refused_before_any_conversion(tmp_path, capsys) -> None:
    """The 5B's original folder was told it misses Wan2.1_VAE.pth and high_noise_model/ (the I2V one
    is a teacher: tests/test_i2v_original_layout.py)."""
    cache = tmp_path / "cache"
    for name, config, model_type, in_dim, model in (
        ("Wan2.2-TI2V-5B", "config.json", "ti2v", 48, "Wan2.2-TI2V-5B"),
    ):
        teacher = original_layout(tmp_path / name, config, model_type, in_dim)
        assert train(train_args(teacher, tmp_path / "out", cache)) == 5
        err = banner(capsys)
        assert f"holds the {model} teacher" in err and f"{config}: model_type = {model_type}" in err
        assert "Wan2.1_VAE.pth" not in err and "incomplete" not in err
    assert not cache.exists() and not (tmp_path / "out").exists()


@pytest.mark.usefixtures("undistillable_ti2v")
def test_a_hub_id_of_another_model_is_refused_from_its_configs_before_the_weights_are_fetched(
    ti2v_teacher, tmp_path, monkeypatch, capsys
) -> None:
    """Only the configs are in the hub cache and the hub cannot be reached: without the configs-first
    look the run went for the whole repository (~120 GB on the real one)."""
    commit = "0" * 40
    repo = tmp_path / "hub" / "models--Wan-AI--Wan2.2-TI2V-5B-Diffusers"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    shutil.copytree(ti2v_teacher, repo / "snapshots" / commit, ignore=shutil.ignore_patterns("*.safetensors"))
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    args = train_args(Path("Wan-AI/Wan2.2-TI2V-5B-Diffusers"), tmp_path / "out", tmp_path / "cache")
    assert train(args) == 5
    err = banner(capsys)
    assert "Wan-AI/Wan2.2-TI2V-5B-Diffusers holds the Wan2.2-TI2V-5B teacher" in err and FIX in err
    assert "could not fetch" not in err


# ---------------------------------------------------------------------------------------------
# Files that disagree on which model it is
# ---------------------------------------------------------------------------------------------


def edit_json(path: Path, **values: object) -> None:
    path.write_text(json.dumps({**json.loads(path.read_text()), **values}))


def test_files_that_disagree_are_refused_naming_both(tiny_teacher, i2v_teacher, tmp_path, capsys) -> None:
    # An image-to-video pipeline over text-to-video experts (16 input channels).
    teacher = shutil.copytree(tiny_teacher, tmp_path / "i2v-index")
    edit_json(teacher / "model_index.json", _class_name="WanImageToVideoPipeline")
    assert train(train_args(teacher, tmp_path / "out", tmp_path / "cache")) == 5
    err = banner(capsys)
    assert "the teacher's files disagree on which Wan 2.2 model it is" in err
    assert "model_index.json _class_name: WanImageToVideoPipeline: that is Wan2.2-I2V-A14B" in err
    assert "transformer/config.json in_channels/out_channels: 16/16: that is Wan2.2-T2V-A14B" in err
    assert f"download_wan.py --verify {teacher}" in err
    assert not (tmp_path / "out").exists() and not (tmp_path / "cache").exists()
    # A text-to-video index over image-to-video experts: --verify says the same.
    teacher = shutil.copytree(i2v_teacher, tmp_path / "t2v-index")
    edit_json(teacher / "model_index.json", _class_name="WanPipeline")
    assert download_wan.main(["--verify", str(teacher)]) == 5
    err = banner(capsys)
    assert "model_index.json _class_name: WanPipeline" in err and "36/16: that is Wan2.2-I2V-A14B" in err


def test_tiny_kind_is_a_tiny_option(capsys) -> None:
    with pytest.raises(SystemExit) as usage:
        download_wan.main(["--tiny_kind", "i2v"])
    assert usage.value.code == 2 and "--tiny_kind" in capsys.readouterr().err
