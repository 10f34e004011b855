"""The ViT classifier's tensors and forward graph (Hugging Face's
``ViTForImageClassification``, pre-norm encoder, class-token head).

Tensors (``params``; GGUF names in llama.cpp's vision style, NumPy shapes,
D = d_model, K = C·p·p, T = n_patches + 1)::

    v.patch_embd.weight   (D, C, p, p)  the Conv2d weight, as PyTorch stores it
    v.patch_embd.bias     (D,)
    v.class_embd          (D,)
    v.position_embd.weight (T, D)       row 0 is the class token's
    v.blk.N.ln1.{weight,bias}  (D,)     LayerNorm before attention
    v.blk.N.attn_{q,k,v}.{weight (D, D), bias (D,)}
    v.blk.N.attn_out.{weight (D, D), bias (D,)}
    v.blk.N.ln2.{weight,bias}  (D,)     LayerNorm before the MLP
    v.blk.N.ffn_up.{weight (F, D), bias (F,)}
    v.blk.N.ffn_down.{weight (D, F), bias (D,)}
    v.post_ln.{weight,bias}    (D,)     the final LayerNorm
    cls.weight (n_classes, D), cls.bias (n_classes,)

The graph (``forward``), batched over images and heads, activations
(B·T, D) row-major (image b's token t is row b·T + t):

- ``patches`` F32 (B, T, K) from ``patchify``: row 0 of every image is all
  zeros (the class-token slot), row 1 + i·g + j the patch at grid (i, j)
  flattened in the Conv2d weight's (C, p, p) order, so the patch embedding
  is ONE exact ``mul_mat`` with the weight viewed as (D, K) (the
  convolution with stride p is that product).
- The class token and the patch bias without CONCAT (which has no backward
  in ggml, and this graph must train): ``tokens = (P·Wᵀ + b) ⊙ is_patch +
  (position_embd + is_class ⊗ class_embd)``, with the row indicators
  ``is_patch`` (T, 1) = (0, 1, …, 1) and ``is_class`` = 1 − is_patch
  broadcast over the images. The indicators are exact 0/1 values computed
  inside the graph from the input's shape (a zero from ``scale(·, 0)`` of
  the input's first value, ``diag_mask_inf`` on a (1, T) row, ``clamp`` to
  [−1, 0], ``scale``): they depend on no parameter, so they need no
  backward, and a caller feeds only ``patches``. Every op that a parameter
  reaches (MUL_MAT, ADD, MUL, REPEAT, RESHAPE, VIEW, CONT, PERMUTE, NORM,
  SOFT_MAX, SCALE, UNARY:GELU_ERF) has a backward in toy-ggml's allow-list.
  The patches must be finite (``patchify`` checks).
- Blocks: x += attn_out(MHA(LN1(x))); x += ffn_down(GELU_erf(ffn_up(LN2(x)))),
  every projection with its bias. Attention is unmasked softmax(Q Kᵀ/√d_h) V
  with Q, K, V (B·H, T, d_h) in one ``mul_mat`` each way (ggml's 3-D batch:
  the form its MUL_MAT backward handles), as ``toy.models.common.forward_batch``
  does for language models.
- After the last block's attention only the class rows (B, D) go on
  (LayerNorm, MLP and head act per row, so the result is the same and the
  last MLP costs 1/T); the final LayerNorm, then ``cls`` -> logits
  (B, n_classes).

GELU is the exact erf form (``Context.gelu_erf``, Hugging Face's
``hidden_act="gelu"``), LayerNorm ``norm(x, eps)·γ + β``. The projections go
through ``toy.models.common.lora_linear``, so ``lora`` (GGUF weight name ->
``(a, b, scale, drop)`` terms, as in ``toy.models.gpt2.forward``) adapts any
of them.
"""

from __future__ import annotations

import math

import numpy as np

from toy.errors import BadInputError
from toy.models import ParamInfo
from toy.models.common import lora_linear
from toy_vit.config import ViTConfig

_BLOCK = ("ln1", "attn_q", "attn_k", "attn_v", "attn_out", "ln2", "ffn_up", "ffn_down")


