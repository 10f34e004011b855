"""An independent float64 PyTorch reference for GPT-2 training (tests only).

Written from the math (GPT-2 paper / OpenAI's ``model.py``), not from the
ggml graph, ``toy.models.gpt2`` or Hugging Face; it shares the conventions
of ``torch_llama``: GGUF tensor names (llama.cpp's ``gpt2`` layout), weights
as NumPy arrays in NumPy order (a linear weight ``W`` has shape
``(d_out, d_in)`` and maps ``x -> x @ W.T + b``), the config a
``toy.models.gpt2.GPT2Config`` (read: ``n_layer``, ``n_head``, ``d_model``,
``norm_eps``, ``tied_output``).

The model, per row of T tokens:

    x   = token_embd[tokens] + position_embd[pos]
    per block:  h = LN(x; attn_norm)            LN(x) = (x - mean) / sqrt(var + eps) * g + b
                q|k|v = h @ attn_qkv.T + bias    thirds of the 3d outputs, head j owns rows [j hd, (j+1) hd)
                x = x + attn(q, k, v) @ attn_output.T + bias      scale 1/sqrt(hd), additive mask
                h = LN(x; ffn_norm)
                x = x + gelu(h @ ffn_up.T + bias) @ ffn_down.T + bias
    logits = LN(x; output_norm) @ head.T          head = token_embd (tied) or output

with ``gelu(x) = 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))``.

``gelu="fp16"`` emulates ggml's CPU GELU, which reads a float16 table: the
value is ``f16(gelu(f16(x)))`` (0 below -10, x above 10), while the
gradient stays the exact derivative at x (a straight-through term), which
is what toy-ggml's GELU backward (patch 0002) computes. It isolates the
table's rounding from everything else in a comparison; the default
(``"exact"``) is the plain formula.

A batch is B independent rows of T tokens: ``tokens``, ``pos``, ``doc``,
``targets`` int (B, T), ``loss_mask`` float (B, T). Query t of row b attends
key s iff ``s <= t`` and ``doc[b, s] == doc[b, t]`` (packed documents,
block-causal), as an additive (B, 1, T, T) mask of 0 and -inf; a token's
learned position is ``position_embd[pos[b, t]]``. The loss matches toy's
engine (``toy.train.stepgraph``): the mean NLL over the target tokens,

    sum_{b,t} [loss_mask > 0] * -log softmax(logits[b,t])[targets[b,t]] / normalizer

(``normalizer`` defaults to the number of targets), with its gradient from
torch autograd in float64.

LoRA: ``lora`` maps an adapted weight's GGUF name to ``(A, B, scale)``,
A (r, d_in), B (d_out, r); that product then uses ``W + scale * B @ A``,
and ``loss_and_grads`` also returns the gradients of ``<W>.lora_a`` and
``<W>.lora_b`` (autograd through the effective weight).

For AdamW use ``torch_llama.adamw_step`` (it is architecture-free).
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping

import numpy as np

# torch is imported on first use (importing it takes seconds)
torch = None


def _load_torch():
    global torch
    if torch is None:
        import torch as _torch

        env = os.environ.get("TOY_THREADS", "").strip()
        if env.isdigit() and int(env) >= 1:
            _torch.set_num_threads(int(env))
        torch = _torch
    return torch


def _ints(a, name: str):
    a = np.asarray(a)
    if a.ndim != 2:
        raise ValueError(f"torch_gpt2: {name} must be (B, T), got shape {a.shape}")
    return torch.from_numpy(a.astype(np.int64))


def _layer_norm(x, g, b, eps: float):
    mu = x.mean(dim=-1, keepdim=True)
    var = ((x - mu) ** 2).mean(dim=-1, keepdim=True)  # biased variance, as GPT-2
    return (x - mu) / torch.sqrt(var + eps) * g + b


def gelu_tanh(x):
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x**3)))


def _gelu_fp16_value(x):
    """ggml's CPU table lookup: f16(gelu_f32(f16(x))), 0 at x <= -10, x at x >= 10.

    The table entry is ggml's float32 ``0.5f*x*(1.0f + tanhf(c*x*(1.0f +
    a*x*x)))``, evaluated here op by op in float32 (``1 + a*x*x`` as one
    fused multiply-add, as the compiler contracts it, and tanh rounded once
    to float32): in the left tail ``1 + tanh`` cancels, so only float32
    arithmetic gives ggml's value there (a float64 formula differs from the
    table in ~3% of entries). Checked against ggml's own GELU on every
    float16 input in (-10, 10): identical."""
    f32, f64 = torch.float32, torch.float64
    xd = x.detach()
    x16 = xd.to(f32).to(torch.float16).to(f32)
    c = torch.tensor(0.79788456080286535587989211986876, dtype=f32)
    a = torch.tensor(0.044715, dtype=f32)
    ax = a * x16  # float32
    poly = (ax.to(f64) * x16.to(f64) + 1.0).to(f32)  # fma(a*x, x, 1): the product is exact in float64
    u = (c * x16) * poly  # float32
    t = torch.tanh(u.to(f64)).to(f32)
    y = ((0.5 * x16) * (1.0 + t)).to(torch.float16).to(f64)
    return torch.where(xd <= -10.0, torch.zeros_like(xd), torch.where(xd >= 10.0, xd, y))


def _gelu(x, mode: str):
    if mode == "exact":
        return gelu_tanh(x)
    if mode == "fp16":
        g = gelu_tanh(x)
        return g + (_gelu_fp16_value(x) - g.detach())  # table value, exact gradient
    raise ValueError(f"torch_gpt2: gelu={mode!r}: 'exact' or 'fp16'")


def _forward(w, cfg, tokens, pos, doc, lora=None, gelu: str = "exact"):
    """Logits (B, T, V) float64, differentiable in ``w`` (and the LoRA tensors)."""
    B, T = tokens.shape
    if pos.shape != (B, T) or doc.shape != (B, T):
        raise ValueError(f"torch_gpt2: tokens {tuple(tokens.shape)}, pos {tuple(pos.shape)}, doc {tuple(doc.shape)}")
    if int(pos.max()) >= w["position_embd.weight"].shape[0] or int(pos.min()) < 0:
        raise ValueError(f"torch_gpt2: a position outside [0, {w['position_embd.weight'].shape[0]})")
    d, H, eps = int(cfg.d_model), int(cfg.n_head), float(cfg.norm_eps)
    if d % H:
        raise ValueError(f"torch_gpt2: d_model {d} is not a multiple of n_head {H}")
    hd = d // H
    lora = lora or {}

    def weight(name):
        W = w[name]
        if name in lora:
            a, b, s = lora[name]
            W = W + s * (b @ a)  # (d_out, r) @ (r, d_in)
        return W

    def linear(x, stem):
        return x @ weight(f"{stem}.weight").T + w[f"{stem}.bias"]

    causal = torch.ones(T, T, dtype=torch.bool).tril()  # [t, s]: s <= t
    allowed = causal[None] & (doc[:, :, None] == doc[:, None, :])  # (B, T, T)
    zero = torch.zeros((), dtype=torch.float64)
    mask = torch.where(allowed, zero, torch.tensor(float("-inf"), dtype=torch.float64))[:, None]  # (B, 1, T, T)

    x = w["token_embd.weight"][tokens] + w["position_embd.weight"][pos]  # (B, T, d)
    for layer in range(cfg.n_layer):
        p = f"blk.{layer}"
        h = _layer_norm(x, w[f"{p}.attn_norm.weight"], w[f"{p}.attn_norm.bias"], eps)
        qkv = linear(h, f"{p}.attn_qkv")  # (B, T, 3d): Q | K | V
        q, k, v = (qkv[..., j * d : (j + 1) * d].reshape(B, T, H, hd).transpose(1, 2) for j in range(3))
        scores = (q @ k.transpose(-1, -2)) / math.sqrt(hd) + mask  # (B, H, T, T)
        att = torch.softmax(scores, dim=-1) @ v  # (B, H, T, hd)
        att = att.transpose(1, 2).reshape(B, T, d)
        x = x + linear(att, f"{p}.attn_output")
        h = _layer_norm(x, w[f"{p}.ffn_norm.weight"], w[f"{p}.ffn_norm.bias"], eps)
        x = x + linear(_gelu(linear(h, f"{p}.ffn_up"), gelu), f"{p}.ffn_down")
    x = _layer_norm(x, w["output_norm.weight"], w["output_norm.bias"], eps)
    head = w["token_embd.weight" if cfg.tied_output else "output.weight"]
    return x @ head.T


def _as_torch(params: Mapping[str, np.ndarray], grad: bool) -> dict:
    return {
        k: torch.tensor(np.asarray(v, np.float64), dtype=torch.float64, requires_grad=grad) for k, v in params.items()
    }


def _lora_torch(lora, grad: bool):
    """{W: (A, B, s)} as torch tensors, and the flat name -> tensor map of A/B."""
    out, flat = {}, {}
    for name, (a, b, s) in (lora or {}).items():
        ta = torch.tensor(np.asarray(a, np.float64), dtype=torch.float64, requires_grad=grad)
        tb = torch.tensor(np.asarray(b, np.float64), dtype=torch.float64, requires_grad=grad)
        out[name] = (ta, tb, float(s))
        flat[f"{name}.lora_a"], flat[f"{name}.lora_b"] = ta, tb
    return out, flat


def logits(params: Mapping[str, np.ndarray], cfg, tokens, pos, doc, *, lora=None, gelu: str = "exact") -> np.ndarray:
    """Logits (B, T, V) float64 of B rows (see the module doc for pos/doc)."""
    _load_torch()
    w = _as_torch(params, grad=False)
    lt, _ = _lora_torch(lora, grad=False)
    with torch.no_grad():
        out = _forward(w, cfg, _ints(tokens, "tokens"), _ints(pos, "pos"), _ints(doc, "doc"), lt, gelu)
    return out.numpy().copy()


def loss_and_grads(
    params: Mapping[str, np.ndarray],
    cfg,
    tokens,
    pos,
    doc,
    targets,
    loss_mask,
    normalizer: float | None = None,
    *,
    lora=None,
    gelu: str = "exact",
) -> tuple[float, dict[str, np.ndarray]]:
    """The masked, normalized cross-entropy of a batch and its gradient with
    respect to every entry of ``params`` (and, with ``lora``, every
    ``<W>.lora_a`` / ``<W>.lora_b``): float64 arrays of the same shapes,
    zeros for a tensor the loss does not use."""
    _load_torch()
    w = _as_torch(params, grad=True)
    lt, flat = _lora_torch(lora, grad=True)
    tok, tgt = _ints(tokens, "tokens"), _ints(targets, "targets")
    sel = torch.from_numpy(np.asarray(loss_mask) > 0).to(torch.float64)
    if tgt.shape != tok.shape or sel.shape != tok.shape:
        raise ValueError(
            f"torch_gpt2: tokens {tuple(tok.shape)}, targets {tuple(tgt.shape)}, loss_mask {tuple(sel.shape)}"
        )
    n = float(sel.sum()) if normalizer is None else float(normalizer)
    z = _forward(w, cfg, tok, _ints(pos, "pos"), _ints(doc, "doc"), lt, gelu)  # (B, T, V)
    logp = torch.log_softmax(z, dim=-1)
    nll = -logp.gather(-1, tgt.clamp(0, z.shape[-1] - 1)[..., None])[..., 0]  # (B, T)
    loss = (sel * nll).sum() / n
    named = {**w, **flat}
    names = list(named)
    grads = torch.autograd.grad(loss, [named[k] for k in names], allow_unused=True)
    out = {}
    for k, g in zip(names, grads):
        out[k] = np.zeros(tuple(named[k].shape)) if g is None else g.numpy().copy()
    return float(loss.detach()), out


__all__ = ["gelu_tanh", "logits", "loss_and_grads"]
