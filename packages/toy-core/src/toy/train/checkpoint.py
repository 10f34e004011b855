"""Checkpoints: GGUF models llama.cpp loads, plus the state to resume exactly.

A checkpoint at optimizer step N is two files in ``<run>/checkpoints/``:

- ``step_N.gguf``: the model. Standard llama.cpp metadata
  (``general.type = model``, ``general.architecture`` and the architecture's
  dimension keys from the registry, ``general.file_type`` 0 = all F32,
  ``general.quantization_version``) and tensor names, the tokenizer embedded (``tokenizer.*``), F32
  weights, and a few ``toy.train.*`` keys (run id, step) that other readers
  ignore. ``toy infer`` and llama.cpp load it unchanged.
- ``step_N.state.gguf``: what resuming needs beyond the weights: AdamW's
  moments (``adam_m.<name>``, ``adam_v.<name>``, F32) and, as JSON strings,
  the resolved config, the data cursor, the RNG state and counters
  (``toy.state.*``).

``latest`` is a symbolic link to the newest ``step_N.gguf``. Writing order
makes a crash harmless: both files are written to temporary names and renamed
into place (``GGUFWriter``), then ``latest`` is re-pointed by renaming a new
link over it. Until that rename, ``latest`` names the previous, complete
checkpoint; a state file without its model (or the reverse) is ignored.
Older checkpoints beyond ``keep`` are deleted after the new one is in place.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from toy.errors import BadInputError
from toy.gguf import GGUFFile, GGUFWriter
from toy.gguf.constants import ValueType
from toy.gguf.convert import QUANT_VERSION
from toy.gguf.reader import TypeInfo

_STEP_RE = re.compile(r"^step_(\d+)\.gguf$")


class CheckpointError(BadInputError):
    """A run folder or checkpoint cannot be resumed from; the message says why."""


def model_metadata(cfg, name: str) -> dict[str, Any]:
    """The GGUF metadata of a checkpoint of this config with F32 weights, as
    llama.cpp's converter writes it: ``general.type = "model"``, the
    architecture's keys (``arch.metadata``), ``general.file_type`` 0 (all
    F32) and ``general.quantization_version``."""
    from toy import models

    u32 = TypeInfo(ValueType.UINT32)
    return {
        "general.type": "model",
        **models.of(cfg).metadata(cfg, name),
        "general.file_type": (0, u32),
        "general.quantization_version": (QUANT_VERSION, u32),
    }


@dataclass
class Resumable:
    """What ``load`` gives back."""

    step: int
    model_path: Path
    params: dict[str, np.ndarray]
    optimizer: dict[str, np.ndarray]
    state: dict[str, Any]  # config, data cursor, rng, counters
    tokenizer_metadata: dict[str, Any]


def _relink(link: Path, target_name: str) -> None:
    tmp = link.with_name(f".{link.name}.{os.getpid()}.tmp")
    try:
        tmp.unlink()
    except FileNotFoundError:
        pass
    os.symlink(target_name, tmp)
    os.replace(tmp, link)


def list_steps(folder: Path) -> list[int]:
    """Steps that have both a model and a state file, ascending."""
    out = []
    if folder.is_dir():
        for p in folder.iterdir():
            m = _STEP_RE.match(p.name)
            if m and (folder / f"step_{m.group(1)}.state.gguf").is_file():
                out.append(int(m.group(1)))
    return sorted(out)


def save(
    folder: str | Path,
    *,
    step: int,
    cfg,
    params: dict[str, np.ndarray],
    optimizer: dict[str, np.ndarray],
    tokenizer_metadata: dict[str, Any],
    state: dict[str, Any],
    run_id: str,
    keep: int = 0,
    write_model=None,
) -> Path:
    """Write the checkpoint of ``step`` and point ``latest`` at it; returns
    the model file's path. ``tokenizer_metadata``: ``tokenizer.*`` keys,
    values optionally ``(value, TypeInfo)`` pairs (kept exactly).
    ``write_model(path, params, step, run_id)`` (optional) writes the model
    file instead of the llama model below: a LoRA run writes its adapter, a
    full fine-tune the base's metadata with the trained weights."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    model_path = folder / f"step_{step}.gguf"
    w = None
    if write_model is None:
        w = GGUFWriter(model_path)
        for k, v in {**model_metadata(cfg, run_id), **tokenizer_metadata}.items():
            if isinstance(v, tuple):
                w.add(k, v[0], v[1])
            else:
                w.add(k, v)
        w.add("toy.train.run_id", run_id)
        w.add("toy.train.step", int(step))
        for name, a in params.items():
            w.add_tensor(name, np.ascontiguousarray(a, np.float32))
    state_path = folder / f"step_{step}.state.gguf"
    s = GGUFWriter(state_path)
    s.add("toy.state.step", int(step))
    s.add("toy.state.run_id", run_id)
    s.add("toy.state.json", json.dumps(state, sort_keys=True))
    for name, a in optimizer.items():
        s.add_tensor(name, np.ascontiguousarray(a, np.float32))
    s.write()  # the state first: a model file only ever appears with its state
    if w is not None:
        w.write()
    else:
        write_model(model_path, params, step, run_id)
    _relink(folder / "latest", model_path.name)
    if keep > 0:
        for old in list_steps(folder)[:-keep]:
            if old != step:
                for suffix in (".gguf", ".state.gguf"):
                    try:
                        (folder / f"step_{old}{suffix}").unlink()
                    except FileNotFoundError:
                        pass
    return model_path


