"""ggml tensors over a GGUF file's data.

On the CPU the tensors point straight into the read-only file mapping (no
copy, quantized types stay quantized); the mapping lives as long as any of
them. On another device each tensor is copied once into a device buffer.

With ``repack`` (inference on the CPU), the weights of the projections that
ggml's CPU backend stores in an interleaved layout with product kernels of
its own (``REPACK_TYPES`` where ``Runtime.repack_layout`` says this CPU has
one) are copied once into such a buffer instead; their pages of the mapping
are then released, so resident memory holds each weight once. A head tied to
the token embedding (no ``output.weight``) gets a repacked copy of the
embedding for its product (``BoundTensors.product_copies``), as llama.cpp
makes one: the embedding's lookup keeps reading the file, whose pages it
touches one row at a time, so resident memory grows by the copy alone.

A model split across devices (``toy.engine.split``) passes ``device_of``:
each tensor then goes to the device it names, the local ones as above and
each other device's in one context of its own, allocated there as weights
(so the scheduler runs the products on the device that holds the weight)
and filled once from the file.
"""

from __future__ import annotations

import mmap
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import toy_ggml
from toy.gguf.reader import GGUFError, GGUFFile, TensorInfo

#: the types toy repacks by default: the layouts whose kernels give each row of a product the bits of that
#: row alone, as exact batching and speculative decoding need (toy-ggml's test_repack.py proves it on every
#: CPU variant the tests run), and that are faster than the plain layout for decode without slowing
#: prefill. ggml's Q4_0 and IQ4_NL (on 2 Zen 4 cores, a 512-row Q4_0 product 15.3 ms repacked against
#: 22.5 ms plain; experts 11.3 against 23.4 ms); toy's own Q4_1 (patch 0028, x86 with AVX2) and Q8_0
#: (AVX-512 VNNI), whose products are the plain layout's one-row products bit for bit (a 1536x576 Q8_0
#: product of one row 0.020 ms against 0.032-0.046 plain; of 512 rows 4.4 ms against tinyBLAS's 4.2).
REPACK_TYPES = frozenset(
    {toy_ggml.GGMLType.Q4_0, toy_ggml.GGMLType.IQ4_NL, toy_ggml.GGMLType.Q8_0, toy_ggml.GGMLType.Q4_1}
)
#: with ``repack="all"``, also the K-quant layouts (row-invariant in toy's hinted products through patch
#: 0026): faster one-row products (decode), slower many-row ones where not hinted (a prefill without exact
#: batching: a 512-row Q4_K product 14.5 ms repacked against 8.3 ms plain; experts 14.2 against 6.1 ms)
REPACK_ALL_TYPES = REPACK_TYPES | {toy_ggml.GGMLType.Q4_K, toy_ggml.GGMLType.Q2_K}
#: the values ``repack`` takes
REPACK_CHOICES = (False, True, "all")

#: the weights read only as a product's first operand (a repacked weight can be nothing else): the
#: projections of every architecture toy runs (a mixture's shared expert too), and the output head (not
#: the token embedding, which GET_ROWS reads, even when the head is tied to it)
_PRODUCT_WEIGHTS = (
    "attn_q.weight", "attn_k.weight", "attn_v.weight", "attn_qkv.weight", "attn_output.weight",
    "ffn_gate.weight", "ffn_up.weight", "ffn_down.weight",
    "ffn_gate_shexp.weight", "ffn_up_shexp.weight", "ffn_down_shexp.weight",
)  # fmt: skip
#: a mixture's experts, (E, out, in) each, read only by ``mul_mat_id``
_EXPERT_WEIGHTS = ("ffn_gate_exps.weight", "ffn_up_exps.weight", "ffn_down_exps.weight")
_EMBEDDING = "token_embd.weight"


def _repackable(
    info: TensorInfo, runtime: toy_ggml.Runtime, types: frozenset[toy_ggml.GGMLType], head: bool = False
) -> bool:
    """Whether ``info`` goes into ggml's repacked layout: a projection or a mixture's experts (or, ``head``,
    the embedding a tied head reads) of one of ``types``, with a layout for its shape on this CPU."""
    if info.dtype not in types or not (head or info.name.startswith("blk.") or info.name == "output.weight"):
        return False
    if len(info.shape) == 3:
        if not info.name.endswith(_EXPERT_WEIGHTS):
            return False
    elif len(info.shape) != 2 or not (head or info.name == "output.weight" or info.name.endswith(_PRODUCT_WEIGHTS)):
        return False
    return runtime.repack_layout(info.dtype, info.shape)


@dataclass
class BoundTensors:
    """The context holding the tensors, and the tensors by GGUF name."""

    context: toy_ggml.Context
    tensors: dict[str, toy_ggml.Tensor]
    zero_copy: bool
    #: the contexts of the tensors on other devices than the runtime's primary one (a split model), and
    #: of the repacked weights
    remote: list[toy_ggml.Context] = field(default_factory=list)
    #: the GGUF names of the weights held in ggml's repacked layouts (``repack``)
    repacked: frozenset[str] = frozenset()
    #: product-only copies of tensors that are also read otherwise, by GGUF name: a tied head's repacked
    #: embedding (``toy.models.common.head_weight`` reads it)
    product_copies: dict[str, toy_ggml.Tensor] = field(default_factory=dict)

    def __getitem__(self, name: str) -> toy_ggml.Tensor:
        return self.tensors[name]

    def close(self) -> None:
        for ctx in self.remote:
            ctx.close()
        self.remote.clear()
        self.context.close()


