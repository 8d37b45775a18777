"""The whole command surface with bad values: every flag of every command, found from its own parser.

Each command of the project (every module with a `main` run as `python -m ...`, and the two scripts)
is asked for its argparse parser, and every flag is given what a user gets wrong: a word for a
number, a negative or non-finite number, a bad choice, a file where a folder goes, a folder where a
file goes, a path through a file. Each must end in the project's banner naming the flag, with the
argv or config exit code (a prompt file: the data code, as documented): never a traceback, never exit 10, and nothing written. The values are
refused while parsing or validating, before any model loads, so each case takes milliseconds; the
commands run in this process.

The second half is the trainer's --config files: YAML's own readings (null, true, 1e-3, no), lists
for single values, the origin project's flag names as keys, and a recipe's value named as the
recipe's, not as a flag nobody typed.
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import importlib
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from conftest import REPO

from distill.ops.command import PathAction
from distill.ops.paths import Kind


def entry_modules() -> list[str]:
    """Every module of the project with a `main` that runs as a command (not the `python -m distill`
    dispatcher, which only hands its arguments to these)."""
    files = [
        REPO / "train_distillation.py",
        REPO / "download_wan.py",
        *sorted((REPO / "distill").rglob("*.py")),
    ]
    found = []
    for path in files:
        text = path.read_text()
        if "__main__" not in text or path.name == "__main__.py":
            continue
        tree = ast.parse(text)
        has_main = any(isinstance(node, ast.FunctionDef) and node.name == "main" for node in tree.body)
        runs = any(isinstance(node, ast.If) and "__main__" in ast.unparse(node.test) for node in tree.body)
        if has_main and runs:
            found.append(".".join(path.relative_to(REPO).with_suffix("").parts))
    return found


class _Captured(BaseException):  # not an Exception: passes every handler of the command on its way out
    def __init__(self, parser: argparse.ArgumentParser) -> None:
        self.parser = parser


def parser_of(main: Callable, monkeypatch: pytest.MonkeyPatch) -> argparse.ArgumentParser:
    """The parser `main` builds, taken when it starts parsing (nothing of the command runs)."""

    def capture(self, *args, **kwargs):  # noqa: ANN001, ANN202
        raise _Captured(self)

    with monkeypatch.context() as patch:
        patch.setattr(argparse.ArgumentParser, "parse_known_args", capture)
        with pytest.raises(_Captured) as caught:
            main([])
    return caught.value.parser


def bad_values(action: argparse.Action, place: Path) -> list[str]:
    """What a user gets wrong for this flag, from what the parser says it takes."""
    if isinstance(action, PathAction):
        wrong = {
            Kind.FILE: place / "folder",
            Kind.OUTPUT_FILE: place / "folder",
            Kind.FILE_OR_FOLDER: place / "afile" / "x",
            Kind.PROMPTS: place / "afile" / "x",  # a prompts file or a captioned folder: either is right
        }.get(action.kind, place / "afile")  # the folder kinds: a file
        return [str(wrong), str(place / "afile" / "inside")]
    if action.choices is not None:
        return ["not-a-choice"]
    kind = action.type
    minimum = getattr(kind, "minimum", 0)  # the trainer's plain int / float settings are never negative
    if kind is int or getattr(kind, "__name__", "") == "integer":
        return ["many", "2.5"] + (["-1"] if minimum is not None else [])
    if kind is float or getattr(kind, "__name__", "") == "number":
        return ["much", "nan", "inf"] + (["-1"] if minimum is not None else [])
    return []


def walk(module: str, place: Path, monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, list[str]]]:
    """Every (flag, argv) case of `module`."""
    main = importlib.import_module(module).main
    parser = parser_of(main, monkeypatch)
    cases = []
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        flag = action.option_strings[0] if action.option_strings else action.dest
        if action.nargs == 0:  # a switch: a value attached to it is refused, not ignored
            cases.append((flag, [f"{flag}=maybe"]))
            continue
        if action.nargs not in (None, "?"):
            continue  # several values at once (download_wan.py --convert SRC DST: tests/test_path_flags.py)
        for value in bad_values(action, place):
            cases.append((flag, [flag, value] if action.option_strings else [value]))
    return cases


def base_argv(module: str, place: Path) -> list[str]:
    """What the command needs besides the flag under test: only the trainer checks every setting
    together (a value that parses is judged in TrainConfig.validate), so only it gets a valid rest."""
    if module != "train_distillation":
        return []
    return [
        *(
            "--teacher_path",
            str(place / "no-teacher"),
            "--data_path",
            str(REPO / "data" / "static_prompts.txt"),
        ),
        *("--student_config", str(REPO / "config" / "student_tiny.json"), "--output_dir", str(place / "run")),
        *("--device", "cpu", "--backend", "gloo"),
    ]


def snapshot(folder: Path) -> dict[str, str]:
    return {
        str(p.relative_to(folder)): "dir" if p.is_dir() else hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
    }


def run(main: Callable, argv: list[str]) -> int:
    try:
        code = main(argv)
    except SystemExit as stop:  # argparse's usage errors keep their SystemExit(2), after the banner
        code = stop.code
    return code if isinstance(code, int) else 0


MODULES = entry_modules()


def test_every_command_is_found():
    assert {"train_distillation", "download_wan", "distill.generate", "distill.evaluate"} <= set(MODULES)
    assert {"distill.bench.cli", "distill.toy.build", "distill.toy.stage_one", "distill.doctor"} <= set(
        MODULES
    )


@pytest.mark.parametrize("module", MODULES)
def test_every_flag_given_a_bad_value_ends_in_the_banner_naming_it(module, tmp_path, monkeypatch, capsys):
    (tmp_path / "afile").write_text("a user's file: must survive\n")
    (tmp_path / "folder").mkdir()
    (tmp_path / "folder" / "kept.txt").write_text("a red fox\n")
    monkeypatch.chdir(tmp_path)  # a default output folder (outputs/...) would land here, not in the repo
    main = importlib.import_module(module).main
    cases = walk(module, tmp_path, monkeypatch)
    assert cases, f"{module}: no flags found"
    before = snapshot(tmp_path)
    threads = torch.get_num_threads()
    wrong = []
    try:
        for flag, argv in cases:
            code = run(main, base_argv(module, tmp_path) + argv)
            err = capsys.readouterr().err
            title = next((line for line in err.splitlines() if line.startswith("ERROR (")), "")
            if code not in (2, 3, 6) or flag not in title or "Traceback" in err or "How to fix:" not in err:
                wrong.append(f"{' '.join(argv)}: exit {code}, {title or err[-300:]!r}")
    finally:
        torch.set_num_threads(threads)
    assert not wrong, f"{module}:\n" + "\n".join(wrong)
    assert snapshot(tmp_path) == before


# ---------------------------------------------------------------------------------------------
# Class 1 beyond flags: a command's body runs under the banner too
# ---------------------------------------------------------------------------------------------


def test_an_unexpected_exception_in_a_command_is_the_banner_not_a_traceback(monkeypatch, capsys):
    from distill import doctor

    def broken() -> str:
        raise KeyError("a bug")

    monkeypatch.setattr(doctor, "_environment", lambda: broken())
    monkeypatch.setattr(doctor, "_check", lambda name, fn, results: fn())
    assert doctor.main([]) == 10
    err = capsys.readouterr().err
    assert "ERROR (internal): unexpected KeyError in distill.doctor" in err and "How to fix:" in err


# ---------------------------------------------------------------------------------------------
# Class 4: config files
# ---------------------------------------------------------------------------------------------


def train_with(tmp_path: Path, text: str, *flags: str, suffix: str = ".yaml") -> tuple[int, str]:
    import train_distillation

    config = tmp_path / f"run{suffix}"
    config.write_text(text)
    argv = [*base_argv("train_distillation", tmp_path), "--config", str(config), "--dry_run", *flags]
    return run(train_distillation.main, argv), config


@pytest.mark.parametrize(
    ("text", "named", "fix"),
    [
        ("lr_warmup_steps: null\n", "'lr_warmup_steps' in", "lr_warmup_steps: 0"),
        ("lr_warmup_steps:\n", "is empty", "remove the line"),
        ("lr_warmup_steps: true\n", "is true, a yes/no value", "lr_warmup_steps: 0"),
        ("seed: yes\n", "'seed' in", "give a number"),
        ("critic_lr: 1e-3\nmethod: dmd\nstudent_init: teacher\n", "got the text '1e-3'", "critic_lr: 1.0e-3"),
        ("num_steps: 1e3\n", "must be a whole number", "num_steps: 1000"),
        ("num_steps: 2.5\n", "must be a whole number", "num_steps"),
        ("mixed_precision: no\n", "'mixed_precision' in", "mixed_precision: 'no'"),
        ("student_lora_targets: [to_q, to_k]\n", "is a list", "student_lora_targets: to_q,to_k"),
        ("height: [16, 32]\n", "is a list", "height: 480"),
        ("lr: {peak: 1}\n", "is a mapping", "lr"),
        ("negative_prompt: 12\n", "must be text", "quote it"),
        ("lr: 1.0e-3\nlr: 2.0e-3\n", "'lr' is set twice", "keep one 'lr:'"),
        ("on: 3\n", "has the key True", "setting names"),
        ("config: other.yaml\n", "cannot name another one", "remove the 'config' line"),
        ("max_steps: 2\nnum_steps: 3\n", "'max_steps' and 'num_steps' are both set", "keep only 'num_steps'"),
        ("--max-steps: 2\n", "without -- and with underscores: num_steps", "remove"),
    ],
)
def test_a_config_value_yaml_reads_otherwise_is_refused_naming_the_file_and_the_spelling(
    text, named, fix, tmp_path, capsys
):
    code, config = train_with(tmp_path, text)
    err = capsys.readouterr().err
    assert code == 3 and named in err and fix in err and str(config) in err, err
    assert "Traceback" not in err and not (tmp_path / "run").exists()


def test_a_json_number_in_quotes_is_named_as_text(tmp_path, capsys):
    code, _ = train_with(tmp_path, '{"lr": "1e-3"}', suffix=".json")
    err = capsys.readouterr().err
    assert code == 3 and "JSON reads it as text" in err and '"lr": 1e-3' in err


def test_the_origin_flag_names_are_accepted_as_config_keys(tmp_path):
    from distill.config.cli import parse_config

    config = tmp_path / "run.yaml"
    config.write_text("max_steps: 2\nlearning_rate: 3.0e-4\nepochs: 1\n")
    cfg = parse_config([*base_argv("train_distillation", tmp_path), "--config", str(config)])
    assert (cfg.num_steps, cfg.lr, cfg.num_epochs) == (2, 3e-4, 1)
    config.write_text("max_steps: 2\nlr_warmup_steps: 1.0e+1\n")
    assert (
        parse_config([*base_argv("train_distillation", tmp_path), "--config", str(config)]).lr_warmup_steps
        == 10
    )


def test_a_recipe_value_in_conflict_is_named_as_the_recipe_s_not_as_a_flag(tmp_path, capsys):
    recipe = REPO / "config" / "recipes" / "a14b-lora-4step-1xh200.yaml"  # teacher_placement: gpu
    import train_distillation

    argv = [
        "--config",
        str(recipe),
        "--teacher_on_cpu",
        "--output_dir",
        str(tmp_path / "run"),
        "--device",
        "cpu",
    ]
    code = run(train_distillation.main, argv)
    err = capsys.readouterr().err
    title = next(line for line in err.splitlines() if line.startswith("ERROR ("))
    assert code == 3, err
    assert f"teacher_placement: gpu (in {recipe})" in title and "--teacher_placement" not in title
    assert f"'teacher_placement' is set in {recipe}" in err and "override with --teacher_placement" in err


def test_a_negative_setting_with_no_rule_of_its_own_is_refused(tmp_path, capsys):
    code, _ = train_with(tmp_path, "weight_decay: -0.1\n")
    err = capsys.readouterr().err
    assert code == 3 and "'weight_decay' (in" in err and "must be 0 or more, got -0.1" in err


@pytest.mark.parametrize("argv", [["--height", "8"], ["--width", "40"], ["--num_frames", "2"]])
def test_a_bench_size_the_model_cannot_take_is_refused_before_it_runs(argv, capsys):
    from distill.bench import cli

    assert run(cli.main, ["--preset", "cpu-tiny", *argv]) == 2
    err = capsys.readouterr().err
    assert f"{argv[0]} must be" in err and "Traceback" not in err
