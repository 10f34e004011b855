"""Convert a GGUF model's weights to another ggml type (quantize, or widen).

``quantize_model(src, dst, dtype)`` copies every metadata key with its
on-disk type, sets ``general.file_type`` to llama.cpp's ``LLAMA_FTYPE`` value
for the target, and converts tensors one at a time.

The K-quant targets write llama.cpp's mixes (``toy.gguf.quant_mix``: the
rules, and why): ``Q4_K`` (alias ``Q4_K_M``) is llama.cpp's "mostly Q4_K_M"
with the output matrix in Q6_K, some ``attn_v``/``ffn_down`` layers in Q6_K,
the MoE routers kept F32 and so on, tensor for tensor what
``llama_model_quantize`` writes without an importance matrix; likewise
``Q2_K``, ``Q3_K`` (``Q3_K_M``), ``Q5_K`` (``Q5_K_M``) and ``Q6_K``. A tensor
the mix leaves alone keeps its type (1-D ones become F32, as below) and is
written with llama.cpp's shape (trailing ggml extents of 1 dropped).

Every other target is uniform:

- a tensor of 2+ dims whose last extent (ggml's ``ne[0]``, the row) is a
  multiple of the target's block is dequantized to F32 through ggml and
  quantized to the target; one that is not falls back the way llama.cpp does
  (``Q4_K -> Q5_0``, ``Q6_K -> Q8_0`` ..., then F16 when even that does not
  fit), and the fallbacks are reported;
- 1-D tensors (norms, biases) stay or become F32; integer tensors are copied;
  learned positions and token types keep their type.

In both, a tensor already of its destination type is copied byte for byte,
and a quantized source tensor is dequantized and quantized again (what
llama.cpp does only with ``--allow-requantize``).

Memory stays bounded by the largest tensor: each converted tensor goes to a
spill file beside the destination, which is memory-mapped (file-backed pages,
not heap) for ``GGUFWriter.write()`` and deleted afterwards. The destination
appears atomically (the writer renames it into place).
"""

from __future__ import annotations

import mmap
import os
import tempfile
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

import toy_ggml
from toy.gguf import quant_mix
from toy.gguf.constants import ValueType
from toy.gguf.reader import GGUFFile, TypeInfo
from toy.gguf.writer import GGUFWriter
from toy_ggml import GGMLType

# enum llama_ftype, llama.cpp include/llama.h (llama-cpp-python 0.3.36); ids 4-6
# and 33-35 were removed upstream. "GUESSED" (1024) is never written to files.
LLAMA_FTYPES: dict[int, str] = {
    0: "ALL_F32",
    1: "MOSTLY_F16",
    2: "MOSTLY_Q4_0",
    3: "MOSTLY_Q4_1",
    7: "MOSTLY_Q8_0",
    8: "MOSTLY_Q5_0",
    9: "MOSTLY_Q5_1",
    10: "MOSTLY_Q2_K",
    11: "MOSTLY_Q3_K_S",
    12: "MOSTLY_Q3_K_M",
    13: "MOSTLY_Q3_K_L",
    14: "MOSTLY_Q4_K_S",
    15: "MOSTLY_Q4_K_M",
    16: "MOSTLY_Q5_K_S",
    17: "MOSTLY_Q5_K_M",
    18: "MOSTLY_Q6_K",
    19: "MOSTLY_IQ2_XXS",
    20: "MOSTLY_IQ2_XS",
    21: "MOSTLY_Q2_K_S",
    22: "MOSTLY_IQ3_XS",
    23: "MOSTLY_IQ3_XXS",
    24: "MOSTLY_IQ1_S",
    25: "MOSTLY_IQ4_NL",
    26: "MOSTLY_IQ3_S",
    27: "MOSTLY_IQ3_M",
    28: "MOSTLY_IQ2_S",
    29: "MOSTLY_IQ2_M",
    30: "MOSTLY_IQ4_XS",
    31: "MOSTLY_IQ1_M",
    32: "MOSTLY_BF16",
    36: "MOSTLY_TQ1_0",
    37: "MOSTLY_TQ2_0",
    38: "MOSTLY_MXFP4_MOE",
    39: "MOSTLY_NVFP4",
    40: "MOSTLY_Q1_0",
    41: "MOSTLY_Q2_0",
}

