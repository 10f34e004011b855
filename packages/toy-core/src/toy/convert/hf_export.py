"""A GGUF language model as a Hugging Face folder that ``transformers`` loads
with no GGUF involved.

``export_hf(model_path, folder)`` writes ``config.json`` (the Hugging Face
architecture's fields, read from the GGUF metadata through toy's registry
config), the weights as safetensors (``model.safetensors``, or numbered
shards plus ``model.safetensors.index.json`` above ``shard_bytes``), the
tokenizer (``tokenizer.json``, ``tokenizer_config.json`` with the chat
template, ``special_tokens_map.json``, and for a SentencePiece vocabulary
``tokenizer.model``: ``toy.tokenizer.export``) and
``generation_config.json``, for every registered language architecture:
llama, qwen2, qwen3, gpt2, gemma2, gemma3 (as ``Gemma3ForCausalLM``, the
text model), olmoe, qwen2moe and qwen3moe.

This module knows no architecture: the family of ``general.architecture``
(``toy.models.hf_family``) gives the table (``HFFamily.tensors``: Hugging
Face name, GGUF name, operation), ``config.json``'s fields
(``HFFamily.config_to_hf``, RoPE scaling from ``rope_scaling_to_hf``) and
the class written (``export_class``). The generated reference
(docs/reference/hf-mapping.md) prints the tables.

How each tensor is written:

- F32, F16 and BF16 tensors keep their type and bytes (safetensors allows a
  type per tensor, so an F16 file's F32 norms stay F32): a round trip
  through llama.cpp's converter with the same ``--outtype`` gives the same
  bytes back. Quantized tensors are dequantized to F32 (through ggml); the
  report lists them.
- The inverse of each row's operation: ``rope_pairs`` puts each head's
  interleaved Q/K rows back into Hugging Face's halves; ``transpose``
  transposes back (GPT-2's ``Conv1D``); ``plus_one`` subtracts 1 in F32
  (Gemma's norm gains).
- A row with ``expert=j`` is expert ``j``'s matrix of a stacked 3-D tensor
  (a quantized one is dequantized once for all its experts).
- A row without a GGUF tensor (``fill``) is written as its constant: a
  zero bias or a unit norm Hugging Face's class has and the file lacks.
- A tensor the exported ``config.json`` recomputes (llama3's
  ``rope_freqs.weight``) is not written; the export checks that the
  config gives it back exactly.

The safetensors files are written here, streaming one tensor at a time
(header first: every shape and type is known from the GGUF index), so the
export holds one tensor in memory, not the model; no torch, no
transformers. The folder appears complete or not at all: everything is
written into a temporary sibling folder that is renamed onto ``folder``
(which must not exist or be empty) at the end.

Refused with ``HFExportError`` (naming the field): an architecture
without a Hugging Face family, what a family's ``config_to_hf`` cannot
express (its ``HFMappingError``), and any tensor the table does not map
(it refuses rather than drop it).
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

import toy_ggml
from toy.convert.safetensors_io import write_safetensors
from toy.errors import BadInputError
from toy.models.hf import HFMappingError, HFTensor

# above this many bytes of weights the safetensors file is split (transformers' default shard size)
DEFAULT_SHARD_BYTES = 5 * 10**9

_T = toy_ggml.GGMLType
# GGUF float type -> (safetensors dtype, NumPy view of the raw bytes, bytes per element)
_FLOATS: dict[int, tuple[str, Any, int]] = {
    int(_T.F32): ("F32", np.float32, 4),
    int(_T.F16): ("F16", np.float16, 2),
    int(_T.BF16): ("BF16", np.uint16, 2),  # NumPy has no bfloat16: the bits are moved, never computed on
}
_TORCH_DTYPE = {"F32": "float32", "F16": "float16", "BF16": "bfloat16"}


class HFExportError(BadInputError):
    """A model that cannot be written as a Hugging Face folder (the message names the field or tensor)."""


@dataclass
class ExportReport:
    """What ``export_hf`` wrote."""

    folder: Path
    architecture: str
    hf_class: str
    files: list[Path] = field(default_factory=list)
    n_tensors: int = 0
    n_bytes: int = 0
    dequantized: list[str] = field(default_factory=list)  # GGUF tensors that were quantized (written as F32)
    notes: list[str] = field(default_factory=list)  # what was left out and why (tokenizer.model without sentencepiece)

    def to_dict(self) -> dict[str, Any]:
        return {
            "folder": str(self.folder),
            "architecture": self.architecture,
            "hf_class": self.hf_class,
            "files": [str(p) for p in self.files],
            "n_tensors": self.n_tensors,
            "n_bytes": self.n_bytes,
            "dequantized": list(self.dequantized),
            "notes": list(self.notes),
        }


def unpermute_rows(w: np.ndarray, n_head: int) -> np.ndarray:
    """The inverse of the import's ``rope_pairs`` for ``n_head`` heads: within
    a head the converter moved row ``j`` of the second half next to row ``j``
    of the first (pairs); this puts the halves back."""
    rows = w.shape[0]
    out: np.ndarray = w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
    return out


def undo_op(w: np.ndarray, op: str, heads: int) -> np.ndarray:
    """One operation of ``toy.models.hf.OPS`` in the export direction."""
    if op == "":
        return w
    if op == "rope_pairs":
        return unpermute_rows(w, heads)
    if op == "transpose":
        return np.ascontiguousarray(w.T)
    if op == "plus_one":  # computed in float32 (the GGUF norm gains are F32)
        out: np.ndarray = (w.astype(np.float32) - np.float32(1.0)).astype(np.float32)
        return out
    raise ValueError(f"unknown op {op!r}")


def _meta_int(metadata: dict[str, Any], key: str) -> int | None:
    v = metadata.get(key)
    return int(v) if isinstance(v, (int, np.integer)) else None


def _mapping_error(e: HFMappingError) -> HFExportError:
    return HFExportError(str(e), e.hint, field=e.field)


def _plan(gf: Any, arch: str, family: Any) -> tuple[Any, list[HFTensor], dict[str, Any]]:
    """(toy config, the rows written, config.json's architecture fields) of the open GGUF ``gf``."""
    from toy import models

    cfg = models.config_from_gguf(gf)
    try:
        rows = family.tensors(arch, cfg)
        config = family.config_to_hf(arch, cfg)
        if family.rope_scaling_to_hf is not None:
            freqs = gf.tensor_to_float("rope_freqs.weight") if "rope_freqs.weight" in gf.tensors else None
            config["rope_scaling"] = family.rope_scaling_to_hf(arch, cfg, gf.metadata, freqs)
        extra = family.extra_tensors(arch, config) if family.extra_tensors is not None else []
    except HFMappingError as e:
        raise _mapping_error(e) from None
    written = []
    for r in rows:
        if r.gguf is None:
            if r.fill is not None:
                written.append(r)  # a parameter Hugging Face needs and the file lacks: a constant
            continue
        if r.gguf in gf.tensors:
            written.append(r)
        elif not r.optional:
            raise HFExportError(
                f"the {arch} model lacks tensor {r.gguf!r} (Hugging Face's {r.hf})",
                hint="the file is not a complete model of its architecture",
                field=r.gguf,
            )
    # tensors the exported config.json recomputes (llama3's rope_freqs.weight) must come back exactly
    # (within 1e-6 relative: the converter's float32 pow is not always correctly rounded, toy.models.rope_hf)
    derived = set()
    for n, a in extra:
        if n in gf.tensors:
            want, got = np.asarray(a, np.float32), gf.tensor_to_float(n)
            if want.size != got.size or not np.allclose(got.reshape(want.shape), want, rtol=1e-6, atol=0):
                raise HFExportError(
                    f"tensor {n!r} differs from what config.json's rope_scaling gives back",
                    hint="the file's tensor cannot be expressed in Hugging Face's config; it refuses rather than "
                    "change the model",
                    field=n,
                )
            derived.add(n)
    left = sorted(set(gf.tensors) - {r.gguf for r in written} - derived)
    if left:
        raise HFExportError(
            f"tensor {left[0]!r} has no place in Hugging Face's {arch}"
            + (f" (and {len(left) - 1} more)" if len(left) > 1 else ""),
            hint="the file carries tensors toy's exporter does not map; it refuses rather than drop them",
            field=left[0],
        )
    return cfg, written, config


def _out_type(gf: Any, r: HFTensor) -> tuple[str, tuple[int, ...], bool]:
    """(safetensors dtype, Hugging Face shape, dequantized?) of one row."""
    if r.gguf is None:
        return "F32", tuple(r.fill_shape), False
    t = gf.tensors[r.gguf]
    shape = tuple(t.shape) if r.expert is None else tuple(t.shape[1:])
    if r.op == "transpose":
        shape = shape[::-1]
    f = _FLOATS.get(int(t.dtype))
    return (f[0] if f and r.op != "plus_one" else "F32"), shape, f is None


def _array(gf: Any, r: HFTensor, last: dict[str, np.ndarray]) -> np.ndarray:
    """One row's array. ``last`` keeps the previous dequantized tensor, so that the experts of one 3-D
    tensor (consecutive rows) dequantize it once."""
    if r.gguf is None:
        return np.full(tuple(r.fill_shape), r.fill, np.float32)
    t = gf.tensors[r.gguf]
    f = _FLOATS.get(int(t.dtype))
    if f is None or r.op == "plus_one":
        if r.gguf not in last:
            last.clear()
            last[r.gguf] = gf.tensor_to_float(r.gguf)
        a = last[r.gguf]
    else:
        a = np.frombuffer(gf.tensor_bytes(r.gguf), dtype=f[1]).reshape(t.shape)
    if r.expert is not None:
        a = a[r.expert]
    return undo_op(a, r.op, r.heads)


_ITEM = {"F32": 4, "F16": 2, "BF16": 2}


def _shards(sizes: list[int], limit: int) -> list[list[int]]:
    """Indices of the entries in each shard: in order, a new shard when the next tensor would pass ``limit``."""
    out: list[list[int]] = [[]]
    used = 0
    for i, n in enumerate(sizes):
        if out[-1] and used + n > limit:
            out.append([])
            used = 0
        out[-1].append(i)
        used += n
    return out


def _check_folder(folder: Path) -> None:
    if folder.exists() and (not folder.is_dir() or any(folder.iterdir())):
        what = "is not a folder" if not folder.is_dir() else "is not empty"
        raise HFExportError(f"{folder} {what}", hint="pass a new or empty folder: the export never overwrites files",
                            field="folder")  # fmt: skip


def export_hf(
    model_path: str | os.PathLike[str],
    folder: str | os.PathLike[str],
    *,
    shard_bytes: int = DEFAULT_SHARD_BYTES,
) -> ExportReport:
    """Write the GGUF model at ``model_path`` as a Hugging Face folder ``folder`` (new or empty)."""
    from toy import models
    from toy.gguf.reader import GGUFFile
    from toy.tokenizer import ChatTemplate, Tokenizer
    from toy.tokenizer.export import export_hf as export_tokenizer

    if shard_bytes <= 0:
        raise HFExportError(f"shard_bytes must be positive, not {shard_bytes}", field="shard_bytes")
    dest = Path(folder)
    _check_folder(dest)
    with GGUFFile(model_path) as gf:
        arch = gf.architecture
        family = None
        if arch in models.registered() and models.language_model(arch) and getattr(models.get(arch), "hf", None):
            family = models.hf_family(arch)
        if family is None or arch is None or arch not in family.export_class:
            known = arch in models.registered()
            exportable = [a for f in models.hf_families() for a in f.export_class]
            raise HFExportError(
                f"{gf.path if hasattr(gf, 'path') else model_path}: general.architecture = {arch!r} "
                + ("cannot be exported to Hugging Face yet" if known else "is not a model toy knows"),
                hint=f"exportable architectures: {', '.join(exportable)}",
                field="general.architecture",
            )
        cfg, entries, config = _plan(gf, arch, family)
        hf_class = family.export_class[arch]
        tok = Tokenizer.from_gguf(gf.metadata)
        template = ChatTemplate.from_gguf(gf.metadata)
        meta = gf.metadata
        specials = {k: _meta_int(meta, f"tokenizer.ggml.{k}_token_id") for k in ("bos", "eos", "pad")}
        plans = [_out_type(gf, e) for e in entries]
        dtypes = {p[0] for p in plans}
        report = ExportReport(dest, arch, hf_class)
        report.dequantized = list(dict.fromkeys(e.gguf for e, p in zip(entries, plans, strict=True) if p[2] and e.gguf))
        config = {
            "architectures": [hf_class],
            **config,
            "bos_token_id": specials["bos"],
            "eos_token_id": specials["eos"],
            # the widest type the weights use: what from_pretrained(torch_dtype="auto") picks
            "torch_dtype": _TORCH_DTYPE["F32" if "F32" in dtypes or len(dtypes) > 1 else dtypes.pop()],
        }
        if specials["pad"] is not None:
            config["pad_token_id"] = specials["pad"]
        items = []
        for e, (dtype, shape, _) in zip(entries, plans, strict=True):
            n = _ITEM[dtype]
            for s in shape:
                n *= s
            items.append((e.hf, dtype, shape, n))
        groups = _shards([it[3] for it in items], shard_bytes)

        tmp = dest.parent / f".{dest.name}.export-{os.getpid()}"
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir(parents=True)
        try:
            names: list[str] = []
            weight_map: dict[str, str] = {}
            for k, idx in enumerate(groups, 1):
                name = "model.safetensors" if len(groups) == 1 else f"model-{k:05d}-of-{len(groups):05d}.safetensors"
                last: dict[str, np.ndarray] = {}
                write_safetensors(tmp / name, [items[i] for i in idx], (_array(gf, entries[i], last) for i in idx))
                names.append(name)
                weight_map.update({items[i][0]: name for i in idx})
            total = sum(it[3] for it in items)
            if len(groups) > 1:
                index = {"metadata": {"total_size": total}, "weight_map": weight_map}
                (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
                names.append("model.safetensors.index.json")
            (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
            gen = {k + "_token_id": v for k, v in specials.items() if v is not None}
            (tmp / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
            n_ctx = config.get("max_position_embeddings", config.get("n_positions"))
            tok_files = export_tokenizer(tok, template, tmp, n_ctx=n_ctx, metadata=meta, notes=report.notes)
            names += ["config.json", "generation_config.json", *(p.name for p in tok_files)]
            if dest.exists():
                dest.rmdir()  # empty (checked above)
            os.replace(tmp, dest)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    report.files = [dest / n for n in names]
    report.n_tensors = len(items)
    report.n_bytes = total
    return report


__all__ = ["DEFAULT_SHARD_BYTES", "ExportReport", "HFExportError", "export_hf", "undo_op", "unpermute_rows"]
