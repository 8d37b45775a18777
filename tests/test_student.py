"""Tests for distill/models/student.py with tiny real WanTransformer3DModel teachers (no mocks)."""

from __future__ import annotations

import json
import logging
import resource
from pathlib import Path

import pytest
import torch
from diffusers import WanTransformer3DModel

from distill.models.student import (
    build_student,
    count_parameters,
    export_student,
    init_student_from_teacher,
    load_pretrained_student,
    teacher_block_indices,
)
from distill.models.student_config import load_student_config
from distill.ops.errors import DistillError, Stage

REPO = Path(__file__).resolve().parent.parent

# The shape of the project's tiny test teacher (see FACTS.md).
TINY = dict(
    patch_size=(1, 2, 2),
    num_attention_heads=2,
    attention_head_dim=12,
    in_channels=16,
    out_channels=16,
    text_dim=32,
    freq_dim=256,
    ffn_dim=32,
    num_layers=2,
    cross_attn_norm=True,
    qk_norm="rms_norm_across_heads",
    eps=1e-6,
    rope_max_seq_len=32,
)

# The real Wan2.2 A14B expert's shape (never built: only its config is used).
A14B = dict(TINY, num_attention_heads=40, attention_head_dim=128, text_dim=4096, ffn_dim=13824, num_layers=40)
A14B["rope_max_seq_len"] = 1024


def make_teacher(seed: int = 0, **overrides) -> WanTransformer3DModel:
    torch.manual_seed(seed)
    return WanTransformer3DModel(**{**TINY, **overrides}).eval()


def forward(model: WanTransformer3DModel) -> torch.Tensor:
    generator = torch.Generator().manual_seed(123)
    latent = torch.randn(1, 16, 1, 8, 8, generator=generator)
    text = torch.randn(1, 7, 32, generator=generator)
    with torch.no_grad():
        return model(latent, torch.tensor([700.0]), text, return_dict=False)[0]


def write_json(tmp_path: Path, data, name: str = "student.json") -> Path:
    path = tmp_path / name
    path.write_text(json.dumps(data) if not isinstance(data, str) else data)
    return path


# ----------------------------------------------------------------------------------------------
# load_student_config
# ----------------------------------------------------------------------------------------------


def test_tiny_config_loads_as_written_and_builds():
    written = json.loads((REPO / "config" / "student_tiny.json").read_text())
    config = load_student_config(REPO / "config" / "student_tiny.json", make_teacher().config)
    expected = {k: v for k, v in written.items() if not k.startswith("_")}
    expected["patch_size"] = tuple(expected["patch_size"])
    assert config == expected
    student = build_student(config, seed=0)
    assert student.config.num_layers == 2
    assert forward(student).shape == (1, 16, 1, 8, 8)


def test_a_diffusers_transformer_config_json_is_a_valid_student_config(tmp_path):
    teacher = make_teacher(num_layers=3)
    teacher.save_config(tmp_path / "transformer")
    raw = json.loads((tmp_path / "transformer" / "config.json").read_text())
    assert "_class_name" in raw and "_diffusers_version" in raw  # the "_" keys really are there
    config = load_student_config(tmp_path / "transformer" / "config.json", teacher.config)
    assert config["num_layers"] == 3
    assert config == {
        k: (tuple(v) if k == "patch_size" else v) for k, v in raw.items() if not k.startswith("_")
    }


def test_missing_keys_come_from_the_teacher_not_diffusers_defaults(tmp_path):
    path = write_json(
        tmp_path, {"num_layers": 1, "num_attention_heads": 1, "attention_head_dim": 12, "ffn_dim": 16}
    )
    config = load_student_config(path, make_teacher().config)
    # diffusers' defaults would be text_dim 4096 and rope_max_seq_len 1024 (the 14B model)
    assert config["text_dim"] == 32
    assert config["rope_max_seq_len"] == 32
    assert config["in_channels"] == config["out_channels"] == 16
    assert config["image_dim"] is None


def test_origin_project_keys_translate(tmp_path, caplog):
    origin = {
        "model_type": "WanLiteStudent",
        "hidden_size": 24,
        "depth": 3,
        "num_heads": 2,
        "num_channels": 16,
        "image_size": 64,
        "patch_size": 2,
        "text_max_length": 77,
        "text_encoder_output_dim": 32,
        "projection_factor": 1.0,
    }
    with caplog.at_level(logging.WARNING, logger="distill.models.student_config"):
        config = load_student_config(write_json(tmp_path, origin), make_teacher().config)
    assert config["num_attention_heads"] == 2
    assert config["attention_head_dim"] == 12
    assert config["num_layers"] == 3
    assert config["in_channels"] == config["out_channels"] == 16
    assert config["patch_size"] == (1, 2, 2)
    assert config["text_dim"] == 32
    assert config["ffn_dim"] == 4 * 24  # documented default MLP ratio for origin configs
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "image_size" in warnings[0].getMessage()
    assert forward(build_student(config, seed=0)).shape == (1, 16, 1, 8, 8)

    with_ratio = load_student_config(
        write_json(tmp_path, {**origin, "mlp_ratio": 2.5}), make_teacher().config
    )
    assert with_ratio["ffn_dim"] == 60


