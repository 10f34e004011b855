"""Write GGUF v3 files atomically.

``GGUFWriter(path)`` collects metadata and tensors, then ``write()`` streams
them to a temporary file in the destination folder and renames it into
place, so a reader never sees a half-written file and a crash leaves any
previous file untouched.

Metadata types: ``add(key, value, type=None)``. Without a type, Python values
map to BOOL, INT32 (or INT64 when out of range), FLOAT32, STRING; NumPy
arrays to arrays of their dtype; lists of str to string arrays. Pass the type
(a ``TypeInfo``, e.g. from ``GGUFFile.types``) to reproduce a file exactly.

Tensors: ``add_tensor(name, array)`` for float/int NumPy data (stored as
its ggml type, or quantized through ggml with ``dtype=``), or
``add_tensor_bytes(name, shape, dtype, data)`` for data already in ggml
layout (e.g. copied from another GGUF).
"""

from __future__ import annotations

import os
import struct
import tempfile
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO

import numpy as np

import toy_ggml
from toy.gguf.constants import DEFAULT_ALIGNMENT, DTYPE_TO_VALUE_TYPE, MAGIC, SCALAR, ValueType
from toy.gguf.reader import GGUFError, GGUFFile, TypeInfo

if TYPE_CHECKING:
    from typing_extensions import Buffer  # collections.abc.Buffer from Python 3.12

_NP_TO_GGML: dict[np.dtype[Any], toy_ggml.GGMLType] = {
    np.dtype(np.float32): toy_ggml.GGMLType.F32,
    np.dtype(np.float16): toy_ggml.GGMLType.F16,
    np.dtype(np.float64): toy_ggml.GGMLType.F64,
    np.dtype(np.int8): toy_ggml.GGMLType.I8,
    np.dtype(np.int16): toy_ggml.GGMLType.I16,
    np.dtype(np.int32): toy_ggml.GGMLType.I32,
    np.dtype(np.int64): toy_ggml.GGMLType.I64,
}


def _infer(value: Any) -> TypeInfo:
    if isinstance(value, bool):
        return TypeInfo(ValueType.BOOL)
    if isinstance(value, int):
        if -(1 << 31) <= value < (1 << 31):
            return TypeInfo(ValueType.INT32)
        if -(1 << 63) <= value < (1 << 63):
            return TypeInfo(ValueType.INT64)
        if 0 <= value < (1 << 64):
            return TypeInfo(ValueType.UINT64)
        raise ValueError(f"integer {value} does not fit in 64 bits")
    if isinstance(value, float):
        return TypeInfo(ValueType.FLOAT32)
    if isinstance(value, str):
        return TypeInfo(ValueType.STRING)
    if isinstance(value, np.ndarray):
        vt = DTYPE_TO_VALUE_TYPE.get(value.dtype.newbyteorder("<"))
        if vt is None or value.ndim != 1:
            raise ValueError(f"cannot store a {value.dtype} array of {value.ndim} dimensions in GGUF metadata")
        return TypeInfo(ValueType.ARRAY, TypeInfo(vt))
    if isinstance(value, (list, tuple)):
        if not value:
            raise ValueError("cannot infer the element type of an empty list; pass type=")
        subs = {_infer(v) for v in value}
        if len(subs) != 1:
            raise ValueError("list elements have mixed types; pass type=")
        return TypeInfo(ValueType.ARRAY, subs.pop())
    raise ValueError(f"cannot store {type(value).__name__} in GGUF metadata")


