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
- ``read``/``write`` copy the K/V bytes of a span of positions out of and
  into a slot in one layout-independent order, (n_layer, 2, n, row_bytes)
  (a transposed V's channel rows gathered per position), through NumPy views
  over the CPU mapping (the prefix cache, ``toy.engine.prefix``, and slot
  files). With exact batching a position's K/V depend only on its context,
  so bytes copied into another slot are what a prefill there would write.
  CPU only: on a device they raise ``BadInputError``. A Q8_0 row is whole
  blocks of 32 values, so a position's row is still contiguous bytes.
- A model split across devices (``toy.engine.split``) keeps each layer's K
  and V on the device of that layer's weights (``layer_devices``): the local
  layers as above, each other device's in a context allocated there and
  zeroed once. ``device`` then names them all ("CPU+RPC0[10.0.0.2:50052]"), and ``read`` /
  ``write`` refuse, as on any device.
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

    def __init__(
        self,
        cfg,
        runtime: toy_ggml.Runtime,
        n_ctx: int,
        n_slot: int = 1,
        kv_type="f16",
        v_trans=True,
        layer_devices=None,
    ):
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
        # each layer's device (a backend name of ``runtime``; None: the primary one)
        primary = runtime.backends[0]
        devs = [
            primary if layer_devices is None or layer_devices[i] is None else layer_devices[i]
            for i in range(cfg.n_layer)
        ]
        ctxs: dict[str, toy_ggml.Context] = {}
        for d in [primary, *devs]:
            if d not in ctxs:
                ctxs[d] = toy_ggml.Context(max_tensors=2 * cfg.n_layer + 2)
        self._ctx = ctxs.pop(primary)
        self._remote = ctxs  # the other devices' contexts, by backend name
        k_shape = (n_slot, n_ctx, self.width)
        v_shape = (n_slot, self.width, n_ctx) if v_trans else k_shape
        self.k, self.v = [], []
        for i, d in enumerate(devs):
            ctx = self._ctx if d == primary else self._remote[d]
            self.k.append(ctx.tensor(self.kv_type, k_shape, name=f"cache_k_l{i}"))
            self.v.append(ctx.tensor(self.kv_type, v_shape, name=f"cache_v_l{i}"))
        try:
            for d, ctx in self._remote.items():
                ctx.allocate(runtime, device=d)
                zeros = None
                for i in range(cfg.n_layer):
                    if devs[i] == d:
                        zeros = zeros or bytes(self.k[i].nbytes)
                        self.k[i].set_raw(zeros)
                        self.v[i].set_raw(zeros)  # K and V hold as many values (v_trans only transposes)
        except BaseException:
            self.close()
            raise
        local = [i for i in range(cfg.n_layer) if devs[i] == primary]
        tensors = [self.k[i] for i in local] + [self.v[i] for i in local]
        if tensors and runtime.device == "CPU":
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
            if not self._remote:  # byte views of each layer's K and V over the same memory (``read``/``write``)
                es = self.k[0].nbytes // (n_slot * n_ctx * self.width)  # bytes per value (F16, F32; not Q8_0)
                vb_shape = (n_slot, self.width, n_ctx, es) if v_trans else (n_slot, n_ctx, -1)
                self._kb = [self._bytes_view(mem, off, t, (n_slot, n_ctx, -1)) for t, off in zip(self.k, offsets)]
                self._vb = [self._bytes_view(mem, off, t, vb_shape) for t, off in zip(self.v, offsets[cfg.n_layer :])]
        elif tensors:
            self._ctx.allocate(runtime)
            zeros = None
            for t in tensors:
                zeros = zeros or bytes(t.nbytes)
                t.set_raw(zeros)
        self._tokens: list[list[int]] = [[] for _ in range(n_slot)]
        self.device = "+".join([runtime.device, *self._remote])  # "CPU", or a split's devices: "CPU+RPC[...]"

    @staticmethod
    def _bytes_view(mem, offset: int, t, shape) -> np.ndarray:
        """A writable uint8 view of tensor ``t``'s bytes at ``offset`` in ``mem``, reshaped to ``shape``."""
        return np.frombuffer(mem, np.uint8, count=t.nbytes, offset=offset).reshape(shape)

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

    # -- copying positions out and in (the prefix cache, slot files)

    @property
    def row_bytes(self) -> int:
        """Bytes of one position's K (or V) in one layer: ``width`` values of ``kv_type``."""
        return self.k[0].nbytes // (self.n_slot * self.n_ctx)

    @property
    def token_bytes(self) -> int:
        """Bytes of one position over every layer, K and V."""
        return 2 * self.cfg.n_layer * self.row_bytes

    def _host(self, what: str) -> None:
        if self._remote:
            raise BadInputError(
                f"{what} needs the KV cache in local memory (this one is split: {self.device})",
                hint="the prefix cache and slot files need every layer local: run without --rpc, "
                "or turn the prefix cache off (--cache-ram 0)",
            )
        if self.device != "CPU":
            raise BadInputError(
                f"{what} needs the KV cache in CPU memory (this one is on {self.device})",
                hint="the prefix cache and slot files are CPU-only for now: run with --device cpu, "
                "or turn the prefix cache off (--cache-ram 0)",
            )

    def _span(self, slot: int, start: int, n: int) -> None:
        self._check(slot)
        if start < 0 or n < 0 or start + n > self.n_ctx:
            raise BadInputError(f"positions [{start}, {start + n}) are outside the slot's {self.n_ctx}")

    def read(self, slot: int, start: int, n: int) -> np.ndarray:
        """A copy of the K and V bytes of positions ``[start, start + n)`` of ``slot``: uint8 of shape
        (n_layer, 2, n, row_bytes), K then V per layer, each position's ``width`` channels in order. The order
        does not depend on the layout: a transposed V's strided channel rows are gathered into position rows
        (the bytes of each value are kept as they are)."""
        self._host("reading the KV cache")
        self._span(slot, start, n)
        L, rb = self.cfg.n_layer, self.row_bytes
        out = np.empty((L, 2, n, rb), np.uint8)
        for i in range(L):
            out[i, 0] = self._kb[i][slot, start : start + n]
            if self.v_trans:  # (width, n, es): each channel's values at the n positions -> (n, width * es)
                out[i, 1] = self._vb[i][slot, :, start : start + n].transpose(1, 0, 2).reshape(n, rb)
            else:
                out[i, 1] = self._vb[i][slot, start : start + n]
        return out

    def write(self, slot: int, start: int, data, ids) -> None:
        """Write K/V bytes in ``read``'s order (shape (n_layer, 2, n, row_bytes)) at positions ``[start, start +
        n)`` of ``slot`` and record ``ids`` (n of them) there, as ``append`` does after a compute: the slot keeps
        its first ``start`` tokens (``start`` at most its length) and then holds ``start + n``."""
        self._host("writing the KV cache")
        ids = [int(i) for i in ids]
        n = len(ids)
        self._span(slot, start, n)
        if start > len(self._tokens[slot]):
            raise BadInputError(f"write at {start}: slot {slot} holds only {len(self._tokens[slot])} tokens")
        L, rb = self.cfg.n_layer, self.row_bytes
        a = np.asarray(data, np.uint8)
        if a.shape != (L, 2, n, rb):
            raise BadInputError(f"KV data of shape {a.shape} does not fit ({L}, 2, {n}, {rb})")
        self.truncate(slot, start)
        for i in range(L):
            self._kb[i][slot, start : start + n] = a[i, 0]
            if self.v_trans:
                self._vb[i][slot, :, start : start + n] = a[i, 1].reshape(n, self.width, -1).transpose(1, 0, 2)
            else:
                self._vb[i][slot, start : start + n] = a[i, 1]
        self._tokens[slot].extend(ids)

    def close(self) -> None:
        for ctx in self._remote.values():
            ctx.close()
        self._remote.clear()
        self._ctx.close()


__all__ = ["KV_TYPES", "KVCache", "kv_type_of"]
