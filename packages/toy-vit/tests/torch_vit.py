"""The independent float64 PyTorch reference of toy-vit's training tests,
written from the math (not from toy's graph), plus the tests' synthetic
image folder.

``loss_and_grads`` is Hugging Face's ``ViTForImageClassification``
forward (pre-norm blocks, class token, exact erf GELU) on toy's tensor
names, in float64 with torch autograd:

- the patch embedding is ``F.conv2d`` with stride p on the pixels (not toy's
  patchify + product), then the class token is concatenated in front and
  the position embedding added;
- each block: ``x += W_o·MHA(LN1(x)) + b_o``, ``x += W_down·gelu(W_up·LN2(x)
  + b_up) + b_down``, ``LayerNorm`` with the config's epsilon, attention
  softmax(Q Kᵀ / √d_h) V per head;
- the final LayerNorm of the class token, then the head;
- the loss is ``F.cross_entropy(logits[kept], labels[kept],
  label_smoothing=e)`` (the mean over the kept rows);
- LoRA (optional): a projection W becomes ``W x + s · B (A x)``.

``adamw_step`` is one ``torch.optim.AdamW`` step (two groups: weight decay
and none; ``clip_grad_norm_`` first when asked), float64.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import numpy as np

_STEMS = ("attn_q", "attn_k", "attn_v", "attn_out", "ffn_up", "ffn_down")


def _t(a):
    import torch

    return torch.tensor(np.asarray(a, np.float64), dtype=torch.float64)


def vit_logits(P: Mapping, cfg, pixels, lora: Mapping | None = None, lora_scale: float = 0.0):
    """Logits (B, n_classes), torch float64, of ``pixels`` (B, C, H, W) with
    parameters ``P`` (name -> torch tensor); ``lora``: weight name -> (A, B)
    torch tensors."""
    import torch
    import torch.nn.functional as F

    D, H, dh, eps, p = cfg.d_model, cfg.n_head, cfg.head_dim, cfg.norm_eps, cfg.patch_size
    x = _t(pixels) if not isinstance(pixels, torch.Tensor) else pixels
    B = x.shape[0]
    e = F.conv2d(x, P["v.patch_embd.weight"], P["v.patch_embd.bias"], stride=p)  # (B, D, g, g)
    e = e.flatten(2).transpose(1, 2)  # (B, g*g, D), row-major over the grid
    cls = P["v.class_embd"].reshape(1, 1, D).expand(B, 1, D)
    x = torch.cat([cls, e], dim=1) + P["v.position_embd.weight"]  # (B, T, D)

    def lin(name, h):
        y = h @ P[f"{name}.weight"].T + P[f"{name}.bias"]
        if lora and f"{name}.weight" in lora:
            a, b = lora[f"{name}.weight"]
            y = y + lora_scale * ((h @ a.T) @ b.T)
        return y

    def ln(h, name):
        return F.layer_norm(h, (D,), P[f"{name}.weight"], P[f"{name}.bias"], eps)

    for i in range(cfg.n_layer):
        b = f"v.blk.{i}"
        h = ln(x, f"{b}.ln1")
        T = h.shape[1]
        q, k, v = (lin(f"{b}.{n}", h).reshape(B, T, H, dh).transpose(1, 2) for n in ("attn_q", "attn_k", "attn_v"))
        att = torch.softmax(q @ k.transpose(-1, -2) / dh**0.5, dim=-1)  # (B, H, T, T)
        o = (att @ v).transpose(1, 2).reshape(B, T, D)
        x = x + lin(f"{b}.attn_out", o)
        x = x + lin(f"{b}.ffn_down", F.gelu(lin(f"{b}.ffn_up", ln(x, f"{b}.ln2"))))
    return lin("cls", ln(x[:, 0], "v.post_ln"))


def loss_and_grads(
    params: Mapping[str, np.ndarray],
    cfg,
    pixels: np.ndarray,
    labels: np.ndarray,
    mask: np.ndarray | None = None,
    *,
    label_smoothing: float = 0.0,
    lora: Mapping[str, tuple[np.ndarray, np.ndarray]] | None = None,
    lora_scale: float = 0.0,
    trainable=None,
) -> tuple[float, dict[str, np.ndarray]]:
    """(loss, gradients float64) of the mean (smoothed) cross-entropy over
    the rows where ``mask`` > 0 (all when None). Gradients of every name in
    ``trainable`` (default: every parameter, and with ``lora`` every
    ``<W>.lora_a`` / ``<W>.lora_b``)."""
    import torch
    import torch.nn.functional as F

    P = {k: _t(v).requires_grad_(True) for k, v in params.items()}
    L = {w: (_t(a).requires_grad_(True), _t(b).requires_grad_(True)) for w, (a, b) in (lora or {}).items()}
    z = vit_logits(P, cfg, pixels, L, lora_scale)
    y = torch.tensor(np.asarray(labels, np.int64))
    keep = torch.ones(len(y), dtype=torch.bool) if mask is None else torch.tensor(np.asarray(mask) > 0)
    loss = F.cross_entropy(z[keep], y[keep], label_smoothing=label_smoothing)
    leaves = dict(P)
    for w, (a, b) in L.items():
        leaves[f"{w}.lora_a"], leaves[f"{w}.lora_b"] = a, b
    names = list(trainable) if trainable is not None else list(leaves)
    if not names:
        return float(loss.detach()), {}
    gs = torch.autograd.grad(loss, [leaves[n] for n in names], allow_unused=True)
    out = {n: (g.numpy() if g is not None else np.zeros(leaves[n].shape)) for n, g in zip(names, gs)}
    return float(loss.detach()), out


def adamw_step(params, grads, state, *, lr, beta1, beta2, eps, weight_decay, no_decay, max_grad_norm):
    """One ``torch.optim.AdamW`` step (float64); ``state`` None at first,
    then what the previous call returned. Returns (params, state, the
    gradients' global L2 norm before clipping)."""
    import torch

    names = list(params)
    if state is None:
        tp = {n: torch.nn.Parameter(torch.zeros(np.shape(params[n]), dtype=torch.float64)) for n in names}
        groups = [
            {"params": [tp[n] for n in names if n not in no_decay], "weight_decay": float(weight_decay)},
            {"params": [tp[n] for n in names if n in no_decay], "weight_decay": 0.0},
        ]
        opt = torch.optim.AdamW(
            [g for g in groups if g["params"]], lr=lr, betas=(beta1, beta2), eps=eps, foreach=False, fused=False
        )
        state = {"params": tp, "optimizer": opt}
    tp, opt = state["params"], state["optimizer"]
    for g in opt.param_groups:
        g["lr"] = lr
    with torch.no_grad():
        for n in names:
            tp[n].copy_(_t(params[n]))
            tp[n].grad = _t(grads[n])
    if max_grad_norm:
        norm = float(torch.nn.utils.clip_grad_norm_([tp[n] for n in names], max_grad_norm))
    else:
        norm = float(torch.sqrt(sum((tp[n].grad ** 2).sum() for n in names)))
    opt.step()
    return {n: tp[n].detach().numpy().copy() for n in names}, state, norm


def random_params(cfg, seed: int, std: float = 0.2) -> dict[str, np.ndarray]:
    """Float32 parameters for gradient checks: matrices N(0, std²) (scaled
    by 1/sqrt(fan-in) x 4 for the wide ones, so activations stay O(1)), norm
    gains 1 + N(0, 0.1²), shifts and biases N(0, 0.1²): every tensor
    matters and none is at its initial value."""
    from toy_vit.model import params as vit_params

    rng = np.random.default_rng(seed)
    out = {}
    for name, p in vit_params(cfg).items():
        if p.kind == "norm":
            a = 1.0 + 0.1 * rng.standard_normal(p.shape)
        elif p.kind in ("bias", "norm_bias"):
            a = 0.1 * rng.standard_normal(p.shape)
        elif p.kind == "position":
            a = 0.5 * rng.standard_normal(p.shape)
        else:
            fan_in = int(np.prod(p.shape[1:]))
            a = rng.standard_normal(p.shape) * min(std, 1.5 / np.sqrt(fan_in))
        out[name] = a.astype(np.float32)
    return out


def write_shapes_folder(root: Path, *, size: int = 16, per_class: int = 30, seed: int = 0, noise: float = 40.0) -> Path:
    """A small RGB image folder of 3 classes (``horizontal``, ``vertical``,
    ``diagonal`` stripes, random phase and frequency, Gaussian pixel noise),
    ``per_class`` PNGs each: a task a micro ViT learns in a few dozen steps
    and chance is 1/3."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:size, 0:size].astype(np.float64)
    for c, name in enumerate(("horizontal", "vertical", "diagonal")):
        (root / name).mkdir(parents=True, exist_ok=True)
        for i in range(per_class):
            f, ph = rng.uniform(0.7, 1.4), rng.uniform(0, 2 * np.pi)
            u = (y, x, (x + y) / np.sqrt(2))[c]
            base = np.sin(u * f + ph)[..., None] * rng.uniform(40, 90, size=3)
            img = (base + 128 + rng.normal(0, noise, (size, size, 3))).clip(0, 255).astype(np.uint8)
            Image.fromarray(img).save(root / name / f"{i:03d}.png")
    return root


__all__ = ["adamw_step", "loss_and_grads", "random_params", "vit_logits", "write_shapes_folder"]
