"""An independent float64 NumPy reference forward of GPT-2 (tests only).

Written from the math of the GPT-2 paper / OpenAI's ``model.py``, not from
the ggml graph nor from Hugging Face's code: pre-LayerNorm blocks, learned
absolute positions, fused QKV, causal softmax attention scaled by
``1/sqrt(head_dim)``, a GELU MLP of the tanh form
``0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))`` and a final LayerNorm.

Weights use GGUF tensor names (llama.cpp's ``gpt2`` architecture) in NumPy
order, as the ``gguf`` package reads them: a linear weight ``W`` has shape
``(d_out, d_in)`` and maps ``x -> x @ W.T + b``. ``blk.N.attn_qkv.weight``
is ``(3 d, d)``: rows ``[0, d)`` are Q, ``[d, 2d)`` K, ``[2d, 3d)`` V, and
within each, head ``h`` owns rows ``[h hd, (h+1) hd)``. The head is
``output.weight`` when present, else ``token_embd.weight`` (tied).

``load_gguf(path)`` reads a converted file (F32, F16 or Q8_0 tensors,
dequantized by the ``gguf`` package) into ``(config, weights)``;
``forward(config, weights, ids)`` returns float64 logits ``(T, V)``.

Test modules load it like ``gpt2_ref`` (see that module's docstring).
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import numpy as np


def load_gguf(path) -> tuple[dict, dict[str, np.ndarray]]:
    """``config`` (n_layer, n_embd, n_head, n_ctx, n_ff, eps from the
    ``gpt2.*`` keys) and every tensor as a float64 array in NumPy order.
    ``path`` may also be an open ``gguf.GGUFReader``."""
    from gguf import GGUFReader
    from gguf.quants import dequantize

    r = path if isinstance(path, GGUFReader) else GGUFReader(str(path))

    def field(key):
        f = r.fields[key]
        return f.parts[f.data[0]].tolist()[0]

    cfg = {
        "n_layer": int(field("gpt2.block_count")),
        "n_embd": int(field("gpt2.embedding_length")),
        "n_head": int(field("gpt2.attention.head_count")),
        "n_ctx": int(field("gpt2.context_length")),
        "n_ff": int(field("gpt2.feed_forward_length")),
        "eps": float(field("gpt2.attention.layer_norm_epsilon")),
    }
    weights = {}
    for t in r.tensors:
        shape = tuple(int(n) for n in reversed(t.shape.tolist()))
        w = dequantize(t.data, t.tensor_type).reshape(shape)
        weights[t.name] = np.asarray(w, dtype=np.float64)
    return cfg, weights


def layer_norm(x: np.ndarray, g: np.ndarray, b: np.ndarray, eps: float) -> np.ndarray:
    mu = x.mean(axis=-1, keepdims=True)
    var = ((x - mu) ** 2).mean(axis=-1, keepdims=True)
    return (x - mu) / np.sqrt(var + eps) * g + b


def gelu_tanh(x: np.ndarray) -> np.ndarray:
    return 0.5 * x * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x**3)))


def forward(cfg: Mapping, w: Mapping[str, np.ndarray], ids, hidden: list | None = None) -> np.ndarray:
    """Float64 logits ``(T, V)`` for token ids ``ids`` at positions 0..T-1;
    ``hidden`` (a list, optional) receives the residual stream (T, d) after
    each block."""
    ids = np.asarray(ids, dtype=np.int64)
    T = len(ids)
    d, H, eps = int(cfg["n_embd"]), int(cfg["n_head"]), float(cfg["eps"])
    hd = d // H

    def W(name):
        return np.asarray(w[name], dtype=np.float64)

    x = W("token_embd.weight")[ids] + W("position_embd.weight")[:T]
    causal = np.triu(np.ones((T, T), dtype=bool), k=1)  # True above the diagonal: masked
    for i in range(int(cfg["n_layer"])):
        p = f"blk.{i}."
        h = layer_norm(x, W(p + "attn_norm.weight"), W(p + "attn_norm.bias"), eps)
        qkv = h @ W(p + "attn_qkv.weight").T + W(p + "attn_qkv.bias")  # (T, 3d)
        q, k, v = (qkv[:, j * d : (j + 1) * d].reshape(T, H, hd).transpose(1, 0, 2) for j in range(3))
        s = q @ k.transpose(0, 2, 1) / math.sqrt(hd)  # (H, T, T)
        s = np.where(causal, -np.inf, s)
        s = s - s.max(axis=-1, keepdims=True)
        a = np.exp(s)
        a /= a.sum(axis=-1, keepdims=True)
        o = (a @ v).transpose(1, 0, 2).reshape(T, d)
        x = x + o @ W(p + "attn_output.weight").T + W(p + "attn_output.bias")
        h = layer_norm(x, W(p + "ffn_norm.weight"), W(p + "ffn_norm.bias"), eps)
        u = gelu_tanh(h @ W(p + "ffn_up.weight").T + W(p + "ffn_up.bias"))
        x = x + u @ W(p + "ffn_down.weight").T + W(p + "ffn_down.bias")
        if hidden is not None:
            hidden.append(x)
    x = layer_norm(x, W("output_norm.weight"), W("output_norm.bias"), eps)
    head = W("output.weight") if "output.weight" in w else W("token_embd.weight")
    return x @ head.T
