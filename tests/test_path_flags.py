"""Every path flag of every command, given a path of the wrong kind, is refused before any work.

A file where a folder goes, a folder where a file goes, a path through a file, a missing input: each
ends with the command's config exit code (prompt files of the trainer: its data code, as documented)
and one banner whose title names the flag, no traceback, and not a byte changed in the folder the
user pointed at, including an earlier run's checkpoints and caches. Each command's main runs in
this process (nothing here loads a model: the checks come first), so the whole file takes seconds.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from conftest import train_args

import download_wan
import train_distillation
from distill import demo, doctor, evaluate, generate, gpu_check, stress
from distill.bench import cli as bench
from distill.ops.errors import DistillError
from distill.ops.paths import Kind, PathFlag, check_paths
from distill.toy import build, stage_one

KEPT = b"an earlier run's file: must survive a refused command\n"


@pytest.fixture
def place(tmp_path: Path) -> Path:
    """A folder as a user's might look: a stray file, a folder of prompts, an earlier run with a
    checkpoint and a cache, a folder with a file where a default cache would go, a student folder."""
    (tmp_path / "afile").write_bytes(KEPT)
    (tmp_path / "prompts").mkdir()
    (tmp_path / "prompts" / "mine.txt").write_text("a red fox\n")
    step = tmp_path / "run" / "checkpoints" / "step_00000002"
    step.mkdir(parents=True)
    (step / "student.safetensors").write_bytes(KEPT)
    (tmp_path / "run" / "cache" / "embeddings").mkdir(parents=True)
    (tmp_path / "run" / "cache" / "embeddings" / "0001.pt").write_bytes(KEPT)
    (tmp_path / "old").mkdir()
    (tmp_path / "old" / "cache").write_bytes(KEPT)  # where the default --cache_dir would go
    (tmp_path / "student").mkdir()
    (tmp_path / "student" / "config.json").write_text("{}")
    return tmp_path


def snapshot(folder: Path) -> dict[str, str]:
    """Every entry under `folder` with a digest of its bytes (folders: "dir")."""
    return {
        str(p.relative_to(folder)): "dir" if p.is_dir() else hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
    }


def train(tmp: Path, **flags: object) -> int:
    # A teacher that is never there: the path checks must refuse before the teacher is read.
    where = {"output_dir": tmp / "run", "cache_dir": tmp / "run" / "cache"}
    where |= {k: flags.pop(k) for k in list(where) if k in flags}
    return train_distillation.main(
        train_args(tmp / "no-teacher", where["output_dir"], where["cache_dir"], **flags)
    )


def lora(tmp: Path, **flags: object) -> int:
    return train(tmp, method="dmd", student_config=None, student_init=None, student_lora_rank=4, **flags)


def exits(command: Callable[[list[str]], object], *argv: object) -> Callable[[Path], int]:
    """A command whose main returns its exit code or raises SystemExit with it."""

    def run(tmp: Path) -> int:
        try:
            code = command([str(a).replace("TMP", str(tmp)) for a in argv])
        except SystemExit as stop:
            code = stop.code
        return int(code or 0)

    return run


@dataclass(frozen=True)
class Case:
    id: str
    run: Callable[[Path], int]
    flag: str
    code: int = 3


A = "TMP/afile"  # a file
UNDER = "TMP/afile/inside"  # a path through a file
NOWHERE = "TMP/nowhere/x"  # missing
PROMPTS = "TMP/prompts/mine.txt"


def gen(*argv: str) -> Callable[[Path], int]:
    return exits(generate.main, *argv, *([] if "--student" in argv else ["--student", "TMP/student"]))


def ev(*argv: str) -> Callable[[Path], int]:
    defaults = {"--student": "TMP/student", "--prompts": PROMPTS, "--output_dir": "TMP/e"}
    given = dict(zip(argv[::2], argv[1::2]))
    return exits(evaluate.main, *(item for pair in {**defaults, **given}.items() for item in pair))


def t(**flags: object) -> Callable[[Path], int]:
    """The trainer with `flags`, each value a path under the test's folder (a str with TMP)."""
    return lambda tmp: train(
        tmp, **{k: v.replace("TMP", str(tmp)) if isinstance(v, str) else v for k, v in flags.items()}
    )


