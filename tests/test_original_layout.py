"""The ORIGINAL Wan layout: a tiny teacher written in it converts to exactly the diffusers-layout
teacher of the same weights, trains the same, and a student exports back to the original key names.

    .venv/bin/python -m pytest -q tests/test_original_layout.py
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pytest
import torch
from conftest import train_args
from diffusers import AutoencoderKLWan, WanTransformer3DModel
from safetensors import safe_open
from safetensors.torch import load_file

import download_wan
from distill.config.cli import parse_config
from distill.models.original.convert import default_convert_root, ensure_converted
from distill.models.original.detect import CONVERT_DIR_ENV, MARKER, looks_original, original_problems
from distill.models.original.export import export_original
from distill.models.original.keymaps import vae_to_original
from distill.models.teacher import TeacherInfo, inspect_teacher, load_expert, load_text_encoder
from distill.models.tiny import (
    ORIGINAL_LAYOUT_SHAPE,
    build_tiny_pipeline,
    write_tiny_original_teacher,
    write_tiny_teacher,
)
from distill.ops.errors import DistillError, Stage
from distill.train.trainer import Distiller

PROMPT = "a red cube spinning slowly on a wooden table"


@pytest.fixture(scope="module")
def original(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny teacher (seed 0) in the original layout. Copy it before changing anything in it."""
    return write_tiny_original_teacher(tmp_path_factory.mktemp("original") / "Wan2.2-T2V-A14B", seed=0)


