"""Reading a text corpus: files, folders and JSONL, as documents or as
bounded chunks. Training (``toy.train.data``: the token cache, ``toy.train.bpe``)
and evaluation (``toy.eval.record``) read text through here.

Decisions:

- A plain-text file is one document; a ``.jsonl`` line with a non-empty string
  ``"text"`` is one document. Empty documents are skipped. Bytes are decoded as
  UTF-8 exactly (a leading BOM is dropped, line endings are kept).
- A folder is read recursively in sorted order (hidden entries skipped),
  keeping the ``TEXT_SUFFIXES`` files.
- ``iter_chunks`` cuts large plain-text files into ~``CHUNK_BYTES`` pieces,
  only at a line break where no pre-tokenizer piece of the byte-level BPE
  families toy reads can cross (see ``_safe_cut``), so tokenizing the chunks
  one by one gives the ids of the whole file. A stretch of 8 chunks without
  such a point is cut at a newline (or a character boundary) instead, which
  bounds memory.

- A JSONL line is read with a bound (``toy.inputs.max_record_bytes``: 64 MiB
  unless ``TOY_MAX_RECORD_BYTES`` says otherwise); a longer one is refused
  naming the file and line. A path that is not a regular file (a FIFO, a
  device, also one found in a folder) is refused before it is opened.
- ``iter_text`` gives a corpus as text blocks cut only at character
  boundaries (for callers that join them and cut their own pieces, such as
  ``toy.eval``'s reader, which stops reading once it has enough tokens).

Invariants: bad input raises ``DataError`` naming the file (and the 1-based
JSONL line); nothing here tokenizes (this module sits below the tokenizer in
the layer table of ``docs/concepts/architecture.md``).
"""

from __future__ import annotations

import codecs
import itertools
import json
import os
from collections.abc import Iterable, Iterator
from pathlib import Path

from toy.errors import DataError
from toy.inputs import max_record_bytes, read_line, regular_file

TEXT_SUFFIXES = (".txt", ".md", ".rst", ".text", ".jsonl")
CHUNK_BYTES = 1 << 20

Paths = str | os.PathLike[str] | Iterable[str | os.PathLike[str]]


def corpus_files(paths: Paths) -> list[Path]:
    """Files in reading order: given files as given, folders recursively in
    sorted order (hidden entries skipped) keeping the TEXT_SUFFIXES files."""
    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    files: list[Path] = []
    for p in map(Path, paths):
        if p.is_dir():
            found = []
            for root, dirs, names in os.walk(p):
                dirs[:] = [d for d in dirs if not d.startswith(".")]
                found += [Path(root, n) for n in names if not n.startswith(".") and n.lower().endswith(TEXT_SUFFIXES)]
            if not found:
                raise DataError(f"{p}: the folder holds no {' '.join(TEXT_SUFFIXES)} files")
            files += [regular_file(f) for f in sorted(found, key=lambda f: f.relative_to(p).parts)]
        elif p.is_file():
            files.append(p)
        elif p.exists():
            regular_file(p)  # raises, saying what it is
            raise DataError(f"{p}: not a regular file or folder")
        else:
            raise DataError(f"{p}: no such file or folder")
    if not files:
        raise DataError("no corpus files given")
    return files


def is_jsonl(path: Path) -> bool:
    """Whether ``path`` is read as JSONL (one ``{"text": ...}`` document a line)."""
    return path.name.lower().endswith(".jsonl")


def _decode(raw: bytes, path: Path, offset: int) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise DataError(f"{path}: not valid UTF-8 text (byte {offset + e.start})") from None


def read_error(path: Path, e: OSError) -> DataError:
    """The ``DataError`` for an ``OSError`` while reading ``path``."""
    return DataError(f"{path}: cannot read: {e.strerror or e}")


def _jsonl_docs(path: Path) -> Iterator[tuple[str, str, int]]:
    """(source, text, bytes consumed since the previous yield) per document."""
    pending, limit = 0, max_record_bytes()
    try:
        with open(regular_file(path), "rb") as f:
            for lineno in itertools.count(1):
                raw = read_line(f, f"{path}:{lineno}", limit)
                if not raw:
                    break
                pending += len(raw)
                if lineno == 1 and raw.startswith(b"\xef\xbb\xbf"):
                    raw = raw[3:]
                if not raw.strip():
                    continue
                where = f"{path}:{lineno}"
                try:
                    obj = json.loads(raw.decode("utf-8"))
                except UnicodeDecodeError:
                    raise DataError(f"{where}: not valid UTF-8") from None
                except ValueError as e:
                    raise DataError(f"{where}: not valid JSON ({e})") from None
                if not isinstance(obj, dict):
                    raise DataError(f"{where}: expected a JSON object, got {type(obj).__name__}")
                if "text" not in obj:
                    raise DataError(f'{where}: the object has no "text" field')
                text = obj["text"]
                if not isinstance(text, str):
                    raise DataError(f'{where}: "text" is {type(text).__name__}, not a string')
                if text:
                    yield where, text, pending
                    pending = 0
    except OSError as e:
        raise read_error(path, e) from None


def _is_alnum(byte: int) -> bool:
    return 0x30 <= byte <= 0x39 or 0x41 <= byte <= 0x5A or 0x61 <= byte <= 0x7A