def params(cfg: ViTConfig) -> dict[str, ParamInfo]:
    """The trainable tensors, GGUF name -> ``ParamInfo(shape, kind)`` (NumPy
    shapes; a linear weight is (d_out, d_in)), in Hugging Face's module order."""
    D, F, T, C, p = cfg.d_model, cfg.d_ff, cfg.n_tokens, cfg.n_channels, cfg.patch_size
    out: dict[str, ParamInfo] = {
        "v.patch_embd.weight": ParamInfo((D, C, p, p), "matrix"),
        "v.patch_embd.bias": ParamInfo((D,), "bias"),
        "v.class_embd": ParamInfo((D,), "position"),
        "v.position_embd.weight": ParamInfo((T, D), "position"),
    }
    for i in range(cfg.n_layer):
        b = f"v.blk.{i}"
        out[f"{b}.ln1.weight"] = ParamInfo((D,), "norm")
        out[f"{b}.ln1.bias"] = ParamInfo((D,), "norm_bias")
        for n in ("attn_q", "attn_k", "attn_v"):
            out[f"{b}.{n}.weight"] = ParamInfo((D, D), "matrix")
            out[f"{b}.{n}.bias"] = ParamInfo((D,), "bias")
        out[f"{b}.attn_out.weight"] = ParamInfo((D, D), "residual")
        out[f"{b}.attn_out.bias"] = ParamInfo((D,), "bias")
        out[f"{b}.ln2.weight"] = ParamInfo((D,), "norm")
        out[f"{b}.ln2.bias"] = ParamInfo((D,), "norm_bias")
        out[f"{b}.ffn_up.weight"] = ParamInfo((F, D), "matrix")
        out[f"{b}.ffn_up.bias"] = ParamInfo((F,), "bias")
        out[f"{b}.ffn_down.weight"] = ParamInfo((D, F), "residual")
        out[f"{b}.ffn_down.bias"] = ParamInfo((D,), "bias")
    out["v.post_ln.weight"] = ParamInfo((D,), "norm")
    out["v.post_ln.bias"] = ParamInfo((D,), "norm_bias")
    out["cls.weight"] = ParamInfo((cfg.n_classes, D), "matrix")
    out["cls.bias"] = ParamInfo((cfg.n_classes,), "bias")
    return out


def n_params(cfg: ViTConfig) -> int:
    """Parameter count of a config (every tensor of ``params``)."""
    return sum(math.prod(p.shape) for p in params(cfg).values())


def patchify(pixels: np.ndarray, cfg: ViTConfig) -> np.ndarray:
    """The graph's input from normalised pixels F32 (B, C, H, W), H = W =
    image_size: F32 (B, T, C·p·p), row 0 of each image zeros (the class
    slot), row 1 + i·g + j the patch at grid row i, column j, flattened in
    (C, p, p) order (the Conv2d weight's). ``BadInputError`` for a wrong
    shape or a non-finite value."""
    x = np.asarray(pixels)
    C, S, p, g = cfg.n_channels, cfg.image_size, cfg.patch_size, cfg.grid
    if x.ndim != 4 or x.shape[1:] != (C, S, S) or x.shape[0] < 1:
        raise BadInputError(f"pixels of shape {x.shape}: the model takes (B, {C}, {S}, {S}) with B >= 1")
    if not np.issubdtype(x.dtype, np.floating):
        raise BadInputError(f"pixels of dtype {x.dtype}: normalised float values are expected (see preprocess)")
    x = x.astype(np.float32, copy=False)
    if not np.isfinite(x).all():
        raise BadInputError("pixels contain NaN or infinite values")
    B = x.shape[0]
    out = np.zeros((B, cfg.n_tokens, cfg.patch_dim), np.float32)
    # (B, C, g, p, g, p) -> (B, g, g, C, p, p): patch (i, j) with its (C, p, p) values
    out[:, 1:] = x.reshape(B, C, g, p, g, p).transpose(0, 2, 4, 1, 3, 5).reshape(B, g * g, C * p * p)
    return out


def _row_indicators(ctx, patches, T: int):
    """is_patch and is_class, F32 (T, 1): (0, 1, …, 1) and (1, 0, …, 0),
    exact, computed from the input's first value (see the module docstring)."""
    zero = ctx.scale(ctx.view(patches, (1, 1)), 0.0)  # 0 (the class slot's first value, times 0)
    row = ctx.diag_mask_inf(ctx.repeat(zero, (1, T)), 0)  # (0, -inf, …, -inf)
    neg = ctx.clamp(row, -1.0, 0.0)  # (0, -1, …, -1)
    is_patch = ctx.reshape(ctx.scale(neg, -1.0), (T, 1))
    is_class = ctx.reshape(ctx.scale(neg, 1.0, 1.0), (T, 1))  # (1, 0, …, 0)
    return is_patch, is_class