def _encode(out: list[bytes], value: Any, info: TypeInfo, key: str) -> None:
    vt = info.type
    if vt in SCALAR:
        fmt = SCALAR[vt][0]
        try:
            out.append(struct.pack(fmt, value))
        except struct.error as e:
            raise ValueError(f"{key}: {value!r} is not a valid {vt.name}: {e}") from None
    elif vt == ValueType.STRING:
        if not isinstance(value, str):
            raise ValueError(f"{key}: expected a string, got {type(value).__name__}")
        b = value.encode("utf-8")
        out.append(struct.pack("<Q", len(b)))
        out.append(b)
    elif vt == ValueType.ARRAY:
        sub = info.sub
        if sub is None:
            raise ValueError(f"{key}: array type without element type")
        out.append(struct.pack("<IQ", int(sub.type), len(value)))
        if sub.type in SCALAR:
            dt = SCALAR[sub.type][1]
            arr = np.asarray(value)
            if arr.size and not np.can_cast(arr.dtype, dt, casting="same_kind") and arr.dtype.kind != dt.kind:
                raise ValueError(f"{key}: cannot store {arr.dtype} values as {sub.type.name}")
            out.append(np.ascontiguousarray(arr, dtype=dt).tobytes())
        else:
            for v in value:
                _encode(out, v, sub, key)
    else:
        raise ValueError(f"{key}: unknown value type {vt}")


def publish(tmp: str | os.PathLike[str], path: str | os.PathLike[str]) -> None:
    """Put a finished temporary file in place: give it the usual umask-based
    mode (mkstemp makes it 0600), then rename it to ``path`` (atomic on one
    file system, so a reader sees the old file or the whole new one)."""
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o666 & ~umask)
    os.replace(tmp, path)


def header_bytes(
    kv: Iterable[tuple[str, Any, TypeInfo]],
    tensors: Iterable[tuple[str, tuple[int, ...], Any, int]],
    alignment: int = DEFAULT_ALIGNMENT,
) -> tuple[bytes, list[int]]:
    """The GGUF v3 header of ``kv`` ((key, value, type)) and ``tensors``
    ((name, shape in NumPy order, ggml type, data bytes)), padded to
    ``alignment``, and each tensor's offset in the data section (each
    aligned). A streaming writer (``toy.convert``'s import) writes the
    header, then each tensor's bytes at its offset, without holding them."""
    kv, tensors = list(kv), list(tensors)
    header: list[bytes] = [MAGIC, struct.pack("<IQQ", 3, len(tensors), len(kv))]
    for key, value, info in kv:
        kb = key.encode()
        header += [struct.pack("<Q", len(kb)), kb, struct.pack("<I", int(info.type))]
        _encode(header, value, info, key)
    offsets, offset = [], 0
    for name, shape, gt, nbytes in tensors:
        nb = name.encode()
        dims = tuple(reversed(shape))
        header.append(struct.pack("<Q", len(nb)) + nb + struct.pack("<I", len(dims)))
        header.append(struct.pack(f"<{len(dims)}Q", *dims))
        header.append(struct.pack("<IQ", int(gt), offset))
        offsets.append(offset)
        offset = (offset + nbytes + alignment - 1) // alignment * alignment
    head = b"".join(header)
    return head + b"\0" * ((-len(head)) % alignment), offsets


@contextmanager
def atomic_output(path: str | os.PathLike[str]) -> Iterator[BinaryIO]:
    """A binary file that becomes ``path`` only when the ``with`` block ends
    without an error (written to a temporary file in the same folder,
    fsynced, then ``publish``ed); on any error the temporary file is removed
    and ``path`` is left as it was."""
    dst = Path(path)
    dst.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{dst.name}.", suffix=".tmp", dir=dst.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        publish(tmp, dst)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