@pytest.fixture(scope="module")
def twin(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The same weights (seed and shape) in the diffusers layout."""
    return write_tiny_teacher(
        tmp_path_factory.mktemp("twin") / "teacher", seed=0, shape=ORIGINAL_LAYOUT_SHAPE
    )


@pytest.fixture(scope="module")
def converted(original: Path, tmp_path_factory: pytest.TempPathFactory) -> TeacherInfo:
    return inspect_teacher(str(original), convert_dir=tmp_path_factory.mktemp("converted"))


def _keys(path: Path) -> set[str]:
    if path.suffix == ".pth":
        return set(torch.load(path, weights_only=True))
    with safe_open(path, framework="pt") as handle:
        return set(handle.keys())


def test_the_tiny_original_teacher_has_the_release_layout_and_key_names(original: Path) -> None:
    assert looks_original(original) and original_problems(original) == []
    assert json.loads((original / "configuration.json").read_text())["task"] == "text-to-video"
    assert (original / "google/umt5-xxl/tokenizer.json").is_file()
    for expert in ("high_noise_model", "low_noise_model"):
        config = json.loads((original / expert / "config.json").read_text())
        assert config["_class_name"] == "WanModel" and config["model_type"] == "t2v"
        index = json.loads((original / expert / "diffusion_pytorch_model.safetensors.index.json").read_text())
        assert sorted(set(index["weight_map"].values())) == [
            "diffusion_pytorch_model-00001-of-00002.safetensors",
            "diffusion_pytorch_model-00002-of-00002.safetensors",
        ]
        assert {"head.modulation", "blocks.1.norm3.weight", "blocks.0.cross_attn.o.bias"} <= set(
            index["weight_map"]
        )
    t5 = _keys(original / "models_t5_umt5-xxl-enc-bf16.pth")
    assert {
        "token_embedding.weight",
        "blocks.1.ffn.gate.0.weight",
        "blocks.0.pos_embedding.embedding.weight",
    } <= t5
    vae = _keys(original / "Wan2.1_VAE.pth")
    assert {
        "decoder.upsamples.4.shortcut.weight",
        "decoder.upsamples.11.resample.1.weight",
        "conv1.weight",
    } <= vae


def test_conversion_equals_the_diffusers_twin(converted: TeacherInfo, twin: Path, original: Path) -> None:
    reference = inspect_teacher(str(twin))
    assert converted.path != original and (converted.path / MARKER).is_file()
    assert (converted.boundary_ratio, converted.flow_shift) == (
        reference.boundary_ratio,
        reference.flow_shift,
    )
    # WanModel's rope table is 1024 long; the values for the positions used are the same.
    assert {**converted.expert_config, "rope_max_seq_len": 32} == reference.expert_config
    cpu = torch.device("cpu")

    embeds = [
        load_text_encoder(info, cpu, torch.float32).encode_prompt(
            PROMPT, do_classifier_free_guidance=False, max_sequence_length=32, device=cpu
        )[0]
        for info in (converted, reference)
    ]
    torch.testing.assert_close(embeds[0], embeds[1], rtol=0, atol=1e-6)

    video = torch.rand(1, 3, 5, 16, 16, generator=torch.Generator().manual_seed(0)) * 2 - 1
    latents = [
        AutoencoderKLWan.from_pretrained(info.path / "vae").encode(video).latent_dist.mean
        for info in (converted, reference)
    ]
    assert latents[0].shape == (1, 16, 2, 2, 2)
    torch.testing.assert_close(latents[0], latents[1], rtol=0, atol=1e-6)

    gen = torch.Generator().manual_seed(1)
    x, text = torch.randn(2, 16, 2, 4, 4, generator=gen), torch.randn(2, 7, 32, generator=gen)
    t = torch.tensor([950.0, 120.0])
    for expert in ("transformer", "transformer_2"):
        outs = [
            load_expert(info, expert, torch.float32)(x, t, text, return_dict=False)[0]
            for info in (converted, reference)
        ]
        torch.testing.assert_close(outs[0], outs[1], rtol=0, atol=1e-6)


def _wan_t5_reference(state: dict[str, torch.Tensor], ids: torch.Tensor) -> torch.Tensor:
    """Wan's own T5 encoder forward (wan/modules/t5.py, no padding), written against the ORIGINAL
    key names, so the T5 key map is checked against the model it came from, not against itself."""
    import math

    def rms(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))

    def buckets(length: int, num_buckets: int, max_dist: int = 128) -> torch.Tensor:
        rel = torch.arange(length)[None] - torch.arange(length)[:, None]
        half = num_buckets // 2
        out, rel = (rel > 0).long() * half, rel.abs()
        exact = half // 2
        large = exact + (torch.log(rel.float() / exact) / math.log(max_dist / exact) * (half - exact)).long()
        return out + torch.where(rel < exact, rel, large.clamp(max=half - 1))

    x = state["token_embedding.weight"][ids]
    b, length, _ = x.shape
    for i in range(sum(k.endswith(".norm1.weight") for k in state)):
        w = {k.removeprefix(f"blocks.{i}."): v for k, v in state.items() if k.startswith(f"blocks.{i}.")}
        table = w["pos_embedding.embedding.weight"]
        heads = table.shape[1]
        bias = table[buckets(length, table.shape[0])].permute(2, 0, 1)[None]
        h = rms(x, w["norm1.weight"])
        q, k, v = (h @ w[f"attn.{n}.weight"].T for n in "qkv")
        q, k, v = (t.view(b, length, heads, -1) for t in (q, k, v))
        attn = torch.softmax(torch.einsum("binc,bjnc->bnij", q, k) + bias, dim=-1)
        x = x + torch.einsum("bnij,bjnc->binc", attn, v).reshape(b, length, -1) @ w["attn.o.weight"].T
        h = rms(x, w["norm2.weight"])
        gate = torch.nn.functional.gelu(h @ w["ffn.gate.0.weight"].T, approximate="tanh")
        x = x + ((h @ w["ffn.fc1.weight"].T) * gate) @ w["ffn.fc2.weight"].T
    return rms(x, state["norm.weight"])


def test_converted_text_encoder_equals_wan_t5_reference(converted: TeacherInfo, original: Path) -> None:
    pipe = load_text_encoder(converted, torch.device("cpu"), torch.float32)
    ids = pipe.tokenizer([PROMPT], return_tensors="pt").input_ids
    assert ids.shape[1] > 8  # long enough for the logarithmic relative-position buckets
    with torch.no_grad():
        ours = pipe.text_encoder(ids).last_hidden_state
    state = torch.load(original / "models_t5_umt5-xxl-enc-bf16.pth", weights_only=True)
    torch.testing.assert_close(ours, _wan_t5_reference(state, ids), rtol=0, atol=1e-5)


def test_a_second_load_reuses_the_conversion(
    converted: TeacherInfo, original: Path, caplog: pytest.LogCaptureFixture
) -> None:
    stamp = (converted.path / MARKER).stat().st_mtime_ns
    with caplog.at_level(logging.INFO, logger="distill.models.original.convert"):
        again = inspect_teacher(str(original), convert_dir=converted.path.parent)
    assert again.path == converted.path and (again.path / MARKER).stat().st_mtime_ns == stamp
    assert "Using the diffusers-layout conversion" in caplog.text


def test_concurrent_loads_convert_once(
    original: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """All ranks of a torchrun job call inspect_teacher at once: one converts, the others wait."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(3) as pool:
        paths = list(pool.map(lambda _: ensure_converted(original, tmp_path), range(3)))
    assert len(set(paths)) == 1 and (paths[0] / MARKER).is_file()
    assert capsys.readouterr().out.count("converting it once") == 1
    assert [p.name for p in tmp_path.iterdir() if not p.name.endswith(".lock")] == [paths[0].name]


def test_default_conversion_folder(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv(CONVERT_DIR_ENV, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert default_convert_root() == tmp_path / "wan-distill" / "converted"
    monkeypatch.setenv(CONVERT_DIR_ENV, str(tmp_path / "mine"))
    assert default_convert_root() == tmp_path / "mine"


def test_cli_convert_then_verify(original: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    dst = tmp_path / "Wan2.2-T2V-A14B-Diffusers"
    assert download_wan.main(["--convert", str(original), str(dst)]) == 0
    assert "is a complete Wan 2.2 diffusers teacher" in capsys.readouterr().out
    assert download_wan.main(["--verify", str(dst)]) == 0
    assert download_wan.main(["--convert", str(original), str(dst)]) == 0  # already there: kept
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "notes.txt").write_text("mine")
    assert download_wan.main(["--convert", str(original), str(tmp_path / "busy")]) == Stage.TEACHER_LOAD
    assert "not empty" in capsys.readouterr().err
    assert download_wan.main(["--convert", str(dst), str(tmp_path / "again")]) == Stage.TEACHER_LOAD
    assert "already in the diffusers layout" in capsys.readouterr().err


def test_cli_tiny_original_layout(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert download_wan.main(["--tiny", str(tmp_path / "t"), "--layout", "original"]) == 0
    assert "original layout" in capsys.readouterr().out
    assert looks_original(tmp_path / "t") and original_problems(tmp_path / "t") == []
    with pytest.raises(SystemExit) as usage:
        download_wan.main(["--verify", str(tmp_path / "t"), "--layout", "original"])
    assert usage.value.code == 2


def test_a_partial_original_folder_names_what_is_missing(original: Path, tmp_path: Path) -> None:
    broken = tmp_path / "Wan2.2-T2V-A14B"
    shutil.copytree(original, broken)
    (broken / "Wan2.1_VAE.pth").unlink()
    (broken / "low_noise_model" / "diffusion_pytorch_model-00002-of-00002.safetensors").unlink()
    t5 = broken / "models_t5_umt5-xxl-enc-bf16.pth"
    t5.write_bytes(t5.read_bytes()[: t5.stat().st_size // 2])
    with pytest.raises(DistillError) as caught:
        inspect_teacher(str(broken), convert_dir=tmp_path / "converted")
    error = caught.value
    assert error.stage == Stage.TEACHER_LOAD and "ORIGINAL Wan layout" in error.title
    assert "- missing Wan2.1_VAE.pth" in error.details
    assert "low_noise_model/diffusion_pytorch_model-00002-of-00002.safetensors is missing" in error.details
    assert "models_t5_umt5-xxl-enc-bf16.pth is not a complete torch checkpoint" in error.details
    assert not (tmp_path / "converted").exists()


def test_student_export_in_the_original_format_reloads_with_from_single_file(
    twin: Path, tmp_path: Path
) -> None:
    student = WanTransformer3DModel.from_pretrained(twin / "transformer")
    from_model = export_original(student, tmp_path / "student_original.safetensors")
    from_folder = export_original(twin / "transformer", tmp_path / "from_folder.safetensors")
    assert load_file(from_model).keys() == load_file(from_folder).keys()
    with safe_open(from_model, framework="pt") as handle:
        assert {"head.head.weight", "blocks.0.self_attn.norm_q.weight", "blocks.1.modulation"} <= set(
            handle.keys()
        )
        assert json.loads(handle.metadata()["config"])["_class_name"] == "WanModel"
    reloaded = WanTransformer3DModel.from_single_file(str(from_model), config=str(twin / "transformer"))
    expected = student.state_dict()
    assert reloaded.state_dict().keys() == expected.keys()
    for key, value in reloaded.state_dict().items():
        assert torch.equal(value, expected[key]), key


def test_structures_the_original_format_cannot_hold_are_refused(tmp_path: Path) -> None:
    default_vae = build_tiny_pipeline(0).vae  # dim_mult [1,1,1,1]: diffusers' converter cannot read it back
    with pytest.raises(DistillError, match="cannot be written in the original Wan format"):
        vae_to_original(default_vae.state_dict(), num_res_blocks=1)
    no_qk_norm = WanTransformer3DModel(
        num_attention_heads=2, attention_head_dim=12, text_dim=32, ffn_dim=32, num_layers=1, qk_norm=None
    )
    with pytest.raises(DistillError, match="original Wan format"):
        export_original(no_qk_norm, tmp_path / "unused.safetensors")
    assert not any(tmp_path.iterdir())


def _wide_patch_expert() -> WanTransformer3DModel:
    return WanTransformer3DModel(
        patch_size=(1, 4, 4),
        num_attention_heads=2,
        attention_head_dim=12,
        text_dim=32,
        ffn_dim=32,
        num_layers=1,
    )


def test_a_patch_size_other_than_1_2_2_is_refused_at_export(tmp_path: Path) -> None:
    """WanModel builds patch (1, 2, 2) whatever its config.json says; other weights do not load."""
    student = _wide_patch_expert()
    student.save_pretrained(tmp_path / "student")
    for source in (student, tmp_path / "student"):  # a model, or its folder (patch_size as a list)
        with pytest.raises(DistillError, match="original Wan format") as caught:
            export_original(source, tmp_path / "student_original.safetensors")
        assert "'patch_size': (1, 4, 4)" in caught.value.details
        assert any("patch_size [1, 2, 2]" in fix for fix in caught.value.fixes)
    assert not (tmp_path / "student_original.safetensors").exists()


def test_a_patch_size_the_original_format_cannot_hold_is_refused_before_training(
    tiny_teacher: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from train_distillation import main

    teacher = tmp_path / "teacher"
    shutil.copytree(tiny_teacher, teacher)
    for expert in ("transformer", "transformer_2"):  # a teacher (and so a student) with patch (1, 4, 4)
        shutil.rmtree(teacher / expert)
        _wide_patch_expert().save_pretrained(teacher / expert)
    config = json.loads((Path(__file__).parents[1] / "config" / "student_tiny.json").read_text())
    student_config = tmp_path / "student.json"
    student_config.write_text(json.dumps({**config, "patch_size": [1, 4, 4]}))
    common = dict(student_config=student_config, height=32, width=32)
    args = train_args(
        teacher, tmp_path / "out", tmp_path / "cache", export_formats="diffusers,original", **common
    )
    assert main([str(a) for a in args]) == Stage.CONFIG
    err = capsys.readouterr().err
    assert f"the student of {student_config} (--export_formats original) cannot be written" in err
    assert "'patch_size': (1, 4, 4)" in err and "--export_formats diffusers" in err
    assert not (tmp_path / "out").exists() and not (tmp_path / "cache").exists()
    # the same run without the original format is valid
    args = train_args(teacher, tmp_path / "out", tmp_path / "cache", dry_run=True, **common)
    assert main([str(a) for a in args]) == 0


def test_training_on_the_original_layout_matches_the_diffusers_twin(
    original: Path, twin: Path, tmp_path: Path
) -> None:
    """Same caches, same targets, same gradients: what two code paths can promise on any CPU.

    The trained weights are NOT compared: Adam divides by the root of tiny second moments, so
    float noise of 1e-7 in the teachers' outputs moves some weights by up to lr per step (1.5e-4
    seen after 2 steps on an AVX-512 CPU). Losses and gradient norms are smooth in the weights
    and carry no such amplification.
    """
    # The trainer converts into <cache_dir>/teacher, on storage every rank shares.
    settings = dict(num_steps=4, max_prompts=2, batch_size=2)
    results = [
        Distiller(
            parse_config(train_args(teacher, tmp_path / name, tmp_path / f"{name}-cache", **settings))
        ).run()
        for name, teacher in (("original", original), ("twin", twin))
    ]
    assert [r.steps for r in results] == [4, 4]
    assert any((tmp_path / "original-cache" / "teacher").glob(f"*/{MARKER}"))

    # The prompt embeddings (text encoder) and clean latents (both experts, sampled) agree.
    for kind in ("embeddings", "latents"):
        files = [
            sorted((tmp_path / f"{name}-cache" / kind).glob("**/*.safetensors"))
            for name in ("original", "twin")
        ]
        assert [p.name for p in files[0]] == [p.name for p in files[1]] and files[0]
        for a, b in zip(*files):
            torch.testing.assert_close(load_file(a)["value"], load_file(b)["value"], rtol=0, atol=1e-5)

    # Step 1 is computed before any update: its loss is the teacher's target against the same
    # initial student, its gradient norm the first gradient. Later steps follow the trajectory.
    histories = [r.history for r in results]
    assert [h["step"] for h in histories[0]] == [1, 2, 3, 4]
    seen = set()
    for ours, theirs in zip(*histories):
        assert ours.keys() == theirs.keys()
        rtol = 1e-5 if ours["step"] == 1 else 1e-4
        for key in ("loss", "grad_norm", "loss_high_noise", "loss_low_noise"):
            if key in ours:
                seen.add(key)
                assert ours[key] == pytest.approx(theirs[key], rel=rtol), (ours["step"], key)
    assert {"loss_high_noise", "loss_low_noise"} <= seen  # both experts were compared


def test_training_exports_the_original_format_on_request(tiny_teacher, shared_cache, tmp_path):
    from conftest import train_args
    from diffusers import WanTransformer3DModel

    from distill.config.cli import parse_config
    from distill.train.trainer import Distiller

    result = Distiller(
        parse_config(
            train_args(
                tiny_teacher,
                tmp_path / "out",
                shared_cache,
                num_steps=2,
                ema_decay=0.9,
                export_formats="diffusers,original",
            )
        )
    ).run()
    for name in ("student", "student_ema"):
        single = tmp_path / "out" / f"{name}_original.safetensors"
        reloaded = WanTransformer3DModel.from_single_file(str(single), config=str(result.output_dir / name))
        exported = WanTransformer3DModel.from_pretrained(result.output_dir / name)
        assert all(
            torch.equal(a, b) for a, b in zip(reloaded.state_dict().values(), exported.state_dict().values())
        )
