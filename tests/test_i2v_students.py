"""Students of an image-to-video teacher (Wan2.2-I2V-A14B: 36 input channels = 16 noisy + 4 mask + 16
image latent): the shipped configs, the starts (--student_init teacher, a text-to-video student folder
widened to 36 channels), and every student, config or LoRA folder of one model refused with the other
model's teacher, naming both models and the fix. Tiny real models, no mocks."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pytest
import torch
from conftest import A14B_EXPERT, REPO, train_args
from PIL import Image

from distill.config.settings import TrainConfig
from distill.models.conditioning import Condition, model_input
from distill.models.lora import STUDENT_ADAPTER, LoraExperts, LoraShape
from distill.models.lora_files import FILES, WAN_FORMAT_DIR, write_lora_folder
from distill.models.student import (
    build_student,
    export_student,
    init_student_from_teacher,
    load_pretrained_student,
)
from distill.models.student_config import load_student_config
from distill.models.teacher import inspect_teacher, load_expert
from distill.models.teacher_kind import I2V_A14B, T2V_A14B
from distill.models.tiny import write_tiny_teacher
from distill.ops.errors import DistillError, Stage
from distill.sample.lora_fit import lora_start
from distill.sample.model_card import document_export
from distill.sample.run_settings import settings_from_run
from distill.sample.student_folder import load_student, lora_student, student_limits
from train_distillation import main as train

pytestmark = pytest.mark.usefixtures("one_thread")

T2V, I2V = T2V_A14B.model, I2V_A14B.model
TINY_T2V = REPO / "config" / "student_tiny.json"
TINY_I2V = REPO / "config" / "student_tiny_i2v.json"
SHAPE = LoraShape(2, 2.0)


def refusal(error: DistillError, first: str, second: str) -> str:
    """The whole text of a refusal, checked to name both models and to offer a fix."""
    text = "\n".join([error.title, error.details, *error.causes, *error.fixes])
    assert error.stage == Stage.CONFIG
    assert first in error.title and second in error.title, error.title
    assert error.fixes
    return text


def write_lora_run(info, out: Path) -> Path:
    """A LoRA run's output folder as the export writes it: lora/ (both formats) and run_settings.json
    in and beside it, from adapters on the teacher's own experts."""
    experts = LoraExperts(
        load_expert(info, "transformer", torch.float32),
        load_expert(info, "transformer_2", torch.float32),
        SHAPE,
        None,
        seed=0,
    )
    student = experts.model(STUDENT_ADAPTER, info.boundary_ratio)
    lora = write_lora_folder({w: student.state(w) for w in ("high", "low")}, SHAPE, out / "lora")
    cfg = TrainConfig(teacher_path=str(info.path), student_config="", data_path="", output_dir=str(out))
    document_export(out, settings_from_run(cfg, info, 1), lora, student_kind="lora")
    return lora


def write_student_run(config: dict, teacher: Path, info, out: Path) -> Path:
    """A full student's run folder: student/ and run_settings.json in and beside it."""
    student = export_student(build_student(config, seed=0), out / "student")
    cfg = TrainConfig(teacher_path=str(teacher), student_config="", data_path="", output_dir=str(out))
    document_export(out, settings_from_run(cfg, info, 1), student)
    return student


