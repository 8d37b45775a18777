"""A teacher carrying the user's LoRAs (--teacher_lora): fused as stock diffusers fuses them, part of
the caches' keys and the resume identity, and every bad input refused with its fix."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from conftest import train_args
from safetensors.torch import save_file

from distill.models.lora import LoraShape
from distill.models.lora_files import write_lora_folder
from distill.models.teacher import inspect_teacher, load_experts, with_teacher_loras
from distill.models.teacher_kind import I2V_A14B, T2V_A14B, TI2V_5B
from distill.models.tiny import write_tiny_teacher
from distill.ops.errors import DistillError, Stage, format_banner
from train_distillation import main

WIDTH, FFN, BLOCKS = 24, 32, 2  # the tiny teacher's experts (2 heads x 12, ffn 32, 2 layers)


def write_user_lora(
    path: Path, seed: int, width: int = WIDTH, ffn: int = FFN, rank: int = 4, image_attention: bool = False
) -> Path:
    """A LoRA in the Wan/ComfyUI form a user downloads: `diffusion_model.` keys, lora_down/lora_up
    and an alpha per module (scale alpha / rank = 0.5 here)."""
    g = torch.Generator().manual_seed(seed)
    shapes = {f"{attn}.{m}": (width, width) for attn in ("self_attn", "cross_attn") for m in "qkvo"}
    shapes |= {"ffn.0": (width, ffn), "ffn.2": (ffn, width)}
    if image_attention:  # Wan 2.1 image to video's extra cross-attention
        shapes |= {"cross_attn.k_img": (width, width), "cross_attn.v_img": (width, width)}
    state = {}
    for block in range(BLOCKS):
        for module, (n_in, n_out) in shapes.items():
            key = f"diffusion_model.blocks.{block}.{module}"
            state[f"{key}.lora_down.weight"] = torch.randn(rank, n_in, generator=g) * 0.3
            state[f"{key}.lora_up.weight"] = torch.randn(n_out, rank, generator=g) * 0.3
            state[f"{key}.alpha"] = torch.tensor(rank / 2.0)
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(state, path)
    return path


def forward(model: torch.nn.Module, channels: int = 16) -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    latents = torch.randn(1, channels, 1, 8, 8, generator=g)
    text = torch.randn(1, 8, 32, generator=g)
    with torch.no_grad():
        return model(latents, torch.tensor([700]), text).sample


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A user's high/low pair in one folder."""
    folder = tmp_path_factory.mktemp("user_lora") / "style"
    write_user_lora(folder / "style_high_noise.safetensors", seed=1)
    write_user_lora(folder / "style_low_noise.safetensors", seed=2)
    return folder


def test_the_fused_teacher_is_the_stock_pipeline_with_the_pair_loaded_and_fused(tiny_teacher, pair):
    from diffusers import WanPipeline

    info = with_teacher_loras(inspect_teacher(str(tiny_teacher)), [f"{pair}:0.7"])
    assert [(lora.expert, lora.path.name, lora.scale) for lora in info.loras] == [
        ("transformer", "style_high_noise.safetensors", 0.7),
        ("transformer_2", "style_low_noise.safetensors", 0.7),
    ]
    ours = load_experts(info, torch.float32)
    bare = load_experts(inspect_teacher(str(tiny_teacher)), torch.float32)

    pipe = WanPipeline.from_pretrained(tiny_teacher)
    pipe.load_lora_weights(pair, weight_name="style_high_noise.safetensors", adapter_name="style")
    pipe.load_lora_weights(
        pair, weight_name="style_low_noise.safetensors", adapter_name="style_2", load_into_transformer_2=True
    )
    pipe.fuse_lora(lora_scale=0.7, components=["transformer", "transformer_2"])
    for mine, stock, base in zip(ours, (pipe.transformer, pipe.transformer_2), bare, strict=True):
        # Frozen plain layers: nothing of peft is left to train or to shard around.
        assert not any("lora" in name for name, _ in mine.named_modules())
        assert not any(p.requires_grad for p in mine.parameters())
        torch.testing.assert_close(forward(mine), forward(stock), rtol=1e-5, atol=1e-6)
        assert (forward(mine) - forward(base)).abs().max() > 1e-2  # the LoRA changed the expert