def latest_step(folder: str | Path) -> int | None:
    """The step ``latest`` points at (if its state file exists), else the
    newest complete step, else None."""
    folder = Path(folder)
    link = folder / "latest"
    if link.is_symlink() or link.exists():
        m = _STEP_RE.match(os.readlink(link) if link.is_symlink() else link.name)
        if m and (folder / f"step_{m.group(1)}.state.gguf").is_file() and (folder / m.group(0)).is_file():
            return int(m.group(1))
    steps = list_steps(folder)
    return steps[-1] if steps else None


def _detach(v: Any) -> Any:
    """A metadata value that outlives its file's mapping."""
    if isinstance(v, np.ndarray):
        return v.copy()
    if hasattr(v, "tolist") and not isinstance(v, (str, bytes)):
        return v.tolist()
    return v


def tokenizer_metadata_of(gf: GGUFFile) -> dict[str, Any]:
    """The ``tokenizer.*`` keys of an open GGUF as ``(value, TypeInfo)`` pairs."""
    return {k: (_detach(v), gf.types[k]) for k, v in gf.metadata.items() if k.startswith("tokenizer.")}


def load(folder: str | Path, step: int | None = None) -> Resumable:
    """Read a checkpoint (default: the latest) back as float arrays."""
    folder = Path(folder)
    if step is None:
        step = latest_step(folder)
        if step is None:
            raise CheckpointError(f"{folder}: no complete checkpoint to resume from")
    model_path = folder / f"step_{step}.gguf"
    state_path = folder / f"step_{step}.state.gguf"
    for p in (model_path, state_path):
        if not p.is_file():
            raise CheckpointError(f"{p}: missing")
    with GGUFFile(model_path) as gf:
        params = {n: np.array(gf.tensor_to_float(n), np.float32) for n in gf.tensors}
        tok = tokenizer_metadata_of(gf)
    with GGUFFile(state_path) as sf:
        if int(sf.metadata.get("toy.state.step", -1)) != step:
            raise CheckpointError(f"{state_path}: its step does not match {model_path.name}")
        optimizer = {n: np.array(sf.tensor_to_float(n), np.float32) for n in sf.tensors}
        state = json.loads(sf.metadata["toy.state.json"])
    return Resumable(step, model_path, params, optimizer, state, tok)


__all__ = [
    "CheckpointError",
    "Resumable",
    "latest_step",
    "list_steps",
    "model_metadata",
    "load",
    "save",
    "tokenizer_metadata_of",
]