@pytest.fixture(scope="module")
def world(tiny_teacher: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """Both tiny teachers, a full student and a LoRA run exported for each, and prompts with images."""
    root = tmp_path_factory.mktemp("i2v_students")
    i2v = write_tiny_teacher(root / "i2v_teacher", seed=0, kind=I2V_A14B)
    infos = {"t2v": inspect_teacher(tiny_teacher), "i2v": inspect_teacher(i2v)}
    assert infos["t2v"].kind == T2V_A14B and infos["i2v"].kind == I2V_A14B
    configs = {
        "t2v": load_student_config(TINY_T2V, infos["t2v"].expert_config),
        "i2v": load_student_config(TINY_I2V, infos["i2v"].expert_config),
    }
    images = root / "data" / "images"
    images.mkdir(parents=True)
    lines = []
    for i in range(2):
        Image.new("RGB", (16, 16), (40 + 100 * i, 200, 90)).save(images / f"{i}.png")
        lines.append(json.dumps({"prompt": f"a ball number {i}", "image": f"images/{i}.png"}))
    (root / "data" / "pairs.jsonl").write_text("\n".join(lines) + "\n")
    return {
        "root": root,
        "teachers": {"t2v": tiny_teacher, "i2v": i2v},
        "infos": infos,
        "configs": configs,
        "data": root / "data" / "pairs.jsonl",
        "students": {
            k: write_student_run(configs[k], t, infos[k], root / f"{k}_run")
            for k, t in (("t2v", tiny_teacher), ("i2v", i2v))
        },
        "loras": {k: write_lora_run(infos[k], root / f"{k}_lora_run") for k in ("t2v", "i2v")},
    }


def i2v_train_args(world: dict, out: str, **overrides: object) -> list[str]:
    root = world["root"]
    return train_args(
        world["teachers"]["i2v"],
        root / out,
        root / "cache",
        **{"data_path": world["data"], "num_frames": 1, "max_prompts": None, "num_steps": 1, **overrides},
    )


def banner(capsys: pytest.CaptureFixture[str]) -> str:
    err = capsys.readouterr().err
    assert "Traceback" not in err and "ERROR (config)" in err, err[-2000:]
    return err


# ------------------------------------------------------------------------------------------------
# Student configs
# ------------------------------------------------------------------------------------------------


def test_shipped_i2v_configs_take_the_i2v_teachers_input(world):
    tiny = world["configs"]["i2v"]
    assert (tiny["in_channels"], tiny["out_channels"]) == (36, 16)
    real_i2v = dict(A14B_EXPERT, in_channels=36, out_channels=16)
    big = load_student_config(REPO / "config" / "student_config_i2v.json", real_i2v)
    t2v_big = load_student_config(REPO / "config" / "student_config.json", A14B_EXPERT)
    # The 1.3B shape with the image-to-video input: nothing else differs from the T2V config.
    assert {k for k in big if big[k] != t2v_big[k]} == {"in_channels"}
    assert (big["in_channels"], big["out_channels"]) == (36, 16)


def test_a_t2v_config_with_the_i2v_teacher_is_refused_naming_both_models_and_the_fix(world):
    with pytest.raises(DistillError) as caught:
        load_student_config(TINY_T2V, world["infos"]["i2v"].expert_config)
    text = refusal(caught.value, T2V, I2V)
    assert str(TINY_T2V) in caught.value.title
    assert I2V_A14B.inputs in caught.value.details  # what the teacher's 36 channels are made of
    assert any(
        '"in_channels": 36' in fix and "config/student_tiny_i2v.json" in fix for fix in caught.value.fixes
    )
    assert "config/student_config_i2v.json" in text
    # and the reverse: an image-to-video config with the text-to-video teacher
    with pytest.raises(DistillError) as caught:
        load_student_config(TINY_I2V, world["infos"]["t2v"].expert_config)
    refusal(caught.value, I2V, T2V)
    assert any('"in_channels": 16' in fix and "config/student_tiny.json" in fix for fix in caught.value.fixes)


def test_the_command_refuses_a_t2v_config_with_a_banner(world, capsys):
    assert train(i2v_train_args(world, "refused_config", student_config=TINY_T2V)) == 3
    err = banner(capsys)
    assert T2V in err and I2V in err and "config/student_tiny_i2v.json" in err


def test_text_to_video_wording_stays_for_other_channel_counts(world, tmp_path):
    """A T2V teacher and a config of no known model: the message as it always was."""
    path = tmp_path / "s.json"
    path.write_text(json.dumps({"in_channels": 4, "out_channels": 16}))
    with pytest.raises(DistillError) as caught:
        load_student_config(path, world["infos"]["t2v"].expert_config)
    assert caught.value.title == "Student config does not match the teacher"
    assert caught.value.details == (
        f"{path}: `in_channels` = 4 but the teacher has in_channels = 16; the student denoises the "
        "teacher's VAE latents, so it must work in the teacher's 16-channel latent space."
    )
    assert caught.value.fixes == [
        f'Set "in_channels": 16 in {path} (or delete it to inherit the teacher\'s).'
    ]


def test_origin_num_channels_with_the_i2v_teacher_names_both_keys(world, tmp_path):
    path = tmp_path / "origin.json"
    path.write_text(json.dumps({"hidden_size": 24, "depth": 1, "num_heads": 2, "num_channels": 36}))
    with pytest.raises(DistillError) as caught:
        load_student_config(path, world["infos"]["i2v"].expert_config)
    assert any('"in_channels": 36, "out_channels": 16' in fix for fix in caught.value.fixes)


# ------------------------------------------------------------------------------------------------
# Starts: the teacher's blocks, a text-to-video student folder
# ------------------------------------------------------------------------------------------------


def conditioned_inputs(info, seed: int = 0) -> tuple[torch.Tensor, Condition, torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    noisy = torch.randn(2, 16, 2, 4, 4, generator=generator)
    condition = Condition(torch.randn(2, 20, 2, 4, 4, generator=generator))
    text = torch.randn(2, 6, info.text_dim, generator=generator)
    return noisy, condition, torch.tensor([900.0, 300.0]), text


def predict(model, hidden: torch.Tensor, t: torch.Tensor, text: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(hidden_states=hidden, timestep=t, encoder_hidden_states=text, return_dict=False)[0]


def test_teacher_init_copies_the_36_channel_patch_embedding_exactly(world):
    info = world["infos"]["i2v"]
    expert = load_expert(info, "transformer", torch.float32)
    same = build_student(
        load_student_config(info.path / "transformer" / "config.json", info.expert_config), seed=3
    )
    report = init_student_from_teacher(same, expert)
    assert report["unmapped"] == [] and same.patch_embedding.weight.shape[1] == 36
    noisy, condition, t, text = conditioned_inputs(info)
    hidden = model_input(I2V_A14B, noisy, condition)
    assert torch.equal(predict(same, hidden, t, text), predict(expert, hidden, t, text))
    # the shipped tiny student is wider: the teacher fills its leading rows, all 36 channels of them
    wider = build_student(world["configs"]["i2v"], seed=3)
    init_student_from_teacher(wider, expert)
    rows = expert.patch_embedding.weight.shape[0]
    assert torch.equal(wider.patch_embedding.weight[:rows], expert.patch_embedding.weight)


def test_a_t2v_student_folder_starts_an_i2v_student_as_exactly_that_model(world, caplog, tmp_path):
    folder, info = world["students"]["t2v"], world["infos"]["i2v"]
    t2v_model = load_pretrained_student(str(folder))
    with caplog.at_level(logging.INFO, logger="distill.models.student_kind"):
        widened = load_pretrained_student(str(folder), info.expert_config)
    assert len([r for r in caplog.records if "widened" in r.getMessage()]) == 1
    assert (widened.config.in_channels, widened.config.out_channels) == (36, 16)
    assert not widened.patch_embedding.weight[:, 16:].any()
    noisy, condition, t, text = conditioned_inputs(info)
    expected = predict(t2v_model, noisy, t, text)
    torch.testing.assert_close(predict(widened, model_input(I2V_A14B, noisy, condition), t, text), expected)
    other = Condition(condition.channels.flip(0) * 3)  # any condition: the same prediction
    torch.testing.assert_close(predict(widened, model_input(I2V_A14B, noisy, other), t, text), expected)
    # exported, it reloads as an image-to-video student of 16 outputs
    reloaded = load_pretrained_student(str(export_student(widened, tmp_path / "w")), info.expert_config)
    assert (reloaded.config.in_channels, reloaded.config.out_channels) == (36, 16)


def test_the_trainer_starts_an_i2v_student_from_a_t2v_student_folder(world):
    args = i2v_train_args(world, "from_t2v", student_config=TINY_I2V, student_init=world["students"]["t2v"])
    assert train(args) == 0
    config = json.loads((world["root"] / "from_t2v" / "student" / "config.json").read_text())
    assert (config["in_channels"], config["out_channels"]) == (36, 16)


def test_other_mismatches_of_a_t2v_folder_are_still_refused(world, tmp_path):
    info = world["infos"]["i2v"]
    for name, change, key in (
        ("text", {"text_dim": 24}, "text_dim"),
        ("out", {"out_channels": 32}, "out_channels"),
    ):
        folder = export_student(build_student({**world["configs"]["t2v"], **change}, seed=0), tmp_path / name)
        with pytest.raises(DistillError) as caught:
            load_pretrained_student(str(folder), info.expert_config)
        assert key in caught.value.details and caught.value.stage == Stage.CONFIG


def test_an_i2v_student_folder_cannot_start_a_t2v_student(world):
    with pytest.raises(DistillError) as caught:
        load_pretrained_student(str(world["students"]["i2v"]), world["infos"]["t2v"].expert_config)
    text = refusal(caught.value, I2V, T2V)
    assert "--student_init" in caught.value.title and "--student_init teacher" in text


# ------------------------------------------------------------------------------------------------
# Exported students and LoRA folders with the other model's teacher
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("student, teacher", [("t2v", "i2v"), ("i2v", "t2v")])
def test_a_full_student_samples_only_with_its_own_models_teacher(world, student, teacher):
    names = {"t2v": T2V, "i2v": I2V}
    folder, info = world["students"][student], world["infos"][teacher]
    for attempt in (
        lambda: student_limits(folder, info),
        lambda: load_student(folder, info, torch.device("cpu"), torch.float32),
    ):
        with pytest.raises(DistillError) as caught:
            attempt()
        text = refusal(caught.value, names[student], names[teacher])
        assert (
            f"--teacher_path {world['teachers'][student].resolve()}" in text
        )  # the run's own teacher, as recorded
    own = world["infos"][student]
    assert student_limits(folder, own) is not None
    assert (
        load_student(folder, own, torch.device("cpu"), torch.float32).config.in_channels
        == own.kind.in_channels
    )


def test_generate_refuses_a_t2v_student_with_the_i2v_teacher_with_a_banner(world, capsys):
    from distill import generate

    student, teacher = world["students"]["t2v"], world["teachers"]["i2v"]
    args = ["--student", str(student), "--teacher_path", str(teacher), "--prompt", "a ball"]
    assert (
        generate.main([*args, "--output", str(world["root"] / "g.png"), "--steps", "2", "--device", "cpu"])
        == 3
    )
    err = banner(capsys)
    assert T2V in err and I2V in err and f"--teacher_path {world['teachers']['t2v'].resolve()}" in err


@pytest.mark.parametrize("lora, teacher", [("t2v", "i2v"), ("i2v", "t2v")])
def test_lora_adapters_fit_only_their_own_models_teacher(world, lora, teacher):
    names = {"t2v": T2V, "i2v": I2V}
    folder, info = world["loras"][lora], world["infos"][teacher]
    for attempt in (
        lambda: lora_start(folder, SHAPE, info),  # --student_lora_init
        lambda: lora_student(folder, info),  # generate / evaluate --student
        lambda: lora_student(folder / WAN_FORMAT_DIR, info),  # the comfyui/ copy
    ):
        with pytest.raises(DistillError) as caught:
            attempt()
        text = refusal(caught.value, names[lora], names[teacher])
        assert f"--teacher_path {world['teachers'][lora].resolve()}" in text
    assert lora_start(folder, SHAPE, world["infos"][lora]).shape == SHAPE  # its own teacher: accepted


def test_the_command_refuses_t2v_adapters_on_the_i2v_teacher_with_a_banner(world, capsys):
    args = i2v_train_args(
        world,
        "refused_lora",
        student_config=None,
        student_lora_rank=SHAPE.rank,
        student_lora_alpha=SHAPE.alpha,
        student_lora_init=world["loras"]["t2v"],
    )
    assert train(args) == 3
    err = banner(capsys)
    assert T2V in err and I2V in err and "--student_lora_init" in err


def test_the_kind_a_copied_lora_folder_records_itself(world, tmp_path, caplog):
    """Copied alone (no run_settings.json, its teacher gone): the folder's own record decides, and a
    folder that records nothing is accepted with a warning (its shapes fit either model)."""
    i2v = world["infos"]["i2v"]
    alone = shutil.copytree(
        world["loras"]["t2v"], tmp_path / "alone", ignore=shutil.ignore_patterns("run_settings.json")
    )
    with caplog.at_level(logging.WARNING, logger="distill.sample.lora_fit"):
        assert lora_student(alone, i2v) is not None
    assert any("nothing records" in r.getMessage() for r in caplog.records)
    config = json.loads((alone / "adapter_config.json").read_text())
    (alone / "adapter_config.json").write_text(json.dumps({**config, "teacher_kind": T2V_A14B.name}))
    with pytest.raises(DistillError) as caught:
        lora_student(alone, i2v)
    assert "adapter_config.json: teacher_kind = t2v-a14b" in refusal(caught.value, T2V, I2V)
    # the comfyui/ format has no adapter_config.json: its files' metadata
    from safetensors.torch import load_file, save_file

    comfy = alone / WAN_FORMAT_DIR
    for name in FILES.values():
        save_file(load_file(comfy / name), comfy / name, metadata={"format": "pt", "teacher_kind": T2V})
    with pytest.raises(DistillError) as caught:
        lora_student(comfy, i2v)
    refusal(caught.value, T2V, I2V)
    # a run_settings.json whose teacher folder is gone: the stock pipeline it records
    moved = shutil.copytree(world["loras"]["i2v"], tmp_path / "moved")
    settings = json.loads((moved / "run_settings.json").read_text())
    settings["teacher_path"] = str(tmp_path / "gone")
    (moved / "run_settings.json").write_text(
        json.dumps({**settings, "pipeline_class": "WanImageToVideoPipeline"})
    )
    with pytest.raises(DistillError) as caught:
        lora_student(moved, world["infos"]["t2v"])
    assert "pipeline_class = WanImageToVideoPipeline" in refusal(caught.value, I2V, T2V)
