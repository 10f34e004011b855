"""Read GGUF files: typed metadata, tensor infos, memory-mapped tensor data.

``GGUFFile(path)`` maps the file read-only and parses the header with a
bounds-checked cursor. Every length and count read from the file is checked
against the bytes that remain before anything is allocated, so a forged
file fails fast with ``GGUFError`` (file name and what is wrong) in bounded
time and memory; it never reaches ggml with a bad offset.

Invariants:
- metadata values are Python scalars, ``str``, NumPy arrays (numeric arrays,
  read-only copies), lists (string and nested arrays) or, for string arrays
  longer than LAZY_STRINGS, a ``StringArray`` (a Sequence decoded on access);
  ``types[key]`` keeps the on-disk type so a writer can reproduce the file;
- tensor shapes are NumPy order (GGUF stores ggml order, innermost first);
- tensor data stays in the map: ``tensor_bytes`` returns a read-only
  memoryview; ``bind`` (see ``toy.gguf.bind``) points ggml tensors at it.
"""

from __future__ import annotations

import mmap
import os
import stat
import struct
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, overload

import numpy as np

import toy_ggml
from toy._native.gguf_scan import ScanError, index_strings, scan_pairs, scan_strings
from toy.errors import BadInputError
from toy.gguf.constants import (
    DEFAULT_ALIGNMENT,
    MAGIC,
    MAX_ARRAY_DEPTH,
    MAX_DIMS,
    MAX_KEY_BYTES,
    MAX_KV,
    MAX_TENSORS,
    SCALAR,
    VERSIONS,
    ValueType,
)
from toy.inputs import file_kind

# string arrays longer than this (vocabularies, merges) are kept as one bytes
# block plus offsets and decoded on access: ~5x less memory than str objects
LAZY_STRINGS = 1024


class StringArray(Sequence[str]):
    """A read-only sequence of str over one bytes block (validated UTF-8),
    decoded item by item on access. Compares equal to a list of the same
    strings."""

    __slots__ = ("_raw", "_bounds")

    def __init__(self, raw: bytes, bounds: np.ndarray):
        self._raw = raw
        self._bounds = bounds

    def __len__(self) -> int:
        return len(self._bounds)

    @overload
    def __getitem__(self, i: int) -> str: ...
    @overload
    def __getitem__(self, i: slice) -> list[str]: ...
    def __getitem__(self, i: int | slice) -> str | list[str]:
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        a, b = self._bounds[i]
        return self._raw[a:b].decode("utf-8")

    def __iter__(self) -> Iterator[str]:
        raw = self._raw
        for a, b in self._bounds.tolist():
            yield raw[a:b].decode("utf-8")

    def __eq__(self, other: object) -> bool:
        if isinstance(other, (StringArray, list, tuple)):
            return len(self) == len(other) and all(x == y for x, y in zip(self, other))
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]  # unhashable, like list (typeshed declares a method)

    def tolist(self) -> list[str]:
        """Every string, decoded in one native pass (``list(self)`` decodes
        them one Python call at a time, ~3x slower for a vocabulary)."""
        return scan_strings(self._raw, 0, len(self))[0]

    def pairs(self) -> list[tuple[str, str]] | int:
        """Every string split at its first space after the first character,
        as ``(left, right)``, in one native pass (how llama.cpp reads
        ``tokenizer.ggml.merges``); the index of the first string without
        such a space instead, when there is one."""
        try:
            return scan_pairs(self._raw, 0, len(self))[0]
        except ScanError as e:
            return int(e.args[0])

    def __repr__(self) -> str:
        return f"StringArray({len(self)} strings)"


class GGUFError(BadInputError):
    """A GGUF file is malformed or unsupported: bad input (the CLI exits 2,
    the server answers 400), as the file is the user's to replace."""


@dataclass(frozen=True)
class TypeInfo:
    """On-disk type of a metadata value: ``type``; for arrays also the
    element type (``sub``, itself a TypeInfo for nested arrays)."""

    type: ValueType
    sub: TypeInfo | None = None


@dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]  # NumPy order
    dtype: toy_ggml.GGMLType
    offset: int  # relative to the data section
    nbytes: int

    @property
    def n_elements(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


_TYPE_SIZES: dict[int, tuple[int, int]] = {}


def _ggml_type(tag: int) -> tuple[toy_ggml.GGMLType, int, int] | None:
    """(type, block size, bytes per block) for a ggml type tag, or None."""
    try:
        t = toy_ggml.GGMLType(tag)
    except ValueError:
        return None
    if tag not in _TYPE_SIZES:
        traits = toy_ggml.type_info(t)
        _TYPE_SIZES[tag] = (traits.block_size, traits.type_size)
    blck, size = _TYPE_SIZES[tag]
    return t, blck, size


class _Cursor:
    """Little-endian reads over a buffer; every read is bounds-checked."""

    __slots__ = ("buf", "pos", "end", "file")

    def __init__(self, buf: memoryview, file: str):
        self.buf = buf
        self.pos = 0
        self.end = len(buf)
        self.file = file

    def fail(self, what: str) -> GGUFError:
        return GGUFError(f"{self.file}: {what} (at byte {self.pos})")

    def need(self, n: int, what: str) -> None:
        if n < 0 or self.pos + n > self.end:
            raise self.fail(f"truncated: {what} needs {n} bytes, {self.end - self.pos} left")

    def scalar(self, fmt: str, size: int, what: str) -> Any:
        self.need(size, what)
        (v,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += size
        return v

    def u32(self, what: str) -> int:
        return int(self.scalar("<I", 4, what))

    def u64(self, what: str) -> int:
        return int(self.scalar("<Q", 8, what))

    def string(self, what: str, limit: int | None = None) -> str:
        n = self.u64(f"length of {what}")
        if limit is not None and n > limit:
            raise self.fail(f"{what} is {n} bytes long (limit {limit})")
        self.need(n, what)
        raw = bytes(self.buf[self.pos : self.pos + n])
        self.pos += n
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise self.fail(f"{what} is not valid UTF-8 ({e.reason} at byte {e.start})") from None


def _read_value(cur: _Cursor, vtype: int, key: str, depth: int = 0) -> tuple[Any, TypeInfo]:
    try:
        vt = ValueType(vtype)
    except ValueError:
        raise cur.fail(f"key {key!r}: unknown value type {vtype}") from None
    if vt in SCALAR:
        fmt, dt = SCALAR[vt]
        v = cur.scalar(fmt, dt.itemsize, f"value of {key!r}")
        if vt == ValueType.BOOL:
            v = bool(v)
        return v, TypeInfo(vt)
    if vt == ValueType.STRING:
        return cur.string(f"value of {key!r}"), TypeInfo(vt)
    # array
    if depth >= MAX_ARRAY_DEPTH:
        raise cur.fail(f"key {key!r}: arrays nested deeper than {MAX_ARRAY_DEPTH}")
    etype = cur.u32(f"element type of {key!r}")
    count = cur.u64(f"element count of {key!r}")
    try:
        et = ValueType(etype)
    except ValueError:
        raise cur.fail(f"key {key!r}: unknown array element type {etype}") from None
    left = cur.end - cur.pos
    if et in SCALAR:
        dt = SCALAR[et][1]
        if count > left // dt.itemsize:
            raise cur.fail(f"key {key!r}: array of {count} {et.name} does not fit in the {left} bytes left")
        n = count * dt.itemsize
        arr = np.frombuffer(cur.buf, dtype=dt, count=count, offset=cur.pos).copy()
        cur.pos += n
        if et == ValueType.BOOL and count and arr.view(np.uint8).max() > 1:
            raise cur.fail(f"key {key!r}: bool array holds values other than 0 and 1")
        arr.flags.writeable = False
        return arr, TypeInfo(vt, TypeInfo(et))
    # strings (8-byte length each at least) and nested arrays (12 bytes at least)
    min_size = 8 if et == ValueType.STRING else 12
    if count > left // min_size:
        raise cur.fail(f"key {key!r}: array of {count} {et.name} does not fit in the {left} bytes left")
    items: list[Any] = []
    sub = TypeInfo(et)
    if et == ValueType.STRING:
        try:
            if count > LAZY_STRINGS:
                start = cur.pos
                bounds, cur.pos = index_strings(cur.buf, cur.pos, count)
                return StringArray(bytes(cur.buf[start : cur.pos]), bounds), TypeInfo(vt, sub)
            items, cur.pos = scan_strings(cur.buf, cur.pos, count)
        except ScanError as e:
            i, reason = e.args
            raise cur.fail(f"string {i} of {key!r}: {reason}") from None
    else:
        for _ in range(count):
            v, sub_i = _read_value(cur, et, key, depth + 1)
            items.append(v)
            sub = sub_i
    return items, TypeInfo(vt, sub)


class GGUFFile:
    """A parsed GGUF file over a read-only memory map. Close it (or use
    ``with``) to release the map; bound ggml tensors keep it alive on their
    own."""

    def __init__(self, path: str | os.PathLike[str]):
        self.path = Path(path)
        name = str(self.path)
        try:
            fd = os.open(self.path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))  # a FIFO must not block the open
        except FileNotFoundError:
            raise GGUFError(f"{name}: no such file", hint="check the path or run `toy list`") from None
        except IsADirectoryError:
            raise GGUFError(f"{name}: is a directory, not a GGUF file") from None
        except OSError as e:
            raise GGUFError(f"{name}: cannot open ({e.strerror})") from None
        try:
            st = os.fstat(fd)
            if stat.S_ISDIR(st.st_mode):
                raise GGUFError(f"{name}: is a directory, not a GGUF file")
            if not stat.S_ISREG(st.st_mode):
                raise GGUFError(f"{name}: not a regular file ({file_kind(st.st_mode)})")
            size = st.st_size
            if size < 24:
                raise GGUFError(f"{name}: not a GGUF file (only {size} bytes)")
            self._map = mmap.mmap(fd, 0, access=mmap.ACCESS_READ)
        except OSError as e:
            raise GGUFError(f"{name}: cannot map ({e.strerror})") from None
        finally:
            os.close(fd)
        self.size = size
        self._view = memoryview(self._map)
        try:
            self._parse(name)
        except BaseException:
            self.close()
            raise

    def _parse(self, name: str) -> None:
        cur = _Cursor(self._view, name)
        magic = bytes(self._view[:4])
        if magic != MAGIC:
            raise GGUFError(f"{name}: not a GGUF file (magic {magic!r}, expected {MAGIC!r})")
        cur.pos = 4
        version = cur.u32("version")
        if version not in VERSIONS:
            swapped = int.from_bytes(version.to_bytes(4, "little"), "big")
            extra = " (a big-endian file?)" if swapped in VERSIONS else ""
            raise GGUFError(f"{name}: unsupported GGUF version {version}{extra}; toy reads versions 2 and 3")
        self.version = version
        n_tensors = cur.u64("tensor count")
        n_kv = cur.u64("metadata count")
        if n_tensors > MAX_TENSORS:
            raise GGUFError(f"{name}: absurd tensor count {n_tensors} (limit {MAX_TENSORS})")
        if n_kv > MAX_KV:
            raise GGUFError(f"{name}: absurd metadata count {n_kv} (limit {MAX_KV})")

        self.metadata: dict[str, Any] = {}
        self.types: dict[str, TypeInfo] = {}
        for i in range(n_kv):
            key = cur.string(f"key {i}", limit=MAX_KEY_BYTES)
            if key in self.metadata:
                raise cur.fail(f"duplicate key {key!r}")
            vtype = cur.u32(f"type of {key!r}")
            value, info = _read_value(cur, vtype, key)
            self.metadata[key] = value
            self.types[key] = info

        align = self.metadata.get("general.alignment", DEFAULT_ALIGNMENT)
        if self.types.get("general.alignment", TypeInfo(ValueType.UINT32)).type != ValueType.UINT32:
            raise GGUFError(f"{name}: general.alignment must be a uint32")
        if not (isinstance(align, int) and align > 0 and (align & (align - 1)) == 0 and align <= 1 << 16):
            raise GGUFError(f"{name}: general.alignment {align} is not a power of two in 1..65536")
        self.alignment = align

        infos: list[tuple[str, tuple[int, ...], toy_ggml.GGMLType, int, int]] = []
        seen: set[str] = set()
        for i in range(n_tensors):
            tname = cur.string(f"name of tensor {i}", limit=MAX_KEY_BYTES)
            if tname in seen:
                raise cur.fail(f"duplicate tensor name {tname!r}")
            if len(tname.encode()) >= 64:
                raise cur.fail(f"tensor name {tname[:80]!r} is longer than ggml's 63 bytes")
            seen.add(tname)
            n_dims = cur.u32(f"dimension count of {tname!r}")
            if not 1 <= n_dims <= MAX_DIMS:
                raise cur.fail(f"tensor {tname!r} has {n_dims} dimensions (1..{MAX_DIMS} supported)")
            dims = [cur.u64(f"dimension {d} of {tname!r}") for d in range(n_dims)]
            tag = cur.u32(f"type of {tname!r}")
            offset = cur.u64(f"offset of {tname!r}")
            ti = _ggml_type(tag)
            if ti is None:
                raise cur.fail(f"tensor {tname!r} has unknown ggml type {tag}")
            gt, blck, bsize = ti
            n = 1
            for d in dims:
                if d == 0 or d > (1 << 62) // n:
                    raise cur.fail(f"tensor {tname!r} has bad dimensions {dims}")
                n *= d
            if dims[0] % blck != 0:
                raise cur.fail(
                    f"tensor {tname!r}: first dimension {dims[0]} is not a multiple of the {gt.name} block size {blck}"
                )
            nbytes = n // blck * bsize
            if offset % align != 0:
                raise cur.fail(f"tensor {tname!r}: offset {offset} is not aligned to {align}")
            infos.append((tname, tuple(reversed(dims)), gt, offset, nbytes))

        self.data_offset = (cur.pos + align - 1) // align * align
        data_size = self.size - self.data_offset
        if data_size < 0:
            raise GGUFError(f"{name}: truncated before the tensor data")
        spans = []
        self.tensors: dict[str, TensorInfo] = {}
        for tname, shape, gt, offset, nbytes in infos:
            if offset > data_size or nbytes > data_size - offset:
                raise GGUFError(
                    f"{name}: tensor {tname!r} ({nbytes} bytes at data offset {offset}) lies outside the file "
                    f"({data_size} bytes of data)"
                )
            spans.append((offset, offset + nbytes, tname))
            self.tensors[tname] = TensorInfo(tname, shape, gt, offset, nbytes)
        spans.sort()
        for (_s0, e0, n0), (s1, _e1, n1) in zip(spans, spans[1:]):
            if s1 < e0:
                raise GGUFError(f"{name}: tensors {n0!r} and {n1!r} overlap")

    # -- access

    @property
    def architecture(self) -> str | None:
        a = self.metadata.get("general.architecture")
        return a if isinstance(a, str) else None

    def tensor_bytes(self, name: str) -> memoryview:
        """Read-only view of a tensor's bytes inside the map."""
        t = self.tensors[name]
        start = self.data_offset + t.offset
        return self._view[start : start + t.nbytes]

    def tensor_to_float(self, name: str) -> np.ndarray:
        """A float32 copy of a tensor, dequantized through ggml."""
        t = self.tensors[name]
        return toy_ggml.dequantize(self.tensor_bytes(name), int(t.dtype), t.shape)

    @property
    def n_params(self) -> int:
        return sum(t.n_elements for t in self.tensors.values())

    def close(self) -> None:
        """Release this object's hold on the map (tensors bound to it keep
        their own)."""
        view = getattr(self, "_view", None)
        if view is not None:
            view.release()
            self._view = None  # type: ignore[assignment]  # None only once closed; an open file's is a memoryview
        m = getattr(self, "_map", None)
        if m is not None:
            try:
                m.close()
            except BufferError:
                pass  # still exported to bound tensors; freed when they go
            self._map = None  # type: ignore[assignment]  # None only once closed; an open file's is an mmap

    def __enter__(self) -> GGUFFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<GGUFFile {self.path.name} v{self.version} {len(self.metadata)} keys {len(self.tensors)} tensors>"
