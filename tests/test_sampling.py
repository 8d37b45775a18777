"""Samples during training (SampleMonitor), the sampling helpers and the pipeline/ folder, on the
tiny real teacher: real models, real files, no mocks."""

import json
import warnings

import imageio.v2 as imageio
import numpy as np
import pytest
import torch
from conftest import REPO
from diffusers import WanPipeline, WanTransformer3DModel
from diffusers.training_utils import EMAModel

from distill.data.prompts import read_prompts
from distill.models.pipelines import (
    encode_prompts,
    initial_noise,
    load_scheduler,
    sample_latents,
    student_pipeline,
)
from distill.models.student import build_student
from distill.models.student_config import load_student_config
from distill.models.teacher import inspect_teacher, load_expert
from distill.models.tiny import TinyTeacherShape, write_tiny_teacher
from distill.report.monitor import (
    DEFAULT_SAMPLE_PROMPTS,
    LOSS_PLOT_MIN_SECONDS,
    SampleMonitor,
    SampleSettings,
    sampling_weights,
)
from distill.report.plots import plot_loss, read_metrics
from distill.sample.media import rank_share
from distill.sample.pipeline_folder import write_pipeline_folder
from distill.train.tracking import wandb_media

CPU = torch.device("cpu")
PROMPTS = read_prompts(DEFAULT_SAMPLE_PROMPTS)


def load_teacher(path):
    info = inspect_teacher(str(path))
    return (
        info,
        load_expert(info, "transformer", torch.float32),
        load_expert(info, "transformer_2", torch.float32),
    )


def tiny_student(info, seed=0):
    return build_student(
        load_student_config(REPO / "config" / "student_tiny.json", info.expert_config), seed=seed
    )


def load_student_config_dict(folder, info, values):
    path = folder / "student.json"
    path.write_text(json.dumps(values))
    return load_student_config(path, info.expert_config)


@pytest.fixture(scope="module")
def teacher(tiny_teacher):
    return load_teacher(tiny_teacher)


@pytest.fixture(scope="module")
def embeddings(teacher):
    return encode_prompts(teacher[0].path, [*PROMPTS, ""], 512, CPU, torch.float32)


def image_settings(**overrides):
    values = dict(save_samples=True, sample_interval=2, sample_steps=3, height=16, width=16, num_frames=1)
    values.update(overrides)
    return SampleSettings(**values)


def test_monitor_leaves_teacher_references_student_samples_and_grids(teacher, embeddings, tmp_path):
    info, high, low = teacher
    monitor = SampleMonitor(image_settings(), info, tmp_path, CPU)
    assert monitor.prompts == PROMPTS  # the held-out prompts the trainer must embed
    student = tiny_student(info).train()

    teacher_files = monitor.start(high, low, embeddings, embeddings[""])
    assert [p.name for p in teacher_files] == [f"teacher_prompt_{i:02d}.png" for i in range(4)]
    assert monitor.after_step(1, student) == []  # not a multiple of sample_interval
    step2 = monitor.after_step(2, student)
    step4 = monitor.after_step(4, student)
    assert student.training  # sampling put it back in training mode

    assert [p.name for p in step2] == [f"step_00000002_prompt_{i:02d}.png" for i in range(4)] + [
        "grid_step_00000002.png"
    ]
    names = sorted(p.name for p in (tmp_path / "samples").iterdir())
    expected = [
        f"{who}_prompt_{i:02d}.png" for who in ("step_00000002", "step_00000004", "teacher") for i in range(4)
    ]
    assert names == sorted(expected + ["grid_step_00000002.png", "grid_step_00000004.png"])
    for path in teacher_files + step4[:-1]:
        image = imageio.imread(path)
        assert image.shape == (16, 16, 3) and image.dtype == np.uint8
    grid = imageio.imread(step4[-1])
    assert grid.shape[0] > 300 and grid.shape[1] > 300  # four labelled rows of four prompts


