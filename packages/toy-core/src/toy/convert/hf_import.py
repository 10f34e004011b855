"""Import a Hugging Face model folder into one GGUF file, without torch,
transformers or llama.cpp's converter.

``import_hf(folder, out, type="f32")`` reads ``config.json``, the
safetensors weights (``toy.convert.safetensors_io``: one file or shards with
an index; F32, F16, BF16) and the tokenizer (``tokenizer.json``,
``tokenizer_config.json``), and writes ``out`` with the metadata keys,
tensor names, tensor layout and tensor types llama.cpp's
``convert_hf_to_gguf.py`` (the one of the pinned llama-cpp-python sdist)
writes for the same folder.

This module knows no architecture. ``config.json``'s ``architectures[0]``
picks the family whose ``HFFamily.classes`` (``toy.models.hf``) names it;
the family's data says the rest: ``config_from_hf`` gives the toy config
(and refuses what toy would compute differently), ``tensors`` the table of
Hugging Face names, GGUF names and operations, ``metadata_from_hf`` the
architecture's keys in the converter's order, ``extra_tensors`` the tensors
the converter computes (llama3's ``rope_freqs.weight``),
``tokenizer_metadata`` the tokenizer keys a class adds. The generated
reference (docs/reference/hf-mapping.md) prints those tables.

How it streams: every header is read first, so the GGUF header (names,
shapes, types, offsets) is known before a weight is touched; then each
tensor goes in blocks of rows (``BLOCK_BYTES`` of source, whole heads
where the rows are interleaved into RoPE pairs; a transposed matrix goes
whole): a block is mapped, converted, appended and its memory released
before the next. A stacked mixture-of-experts tensor is written expert by
expert, so it is never assembled in memory either. Peak memory is a few
blocks plus Python's, not a tensor and not the model. The file is written
under a temporary name in OUT's folder and renamed at the end; on any error
the temporary file is removed and OUT is left as it was.

What the engine does as the converter does, for every architecture:

- Order: the computed tensors first, then the checkpoint's tensors in its
  order (shards by file name, each in header order). The experts of a
  layer are buffered by the converter until the layer's last one arrives,
  then its stacked tensors are written in name order
  (``ffn_down_exps``, ``ffn_gate_exps``, ``ffn_up_exps``): the stacked
  tensors of block ``blk.N`` take the place of the last expert matrix of
  that block in the checkpoint.
- Operations (``toy.models.hf.OPS``): ``rope_pairs`` transposes each head's
  ``(2, rows/2)`` row grid (llama.cpp's Q/K order); ``transpose``;
  ``plus_one`` adds 1 in the source's type (F16 stays F16, as torch does it
  in the converter).
- Types: BF16 weights are widened to float32 (exact); F16 stay F16 until
  the output type is applied. 1-D tensors, ``*_norm.weight``, tensors not
  named ``*.weight``, and the router, shared-expert gate, position and
  token-type embeddings are F32 whatever ``type`` is; the others get
  ``type`` (F32, F16, BF16 or Q8_0). A Q8_0 tensor whose rows are not a
  multiple of 32 falls back to F16. F16 is NumPy's round-to-nearest-even,
  BF16 round-to-nearest-even on the top 16 bits (NaN kept quiet), Q8_0
  ggml's reference quantizer.
- Metadata: ``general.architecture``, ``general.type``, ``general.name``
  (``name`` or the folder's name), ``general.size_label`` (the converter's
  label of the parameter count, ``8x6.5M`` for eight experts), the family's
  keys with ``general.file_type`` where it places it,
  ``general.quantization_version``, then the tokenizer's
  (``toy.convert.hf_tokenizer``). A key written twice keeps its first
  place and takes the second value (the converter's writer).

Checks before anything is written (``HFImportError`` naming the tensor or
field): every checkpoint tensor has a row in the table (or is a buffer the
family skips); every row the table does not mark optional is present;
shapes equal what the toy config makes of them (the registry's parameter
shapes); a Hugging Face-only parameter (a row without a GGUF tensor, which
an export fills with a constant) holds exactly that constant, so a real
weight is never dropped. The converter's guesses of
``general.basename``/``finetune``/``version`` from the folder name and model
card are not reproduced, and ``tokenizer.ggml.pre`` is named from
``tokenizer.json`` (``toy.convert.hf_tokenizer``): the stated exceptions to
byte equality.
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

import toy_ggml
from toy.convert.hf_common import HFImportError, err, read_json
from toy.convert.hf_tokenizer import tokenizer_metadata
from toy.convert.safetensors_io import SafetensorsFolder
from toy.gguf.constants import DEFAULT_ALIGNMENT, ValueType
from toy.gguf.reader import TypeInfo
from toy.gguf.writer import atomic_output, header_bytes
from toy.models.hf import HFMappingError, HFTensor, MetaEntry

GGMLType = toy_ggml.GGMLType

#: output type name -> (ggml type of 2-D weights, general.file_type)
TYPES: dict[str, tuple[GGMLType, int]] = {
    "f32": (GGMLType.F32, 0),
    "f16": (GGMLType.F16, 1),
    "bf16": (GGMLType.BF16, 32),
    "q8_0": (GGMLType.Q8_0, 7),
}

#: GGUF tensors the converter keeps F32 whatever the output type (its list, for the tensors toy has)
F32_TENSORS = re.compile(r"(blk\.\d+\.ffn_gate_inp(_shexp)?|position_embd|token_types)\.weight")
_BLOCK = re.compile(r"blk\.(\d+)\.")

#: metadata value type names (``toy.models.hf.MetaEntry``) -> GGUF types
_SCALARS = {
    "string": ValueType.STRING,
    "uint32": ValueType.UINT32,
    "int32": ValueType.INT32,
    "float32": ValueType.FLOAT32,
    "bool": ValueType.BOOL,
}


@dataclass
class ImportReport:
    folder: Path
    out: Path
    arch: str
    type: str
    n_tensors: int = 0
    n_params: int = 0
    bytes_out: int = 0
    seconds: float = 0.0
    tied: bool = False
    pre: str = ""
    type_counts: dict[str, int] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        d = dict(self.__dict__)
        d["folder"], d["out"] = str(self.folder), str(self.out)
        return d


def type_info(name: str) -> TypeInfo:
    """A ``MetaEntry`` type name (``"uint32"``, ``"array[string]"`` ...) as a GGUF ``TypeInfo``."""
    if name.startswith("array[") and name.endswith("]"):
        return TypeInfo(ValueType.ARRAY, type_info(name[6:-1]))
    if name not in _SCALARS:
        raise ValueError(f"unknown metadata type {name!r}")
    return TypeInfo(_SCALARS[name])


def mapping_error(e: HFMappingError) -> HFImportError:
    """A family's ``HFMappingError`` as the importer's error (same message, hint and field)."""
    return HFImportError(str(e), e.hint, field=e.field)


# ------------------------------------------------------------------ tensors


def permute_rows(w: np.ndarray, n_head: int) -> np.ndarray:
    """Interleave each head's rows from HF's rotate-half order to adjacent
    pairs: within a head of ``r`` rows, the row grid ``(2, r/2)`` is
    transposed to ``(r/2, 2)``."""
    rows = w.shape[0]
    out: np.ndarray = w.reshape(n_head, 2, rows // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
    return out


def apply_op(x: np.ndarray, op: str, heads: int) -> np.ndarray:
    """One operation of ``toy.models.hf.OPS`` in the import direction, on
    the array as read (float32, or float16 for F16 sources)."""
    if op == "":
        return x
    if op == "rope_pairs":
        return permute_rows(x, heads)
    if op == "transpose":
        return np.ascontiguousarray(x.T)
    if op == "plus_one":
        out: np.ndarray = x + np.asarray(1, dtype=x.dtype)
        return out
    raise ValueError(f"unknown op {op!r}")


def out_type(gname: str, shape: tuple[int, ...], target: GGMLType) -> GGMLType:
    if len(shape) <= 1 or gname.endswith("_norm.weight") or not gname.endswith(".weight"):
        return GGMLType.F32
    if F32_TENSORS.fullmatch(gname):
        return GGMLType.F32
    if target == GGMLType.Q8_0 and shape[-1] % 32:
        return GGMLType.F16
    return target


def to_bf16(x: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bits (uint16), round to nearest even, NaN kept a quiet NaN."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    nan = (u & 0x7FFFFFFF) > 0x7F800000
    rounded = (u + (0x7FFF + ((u >> 16) & 1))) >> 16
    quiet = ((u >> 16) | 0x0040) & 0xFFFF
    return np.where(nan, quiet, rounded).astype(np.uint16)


def encode_tensor(x: np.ndarray, gt: GGMLType) -> bytes:
    if gt == GGMLType.F32:
        return np.ascontiguousarray(x, dtype=np.float32).tobytes()
    if gt == GGMLType.F16:
        return np.ascontiguousarray(x, dtype=np.float16).tobytes()
    if gt == GGMLType.BF16:
        return to_bf16(x).tobytes()
    return toy_ggml.quantize(np.ascontiguousarray(x, dtype=np.float32), int(gt)).tobytes()


def nbytes_of(shape: tuple[int, ...], gt: GGMLType) -> int:
    traits = toy_ggml.type_info(gt)
    n = 1
    for d in shape:
        n *= d
    return n // traits.block_size * traits.type_size


def _count(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


# ------------------------------------------------------------------ the plan


def _size_label(n: int) -> str:
    """A parameter count as llama.cpp's converter labels it ("3.2M", "135M")."""
    scale, suffix = 1e-3, "K"
    for limit, sc, suf in ((1e12, 1e-12, "T"), (1e9, 1e-9, "B"), (1e6, 1e-6, "M")):
        if n > limit:
            scale, suffix = sc, suf
            break
    v = n * scale
    digits = max(2 - len(str(round(v)).lstrip("0")), 0)
    return f"{v:.{digits}f}{suffix}"