def test_a_file_goes_on_the_expert_its_name_says_or_on_both(tiny_teacher, pair, tmp_path):
    info = inspect_teacher(str(tiny_teacher))
    high = with_teacher_loras(info, [str(pair / "style_high_noise.safetensors")])
    assert [lora.expert for lora in high.loras] == ["transformer"]
    plain = write_user_lora(tmp_path / "detail.safetensors", seed=3)
    both = with_teacher_loras(info, [f"{plain}:0.5", str(pair / "style_low_noise.safetensors")])
    assert [(lora.expert, lora.scale) for lora in both.loras] == [
        ("transformer", 0.5),
        ("transformer_2", 0.5),
        ("transformer_2", 1.0),
    ]


def test_the_cache_key_and_the_identity_follow_file_scale_and_expert(tiny_teacher, pair, tmp_path):
    from distill.train.identity import teacher_lora_record

    info = inspect_teacher(str(tiny_teacher))
    experts = (*info.expert_folders, "scheduler")
    base = info.fingerprint(*experts)
    keys = {
        spec: with_teacher_loras(info, [spec]).fingerprint(*experts)
        for spec in (str(pair), f"{pair}:0.5", str(pair / "style_high_noise.safetensors"))
    }
    changed = tmp_path / "style"
    shutil.copytree(pair, changed)
    write_user_lora(changed / "style_low_noise.safetensors", seed=9)  # same name, other content
    keys["content"] = with_teacher_loras(info, [str(changed)]).fingerprint(*experts)
    assert len({base, *keys.values()}) == 5
    assert with_teacher_loras(info, [str(changed)]).fingerprint(*experts) == keys["content"]  # stable
    # The text encoder's cache is not the experts': the LoRAs leave it alone.
    with_lora = with_teacher_loras(info, [str(pair)])
    assert with_lora.fingerprint("text_encoder", "tokenizer") == info.fingerprint("text_encoder", "tokenizer")
    # The resume identity keeps the base teacher apart from the LoRAs, which it names.
    assert with_lora.fingerprint(*info.expert_folders, with_loras=False) == info.fingerprint(
        *info.expert_folders
    )
    assert [(r["file"], r["scale"]) for r in teacher_lora_record(with_lora)] == [
        ("style_high_noise.safetensors", 1.0),
        ("style_low_noise.safetensors", 1.0),
    ]


def test_our_own_lora_export_is_a_teacher_lora_in_both_its_formats(tiny_teacher, tmp_path):
    g = torch.Generator().manual_seed(4)
    state = {
        f"blocks.{b}.{attn}.to_q.lora_{ab}.weight": torch.randn(shape, generator=g)
        for b in range(BLOCKS)
        for attn in ("attn1", "attn2")
        for ab, shape in (("A", (2, WIDTH)), ("B", (WIDTH, 2)))
    }
    export = write_lora_folder(
        {"high": state, "low": state}, LoraShape(2, 4.0, ("to_q",)), tmp_path / "lora", T2V_A14B
    )
    info = inspect_teacher(str(tiny_teacher))
    diffusers_files = load_experts(with_teacher_loras(info, [str(export)]), torch.float32)
    wan_files = load_experts(with_teacher_loras(info, [str(export / "comfyui")]), torch.float32)
    bare = load_experts(info, torch.float32)
    for a, b, base in zip(diffusers_files, wan_files, bare, strict=True):
        torch.testing.assert_close(forward(a), forward(b), rtol=1e-5, atol=1e-6)
        assert (forward(a) - forward(base)).abs().max() > 1e-3


def test_a_one_transformer_teacher_takes_one_file(tmp_path):
    from diffusers import WanPipeline

    teacher = write_tiny_teacher(tmp_path / "ti2v", seed=0, kind=TI2V_5B)
    info = inspect_teacher(str(teacher))
    channels = info.expert_config["in_channels"]
    width = info.expert_config["num_attention_heads"] * info.expert_config["attention_head_dim"]
    ffn = info.expert_config["ffn_dim"]
    lora = write_user_lora(tmp_path / "user" / "look_high_noise.safetensors", seed=5, width=width, ffn=ffn)
    fused, none = load_experts(with_teacher_loras(info, [f"{lora.parent}:0.8"]), torch.float32)
    assert none is None
    pipe = WanPipeline.from_pretrained(teacher)
    pipe.load_lora_weights(lora.parent, weight_name=lora.name)
    pipe.fuse_lora(lora_scale=0.8)
    torch.testing.assert_close(
        forward(fused, channels), forward(pipe.transformer, channels), rtol=1e-5, atol=1e-6
    )
    with pytest.raises(DistillError, match="holds 2 .safetensors files"):
        write_user_lora(lora.parent / "look_low_noise.safetensors", seed=6, width=width, ffn=ffn)
        with_teacher_loras(info, [str(lora.parent)])


