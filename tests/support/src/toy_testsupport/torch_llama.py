"""An independent float64 PyTorch reference for llama-family training (tests only).

Written from the math, not from the ggml graph nor from
``toy_testsupport.reference.llama_np`` (whose conventions it shares): GGUF tensor names,
weights as NumPy arrays in NumPy order (a linear weight ``W`` has shape
``(d_out, d_in)`` and maps ``x -> x @ W.T``), the config
``toy.models.llama.LlamaConfig``. Covered: grouped-query attention (query
head ``h`` uses key/value head ``h // (H / H_kv)``), Q/K/V biases, per-head
Q/K RMSNorm (qwen3), tied output (``token_embd.weight`` is the head), a head
size other than ``d_model / n_head``, RoPE "normal" (pairs ``(2i, 2i+1)``)
and "neox" (pairs ``(i, i + n/2)``) over the first ``rope_dims`` dims, pair
``i`` turned by ``pos * base^(-2i/rope_dims)``. RoPE scaling is not
supported (``ValueError``).

A batch is B independent rows of T tokens: ``tokens``, ``pos``, ``doc``,
``targets`` int (B, T), ``loss_mask`` float (B, T). Query ``t`` of row ``b``
attends key ``s`` iff ``s <= t`` and ``doc[b, s] == doc[b, t]`` (several
documents packed in one row, block-causal); a token's RoPE angle uses its
``pos``. The loss is

    sum_{b,t} loss_mask[b,t] * -log softmax(logits[b,t])[targets[b,t]] / normalizer

and its gradient comes from torch autograd in float64.

``adamw_step`` runs ``torch.optim.AdamW`` and ``torch.nn.utils.clip_grad_norm_``
themselves, as an independent reference for an AdamW written elsewhere.

Test modules import it as ``from toy_testsupport import torch_llama``.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping

import numpy as np

# torch is imported on first use, not with this module: test modules that
# import this one only for a constant or a helper should not pay for importing
# torch, which takes seconds.
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


def _check_cfg(cfg) -> None:
    if getattr(cfg, "rope_scaling", None) is not None:
        raise ValueError(f"torch_llama: RoPE scaling {cfg.rope_scaling!r} is not supported")
    if cfg.rope_mode not in ("normal", "neox"):
        raise ValueError(f"torch_llama: rope mode {cfg.rope_mode!r}")
    if cfg.n_head % cfg.n_head_kv:
        raise ValueError(f"torch_llama: n_head {cfg.n_head} is not a multiple of n_head_kv {cfg.n_head_kv}")


def _ints(a, name: str) -> torch.Tensor:
    a = np.asarray(a)
    if a.ndim != 2:
        raise ValueError(f"torch_llama: {name} must be (B, T), got shape {a.shape}")
    return torch.from_numpy(a.astype(np.int64))


def _rms(x: torch.Tensor, gamma: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt((x * x).mean(dim=-1, keepdim=True) + eps) * gamma


def _rope(x: torch.Tensor, pos: torch.Tensor, cfg) -> torch.Tensor:
    """x (B, T, heads, D) rotated by positions pos (B, T)."""
    n = cfg.rope_dims
    half = n // 2
    i = torch.arange(half, dtype=torch.float64)
    theta = float(cfg.rope_base) ** (-2.0 * i / n)  # (half,)
    ang = pos.to(torch.float64)[..., None] * theta  # (B, T, half)
    mscale = float(getattr(cfg, "rope_attn_factor", 1.0))
    c = (torch.cos(ang) * mscale)[:, :, None, :]  # (B, T, 1, half)
    s = (torch.sin(ang) * mscale)[:, :, None, :]
    rot, rest = x[..., :n], x[..., n:]
    if cfg.rope_mode == "normal":
        a, b = rot[..., 0::2], rot[..., 1::2]
        # interleave back: (a', b') pairs at (2i, 2i+1)
        out = torch.stack((a * c - b * s, a * s + b * c), dim=-1).reshape(rot.shape)
    else:
        a, b = rot[..., :half], rot[..., half:]
        out = torch.cat((a * c - b * s, a * s + b * c), dim=-1)
    return torch.cat((out, rest), dim=-1)


def _forward(w: Mapping[str, torch.Tensor], cfg, tokens: torch.Tensor, pos: torch.Tensor, doc: torch.Tensor):
    """Logits (B, T, V) as a torch float64 tensor (differentiable in ``w``)."""
    _check_cfg(cfg)
    B, T = tokens.shape
    if pos.shape != (B, T) or doc.shape != (B, T):
        raise ValueError(f"torch_llama: tokens {tuple(tokens.shape)}, pos {tuple(pos.shape)}, doc {tuple(doc.shape)}")
    H, Hkv, D, eps = cfg.n_head, cfg.n_head_kv, cfg.head_dim, float(cfg.rms_eps)
    group = H // Hkv
    causal = torch.ones(T, T, dtype=torch.bool).tril()  # [t, s]: s <= t
    allowed = causal[None] & (doc[:, :, None] == doc[:, None, :])  # (B, T, T)
    allowed = allowed[:, None]  # (B, 1, T, T) over heads
    kv_head = torch.arange(H) // group  # query head h -> kv head
    x = w["token_embd.weight"][tokens]  # (B, T, d)
    for layer in range(cfg.n_layer):
        p = f"blk.{layer}"
        h = _rms(x, w[f"{p}.attn_norm.weight"], eps)
        qkv = {}
        for n, heads in (("q", H), ("k", Hkv), ("v", Hkv)):
            y = h @ w[f"{p}.attn_{n}.weight"].T
            if cfg.qkv_bias:
                y = y + w[f"{p}.attn_{n}.bias"]
            y = y.reshape(B, T, heads, D)
            if cfg.qk_norm and n != "v":
                y = _rms(y, w[f"{p}.attn_{n}_norm.weight"], eps)
            if n != "v":
                y = _rope(y, pos, cfg)
            qkv[n] = y.transpose(1, 2)  # (B, heads, T, D)
        q = qkv["q"]
        k = qkv["k"][:, kv_head]  # (B, H, T, D)
        v = qkv["v"][:, kv_head]
        scores = (q @ k.transpose(-1, -2)) / math.sqrt(D)  # (B, H, T, T)
        scores = scores.masked_fill(~allowed, float("-inf"))
        att = torch.softmax(scores, dim=-1) @ v  # (B, H, T, D)
        att = att.transpose(1, 2).reshape(B, T, H * D)
        x = x + att @ w[f"{p}.attn_output.weight"].T
        h = _rms(x, w[f"{p}.ffn_norm.weight"], eps)
        gate = h @ w[f"{p}.ffn_gate.weight"].T
        up = h @ w[f"{p}.ffn_up.weight"].T
        x = x + (gate * torch.sigmoid(gate) * up) @ w[f"{p}.ffn_down.weight"].T
    x = _rms(x, w["output_norm.weight"], eps)
    head = w["token_embd.weight" if cfg.tied_output else "output.weight"]
    return x @ head.T


def _as_torch(params: Mapping[str, np.ndarray], grad: bool) -> dict[str, torch.Tensor]:
    return {
        k: torch.tensor(np.asarray(v, np.float64), dtype=torch.float64, requires_grad=grad) for k, v in params.items()
    }


def logits(params: Mapping[str, np.ndarray], cfg, tokens, pos, doc) -> np.ndarray:
    """Logits (B, T, V) float64 of B rows (see the module doc for pos/doc)."""
    _load_torch()
    w = _as_torch(params, grad=False)
    with torch.no_grad():
        out = _forward(w, cfg, _ints(tokens, "tokens"), _ints(pos, "pos"), _ints(doc, "doc"))
    return out.numpy().copy()


def loss_and_grads(
    params: Mapping[str, np.ndarray],
    cfg,
    tokens,
    pos,
    doc,
    targets,
    loss_mask,
    normalizer: float,
    label_smoothing: float = 0.0,
) -> tuple[float, dict[str, np.ndarray]]:
    """The masked, normalized cross-entropy of a batch and its gradient with
    respect to every entry of ``params`` (float64 arrays of the same shapes;
    zeros for a tensor the loss does not use). ``label_smoothing`` e: each
    position's loss is ``(1 - e) * nll + e * mean over the vocabulary of
    -log p`` (PyTorch's ``cross_entropy(label_smoothing=e)``)."""
    _load_torch()
    w = _as_torch(params, grad=True)
    tok, tgt = _ints(tokens, "tokens"), _ints(targets, "targets")
    mask = torch.from_numpy(np.array(loss_mask, np.float64, copy=True))
    if tgt.shape != tok.shape or mask.shape != tok.shape:
        raise ValueError(
            f"torch_llama: tokens {tuple(tok.shape)}, targets {tuple(tgt.shape)}, loss_mask {tuple(mask.shape)}"
        )
    z = _forward(w, cfg, tok, _ints(pos, "pos"), _ints(doc, "doc"))  # (B, T, V)
    logp = torch.log_softmax(z, dim=-1)
    nll = -logp.gather(-1, tgt[..., None])[..., 0]  # (B, T)
    if label_smoothing:
        nll = (1.0 - label_smoothing) * nll - label_smoothing * logp.mean(dim=-1)
    loss = (mask * nll).sum() / float(normalizer)
    names = list(w)
    grads = torch.autograd.grad(loss, [w[n] for n in names], allow_unused=True)
    out = {}
    for n, g in zip(names, grads):
        out[n] = np.zeros(np.shape(params[n])) if g is None else g.numpy().copy()
    return float(loss.detach()), out


def objective_and_grads(
    params: Mapping[str, np.ndarray], cfg, tokens, pos, doc, targets, loss_mask, fn, temperature: float = 1.0
):
    """``fn(lp)`` and its gradient with respect to every entry of ``params``,
    where ``lp`` (B, T) is the float64 torch tensor of each position's target
    log-probability (``log_softmax`` of the logits / ``temperature`` at the
    target), times ``loss_mask``: a training objective on sequence
    log-probabilities (``toy.train.objectives``) written out in torch by the
    caller."""
    _load_torch()
    w = _as_torch(params, grad=True)
    tgt = _ints(targets, "targets")
    mask = torch.from_numpy(np.array(loss_mask, np.float64, copy=True))
    z = _forward(w, cfg, _ints(tokens, "tokens"), _ints(pos, "pos"), _ints(doc, "doc"))
    lp = torch.log_softmax(z / temperature, dim=-1).gather(-1, tgt[..., None])[..., 0] * mask
    loss = fn(lp)
    names = list(w)
    grads = torch.autograd.grad(loss, [w[n] for n in names], allow_unused=True)
    out = {n: np.zeros(np.shape(params[n])) if g is None else g.numpy().copy() for n, g in zip(names, grads)}
    return float(loss.detach()), out


def adamw_step(
    params: Mapping[str, np.ndarray],
    grads: Mapping[str, np.ndarray],
    state,
    *,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    no_decay: set[str],
    max_grad_norm: float | None,
) -> tuple[dict[str, np.ndarray], dict, float]:
    """One step of ``torch.optim.AdamW`` (float64) over ``params``.

    ``state``: None on the first step, then what the previous call returned
    (it holds the torch parameters and the optimizer, so moments and the step
    count carry over; the values in ``params`` are copied in each call, so the
    caller may pass what the previous step returned or anything else of the
    same names and shapes). Two parameter groups: ``weight_decay`` for names
    not in ``no_decay``, 0 for those in it. When ``max_grad_norm`` is not
    None, ``torch.nn.utils.clip_grad_norm_`` scales all gradients together
    to that global L2 norm first (torch's own rule: coefficient
    ``max_norm / (norm + 1e-6)``, clamped to 1).

    Torch's AdamW, for reference: ``p -= lr * weight_decay * p``, then
    ``m = b1 m + (1-b1) g``, ``v = b2 v + (1-b2) g^2``,
    ``p -= lr / (1 - b1^t) * m / (sqrt(v) / sqrt(1 - b2^t) + eps)``.

    Returns (new params as float64 NumPy arrays, state, the global L2 norm
    of the gradients before clipping)."""
    _load_torch()
    names = list(params)
    if state is None:
        tp = {n: torch.nn.Parameter(torch.zeros(np.shape(params[n]), dtype=torch.float64)) for n in names}
        groups = [
            {"params": [tp[n] for n in names if n not in no_decay], "weight_decay": float(weight_decay)},
            {"params": [tp[n] for n in names if n in no_decay], "weight_decay": 0.0},
        ]
        groups = [g for g in groups if g["params"]]
        opt = torch.optim.AdamW(
            groups, lr=lr, betas=(beta1, beta2), eps=eps, weight_decay=weight_decay, foreach=False, fused=False
        )
        state = {"params": tp, "optimizer": opt, "names": names}
    else:
        tp, opt = state["params"], state["optimizer"]
        if set(names) != set(state["names"]):
            raise ValueError("torch_llama.adamw_step: the parameter names changed between steps")
        for g in opt.param_groups:  # a schedule may change lr between steps
            g["lr"] = lr
            g["betas"] = (beta1, beta2)
            g["eps"] = eps
    with torch.no_grad():
        for n in names:
            tp[n].copy_(torch.from_numpy(np.array(params[n], np.float64, copy=True)))
            tp[n].grad = torch.from_numpy(np.array(grads[n], np.float64, copy=True))
    plist = [tp[n] for n in names]
    if max_grad_norm is not None:
        norm = torch.nn.utils.clip_grad_norm_(plist, max_grad_norm, norm_type=2.0)
    else:
        norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(p.grad) for p in plist]))
    opt.step()
    opt.zero_grad(set_to_none=True)
    new = {n: tp[n].detach().numpy().copy() for n in names}
    return new, state, float(norm)


__all__ = ["adamw_step", "logits", "loss_and_grads"]
