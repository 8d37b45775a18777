"""A teacher that samples NaN stops the run at caching, naming the expert; a run that learned
nothing does not exit 0."""

from __future__ import annotations

import json
import shutil
import struct

from conftest import train_args

from train_distillation import main


def poison(weights_file) -> None:
    """0xFF bytes (NaN in every float format) over the middle of the tensor data, same file size."""
    data = bytearray(weights_file.read_bytes())
    header = 8 + struct.unpack("<Q", data[:8])[0]
    middle = header + (len(data) - header) // 2
    data[header:middle] = b"\xff" * (middle - header)
    weights_file.write_bytes(bytes(data))


def test_a_teacher_expert_that_samples_nan_stops_the_run_at_caching_naming_it(tiny_teacher, tmp_path, capsys):
    teacher = tmp_path / "teacher"
    shutil.copytree(tiny_teacher, teacher)
    (weights,) = (teacher / "transformer_2").glob("*.safetensors")
    poison(weights)
    code = main(train_args(teacher, tmp_path / "out", tmp_path / "cache", teacher_sample_steps=4))
    err = capsys.readouterr().err
    assert code == 5 and "Traceback" not in err
    assert "the teacher's low-noise expert (transformer_2/) produced non-finite values" in err
    assert not any((tmp_path / "cache" / "latents").glob("*/*.safetensors"))  # no NaN latent was cached
    assert not (tmp_path / "out" / "student").exists()


def test_a_run_whose_every_step_was_skipped_fails_and_exports_nothing(
    tiny_teacher, shared_cache, tmp_path, monkeypatch, capsys
):
    monkeypatch.setenv("DISTILL_INJECT_FAULT", ",".join(f"nan:{step}" for step in range(1, 5)))
    code = main(train_args(tiny_teacher, tmp_path / "out", shared_cache, num_steps=4, max_bad_steps=10))
    err = capsys.readouterr().err
    assert code == 8 and "every step of this run was skipped: 4 step(s)" in err
    assert not (tmp_path / "out" / "student").exists()
    rows = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    assert [row["loss"] for row in rows] == [None] * 4


def test_ctrl_c_while_the_teacher_samples_keeps_the_finished_entries_and_exits_75(tiny_teacher, tmp_path):
    import os
    import signal
    import subprocess
    import sys

    from conftest import REPO, repo_pythonpath

    args = train_args(tiny_teacher, tmp_path / "out", tmp_path / "cache", teacher_sample_steps=400)
    proc = subprocess.Popen(
        [sys.executable, str(REPO / "train_distillation.py"), *args],
        env={**os.environ, "PYTHONPATH": repo_pythonpath(), "PYTHONUNBUFFERED": "1"},
        stderr=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        text=True,
        # A shell's background job (CI, nohup) starts with SIGINT ignored, and Python then installs
        # no KeyboardInterrupt handler: give the child the terminal's default, as a user's run has.
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    seen = []
    for line in proc.stderr:
        seen.append(line)
        if "sampling 8 clean latent(s)" in line:
            proc.send_signal(signal.SIGINT)
            break
    rest = proc.stderr.read()
    assert proc.wait(timeout=120) == 75, "".join(seen) + rest
    assert "interrupted during data: what was finished is kept" in rest and "Traceback" not in rest