def test_ranks_render_their_share_and_rank_0_assembles_the_grid(teacher, embeddings, tmp_path):
    info, high, low = teacher
    ranks = [SampleMonitor(image_settings(), info, tmp_path, CPU, rank=r, world_size=2) for r in (0, 1)]
    # Run rank 1 before rank 0, as a barrier would order them: rank 0 reads rank 1's files.
    negative = embeddings[""][None]  # padded (1, L, D), as the trainer holds it
    assert [p.name for p in ranks[1].start(high, low, embeddings, negative)] == [
        "teacher_prompt_01.png",
        "teacher_prompt_03.png",
    ]
    assert len(ranks[0].start(high, low, embeddings, negative)) == 4
    student = tiny_student(info)
    assert [p.name for p in ranks[1].after_step(2, student)] == [
        "step_00000002_prompt_01.png",
        "step_00000002_prompt_03.png",
    ]
    files = ranks[0].after_step(2, student)
    assert len(files) == 5 and all(p.is_file() for p in files) and files[-1].name == "grid_step_00000002.png"


def test_rank_share_pads_so_every_rank_runs_as_many_forwards():
    assert rank_share(4, 0, 2) == [(0, True), (2, True)]
    assert rank_share(3, 1, 2) == [(1, True), (2, False)]  # rank 1 repeats an item and discards it
    assert rank_share(1, 2, 3) == [(0, False)]


def test_video_run_on_another_teacher_shape_leaves_mp4s(tmp_path):
    shape = TinyTeacherShape(
        num_layers=3, num_attention_heads=4, attention_head_dim=8, ffn_dim=48, text_dim=16, boundary_ratio=0.7
    )
    info, high, low = load_teacher(write_tiny_teacher(tmp_path / "teacher", seed=3, shape=shape))
    embeddings = encode_prompts(info.path, [*PROMPTS, ""], 512, CPU, torch.float32)
    student = build_student(
        load_student_config_dict(
            tmp_path,
            info,
            {"num_layers": 1, "num_attention_heads": 2, "attention_head_dim": 8, "ffn_dim": 16},
        )
    )
    settings = image_settings(num_frames=5, height=32, width=16, sample_steps=2)
    monitor = SampleMonitor(settings, info, tmp_path / "out", CPU)
    monitor.start(high, low, embeddings, embeddings[""])
    files = monitor.after_step(2, student)
    videos = [p for p in files if p.suffix == ".mp4"]
    assert [p.name for p in videos] == [f"step_00000002_prompt_{i:02d}.mp4" for i in range(4)]
    assert len(list((tmp_path / "out" / "samples").glob("teacher_prompt_*.mp4"))) == 4
    reader = imageio.get_reader(videos[0])
    assert reader.count_frames() == 5 and reader.get_data(0).shape == (32, 16, 3)
    assert files[-1].suffix == ".png"  # the grid shows a strip of frames per clip
    assert files[-2].name == "grid_step_00000002.gif"  # and one GIF plays teacher above student
    media = wandb_media(files)
    assert sorted(media) == ["samples/grid", "samples/grid_clips"] + [
        f"samples/prompt_{i:02d}" for i in range(4)
    ]
    assert type(media["samples/grid_clips"]).__name__ == "Video"
    assert type(media["samples/prompt_00"]).__name__ == "Video"


def test_sampling_uses_ema_weights_and_restores_the_student(teacher):
    info = teacher[0]
    student, other = tiny_student(info, seed=0).train(), tiny_student(info, seed=1)
    before = {k: v.clone() for k, v in student.state_dict().items()}
    ema = EMAModel(list(other.parameters()), decay=0.9)  # its shadow weights are `other`'s
    with sampling_weights(student, ema) as model:
        assert not model.training
        assert all(torch.equal(a, b) for a, b in zip(model.parameters(), other.parameters()))
    assert student.training
    assert all(torch.equal(before[k], v) for k, v in student.state_dict().items())