def test_origin_default_four_channels_is_rejected_with_the_key_and_16(tmp_path):
    origin = {"hidden_size": 24, "depth": 2, "num_heads": 2, "num_channels": 4, "text_encoder_output_dim": 32}
    path = write_json(tmp_path, origin)
    with pytest.raises(DistillError) as info:
        load_student_config(path, make_teacher().config)
    error = info.value
    assert error.stage == Stage.CONFIG
    assert "num_channels" in error.details and "16" in error.details and str(path) in error.details
    assert any('"num_channels": 16' in fix for fix in error.fixes)


def test_conflicting_origin_and_diffusers_keys_are_rejected(tmp_path):
    path = write_json(tmp_path, {"depth": 2, "num_layers": 3})
    with pytest.raises(DistillError, match="depth"):
        load_student_config(path, make_teacher().config)


def test_unknown_key_suggests_the_closest(tmp_path):
    path = write_json(tmp_path, {"num_layer": 2})
    with pytest.raises(DistillError) as info:
        load_student_config(path, make_teacher().config)
    assert "did you mean `num_layers`" in info.value.details
    assert str(path) in info.value.details


def test_invalid_json_names_the_file_line_and_column(tmp_path):
    path = write_json(tmp_path, '{\n  "num_layers": 2,\n}\n')
    with pytest.raises(DistillError) as info:
        load_student_config(path, make_teacher().config)
    assert str(path) in info.value.details
    assert "line 3, column 1" in info.value.details


def test_missing_file_is_a_config_error(tmp_path):
    with pytest.raises(DistillError, match="not found") as info:
        load_student_config(tmp_path / "nope.json", make_teacher().config)
    assert info.value.stage == Stage.CONFIG


def test_text_dim_must_match_the_teacher(tmp_path):
    path = write_json(tmp_path, {"text_dim": 64})
    with pytest.raises(DistillError) as info:
        load_student_config(path, make_teacher().config)
    assert "`text_dim` = 64" in info.value.details and "text_dim = 32" in info.value.details


def test_patch_size_must_match_the_teacher(tmp_path):
    path = write_json(tmp_path, {"patch_size": [1, 4, 4]})
    with pytest.raises(DistillError, match="patch_size"):
        load_student_config(path, make_teacher().config)


def test_hidden_size_must_divide_into_heads(tmp_path):
    path = write_json(tmp_path, {"hidden_size": 25, "num_heads": 2, "num_channels": 16})
    with pytest.raises(DistillError, match="not divisible"):
        load_student_config(path, make_teacher().config)


@pytest.mark.parametrize(
    ("key", "value"),
    [("num_layers", 0), ("ffn_dim", 16.0), ("num_attention_heads", True), ("attention_head_dim", 11)],
)
def test_invalid_values_name_the_key(tmp_path, key, value):
    path = write_json(tmp_path, {key: value})
    with pytest.raises(DistillError) as info:
        load_student_config(path, make_teacher().config)
    assert f"`{key}`" in info.value.details and str(path) in info.value.details


# ----------------------------------------------------------------------------------------------
# build / count
# ----------------------------------------------------------------------------------------------


def test_build_student_seed_is_reproducible_and_leaves_global_rng_alone():
    torch.manual_seed(5)
    state = torch.get_rng_state()
    a = build_student(TINY, seed=1)
    assert torch.equal(torch.get_rng_state(), state)
    b = build_student(TINY, seed=1)
    c = build_student(TINY, seed=2)
    assert torch.equal(a.proj_out.weight, b.proj_out.weight)
    assert not torch.equal(a.proj_out.weight, c.proj_out.weight)


def test_count_parameters_of_the_1p3b_config_allocates_nothing():
    config = load_student_config(REPO / "config" / "student_config.json", A14B)
    peak_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    count = count_parameters(config)
    peak_after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    assert 1.2e9 < count < 1.5e9
    assert peak_after - peak_before < 512 * 1024  # 1.4e9 float32 weights would be 5.7 GB
    small = make_teacher()
    assert count_parameters(small) == sum(p.numel() for p in small.parameters()) == count_parameters(TINY)