CASES = [
    # train_distillation.py
    Case("train-output_dir-file", t(output_dir=A), "--output_dir"),
    Case("train-output_dir-under-file", t(output_dir=UNDER), "--output_dir"),
    Case("train-cache_dir-file", t(cache_dir=A), "--cache_dir"),
    Case("train-cache_dir-under-file", t(cache_dir=UNDER), "--cache_dir"),
    Case("train-cache_dir-file-dry-run", t(cache_dir=A, dry_run=True), "--cache_dir"),
    Case("train-default-cache_dir-file", t(output_dir="TMP/old", cache_dir=None), "--cache_dir"),
    Case("train-sample_dir-file", t(sample_dir=A), "--sample_dir"),
    Case("train-config-folder", t(config="TMP/prompts"), "--config"),
    Case("train-config-missing", t(config="TMP/run.yaml"), "--config"),
    Case("train-teacher_path-file", t(teacher_path=A), "--teacher_path"),
    Case("train-student_config-missing", t(student_config="TMP/s.json"), "--student_config"),
    Case("train-student_config-under-file", t(student_config=UNDER), "--student_config"),
    Case("train-critic_config-missing", t(method="dmd", critic_config=NOWHERE), "--critic_config"),
    Case("train-data_path-missing", t(data_path="TMP/p.txt"), "--data_path", 6),
    Case("train-data_path-under-file", t(data_path=UNDER), "--data_path", 6),
    Case("train-sample_prompts-folder", t(sample_prompts="TMP/prompts"), "--sample_prompts"),
    Case("train-eval_prompts-under-file", t(eval_prompts=UNDER), "--eval_prompts"),
    Case("train-student_init-file", t(student_init=A), "--student_init"),
    Case("train-critic_init-file", t(method="dmd", critic_init=A), "--critic_init"),
    Case(
        "train-student_lora_init-file",
        lambda tmp: lora(tmp, student_lora_init=tmp / "afile"),
        "--student_lora_init",
    ),
    # python -m distill.generate
    Case("generate-student-file", gen("--student", A, "--prompt", "a", "--output", "TMP/g.png"), "--student"),
    Case(
        "generate-teacher-file",
        gen("--teacher_path", A, "--prompt", "a", "--output", "TMP/g.png"),
        "--teacher_path",
    ),
    Case(
        "generate-prompts_file-under-file",
        gen("--prompts_file", UNDER, "--output", "TMP/g"),
        "--prompts_file",
    ),
    Case(
        "generate-prompts_file-missing", gen("--prompts_file", NOWHERE, "--output", "TMP/g"), "--prompts_file"
    ),
    Case("generate-output-under-file", gen("--prompt", "a", "--output", UNDER + ".png"), "--output"),
    # python -m distill.evaluate
    Case("evaluate-student-file", ev("--student", A), "--student"),
    Case("evaluate-teacher-file", ev("--teacher_path", A), "--teacher_path"),
    Case("evaluate-prompts-under-file", ev("--prompts", UNDER), "--prompts"),
    Case("evaluate-prompts-missing", ev("--prompts", NOWHERE), "--prompts"),
    Case("evaluate-output_dir-file", ev("--output_dir", A), "--output_dir"),
    Case("evaluate-output_dir-under-file", ev("--output_dir", UNDER), "--output_dir"),
    # python -m distill.demo
    Case("demo-prompts-folder", exits(demo.main, "TMP/eval", "--prompts", "TMP/prompts"), "--prompts"),
    Case("demo-output-under-file", exits(demo.main, "TMP/eval", "--output", UNDER + ".png"), "--output"),
    Case("demo-output-folder", exits(demo.main, "TMP/eval", "--output", "TMP/prompts"), "--output"),
    # python -m distill.bench (refused before the benchmark runs)
    Case("bench-json-folder", exits(bench.main, "--preset", "cpu-tiny", "--json", "TMP/prompts"), "--json"),
    Case("bench-json-under-file", exits(bench.main, "--preset", "cpu-tiny", "--json", UNDER), "--json"),
    # python -m distill.toy.build and distill.toy.stage_one
    Case("toy-build-output-file", exits(build.main, "--retrain", "--output", A), "--output"),
    Case("toy-build-from-missing", exits(build.main, "--retrain", "--from", NOWHERE), "--from"),
    Case("toy-build-vae_from-file", exits(build.main, "--retrain", "--vae_from", A), "--vae_from"),
    Case("toy-stage_one-work_dir-file", exits(stage_one.main, "--retrain", "--work_dir", A), "--work_dir"),
    Case(
        "toy-stage_one-output-under-file", exits(stage_one.main, "--retrain", "--output", UNDER), "--output"
    ),
    # the tools
    Case("stress-workdir-file", exits(stress.main, "--runs", "1", "--workdir", A), "--workdir"),
    Case("doctor-teacher-file", exits(doctor.main, "--teacher_path", A), "--teacher_path"),
    Case("gpu_check-output_dir-file", exits(gpu_check.main, "--output_dir", A), "--output_dir"),
    # download_wan.py
    Case("download-tiny-file", exits(download_wan.main, "--tiny", A), "--tiny"),
    Case("download-toy-under-file", exits(download_wan.main, "--toy", UNDER), "--toy"),
    Case("download-local_dir-under-file", exits(download_wan.main, "--local_dir", UNDER), "--local_dir"),
    Case(
        "download-convert-dst-file", exits(download_wan.main, "--convert", "TMP/prompts", A), "--convert DST"
    ),
    Case("download-convert-src-file", exits(download_wan.main, "--convert", A, "TMP/new"), "--convert SRC"),
    Case("download-verify-file", exits(download_wan.main, "--verify", A), "--verify"),
]


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_a_path_of_the_wrong_kind_is_refused_naming_the_flag_before_any_work(case, place, capsys):
    before = snapshot(place)
    threads = torch.get_num_threads()  # toy.build sets its --threads before it checks anything
    try:
        code = case.run(place)
    finally:
        torch.set_num_threads(threads)
    err = capsys.readouterr().err
    assert code == case.code, err
    title = next(line for line in err.splitlines() if line.startswith("ERROR ("))
    assert f"{case.flag} " in title, title
    assert "Traceback" not in err and err.count("ERROR (") == 1
    assert "How to fix:" in err
    assert snapshot(place) == before  # nothing created, nothing changed: the earlier run's files too