def test_initial_noise_is_what_wan_pipeline_draws_from_the_seed(teacher, embeddings):
    info = teacher[0]
    student = tiny_student(info).eval()
    pipe = student_pipeline(student, load_scheduler(info.path))
    shape = info.latent_shape(16, 16, 1)
    ours = sample_latents(pipe, initial_noise(shape, 7), embeddings[PROMPTS[0]], None, 2, 1.0)
    theirs = pipe(
        prompt_embeds=embeddings[PROMPTS[0]][None],
        height=16,
        width=16,
        num_frames=1,
        num_inference_steps=2,
        guidance_scale=1.0,
        generator=torch.Generator("cpu").manual_seed(7),
        output_type="latent",
    ).frames[0]
    assert torch.equal(ours, theirs)


def test_pipeline_folder_borrows_the_teacher_components_and_generates(tiny_teacher, teacher, tmp_path):
    info = teacher[0]
    student_dir = tmp_path / "run" / "student"
    tiny_student(info).save_pretrained(student_dir)
    folder = write_pipeline_folder(tmp_path / "run", tiny_teacher, student_dir)
    assert folder == tmp_path / "run" / "pipeline"
    assert sorted(p.name for p in folder.iterdir() if p.is_symlink()) == [
        "scheduler",
        "text_encoder",
        "tokenizer",
        "transformer",
        "vae",
    ]
    assert [p.name for p in folder.iterdir() if not p.is_symlink()] == ["model_index.json"]  # nothing copied

    pipe = WanPipeline.from_pretrained(folder)
    assert pipe.transformer_2 is None and pipe.config.boundary_ratio is None
    assert pipe.transformer.config.num_layers == WanTransformer3DModel.load_config(student_dir)["num_layers"]
    pipe.set_progress_bar_config(disable=True)
    frames = pipe(
        prompt="a red cube", height=16, width=16, num_frames=1, num_inference_steps=2, guidance_scale=1.0
    ).frames
    assert frames.shape == (1, 1, 16, 16, 3)

    moved = tmp_path / "moved"
    (tmp_path / "run").rename(moved)  # the student link is relative: the run folder can move
    assert WanPipeline.from_pretrained(moved / "pipeline").transformer is not None


