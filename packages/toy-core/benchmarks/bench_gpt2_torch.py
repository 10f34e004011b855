"""A plain float32 PyTorch GPT-2, the peer of the GPT-2 training benchmark.

Used by ``test_bench_train.py`` (its torch side, run as a script, so this
folder is on ``sys.path``). Written as PyTorch is normally used, at its
best on a CPU, not as a reference (that is ``toy_testsupport/torch_gpt2.py``, float64
and op by op): ``nn.Embedding`` token and learned position embeddings,
``nn.LayerNorm`` (gain and shift, ``cfg.norm_eps``), one fused QKV
``nn.Linear`` with bias split into Q | K | V thirds (head j owns rows
[j D, (j+1) D) of each third, llama.cpp's ``attn_qkv`` layout),
``F.scaled_dot_product_attention(is_causal=True)`` (scale 1/sqrt(D)), the
output projection with bias, the MLP ``F.gelu(approximate="tanh")``
between two biased ``nn.Linear``, a final LayerNorm and the head: the token
embedding (tied) or a bias-free ``nn.Linear``. A linear weight is
``(d_out, d_in)`` as in GGUF (NumPy order), so toy's starting arrays copy
in unchanged through ``gguf_to_torch_names``.
"""

from __future__ import annotations


def torch_model(cfg):
    """An ``nn.Module`` GPT-2 of ``cfg`` (``toy.models.gpt2.GPT2Config``)."""
    import torch
    import torch.nn.functional as F
    from torch import nn

    H, D, d, eps = cfg.n_head, cfg.head_dim, cfg.d_model, cfg.norm_eps

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln_1 = nn.LayerNorm(d, eps=eps)
            self.qkv = nn.Linear(d, 3 * d)
            self.proj = nn.Linear(d, d)
            self.ln_2 = nn.LayerNorm(d, eps=eps)
            self.up = nn.Linear(d, cfg.d_ff)
            self.down = nn.Linear(cfg.d_ff, d)

        def forward(self, x):
            B, T, _ = x.shape
            q, k, v = (t.view(B, T, H, D).transpose(1, 2) for t in self.qkv(self.ln_1(x)).split(d, dim=-1))
            a = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, H, T, D)
            x = x + self.proj(a.transpose(1, 2).reshape(B, T, d))
            return x + self.down(F.gelu(self.up(self.ln_2(x)), approximate="tanh"))

    class GPT2(nn.Module):
        def __init__(self):
            super().__init__()
            self.wte = nn.Embedding(cfg.n_vocab, d)
            self.wpe = nn.Embedding(cfg.n_ctx_train, d)
            self.blocks = nn.ModuleList(Block() for _ in range(cfg.n_layer))
            self.ln_f = nn.LayerNorm(d, eps=eps)
            self.head = None if cfg.tied_output else nn.Linear(d, cfg.n_vocab, bias=False)
            self.register_buffer("pos", torch.arange(cfg.n_ctx_train), persistent=False)

        def forward(self, tokens):
            x = self.wte(tokens) + self.wpe(self.pos[: tokens.shape[1]])
            for blk in self.blocks:
                x = blk(x)
            x = self.ln_f(x)
            return F.linear(x, self.wte.weight) if self.head is None else self.head(x)

    return GPT2()


def gguf_to_torch_names(cfg) -> dict[str, str]:
    """toy's (GGUF) parameter names -> the torch module's."""
    out = {
        "token_embd.weight": "wte.weight",
        "position_embd.weight": "wpe.weight",
        "output_norm.weight": "ln_f.weight",
        "output_norm.bias": "ln_f.bias",
    }
    if not cfg.tied_output:
        out["output.weight"] = "head.weight"
    per = {"attn_norm": "ln_1", "attn_qkv": "qkv", "attn_output": "proj", "ffn_norm": "ln_2"}
    per |= {"ffn_up": "up", "ffn_down": "down"}
    for i in range(cfg.n_layer):
        for g, t in per.items():
            for leaf in ("weight", "bias"):
                out[f"blk.{i}.{g}.{leaf}"] = f"blocks.{i}.{t}.{leaf}"
    return out


def decayed_names(cfg) -> set[str]:
    """The torch names AdamW decays: toy's rule (``ParamSpec.decays`` with
    the default ``decay_embeddings=False``): matrix and residual weights only."""
    from toy import models

    names = gguf_to_torch_names(cfg)
    return {names[g] for g, p in models.of(cfg).params(cfg).items() if p.kind in ("matrix", "residual")}


__all__ = ["decayed_names", "gguf_to_torch_names", "torch_model"]
