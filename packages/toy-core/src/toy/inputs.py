"""Input files: refusing what is not a regular file, and bounding one record.

Every path toy reads on a user's behalf (data, eval text, prompts, configs,
chat templates, images) goes through ``regular_file`` before it is opened: a
FIFO would block the open (or the first read) forever, a character device such
as ``/dev/zero`` never ends, a folder cannot be read as one file. The check
stats the path after resolving symlinks, so a link to ``/dev/zero`` is refused
too, and it runs before any ``open``, so nothing blocks.

``read_line`` reads one line of a line-oriented file (JSONL) with a bound:
a line over ``max_record_bytes()`` (``MAX_RECORD_BYTES``, 64 MiB, unless the
``TOY_MAX_RECORD_BYTES`` environment variable says otherwise) is refused with
a ``DataError`` naming the file and the 1-based line, before it is read whole.
The bound keeps one record's memory to a small multiple of its size (the
tokenizer encodes long text in pieces, see ``toy.tokenizer.longtext``).

Decisions: ``-`` (stdin) is never a path here; commands that document ``-``
handle it before calling ``regular_file``. Errors are ``DataError``s whose
``field`` is the caller's name for the input (``what``).

Invariants: this module sits in the bottom layer next to ``toy.errors`` and
imports nothing else of toy (docs/concepts/architecture.md).
"""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import BinaryIO

from toy.errors import DataError

#: the default longest line (record) of a line-oriented file, in bytes
MAX_RECORD_BYTES = 64 << 20
#: the environment variable that overrides ``MAX_RECORD_BYTES`` (a byte count)
RECORD_ENV = "TOY_MAX_RECORD_BYTES"

_KINDS = (
    (stat.S_ISDIR, "a folder"),
    (stat.S_ISFIFO, "a FIFO"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISSOCK, "a socket"),
)


def file_kind(mode: int) -> str:
    """What a stat mode is, in words ("a FIFO", "a folder", …)."""
    for test, name in _KINDS:
        if test(mode):
            return name
    return "a special file"


def regular_file(path: str | os.PathLike[str], what: str | None = None) -> Path:
    """``path`` as a ``Path`` when it is a regular file (symlinks followed),
    else a ``DataError`` naming it and what it is. ``what`` names the input in
    the caller's terms (``"--file"``, ``"data.paths"``); it becomes ``field``."""
    p = Path(path)
    try:
        st = os.stat(p)
    except FileNotFoundError:
        raise DataError(f"{p}: no such file", field=what) from None
    except OSError as e:
        raise DataError(f"{p}: cannot read: {e.strerror or e}", field=what) from None
    if not stat.S_ISREG(st.st_mode):
        link = ", through a symbolic link" if p.is_symlink() else ""
        raise DataError(
            f"{p}: not a regular file ({file_kind(st.st_mode)}{link})",
            hint="give the path of an ordinary file (toy does not read pipes, devices or folders here)",
            field=what,
        )
    return p


def max_record_bytes() -> int:
    """The longest line a line-oriented file may hold, in bytes: ``TOY_MAX_RECORD_BYTES`` when set (a
    positive integer), else ``MAX_RECORD_BYTES``."""
    raw = os.environ.get(RECORD_ENV, "").strip()
    if not raw:
        return MAX_RECORD_BYTES
    try:
        value = int(raw.replace("_", ""))
    except ValueError:
        value = 0
    if value < 1:
        raise DataError(f"{RECORD_ENV}={raw!r} must be a positive number of bytes", field=RECORD_ENV)
    return value


def record_too_long(where: str, limit: int) -> DataError:
    """The error for a record over ``limit`` bytes at ``where`` (``path:line``)."""
    return DataError(
        f"{where}: the line is longer than {limit:,} bytes, the most one record may hold",
        hint=f"split the record, or raise the bound with {RECORD_ENV}=BYTES (memory grows with it)",
    )


def read_line(f: BinaryIO, where: str, limit: int) -> bytes:
    """The next line of ``f`` (b"" at the end), refused with ``record_too_long`` when it holds more than
    ``limit`` bytes before its newline, after reading at most ``limit + 1`` bytes of it."""
    line = f.readline(limit + 1)
    if len(line) > limit and not line.endswith(b"\n"):
        raise record_too_long(where, limit)
    return line


__all__ = [
    "MAX_RECORD_BYTES",
    "RECORD_ENV",
    "file_kind",
    "max_record_bytes",
    "read_line",
    "record_too_long",
    "regular_file",
]
