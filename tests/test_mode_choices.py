"""A mode or a pairing is never chosen silently (issue 49, class 3): an image column no record fills,
images in the sample prompts of a text-mode run, fields of a paired file that nothing reads, a
TI2V-5B image-mode run of one frame (nothing to learn) and a second guidance scale for a teacher
with one transformer are refused (or, for harmless fields, named) before anything heavy, and the
first fix each banner gives is then accepted."""

from __future__ import annotations

import csv
import json
import logging
import re
from pathlib import Path

import pytest
from conftest import REPO, train_args
from test_i2v_training import PROMPTS, write_pairs

from distill import evaluate, generate
from distill.config.cli import parse_config
from distill.models.teacher_kind import TI2V_5B
from distill.models.tiny import write_tiny_teacher
from distill.train.trainer import Distiller
from train_distillation import main

pytestmark = pytest.mark.usefixtures("one_thread")

STUDENT = REPO / "config" / "student_tiny_ti2v.json"


@pytest.fixture(scope="module")
def ti2v(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("mode_choices")
    (root / "prompts.txt").write_text("\n".join(PROMPTS) + "\n")
    return {
        "teacher": write_tiny_teacher(root / "teacher", seed=0, kind=TI2V_5B),
        "pairs": write_pairs(root / "data", size=32),
        "prompts": root / "prompts.txt",
    }


def tt(ti2v: dict[str, Path], tmp_path: Path, data: Path, **overrides: object) -> list[str]:
    """The issue's `TT`: the tiny TI2V teacher at 32x32x5, guidance 5."""
    settings: dict[str, object] = dict(
        student_config=STUDENT, data_path=data, height=32, width=32, num_frames=5, guidance_scale=5.0
    )
    return train_args(ti2v["teacher"], tmp_path / "out", tmp_path / "cache", **{**settings, **overrides})


def refused(capsys: pytest.CaptureFixture[str], code: int, run, args: list[str]) -> tuple[str, str]:
    """(banner, its first fix) of a command that must stop with `code`."""
    assert run([str(a) for a in args]) == code
    err = capsys.readouterr().err
    assert "Traceback" not in err and "ERROR (" in err
    return err, re.search(r"How to fix:\n\s+1\. (.*)", err).group(1)


def accepted(args: list[str]) -> Distiller:
    """Every check a run makes before anything heavy passes (the teacher's configs, the data, the
    samples' prompts, the sizes)."""
    return Distiller(parse_config([str(a) for a in args]))


# ---------------------------------------------------------------------------------------------
# The mode of a TI2V-5B run
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("suffix", [".csv", ".jsonl"])
def test_an_image_column_no_prompt_fills_is_refused_and_without_it_the_run_is_text_mode(
    ti2v, tmp_path, capsys, suffix
):
    data = tmp_path / f"data{suffix}"
    if suffix == ".csv":
        with data.open("w", newline="") as handle:
            csv.writer(handle).writerows([("prompt", "image"), *((p, "") for p in PROMPTS)])
    else:
        data.write_text("".join(json.dumps({"prompt": p, "image": None}) + "\n" for p in PROMPTS))
    err, fix = refused(capsys, 6, main, tt(ti2v, tmp_path, data))
    assert f"--data_path {data} has an 'image' field that none of its 4 prompt(s) fills" in err
    assert "distilled as text to video" in err and "give every line its image" in err
    assert (
        fix == f"to distil text to video, remove the image field from {data} (or pass its prompts as a .txt)"
    )
    assert not (tmp_path / "cache").exists() and not (tmp_path / "out").exists()
    if suffix == ".csv":  # the fix
        data.write_text("prompt\n" + "\n".join(PROMPTS) + "\n")
    else:
        data.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    run = accepted(tt(ti2v, tmp_path, data))
    assert [s.prompt for s in run.samples] == list(PROMPTS) and run.samples[0].image is None


def test_images_in_the_sample_prompts_of_a_ti2v_text_mode_run_are_refused(ti2v, tmp_path, capsys):
    args = tt(ti2v, tmp_path, ti2v["prompts"], save_samples=True, sample_prompts=ti2v["pairs"])
    err, fix = refused(capsys, 3, main, args)
    assert f"--sample_prompts {ti2v['pairs']} pairs prompts with images (4 record(s)" in err
    assert (
        f"this run distils Wan2.2-TI2V-5B in text mode: its --data_path {ti2v['prompts']} pairs no images"
        in err
    )
    assert fix.startswith("pass a --sample_prompts without images (a .txt of prompts")
    assert "pair every prompt of --data_path with its image" in err
    text = tmp_path / "samples.txt"
    text.write_text("a red square moving left\n")
    run = accepted(tt(ti2v, tmp_path, ti2v["prompts"], save_samples=True, sample_prompts=text))
    assert run.monitor.samples.prompts == ["a red square moving left"] and run.monitor.samples.images is None


def test_images_in_the_eval_prompts_of_a_t2v_run_are_refused(tiny_teacher, ti2v, tmp_path, capsys):
    common = dict(eval_interval=2, eval_num_buckets=1, eval_samples_per_bucket=1)
    args = train_args(
        tiny_teacher, tmp_path / "out", tmp_path / "cache", eval_prompts=ti2v["pairs"], **common
    )
    err, fix = refused(capsys, 3, main, args)
    assert f"--eval_prompts {ti2v['pairs']} pairs prompts with images" in err
    assert "the teacher is Wan2.2-T2V-A14B, which generates from text only" in err
    assert fix.startswith("pass a --eval_prompts without images")
    text = tmp_path / "evals.txt"
    text.write_text("a red square moving left\n")
    accepted(train_args(tiny_teacher, tmp_path / "out", tmp_path / "cache", eval_prompts=text, **common))


def test_one_frame_in_image_mode_is_refused_and_five_frames_train(ti2v, tmp_path, capsys):
    err, fix = refused(capsys, 3, main, tt(ti2v, tmp_path, ti2v["pairs"], num_frames=1))
    assert "--num_frames 1 leaves nothing to learn: Wan2.2-TI2V-5B in image mode" in err
    assert "the image is latent frame 0" in err and "every loss would be 0" in err
    assert fix.startswith("use --num_frames 5 (or more, 4k+1)")
    assert not (tmp_path / "cache").exists() and not (tmp_path / "out").exists()
    assert accepted(tt(ti2v, tmp_path, ti2v["pairs"], num_frames=5)).samples[0].image is not None
    # text mode makes every frame itself: one frame (a picture) is a run with something to learn
    accepted(tt(ti2v, tmp_path, ti2v["prompts"], num_frames=1))


# ---------------------------------------------------------------------------------------------
# Fields of a paired file that nothing reads
# ---------------------------------------------------------------------------------------------


def with_fields(pairs: Path, folder: Path, **fields: object) -> Path:
    """`pairs` with `fields` added to every record, beside its images (paths stay valid)."""
    rows = [{**json.loads(line), **fields} for line in pairs.read_text().splitlines()]
    path = pairs.parent / f"{folder.name}-{'-'.join(fields)}.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


@pytest.mark.parametrize(
    "field, value, words",
    [
        ("negative_prompt", "blurry", "--negative_prompt"),
        ("last_image", "images/1.png", "take no last frame"),
    ],
)
def test_a_field_that_would_change_a_sample_is_refused_by_every_reader(
    ti2v, tmp_path, capsys, field, value, words
):
    data = with_fields(ti2v["pairs"], tmp_path, **{field: value})
    err, fix = refused(capsys, 6, main, tt(ti2v, tmp_path, data))
    assert (
        f"--data_path {data}: line 1 has a '{field}' field, which this project cannot apply per prompt" in err
    )
    assert words in err and fix.startswith(f"remove the '{field}' field from {data}")
    assert not (tmp_path / "cache").exists()
    # the same reader for generate's prompts file
    render = ["--teacher_only", "--teacher_path", ti2v["teacher"], "--prompts_file", data]
    err, _ = refused(capsys, 6, generate.main, [*render, "--output", tmp_path / "g"])
    assert f"--prompts_file {data}: line 1 has a '{field}' field" in err
    accepted(tt(ti2v, tmp_path, ti2v["pairs"]))  # the fix: the file without it


def test_fields_nothing_reads_are_named_once_and_the_run_goes_on(ti2v, tmp_path, caplog):
    data = with_fields(ti2v["pairs"], tmp_path, seed=7, fps=16)
    with caplog.at_level(logging.WARNING, logger="distill.data.record_fields"):
        run = accepted(tt(ti2v, tmp_path, data))
    said = [r.getMessage() for r in caplog.records if r.name == "distill.data.record_fields"]
    assert len(said) == 1, said  # the file is read several times, named once
    assert (
        f"--data_path {data}: field(s) 'seed', 'fps' are not read and are ignored (first at line 1)"
        in said[0]
    )
    assert "--seed" in said[0] and "--num_frames" in said[0]
    assert len(run.samples) == 4 and run.samples[0].image is not None


# ---------------------------------------------------------------------------------------------
# A second guidance scale for the one transformer: one rule in training, generate and evaluate
# ---------------------------------------------------------------------------------------------


def test_a_second_guidance_for_one_transformer_is_refused_alike_by_every_command(ti2v, tmp_path, capsys):
    needs = "needs a teacher with two experts, and Wan2.2-TI2V-5B has one transformer"
    # training: 3 is the trainer's default for an A14B low-noise expert, and still asked for here
    err, fix = refused(capsys, 3, main, tt(ti2v, tmp_path, ti2v["pairs"], guidance_scale_2=3))
    assert f"--guidance_scale_2 {needs}" in err and fix == "drop --guidance_scale_2"
    config = tmp_path / "run.yaml"
    config.write_text("guidance_scale_2: 3.0\n")
    err, fix = refused(capsys, 3, main, [*tt(ti2v, tmp_path, ti2v["pairs"]), "--config", config])
    assert f"'guidance_scale_2' in {config} {needs}" in err and fix == f"drop 'guidance_scale_2' in {config}"
    accepted(tt(ti2v, tmp_path, ti2v["pairs"]))  # dropped
    accepted(tt(ti2v, tmp_path, ti2v["pairs"], guidance_scale_2=1))  # 1: no guidance, asks for nothing
    # generate, the teacher alone
    render = ["--teacher_only", "--teacher_path", ti2v["teacher"], "--prompt", PROMPTS[0], "--height", "32",
              "--width", "32", "--num_frames", "5", "--steps", "1", "--output", tmp_path / "g.mp4"]  # fmt: skip
    err, fix = refused(capsys, 2, generate.main, [*render, "--guidance_2", "3"])
    assert (
        f"--guidance_2 {needs}" in err and "guided by --guidance alone" in err and fix == "drop --guidance_2"
    )
    assert generate.main([str(a) for a in render]) == 0 and (tmp_path / "g.mp4").is_file()
    # evaluate, with a student of the teacher's shape
    from diffusers import WanTransformer3DModel

    shape = {k: v for k, v in json.loads(STUDENT.read_text()).items() if not k.startswith("_")}
    WanTransformer3DModel(**shape).save_pretrained(tmp_path / "student")
    judge = ["--student", tmp_path / "student", "--teacher_path", ti2v["teacher"], "--prompts", ti2v["prompts"],
             "--output_dir", tmp_path / "e", "--guidance_scale_2", "3"]  # fmt: skip
    err, fix = refused(capsys, 2, evaluate.main, judge)
    assert f"--guidance_scale_2 {needs}" in err and fix == "drop --guidance_scale_2"
