# cython: language_level=3, boundscheck=False, wraparound=False
"""Fast, bounds-checked scan of a GGUF string array (a vocabulary is ~50k
length-prefixed strings; a Python loop costs ~3 us each on our machines)."""

from libc.stdint cimport uint64_t
from libc.string cimport memcpy


class ScanError(ValueError):
    """(index, reason): string ``index`` is truncated or not UTF-8."""


cdef inline int _check_count(Py_ssize_t pos, Py_ssize_t end, uint64_t count) except -1:
    if count > <uint64_t>((end - pos) // 8 if end > pos else 0):
        raise ScanError(0, f"{count} strings cannot fit in {end - pos} bytes")
    return 0


cdef inline Py_ssize_t _length(const unsigned char[::1] buf, Py_ssize_t pos, uint64_t i) except -1:
    """The byte length of string ``i``, whose u64 length is at ``pos``,
    checked against the bytes that follow it."""
    cdef Py_ssize_t end = buf.shape[0]
    cdef uint64_t ln
    if pos + 8 > end:
        raise ScanError(i, "truncated length")
    memcpy(&ln, &buf[pos], 8)   # little-endian hosts only (x86-64, arm64)
    if ln > <uint64_t>(end - pos - 8):
        raise ScanError(i, f"length {ln} exceeds the {end - pos - 8} bytes left")
    return <Py_ssize_t>ln


def scan_strings(const unsigned char[::1] buf, Py_ssize_t pos, uint64_t count):
    """Decode ``count`` GGUF strings (u64 little-endian length + UTF-8
    bytes) starting at ``pos``. Returns (list of str, end position)."""
    cdef Py_ssize_t ln
    cdef uint64_t i
    cdef list out = []
    _check_count(pos, buf.shape[0], count)
    for i in range(count):
        ln = _length(buf, pos, i)
        pos += 8
        try:
            out.append((<const char *>&buf[pos])[:ln].decode("utf-8"))
        except UnicodeDecodeError as e:
            raise ScanError(i, f"not valid UTF-8 ({e.reason})") from None
        pos += ln
    return out, pos


def index_strings(const unsigned char[::1] buf, Py_ssize_t pos, uint64_t count):
    """Like scan_strings, but keep no str objects: validate every string
    (lengths in bounds, UTF-8) and return (bounds, end position) where
    bounds[i] = (start, stop) of string i's bytes relative to ``pos``."""
    import numpy as np
    cdef Py_ssize_t start = pos, ln
    cdef uint64_t i
    _check_count(pos, buf.shape[0], count)
    bounds = np.empty((count, 2), dtype=np.int64)
    cdef long long[:, ::1] b = bounds
    for i in range(count):
        ln = _length(buf, pos, i)
        pos += 8
        try:
            (<const char *>&buf[pos])[:ln].decode("utf-8")
        except UnicodeDecodeError as e:
            raise ScanError(i, f"not valid UTF-8 ({e.reason})") from None
        b[i, 0] = pos - start
        b[i, 1] = pos - start + ln
        pos += ln
    return bounds, pos


def scan_pairs(const unsigned char[::1] buf, Py_ssize_t pos, uint64_t count):
    """Decode ``count`` GGUF strings like scan_strings, each split in two at
    its first space after the first byte (llama.cpp's reading of
    ``tokenizer.ggml.merges``: "left right"). Returns (list of (left, right)
    str tuples, end position); a string without such a space is
    ScanError(index, "no space")."""
    cdef Py_ssize_t j, cut, ln
    cdef uint64_t i
    cdef list out = []
    cdef const char * s
    _check_count(pos, buf.shape[0], count)
    for i in range(count):
        ln = _length(buf, pos, i)
        pos += 8
        s = <const char *>&buf[pos]
        cut = -1
        for j in range(1, ln):
            if s[j] == 32:
                cut = j
                break
        if cut < 0:
            raise ScanError(i, "no space")
        try:
            out.append((s[:cut].decode("utf-8"), s[cut + 1:ln].decode("utf-8")))
        except UnicodeDecodeError as e:
            raise ScanError(i, f"not valid UTF-8 ({e.reason})") from None
        pos += ln
    return out, pos