# ----------------------------------------------------------------------------------------------
# init_student_from_teacher
# ----------------------------------------------------------------------------------------------


def test_block_indices_are_evenly_spaced():
    assert teacher_block_indices(40, 40) == list(range(40))
    indices = teacher_block_indices(40, 30)
    assert indices[0] == 0 and indices[-1] == 39 and len(set(indices)) == 30
    assert teacher_block_indices(3, 2) == [0, 2]
    assert teacher_block_indices(4, 3) == [0, 2, 3]  # 1.5 rounds up
    assert teacher_block_indices(6, 3) == [0, 3, 5]  # 2.5 rounds up too (not to even, as round() would)
    assert teacher_block_indices(5, 1) == [2]
    assert teacher_block_indices(2, 4) == [0, 0, 1, 1]


def test_identical_shapes_reproduce_the_teacher_exactly():
    teacher = make_teacher(seed=0)
    student = build_student(teacher.config, seed=1)
    assert not torch.equal(forward(student), forward(teacher))
    report = init_student_from_teacher(student, teacher)
    assert torch.equal(forward(student), forward(teacher))
    assert report["teacher_blocks"] == [0, 1]
    assert report["copied"] == len(student.state_dict())
    assert report["sliced"] == report["partial"] == 0
    assert report["unmapped"] == [] and report["teacher_unused"] == []


def test_narrower_student_gets_the_leading_sub_blocks_and_runs():
    teacher = make_teacher(num_layers=3)
    student = build_student(dict(TINY, num_layers=1, num_attention_heads=1, ffn_dim=16), seed=1)
    report = init_student_from_teacher(student, teacher)
    assert report["teacher_blocks"] == [1]
    assert report["sliced"] > 0 and report["unmapped"] == []

    s, t = student.blocks[0], teacher.blocks[1]
    assert torch.equal(s.ffn.net[0].proj.weight, t.ffn.net[0].proj.weight[:16, :12])
    assert torch.equal(s.attn1.to_q.weight, t.attn1.to_q.weight[:12, :12])  # the first head
    assert torch.equal(s.scale_shift_table, t.scale_shift_table[..., :12])
    assert torch.equal(student.patch_embedding.weight, teacher.patch_embedding.weight[:12])
    # time_proj is 6 modulation vectors of the model width: each one is sliced, not the first rows
    s_proj = student.condition_embedder.time_proj.weight.view(6, 12, 12)
    t_proj = teacher.condition_embedder.time_proj.weight.view(6, 24, 24)
    assert torch.equal(s_proj, t_proj[:, :12, :12])

    out = forward(student)
    assert out.shape == (1, 16, 1, 8, 8) and torch.isfinite(out).all()


def test_ffn_slicing_is_exact_when_the_dropped_units_are_dead():
    # If the teacher's FFN units 16.. contribute nothing, keeping the first 16 units must give
    # the same function: this pins "the first FFN units" down end to end through the forward pass.
    teacher = make_teacher(seed=3)
    with torch.no_grad():
        for block in teacher.blocks:
            block.ffn.net[2].weight[:, 16:] = 0
    student = build_student(dict(TINY, ffn_dim=16), seed=4)
    init_student_from_teacher(student, teacher)
    torch.testing.assert_close(forward(student), forward(teacher), rtol=1e-5, atol=1e-6)


def test_dropping_an_identity_block_gives_the_teacher_function():
    # Teacher block 1 of 3 is made an identity; a 2-block student keeps blocks 0 and 2 and so must
    # compute exactly what the teacher computes.
    teacher = make_teacher(seed=5, num_layers=3)
    with torch.no_grad():
        middle = teacher.blocks[1]
        for linear in (middle.attn1.to_out[0], middle.attn2.to_out[0], middle.ffn.net[2]):
            linear.weight.zero_()
            linear.bias.zero_()
    student = build_student(dict(TINY, num_layers=2), seed=6)
    report = init_student_from_teacher(student, teacher)
    assert report["teacher_blocks"] == [0, 2]
    assert torch.equal(forward(student), forward(teacher))