def test_loss_plot_from_metrics_file(teacher, tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    rows = [
        {"step": s, "loss": 1 / s, "loss_high_noise": 2 / s, "loss_low_noise": 0.5 / s}
        for s in range(10, 101, 10)
    ]
    rows.append({"step": 100, "eval/denoiser_mse": 0.5})  # another kind of row at a logged step
    rows.append({"step": 20, "loss": 0.04})  # step 20 logged again after a resume
    lines = [json.dumps(r) for r in rows] + ['{"step": 11']  # the last line is still being written
    metrics.write_text("\n".join(lines))
    merged = read_metrics(metrics)
    assert [r["step"] for r in merged] == list(range(10, 101, 10))
    assert merged[1]["loss"] == 0.04 and merged[-1]["loss"] == 0.01 and merged[-1]["eval/denoiser_mse"] == 0.5

    monitor = SampleMonitor(image_settings(save_samples=False), teacher[0], tmp_path, CPU)
    # Within 10 s of the monitor's start nothing is drawn (a short run draws once, at its end)...
    assert monitor.plot_loss(metrics, tmp_path / "loss.png") is None and not (tmp_path / "loss.png").exists()
    out = monitor.plot_loss(metrics, tmp_path / "loss.png", force=True)  # ...unless forced (the end)
    assert out == tmp_path / "loss.png" and imageio.imread(out).shape[2] in (3, 4)
    assert monitor.plot_loss(metrics, out) is None  # redrawn at most every 10 s
    monitor._last_loss_plot -= LOSS_PLOT_MIN_SECONDS  # as if 10 s had passed
    assert monitor.plot_loss(metrics, out) == out
    rank1 = SampleMonitor(image_settings(), teacher[0], tmp_path, CPU, rank=1, world_size=2)
    assert rank1.plot_loss(metrics, tmp_path / "x.png", force=True) is None


def test_a_loss_plot_with_no_finite_loss_says_so_without_a_warning(tmp_path):
    """A run whose every step was skipped logs null losses: loss.png says there is nothing to draw
    (matplotlib warned of a legend with no entries, after the run's failure banner)."""
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text("\n".join(json.dumps({"step": s, "loss": None, "grad_norm": None}) for s in (1, 2)))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = plot_loss(metrics, tmp_path / "loss.png")
    assert out == tmp_path / "loss.png" and imageio.imread(out).shape[2] in (3, 4)


@pytest.mark.parametrize("run", ["velocity", "dmd clips"])
def test_the_loss_plot_keeps_its_labels_on_the_page_and_its_legend_off_the_curves(run, tmp_path, monkeypatch):
    """loss.png is drawn at fixed margins (no measuring draw): every label fits them, the long
    left-axis label beside the log scale's minor tick labels too, and the legend sits below the step
    axis, where it covers neither the curves nor the clip runs' motion-ratio axis."""
    import distill.report.plots as plots

    rows = [
        {"step": s, "loss": 1 / (1 + s / 300), "loss_high_noise": 1.2 / (1 + s / 300)}
        | {"loss_low_noise": 0.8 / (1 + s / 300), "grad_norm": 1.0}
        | ({"critic_loss": 0.1, "latent_motion_ratio": 0.5 + s / 600} if run == "dmd clips" else {})
        for s in range(10, 310, 10)
    ]
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text("\n".join(json.dumps(row) for row in rows))
    saved = []

    def measure_then_save(fig, out_png, **kwargs):
        fig.canvas.draw()
        renderer = fig.canvas.get_renderer()
        # What is drawn (tick labels in view, axis labels, title, legend), in inches, against the page.
        drawn, (width, height) = fig.get_tightbbox(renderer), fig.get_size_inches()
        saved.append(
            {
                "on_page": drawn.x0 >= 0 and drawn.y0 >= 0 and drawn.x1 <= width and drawn.y1 <= height,
                "axes": [ax.get_window_extent(renderer) for ax in fig.axes],
                "legends": [leg.get_window_extent(renderer) for ax in fig.axes if (leg := ax.get_legend())],
                "entries": [
                    t.get_text() for ax in fig.axes if (leg := ax.get_legend()) for t in leg.get_texts()
                ],
            }
        )
        return real_save(fig, out_png, **kwargs)

    real_save = plots.save_figure
    monkeypatch.setattr(plots, "save_figure", measure_then_save)
    plot_loss(metrics, tmp_path / "loss.png")
    (found,) = saved
    assert found["on_page"]
    (legend,) = found["legends"]  # one legend for both axes
    assert not any(legend.overlaps(axes) for axes in found["axes"])
    expected = {"total", "high-noise range (transformer)", "low-noise range (transformer_2)"}
    if run == "dmd clips":
        expected |= {"critic (dmd)", "latent motion ratio"}
    assert set(found["entries"]) == expected


def test_bad_settings_and_missing_prompt_file_are_config_errors(teacher, tmp_path, monkeypatch):
    from distill.ops.errors import DistillError, Stage

    with pytest.raises(DistillError, match="--sample_interval must be a positive integer") as bad:
        SampleMonitor(image_settings(sample_interval=0), teacher[0], tmp_path, CPU)
    assert bad.value.stage == Stage.CONFIG
    with pytest.raises(DistillError, match="--eval_prompts .*nope.txt: file not found"):
        SampleMonitor(image_settings(eval_prompts=str(tmp_path / "nope.txt")), teacher[0], tmp_path, CPU)
    # the documented default also resolves when the run starts in another folder
    monkeypatch.chdir(tmp_path)
    assert (
        SampleMonitor(
            image_settings(sample_prompts="data/sample_prompts.txt"), teacher[0], tmp_path, CPU
        ).prompts
        == PROMPTS
    )