def forward(ctx, cfg: ViTConfig, weights, patches, batch: int, lora=None, row_invariant: bool = False):
    """Logits F32 (B, n_classes) of B images: ``patches`` F32 (B, T, C·p·p)
    as ``patchify`` makes them, ``weights`` GGUF name -> ggml tensor (the
    names of ``params``), ``lora`` optional LoRA terms by weight name.
    ``row_invariant``: every product summed as a one-row product (toy-ggml
    patch 0004), so an image's logits do not depend on the batch beside it."""
    B, T, K, D, H = batch, cfg.n_tokens, cfg.patch_dim, cfg.d_model, cfg.n_head
    dh, eps = cfg.head_dim, cfg.norm_eps
    if tuple(patches.shape) != (B, T, K):
        raise ValueError(f"vit forward: patches {tuple(patches.shape)} must be ({B}, {T}, {K})")
    mm, lin = lora_linear(ctx, weights, lora, row_invariant)

    def ln(x, p: str):
        return ctx.add(ctx.mul(ctx.norm(x, eps), weights[f"{p}.weight"]), weights[f"{p}.bias"])

    def affine(p: str, x):
        return ctx.add(lin(f"{p}.weight", x), weights[f"{p}.bias"])

    def heads(x, axes, shape):  # (B*T, D) -> images-and-heads-major, contiguous
        return ctx.reshape(ctx.cont(ctx.permute(ctx.reshape(x, (B, T, H, dh)), axes)), shape)

    def attend(q, k, v):
        if ctx.gemm:  # toy's GEMM reads the heads as strided views: no copies of Q, K, V
            q = ctx.permute(ctx.reshape(q, (B, T, H, dh)), (0, 2, 1, 3))  # (B, H, T, dh)
            k = ctx.permute(ctx.reshape(k, (B, T, H, dh)), (0, 2, 1, 3))  # (B, H, T, dh)
            v = ctx.permute(ctx.reshape(v, (B, T, H, dh)), (0, 2, 3, 1))  # (B, H, dh, T)
            kq = ctx.soft_max(ctx.mul_mat(k, q), None, 1.0 / math.sqrt(dh))  # (B, H, T, T)
            a = ctx.mul_mat(v, kq)  # (B, H, T, dh)
            return ctx.reshape(ctx.cont(ctx.permute(a, (0, 2, 1, 3))), (B * T, D))
        q = heads(q, (0, 2, 1, 3), (B * H, T, dh))
        k = heads(k, (0, 2, 1, 3), (B * H, T, dh))
        v = heads(v, (0, 2, 3, 1), (B * H, dh, T))
        kq = ctx.soft_max(ctx.mul_mat(k, q, row_invariant=row_invariant), None, 1.0 / math.sqrt(dh))  # (B*H, T, T)
        a = ctx.reshape(ctx.mul_mat(v, kq, row_invariant=row_invariant), (B, H, T, dh))
        return ctx.reshape(ctx.cont(ctx.permute(a, (0, 2, 1, 3))), (B * T, D))

    is_patch, is_class = _row_indicators(ctx, patches, T)
    w = ctx.reshape(weights["v.patch_embd.weight"], (D, K))
    x = mm(w, ctx.reshape(patches, (B * T, K)))  # (B*T, D); the class rows are 0
    x = ctx.mul(ctx.add(x, weights["v.patch_embd.bias"]), is_patch)  # bias on patch rows only
    cls_rows = ctx.mul(ctx.repeat(ctx.reshape(weights["v.class_embd"], (1, D)), (T, D)), is_class)  # (T, D)
    x = ctx.add(x, ctx.add(weights["v.position_embd.weight"], cls_rows))  # (T, D) broadcast over images
    for i in range(cfg.n_layer):
        b = f"v.blk.{i}"
        h = ln(x, f"{b}.ln1")
        a = attend(affine(f"{b}.attn_q", h), affine(f"{b}.attn_k", h), affine(f"{b}.attn_v", h))
        x = ctx.add(x, affine(f"{b}.attn_out", a))
        if i == cfg.n_layer - 1:  # only the class rows from here on: (B, D)
            x = ctx.cont(ctx.view(x, (B, D), strides=(T * D * 4, 4)))
        h = ctx.gelu_erf(affine(f"{b}.ffn_up", ln(x, f"{b}.ln2")))
        x = ctx.add(x, affine(f"{b}.ffn_down", h))
    return affine("cls", ln(x, "v.post_ln"))  # (B, n_classes)


def graph_size(cfg: ViTConfig, lora_terms: int = 0) -> int:
    """Tensors a forward graph creates (an upper bound, for ``Context(max_tensors=…)``)."""
    return 64 * cfg.n_layer + 64 + 4 * lora_terms


__all__ = ["forward", "graph_size", "n_params", "params", "patchify"]
