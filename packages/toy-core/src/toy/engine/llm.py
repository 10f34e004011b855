"""The inference engine: batched prefill and multi-sequence
decode over a KV cache, with graphs built once per shape.

Two kinds of step, both "uploads + one compute" once their graph exists:

- ``prefill(slot, ids)``: the tokens of ONE sequence appended to its cache
  slot, in micro-batches of at most ``n_batch`` tokens (one graph each):
  Q (H, n, D) against the slot's first ``n_kv`` cached keys, a causal mask
  (n, n_kv), K/V written into the cache by ``set_rows`` inside the graph.
  Matrix products may use the CPU's batched kernels (as llama.cpp's prompt
  processing does), unless ``exact_batching``: then prefill products are
  row-invariant too, so a token's K, V and logits depend only on its
  context, never on how the prompt was cut into chunks or which prefix was
  reused from the cache (the server needs this; single-sequence output is
  then no longer llama.cpp's to the last bit for F32/Q8_0/Q4_0 weights).
  With ``flash_attn`` too, attention then uses ggml's one-row kernel
  (``flash_attn_ext(row_invariant=True)``, toy-ggml patch 0020) instead of
  the tiled and split-key kernels ggml picks by shape; so it does on an
  adaptive runtime (the default thread count, ``toy_ggml.runtime_threads``),
  where the split-key kernel's sums would change with the thread count.
- ``decode(slots, tokens)``: one new token for each of S sequences in one
  graph: the weight products run on (S, d) activations with
  ``row_invariant`` products (each row summed exactly as a one-row product,
  toy-ggml patch 0004), and each sequence attends to its own slot with its
  own mask (1, n_kv_s). A sequence therefore gets bit-for-bit the logits it
  gets when decoded alone, whatever else is in the batch.

Shapes (NumPy order): activations (n, d_model); Q (n, H, D), K and V
(n, H_kv, D) before the cache; the attention length ``n_kv`` is the cached
length rounded up to ``kv_pad`` (32 like llama.cpp without flash attention,
256 with it) and capped at ``n_ctx``; padding cells are masked (-inf).
Without flash attention ``kv_pad`` is raised to a multiple of
``toy_ggml.sum_step()`` (64 on the AVX-512 CPU variants, 32 on AVX2): the
attention-weighted sum of V is a dot product over the attention length, and
ggml sums a length's last ``n % step`` elements one by one, so a sequence
padded to 32 alone and to 64 in a batch would be summed in a different
order. With every length a multiple of the step, a batch only adds zeros to
the same SIMD lanes, and on AVX2 the numbers are the same as with 32.

LoRA adapters (``lora``, optional): a map from a base weight's GGUF name to
its terms ``(a, b, scale, None)`` — A (r, in) and B (out, r) ggml tensors
allocated on the engine's runtime and owned by the caller (``toy.load``
keeps them in one context and frees them with the model, after the
engine). Every prefill and decode graph passes them to ``forward``, whose
product with that weight becomes ``W x + Σ scale · B (A x)`` (llama.cpp's
``build_lora_mm``; several adapters stack as several terms). A and B are
products like any other, so the row-invariance rules above hold for them.

Selectable adapters (``adapters``, optional): a list of term maps like
``lora``, one per adapter, of which each sequence uses at most one, chosen by
``slot_adapter[slot]`` (an index into ``adapters``, or None for the base).
A graph computes the terms of every selectable adapter that one of its rows
uses (the set is part of the graph's key; an adapter no row uses is left
out, so a loaded but idle adapter costs nothing), each for all its rows with
its input multiplied by a per-row 0/1 feed (``lsel{j}``, set from the rows'
slots at each compute): a row multiplied by 1 gives exactly the bits of that
adapter applied alone (x · 1 = x), a row multiplied by 0 adds an exact zero.
So sequences with different adapters (and without one) decode in one graph
and each gets the output it would get alone. The cost: each used adapter's
products run over every row of the step. ``add_adapter`` / ``remove_adapter``
change the set between steps (``toy.Model.load_adapter`` /
``unload_adapter``): indices stay stable (a removed adapter leaves a hole,
None, that a later add fills), every cached graph is dropped (graphs hold the
adapters' tensors and feeds), and a slot holding K/V computed with a removed
adapter is emptied, so its prefix is never reused under another adapter
that later takes the same index.

Sliding windows and soft-caps (Gemma): a model whose layers attend through
different windows (``arch.windows(cfg)``) gets one mask input per window
for every mask of a graph, each layer reading its own
(``arch.sliding_window``); the cache keeps every position of every layer
(as llama.cpp's default ``swa_full``), so a sequence longer than the window
is correct, only masked. ``arch.attention_softcap`` caps a layer's scores
before the mask (``toy.models.common.soft_capped``; ``flash_attn_ext``'s
``logit_softcap`` with flash attention).

A model split across devices (``toy.engine.split``): ``layer_devices``
names each layer's device, where its weights already are (``toy.load``
binds them) and where the engine puts its K/V; ggml's scheduler then runs
each layer's ops there and moves only the activations between devices. A
remote device that fails a compute raises ``RemoteDeviceError`` naming its
endpoint; the engine is then unusable (a dead connection stays dead).

Graphs are cached by their shape key (LRU, ``max_graphs``): a decode step
whose sequences keep their slots and padded lengths reuses the previous
graph. Exceeding a slot's context raises ``ContextOverflowError`` before any
compute. Not thread-safe: one engine serves one thread (the server runs one
engine worker).
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial

import numpy as np

import toy_ggml
from toy import models
from toy.engine.kv import KVCache
from toy.engine.split import remote_failure
from toy.errors import BadInputError
from toy.models.common import attention, padded_length, position_mask, soft_capped

F16, F32, I32, I64 = toy_ggml.GGMLType.F16, toy_ggml.GGMLType.F32, toy_ggml.GGMLType.I32, toy_ggml.GGMLType.I64


class ContextOverflowError(BadInputError):
    """A sequence would grow past its slot's context length (bad input: the
    CLI exits 2). Its ``field`` is ``prompt``: the input that has to shrink
    (or the budget beside it)."""


@dataclass
class _Graph:
    inputs: toy_ggml.Context
    ops: toy_ggml.Context
    graph: toy_ggml.Graph
    feeds: dict[str, toy_ggml.Tensor]
    out: toy_ggml.Tensor
    uses: int = 0

    def close(self) -> None:
        self.ops.close()
        self.inputs.close()


@dataclass
class EngineStats:
    graph_builds: int = 0
    prefill_tokens: int = 0
    decode_tokens: int = 0
    computes: int = 0


class LLMEngine:
    """Prefill and decode for any registered architecture (``toy.models``)
    over a slotted KV cache; the forward is ``arch.forward`` with this
    engine's attention, scaled per layer by ``arch.attention_scale``.

    ``weights`` maps GGUF tensor names to bound ggml tensors on ``runtime``.
    ``n_ctx``: tokens per slot; ``n_slot``: sequences held at once;
    ``n_batch``: the prefill micro-batch; ``kv_type``: f16 (default), f32,
    or q8_0 (needs ``flash_attn``); ``lora``: LoRA terms by weight name (see
    the module docstring), applied by every graph.
    """

    def __init__(
        self,
        cfg,
        weights,
        runtime: toy_ggml.Runtime,
        n_ctx: int,
        n_slot: int = 1,
        n_batch: int = 512,
        kv_type="f16",
        flash_attn: bool = False,
        kv_pad: int | None = None,
        max_graphs: int = 16,
        exact_batching: bool = False,
        lora: dict | None = None,
        adapters: Sequence[dict] | None = None,
        layer_devices: Sequence[str | None] | None = None,
    ):
        if n_batch < 1:
            raise BadInputError(f"n_batch={n_batch} must be >= 1", field="n_batch")
        self.cfg, self.weights, self.runtime = cfg, weights, runtime
        self.arch = models.language_model_of(cfg)
        # the layers' attention windows (0: full): one mask input per window and mask
        self.windows = self.arch.windows(cfg)
        self._win = [self.windows.index(self.arch.sliding_window(cfg, i)) for i in range(cfg.n_layer)]
        self.flash_attn = bool(flash_attn)
        self.cache = KVCache(
            cfg, runtime, n_ctx, n_slot, kv_type, v_trans=not self.flash_attn, layer_devices=layer_devices
        )
        self.n_ctx, self.n_slot, self.n_batch = n_ctx, n_slot, n_batch
        self.kv_pad = kv_pad or (256 if self.flash_attn else 32)
        if not self.flash_attn:  # see the module docstring: batch invariance of the V sums
            self.kv_pad = math.lcm(self.kv_pad, toy_ggml.sum_step())
        self.max_graphs = max_graphs
        self.exact_batching = bool(exact_batching)
        self.one_attention = True  # decode consecutive slots with one 4-D attention (see _one_attention)
        self.lora = {name: list(terms) for name, terms in (lora or {}).items() if terms} or None
        #: selectable adapters (see the module docstring; None: an index freed by ``remove_adapter``)
        #: and the one each slot uses (None: the base)
        self.adapters: list[dict | None] = [{n: list(t) for n, t in a.items() if t} for a in adapters or ()]
        self.slot_adapter: list[int | None] = [None] * n_slot
        self._lora_ops = self._count_lora_ops()
        self._graph_adapters: tuple[int, ...] = ()  # the adapters the graph being built computes (_use_adapters)
        self._graphs: OrderedDict[tuple, _Graph] = OrderedDict()
        self.stats = EngineStats()
        self._profile: list | None = None  # (graph, node times) of each compute while toy.trace profiles

    # ------------------------------------------------------------------ adapters

    def _count_lora_ops(self) -> int:
        # each LoRA term adds 4 ops (A x, B (A x), scale, add) to a graph, a selectable one up to 6 (its row
        # feed; an expert term reshapes it)
        n = 4 * sum(len(t) for t in (self.lora or {}).values())
        return n + 6 * sum(len(t) for a in self.adapters if a is not None for t in a.values())

    def _live_adapters(self) -> list[int]:
        return [j for j, a in enumerate(self.adapters) if a is not None]

    def _use_adapters(self, slots) -> tuple[int, ...]:
        """The selectable adapters the rows of a step over ``slots`` use (what its graph computes, and part of its
        key): an adapter no row uses would only add exact zeros at the cost of its products, so it is left out."""
        used = {self.slot_adapter[s] for s in slots}
        self._graph_adapters = tuple(j for j in self._live_adapters() if j in used)
        return self._graph_adapters

    def _adapters_changed(self) -> None:
        """Graphs reference the adapters' tensors and feeds: drop them all."""
        self._lora_ops = self._count_lora_ops()
        for g in self._graphs.values():
            g.close()
        self._graphs.clear()

    def add_adapter(self, terms: dict) -> int:
        """Add a selectable adapter (a term map like ``lora``; its tensors stay
        the caller's) at the first free index, or at the end; returns the index.
        Call between steps, on the engine's thread."""
        terms = {n: list(t) for n, t in terms.items() if t}
        j = next((j for j, a in enumerate(self.adapters) if a is None), len(self.adapters))
        if j == len(self.adapters):
            self.adapters.append(terms)
        else:
            self.adapters[j] = terms
        self._adapters_changed()
        return j

    def remove_adapter(self, j: int) -> None:
        """Free index ``j`` (kept as a hole: other indices stay). No running
        sequence may use it; a slot that holds K/V computed with it is emptied,
        so no prefix of it is reused under a later adapter at that index. The
        caller frees the tensors afterwards. Call between steps, on the
        engine's thread."""
        if not 0 <= j < len(self.adapters) or self.adapters[j] is None:
            raise BadInputError(f"no selectable adapter at index {j}")
        self.adapters[j] = None
        for s in range(self.n_slot):
            if self.slot_adapter[s] == j:
                self.cache.truncate(s, 0)
                self.slot_adapter[s] = None
        self._adapters_changed()

    # ------------------------------------------------------------------ shapes

    def _n_kv(self, length: int) -> int:
        return min(self.n_ctx, padded_length(length, self.kv_pad))

    def _views(self, ctx, layer: int, kc, vc, slot: int, n_kv: int):
        """K (H_kv, n_kv, D) and V ((H_kv, D, n_kv) transposed, or
        (H_kv, n_kv, D) for flash attention) of ``slot`` as views of the
        cache (after this graph's writes: ``kc``/``vc`` are the set_rows)."""
        cache, Hkv, D = self.cache, self.cfg.n_head_kv, self.cfg.head_dim
        k = cache.k[layer]
        row = k.strides[1]  # bytes of one cached position (H_kv * D values)
        head = row // Hkv
        kv = ctx.view(kc, (Hkv, n_kv, D), strides=(head, row, k.strides[2]), offset=slot * k.strides[0])
        v = cache.v[layer]
        if cache.v_trans:  # (n_slot, W, n_ctx): channel c of head h is row h * D + c
            es = v.strides[2]
            vv = ctx.view(vc, (Hkv, D, n_kv), strides=(D * v.strides[1], v.strides[1], es), offset=slot * v.strides[0])
        else:
            vv = ctx.view(vc, (Hkv, n_kv, D), strides=(head, row, v.strides[2]), offset=slot * v.strides[0])
        return kv, vv

    def _one_attention(self, slots: tuple[int, ...]) -> bool:
        """Whether a decode step can attend for all its sequences at once:
        more than one, consecutive slots, the transposed-V cache (no flash
        attention). Each sequence then reads the longest sequence's padded
        length; the extra cells are masked (-inf), so they add exact zeros and
        every sequence's result is bit-identical to its own attention."""
        return (
            self.one_attention
            and len(slots) > 1
            and not self.flash_attn
            and self.cache.v_trans
            and slots == tuple(range(slots[0], slots[0] + len(slots)))
        )

    def _slot_views(self, ctx, layer: int, kc, vc, slot0: int, S: int, n_kv: int):
        """K (S, H_kv, n_kv, D) and V (S, H_kv, D, n_kv) of slots slot0 .. slot0+S-1."""
        cache, Hkv, D = self.cache, self.cfg.n_head_kv, self.cfg.head_dim
        k = cache.k[layer]
        row = k.strides[1]
        head = row // Hkv
        kv = ctx.view(
            kc, (S, Hkv, n_kv, D), strides=(k.strides[0], head, row, k.strides[2]), offset=slot0 * k.strides[0]
        )
        v = cache.v[layer]
        es = v.strides[2]
        vv = ctx.view(
            vc,
            (S, Hkv, D, n_kv),
            strides=(v.strides[0], D * v.strides[1], v.strides[1], es),
            offset=slot0 * v.strides[0],
        )
        return kv, vv

    def _write(self, ctx, layer: int, k, v, feeds, n: int):
        """set_rows of this step's K and V (n, H_kv, D) into the cache."""
        cache, W = self.cache, self.cache.width
        kflat = ctx.reshape(cache.k[layer], (self.n_slot * self.n_ctx, W))
        kc = ctx.set_rows(kflat, ctx.reshape(k, (n, W)), feeds["k_idx"])
        if cache.v_trans:  # one value per row, in v's own order: row (slot, c, pos) of the flattened cache
            vflat = ctx.reshape(cache.v[layer], (self.n_slot * W * self.n_ctx, 1))
            vc = ctx.set_rows(vflat, ctx.reshape(v, (n * W, 1)), feeds["v_idx"])
        else:
            vflat = ctx.reshape(cache.v[layer], (self.n_slot * self.n_ctx, W))
            vc = ctx.set_rows(vflat, ctx.reshape(v, (n, W)), feeds["k_idx"])
        return kc, vc

    def _attend(self, ctx, layer: int, q, k, v, mask, row_invariant: bool):
        """q (H, Tq, D); k, v views from ``_views``; mask (Tq, n_kv)."""
        scale = self.arch.attention_scale(self.cfg, layer)
        cap = self.arch.attention_softcap(self.cfg, layer)
        if self.flash_attn:
            # exact batching: ggml's one-row kernel (patch 0020), so a row's sums never depend on how many rows
            # or keys came with it; so too on an adaptive runtime, whose thread count changes from compute to
            # compute (the split-key kernel's sums depend on it); otherwise ggml picks by shape, as llama.cpp does
            one_row = self.exact_batching or getattr(self.runtime, "adaptive", False)
            o = ctx.flash_attn_ext(q, k, v, mask, scale, logit_softcap=cap, row_invariant=one_row)
            T = q.shape[1]
            return ctx.reshape(o, (T, self.cfg.n_head * self.cfg.head_dim))
        return attention(ctx, q, k, v, mask, scale, row_invariant=row_invariant, softcap=cap)

    @staticmethod
    def _mask_name(j: int, w: int) -> str:
        """The feed of graph mask j for window index w."""
        return f"mask{j}" if w == 0 else f"mask{j}.w{w}"

    def _layer_mask(self, feeds, j: int, layer: int):
        return feeds[self._mask_name(j, self._win[layer])]

    # ------------------------------------------------------------------ graphs

    def _new_graph(self, n: int, masks: list[tuple[int, ...]], n_out: int):
        """Input tensors for a step of n tokens: tokens, pos, k_idx, v_idx,
        one mask per (rows, n_kv) in ``masks`` and window, and out_idx when
        n_out < n."""
        cin = toy_ggml.Context(max_tensors=8 + len(masks) * len(self.windows) + 2 * len(self.adapters))
        mtype = F16 if self.flash_attn else F32
        feeds = {
            "tokens": cin.tensor(I32, (n,), name="tokens"),
            "pos": cin.tensor(I32, (n,), name="pos"),
            "k_idx": cin.tensor(I64, (n,), name="k_idx"),
        }
        if self.cache.v_trans:
            feeds["v_idx"] = cin.tensor(I64, (n * self.cache.width,), name="v_idx")
        for j, shape in enumerate(masks):
            for w in range(len(self.windows)):
                name = self._mask_name(j, w)
                feeds[name] = cin.tensor(mtype, shape, name=name)
        if n_out < n:
            feeds["out_idx"] = cin.tensor(I32, (n_out,), name="out_idx")
        for j in self._graph_adapters:
            feeds[f"lsel{j}"] = cin.tensor(F32, (n, 1), name=f"lsel{j}")
            if n_out < n:  # the layers after the output rows are picked (the last one) see n_out rows
                feeds[f"lsel{j}.out"] = cin.tensor(F32, (n_out, 1), name=f"lsel{j}.out")
        cin.allocate(self.runtime)
        size = (64 + 28 * len(masks)) * self.cfg.n_layer + 256 + self._lora_ops
        return cin, feeds, toy_ggml.Context(max_tensors=size), size

    def _lora_terms(self, feeds) -> dict | None:
        """The graph's LoRA terms: the always-applied ones, then each selectable adapter's with its row feed."""
        if not self._graph_adapters:
            return self.lora
        terms = {name: list(t) for name, t in (self.lora or {}).items()}
        for j in self._graph_adapters:
            adapter = self.adapters[j]
            assert adapter is not None  # _use_adapters picks live ones
            for name, ts in adapter.items():
                rows = tuple(f for f in (feeds[f"lsel{j}"], feeds.get(f"lsel{j}.out")) if f is not None)
                terms.setdefault(name, []).extend((a, b, s, rows) for a, b, s, _ in ts)
        return terms

    def _decode_forward(self, ops, feeds, attend):
        """A decode graph's forward: one row per sequence, row-invariant products, logits of every row."""
        tokens, pos = feeds["tokens"], feeds["pos"]
        lora = self._lora_terms(feeds)
        return self.arch.forward(ops, self.cfg, self.weights, tokens, pos, attend, row_invariant=True, lora=lora)

    def _finish(self, key, cin, feeds, ops, size, out) -> _Graph:
        out.set_output()
        graph = toy_ggml.Graph(ops, size=max(2048, 2 * size)).build_forward(out)
        g = _Graph(cin, ops, graph, feeds, out)
        if len(self._graphs) >= self.max_graphs:
            self._graphs.popitem(last=False)[1].close()
        self._graphs[key] = g
        self.stats.graph_builds += 1
        return g

    def _prefill_graph(self, slot: int, n: int, n_kv: int, n_out: int, hidden: bool = False) -> _Graph:
        key = ("prefill", slot, n, n_kv, n_out, hidden, self._use_adapters((slot,)))
        g = self._graphs.get(key)
        if g is not None:
            self._graphs.move_to_end(key)
            return g
        cin, feeds, ops, size = self._new_graph(n, [(n, n_kv)], n_out)

        def attend(layer, q, k, v):
            kc, vc = self._write(ops, layer, k, v, feeds, n)
            kv, vv = self._views(ops, layer, kc, vc, slot, n_kv)
            mask = self._layer_mask(feeds, 0, layer)
            return self._attend(ops, layer, ops.permute(q, (1, 0, 2)), kv, vv, mask, self.exact_batching)

        out = self.arch.forward(
            ops,
            self.cfg,
            self.weights,
            feeds["tokens"],
            feeds["pos"],
            attend,
            feeds.get("out_idx"),
            row_invariant=self.exact_batching,
            head=not hidden,
            lora=self._lora_terms(feeds),
        )
        return self._finish(key, cin, feeds, ops, size, out)

    def _decode_graph(self, slots: tuple[int, ...], n_kvs: tuple[int, ...]) -> _Graph:
        S = len(slots)
        if not self._one_attention(slots):  # each sequence over its own slot: verify's graph, one row per sequence
            return self._verify_graph(slots, (1,) * S, n_kvs)
        key = ("decode1", slots, max(n_kvs), self._use_adapters(slots))
        g = self._graphs.get(key)
        if g is not None:
            self._graphs.move_to_end(key)
            return g
        H, D = self.cfg.n_head, self.cfg.head_dim
        n_kv = max(n_kvs)
        cin, feeds, ops, size = self._new_graph(S, [(S, 1, 1, n_kv)], S)

        def attend(layer, q, k, v):  # every sequence in one 4-D attention over consecutive slots
            kc, vc = self._write(ops, layer, k, v, feeds, S)
            kv, vv = self._slot_views(ops, layer, kc, vc, slots[0], S, n_kv)
            q4 = ops.reshape(q, (S, H, 1, D))
            scale, cap = self.arch.attention_scale(self.cfg, layer), self.arch.attention_softcap(self.cfg, layer)
            kq, scale = soft_capped(ops, ops.mul_mat(kv, q4, row_invariant=True), scale, cap)
            kq = ops.soft_max(kq, self._layer_mask(feeds, 0, layer), scale)
            return ops.reshape(ops.mul_mat(vv, kq, row_invariant=True), (S, H * D))  # (S, H, 1, D)

        return self._finish(key, cin, feeds, ops, size, self._decode_forward(ops, feeds, attend))

    def _verify_graph(self, slots: tuple[int, ...], ns: tuple[int, ...], n_kvs: tuple[int, ...]) -> _Graph:
        """``verify``'s graph: sequence j's ns[j] rows (consecutive) attend over its own slot with its own causal
        mask (ns[j], n_kvs[j]); every product row-invariant; logits of every row."""
        key = ("verify", slots, ns, n_kvs, self._use_adapters(slots))
        g = self._graphs.get(key)
        if g is not None:
            self._graphs.move_to_end(key)
            return g
        N = sum(ns)
        H, D = self.cfg.n_head, self.cfg.head_dim
        starts = np.cumsum((0,) + ns[:-1]).tolist()
        cin, feeds, ops, size = self._new_graph(N, [(n, n_kv) for n, n_kv in zip(ns, n_kvs)], N)

        def attend_each(layer, q, k, v):  # q (N, H, D): sequence j's rows are starts[j] .. starts[j] + ns[j] - 1
            kc, vc = self._write(ops, layer, k, v, feeds, N)
            outs = []
            for j, (slot, n, n_kv) in enumerate(zip(slots, ns, n_kvs)):
                kv, vv = self._views(ops, layer, kc, vc, slot, n_kv)
                qj = ops.view(q, (H, n, D), strides=(D * 4, H * D * 4, 4), offset=starts[j] * H * D * 4)
                outs.append(self._attend(ops, layer, qj, kv, vv, self._layer_mask(feeds, j, layer), True))
            a = outs[0]
            for o in outs[1:]:
                a = ops.concat(a, o, 0)
            return a

        return self._finish(key, cin, feeds, ops, size, self._decode_forward(ops, feeds, attend_each))

    # ------------------------------------------------------------------ feeds

    def _mask(self, q_pos: np.ndarray, n_kv: int, window: int = 0) -> np.ndarray:
        """(len(q_pos), n_kv): 0 where cell <= the query's position (and
        within ``window``), -inf elsewhere."""
        m = position_mask(q_pos, n_kv, window)
        return m.astype(np.float16) if self.flash_attn else m

    def _v_idx(self, slots: np.ndarray, pos: np.ndarray) -> np.ndarray:
        """Flattened V-cache rows for the step's values as they are laid out,
        (n, W): entry j * W + c is channel c of token j, stored at (slot_j, c,
        pos_j) (no transposed copy of V in the graph)."""
        W, C = self.cache.width, self.n_ctx
        c = np.arange(W, dtype=np.int64)[None, :]
        s, p = slots.astype(np.int64)[:, None], np.asarray(pos, np.int64)[:, None]
        return (s * W * C + c * C + p).reshape(-1)

    def _run(self, g: _Graph, tokens, pos, slots, masks, out_idx=None) -> np.ndarray:
        """One compute. ``masks``: for each mask j of the graph, a function
        window -> the mask array."""
        f = g.feeds
        f["tokens"].set(np.asarray(tokens, np.int32))
        f["pos"].set(pos.astype(np.int32))
        f["k_idx"].set(slots.astype(np.int64) * self.n_ctx + pos)
        if "v_idx" in f:
            f["v_idx"].set(self._v_idx(slots, pos))
        for j, make in enumerate(masks):
            for w, window in enumerate(self.windows):
                f[self._mask_name(j, w)].set(make(window))
        if out_idx is not None:
            f["out_idx"].set(out_idx)
        live = [j for j in self._live_adapters() if f"lsel{j}" in f]  # the adapters this graph computes
        if live:
            chosen = np.array([-1 if self.slot_adapter[s] is None else self.slot_adapter[s] for s in slots])
            for j in live:
                f[f"lsel{j}"].set((chosen == j).astype(np.float32).reshape(-1, 1))
                if f"lsel{j}.out" in f:
                    f[f"lsel{j}.out"].set((chosen[out_idx] == j).astype(np.float32).reshape(-1, 1))
        try:
            if self._profile is None:
                self.runtime.compute(g.graph)
            else:  # toy.trace.trace_decode_step: every node timed, the same kernels
                self._profile.append((g.graph, self.runtime.compute(g.graph, profile=True)))
        except toy_ggml.GGMLError as e:
            remote = remote_failure(e, "a forward pass")
            if remote is None:
                raise
            raise remote from e
        g.uses += 1
        self.stats.computes += 1
        return g.out.numpy()

    # ------------------------------------------------------------------ API

    def _room(self, slot: int, n: int) -> int:
        start = self.cache.length(slot)
        if start + n > self.n_ctx:
            raise ContextOverflowError(
                f"{start + n} tokens exceed the context of {self.n_ctx} tokens"
                + (f" ({start} already in the sequence)" if start else ""),
                hint="shorten the prompt or max_tokens, or load the model with a larger n_ctx",
                field="prompt",
            )
        return start

    def prefill(
        self, slot: int, ids: Sequence[int] | np.ndarray, all_logits: bool = False, hidden: bool = False
    ) -> np.ndarray:
        """Append ``ids`` to ``slot``'s sequence; return the logits of the
        last token (V,) or, with ``all_logits``, of every token (n, V).
        ``hidden``: the final normed hidden states instead of logits
        ((d,) or (n, d)), for embeddings."""
        ids = np.asarray(ids, dtype=np.int32).reshape(-1)
        if len(ids) == 0:
            raise BadInputError("prefill: no tokens", field="ids")
        bad = ids[(ids < 0) | (ids >= self.cfg.n_vocab)]
        if len(bad):
            msg = f"token id {int(bad[0])} is outside the vocabulary (0..{self.cfg.n_vocab - 1})"
            raise BadInputError(msg, field="ids")
        start = self._room(slot, len(ids))
        rows = []
        for a in range(0, len(ids), self.n_batch):
            chunk = ids[a : a + self.n_batch]
            n = len(chunk)
            pos = np.arange(start + a, start + a + n, dtype=np.int64)
            n_kv = self._n_kv(start + a + n)
            n_out = n if all_logits else 1
            g = self._prefill_graph(slot, n, n_kv, n_out, hidden)
            out_idx = None if n_out == n else np.array([n - 1], np.int32)
            mask = partial(self._mask, pos, n_kv)
            logits = self._run(g, chunk, pos, np.full(n, slot), [mask], out_idx)
            self.cache.append(slot, chunk)
            if all_logits or a + n == len(ids):
                rows.append(logits)
        self.stats.prefill_tokens += len(ids)
        return np.concatenate(rows) if all_logits else rows[-1][-1]

    def decode(self, slots: Sequence[int], tokens: Sequence[int]) -> np.ndarray:
        """One token for each sequence (distinct slots): logits (S, V)."""
        slots_t = tuple(int(s) for s in slots)
        if len(set(slots_t)) != len(slots_t) or not slots_t:
            raise BadInputError(f"decode: slots {slots_t} must be distinct and non-empty", field="slots")
        if len(tokens) != len(slots_t):
            raise BadInputError(f"decode: {len(tokens)} tokens for {len(slots_t)} slots", field="tokens")
        tok = np.asarray(tokens, np.int32)
        bad = tok[(tok < 0) | (tok >= self.cfg.n_vocab)]
        if len(bad):
            msg = f"decode: token id {int(bad[0])} is outside the vocabulary (0..{self.cfg.n_vocab - 1})"
            raise BadInputError(msg, field="tokens")
        pos = np.array([self._room(s, 1) for s in slots_t], np.int64)
        n_kvs = tuple(self._n_kv(int(p) + 1) for p in pos)
        g = self._decode_graph(slots_t, n_kvs)
        if self._one_attention(slots_t):
            n_kv = max(n_kvs)

            def stacked(window):
                return np.stack([self._mask(pos[j : j + 1], n_kv, window) for j in range(len(slots_t))])[:, None]

            masks = [stacked]
        else:
            masks = [partial(self._mask, pos[j : j + 1], n) for j, n in enumerate(n_kvs)]
        logits = self._run(g, tok, pos, np.array(slots_t), masks)
        for s, t in zip(slots_t, tok):
            self.cache.append(s, [t])
        self.stats.decode_tokens += len(slots_t)
        return logits

    def verify(self, slots: Sequence[int], token_lists: Sequence[Sequence[int]]) -> list[np.ndarray]:
        """Append ``token_lists[j]`` (at least one token) to slot ``slots[j]`` for every sequence at once, in
        ONE graph, and return each sequence's logits (n_j, V): row i predicts the token after
        ``token_lists[j][i]``. Speculative decoding checks a draft with it (``toy.engine.speculative``).

        Every product is row-invariant and each sequence attends over its own slot with its own causal mask,
        whatever ``exact_batching`` says: each row's logits and K/V are bit-identical to what ``decode`` of
        those tokens one at a time gives (tests/test_speculative.py checks it). The caller drops the rows of
        rejected draft tokens with ``cache.truncate``: cells past a sequence's length are masked, so what they
        hold is never read. With flash attention on an engine without ``exact_batching``, ``decode`` uses the
        kernel ggml picks by shape and ``verify`` the one-row kernel: they can differ in the last bits (the
        library refuses speculation there; see ``toy.engine.speculative``)."""
        slots_t = tuple(int(s) for s in slots)
        if len(set(slots_t)) != len(slots_t) or not slots_t:
            raise BadInputError(f"verify: slots {slots_t} must be distinct and non-empty", field="slots")
        if len(token_lists) != len(slots_t):
            raise BadInputError(f"verify: {len(token_lists)} token lists for {len(slots_t)} slots", field="tokens")
        toks = [np.asarray(t, np.int32).reshape(-1) for t in token_lists]
        if any(len(t) == 0 for t in toks):
            raise BadInputError("verify: every sequence needs at least one token", field="tokens")
        tok = np.concatenate(toks)
        bad = tok[(tok < 0) | (tok >= self.cfg.n_vocab)]
        if len(bad):
            msg = f"verify: token id {int(bad[0])} is outside the vocabulary (0..{self.cfg.n_vocab - 1})"
            raise BadInputError(msg, field="tokens")
        ns = tuple(len(t) for t in toks)
        starts = [self._room(s, n) for s, n in zip(slots_t, ns)]
        pos = np.concatenate([np.arange(a, a + n, dtype=np.int64) for a, n in zip(starts, ns)])
        n_kvs = tuple(self._n_kv(a + n) for a, n in zip(starts, ns))
        g = self._verify_graph(slots_t, ns, n_kvs)
        offs = np.cumsum((0,) + ns).tolist()
        masks = [partial(self._mask, pos[offs[j] : offs[j + 1]], n_kv) for j, n_kv in enumerate(n_kvs)]
        logits = self._run(g, tok, pos, np.repeat(np.array(slots_t), ns), masks)
        for s, t in zip(slots_t, toks):
            self.cache.append(s, t)
        self.stats.decode_tokens += len(tok)
        return [logits[offs[j] : offs[j + 1]] for j in range(len(slots_t))]

    def close(self) -> None:
        for g in self._graphs.values():
            g.close()
        self._graphs.clear()
        self.cache.close()


__all__ = ["ContextOverflowError", "EngineStats", "LLMEngine"]
