"""`generate --stream` (distill/sample/stream.py): a causal student exported from the tiny teacher's
high-noise expert, streamed longer than any clip it saw, and the refusals of what cannot stream."""

from __future__ import annotations

import logging
from pathlib import Path

import imageio.v2 as imageio
import numpy as np
import pytest
import torch

from distill import generate
from distill.models.causal.attention import make_causal
from distill.models.causal.layout import CausalLayout
from distill.models.few_step import few_step_scheduler
from distill.models.student import export_student
from distill.models.teacher import inspect_teacher, load_expert
from distill.models.teacher_kind import I2V_A14B
from distill.models.tiny import write_tiny_teacher
from distill.ops.errors import DistillError
from distill.sample import stream as stream_module
from distill.sample.stream import default_window, whole_chunk_counts


def export_expert(teacher: Path, folder: Path, chunk: int | None) -> Path:
    """The teacher's high-noise expert exported as a student (causal with `chunk`), with a 4-step
    scheduler beside it as a few-step student has."""
    expert = load_expert(inspect_teacher(str(teacher)), "transformer", torch.float32)
    if chunk is not None:
        make_causal(expert, chunk)
    export_student(expert, folder)
    few_step_scheduler(shift=5.0).save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def causal_student(tiny_teacher: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return export_expert(tiny_teacher, tmp_path_factory.mktemp("causal") / "student", 3)


def stream_args(student: Path, teacher: Path, output: Path, *extra: str) -> list[str]:
    return [
        *("--student", str(student), "--teacher_path", str(teacher), "--stream"),
        *("--height", "32", "--width", "32", "--steps", "2", "--prompt", "a red ball rolls right"),
        *("--output", str(output), *extra),
    ]


def test_a_causal_student_streams_a_clip_longer_than_its_rope_table_allows_whole(
    causal_student: Path, tiny_teacher: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # 33 frames = 9 latent frames = 3 chunks of 3; then 37 chunks' worth past the tiny model's 32 positions.
    with caplog.at_level(logging.INFO):
        code = generate.main(
            stream_args(causal_student, tiny_teacher, tmp_path / "new" / "ball", "--num_frames", "33")
        )
    assert code == 0
    # into a folder the stream made (`make demo-stream` writes to one that does not exist yet)
    assert imageio.get_reader(tmp_path / "new" / "ball.mp4").count_frames() == 33
    report = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("prompt 0: first"))
    assert "first 9 frames after" in report and "33 frames in 3 chunks" in report and "frames/s" in report
    assert not list(tmp_path.glob("new/.*tmp*"))  # the temporary file was renamed into place

    code = generate.main(
        stream_args(
            causal_student, tiny_teacher, tmp_path / "long", "--num_frames", "141", "--stream_window", "2"
        )
    )
    assert code == 0 and imageio.get_reader(tmp_path / "long.mp4").count_frames() == 141  # 36 latent frames


def refusal(capsys: pytest.CaptureFixture[str], argv: list[str]) -> str:
    assert generate.main(argv) in (2, 3)
    return capsys.readouterr().err


def test_what_cannot_stream_is_refused_with_the_fix(
    causal_student: Path, tiny_teacher: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "x.mp4"
    err = refusal(capsys, stream_args(causal_student, tiny_teacher, out, "--num_frames", "25"))
    assert "--num_frames 25 is not whole chunks" in err and "7 latent frames" in err
    assert "--num_frames 21, 33, 45, 57" in err

    bidirectional = export_expert(tiny_teacher, tmp_path / "bidirectional", None)
    err = refusal(capsys, stream_args(bidirectional, tiny_teacher, out, "--num_frames", "9"))
    assert "--stream needs a causal student" in err and "causal_config.json" in err and "make_causal" in err

    err = refusal(
        capsys, [*stream_args(causal_student, tiny_teacher, out, "--num_frames", "9"), "--teacher_only"]
    )
    assert "--stream needs a causal student" in err and "--teacher_only" in err

    err = refusal(
        capsys, stream_args(causal_student, tiny_teacher, out, "--num_frames", "9", "--guidance", "3")
    )
    assert "guidance 1" in err and "--guidance 1" in err

    argv = stream_args(causal_student, tiny_teacher, out, "--num_frames", "9", "--stream_window", "2")
    argv.remove("--stream")
    err = refusal(capsys, argv)
    assert "--stream_window needs --stream" in err and "add --stream" in err


def test_flags_at_their_off_value_are_not_refused(
    causal_student: Path, tiny_teacher: Path, tmp_path: Path
) -> None:
    argv = stream_args(causal_student, tiny_teacher, tmp_path / "one", "--num_frames", "9", "--guidance", "1")
    assert generate.main(argv) == 0
    assert imageio.get_reader(tmp_path / "one.mp4").count_frames() == 9


def test_window_and_frame_counts_in_words() -> None:
    three, one = CausalLayout(3), CausalLayout(1)
    assert whole_chunk_counts(three, 4, 25) == [21, 33, 45, 57]
    assert whole_chunk_counts(one, 4, 10) == [9, 13, 17, 21]
    # The trained clip's span: 81 frames = 21 latent frames = 7 chunks of 3, 6 of them past.
    assert default_window(three, 81, 4) == 6 and default_window(three, 9, 4) == 1
    assert default_window(one, 9, 4) == 2 and default_window(one, None, 4) == 3


def test_an_image_to_video_student_streams_with_its_image_in_the_first_chunk(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    teacher = write_tiny_teacher(tmp_path / "i2v_teacher", seed=0, kind=I2V_A14B)
    student = export_expert(teacher, tmp_path / "i2v_student", 1)
    image = tmp_path / "first.png"
    imageio.imwrite(image, (torch.rand(32, 32, 3) * 255).to(torch.uint8).numpy())
    argv = stream_args(student, teacher, tmp_path / "clip", "--num_frames", "13", "--image", str(image))
    assert generate.main(argv) == 0
    assert imageio.get_reader(tmp_path / "clip.mp4").count_frames() == 13


def test_open_stream_gives_each_chunk_as_it_is_made_and_refuses_what_generate_refuses(
    causal_student: Path, tiny_teacher: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The Python face of `generate --stream` (the causal model cards' code): the same flags, the
    same checks, each chunk's frames as they are made: the frames the command writes."""
    written: list[np.ndarray] = []
    add = stream_module._FrameWriter.add
    monkeypatch.setattr(
        stream_module._FrameWriter, "add", lambda self, f: (written.append(f), add(self, f))[1]
    )
    argv = stream_args(causal_student, tiny_teacher, tmp_path / "ball", "--num_frames", "33")
    assert generate.main(argv) == 0
    python = [a for a in argv if a not in ("--stream", "--output", str(tmp_path / "ball"))]
    chunks = list(generate.open_stream(python).chunks(0, seed=0))
    # chunks of 3 latent frames: 9 video frames first (1 + 4 + 4), then 12 each
    assert [len(frames) for frames in chunks] == [9, 12, 12]
    assert len(written) == 3 and all(np.array_equal(a, b) for a, b in zip(chunks, written))

    with pytest.raises(DistillError, match="--output has no place"):
        generate.open_stream([*python, "--output", str(tmp_path / "x.mp4")])
    bidirectional = export_expert(tiny_teacher, tmp_path / "bidirectional", None)
    python[python.index("--student") + 1] = str(bidirectional)
    with pytest.raises(DistillError, match="--stream needs a causal student"):
        generate.open_stream(python)


class StepClock:
    """A perf_counter that moves only when told: the time a test gives each part of a stream."""

    def __init__(self) -> None:
        self.now = 0.0

    def perf_counter(self) -> float:
        return self.now


def test_the_first_frames_arrive_when_decoded_not_when_the_file_has_them(
    causal_student: Path, tiny_teacher: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Time to first frame is the sampler's (the first chunk decoded); the writer's time (the first
    ffmpeg of a process: 0.2-0.5 s) counts in the clip's total only. The clock moves only in the writer
    here, 10 s a chunk, so the sampler's own time is 0."""
    clock = StepClock()
    monkeypatch.setattr(stream_module, "time", clock)
    add = stream_module._FrameWriter.add

    def slow_add(self, frames: np.ndarray) -> None:
        clock.now += 10.0
        add(self, frames)

    monkeypatch.setattr(stream_module._FrameWriter, "add", slow_add)
    argv = stream_args(causal_student, tiny_teacher, tmp_path / "ball", "--num_frames", "33")
    python = [a for a in argv if a not in ("--stream", "--output", str(tmp_path / "ball"))]
    opened = generate.open_stream(python)
    path, report = opened.streamer.stream(0, opened.prompts[0], 0, tmp_path / "ball")
    assert path.exists() and report.chunks == 3 and report.first_frames == 9
    assert report.time_to_first_frame == 0.0
    assert report.total == 30.0
    assert "first 9 frames after 0.00 s (0% of the clip's time)" in report.line(0)