def _safe_cut(buf: bytearray) -> int:
    """The last index where the text can be cut without changing its tokens
    (0 if none): after a newline that has printable ASCII on both sides, or
    before a line break (LF or CRLF) that follows an ASCII letter or digit. At
    both points every pre-tokenizer regex toy knows ends a piece, and none of
    its look-aheads reaches across."""
    i = buf.rfind(b"\n", 0, len(buf) - 1)
    while i > 0:
        if 0x21 <= buf[i - 1] <= 0x7E and 0x21 <= buf[i + 1] <= 0x7E:
            return i + 1
        j = i - 1 if buf[i - 1] == 0x0D else i
        if j > 0 and _is_alnum(buf[j - 1]):
            return j
        i = buf.rfind(b"\n", 0, i)
    return 0


def _fallback_cut(buf: bytearray) -> int:
    """After the last newline, else before the last character (never inside a
    UTF-8 sequence)."""
    i = buf.rfind(b"\n")
    if i >= 0:
        return i + 1
    cut = len(buf) - 1
    while cut > 0 and 0x80 <= buf[cut] < 0xC0:
        cut -= 1
    return cut or len(buf)


def _text_chunks(path: Path, chunk_bytes: int | None) -> Iterator[tuple[str, bool, int]]:
    """(text, is the file's last chunk, bytes) for a plain-text file, cut near
    every ``chunk_bytes`` (None: the whole file at once); nothing for a file
    without text."""
    buf = bytearray()
    offset, any_text, first = 0, False, True
    try:
        with open(path, "rb") as f:
            while True:
                block = f.read(chunk_bytes or -1)
                if first and block.startswith(b"\xef\xbb\xbf"):
                    block, offset = block[3:], 3
                first = False
                buf += block
                if block and chunk_bytes and len(buf) < chunk_bytes:
                    continue
                if not block or not chunk_bytes:
                    cut, last = len(buf), True
                else:
                    cut, last = _safe_cut(buf), False
                    if not cut:
                        if len(buf) < 8 * chunk_bytes:
                            continue
                        cut = _fallback_cut(buf)
                text = _decode(bytes(buf[:cut]), path, offset)
                del buf[:cut]
                offset += cut
                if last:
                    if text or any_text:
                        yield text, True, cut
                    return
                any_text = any_text or bool(text)
                yield text, False, cut
    except OSError as e:
        raise read_error(path, e) from None


def iter_chunks(paths: Paths, chunk_bytes: int | None = CHUNK_BYTES) -> Iterator[tuple[str, str, bool, int]]:
    """(source, text, ends a document, bytes read) with bounded memory: a
    JSONL document is one chunk, a plain-text file one or more."""
    for path in corpus_files(paths):
        if is_jsonl(path):
            for source, text, nbytes in _jsonl_docs(path):
                yield source, text, True, nbytes
        else:
            for text, last, nbytes in _text_chunks(path, chunk_bytes):
                yield str(path), text, last, nbytes


def _text_blocks(path: Path, block_bytes: int) -> Iterator[str]:
    """A plain-text file's text in blocks of about ``block_bytes``, cut at character boundaries."""
    dec = codecs.getincrementaldecoder("utf-8")()
    offset = 0
    try:
        with open(regular_file(path), "rb") as f:
            while True:
                block = f.read(block_bytes)
                if offset == 0 and block.startswith(b"\xef\xbb\xbf"):
                    block, offset = block[3:], 3
                try:
                    text = dec.decode(block, final=not block)
                except UnicodeDecodeError as e:
                    start = offset - len(dec.getstate()[0]) + e.start
                    raise DataError(f"{path}: not valid UTF-8 text (byte {start})") from None
                offset += len(block)
                if text:
                    yield text
                if not block:
                    return
    except OSError as e:
        raise read_error(path, e) from None


def iter_text(paths: Paths, block_bytes: int = CHUNK_BYTES) -> Iterator[tuple[str, str, bool]]:
    """(source, text, starts a document) for the non-empty documents of the corpus in reading order: a
    JSONL document in one block, a plain-text file in blocks of about ``block_bytes`` bytes cut at
    character boundaries only (not where tokens are safe: join them before tokenizing)."""
    for path in corpus_files(paths):
        if is_jsonl(path):
            for source, text, _ in _jsonl_docs(path):
                yield source, text, True
            continue
        for i, text in enumerate(_text_blocks(path, block_bytes)):
            yield str(path), text, i == 0


def iter_documents(paths: Paths) -> Iterator[tuple[str, str]]:
    """(source, text) for every non-empty document of the corpus."""
    for path in corpus_files(paths):
        if is_jsonl(path):
            for source, text, _ in _jsonl_docs(path):
                yield source, text
            continue
        try:
            raw = regular_file(path).read_bytes()
        except OSError as e:
            raise read_error(path, e) from None
        skip = 3 if raw.startswith(b"\xef\xbb\xbf") else 0
        text = _decode(raw[skip:], path, skip)
        if text:
            yield str(path), text


__all__ = [
    "CHUNK_BYTES",
    "TEXT_SUFFIXES",
    "DataError",
    "Paths",
    "corpus_files",
    "is_jsonl",
    "iter_chunks",
    "iter_documents",
    "iter_text",
    "read_error",
]
