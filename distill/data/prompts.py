"""Prompt files: one prompt per line (.txt), a `prompt` or `text` column (.csv/.tsv), or JSON lines.
A missing, empty or unreadable file is refused with the flag that named it."""

from __future__ import annotations

import csv
import json
from pathlib import Path

from distill.ops.errors import DistillError, Stage


def _data_error(path: Path, problem: str, fix: str, flag: str = "--data_path") -> DistillError:
    return DistillError(f"{flag} {path}: {problem}", fixes=[fix], stage=Stage.DATA)


def read_prompts(path: str | Path, flag: str = "--data_path") -> list[str]:
    """Prompts from .txt (one a line; blank and '#' lines skipped), .jsonl or .csv (a 'prompt' field).

    `flag` is the setting the path came from, named in every error.
    """
    path = Path(path)
    if path.is_dir():
        inside = sorted(p.name for p in path.iterdir() if p.suffix.lower() in (".txt", ".jsonl", ".csv"))
        raise _data_error(
            path,
            "is a folder; a prompts file is expected",
            f"pass one file, e.g. {flag} {path / inside[0]}"
            if inside
            else "pass a .txt, .jsonl or .csv file",
            flag,
        )
    if not path.is_file():
        raise _data_error(
            path, "file not found", "check the path; data/static_prompts.txt ships with the project", flag
        )
    raw = path.read_bytes()
    if b"\x00" in raw[:8192]:
        raise _data_error(
            path, "looks like a binary file, not text", "pass a UTF-8 .txt, .jsonl or .csv file", flag
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
        prompts = _prompts_from_jsonl(path, text, flag)
    elif suffix == ".csv":
        rows = list(csv.DictReader(text.splitlines()))
        if rows and "prompt" not in rows[0]:
            raise _data_error(
                path,
                f"has no 'prompt' column (columns: {', '.join(rows[0])})",
                "name the column 'prompt'",
                flag,
            )
        prompts = [row["prompt"].strip() for row in rows]
    else:
        prompts = [line.strip() for line in text.splitlines() if not line.lstrip().startswith("#")]
    prompts = [p for p in prompts if p]
    if not prompts:
        raise _data_error(
            path, "holds no prompts", "write one prompt per line (lines starting with # are comments)", flag
        )
    return prompts


def _prompts_from_jsonl(path: Path, text: str, flag: str) -> list[str]:
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
        if not isinstance(record, dict) or "prompt" not in record:
            raise _data_error(
                path, f"line {number} has no 'prompt' field", 'write {"prompt": "..."} per line', flag
            )
        prompts.append(str(record["prompt"]).strip())
    return prompts


def reference_prompts(prompts: list[str], count: int) -> list[str]:
    """`count` prompts at evenly spaced positions of `prompts` (all of them when there are no more):
    the fixed set whose teacher samples a run that trains without them compares its student with."""
    if count >= len(prompts):
        return list(prompts)
    return [prompts[i * len(prompts) // count] for i in range(count)]
