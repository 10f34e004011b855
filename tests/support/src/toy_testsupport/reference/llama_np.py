"""A plain NumPy float64 reference of the llama-family forward pass (tests only).

Written from the math, not from the ggml graph: the same config
(``toy.models.llama.LlamaConfig``) and GGUF tensor names, weights as float
arrays in NumPy order (a linear weight ``W`` has shape ``(d_out, d_in)`` and
maps ``x -> x @ W.T``). Quantized weights are dequantized by the caller
(``GGUFFile.tensor_to_float``). Query head ``h`` attends with key/value head
``h // (n_head / n_head_kv)``.

RoPE: "normal" rotates pairs ``(2i, 2i+1)``, "neox" pairs
``(i, i + n_dims/2)`` (``n_dims = rope_dims``; dims past it are left alone),
pair ``i`` by an angle ``pos * theta_i`` with

    theta_i = base^(-2i/n_dims) / freq_factor_i

(``freq_factor`` = the ``rope_freqs.weight`` tensor for "llama3" scaling,
1 otherwise), and cos/sin multiplied by a magnitude ``mscale``. Scaling
(``cfg.rope_scaling``, freq_scale = 1/factor):

- none / "llama3": angle ``pos * theta_i``, mscale = attn_factor;
- "linear": angle ``freq_scale * pos * theta_i`` (positions interpolated),
  mscale = attn_factor;
- "yarn" (YaRN, Peng et al. 2023, as ggml defines it): extrapolated
  ``theta_extrap = theta_i``, interpolated ``theta_interp = freq_scale *
  theta_i``, mixed per pair by a ramp over the pair index between the
  correction dims ``low = max(0, floor(c(beta_fast)))`` and
  ``high = min(n_dims - 1, ceil(c(beta_slow)))`` where
  ``c(b) = n_dims * ln(n_ctx_orig / (b * 2 pi)) / (2 ln base)`` (the pair
  whose wavelength makes ``b`` turns over the original context):
  ``ramp_i = (1 - clip((i - low) / max(0.001, high - low), 0, 1)) * ext_factor``,
  angle ``pos * (theta_interp * (1 - ramp_i) + theta_extrap * ramp_i)``
  (high frequencies extrapolated, low ones interpolated), and
  mscale = attn_factor * (1 + 0.1 ln(1 / freq_scale)) when ext_factor != 0.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping

import numpy as np


def load_weights(gf) -> dict[str, np.ndarray]:
    """Every tensor of an open ``GGUFFile`` as a float64 array."""
    return {name: gf.tensor_to_float(name).astype(np.float64) for name in gf.tensors}


def _rms(x: np.ndarray, gamma: np.ndarray, eps: float) -> np.ndarray:
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * gamma


def rope_angles(
    pos: np.ndarray,
    dims: int,
    base: float,
    *,
    freq_scale: float = 1.0,
    freq_factors: np.ndarray | None = None,
    ext_factor: float = 0.0,
    n_ctx_orig: int = 0,
    beta_fast: float = 32.0,
    beta_slow: float = 1.0,
    attn_factor: float = 1.0,
) -> tuple[np.ndarray, float]:
    """The rotation angles (T, dims/2) of positions ``pos`` (T,) and the
    magnitude ``mscale`` that multiplies cos and sin (see the module doc)."""
    half = dims // 2
    i = np.arange(half, dtype=np.float64)
    theta_extrap = float(base) ** (-2.0 * i / dims)
    if freq_factors is not None:
        theta_extrap = theta_extrap / np.asarray(freq_factors, np.float64).reshape(-1)[:half]
    theta_interp = freq_scale * theta_extrap
    mscale = float(attn_factor)
    if ext_factor != 0.0:
        if not n_ctx_orig > 0:
            raise ValueError(f"YaRN needs the original context length (n_ctx_orig={n_ctx_orig})")

        def corr_dim(beta: float) -> float:
            return dims * math.log(n_ctx_orig / (beta * 2.0 * math.pi)) / (2.0 * math.log(base))

        low = max(0.0, math.floor(corr_dim(beta_fast)))
        high = min(dims - 1.0, math.ceil(corr_dim(beta_slow)))
        y = (i - low) / max(0.001, high - low)
        ramp = (1.0 - np.clip(y, 0.0, 1.0)) * ext_factor
        theta = theta_interp * (1.0 - ramp) + theta_extrap * ramp
        mscale *= 1.0 + 0.1 * math.log(1.0 / freq_scale)
    else:
        theta = theta_interp
    return np.asarray(pos, np.float64)[:, None] * theta[None, :], mscale


def rope(x: np.ndarray, pos: np.ndarray, dims: int, base: float, mode: str, **scaling) -> np.ndarray:
    """x (T, H, D) rotated per position; pos (T,). ``scaling``: the keyword
    arguments of ``rope_angles`` (freq_scale, freq_factors, ext_factor,
    n_ctx_orig, beta_fast, beta_slow, attn_factor); none = plain RoPE."""
    x = x.copy()
    half = dims // 2
    ang, mscale = rope_angles(pos, dims, base, **scaling)  # (T, half)
    c, s = (np.cos(ang) * mscale)[:, None, :], (np.sin(ang) * mscale)[:, None, :]
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


def rope_scaling_of(cfg, w: Mapping[str, np.ndarray]) -> dict:
    """The ``rope`` scaling keywords of a config (and, for "llama3", its
    ``rope_freqs.weight``). Configs without the scaling fields get none."""
    kind = getattr(cfg, "rope_scaling", None)
    if kind is None:
        return {"attn_factor": getattr(cfg, "rope_attn_factor", 1.0)}
    if kind not in ("linear", "yarn", "llama3"):
        raise ValueError(f"rope scaling {kind!r}")
    out = {
        "freq_scale": getattr(cfg, "rope_freq_scale", 1.0),
        "attn_factor": getattr(cfg, "rope_attn_factor", 1.0),
    }
    if kind == "yarn":
        out.update(
            ext_factor=getattr(cfg, "yarn_ext_factor", 1.0),
            n_ctx_orig=getattr(cfg, "rope_orig_ctx", 0),
            beta_fast=getattr(cfg, "yarn_beta_fast", 32.0),
            beta_slow=getattr(cfg, "yarn_beta_slow", 1.0),
        )
    if kind == "llama3":
        out["freq_factors"] = w["rope_freqs.weight"]
    return out


def forward_logits(
    cfg,
    w: Mapping[str, np.ndarray],
    ids,
    qkv_round: Callable[[np.ndarray], np.ndarray] | None = None,
    hidden: list | None = None,
) -> np.ndarray:
    """Logits (T, n_vocab) float64 of token ids (T,). ``qkv_round`` (optional)
    maps Q, K and V, each (T, heads, D) after RoPE, to rounded copies before
    attention: a test emulates a storage type with it (e.g. a quantized KV
    cache, through a quantize/dequantize round trip). ``hidden`` (a list,
    optional) receives the residual stream (T, d) after each block."""
    ids = np.asarray(ids, dtype=np.int64)
    T, H, Hkv, D, eps = len(ids), cfg.n_head, cfg.n_head_kv, cfg.head_dim, cfg.rms_eps
    group = H // Hkv
    pos = np.arange(T)
    causal = np.triu(np.ones((T, T), bool), 1)
    scaling = rope_scaling_of(cfg, w)
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
                y = rope(y, pos, cfg.rope_dims, cfg.rope_base, cfg.rope_mode, **scaling)
            qkv[n] = y if qkv_round is None else np.asarray(qkv_round(y), np.float64)
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
        if hidden is not None:
            hidden.append(x)
    x = _rms(x, w["output_norm.weight"], eps)
    head = w["token_embd.weight" if cfg.tied_output else "output.weight"]
    return x @ np.asarray(head, np.float64).T
