"""LoRA adapter files: GGUF in llama.cpp's format (``llama-cli --lora``
loads them; ``toy infer --lora`` and ``toy merge`` too). Reading, writing and
validating them; applying them to a model is ``toy.adapters.apply``.

The file (what llama.cpp's ``llama_adapter_lora_init`` checks):

- ``general.type`` = "adapter", ``adapter.type`` = "lora",
  ``general.architecture`` = the base model's (llama.cpp refuses a mismatch);
- ``adapter.lora.alpha`` (FLOAT32): llama.cpp scales each product by
  ``alpha / rank`` (rank = the rows of ``lora_a``). toy writes the alpha that
  makes that equal to toy's scale: ``alpha`` itself for plain LoRA,
  ``alpha · sqrt(rank)`` for rank-stabilized LoRA (scale ``alpha/√rank``), so
  both programs apply the same update;
- per adapted weight ``W`` (GGUF name ``blk.N.attn_q.weight`` …, NumPy shape
  (out, in)) two F32 tensors: ``W.lora_a`` of NumPy shape (r, in) and
  ``W.lora_b`` of shape (out, r) (ggml ``ne`` [in, r] and [r, out]: "lora_a
  transposed", as llama.cpp demands). The update is ``W x + scale · B (A x)``.
  A mixture of experts' stacked weight ``blk.N.ffn_{gate,up,down}_exps.weight``
  (NumPy (E, out, in)) takes a 3-D pair, one (A, B) per expert stacked as
  llama.cpp's ``convert_lora_to_gguf.py`` writes them: ``lora_a`` (E, r, in),
  ``lora_b`` (E, out, r); llama.cpp (``build_lora_mm_id``) and toy
  (``toy.models.moe``) apply expert e's pair to the rows routed to e.
- toy's own keys record how it was trained: ``toy.lora.targets`` (e.g.
  ["q", "k", "v", "o"]), ``toy.lora.rank``, ``toy.lora.alpha`` (the
  configured alpha), ``toy.lora.rslora``, ``toy.lora.dropout``,
  ``toy.lora.base`` (the base file's name) and ``general.name``.

Reading validates the same things llama.cpp does (type keys, pairs complete,
shapes consistent with each other) and, against a base model, that every
adapted weight exists with the right shape.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from toy.errors import BadInputError
from toy.gguf import GGUFFile, GGUFWriter, TypeInfo, ValueType


class AdapterError(BadInputError):
    """An adapter file is not a usable LoRA adapter (or not for this base)."""


@dataclass
class Adapter:
    """A LoRA adapter in memory: ``pairs`` maps a base weight name to (A, B)."""

    architecture: str
    alpha: float  # as written in the file: scale = alpha / rank
    pairs: dict[str, tuple[np.ndarray, np.ndarray]]
    meta: dict = field(default_factory=dict)
    path: Path | None = None

    @property
    def rank(self) -> int:
        return int(next(iter(self.pairs.values()))[0].shape[-2])

    def scale(self, name: str) -> float:
        """llama.cpp's scale of one weight's update: alpha / rank (1 when alpha is 0)."""
        r = self.pairs[name][0].shape[-2]
        return self.alpha / r if self.alpha else 1.0

    def check_base(self, base_shapes: Mapping[str, tuple[int, ...]], base_arch: str | None) -> None:
        """Raise unless every adapted weight exists in the base with the shape the pair expects."""
        where = f"{self.path}: " if self.path else ""
        if base_arch is not None and base_arch != self.architecture:
            raise AdapterError(f"{where}the adapter is for {self.architecture!r}, the model is {base_arch!r}")
        for name, (a, b) in self.pairs.items():
            if name not in base_shapes:
                raise AdapterError(f"{where}adapts {name}, which the model does not have", hint="wrong base model?")
            want = tuple(base_shapes[name])
            if pair_shape(a, b) != want:
                raise AdapterError(
                    f"{where}{name}: lora_b {b.shape} x lora_a {a.shape} does not make the model's {want}",
                    hint="wrong base model?",
                )


def pair_shape(a: np.ndarray, b: np.ndarray) -> tuple[int, ...]:
    """The base weight shape a pair adapts: (out, in), or (E, out, in) for an expert pair."""
    return (int(b.shape[0]), int(a.shape[1])) if a.ndim == 2 else (int(b.shape[0]), int(b.shape[1]), int(a.shape[2]))


def pairs_ok(a: np.ndarray, b: np.ndarray) -> bool:
    """Whether lora_a and lora_b pair: 2-D (r, in) and (out, r), or 3-D expert
    stacks (E, r, in) and (E, out, r) of one E and one rank."""
    if a.ndim == 2 and b.ndim == 2:
        return a.shape[0] == b.shape[1]
    if a.ndim == 3 and b.ndim == 3:
        return a.shape[0] == b.shape[0] and a.shape[1] == b.shape[2]
    return False


def lora_alpha_for_file(alpha: float, rank: int, rslora: bool) -> float:
    """The ``adapter.lora.alpha`` that makes llama.cpp's alpha/rank equal toy's scale."""
    return float(alpha * math.sqrt(rank)) if rslora else float(alpha)


def save_adapter(
    path: str | os.PathLike,
    *,
    architecture: str,
    pairs: Mapping[str, tuple[np.ndarray, np.ndarray]],
    alpha: float,
    rank: int,
    rslora: bool = False,
    targets: list[str] | None = None,
    dropout: float = 0.0,
    base: str | None = None,
    name: str | None = None,
) -> Path:
    """Write an adapter atomically (see the module docstring); returns the path."""
    u32, f32 = TypeInfo(ValueType.UINT32), TypeInfo(ValueType.FLOAT32)
    w = GGUFWriter(path)
    w.add("general.architecture", architecture)
    w.add("general.type", "adapter")
    w.add("general.name", name or "toy LoRA adapter")
    w.add("adapter.type", "lora")
    w.add("adapter.lora.alpha", lora_alpha_for_file(alpha, rank, rslora), f32)
    w.add("toy.lora.rank", int(rank), u32)
    w.add("toy.lora.alpha", float(alpha), f32)
    w.add("toy.lora.rslora", bool(rslora))
    w.add("toy.lora.dropout", float(dropout), f32)
    if targets:
        w.add("toy.lora.targets", list(targets))
    if base:
        w.add("toy.lora.base", str(base))
    for wname, (a, b) in pairs.items():
        w.add_tensor(f"{wname}.lora_a", np.ascontiguousarray(a, np.float32))
        w.add_tensor(f"{wname}.lora_b", np.ascontiguousarray(b, np.float32))
    return Path(w.write())


def load_adapter(path: str | os.PathLike) -> Adapter:
    """Read and validate an adapter file (its own consistency; ``check_base`` for a model)."""
    path = Path(path)
    with GGUFFile(path) as gf:
        md = gf.metadata
        if md.get("general.type") != "adapter":
            raise AdapterError(
                f"{path}: general.type is {md.get('general.type')!r}, not 'adapter': not an adapter file"
            )
        if md.get("adapter.type") != "lora":
            raise AdapterError(f"{path}: adapter.type is {md.get('adapter.type')!r}, toy reads 'lora' adapters")
        arch = md.get("general.architecture")
        if not isinstance(arch, str):
            raise AdapterError(f"{path}: no general.architecture")
        alpha = float(md.get("adapter.lora.alpha", 0.0))
        halves: dict[str, dict[str, np.ndarray]] = {}
        for tname in gf.tensors:
            for suffix in (".lora_a", ".lora_b"):
                if tname.endswith(suffix):
                    halves.setdefault(tname[: -len(suffix)], {})[suffix] = gf.tensor_to_float(tname)
                    break
            else:
                raise AdapterError(f"{path}: tensor {tname} is neither a .lora_a nor a .lora_b")
        meta = {k: v for k, v in md.items() if k.startswith("toy.lora.") or k == "general.name"}
    pairs = {}
    for wname, h in halves.items():
        if set(h) != {".lora_a", ".lora_b"}:
            raise AdapterError(f"{path}: {wname} has only {next(iter(h))[1:]}")
        a, b = h[".lora_a"], h[".lora_b"]
        if not pairs_ok(a, b):
            raise AdapterError(
                f"{path}: {wname}: lora_a {a.shape} and lora_b {b.shape} do not pair "
                "(rank mismatch; 2-D pairs, or 3-D expert stacks (E, r, in) and (E, out, r))"
            )
        pairs[wname] = (a, b)
    if not pairs:
        raise AdapterError(f"{path}: no LoRA tensors")
    return Adapter(arch, alpha, pairs, meta, path)


__all__ = ["Adapter", "AdapterError", "load_adapter", "lora_alpha_for_file", "pair_shape", "pairs_ok", "save_adapter"]