# target ggml type -> the llama_ftype of the file it writes (the K-quants: llama.cpp's mixes)
TARGET_FTYPE: dict[GGMLType, int] = {
    GGMLType.F32: 0,
    GGMLType.F16: 1,
    GGMLType.BF16: 32,
    GGMLType.Q8_0: 7,
    GGMLType.Q5_1: 9,
    GGMLType.Q5_0: 8,
    GGMLType.Q4_1: 3,
    GGMLType.Q4_0: 2,
    GGMLType.Q6_K: 18,
    GGMLType.Q5_K: 17,
    GGMLType.Q4_K: 15,
    GGMLType.Q3_K: 12,
    GGMLType.Q2_K: 10,
    GGMLType.IQ4_NL: 25,
}
SUPPORTED_TARGETS: tuple[str, ...] = tuple(t.name for t in TARGET_FTYPE)
_ALIASES = {"Q3_K_M": "Q3_K", "Q4_K_M": "Q4_K", "Q5_K_M": "Q5_K", "FP16": "F16", "FP32": "F32"}
_INT_TYPES = {GGMLType.I8, GGMLType.I16, GGMLType.I32, GGMLType.I64}
QUANT_VERSION = 2  # GGML_QNT_VERSION


def ftype_label(ftype: int) -> str | None:
    """Short name of a general.file_type value: 3 -> "Q4_1", 0 -> "F32"."""
    name = LLAMA_FTYPES.get(ftype)
    if name is None:
        return None
    return name.split("_", 1)[1]


def file_type_of(tensors: Iterable[tuple[tuple[int, ...], GGMLType]]) -> int:
    """The ``general.file_type`` that describes a file holding ``tensors``
    ((shape, GGMLType) pairs): the type holding most parameters among the
    2-D and larger float tensors ("mostly X"), 0 (all F32) when that is F32
    or there are none. A merge that writes some weights as F32 into a
    quantized base says what it wrote this way."""
    count: dict[GGMLType, int] = {}
    for shape, t in tensors:
        if len(shape) >= 2 and t not in _INT_TYPES:
            count[t] = count.get(t, 0) + int(np.prod(shape))
    if not count:
        return 0
    top = max(count, key=lambda t: (count[t], -int(t)))
    return TARGET_FTYPE.get(top, 0)


def parse_target(dtype: str | int | GGMLType) -> GGMLType:
    """The target type, or ValueError naming the supported ones."""
    if isinstance(dtype, str):
        if dtype.strip().upper() in quant_mix.OTHER_K_MIXES:
            mixes = ", ".join(f"{t.name} ({n})" if t.name != n else n for t, n in quant_mix.MIX_NAME.items())
            raise ValueError(
                f"cannot convert a model to {dtype!r}: toy writes llama.cpp's K-quant mixes {mixes}, "
                f"not {dtype.strip().upper()}; supported types: {', '.join(SUPPORTED_TARGETS)}"
            )
        dtype = _ALIASES.get(dtype.strip().upper(), dtype.strip())
    try:
        t = GGMLType.parse(dtype)
    except (ValueError, TypeError):
        t = None
    if t is None or t not in TARGET_FTYPE or (t != GGMLType.F32 and int(t) not in toy_ggml.quantizable_types()):
        raise ValueError(f"cannot convert a model to {dtype!r}; supported types: {', '.join(SUPPORTED_TARGETS)}")
    return t


# tensors llama.cpp's quantizer leaves in their type: learned positions (GPT-2) and token types (BERT)
_KEEP = ("position_embd.weight", "token_types.weight")


def tensor_target(shape: tuple[int, ...], src: GGMLType, target: GGMLType, name: str | None = None) -> GGMLType:
    """The type a tensor ``name`` of ``shape`` (NumPy order) and type ``src``
    gets from a uniform conversion to ``target`` (the K-quant mixes choose
    per tensor: ``quant_mix.plan``)."""
    if src in _INT_TYPES or name in _KEEP:
        return src
    if len(shape) < 2:
        return GGMLType.F32
    return quant_mix.fallback_type(shape[-1], target)


def _mix_target(shape: tuple[int, ...], src: GGMLType, choice: quant_mix.Choice | None) -> GGMLType:
    """The type a tensor gets in a K-quant mix: the mix's choice, or (a tensor
    llama.cpp's quantizer leaves alone) its own type, F32 for a 1-D float one
    as in every toy conversion (llama.cpp would keep an F16 norm F16; its
    converters write norms F32 anyway)."""
    if choice is not None:
        return choice.type
    if src in _INT_TYPES or len(quant_mix.ggml_dims(shape)) >= 2:
        return src
    return GGMLType.F32


@dataclass
class QuantizeReport:
    src: Path
    dst: Path
    target: str
    file_type: int
    mix: str | None = None  # llama.cpp's name of the K-quant mix written ("Q4_K_M"), None when uniform
    n_tensors: int = 0
    converted: int = 0
    copied: int = 0
    fallbacks: dict[str, str] = field(default_factory=dict)  # tensor -> type used (its row fits no other)
    type_counts: dict[str, int] = field(default_factory=dict)  # type written -> tensors
    bytes_in: int = 0
    bytes_out: int = 0

    def to_dict(self) -> dict[str, Any]:
        d = dict(self.__dict__)
        d["src"], d["dst"] = str(self.src), str(self.dst)
        return d


