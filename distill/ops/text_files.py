"""Reading a text file a user named (a settings file, a student config): UTF-8, or a banner.

Editors on some systems save in UTF-16 or a legacy code page (Latin-1, Windows-1252); Python's
decoder then raises a UnicodeDecodeError deep inside whatever parses the file, which reaches the
user as a traceback. Here the file is decoded once, and what is wrong is said in the user's terms:
the flag and file, the line of the first byte that is not UTF-8, and how to re-save it.
"""

from __future__ import annotations

import codecs
from pathlib import Path

from distill.ops.errors import DistillError, Stage

# How much of the start is looked at for NUL bytes: text has none, every binary format has some.
BINARY_PROBE = 8192


def read_user_text(path: str | Path, flag: str, stage: Stage = Stage.CONFIG) -> str:
    """The text of the file `flag` names, decoded as UTF-8 (a byte-order mark is dropped).

    Refused with a banner naming `flag` and the file: a file that cannot be read, a UTF-16 file, a
    binary file, and bytes that are not UTF-8 (with the line of the first one).
    """
    path = Path(path)
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise DistillError(
            f"{flag} {path}: cannot be read ({exc.strerror or exc})",
            fixes=[f"check the file's permissions (ls -l {path}), or pass another file"],
            stage=stage,
        ) from None
    resave = f"re-save {path} as UTF-8 (an editor's 'save with encoding', or iconv -t utf-8)"
    if raw.startswith((codecs.BOM_UTF16_LE, codecs.BOM_UTF16_BE)):
        raise DistillError(
            f"{flag} {path}: is UTF-16 text, not UTF-8",
            "Settings files are read as UTF-8.",
            fixes=[resave],
            stage=stage,
        )
    if b"\x00" in raw[:BINARY_PROBE]:
        raise DistillError(
            f"{flag} {path}: looks like a binary file, not text",
            fixes=[f"pass the text file meant for {flag}"],
            stage=stage,
        )
    try:
        return raw.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        line = raw[: exc.start].count(b"\n") + 1
        raise DistillError(
            f"{flag} {path}: is not UTF-8 (bad byte at line {line})",
            f"Byte 0x{raw[exc.start]:02x} at line {line} is not UTF-8: the file was probably saved in "
            "another encoding (Latin-1, Windows-1252).",
            fixes=[resave],
            stage=stage,
        ) from None
