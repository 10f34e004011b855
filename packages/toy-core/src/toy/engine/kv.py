"""The KV cache: one region ("slot") per sequence, cells in position order.

Layout (NumPy order, per layer ``l``):

- ``k[l]``: (n_slot, n_ctx, H_kv * D) — the keys of slot ``s`` at position
  ``p`` are row ``s * n_ctx + p`` of the (n_slot * n_ctx, H_kv * D) matrix;
- ``v[l]``: (n_slot, H_kv * D, n_ctx) — values transposed (channel-major),
  as llama.cpp stores them without flash attention, so ``softmax(KQ) @ V``
  reads each channel's values contiguously; with flash attention values are
  stored like keys, (n_slot, n_ctx, H_kv * D).

Decisions:

- A slot holds exactly one sequence and its cells are positions ``0 ..
  length - 1``. A sequence's cells therefore lie in the same order whether it
  runs alone or beside others, which is what makes batched decoding give
  every sequence bit-for-bit its solo result (the attention reads the same
  cells in the same order; see ``toy.engine.llm``).
- Prefix reuse is per slot: ``tokens(slot)`` is what the slot holds, and a
  caller keeps the common prefix (``truncate``) and prefills only the rest.
- The cache memory is zero from creation (on the CPU, an anonymous mapping
  whose pages the OS zeroes on first touch; on a device, written once). Cells past a sequence's length
  are masked out of attention; zeros (or a previous sequence's finite values)
  there contribute exact zeros.
"""

from __future__ import annotations

import contextlib
import mmap

import numpy as np

import toy_ggml
from toy.errors import BadInputError

_ALIGN = 64  # bytes: each cache tensor starts on a cache line (ggml's CPU buffers need 32)

KV_TYPES = {"f16": toy_ggml.GGMLType.F16, "f32": toy_ggml.GGMLType.F32, "q8_0": toy_ggml.GGMLType.Q8_0}


def kv_type_of(name) -> toy_ggml.GGMLType:
    """A KV cache type from its name (f16, f32, q8_0) or a GGMLType."""
    if isinstance(name, toy_ggml.GGMLType):
        if name in KV_TYPES.values():
            return name
        name = name.name
    t = KV_TYPES.get(str(name).lower())
    if t is None:
        raise BadInputError(f"KV cache type {name!r} is not supported", hint=f"choose one of {', '.join(KV_TYPES)}")
    return t


class KVCache:
    """K and V tensors for every layer, for ``n_slot`` sequences of up to
    ``n_ctx`` tokens each, allocated on ``runtime``'s device."""

    def __init__(self, cfg, runtime: toy_ggml.Runtime, n_ctx: int, n_slot: int = 1, kv_type="f16", v_trans=True):
        if n_ctx < 1 or n_slot < 1:
            raise BadInputError(f"KV cache needs n_ctx >= 1 and n_slot >= 1 (got n_ctx={n_ctx}, n_slot={n_slot})")
        self.kv_type = kv_type_of(kv_type)
        if v_trans and self.kv_type == toy_ggml.GGMLType.Q8_0:
            raise BadInputError(
                "a Q8_0 KV cache needs flash attention",
                hint="turn on flash attention (--flash-attn, flash_attn=True) or use an f16 cache",
            )
        self.cfg, self.n_ctx, self.n_slot, self.v_trans = cfg, n_ctx, n_slot, v_trans
        self.width = cfg.n_head_kv * cfg.head_dim
        if self.kv_type == toy_ggml.GGMLType.Q8_0 and cfg.head_dim % 32:
            raise BadInputError(f"a Q8_0 KV cache needs a head size that is a multiple of 32 (got {cfg.head_dim})")
        self._ctx = toy_ggml.Context(max_tensors=2 * cfg.n_layer + 2)
        k_shape = (n_slot, n_ctx, self.width)
        v_shape = (n_slot, self.width, n_ctx) if v_trans else k_shape
        self.k = [self._ctx.tensor(self.kv_type, k_shape, name=f"cache_k_l{i}") for i in range(cfg.n_layer)]
        self.v = [self._ctx.tensor(self.kv_type, v_shape, name=f"cache_v_l{i}") for i in range(cfg.n_layer)]
        tensors = self.k + self.v
        if runtime.device == "CPU":
            # an anonymous private mapping: the OS hands out pages of zeros when they
            # are first touched, so creating the cache makes no pass over it and
            # positions a sequence never reaches take no memory. Small pages: a huge
            # page would be zeroed whole (2 MiB) on the first write into it, which
            # makes the first forward pay for most of the cache. Zero bytes are 0.0 in
            # every KV type (F16, F32, and Q8_0 blocks: a zero scale and zero quants,
            # what quantizing zeros gives).
            offsets, total = [], 0
            for t in tensors:
                offsets.append(total)
                total += -(-t.nbytes // _ALIGN) * _ALIGN
            mem = mmap.mmap(-1, total, flags=mmap.MAP_PRIVATE)
            with contextlib.suppress(AttributeError, OSError):  # not every OS has the advice
                mem.madvise(mmap.MADV_NOHUGEPAGE)
            buf = toy_ggml.buffer_from_memory(mem)
            for t, off in zip(tensors, offsets):
                t.bind(buf, off)
            buf.close()  # the context owns it now (and, through it, ``mem``)
        else:
            self._ctx.allocate(runtime)
            zeros = None
            for t in tensors:
                zeros = zeros or bytes(t.nbytes)
                t.set_raw(zeros)
        self._tokens: list[list[int]] = [[] for _ in range(n_slot)]

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.k + self.v)

    def _check(self, slot: int) -> None:
        if not 0 <= slot < self.n_slot:
            raise BadInputError(f"slot {slot} is out of range (the cache has {self.n_slot} slots)")

    def length(self, slot: int) -> int:
        """Tokens cached in ``slot`` (its next position)."""
        self._check(slot)
        return len(self._tokens[slot])

    def tokens(self, slot: int) -> list[int]:
        """The token ids cached in ``slot``, in position order (a copy)."""
        self._check(slot)
        return list(self._tokens[slot])

    def append(self, slot: int, ids) -> None:
        """Record that ``ids`` were written at the slot's next positions
        (called by the engine after the compute that wrote them)."""
        self._tokens[slot].extend(int(i) for i in ids)

    def truncate(self, slot: int, n: int) -> None:
        """Keep the first ``n`` tokens of ``slot`` (0 clears it)."""
        self._check(slot)
        if n < 0:
            raise BadInputError(f"truncate: n={n} must be >= 0")
        del self._tokens[slot][n:]

    def clear(self, slot: int | None = None) -> None:
        for s in range(self.n_slot) if slot is None else (slot,):
            self.truncate(s, 0)

    def common_prefix(self, slot: int, ids) -> int:
        """How many leading tokens of ``ids`` the slot already holds."""
        self._check(slot)
        held = self._tokens[slot]
        n = min(len(held), len(ids))
        a = np.asarray(held[:n], np.int64)
        b = np.asarray(ids[:n], np.int64)
        diff = np.flatnonzero(a != b)
        return int(diff[0]) if len(diff) else n

    def close(self) -> None:
        self._ctx.close()


__all__ = ["KV_TYPES", "KVCache", "kv_type_of"]