def size_label(shapes: Mapping[str, tuple[int, ...]]) -> str:
    """The converter's ``general.size_label`` of the tensors written: the
    count, or ``{experts}x{count of one expert's share}`` when stacked expert
    tensors (``*_exps.*``) are among them."""
    total = shared = expert = expert_sum = n_expert_tensors = 0
    for name, shape in shapes.items():
        size = _count(shape)
        total += size
        if "_exps." in name and len(shape) >= 3:
            n = shape[0]  # (E, ...) in NumPy order: ggml's last dimension
            expert += size // n
            expert_sum += n
            n_expert_tensors += 1
        else:
            shared += size
    if n_expert_tensors:
        return f"{expert_sum // n_expert_tensors}x{_size_label(shared + expert)}"
    return _size_label(total)


@dataclass
class _Source:
    """One Hugging Face tensor of a GGUF tensor (one expert's, for a stacked one)."""

    hf_name: str
    op: str
    heads: int
    shape: tuple[int, ...]  # Hugging Face's


@dataclass
class _Plan:
    name: str
    shape: tuple[int, ...]  # GGUF tensor, NumPy order
    type: GGMLType
    sources: list[_Source] = field(default_factory=list)  # stacked: one per expert, in expert order
    data: np.ndarray | None = None  # a computed tensor (the family's extra_tensors)


