"""distill/models/tiny.py: the tiny random teacher has the real A14B diffusers layout, loads offline,
generates, and is reproducible from its seed."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from distill.models.layout import DIFFUSERS_COMPONENTS, missing_components
from distill.models.tiny import TinyTeacherShape, is_tiny_teacher, write_tiny_teacher
from distill.ops.errors import DistillError

# What WanPipeline.save_pretrained writes with diffusers 0.42 / transformers 5: other parts of
# the project (and --verify) rely on these exact names.
EXPECTED_FILES = {
    "model_index.json",
    "scheduler/scheduler_config.json",
    "text_encoder/config.json",
    "text_encoder/model.safetensors",
    "tokenizer/tokenizer.json",
    "tokenizer/tokenizer_config.json",
    "transformer/config.json",
    "transformer/diffusion_pytorch_model.safetensors",
    "transformer_2/config.json",
    "transformer_2/diffusion_pytorch_model.safetensors",
    "vae/config.json",
    "vae/diffusion_pytorch_model.safetensors",
}
WEIGHT_FILES = sorted(f for f in EXPECTED_FILES if f.endswith(".safetensors"))


def files_of(folder: Path) -> dict[str, bytes]:
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in folder.rglob("*") if p.is_file()}


def test_layout_is_the_a14b_diffusers_layout(tiny_teacher: Path) -> None:
    assert missing_components(tiny_teacher, DIFFUSERS_COMPONENTS) == []
    assert set(files_of(tiny_teacher)) == EXPECTED_FILES
    index = json.loads((tiny_teacher / "model_index.json").read_text())
    assert index["_class_name"] == "WanPipeline"
    assert index["boundary_ratio"] == 0.875
    assert index["transformer"] == ["diffusers", "WanTransformer3DModel"]
    assert index["transformer_2"] == ["diffusers", "WanTransformer3DModel"]
    assert index["text_encoder"] == ["transformers", "UMT5EncoderModel"]
    scheduler = json.loads((tiny_teacher / "scheduler/scheduler_config.json").read_text())
    assert scheduler["_class_name"] == "UniPCMultistepScheduler"
    assert (scheduler["prediction_type"], scheduler["use_flow_sigmas"], scheduler["flow_shift"]) == (
        "flow_prediction",
        True,
        3.0,
    )


def test_experts_have_the_shape_and_differ(tiny_teacher: Path) -> None:
    shape = TinyTeacherShape()
    for expert in ("transformer", "transformer_2"):
        config = json.loads((tiny_teacher / expert / "config.json").read_text())
        assert config["num_layers"] == shape.num_layers
        assert config["num_attention_heads"] * config["attention_head_dim"] == 24
        assert (config["text_dim"], config["ffn_dim"], config["freq_dim"]) == (32, 32, 256)
        assert (config["in_channels"], config["out_channels"], config["patch_size"]) == (16, 16, [1, 2, 2])
        assert config["qk_norm"] == "rms_norm_across_heads" and config["cross_attn_norm"] is True
    high = load_file(tiny_teacher / "transformer/diffusion_pytorch_model.safetensors")
    low = load_file(tiny_teacher / "transformer_2/diffusion_pytorch_model.safetensors")
    assert high.keys() == low.keys()
    assert not torch.equal(high["blocks.0.attn1.to_q.weight"], low["blocks.0.attn1.to_q.weight"])
    text = json.loads((tiny_teacher / "text_encoder/config.json").read_text())
    assert text["d_model"] == shape.text_dim


def test_same_seed_is_byte_identical_and_other_seed_differs(tiny_teacher: Path, tmp_path: Path) -> None:
    again = files_of(write_tiny_teacher(tmp_path / "again", seed=0))
    assert again == files_of(tiny_teacher)
    other = files_of(write_tiny_teacher(tmp_path / "other", seed=1))
    for name in WEIGHT_FILES:
        assert other[name] != again[name], name
    # The tokenizer does not depend on the seed: token ids stay comparable across teachers.
    assert other["tokenizer/tokenizer.json"] == again["tokenizer/tokenizer.json"]


def test_caller_rng_is_untouched(tmp_path: Path) -> None:
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    write_tiny_teacher(tmp_path / "t", seed=5)
    assert torch.equal(torch.rand(3), expected)


@pytest.mark.parametrize("class_name", ["AutoTokenizer", "T5TokenizerFast"])
def test_tokenizer_loads_offline_and_handles_any_text(tiny_teacher: Path, class_name: str) -> None:
    import transformers

    tokenizer = getattr(transformers, class_name).from_pretrained(tiny_teacher / "tokenizer")
    assert (tokenizer.pad_token_id, tokenizer.eos_token_id, tokenizer.unk_token_id) == (0, 1, 2)
    assert tokenizer.model_max_length == 512
    vocab_size = json.loads((tiny_teacher / "text_encoder/config.json").read_text())["vocab_size"]
    assert len(tokenizer) == vocab_size

    known = tokenizer("a red cube spinning slowly")["input_ids"]
    assert known[-1] == 1 and 2 not in known
    assert tokenizer.decode(known, skip_special_tokens=True) == "a red cube spinning slowly"

    # Unseen words fall back to pieces; unseen scripts to <unk>; nothing raises.
    odd = tokenizer("Xylophone QUARTZ zebra 42% naïve 日本 🚀")["input_ids"]
    assert odd[-1] == 1 and 2 in odd and all(0 <= i < vocab_size for i in odd)
    batch = tokenizer(
        ["a cat", ""], padding="max_length", max_length=16, truncation=True, return_tensors="pt"
    )
    assert batch["input_ids"].shape == (2, 16) and batch["input_ids"][1, 1:].eq(0).all()


def test_pipeline_loads_routes_both_experts_and_generates(tiny_teacher: Path) -> None:
    from diffusers import WanPipeline

    pipe = WanPipeline.from_pretrained(tiny_teacher)
    pipe.set_progress_bar_config(disable=True)
    calls = {"transformer": 0, "transformer_2": 0}
    for name in calls:
        getattr(pipe, name).register_forward_pre_hook(lambda *_, n=name: calls.__setitem__(n, calls[n] + 1))

    image = pipe(
        prompt="a red cube", height=16, width=16, num_frames=1, num_inference_steps=2, output_type="np"
    )
    assert image.frames.shape == (1, 1, 16, 16, 3)
    assert np.isfinite(image.frames).all() and image.frames.min() >= 0 and image.frames.max() <= 1
    # Timesteps 999 and 750 straddle 0.875 * 1000: one step on each expert (x2 for CFG).
    assert calls == {"transformer": 2, "transformer_2": 2}

    video = pipe(
        prompt="a red cube", height=16, width=16, num_frames=5, num_inference_steps=2, output_type="np"
    )
    assert video.frames.shape == (1, 5, 16, 16, 3)
    assert np.isfinite(video.frames).all()


def test_refuses_a_foreign_folder_unless_overwrite(tmp_path: Path) -> None:
    target = tmp_path / "models"
    target.mkdir()
    (target / "precious.txt").write_text("keep me")
    with pytest.raises(DistillError, match="already holds files of its own: refusing to replace") as caught:
        write_tiny_teacher(target)
    assert "precious.txt" in caught.value.details and "--overwrite" in " ".join(caught.value.fixes)
    assert (target / "precious.txt").read_text() == "keep me"

    write_tiny_teacher(target, overwrite=True)
    assert is_tiny_teacher(target) and not (target / "precious.txt").exists()


def test_replaces_a_tiny_teacher_of_another_seed_only_with_overwrite(
    tiny_teacher: Path, tmp_path: Path
) -> None:
    """The same seed writes the same files (kept as they are); another seed's weights replace them only
    with overwrite (distill/ops/replace.py: a folder is never replaced without the flag)."""
    target = tmp_path / "teacher"
    shutil.copytree(tiny_teacher, target)
    write_tiny_teacher(target, seed=0)
    with pytest.raises(DistillError, match="already holds a Wan2.2-T2V-A14B teacher"):
        write_tiny_teacher(target, seed=7)
    write_tiny_teacher(target, seed=7, overwrite=True)
    weights = "transformer/diffusion_pytorch_model.safetensors"
    assert (target / weights).read_bytes() != (tiny_teacher / weights).read_bytes()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["teacher"]  # no staging leftovers


def test_a_crash_leaves_the_old_folder_and_no_partial_one(
    tiny_teacher: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import distill.models.tiny

    def crash(folder: Path, shape: TinyTeacherShape, *kind: object) -> None:
        assert (folder / "transformer_2").is_dir()  # the crash comes after the files were written
        raise RuntimeError("disk full")

    monkeypatch.setattr(distill.models.tiny, "_check_saved_index", crash)
    with pytest.raises(RuntimeError, match="disk full"):
        write_tiny_teacher(tmp_path / "fresh")
    assert list(tmp_path.iterdir()) == []

    target = tmp_path / "teacher"
    shutil.copytree(tiny_teacher, target)
    with pytest.raises(RuntimeError, match="disk full"):
        write_tiny_teacher(target, seed=3)
    assert files_of(target) == files_of(tiny_teacher)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["teacher"]
