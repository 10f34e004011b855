"""Read Hugging Face safetensors weights one tensor at a time, without torch.

A safetensors file is an 8-byte little-endian header length, a JSON header
(tensor name -> ``dtype``, ``shape``, ``data_offsets`` relative to the end of
the header, plus an optional ``__metadata__``), then the tensor bytes. A
sharded checkpoint adds ``model.safetensors.index.json`` whose ``weight_map``
names the shard of every tensor.

``SafetensorsFolder(folder)`` reads and checks every header up front (names,
dtypes, shapes against byte ranges, ranges inside the file, no overlap), so
a truncated shard or a header that lies about its offsets is refused before
anything is written. ``read(name)`` then maps only that tensor's bytes
(``mmap`` of the page-aligned range), copies them into a NumPy array and
unmaps, so the resident memory of a conversion stays near one tensor, not
the model.

One file alone: ``read_header(path)`` (the checked tensor table; the
tensors must tile the data section exactly, as the safetensors library
requires), ``read_metadata(path)`` (its ``__metadata__``) and
``read_ref(ref, start, stop)`` (rows of one tensor). ``write_safetensors``
writes a file streaming, one array at a time (the export and PEFT's).

Why not the ``safetensors`` library: its NumPy API cannot read BF16 tensors
(``safe_open(..., framework="np")`` raises "data type 'bfloat16' not
understood" in safetensors 0.8.0, NumPy having no bfloat16), which most
current checkpoints are; its torch API would bring torch to run time; and its
writer takes every tensor at once, where the export streams them. The format
is a JSON header and raw little-endian bytes, so the reader here is short and
checks more than a loader needs to (gaps, overlaps, lying offsets).

BF16 has no NumPy dtype: its 16 bits are the top half of a float32, so
``read`` returns it widened to float32 by a 16-bit shift (exact). F16 is
returned as float16, F32 as float32.

Errors are ``SafetensorsError`` (a ``BadInputError``) naming the file and,
where there is one, the tensor.
"""

from __future__ import annotations

import json
import mmap
import os
import struct
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from toy.errors import BadInputError

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
# header sizes above this are refused (the format's own readers cap it at 100 MB)
MAX_HEADER = 100 * 1024 * 1024

_DTYPES: dict[str, tuple[np.dtype, int]] = {
    "F32": (np.dtype("<f4"), 4),
    "F16": (np.dtype("<f2"), 2),
    "BF16": (np.dtype("<u2"), 2),
}


class SafetensorsError(BadInputError):
    """A safetensors file or index that cannot be read as it claims."""