@pytest.mark.parametrize(
    "shape",
    [
        dict(num_attention_heads=3, ffn_dim=48, num_layers=4),  # wider and deeper: blocks repeat
        dict(num_attention_heads=1, ffn_dim=64, num_layers=1),  # narrower residual, wider FFN
        dict(freq_dim=128, cross_attn_norm=False),  # other sinusoid width, no cross-attn norm
    ],
)
def test_any_valid_shape_pair_initialises_and_runs(shape):
    teacher = make_teacher(num_layers=2)
    student = build_student(dict(TINY, **shape), seed=1)
    report = init_student_from_teacher(student, teacher)
    counted = report["copied"] + report["sliced"] + report["partial"] + len(report["unmapped"])
    assert counted == len(student.state_dict())
    assert len(report["teacher_blocks"]) == student.config.num_layers
    out = forward(student)
    assert out.shape == (1, 16, 1, 8, 8) and torch.isfinite(out).all()
    if shape.get("freq_dim"):
        assert report["unmapped"] == ["condition_embedder.time_embedder.linear_1.weight"]
        assert any(key.endswith("norm2.weight") for key in report["teacher_unused"])
    else:
        assert report["partial"] > 0


def test_head_dim_mismatch_is_refused():
    teacher = make_teacher()
    student = build_student(dict(TINY, num_attention_heads=3, attention_head_dim=8), seed=0)
    with pytest.raises(DistillError, match="attention_head_dim") as info:
        init_student_from_teacher(student, teacher)
    assert info.value.stage == Stage.CONFIG


def test_tensors_without_a_teacher_counterpart_are_reported():
    teacher = make_teacher(cross_attn_norm=False)
    student = build_student(TINY, seed=0)
    report = init_student_from_teacher(student, teacher)
    assert sorted(report["unmapped"]) == sorted(
        f"blocks.{i}.norm2.{p}" for i in range(2) for p in ("weight", "bias")
    )


# ----------------------------------------------------------------------------------------------
# export / pretrained
# ----------------------------------------------------------------------------------------------


def assert_same_weights(a: WanTransformer3DModel, b: WanTransformer3DModel) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for key in sa:
        assert sa[key].dtype == sb[key].dtype and torch.equal(sa[key], sb[key]), key


def test_export_reloads_bit_identically_and_replaces_atomically(tmp_path):
    student = build_student(TINY, seed=0)
    out = export_student(student, tmp_path / "student")
    assert out == tmp_path / "student"
    assert (out / "config.json").is_file() and list(out.glob("*.safetensors"))
    assert_same_weights(student, WanTransformer3DModel.from_pretrained(out))

    # Re-export a different (compile-wrapped) model over it: the new weights replace the old
    # ones and no staging folder is left behind.
    other = build_student(TINY, seed=1)
    export_student(torch.compile(other), out)
    assert_same_weights(other, WanTransformer3DModel.from_pretrained(out))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["student"]


def test_failed_export_keeps_the_previous_one(tmp_path):
    first = build_student(TINY, seed=0)
    out = export_student(first, tmp_path / "student")
    broken = build_student(TINY, seed=1)

    def crash_midway(save_directory, **kwargs):
        Path(save_directory, "config.json").write_text("{")
        raise OSError("No space left on device")

    broken.save_pretrained = crash_midway
    with pytest.raises(DistillError, match="No space left") as info:
        export_student(broken, out)
    assert info.value.stage == Stage.CHECKPOINT
    assert_same_weights(first, WanTransformer3DModel.from_pretrained(out))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["student"]


def test_load_pretrained_student_from_model_and_pipeline_folders(tmp_path):
    student = build_student(dict(TINY, num_layers=1), seed=0)
    export_student(student, tmp_path / "model")
    export_student(student, tmp_path / "pipeline" / "transformer")
    teacher_config = make_teacher().config
    for folder in (tmp_path / "model", tmp_path / "pipeline"):
        loaded = load_pretrained_student(str(folder), expected=teacher_config)
        assert_same_weights(student, loaded)
    # a bfloat16 checkpoint comes back as float32 master weights
    export_student(build_student(TINY, seed=2).to(torch.bfloat16), tmp_path / "bf16")
    assert load_pretrained_student(str(tmp_path / "bf16")).proj_out.weight.dtype == torch.float32


def test_load_pretrained_student_refuses_another_text_space(tmp_path):
    export_student(build_student(TINY, seed=0), tmp_path / "model")
    expected = dict(TINY, text_dim=4096)
    with pytest.raises(DistillError) as info:
        load_pretrained_student(str(tmp_path / "model"), expected=expected)
    assert "text_dim" in info.value.details and "4096" in info.value.details


def test_load_pretrained_student_missing_paths(tmp_path):
    with pytest.raises(DistillError, match="not found"):
        load_pretrained_student(str(tmp_path / "absent"))
    (tmp_path / "empty" / "vae").mkdir(parents=True)
    with pytest.raises(DistillError) as info:
        load_pretrained_student(str(tmp_path / "empty"))
    assert "vae/" in info.value.details