def _gguf_shape(row: HFTensor, hf_shape: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(reversed(hf_shape)) if row.op == "transpose" else hf_shape


def _find_family(config_json: Mapping[str, Any]) -> tuple[Any, str, str]:
    """(family, HF class, GGUF architecture) of ``config.json``."""
    from toy import models

    archs = config_json.get("architectures")
    if not isinstance(archs, list) or not archs or not isinstance(archs[0], str):
        raise err(
            "config.json: architectures is missing or not a list of names",
            "architectures",
            'it names the model class, e.g. ["LlamaForCausalLM"]',
        )
    hf_arch = archs[0]
    known: list[str] = []
    for family in models.hf_families():
        if hf_arch in family.classes:
            return family, hf_arch, family.classes[hf_arch]
        known += list(family.classes)
        if hf_arch in family.refused_classes:
            raise err(
                f"config.json: architecture {hf_arch!r} is not one toy imports",
                "architectures",
                family.refused_classes[hf_arch],
            )
    raise err(
        f"config.json: architecture {hf_arch!r} is not one toy imports",
        "architectures",
        f"toy imports {', '.join(known)}",
    )


def _check_fill(weights: SafetensorsFolder, row: HFTensor) -> None:
    """A Hugging Face-only parameter must hold its constant everywhere (else
    the GGUF file, which has no place for it, would lose it)."""
    ref = weights.tensors[row.hf]
    if tuple(ref.shape) != tuple(row.fill_shape):
        raise err(
            f"tensor {row.hf!r} has shape {tuple(ref.shape)}, config.json says {tuple(row.fill_shape)}",
            row.hf,
            "the weights and config.json do not belong together",
        )
    x = weights.read(row.hf)
    if not np.all(x == np.asarray(row.fill, dtype=x.dtype)):
        raise err(
            f"tensor {row.hf!r} is not all {row.fill}: toy's model (and its GGUF file) has no place for it",
            row.hf,
            "this checkpoint uses a parameter toy's architecture does not have; it cannot be imported exactly",
        )


def plan_tensors(
    arch: str, cfg: Any, rows: list[HFTensor], weights: SafetensorsFolder, skipped: tuple[str, ...], target: GGMLType
) -> list[_Plan]:
    """The GGUF tensors of the checkpoint ``weights`` through the family's
    table ``rows``, in the converter's order, checked (module docstring)."""
    from toy import models

    by_hf = {r.hf: r for r in rows}
    params = models.get(arch).params(cfg)
    for row in rows:
        if row.hf in weights.tensors or row.optional or row.gguf is None:
            continue
        missing = [r for r in rows if r.gguf is not None and not r.optional and r.hf not in weights.tensors]
        raise err(
            f"{weights.folder}: the weights lack {row.hf} (GGUF {row.gguf})"
            + (f" and {len(missing) - 1} more" if len(missing) > 1 else ""),
            row.hf,
            "a shard may be missing, or the checkpoint is not a complete model of config.json's architecture",
        )
    # the experts each stacked GGUF tensor expects, and the stacked tensors of each block
    n_experts: dict[str, int] = {}
    for r in rows:
        if r.expert is not None and r.gguf is not None:
            n_experts[r.gguf] = max(n_experts.get(r.gguf, 0), r.expert + 1)
    stacks: dict[str, list[str]] = {}
    for g in n_experts:
        m = _BLOCK.match(g)
        stacks.setdefault(m.group(1) if m else g, []).append(g)
    pending: dict[str, dict[int, _Source]] = {g: {} for g in n_experts}
    plans: list[_Plan] = []

    def shape_check(name: str, got: tuple[int, ...], want: tuple[int, ...] | None, hf: str) -> None:
        if want is not None and tuple(got) != tuple(want):
            raise err(
                f"tensor {hf!r} has shape {tuple(got)} (as {name}), config.json says {tuple(want)}",
                hf,
                "the weights and config.json do not belong together",
            )

    for hf_name, ref in weights.tensors.items():
        if hf_name.endswith(skipped):
            continue
        found = by_hf.get(hf_name)
        if found is None:
            raise err(
                f"tensor {hf_name!r} has no GGUF name in toy's {arch} mapping",
                hf_name,
                "the checkpoint holds a tensor this architecture does not have (an adapter, a vision tower, "
                "a layer past num_hidden_layers?)",
            )
        row = found
        if row.gguf is None:
            if row.fill is not None:
                _check_fill(weights, row)
            continue  # no fill: a parameter the converter drops (gemma2's duplicate lm_head)
        shape = tuple(ref.shape)
        if row.op == "rope_pairs" and (not shape or row.heads <= 0 or shape[0] % (2 * row.heads)):
            raise err(
                f"tensor {hf_name!r}: {shape[0] if shape else 0} rows do not split into {row.heads} heads of pairs",
                hf_name,
                "the checkpoint does not match config.json's head counts",
            )
        if row.op == "transpose" and len(shape) != 2:
            raise err(f"tensor {hf_name!r} has shape {shape}, not a matrix", hf_name, "check the checkpoint")
        gshape = _gguf_shape(row, shape)
        want = params[row.gguf].shape if row.gguf in params else None
        source = _Source(hf_name, row.op, row.heads, shape)
        if row.expert is None:
            shape_check(row.gguf, gshape, want, hf_name)
            plans.append(_Plan(row.gguf, gshape, out_type(row.gguf, gshape, target), [source]))
            continue
        shape_check(row.gguf, gshape, None if want is None else tuple(want[1:]), hf_name)
        pending[row.gguf][row.expert] = source
        m = _BLOCK.match(row.gguf)
        block = stacks[m.group(1) if m else row.gguf]
        if all(len(pending[g]) == n_experts[g] for g in block):
            for g in sorted(block):
                srcs = [pending[g][j] for j in range(n_experts[g])]
                first = _gguf_shape(by_hf[srcs[0].hf_name], srcs[0].shape)
                for s in srcs[1:]:
                    shape_check(g, _gguf_shape(by_hf[s.hf_name], s.shape), first, s.hf_name)
                full = (len(srcs), *first)
                plans.append(_Plan(g, full, out_type(g, full, target), srcs))
    return plans


def import_hf(
    folder: str | os.PathLike[str],
    out: str | os.PathLike[str],
    type: str = "f32",
    name: str | None = None,
    progress: Callable[[int, int, str], None] | None = None,
) -> ImportReport:
    """Convert the HF model in ``folder`` to the GGUF file ``out`` (see the
    module docstring); ``name`` is general.name (default: the folder's name)."""
    t0 = time.perf_counter()
    src = Path(folder)
    dst = Path(out)
    key = str(type).strip().lower()
    if key not in TYPES:
        raise err(f"unknown output type {type!r}", "type", f"choose one of {', '.join(TYPES)}")
    target, file_type = TYPES[key]
    if not src.is_dir():
        raise err(f"{src}: not a folder", "folder", "pass a Hugging Face model folder (config.json, *.safetensors)")
    config_json = read_json(src / "config.json", "config.json")
    family, hf_arch, arch = _find_family(config_json)
    weights = SafetensorsFolder(src)
    tc_path = src / "tokenizer_config.json"
    tokenizer_config = read_json(tc_path, "tokenizer_config.json") if tc_path.is_file() else {}
    try:
        if family.config_from_hf is None:
            raise HFMappingError(f"toy cannot import {hf_arch} yet", "no import table", field="architectures")
        cfg = family.config_from_hf(arch, config_json, frozenset(weights.tensors))
        rows = family.tensors(arch, cfg)
        arch_meta: list[MetaEntry] = family.metadata_from_hf(arch, config_json)
        extras = family.extra_tensors(arch, config_json) if family.extra_tensors is not None else []
        tok_meta = family.tokenizer_metadata(arch, tokenizer_config) if family.tokenizer_metadata else []
    except HFMappingError as e:
        raise mapping_error(e) from None
    plans = [
        _Plan(n, tuple(a.shape), out_type(n, tuple(a.shape), target), data=np.ascontiguousarray(a, np.float32))
        for n, a in extras
    ]
    plans += plan_tensors(arch, cfg, rows, weights, family.skipped, target)

    meta: dict[str, tuple[Any, TypeInfo]] = {}

    def put(entries: list[MetaEntry] | list[tuple[str, Any, TypeInfo]]) -> None:
        for k, v, t in entries:  # a key written again keeps its place (the converter's writer)
            meta[k] = (v, type_info(t) if isinstance(t, str) else t)

    put(
        [
            ("general.architecture", arch, "string"),
            ("general.type", "model", "string"),
            ("general.name", name if name is not None else src.resolve().name, "string"),
            ("general.size_label", size_label({p.name: p.shape for p in plans}), "string"),
        ]
    )
    put([(k, file_type if k == "general.file_type" else v, t) for k, v, t in arch_meta])
    put([("general.quantization_version", 2, "uint32")])
    put(tok_meta)
    put(tokenizer_metadata(src, cfg.n_vocab, arch, config_json))
    if family.tokenizer_metadata_after is not None:
        try:
            put(family.tokenizer_metadata_after(arch, str(meta["tokenizer.ggml.model"][0])))
        except HFMappingError as e:
            raise mapping_error(e) from None

    names = {p.name for p in plans}
    report = ImportReport(src, dst, arch, key, n_params=sum(_count(p.shape) for p in plans))
    report.tied = "token_embd.weight" in names and "output.weight" not in names
    pre = meta.get("tokenizer.ggml.pre")
    report.pre = str(pre[0]) if pre else ""
    _write(dst, [(k, v, t) for k, (v, t) in meta.items()], plans, weights, report, progress)
    report.seconds = time.perf_counter() - t0
    return report


# ------------------------------------------------------------------ writing

#: rows converted at once: a tensor is read, permuted and encoded in blocks of about this many source bytes, so the
#: peak memory is a block's, not a whole embedding's (a 0.5B model's is 200 MB in F32)
BLOCK_BYTES = 16 << 20


def _row_blocks(shape: tuple[int, ...], op: str, heads: int) -> list[tuple[int, int, int]]:
    """``(start, stop, heads)`` blocks of a source tensor's rows, in order:
    whole heads when the rows are interleaved (the permutation moves rows
    within a head only; ``heads`` is the block's head count, 0 for none),
    the whole tensor for a transpose, and whole rows always."""
    rows = shape[0] if shape else 1
    if op == "transpose":
        return [(0, rows, 0)]
    row_bytes = 4
    for d in shape[1:]:
        row_bytes *= d
    permute = heads if op == "rope_pairs" else 0
    unit = rows // permute if permute else 1  # rows per head
    per_block = max(1, BLOCK_BYTES // max(1, row_bytes * unit)) * unit
    out = []
    for start in range(0, rows, per_block):
        stop = min(rows, start + per_block)
        out.append((start, stop, (stop - start) // unit if permute else 0))
    return out or [(0, rows, permute)]


def _chunks(p: _Plan, weights: SafetensorsFolder) -> Iterator[np.ndarray]:
    """The GGUF tensor ``p`` as consecutive row blocks, source by source."""
    if p.data is not None:
        yield p.data
        return
    for s in p.sources:
        for start, stop, heads in _row_blocks(s.shape, s.op, s.heads):
            # no local name: the generator's frame must not keep a block alive while the caller encodes it
            yield apply_op(weights.read_rows(s.hf_name, start, stop), s.op, heads)


def _write(
    dst: Path,
    meta: list[tuple[str, Any, TypeInfo]],
    plans: list[_Plan],
    weights: SafetensorsFolder,
    report: ImportReport,
    progress: Callable[[int, int, str], None] | None,
) -> None:
    sizes = [nbytes_of(p.shape, p.type) for p in plans]
    head, offsets = header_bytes(meta, ((p.name, p.shape, p.type, n) for p, n in zip(plans, sizes, strict=True)))
    with atomic_output(dst) as f:
        f.write(head)
        for i, (p, size, off) in enumerate(zip(plans, sizes, offsets, strict=True)):
            if progress is not None:
                progress(i, len(plans), p.name)
            f.write(b"\0" * (off - (f.tell() - len(head))))  # the previous tensor's alignment padding
            written = 0
            for x in _chunks(p, weights):
                data = encode_tensor(x, p.type)
                del x
                f.write(data)
                written += len(data)
                del data
            if written != size:  # a bug, not bad input
                raise AssertionError(f"{p.name}: {written} bytes, expected {size}")
            report.type_counts[p.type.name] = report.type_counts.get(p.type.name, 0) + 1
        f.write(b"\0" * ((-(f.tell() - len(head))) % DEFAULT_ALIGNMENT))  # the last tensor's padding
    report.n_tensors = len(plans)
    report.bytes_out = dst.stat().st_size
