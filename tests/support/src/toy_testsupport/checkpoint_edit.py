"""Hand-edited training checkpoints: what a user or a script could write,
made to pass toy's checksums, so a test shows that the validation on resume,
not the integrity check, is what refuses it.

``edit_checkpoint(folder, step, optimizer=, state=, params=, metadata=)``
rewrites ``step_<step>.gguf`` / ``step_<step>.state.gguf`` in place: each
callback gets the current value (optimizer tensors ``{name: F32 array}``,
the decoded ``toy.state.json``, the model file's tensors, the state file's
other metadata ``{key: value}``) and edits it in place or returns a
replacement. The checksums (``toy.state.checksums``) are recomputed the way
``toy.train.checkpoint.save`` computes them: CRC-32 of the model file's
bytes, of the ``toy.state.json`` string and of each optimizer tensor's
bytes. ``types`` maps an optimizer tensor's name to the type to store it
as (``"F16"``; default F32).
"""

from __future__ import annotations

import json
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from toy.gguf import GGUFFile, GGUFWriter
from toy.gguf.writer import copy_metadata

CHECKSUMS = "toy.state.checksums"


def _apply(fn: Callable[[Any], Any] | None, value: Any) -> Any:
    if fn is None:
        return value
    out = fn(value)
    return value if out is None else out


def _crc(a: np.ndarray) -> int:
    return zlib.crc32(memoryview(np.ascontiguousarray(a)).cast("B"))


def edit_checkpoint(
    folder: str | Path,
    step: int,
    *,
    optimizer: Callable[[dict[str, np.ndarray]], Any] | None = None,
    state: Callable[[Any], Any] | None = None,
    params: Callable[[dict[str, np.ndarray]], Any] | None = None,
    metadata: Callable[[dict[str, Any]], Any] | None = None,
    types: dict[str, str] | None = None,
) -> None:
    folder = Path(folder)
    model_path, state_path = folder / f"step_{step}.gguf", folder / f"step_{step}.state.gguf"
    if params is not None:
        with GGUFFile(model_path) as gf:
            values = {n: np.array(gf.tensor_to_float(n), np.float32) for n in gf.tensors}
            w = GGUFWriter(model_path)
            copy_metadata(gf, w)
        for n, a in _apply(params, values).items():
            w.add_tensor(n, np.ascontiguousarray(a, np.float32))
        w.write()
    with GGUFFile(state_path) as sf:
        tensors = {n: np.array(sf.tensor_to_float(n), np.float32) for n in sf.tensors}
        record = json.loads(sf.metadata["toy.state.json"])
        meta = {k: v for k, v in sf.metadata.items() if k not in (CHECKSUMS, "toy.state.json")}
        w = GGUFWriter(state_path)
        if metadata is None:
            copy_metadata(sf, w, skip={CHECKSUMS, "toy.state.json"})
    if metadata is not None:
        for k, v in _apply(metadata, meta).items():
            w.add(k, v)
    state_json = json.dumps(_apply(state, record), sort_keys=True)
    w.add("toy.state.json", state_json)
    crcs = {}
    for n, a in _apply(optimizer, tensors).items():
        kind = (types or {}).get(n)
        stored = np.ascontiguousarray(a, np.float32)
        if kind is not None:
            stored = np.ascontiguousarray(stored, {"F16": np.float16}[kind])
        crcs[n] = _crc(stored.astype(np.float32))  # the writer's checksum: of the values read back as F32
        w.add_tensor(n, stored)
    model_crc = zlib.crc32(model_path.read_bytes())
    w.add(CHECKSUMS, json.dumps({"model": model_crc, "json": zlib.crc32(state_json.encode()), "tensors": crcs}))
    w.write()


__all__ = ["edit_checkpoint"]
