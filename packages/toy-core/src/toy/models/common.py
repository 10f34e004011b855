"""Graph pieces every architecture shares: attention masks, KV padding, the
attention core, the full-sequence and the batched training forward.

Shapes are NumPy order. Invariants:

- masks are additive F32 (0 where a query may attend a key, -inf elsewhere)
  and built here only: ``position_mask`` (the KV cache's: a query at
  position p sees cells 0..p), ``causal_mask`` (a whole sequence, with
  optional padding columns) and ``block_causal_mask`` (training rows of
  packed documents);
- attention is batched over heads: Q (H, Tq, D) against K (H_kv, n_kv, D)
  in one ``mul_mat`` (ggml's broadcast gives query head ``h`` the key/value
  head ``h // (H / H_kv)``: GQA grouping), one ``soft_max`` with the mask
  and the architecture's scale, one ``mul_mat`` with V; never one GEMM per
  head;
- the forward itself is the architecture's (``arch.forward``); this module
  only supplies its ``attend`` and, for training, the head after ``keep``.
"""

from __future__ import annotations

import numpy as np


def padded_length(n_tokens: int, pad: int) -> int:
    """n_tokens rounded up to a multiple of pad (>= 1)."""
    return -(-n_tokens // pad) * pad


def position_mask(q_pos: np.ndarray, n_kv: int) -> np.ndarray:
    """F32 (len(q_pos), n_kv): 0 where cell <= the query's position, -inf after."""
    q_pos = np.asarray(q_pos)
    return np.where(np.arange(n_kv)[None, :] <= q_pos[:, None], np.float32(0), np.float32(-np.inf)).astype(np.float32)


def causal_mask(n_tokens: int, n_kv: int | None = None) -> np.ndarray:
    """F32 (T, n_kv) (n_kv >= T, default T): 0 where key position <= query
    position, -inf after (the padding columns past T included)."""
    n_kv = n_tokens if n_kv is None else n_kv
    if n_kv < n_tokens:
        raise ValueError(f"causal_mask: n_kv={n_kv} < n_tokens={n_tokens}")
    return position_mask(np.arange(n_tokens), n_kv)


def block_causal_mask(doc: np.ndarray, block_causal: bool = True) -> np.ndarray:
    """F32 (B, 1, T, T) for rows of document ids ``doc`` (B, T): 0 where
    query t may attend key s (s <= t, and the same document when
    ``block_causal``), -inf elsewhere."""
    doc = np.asarray(doc)
    t = doc.shape[1]
    allowed = np.tril(np.ones((t, t), dtype=bool))[None]  # (1, T, T) [query, key]
    if block_causal:
        allowed = allowed & (doc[:, :, None] == doc[:, None, :])
    return np.where(allowed, np.float32(0), np.float32(-np.inf)).astype(np.float32)[:, None]


def attention(ctx, q, k, v, mask, scale: float, row_invariant: bool = False):
    """Attention batched over heads: q (H, Tq, D), k (H_kv, n_kv, D),
    v (H_kv, D, n_kv) (V transposed, as the KV cache stores it), mask F32
    (Tq, n_kv) -> (Tq, H * D)."""
    kq = ctx.soft_max(ctx.mul_mat(k, q, row_invariant=row_invariant), mask, scale)  # (H, Tq, n_kv)
    a = ctx.mul_mat(v, kq, row_invariant=row_invariant)  # (H, Tq, D)
    H, T, D = a.shape
    return ctx.reshape(ctx.cont(ctx.permute(a, (1, 0, 2))), (T, H * D))


def forward_logits(ctx, cfg, weights, tokens, pos, mask, n_tokens: int, kv_type=None):
    """Logits (T, n_vocab) F32 of one sequence without a KV cache, for any
    architecture: ``tokens``/``pos`` I32 (T,), ``mask`` F32 (T, n_kv)
    (``causal_mask``). With n_kv > T the keys and values get n_kv - T zero
    rows, masked out: the attention then has llama.cpp's padded KV length (a
    multiple of 32 without flash attention), so its F16 matmuls take the
    same kernels and sums. ``kv_type`` (e.g. F16) rounds K and V to that
    type before attention, as a llama.cpp KV cache of that type does."""
    from toy import models

    arch = models.of(cfg)
    T = n_tokens
    n_kv = mask.shape[-1]
    if mask.shape != (T, n_kv) or n_kv < T:
        raise ValueError(f"forward_logits: mask {mask.shape} must be ({T}, n_kv >= {T})")

    def attend(layer, q, k, v):
        q = ctx.permute(q, (1, 0, 2))  # (H, T, D)
        k = ctx.permute(k, (1, 0, 2))  # (Hkv, T, D)
        v = ctx.cont(ctx.permute(v, (1, 2, 0)))  # (Hkv, D, T)
        if n_kv > T:  # zero keys/values past T (masked): (Hkv, n_kv, D), (Hkv, D, n_kv)
            k = ctx.pad(ctx.cont(k), ((0, 0), (0, n_kv - T), (0, 0)))
            v = ctx.pad(v, ((0, 0), (0, 0), (0, n_kv - T)))
        if kv_type is not None:
            k, v = ctx.cast(k, kv_type), ctx.cast(v, kv_type)
        return attention(ctx, q, k, v, mask, arch.attention_scale(cfg, layer))

    return arch.forward(ctx, cfg, weights, tokens, pos, attend)


def forward_batch(ctx, cfg, weights, tokens, pos, mask, batch: int, keep=None, lora=None):
    """Logits (B*T, V) of B rows of T tokens at once, for training, for any
    architecture: ``tokens`` and ``pos`` I32 (B*T,) (row-major), ``mask`` F32
    (B, 1, T, T) additive attention mask (``block_causal_mask``), broadcast
    over heads. ``keep`` (F32 (B*T, 1), optional) multiplies the final hidden
    states before the head: a row multiplied by 0 contributes nothing to any
    weight's gradient, which is how rows without a target leave the loss.

    Attention is batched over rows and heads together: Q (B*H, T, D) against
    K (B*H_kv, T, D) in one mul_mat, whose broadcast gives query head
    ``b*H + h`` the key/value head ``b*H_kv + h // G`` (G = H / H_kv): GQA
    within each row. (A 4-D broadcast would read the same heads, but ggml's
    MUL_MAT backward only handles the 3-D one.) The scores are viewed as
    (B, H, T, T) for one soft_max with the mask, then one mul_mat with V."""
    from toy import models

    arch = models.of(cfg)
    N = tokens.shape[0]
    if N % batch:
        raise ValueError(f"forward_batch: {N} tokens do not split into {batch} rows")
    T, H, Hkv, D = N // batch, cfg.n_head, cfg.n_head_kv, cfg.head_dim
    if mask.shape != (batch, 1, T, T):
        raise ValueError(f"forward_batch: mask {mask.shape} must be ({batch}, 1, {T}, {T})")

    def heads(x, n, axes, shape):  # (N, n, D) -> rows-and-heads-major, contiguous
        return ctx.reshape(ctx.cont(ctx.permute(ctx.reshape(x, (batch, T, n, D)), axes)), shape)

    def attend(layer, q, k, v):
        q = heads(q, H, (0, 2, 1, 3), (batch * H, T, D))
        k = heads(k, Hkv, (0, 2, 1, 3), (batch * Hkv, T, D))
        v = heads(v, Hkv, (0, 2, 3, 1), (batch * Hkv, D, T))
        kq = ctx.reshape(ctx.mul_mat(k, q), (batch, H, T, T))
        kq = ctx.reshape(ctx.soft_max(kq, mask, arch.attention_scale(cfg, layer)), (batch * H, T, T))
        a = ctx.reshape(ctx.mul_mat(v, kq), (batch, H, T, D))
        return ctx.reshape(ctx.cont(ctx.permute(a, (0, 2, 1, 3))), (N, H * D))

    h = arch.forward(ctx, cfg, weights, tokens, pos, attend, head=False, lora=lora)  # (N, d)
    if keep is not None:
        h = ctx.mul(h, keep)
    return ctx.mul_mat(weights[arch.output_weight(cfg)], h)


def lora_linear(ctx, weights, lora, row_invariant: bool = False):
    """``lin(name, x)``: the product of weight ``name`` with x (T, in) plus
    its LoRA terms ``Σ scale · B (A (x ⊙ drop))`` (llama.cpp's
    ``build_lora_mm``), the projection every architecture's forward uses."""

    def mm(w, x):
        return ctx.mul_mat(w, x, row_invariant=row_invariant)

    def lin(name: str, x):
        y = mm(weights[name], x)
        for a, b, s, drop in lora.get(name, ()) if lora else ():
            xa = x if drop is None else ctx.mul(x, drop)
            y = ctx.add(y, ctx.scale(mm(b, mm(a, xa)), s))
        return y

    return mm, lin


__all__ = [
    "attention",
    "block_causal_mask",
    "causal_mask",
    "forward_batch",
    "forward_logits",
    "lora_linear",
    "padded_length",
    "position_mask",
]