@pytest.mark.parametrize(
    ("spec", "words"),
    [
        ("{pair}:abc", "the scale 'abc' is not a finite number"),
        ("{pair}:nan", "the scale 'nan' is not a finite number"),
        ("{pair}:inf", "the scale 'inf' is not a finite number"),
        ("{tmp}/nowhere.safetensors", "does not exist"),
        ("{half}", "half a pair: the folder has a high-noise LoRA (style_high_noise.safetensors) and no low"),
        ("{wide}", "0 of 20 adapted modules match"),
        ("{i2v21}", "20 of 24 adapted modules match"),
    ],
)
def test_bad_teacher_loras_are_refused_before_anything_loads(tiny_teacher, pair, tmp_path, spec, words):
    half = tmp_path / "half"
    half.mkdir()
    shutil.copy(pair / "style_high_noise.safetensors", half)
    write_user_lora(tmp_path / "wide.safetensors", seed=7, width=48)
    write_user_lora(tmp_path / "i2v21.safetensors", seed=8, image_attention=True)
    given = spec.format(
        pair=pair,
        tmp=tmp_path,
        half=half,
        wide=tmp_path / "wide.safetensors",
        i2v21=tmp_path / "i2v21.safetensors",
    )
    with pytest.raises(DistillError) as refused:
        with_teacher_loras(inspect_teacher(str(tiny_teacher)), [given])
    text = format_banner(refused.value)
    assert words in text, text
    assert refused.value.fixes, text


def test_a_resume_with_another_teacher_lora_is_refused_naming_it(tiny_teacher, pair, tmp_path, capsys):
    out = tmp_path / "out"
    args = train_args(tiny_teacher, out, tmp_path / "cache", num_steps=2, checkpoint_every=2)
    assert main([*args, "--teacher_lora", f"{pair}:0.7"]) == 0
    recorded = json.loads((out / "student" / "run_settings.json").read_text())
    assert [(r["expert"], r["scale"]) for r in recorded["teacher_loras"]] == [
        ("transformer", 0.7),
        ("transformer_2", 0.7),
    ]
    assert (
        "style_high_noise.safetensors` fused into the high-noise expert at scale 0.7"
        in (out / "student" / "README.md").read_text()
    )
    capsys.readouterr()
    more = train_args(tiny_teacher, out, tmp_path / "cache", num_steps=4, checkpoint_every=2)
    code = main([*more, "--teacher_lora", f"{pair}:0.5"])
    err = capsys.readouterr().err
    assert code == int(Stage.CHECKPOINT), err
    assert "different set of teacher LoRAs (--teacher_lora)" in err
    assert "style_high_noise.safetensors on transformer at scale 0.7" in err and "at scale 0.5" in err
    # A bad LoRA on that run's folder: refused before the teacher loads, the run's files kept.
    half = tmp_path / "half"
    half.mkdir()
    shutil.copy(pair / "style_high_noise.safetensors", half)
    for bad in (f"{pair}:nan", str(half)):
        assert main([*more, "--teacher_lora", bad]) == int(Stage.CONFIG)
        assert "--teacher_lora" in capsys.readouterr().err
    assert (out / "checkpoints" / "step_00000002" / "COMPLETE").is_file()  # nothing written is lost
    assert (out / "student" / "run_settings.json").is_file()


def test_the_flag_repeats_and_a_config_file_takes_one_value_or_a_list(tiny_teacher, pair, tmp_path):
    from distill.config.cli import load_config_file, parse_config

    args = train_args(tiny_teacher, tmp_path / "out", tmp_path / "cache")
    high, low = (str(pair / f"style_{w}_noise.safetensors") for w in ("high", "low"))
    assert parse_config([*args, "--teacher_lora", high, "--teacher_lora", f"{low}:0.5"]).teacher_lora == [
        high,
        f"{low}:0.5",
    ]
    assert parse_config(args).teacher_lora is None
    listed, single = tmp_path / "listed.yaml", tmp_path / "single.yaml"
    listed.write_text(f"teacher_lora: [{high}, {low}]\n")
    single.write_text(f"teacher_lora: {pair}:0.7\n")
    assert load_config_file(listed)["teacher_lora"] == [high, low]
    assert load_config_file(single)["teacher_lora"] == [f"{pair}:0.7"]