@dataclass(frozen=True)
class TensorRef:
    """Where one tensor's bytes are: ``file``, absolute ``offset``, ``nbytes``."""

    name: str
    file: Path
    dtype: str  # "F32", "F16" or "BF16"
    shape: tuple[int, ...]
    offset: int
    nbytes: int

    @property
    def size(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


def _bad(path: Path, what: str, hint: str | None = None) -> SafetensorsError:
    return SafetensorsError(
        f"{path}: {what}", hint or "re-download or re-save the checkpoint (save_pretrained)", field=str(path)
    )


def _load_header(path: Path) -> tuple[dict[str, Any], int, int]:
    """(the JSON header, where the data starts, the file's size) of one file."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise _bad(path, f"{size} bytes: too short for a safetensors file (no header length)")
            (n,) = struct.unpack("<Q", head)
            if n > MAX_HEADER or 8 + n > size:
                raise _bad(path, f"header length {n} does not fit the file's {size} bytes (truncated?)")
            raw = f.read(n)
    except OSError as e:
        raise _bad(path, f"cannot read: {e.strerror or e}") from None
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise _bad(path, f"header is not JSON ({e})") from None
    if not isinstance(header, dict):
        raise _bad(path, "header is not a JSON object")
    return header, 8 + n, size


def read_metadata(path: str | os.PathLike[str]) -> dict[str, str]:
    """The ``__metadata__`` of one safetensors file (string keys and values; empty when it has none)."""
    p = Path(path)
    header, _, _ = _load_header(p)
    meta = header.get("__metadata__", {})
    if not isinstance(meta, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in meta.items()):
        raise _bad(p, "__metadata__ is not an object of strings")
    return dict(meta)


def read_header(path: Path) -> list[TensorRef]:
    """The checked tensor table of one safetensors file, in header order:
    every dtype known, every byte range the size of its shape, and the
    ranges tiling the data section exactly (no overlap, no gap, nothing
    after the last tensor), as the safetensors library requires."""
    path = Path(path)
    header, base, size = _load_header(path)
    refs: list[TensorRef] = []
    for name, info in header.items():
        if name == "__metadata__":
            continue
        if not isinstance(info, dict):
            raise _bad(path, f"tensor {name!r}: header entry is not an object")
        dtype, shape, offs = info.get("dtype"), info.get("shape"), info.get("data_offsets")
        if dtype not in _DTYPES:
            raise _bad(
                path,
                f"tensor {name!r} has dtype {dtype!r}",
                "toy imports F32, F16 and BF16 weights; save the model in one of those",
            )
        if (
            not isinstance(shape, list)
            or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape)
            or not isinstance(offs, list)
            or len(offs) != 2
            or not all(isinstance(o, int) and not isinstance(o, bool) for o in offs)
        ):
            raise _bad(path, f"tensor {name!r}: malformed shape or data_offsets in the header")
        begin, end = offs
        count = 1
        for d in shape:
            count *= d
        want = count * _DTYPES[dtype][1]
        if begin < 0 or end < begin or end - begin != want:
            raise _bad(
                path,
                f"tensor {name!r}: data_offsets [{begin}, {end}] hold {end - begin} bytes, "
                f"{dtype} {tuple(shape)} needs {want}",
            )
        if base + end > size:
            raise _bad(
                path,
                f"tensor {name!r}: bytes [{base + begin}, {base + end}) run past the end of the file "
                f"({size} bytes; truncated?)",
            )
        refs.append(TensorRef(name, path, dtype, tuple(shape), base + begin, want))
    spans = sorted((r.offset, r.offset + r.nbytes, r.name) for r in refs if r.nbytes)
    for (_, e0, n0), (b1, _, n1) in zip(spans, spans[1:]):
        if b1 < e0:
            raise _bad(path, f"tensors {n0!r} and {n1!r} overlap in the file (the header lies about offsets)")
    end = base
    for b, e, name in spans:
        if b != end:
            raise _bad(path, f"tensor {name!r} starts at byte {b}, after a gap from byte {end} (data_offsets lie)")
        end = e
    if end != size:
        raise _bad(path, f"{size - end} bytes after the last tensor (the header does not describe the whole file)")
    return refs


def read_ref(ref: TensorRef, start: int = 0, stop: int | None = None) -> np.ndarray:
    """Rows ``start:stop`` (of the first axis; a 0-d tensor has one; all by
    default) of the tensor ``ref`` points at, as float32 (F32, BF16 widened)
    or float16 (F16), NumPy order: only those rows' bytes are mapped, and
    unmapped before this returns."""
    np_dtype = _DTYPES[ref.dtype][0]
    rows = ref.shape[0] if ref.shape else 1
    stop = rows if stop is None else stop
    if not 0 <= start <= stop <= rows:
        raise ValueError(f"rows {start}:{stop} of {ref.name!r} ({rows} rows)")
    shape = (stop - start, *ref.shape[1:]) if ref.shape else ref.shape
    row_bytes = ref.nbytes // rows if rows else 0
    nbytes = (stop - start) * row_bytes
    count = nbytes // np.dtype(np_dtype).itemsize
    if nbytes == 0:
        out = np.zeros(shape, dtype=np_dtype)
    else:
        first = ref.offset + start * row_bytes
        base = first - first % mmap.ALLOCATIONGRANULARITY
        skip = first - base
        try:
            with (
                open(ref.file, "rb") as f,
                mmap.mmap(f.fileno(), skip + nbytes, access=mmap.ACCESS_READ, offset=base) as m,
            ):
                view = np.frombuffer(m, dtype=np_dtype, count=count, offset=skip)
                out = view.reshape(shape).copy()
                del view
        except (OSError, ValueError) as e:
            raise _bad(ref.file, f"tensor {ref.name!r}: cannot map its bytes ({e})") from None
    if ref.dtype == "BF16":
        return (out.astype(np.uint32) << 16).view(np.float32)
    return out


class SafetensorsFolder:
    """Every tensor of a Hugging Face model folder (single file or sharded)."""

    def __init__(self, folder: str | os.PathLike[str]):
        self.folder = Path(folder)
        index = self.folder / INDEX_NAME
        single = self.folder / SINGLE_NAME
        self.tensors: dict[str, TensorRef] = {}
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
                if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
                    raise TypeError
            except (OSError, ValueError, KeyError, TypeError):
                raise _bad(index, "not a safetensors index (a JSON object with a weight_map of file names)") from None
            # shards in file-name order, each in its header's order (llama.cpp's converter's order)
            for shard in sorted(set(weight_map.values())):
                p = self.folder / shard
                if Path(shard).name != shard or not p.is_file():
                    raise SafetensorsError(
                        f"{index}: shard {shard!r} is missing from {self.folder}",
                        "download every shard the index names",
                        field=shard,
                    )
                for ref in read_header(p):
                    self._add(ref)
            for name, shard in weight_map.items():
                found = self.tensors.get(name)
                if found is None or found.file.name != shard:
                    raise _bad(index, f"tensor {name!r} is not in shard {shard!r} as the index says")
        elif single.is_file():
            for ref in read_header(single):
                self._add(ref)
        else:
            raise SafetensorsError(
                f"{self.folder}: no {SINGLE_NAME} or {INDEX_NAME}",
                "toy imports safetensors checkpoints (save_pretrained(..., safe_serialization=True))",
                field=str(self.folder),
            )

    def _add(self, ref: TensorRef) -> None:
        if ref.name in self.tensors:
            raise _bad(ref.file, f"tensor {ref.name!r} is also in {self.tensors[ref.name].file.name}")
        self.tensors[ref.name] = ref

    def __contains__(self, name: str) -> bool:
        return name in self.tensors

    def read(self, name: str) -> np.ndarray:
        """The tensor as float32 (F32, BF16) or float16 (F16), NumPy order."""
        ref = self.tensors[name]
        return self.read_rows(name, 0, ref.shape[0] if ref.shape else 1)

    def read_rows(self, name: str, start: int, stop: int) -> np.ndarray:
        """Rows ``start:stop`` (of the first axis; a 0-d tensor has one) as
        ``read`` gives the whole tensor: only those rows' bytes are mapped,
        and unmapped before this returns, so converting a tensor in blocks of
        rows keeps neither the whole source nor a whole copy resident."""
        return read_ref(self.tensors[name], start, stop)


def write_safetensors(
    path: str | os.PathLike[str],
    items: list[tuple[str, str, tuple[int, ...], int]],
    arrays: Iterable[np.ndarray],
    metadata: Mapping[str, str] | None = None,
) -> None:
    """Write one safetensors file, streaming: ``items`` (name, dtype
    ``"F32"``/``"F16"``/``"BF16"``, shape, nbytes) give the header,
    ``arrays`` the data one at a time in the same order (a BF16 array as
    its uint16 bits); the header's ``__metadata__`` is ``{"format": "pt"}``
    plus ``metadata``."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt", **(metadata or {})}}
    offset = 0
    for name, dtype, shape, nbytes in items:
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # the data starts 8-byte aligned
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for (name, _, shape, nbytes), a in zip(items, arrays, strict=True):
            data = np.ascontiguousarray(a).tobytes()
            if len(data) != nbytes or tuple(a.shape) != tuple(shape):  # a bug here must not write a wrong file
                raise AssertionError(f"{name}: {a.shape} / {len(data)} bytes, planned {shape} / {nbytes}")
            f.write(data)