def _convert_tensor(gf: GGUFFile, name: str, dst_type: GGMLType) -> bytes | memoryview:
    info = gf.tensors[name]
    raw = gf.tensor_bytes(name)
    if info.dtype == dst_type:
        return raw
    x = toy_ggml.dequantize(raw, int(info.dtype), info.shape)  # float32, info.shape
    if dst_type == GGMLType.F32:
        return x.tobytes()
    try:
        return toy_ggml.quantize(x, int(dst_type)).tobytes()
    except ValueError as e:
        raise ValueError(f"tensor {name!r} ({info.dtype.name} {info.shape}) -> {dst_type.name}: {e}") from None


def quantize_model(
    src_path: str | os.PathLike[str],
    dst_path: str | os.PathLike[str],
    dtype: str | int | GGMLType,
    progress: Callable[[int, int, str], None] | None = None,
) -> QuantizeReport:
    """Write ``dst_path``: ``src_path`` with its weights converted to ``dtype``
    (a K-quant: llama.cpp's mix of that name, see the module docstring).
    ``progress(done, total, tensor_name)`` is called after each tensor."""
    target = parse_target(dtype)
    ftype = TARGET_FTYPE[target]
    dst = Path(dst_path)
    src = GGUFFile(src_path)
    spill = None
    spill_map = None
    views: list[memoryview] = []
    try:
        mix = target in quant_mix.MIX_FTYPE
        choices = quant_mix.plan({n: i.shape for n, i in src.tensors.items()}, src.metadata, target) if mix else {}
        report = QuantizeReport(
            Path(src_path),
            dst,
            target.name,
            ftype,
            mix=quant_mix.MIX_NAME[target] if mix else None,
            n_tensors=len(src.tensors),
        )
        writer = GGUFWriter(dst, alignment=src.alignment)
        for key, value in src.metadata.items():
            if key == "general.alignment":
                continue  # the writer adds it for a non-default alignment
            if key == "general.file_type":
                writer.add(key, ftype, src.types[key])
            else:
                writer.add(key, value, src.types[key])
        if "general.file_type" not in src.metadata:
            writer.add("general.file_type", ftype, TypeInfo(ValueType.UINT32))
        if (
            target not in (GGMLType.F32, GGMLType.F16, GGMLType.BF16)
            and "general.quantization_version" not in src.metadata
        ):
            writer.add("general.quantization_version", QUANT_VERSION, TypeInfo(ValueType.UINT32))

        dst.parent.mkdir(parents=True, exist_ok=True)
        fd, spill = tempfile.mkstemp(prefix=f".{dst.name}.", suffix=".spill", dir=dst.parent)
        layout: list[tuple[str, tuple[int, ...], GGMLType, int, int]] = []
        total = len(src.tensors)
        with os.fdopen(fd, "wb") as f:
            for i, (name, info) in enumerate(src.tensors.items()):
                shape = info.shape
                if mix:
                    choice = choices.get(name)
                    want = _mix_target(info.shape, info.dtype, choice)
                    shape = quant_mix.ggml_dims(info.shape)  # as llama.cpp writes it
                    if choice is not None and choice.fell_back:
                        report.fallbacks[name] = want.name
                else:
                    want = tensor_target(info.shape, info.dtype, target, name)
                    if len(info.shape) >= 2 and want != target and info.dtype not in _INT_TYPES and name not in _KEEP:
                        report.fallbacks[name] = want.name
                report.type_counts[want.name] = report.type_counts.get(want.name, 0) + 1
                data = _convert_tensor(src, name, want)
                if info.dtype == want:
                    report.copied += 1
                else:
                    report.converted += 1
                start = f.tell()
                f.write(data)
                layout.append((name, shape, want, start, len(memoryview(data).cast("B"))))
                report.bytes_in += info.nbytes
                del data
                if progress:
                    progress(i + 1, total, name)
        size = os.path.getsize(spill)
        if size:
            with open(spill, "rb") as f:
                spill_map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
            whole = memoryview(spill_map)
            views.append(whole)
            for name, shape, t, start, n in layout:
                v = whole[start : start + n]
                views.append(v)
                writer.add_tensor_bytes(name, shape, t, v)
                report.bytes_out += n
        writer.write()
        del writer
        return report
    finally:
        for v in reversed(views):
            try:
                v.release()
            except BufferError:
                pass
        if spill_map is not None:
            try:
                spill_map.close()
            except BufferError:
                pass
        if spill is not None:
            try:
                os.unlink(spill)
            except OSError:
                pass
        src.close()


__all__ = [
    "LLAMA_FTYPES",
    "SUPPORTED_TARGETS",
    "TARGET_FTYPE",
    "QuantizeReport",
    "file_type_of",
    "ftype_label",
    "parse_target",
    "quantize_model",
    "tensor_target",
]