def bind_tensors(
    gf: GGUFFile,
    runtime: toy_ggml.Runtime | None = None,
    device_of: Callable[[str], str | None] | None = None,
    repack: bool | str = False,
) -> BoundTensors:
    """Make a ggml tensor for every tensor of ``gf``: zero-copy on the CPU
    (``runtime`` None or a CPU runtime), copied to ``runtime``'s device
    otherwise. ``device_of`` (a split model): the backend name of ``runtime``
    that holds each tensor by GGUF name (None or the primary's: as above).
    ``repack`` (a CPU runtime, one device): the weights of ``REPACK_TYPES``
    (``"all"``: ``REPACK_ALL_TYPES``) with a repacked layout on this CPU are
    copied into it (``BoundTensors.repacked`` names them); such a weight can
    only be a product's first operand and cannot be read back through ggml,
    so only inference asks for it."""
    if repack not in REPACK_CHOICES:
        raise ValueError(f"repack={repack!r}: expected one of {', '.join(map(repr, REPACK_CHOICES))}")
    types = REPACK_ALL_TYPES if repack == "all" else REPACK_TYPES
    primary = "" if runtime is None else runtime.backends[0]
    where: dict[str, list[TensorInfo]] = {}
    for info in gf.tensors.values():
        dev = device_of(info.name) if device_of is not None else None
        where.setdefault(dev or primary, []).append(info)
    split = len(where) > 1 or primary not in where
    zero_copy = runtime is None or runtime.device == "CPU"
    packed: list[TensorInfo] = []
    # the runtime whose CPU repacks the weights (None: nothing is repacked)
    cpu = runtime if repack and zero_copy and not split else None
    if cpu is not None:
        packed = [info for info in where.get(primary, ()) if _repackable(info, cpu, types)]
        if packed:
            names = {info.name for info in packed}
            where[primary] = [info for info in where[primary] if info.name not in names]
    ctx = toy_ggml.Context(max_tensors=len(where.get(primary, ())) + 16)
    out: dict[str, toy_ggml.Tensor] = {}
    for info in where.get(primary, ()):
        out[info.name] = ctx.tensor(info.dtype, info.shape, name=info.name)
    bound = BoundTensors(ctx, out, zero_copy, repacked=frozenset(info.name for info in packed))
    tied = None  # the embedding a tied head reads, when it gets a repacked copy
    embd = gf.tensors.get(_EMBEDDING)
    if (
        cpu is not None
        and "output.weight" not in gf.tensors
        and embd is not None
        and _repackable(embd, cpu, types, head=True)
    ):
        tied = embd
    try:
        if cpu is not None and (packed or tied is not None):
            pctx = _weights_context(bound, packed)
            copies = [(info, out[info.name]) for info in packed]
            if tied is not None:
                head = pctx.tensor(tied.dtype, tied.shape, name=f"{tied.name}.head")
                bound.product_copies[tied.name] = head
                copies.append((tied, head))
            pctx.allocate(cpu, weights=True, repack=True)

            def fill(job: tuple[TensorInfo, toy_ggml.Tensor]) -> None:
                info, dest = job
                try:
                    dest.set_raw(gf.tensor_bytes(info.name))
                except ValueError as e:  # ggml's row check: NaN/inf scales, which repacking refuses
                    raise GGUFError(
                        f"tensor {info.name!r} ({info.dtype.name}): {e}",
                        hint="the file is damaged; load it with repack=False to use it as it is",
                    ) from None
                _release(gf, gf.data_offset + info.offset, info.nbytes)

            # the runtime's threads repack the weights side by side (set_raw runs without the GIL)
            with ThreadPoolExecutor(max_workers=min(cpu.threads, len(copies))) as pool:
                for _ in pool.map(fill, copies):
                    pass
        if out and zero_copy:
            # a split model's local weights are marked as weights: the scheduler then runs their ops here
            # (unmarked, it would run the head on a remote device and send it the head's weights every step)
            buf = toy_ggml.buffer_from_memory(gf._map, weights=split)
            for info in where[primary]:
                out[info.name].bind(buf, gf.data_offset + info.offset)
            buf.close()  # the context owns it now; freed with the context
        elif out:
            ctx.allocate(runtime, weights=split)
            for info in where[primary]:
                out[info.name].set_raw(gf.tensor_bytes(info.name))
        for dev, infos in where.items():
            if dev == primary:
                continue
            rctx = _weights_context(bound, infos)
            rctx.allocate(runtime, device=dev, weights=True)
            for info in infos:
                out[info.name].set_raw(gf.tensor_bytes(info.name))
    except BaseException:
        bound.close()
        raise
    return bound


def _weights_context(bound: BoundTensors, infos: list[TensorInfo]) -> toy_ggml.Context:
    """A context of its own (closed with ``bound``) with a tensor for each of ``infos``, in ``bound``."""
    ctx = toy_ggml.Context(max_tensors=len(infos) + 16)
    bound.remote.append(ctx)
    for info in infos:
        bound.tensors[info.name] = ctx.tensor(info.dtype, info.shape, name=info.name)
    return ctx


def _release(gf: GGUFFile, start: int, size: int) -> None:
    """Drop this process's pages of ``gf``'s mapping in [start, start + size) (whole pages inside it):
    a repacked weight was read from them once; the page cache keeps the file, resident memory does not."""
    page = mmap.PAGESIZE
    a = (start + page - 1) // page * page
    b = (start + size) // page * page
    if b > a and hasattr(gf._map, "madvise"):
        gf._map.madvise(mmap.MADV_DONTNEED, a, b - a)
