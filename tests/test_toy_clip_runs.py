"""A run on the moving toy world's clips: what a user watches (motion metric in metrics.jsonl and
loss.png, frame strips and a GIF in the samples, eval.json's motion figures, toy_clips.gif)."""

from __future__ import annotations

import json

import pytest
from conftest import REPO, train_args
from PIL import Image

from distill.config.cli import parse_config
from distill.evaluate import main as evaluate_main
from distill.toy.evaluation import eval_prompts
from distill.toy.world import CLIP_ATTRIBUTES, CLIP_FRAMES
from distill.train.trainer import Distiller

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def clip_run(toy_teacher, tmp_path_factory):
    out = tmp_path_factory.mktemp("clip_run")
    prompts = out / "prompts.txt"
    prompts.write_text("\n".join(eval_prompts(9, clips=True)) + "\n")
    shown = out / "shown.txt"  # two of the README's clip sample prompts
    shown.write_text(
        "".join((REPO / "data" / "toy_video_sample_prompts.txt").read_text().splitlines(True)[1:3])
    )
    args = train_args(
        toy_teacher,
        out / "run",
        out / "cache",
        method="dmd",
        student_config=REPO / "config" / "student_toy_3layer.json",
        student_init=REPO / "assets" / "toy_student_stage1",
        data_path=prompts,
        max_prompts=None,
        height=32,
        width=32,
        num_frames=CLIP_FRAMES,
        teacher_sample_steps=4,
        # One student step: every critic update sees the student's final samples, the only ones the
        # motion ratio counts (an earlier step's estimate is a blurred mean).
        student_steps=1,
        critic_updates=2,
        batch_size=3,
        num_steps=4,
        log_every=2,
        save_samples=True,
        sample_interval=4,
        sample_steps=4,
        sample_prompts=shown,
    )
    Distiller(parse_config(args)).run()
    return out / "run"


def test_a_clip_run_logs_its_motion_and_writes_clips_people_can_watch(clip_run):
    rows = [json.loads(line) for line in (clip_run / "metrics.jsonl").read_text().splitlines()]
    ratios = [row["latent_motion_ratio"] for row in rows if "latent_motion_ratio" in row]
    assert len(ratios) == 2 and all(r > 0 for r in ratios), rows
    samples = clip_run / "samples"
    assert sorted(p.name for p in samples.glob("*.mp4"))[:1] == ["step_00000004_prompt_00.mp4"]
    gif = Image.open(samples / "grid_step_00000004.gif")
    assert gif.n_frames == CLIP_FRAMES
    # The strip grid (4 rows x 2 prompts): square tiles would make it about twice as tall as wide;
    # strips of 5 frames make it wider than tall.
    grid = Image.open(samples / "grid_step_00000004.png")
    assert grid.width > grid.height
    assert (clip_run / "loss.png").is_file()


def test_evaluate_scores_motion_on_a_clip_student(toy_teacher, clip_run, tmp_path):
    code = evaluate_main(
        [
            "--student",
            str(clip_run / "student"),
            "--teacher_path",
            str(toy_teacher),
            "--prompts",
            str(REPO / "data" / "toy_video_sample_prompts.txt"),
            "--output_dir",
            str(tmp_path),
            "--max_prompts",
            "1",
            "--num_buckets",
            "2",
            "--toy_prompts",
            "9",
        ]
    )
    assert code == 0
    toy = json.loads((tmp_path / "eval.json").read_text())["toy"]
    assert toy["num_frames"] == CLIP_FRAMES and toy["prompts"] == 9
    for name in ("teacher", "teacher_at_student_steps", "student"):
        entry = toy[name]
        assert set(entry["per_attribute"]) == set(CLIP_ATTRIBUTES)
        assert entry["motion_ratio"] is None or entry["motion_ratio"] >= 0.0
        assert 0.0 <= entry["identity"] <= 1.0 and 0.0 <= entry["still_leak"] <= 1.0
    assert toy["chance"]["all"] < 1 / 1900  # the clip world: 1,944 prompts
    assert Image.open(tmp_path / "toy_clips.gif").n_frames == CLIP_FRAMES
    assert (tmp_path / "toy_clips.png").is_file() and (tmp_path / "eval.png").is_file()
