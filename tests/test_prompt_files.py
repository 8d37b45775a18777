"""Prompt files: .txt, .csv and .tsv with a 'prompt' column, .jsonl; a record without a usable prompt
is a data error (exit 6) naming the file and its line, never trained on as "None" or half a prompt
(issue 36, class 5)."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import train_args

from distill.data.prompts import read_prompts
from distill.ops.errors import DistillError, Stage
from train_distillation import main


def write(folder: Path, name: str, text: str) -> Path:
    path = folder / name
    path.write_text(text, encoding="utf-8")
    return path


@pytest.mark.parametrize(
    "name, text, words",
    [
        ("p.csv", "prompt,id\na cat,1\n,2\n", "line 3 has an empty prompt"),
        ("p.csv", "id,prompt\n1,a cat\n2\n", "line 3 has no 'prompt' field (fewer comma-separated fields"),
        ("p.csv", "prompt,id\na cat, on a mat,1\n", "line 2 has more comma-separated fields than the header"),
        ("p.jsonl", '{"prompt": "a cat"}\n{"prompt": null}\n', "line 2: the prompt is null (a JSON null)"),
        ("p.jsonl", '{"prompt": 7}\n', "line 1: the prompt is 7 (a JSON number), not text"),
        ("p.jsonl", '{"prompt": ["a", "b"]}\n', "(a JSON array), not text"),
        ("p.jsonl", '{"prompt": "  "}\n', "line 1 has an empty prompt"),
        ("p.jsonl", '"a cat"\n', "line 1 is a JSON string, not an object"),
        ("p.jsonl", "[1, 2]\n", "line 1 is a JSON array, not an object"),
        ("p.jsonl", '{"text": "a cat"}\n', "line 1 has no 'prompt' field (fields: text)"),
        ("p.tsv", "a red cube\na blue ball\n", "has no 'prompt' column in its first line (tab-separated"),
        ("p.tsv", "prompt\tid\na cat\t1\tx\n", "line 2 has more tab-separated fields than the header"),
    ],
)
def test_a_record_without_a_usable_prompt_is_refused_with_its_line(tmp_path, name, text, words):
    path = write(tmp_path, name, text)
    with pytest.raises(DistillError) as refused:
        read_prompts(path, "--prompts_file")
    error = refused.value
    assert error.stage == Stage.DATA and f"--prompts_file {path}" in error.title and words in error.title
    assert error.fixes


def test_tsv_is_read_by_its_prompt_column_and_csv_keeps_quoted_commas(tmp_path):
    tsv = write(tmp_path, "p.tsv", "id\tprompt\n1\ta cat, sitting\n2\ta dog\n")
    assert read_prompts(tsv) == ["a cat, sitting", "a dog"]  # before: the header and the ids were prompts
    csv = write(tmp_path, "p.csv", 'prompt,id\n"a cat, on a mat",1\n\nb,\n')
    assert read_prompts(csv) == ["a cat, on a mat", "b"]


def test_a_bad_prompt_file_stops_the_trainer_as_a_data_error(tiny_teacher, tmp_path, capsys):
    data = write(tmp_path, "prompts.csv", "prompt,id\na cat,1\n,2\n")
    code = main(train_args(tiny_teacher, tmp_path / "out", tmp_path / "cache", data_path=data))
    err = capsys.readouterr().err
    assert code == 6 and f"{data}: line 3 has an empty prompt" in err and "Traceback" not in err
    assert not (tmp_path / "cache").exists()  # refused before the teacher sampled anything