def musubi_key(key: str) -> str:
    name = key.removeprefix("diffusion_model.")
    tail = next(t for t in (".lora_down.weight", ".lora_up.weight", ".alpha") if name.endswith(t))
    return "lora_unet_" + name.removesuffix(tail).replace(".", "_") + tail


def test_a_musubi_tuner_file_fuses_as_its_wan_form_does(tiny_teacher, pair, tmp_path):
    from safetensors.torch import load_file

    wan = load_file(pair / "style_high_noise.safetensors")
    # musubi-tuner / kohya name the same modules lora_unet_blocks_0_self_attn_q.lora_down.weight.
    musubi = {musubi_key(key): value for key, value in wan.items()}
    save_file(musubi, tmp_path / "style_high.safetensors")
    info = inspect_teacher(str(tiny_teacher))
    (from_wan, _), (from_musubi, _) = (
        load_experts(with_teacher_loras(info, [path]), torch.float32)
        for path in (str(pair / "style_high_noise.safetensors"), str(tmp_path / "style_high.safetensors"))
    )
    torch.testing.assert_close(forward(from_musubi), forward(from_wan), rtol=1e-5, atol=1e-6)


@pytest.fixture(scope="module")
def i2v_teacher(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_teacher(tmp_path_factory.mktemp("i2v") / "teacher", seed=0, kind=I2V_A14B)


def test_the_i2v_teacher_fuses_a_wan_pair_as_the_stock_i2v_pipeline_does(i2v_teacher, pair):
    from diffusers import WanImageToVideoPipeline

    info = with_teacher_loras(inspect_teacher(str(i2v_teacher)), [f"{pair}:0.6"])
    assert info.kind == I2V_A14B
    ours = load_experts(info, torch.float32)
    bare = load_experts(inspect_teacher(str(i2v_teacher)), torch.float32)
    pipe = WanImageToVideoPipeline.from_pretrained(i2v_teacher)
    pipe.load_lora_weights(pair, weight_name="style_high_noise.safetensors", adapter_name="style")
    pipe.load_lora_weights(
        pair, weight_name="style_low_noise.safetensors", adapter_name="style_2", load_into_transformer_2=True
    )
    pipe.fuse_lora(lora_scale=0.6, components=["transformer", "transformer_2"])
    channels = info.expert_config["in_channels"]  # noise, mask and the image's latent
    assert channels > 16
    for mine, stock, base in zip(ours, (pipe.transformer, pipe.transformer_2), bare, strict=True):
        torch.testing.assert_close(forward(mine, channels), forward(stock, channels), rtol=1e-5, atol=1e-6)
        assert (forward(mine, channels) - forward(base, channels)).abs().max() > 1e-2


def test_our_export_for_another_teacher_kind_is_refused_naming_both(tiny_teacher, i2v_teacher, tmp_path):
    g = torch.Generator().manual_seed(4)
    state = {
        f"blocks.{b}.attn1.to_q.lora_{ab}.weight": torch.randn(shape, generator=g)
        for b in range(BLOCKS)
        for ab, shape in (("A", (2, WIDTH)), ("B", (WIDTH, 2)))
    }
    shape = LoraShape(2, 4.0, ("to_q",))
    i2v = write_lora_folder({"high": state, "low": state}, shape, tmp_path / "i2v_lora", I2V_A14B)
    t2v = write_lora_folder({"high": state, "low": state}, shape, tmp_path / "t2v_lora", T2V_A14B)
    # Same shapes on both teachers: only the record tells; each format, folder or one file of it.
    for given in (i2v, i2v / "comfyui", i2v / "high_noise_lora.safetensors"):
        with pytest.raises(DistillError) as refused:
            with_teacher_loras(inspect_teacher(str(tiny_teacher)), [str(given)])
        text = format_banner(refused.value)
        assert "a LoRA of Wan2.2-I2V-A14B (image to video); this teacher is Wan2.2-T2V-A14B" in text, text
        assert "teacher_kind = i2v-a14b" in text
    with pytest.raises(DistillError, match="a LoRA of Wan2.2-T2V-A14B .* this teacher is Wan2.2-I2V-A14B"):
        with_teacher_loras(inspect_teacher(str(i2v_teacher)), [str(t2v / "comfyui")])
    # Each on its own teacher: accepted (the fix the banner offers).
    assert len(with_teacher_loras(inspect_teacher(str(i2v_teacher)), [str(i2v)]).loras) == 2
    assert len(with_teacher_loras(inspect_teacher(str(tiny_teacher)), [str(t2v)]).loras) == 2
