"""Prompt files: one prompt per line (.txt), a `prompt` column (.csv comma-, .tsv tab-separated,
with a header line), or JSON lines ({"prompt": "..."} per line, .jsonl); or a folder of videos or
pictures captioned by .txt files of the same names (distill.data.captioned_folder), whose records
carry their medium as the `image` field.
A missing, empty or unreadable file is refused with the flag that named it, and a record that holds
no usable prompt (a missing field, null, a number, empty text, a row with more fields than its
header) with its line: training on "None" or on half a prompt would go unnoticed."""

from __future__ import annotations

import csv
import io
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from distill.data.captioned_folder import read_captioned_folder
from distill.data.record_fields import check_record_fields
from distill.ops.errors import DistillError, Stage


def _data_error(path: Path, problem: str, fix: str, flag: str = "--data_path") -> DistillError:
    return DistillError(f"{flag} {path}: {problem}", fixes=[fix], stage=Stage.DATA)


@dataclass(frozen=True)
class PromptRecord:
    """One prompt, the line of its file it came from, and the record's fields (none for .txt):
    readers of files that pair a prompt with more (an image) take the rest from `fields`."""

    line: int
    prompt: str
    fields: dict[str, Any] = field(default_factory=dict)
    source: Path | None = None
    """The file the record was read from when it is not the prompts file itself (a caption file of
    a folder): the record's line is that file's, and its image is named relative to it."""


def read_prompts(path: str | Path, flag: str = "--data_path", images: bool | None = None) -> list[str]:
    """Prompts from .txt (one a line; blank and '#' lines skipped), .jsonl, .csv or .tsv (a 'prompt' field).

    `flag` is the setting the path came from, named in every error.
    """
    return [record.prompt for record in read_prompt_records(path, flag, images)]


def read_prompt_records(
    path: str | Path, flag: str = "--data_path", images: bool | None = None
) -> list[PromptRecord]:
    """As `read_prompts`, keeping each prompt's line and its record's fields. `images`: whether the
    caller pairs every prompt with an image (True), takes text only (False) or either (None): a
    folder without media then offers a prompts file inside that suits it."""
    path = Path(path)
    if path.is_dir():
        return [
            PromptRecord(1, item.caption, {"image": item.medium.name}, item.caption_file)
            for item in read_captioned_folder(path, flag, images)
        ]
    if not path.is_file():
        raise _data_error(
            path, "file not found", "check the path; data/static_prompts.txt ships with the project", flag
        )
    raw = path.read_bytes()
    if b"\x00" in raw[:8192]:
        raise _data_error(
            path, "looks like a binary file, not text", "pass a UTF-8 .txt, .jsonl, .csv or .tsv file", flag
        )
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        line = raw[: exc.start].count(b"\n") + 1
        raise _data_error(
            path, f"is not UTF-8 (bad byte at line {line})", "re-save the file as UTF-8", flag
        ) from None
    suffix = path.suffix.lower()
    if suffix == ".jsonl":
        records = _prompts_from_jsonl(path, text, flag)
    elif suffix in (".csv", ".tsv"):
        records = _prompts_from_table(path, text, flag, "\t" if suffix == ".tsv" else ",")
    else:
        records = [
            PromptRecord(number, line.strip())
            for number, line in enumerate(text.splitlines(), 1)
            if line.strip() and not line.lstrip().startswith("#")
        ]
    if not records:
        raise _data_error(
            path, "holds no prompts", "write one prompt per line (lines starting with # are comments)", flag
        )
    check_record_fields(path, [(record.line, record.fields) for record in records], flag)
    return records


def _prompts_from_jsonl(path: Path, text: str, flag: str) -> list[PromptRecord]:
    prompts = []
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise _data_error(
                path, f"line {number} is not JSON ({exc.msg})", "one JSON object per line", flag
            ) from None
        if not isinstance(record, dict):
            raise _data_error(
                path,
                f"line {number} is a JSON {_json_kind(record)}, not an object",
                'write one {"prompt": "..."} object per line',
                flag,
            )
        if "prompt" not in record:
            fields = ", ".join(record) or "none"
            raise _data_error(
                path,
                f"line {number} has no 'prompt' field (fields: {fields})",
                'write {"prompt": "..."} per line',
                flag,
            )
        prompts.append(PromptRecord(number, _prompt_text(path, number, record["prompt"], flag), record))
    return prompts


def _prompts_from_table(path: Path, text: str, flag: str, delimiter: str) -> list[PromptRecord]:
    """The 'prompt' column of a .csv / .tsv file whose first line names the columns."""
    kind = "tab" if delimiter == "\t" else "comma"
    reader = csv.DictReader(io.StringIO(text, newline=""), delimiter=delimiter)
    prompts = []
    try:
        columns = reader.fieldnames or []
        if columns and "prompt" not in columns:
            raise _data_error(
                path,
                f"has no 'prompt' column in its first line ({kind}-separated columns: "
                f"{', '.join(repr(c) for c in columns)})",
                f"start the file with a header line naming the column 'prompt' ({kind}-separated), "
                "or save one prompt per line as .txt",
                flag,
            )
        for row in reader:
            line = reader.line_num
            if None in row:  # fields beyond the header: an unquoted separator split the prompt
                raise _data_error(
                    path,
                    f"line {line} has more {kind}-separated fields than the header ({len(columns)})",
                    f'put the prompt in double quotes ("...") when it holds a {kind}',
                    flag,
                )
            if row["prompt"] is None:
                raise _data_error(
                    path,
                    f"line {line} has no 'prompt' field (fewer {kind}-separated fields than the header)",
                    "give every row a value for each column of the header",
                    flag,
                )
            prompts.append(PromptRecord(line, _prompt_text(path, line, row["prompt"], flag), row))
    except csv.Error as exc:
        raise _data_error(
            path, f"line {reader.line_num} is not valid {kind}-separated text ({exc})", "fix that line", flag
        ) from None
    return prompts


def _prompt_text(path: Path, line: int, value: Any, flag: str) -> str:
    """A record's prompt as text, refused when it is not text or is empty (str(None) is "None")."""
    if not isinstance(value, str):
        raise _data_error(
            path,
            f"line {line}: the prompt is {json.dumps(value)[:40]} (a JSON {_json_kind(value)}), not text",
            'write the prompt as a string: {"prompt": "..."}',
            flag,
        )
    if not value.strip():
        raise _data_error(
            path, f"line {line} has an empty prompt", "write the prompt, or remove the line", flag
        )
    return value.strip()


def _json_kind(value: Any) -> str:
    """JSON's own name for the type of a parsed value."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    kinds = {dict: "object", list: "array", str: "string", int: "number", float: "number"}
    return kinds.get(type(value), type(value).__name__)


def reference_prompts(prompts: list[str], count: int) -> list[str]:
    """`count` prompts at evenly spaced positions of `prompts` (all of them when there are no more):
    the fixed set whose teacher samples a run that trains without them compares its student with."""
    if count >= len(prompts):
        return list(prompts)
    return [prompts[i * len(prompts) // count] for i in range(count)]
