"""Graph pieces every architecture shares: attention masks, KV padding, the
attention core, the full-sequence and the batched training forward.

Shapes are NumPy order. Invariants:

- masks are additive F32 (0 where a query may attend a key, -inf elsewhere)
  and built here only: ``position_mask`` (the KV cache's: a query at
  position p sees cells 0..p), ``causal_mask`` (a whole sequence, with
  optional padding columns) and ``block_causal_mask`` (training rows of
  packed documents). Each takes a sliding ``window`` W (0: none): a key
  W or more positions before the query is masked too, so a query sees W
  keys, itself included (llama.cpp's standard SWA). An architecture whose
  layers have different windows (``arch.windows(cfg)``) gets one mask per
  window: the callers pass ``{window: mask}`` and ``layer_masks`` hands
  each layer its own;
- an attention soft-cap c (``arch.attention_softcap``) turns the scaled
  scores s into ``c · tanh(s / c)`` before the mask;
- attention is batched over heads: Q (H, Tq, D) against K (H_kv, n_kv, D)
  in one ``mul_mat`` (ggml's broadcast gives query head ``h`` the key/value
  head ``h // (H / H_kv)``: GQA grouping), one ``soft_max`` with the mask
  and the architecture's scale, one ``mul_mat`` with V; never one GEMM per
  head;
- the forward itself is the architecture's (``arch.forward``); this module
  only supplies its ``attend`` and, for training, the head after ``keep``.

It also holds what the llama-family architectures' checkpoint metadata and
from-scratch configs share (``shape_metadata``, ``uint32_counts``,
``train_shape_fields``).

numpy is imported inside the mask builders, not here: the family modules
import this one, and they must load without numpy (``toy train --help``
lists their families, presets and LoRA targets within its start-up budget).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from toy import models
from toy.errors import ConfigError

if TYPE_CHECKING:
    import numpy as np


def padded_length(n_tokens: int, pad: int) -> int:
    """n_tokens rounded up to a multiple of pad (>= 1)."""
    return -(-n_tokens // pad) * pad


def position_mask(q_pos: np.ndarray, n_kv: int, window: int = 0) -> np.ndarray:
    """F32 (len(q_pos), n_kv): 0 where cell <= the query's position (and,
    with a ``window`` W > 0, cell > position - W), -inf elsewhere."""
    import numpy as np  # lazy: the family modules import this module (see the module docstring)

    q_pos = np.asarray(q_pos)
    cells = np.arange(n_kv)[None, :]
    allowed = cells <= q_pos[:, None]
    if window:
        allowed &= cells > q_pos[:, None] - window
    return np.where(allowed, np.float32(0), np.float32(-np.inf)).astype(np.float32)


def causal_mask(n_tokens: int, n_kv: int | None = None, window: int = 0) -> np.ndarray:
    """F32 (T, n_kv) (n_kv >= T, default T): 0 where key position <= query
    position (and within ``window``), -inf elsewhere (the padding columns
    past T included)."""
    n_kv = n_tokens if n_kv is None else n_kv
    if n_kv < n_tokens:
        raise ValueError(f"causal_mask: n_kv={n_kv} < n_tokens={n_tokens}")
    import numpy as np  # lazy: see the module docstring

    return position_mask(np.arange(n_tokens), n_kv, window)


def block_causal_mask(doc: np.ndarray, block_causal: bool = True, window: int = 0) -> np.ndarray:
    """F32 (B, 1, T, T) for rows of document ids ``doc`` (B, T): 0 where
    query t may attend key s (s <= t, the same document when
    ``block_causal``, and t - s < ``window`` when W > 0: within a document
    the row distance is the position distance), -inf elsewhere."""
    import numpy as np  # lazy: see the module docstring

    doc = np.asarray(doc)
    t = doc.shape[1]
    allowed = np.tril(np.ones((t, t), dtype=bool))
    if window:
        allowed &= ~np.tril(np.ones((t, t), dtype=bool), -window)
    allowed = allowed[None]  # (1, T, T) [query, key]
    if block_causal:
        allowed = allowed & (doc[:, :, None] == doc[:, None, :])
    return np.where(allowed, np.float32(0), np.float32(-np.inf)).astype(np.float32)[:, None]


def layer_masks(arch, cfg, mask):
    """``layer -> mask`` for a config, from ``mask``: one mask (every layer
    attends fully) or ``{window: mask}`` with a mask for each window of
    ``arch.windows(cfg)`` (a missing one is a ValueError)."""
    masks = mask if isinstance(mask, dict) else {0: mask}
    missing = [w for w in arch.windows(cfg) if w not in masks]
    if missing:
        raise ValueError(f"no attention mask for window {missing[0]} (the model's windows: {arch.windows(cfg)})")
    return lambda layer: masks[int(arch.sliding_window(cfg, layer))]


def soft_capped(ctx, kq, scale: float, softcap: float):
    """The scores after scaling and the soft-cap, and the factor the
    softmax applies: (kq, scale) unchanged without a cap, else
    (tanh(kq · scale / c), c), so that soft_max(·, mask, c) computes
    softmax(c · tanh(s / c) + mask)."""
    if not softcap:
        return kq, scale
    return ctx.tanh(ctx.scale(kq, scale / softcap)), softcap


def attention(ctx, q, k, v, mask, scale: float, row_invariant: bool = False, softcap: float = 0.0):
    """Attention batched over heads: q (H, Tq, D), k (H_kv, n_kv, D),
    v (H_kv, D, n_kv) (V transposed, as the KV cache stores it), mask F32
    (Tq, n_kv) -> (Tq, H * D). ``softcap``: see ``soft_capped``."""
    kq, scale = soft_capped(ctx, ctx.mul_mat(k, q, row_invariant=row_invariant), scale, softcap)
    kq = ctx.soft_max(kq, mask, scale)  # (H, Tq, n_kv)
    a = ctx.mul_mat(v, kq, row_invariant=row_invariant)  # (H, Tq, D)
    H, T, D = a.shape
    a = ctx.permute(a, (1, 0, 2))  # (T, H, D); already laid out so for one query row (a decode step): no copy
    return ctx.reshape(a if a.is_contiguous else ctx.cont(a), (T, H * D))


def forward_logits(ctx, cfg, weights, tokens, pos, mask, n_tokens: int, kv_type=None, taps=None, lora=None):
    """Logits (T, n_vocab) F32 of one sequence without a KV cache, for any
    architecture: ``tokens``/``pos`` I32 (T,), ``mask`` F32 (T, n_kv)
    (``causal_mask``), or ``{window: mask}`` for a model with sliding
    windows (``layer_masks``). With n_kv > T the keys and values get n_kv - T zero
    rows, masked out: the attention then has llama.cpp's padded KV length (a
    multiple of 32 without flash attention), so its F16 matmuls take the
    same kernels and sums. ``kv_type`` (e.g. F16) rounds K and V to that
    type before attention, as a llama.cpp KV cache of that type does.
    ``taps``: the architecture ``forward``'s (each block's residual stream);
    ``lora``: its LoRA terms (an engine's ``lora``)."""
    arch = models.language_model_of(cfg)
    T = n_tokens
    mask_of = layer_masks(arch, cfg, mask)
    n_kv = mask_of(0).shape[-1]
    for m in mask.values() if isinstance(mask, dict) else (mask,):
        if m.shape != (T, n_kv) or n_kv < T:
            raise ValueError(f"forward_logits: mask {m.shape} must be ({T}, n_kv >= {T}), all of one shape")

    def attend(layer, q, k, v):
        q = ctx.permute(q, (1, 0, 2))  # (H, T, D)
        k = ctx.permute(k, (1, 0, 2))  # (Hkv, T, D)
        v = ctx.cont(ctx.permute(v, (1, 2, 0)))  # (Hkv, D, T)
        if n_kv > T:  # zero keys/values past T (masked): (Hkv, n_kv, D), (Hkv, D, n_kv)
            k = ctx.pad(ctx.cont(k), ((0, 0), (0, n_kv - T), (0, 0)))
            v = ctx.pad(v, ((0, 0), (0, 0), (0, n_kv - T)))
        if kv_type is not None:
            k, v = ctx.cast(k, kv_type), ctx.cast(v, kv_type)
        scale, cap = arch.attention_scale(cfg, layer), arch.attention_softcap(cfg, layer)
        return attention(ctx, q, k, v, mask_of(layer), scale, softcap=cap)

    return arch.forward(ctx, cfg, weights, tokens, pos, attend, lora=lora, taps=taps)


def forward_batch(ctx, cfg, weights, tokens, pos, mask, batch: int, keep=None, lora=None, taps=None):
    """Logits (B*T, V) of B rows of T tokens at once, for training, for any
    architecture: ``tokens`` and ``pos`` I32 (B*T,) (row-major), ``mask`` F32
    (B, 1, T, T) additive attention mask (``block_causal_mask``), broadcast
    over heads, or ``{window: mask}`` for a model with sliding windows. ``keep`` (F32 (B*T, 1), optional) multiplies the final hidden
    states before the head: a row multiplied by 0 contributes nothing to any
    weight's gradient, which is how rows without a target leave the loss.

    Attention is batched over rows and heads together: Q (B*H, T, D) against
    K (B*H, T, D) in one mul_mat, query head ``b*H + h`` against the
    key/value head ``b*H_kv + h // G`` (G = H / H_kv: GQA within each row),
    which K and V repeat G times (``repeat``, whose backward sums the G
    heads' gradients). A broadcast product would read the same heads without
    the copies, but its gradients would fall back to ggml's OUT_PROD loops;
    without one they are toy GEMM products like the forward (the copies cost
    a K- and V-sized pass per layer). The scores are viewed as (B, H, T, T)
    for one soft_max with the mask, then one mul_mat with V. ``taps``: the
    architecture ``forward``'s (each block's residual stream, (B*T, d))."""
    arch = models.language_model_of(cfg)
    N = tokens.shape[0]
    if N % batch:
        raise ValueError(f"forward_batch: {N} tokens do not split into {batch} rows")
    T, H, Hkv, D = N // batch, cfg.n_head, cfg.n_head_kv, cfg.head_dim
    mask_of = layer_masks(arch, cfg, mask)
    for m in mask.values() if isinstance(mask, dict) else (mask,):
        if m.shape != (batch, 1, T, T):
            raise ValueError(f"forward_batch: mask {m.shape} must be ({batch}, 1, {T}, {T})")

    def heads(x, n, axes, shape):  # (N, n, D) -> rows-and-heads-major, contiguous
        return ctx.reshape(ctx.cont(ctx.permute(ctx.reshape(x, (batch, T, n, D)), axes)), shape)

    G = H // Hkv

    def per_query_head(x):  # (B*Hkv, a, b) -> (B*H, a, b): each key/value head once per query head of its group
        if G == 1:
            return x
        n, a, b = x.shape
        return ctx.reshape(ctx.repeat(ctx.reshape(x, (n, 1, a, b)), (n, G, a, b)), (n * G, a, b))

    def attend(layer, q, k, v):
        q = heads(q, H, (0, 2, 1, 3), (batch * H, T, D))
        k = per_query_head(heads(k, Hkv, (0, 2, 1, 3), (batch * Hkv, T, D)))
        v = per_query_head(heads(v, Hkv, (0, 2, 3, 1), (batch * Hkv, D, T)))
        kq = ctx.reshape(ctx.mul_mat(k, q), (batch, H, T, T))
        kq, scale = soft_capped(ctx, kq, arch.attention_scale(cfg, layer), arch.attention_softcap(cfg, layer))
        kq = ctx.reshape(ctx.soft_max(kq, mask_of(layer), scale), (batch * H, T, T))
        a = ctx.reshape(ctx.mul_mat(v, kq), (batch, H, T, D))
        return ctx.reshape(ctx.cont(ctx.permute(a, (0, 2, 1, 3))), (N, H * D))

    h = arch.forward(ctx, cfg, weights, tokens, pos, attend, head=False, lora=lora, taps=taps)  # (N, d)
    if keep is not None:
        h = ctx.mul(h, keep)
    return final_softcapped(ctx, arch, cfg, ctx.mul_mat(head_weight(weights, arch.output_weight(cfg)), h))


def head_weight(weights: Any, name: str) -> Any:
    """The tensor the head's product reads for ``name`` (``arch.output_weight(cfg)``): the loader's
    product-only copy when it made one (a head tied to the embedding gets the embedding repacked,
    ``toy.gguf.bind.BoundTensors.product_copies``), else ``weights[name]``."""
    copies = getattr(weights, "product_copies", None)
    return copies[name] if copies and name in copies else weights[name]


def final_softcapped(ctx: Any, arch: Any, cfg: Any, logits: Any) -> Any:
    """``c · tanh(logits / c)`` for an architecture with a final soft-cap c
    (``arch.final_softcap``), the logits unchanged otherwise."""
    cap = arch.final_softcap(cfg)
    if not cap:
        return logits
    return ctx.scale(ctx.tanh(ctx.scale(logits, 1.0 / cap)), cap)


def gelu_tanh(ctx, x, how: str = "table"):
    """GELU in its tanh form: ggml's (``how="table"``: on the CPU it reads a
    float16 table, as llama.cpp's graph does, so toy's logits equal
    llama.cpp's) or ``how="exact"``: 0.5 x (1 + tanh(sqrt(2/pi) (x +
    0.044715 x^3))) composed in float32 from ggml ops, as PyTorch computes
    it. Both train (GELU's backward is toy-ggml patch 0002, TANH's 0012)."""
    if how == "table":
        return ctx.gelu(x)
    if how != "exact":
        raise ValueError(f"gelu={how!r}: 'table' or 'exact'")
    u = ctx.scale(ctx.add(x, ctx.scale(ctx.mul(ctx.mul(x, x), x), 0.044715)), math.sqrt(2.0 / math.pi))
    return ctx.mul(ctx.scale(x, 0.5), ctx.scale(ctx.tanh(u), 1.0, 1.0))  # 0.5 x · (1 + tanh u)


def lora_linear(ctx, weights, lora, row_invariant: bool = False):
    """``lin(name, x)``: the product of weight ``name`` with x (T, in) plus
    its LoRA terms ``Σ scale · B (A (x ⊙ drop))`` (llama.cpp's
    ``build_lora_mm``), the projection every architecture's forward uses.
    ``drop`` is None, a tensor of x's shape or one that broadcasts over it
    (training's dropout mask), or a tuple of such row masks of which the one
    with x's row count is used (the engine's per-sequence adapter choice,
    whose last layer may see only the output rows)."""

    def mm(w, x):
        return ctx.mul_mat(w, x, row_invariant=row_invariant)

    def lin(name: str, x):
        y = mm(weights[name], x)
        for a, b, s, drop in lora.get(name, ()) if lora else ():
            if isinstance(drop, tuple):
                drop = next(d for d in drop if d.shape[0] == x.shape[0])
            xa = x if drop is None else ctx.mul(x, drop)
            y = ctx.add(y, ctx.scale(mm(b, mm(a, xa)), s))
        return y

    return mm, lin


__all__ = [
    "attention",
    "block_causal_mask",
    "causal_mask",
    "final_softcapped",
    "forward_batch",
    "forward_logits",
    "gelu_tanh",
    "head_weight",
    "layer_masks",
    "lora_linear",
    "padded_length",
    "position_mask",
    "soft_capped",
]


# ---------------------------------------------------------------- checkpoints and from-scratch configs


def shape_metadata(a: str, cfg, default_context: int) -> dict[str, Any]:
    """The llama.cpp hyperparameter keys of architecture ``a`` a llama-family
    checkpoint carries (context length, widths, block count, heads, head
    sizes), in the converter's order; the context length
    ``default_context`` when the config has none."""
    return {
        f"{a}.context_length": int(cfg.context_length or default_context),
        f"{a}.embedding_length": cfg.d_model,
        f"{a}.block_count": cfg.n_layer,
        f"{a}.feed_forward_length": cfg.d_ff,
        f"{a}.attention.head_count": cfg.n_head,
        f"{a}.attention.head_count_kv": cfg.n_head_kv,
        f"{a}.attention.key_length": cfg.head_dim,
        f"{a}.attention.value_length": cfg.head_dim,
    }


def uint32_counts(metadata: Mapping[str, Any]) -> dict[str, Any]:
    """``metadata`` with every integer value (not a bool) as ``(value,
    TypeInfo(UINT32))``: llama.cpp refuses a file whose counts are INT32."""
    # lazy: toy.gguf loads ggml (~0.3 s); the registry (and so `toy train --help`) must not
    from toy.gguf.constants import ValueType
    from toy.gguf.reader import TypeInfo

    u32 = TypeInfo(ValueType.UINT32)
    return {k: (v, u32) if isinstance(v, int) and not isinstance(v, bool) else v for k, v in metadata.items()}


def train_shape_fields(d: Mapping[str, Any], n_vocab: int) -> dict[str, Any]:
    """The llama-family config fields of a from-scratch run from
    ``resolve_shape``'s dimensions ``d``; an odd ``head_dim`` is a
    ``ConfigError`` (RoPE rotates pairs)."""
    if d["head_dim"] % 2:
        raise ConfigError(f"model.head_dim={d['head_dim']} must be even (RoPE rotates pairs)", field="model.head_dim")
    return dict(
        n_vocab=n_vocab,
        d_model=d["d_model"],
        n_layer=d["n_layer"],
        n_head=d["n_head"],
        n_head_kv=d["n_head_kv"],
        head_dim=d["head_dim"],
        d_ff=d["d_ff"],
        rms_eps=d["norm_eps"],
        rope_base=d["rope_base"],
        tied_output=d["tied_output"],
    )