class GGUFWriter:
    def __init__(self, path: str | os.PathLike[str], alignment: int = DEFAULT_ALIGNMENT):
        if alignment <= 0 or alignment & (alignment - 1):
            raise ValueError(f"alignment {alignment} is not a power of two")
        self.path = Path(path)
        self.alignment = alignment
        self._kv: dict[str, tuple[Any, TypeInfo]] = {}
        self._tensors: dict[str, tuple[tuple[int, ...], toy_ggml.GGMLType, Any]] = {}
        if alignment != DEFAULT_ALIGNMENT:
            self.add("general.alignment", alignment, TypeInfo(ValueType.UINT32))

    def add(self, key: str, value: Any, type: TypeInfo | None = None) -> None:
        if not isinstance(key, str) or not key:
            raise ValueError("metadata keys are non-empty strings")
        if key in self._kv:
            raise ValueError(f"duplicate metadata key {key!r}")
        info = type or _infer(value)
        _encode([], value, info, key)  # validate now, not at write time
        self._kv[key] = (value, info)

    def add_tensor(self, name: str, array: np.ndarray, dtype: toy_ggml.GGMLType | str | None = None) -> None:
        """A tensor from NumPy data (NumPy-order shape). ``dtype`` quantizes
        float data through ggml (e.g. "Q8_0"); default: the array's type."""
        arr = np.asarray(array)
        if dtype is None:
            gt = _NP_TO_GGML.get(arr.dtype)
            if gt is None:
                raise ValueError(f"tensor {name!r}: no ggml type for {arr.dtype}; pass dtype=")
            data = np.ascontiguousarray(arr).tobytes()
        else:
            gt = toy_ggml.GGMLType.parse(dtype)
            data = self._convert(name, arr, gt)
        self.add_tensor_bytes(name, arr.shape, gt, data)

    @staticmethod
    def _convert(name: str, arr: np.ndarray, gt: toy_ggml.GGMLType) -> bytes:
        npt = {v: k for k, v in _NP_TO_GGML.items()}.get(gt)
        if npt is not None:
            return np.ascontiguousarray(arr, dtype=npt).tobytes()
        try:
            return toy_ggml.quantize(np.asarray(arr, dtype=np.float32), int(gt)).tobytes()
        except ValueError as e:
            raise ValueError(f"tensor {name!r}: {e}") from None

    def add_tensor_bytes(
        self, name: str, shape: Iterable[int], dtype: toy_ggml.GGMLType | int | str, data: Buffer | np.ndarray
    ) -> None:
        """A tensor whose bytes are already in ggml layout for ``dtype``."""
        if name in self._tensors:
            raise ValueError(f"duplicate tensor name {name!r}")
        if len(name.encode()) >= 64:
            raise ValueError(f"tensor name {name!r} is longer than ggml's 63 bytes")
        gt = toy_ggml.GGMLType.parse(dtype)
        shape = tuple(int(d) for d in shape)
        if not 1 <= len(shape) <= 4 or any(d <= 0 for d in shape):
            raise ValueError(f"tensor {name!r}: bad shape {shape}")
        traits = toy_ggml.type_info(gt)
        blck, tsize = traits.block_size, traits.type_size
        if shape[-1] % blck:
            raise ValueError(
                f"tensor {name!r}: last extent {shape[-1]} is not a multiple of the {gt.name} block {blck}"
            )
        n = 1
        for d in shape:
            n *= d
        want = n // blck * tsize
        # numpy arrays are buffers, which numpy's stubs declare (__buffer__) for Python 3.12+ only
        mv = memoryview(data).cast("B")  # type: ignore[arg-type]
        if len(mv) != want:
            raise ValueError(f"tensor {name!r}: {len(mv)} bytes given, {gt.name} {shape} needs {want}")
        self._tensors[name] = (shape, gt, mv)

    def write(self) -> Path:
        """Write the file atomically; returns its path."""
        head, offsets = header_bytes(
            ((key, value, info) for key, (value, info) in self._kv.items()),
            ((name, shape, gt, len(mv)) for name, (shape, gt, mv) in self._tensors.items()),
            self.alignment,
        )
        with atomic_output(self.path) as f:
            f.write(head)
            for off, (_, _, mv) in zip(offsets, self._tensors.values(), strict=True):
                cur = f.tell() - len(head)
                if cur < off:
                    f.write(b"\0" * (off - cur))
                f.write(mv)
        return self.path


def copy_metadata(
    src: GGUFFile, writer: GGUFWriter, skip: set[str] | None = None, override: dict[str, Any] | None = None
) -> None:
    """Copy every metadata key of a GGUFFile (with its on-disk type and in
    its order); ``override`` replaces the values of keys it names."""
    for key, value in src.metadata.items():
        if skip and key in skip:
            continue
        if key == "general.alignment" and key in writer._kv:
            continue
        writer.add(key, override[key] if override and key in override else value, src.types[key])


__all__ = ["GGUFWriter", "GGUFError", "atomic_output", "copy_metadata", "header_bytes", "publish"]