def test_every_command_is_covered():
    """A command added to `python -m distill` gets its path flags tried here too (toy commands as well)."""
    from distill.__main__ import COMMANDS

    covered = {case.id.split("-")[0] for case in CASES}
    assert {name.replace("-", "_") for name in COMMANDS} | {"toy"} <= covered


# ---------------------------------------------------------------------------------------------
# The rules themselves (distill/ops/paths.py)
# ---------------------------------------------------------------------------------------------


def refusal(*flags: PathFlag, probe: bool = True) -> DistillError:
    with pytest.raises(DistillError) as caught:
        check_paths(flags, probe=probe)
    return caught.value


def test_a_folder_to_be_made_passes_and_nothing_is_left_behind(tmp_path):
    check_paths([PathFlag("--output_dir", tmp_path / "a" / "b", Kind.OUTPUT_FOLDER)])
    check_paths([PathFlag("--json", tmp_path / "new" / "r.json", Kind.OUTPUT_FILE)])
    assert list(tmp_path.iterdir()) == []  # the probe file is gone and no folder was made


def test_the_fix_for_a_file_offers_a_folder_name_not_taken(tmp_path):
    (tmp_path / "run.json").write_text("{}")
    (tmp_path / "run").write_text("taken too")
    error = refusal(PathFlag("--output_dir", tmp_path / "run.json", Kind.OUTPUT_FOLDER))
    assert f"--output_dir {tmp_path / 'run_2'}" in error.fixes[0]


def test_a_folder_given_for_a_file_offers_a_file_inside_it(tmp_path):
    (tmp_path / "notes.md").write_text("x")
    (tmp_path / "b.jsonl").write_text('{"prompt": "a"}\n')
    error = refusal(PathFlag("--prompts", tmp_path, Kind.FILE, suffixes=(".txt", ".jsonl")))
    assert error.fixes == [f"pass one file, e.g. --prompts {tmp_path / 'b.jsonl'}"]


def test_a_missing_input_names_a_close_name_when_there_is_one(tmp_path):
    (tmp_path / "prompts.txt").write_text("a\n")
    error = refusal(PathFlag("--data_path", tmp_path / "prompt.txt", Kind.FILE))
    assert (
        error.title.endswith("file not found")
        and f"did you mean --data_path {tmp_path / 'prompts.txt'}" in error.fixes[0]
    )
    error = refusal(PathFlag("--data_path", tmp_path / "no" / "p.txt", Kind.FILE))
    assert f"the folder {tmp_path / 'no'} does not exist" in error.fixes[0]


def test_a_hub_id_and_a_loader_checked_folder_pass_when_missing(tmp_path):
    check_paths(
        [
            PathFlag("--teacher_path", "Wan-AI/Wan2.2-T2V-A14B-Diffusers", Kind.FOLDER_OR_HUB),
            PathFlag("--student", tmp_path / "none", Kind.FOLDER, must_exist=False),
        ]
    )


def test_a_link_to_nothing_is_not_a_folder_to_write_into(tmp_path):
    (tmp_path / "out").symlink_to(tmp_path / "gone")
    error = refusal(PathFlag("--output_dir", tmp_path / "out", Kind.OUTPUT_FOLDER), probe=False)
    assert "is a link to" in error.title and "which does not exist" in error.title


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only folders")
def test_a_read_only_folder_is_refused_as_not_writable(tmp_path):
    folder = tmp_path / "ro"
    folder.mkdir()
    folder.chmod(0o555)
    try:
        error = refusal(PathFlag("--cache_dir", folder / "cache", Kind.OUTPUT_FOLDER))
        assert error.title == f"--cache_dir {folder / 'cache'} is not writable"
        check_paths([PathFlag("--cache_dir", folder / "cache", Kind.OUTPUT_FOLDER)], probe=False)  # kind only
    finally:
        folder.chmod(0o755)
