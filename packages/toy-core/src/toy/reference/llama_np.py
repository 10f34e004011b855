"""A plain NumPy float64 reference of the llama-family forward pass (tests only).

Written from the math, not from the ggml graph: the same config
(``toy.models.llama.LlamaConfig``) and GGUF tensor names, weights as float
arrays in NumPy order (a linear weight ``W`` has shape ``(d_out, d_in)`` and
maps ``x -> x @ W.T``). Quantized weights are dequantized by the caller
(``GGUFFile.tensor_to_float``). RoPE: "normal" rotates pairs ``(2i, 2i+1)``,
"neox" pairs ``(i, i + rope_dims/2)``, both by angle ``pos * base^(-2i/rope_dims)``;
dims past ``rope_dims`` are left alone. Query head ``h`` attends with key/value
head ``h // (n_head / n_head_kv)``.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np


def load_weights(gf) -> dict[str, np.ndarray]:
    """Every tensor of an open ``GGUFFile`` as a float64 array."""
    return {name: gf.tensor_to_float(name).astype(np.float64) for name in gf.tensors}


def _rms(x: np.ndarray, gamma: np.ndarray, eps: float) -> np.ndarray:
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * gamma


def rope(x: np.ndarray, pos: np.ndarray, dims: int, base: float, mode: str) -> np.ndarray:
    """x (T, H, D) rotated per position; pos (T,)."""
    x = x.copy()
    half = dims // 2
    theta = base ** (-2.0 * np.arange(half) / dims)  # (half,)
    ang = pos[:, None].astype(np.float64) * theta[None, :]  # (T, half)
    c, s = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]
    if mode == "normal":
        i0, i1 = np.arange(0, dims, 2), np.arange(1, dims, 2)
    elif mode == "neox":
        i0, i1 = np.arange(half), np.arange(half, dims)
    else:
        raise ValueError(f"rope mode {mode!r}")
    a, b = x[..., i0].copy(), x[..., i1].copy()
    x[..., i0] = a * c - b * s
    x[..., i1] = a * s + b * c
    return x


def forward_logits(cfg, w: Mapping[str, np.ndarray], ids) -> np.ndarray:
    """Logits (T, n_vocab) float64 of token ids (T,)."""
    ids = np.asarray(ids, dtype=np.int64)
    T, H, Hkv, D, eps = len(ids), cfg.n_head, cfg.n_head_kv, cfg.head_dim, cfg.rms_eps
    group = H // Hkv
    pos = np.arange(T)
    causal = np.triu(np.ones((T, T), bool), 1)
    x = np.asarray(w["token_embd.weight"], np.float64)[ids]
    for i in range(cfg.n_layer):
        p = f"blk.{i}"
        h = _rms(x, w[f"{p}.attn_norm.weight"], eps)
        qkv = {}
        for n, heads in (("q", H), ("k", Hkv), ("v", Hkv)):
            y = h @ w[f"{p}.attn_{n}.weight"].T
            if cfg.qkv_bias:
                y = y + w[f"{p}.attn_{n}.bias"]
            y = y.reshape(T, heads, D)
            if cfg.qk_norm and n != "v":
                y = _rms(y, w[f"{p}.attn_{n}_norm.weight"], eps)
            if n != "v":
                y = rope(y, pos, cfg.rope_dims, cfg.rope_base, cfg.rope_mode)
            qkv[n] = y
        out = np.empty((T, H, D))
        for hh in range(H):
            g = hh // group
            s = qkv["q"][:, hh, :] @ qkv["k"][:, g, :].T / np.sqrt(D)
            s = np.where(causal, -np.inf, s)
            s = np.exp(s - s.max(axis=-1, keepdims=True))
            s /= s.sum(axis=-1, keepdims=True)
            out[:, hh, :] = s @ qkv["v"][:, g, :]
        x = x + out.reshape(T, H * D) @ w[f"{p}.attn_output.weight"].T
        h = _rms(x, w[f"{p}.ffn_norm.weight"], eps)
        gate = h @ w[f"{p}.ffn_gate.weight"].T
        up = h @ w[f"{p}.ffn_up.weight"].T
        x = x + (gate / (1.0 + np.exp(-gate)) * up) @ w[f"{p}.ffn_down.weight"].T
    x = _rms(x, w["output_norm.weight"], eps)
    head = w["token_embd.weight" if cfg.tied_output else "output.weight"]
    return x @ np.asarray(head, np.float64).T
