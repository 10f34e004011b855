"""GPT-2 (``general.architecture = gpt2``): config from GGUF and the forward graph.

llama.cpp's layout and graph (``llm_build_gpt2``): learned absolute positions
added to the token embedding; per block LayerNorm (gain and shift), one fused
QKV projection with bias whose output is split into Q, K and V by views, the
attention output projection with bias, LayerNorm, and a GELU MLP
(``ffn_up`` + bias, GELU in its tanh form, ``ffn_down`` + bias); a final
LayerNorm and the head (``output.weight``, or the token embedding when the
file has none: GPT-2 ties them). Every head has its own K and V
(``n_head_kv == n_head``) and ``n_head * head_dim == d_model``; the attention
scale is 1/sqrt(head_dim).

This module is the family's ``ARCH`` in the registry (``toy.models``). Shapes
are NumPy order, activations ``(T, d)``. GELU is ggml's, which on the CPU
reads a float16 table (as llama.cpp does); its backward is toy-ggml patch
0002 and LayerNorm's patch 0001, so the same forward trains.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from toy.errors import ConfigError
from toy.models import LMArchitecture, LoraTarget, ParamInfo, Traits, UnsupportedModelError, validate
from toy.models.card import decoder_card
from toy.models.common import gelu_tanh, head_weight, lora_linear, uint32_counts

_LAYER_TENSORS = (
    "attn_norm.weight",
    "attn_norm.bias",
    "attn_qkv.weight",
    "attn_qkv.bias",
    "attn_output.weight",
    "attn_output.bias",
    "ffn_norm.weight",
    "ffn_norm.bias",
    "ffn_up.weight",
    "ffn_up.bias",
    "ffn_down.weight",
    "ffn_down.bias",
)


@dataclass(frozen=True)
class GPT2Config:
    n_vocab: int
    d_model: int
    n_layer: int
    n_head: int
    d_ff: int
    n_ctx_train: int  # rows of position_embd: the longest sequence the model can take
    norm_eps: float = 1e-5
    tied_output: bool = True
    context_length: int | None = None
    architecture: str = "gpt2"
    # "table": ggml's GELU, which on the CPU reads a float16 table of the
    # function, as llama.cpp's graph does (toy's logits then equal
    # llama.cpp's); "exact": the tanh formula composed from ggml ops in
    # float32, as Hugging Face computes it (``common.gelu_tanh``). Files
    # always load as "table"; set it with dataclasses.replace.
    gelu: str = "table"

    @property
    def n_head_kv(self) -> int:
        return self.n_head

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_head

    @classmethod
    def from_metadata(cls, metadata: Mapping[str, Any], tensors: Mapping[str, Any]) -> GPT2Config:
        a = metadata.get("general.architecture")
        if a != "gpt2":
            raise UnsupportedModelError(f"architecture {a!r} is not gpt2")
        validate.check_counts("gpt2", metadata)  # before any count sizes a loop (toy.models.validate)

        def num(key: str):
            v = metadata.get(f"gpt2.{key}")
            return None if v is None or isinstance(v, (str, bytes)) or hasattr(v, "__len__") else v

        dims = {k: num(k) for k in ("block_count", "embedding_length", "attention.head_count", "context_length")}
        missing = [k for k, v in dims.items() if v is None]
        if missing:
            raise UnsupportedModelError(f"gpt2 metadata lacks {', '.join(f'gpt2.{k}' for k in missing)}")
        n_layer, d, n_head, ctx = (int(dims[k]) for k in dims)
        global_tensors = ("token_embd.weight", "position_embd.weight", "output_norm.weight", "output_norm.bias")
        validate.require("gpt2", global_tensors, tensors)  # before the blocks
        validate.check_blocks("gpt2.block_count", n_layer, tensors)
        if n_head < 1 or d % n_head:
            raise UnsupportedModelError(f"gpt2.embedding_length {d} is not a multiple of head_count {n_head}")
        kv = num("attention.head_count_kv")
        if kv is not None and int(kv) != n_head:
            raise UnsupportedModelError(f"gpt2 with head_count_kv {kv} != head_count {n_head} is not supported")
        need = ["token_embd.weight", "position_embd.weight", "output_norm.weight", "output_norm.bias"]
        need += [f"blk.{i}.{n}" for i in range(n_layer) for n in _LAYER_TENSORS]
        missing_t = [n for n in need if n not in tensors]
        if missing_t:
            more = f" (and {len(missing_t) - 1} more)" if len(missing_t) > 1 else ""
            raise UnsupportedModelError(f"the gpt2 model lacks tensor {missing_t[0]!r}{more}")
        emb = tensors["token_embd.weight"].shape  # NumPy (V, d)
        vocab = num("vocab_size")
        n_pos = int(tensors["position_embd.weight"].shape[0])
        ff = num("feed_forward_length")
        d_ff = int(ff) if ff is not None else int(tensors["blk.0.ffn_up.weight"].shape[0])
        eps = num("attention.layer_norm_epsilon")
        cfg = cls(
            n_vocab=int(vocab) if vocab is not None else int(emb[0]),
            d_model=d,
            n_layer=n_layer,
            n_head=n_head,
            d_ff=d_ff,
            n_ctx_train=n_pos,
            norm_eps=float(eps) if eps is not None else 1e-5,
            tied_output="output.weight" not in tensors,
            context_length=min(ctx, n_pos),
        )
        validate.check_shapes(
            "gpt2", params(cfg), tensors, validate.lm_sources("gpt2", metadata, cfg), validate.LM_AXES
        )
        validate.check_vocab("gpt2", metadata, cfg.n_vocab)
        return cfg

    @classmethod
    def from_gguf(cls, gf) -> GPT2Config:
        return cls.from_metadata(gf.metadata, gf.tensors)


def forward(
    ctx,
    cfg: GPT2Config,
    weights,
    tokens,
    pos,
    attend,
    out_rows=None,
    row_invariant: bool = False,
    head: bool = True,
    lora=None,
    taps=None,
):
    """The GPT-2 forward of T tokens with a pluggable attention (the
    protocol's ``forward``; see ``toy.models``). ``pos`` I32 (T,) indexes
    the learned position embedding, so it must stay below ``n_ctx_train``
    (the engine's context is capped there)."""
    T, H, D, eps = tokens.shape[0], cfg.n_head, cfg.head_dim, cfg.norm_eps
    mm, lin = lora_linear(ctx, weights, lora, row_invariant)

    def norm(x, p: str):
        return ctx.add(ctx.mul(ctx.norm(x, eps), weights[f"{p}.weight"]), weights[f"{p}.bias"])

    def affine(p: str, x):
        return ctx.add(lin(f"{p}.weight", x), weights[f"{p}.bias"])

    x = ctx.add(ctx.get_rows(weights["token_embd.weight"], tokens), ctx.get_rows(weights["position_embd.weight"], pos))
    for i in range(cfg.n_layer):
        p = f"blk.{i}"
        qkv = affine(f"{p}.attn_qkv", norm(x, f"{p}.attn_norm"))  # (T, 3d): Q | K | V
        q, k, v = (_third(ctx, qkv, j, T, H, D) for j in range(3))
        a = attend(i, q, k, v)  # (T, H*D)
        x = ctx.add(x, affine(f"{p}.attn_output", a))
        if out_rows is not None and i == cfg.n_layer - 1:
            x = ctx.get_rows(x, out_rows)  # (N, d): the rows whose logits are wanted
        h = gelu_tanh(ctx, affine(f"{p}.ffn_up", norm(x, f"{p}.ffn_norm")), cfg.gelu)
        x = ctx.add(x, affine(f"{p}.ffn_down", h))
        if taps is not None:
            taps.append(x)  # the residual stream after the block (see toy.models.llama.forward)
    x = final_norm(ctx, cfg, weights, x)
    if not head:
        return x  # (N, d)
    return mm(head_weight(weights, output_weight(cfg)), x)  # (N, V)


def _third(ctx, qkv, j: int, T: int, H: int, D: int):
    """The j-th third of the fused (T, 3 * H * D) projection as (T, H, D),
    made contiguous (the KV cache's writes reshape it)."""
    return ctx.cont(ctx.view(qkv, (T, H, D), strides=(qkv.strides[0], D * 4, 4), offset=j * H * D * 4))


def final_norm(ctx, cfg: GPT2Config, weights, x):
    """The layer norm before the head (``output_norm``) of a residual stream ``x``."""
    return ctx.add(ctx.mul(ctx.norm(x, cfg.norm_eps), weights["output_norm.weight"]), weights["output_norm.bias"])


def output_weight(cfg: GPT2Config) -> str:
    return "token_embd.weight" if cfg.tied_output else "output.weight"


def attention_scale(cfg: GPT2Config, layer: int) -> float:
    return 1.0 / math.sqrt(cfg.head_dim)


def params(cfg: GPT2Config) -> dict[str, ParamInfo]:
    """The trainable tensors, GGUF name -> ``ParamInfo`` (a linear weight is
    (d_out, d_in)), in block order (llama.cpp's converter writes them in
    Hugging Face's sorted key order instead; nothing depends on the order but
    the seeded initialisation)."""
    d, f, V = cfg.d_model, cfg.d_ff, cfg.n_vocab
    out: dict[str, ParamInfo] = {
        "token_embd.weight": ParamInfo((V, d), "embedding"),
        "position_embd.weight": ParamInfo((cfg.n_ctx_train, d), "position"),
    }
    for i in range(cfg.n_layer):
        p = f"blk.{i}"
        out[f"{p}.attn_norm.weight"] = ParamInfo((d,), "norm")
        out[f"{p}.attn_norm.bias"] = ParamInfo((d,), "norm_bias")
        out[f"{p}.attn_qkv.weight"] = ParamInfo((3 * d, d), "matrix")
        out[f"{p}.attn_qkv.bias"] = ParamInfo((3 * d,), "bias")
        out[f"{p}.attn_output.weight"] = ParamInfo((d, d), "residual")
        out[f"{p}.attn_output.bias"] = ParamInfo((d,), "bias")
        out[f"{p}.ffn_norm.weight"] = ParamInfo((d,), "norm")
        out[f"{p}.ffn_norm.bias"] = ParamInfo((d,), "norm_bias")
        out[f"{p}.ffn_up.weight"] = ParamInfo((f, d), "matrix")
        out[f"{p}.ffn_up.bias"] = ParamInfo((f,), "bias")
        out[f"{p}.ffn_down.weight"] = ParamInfo((d, f), "residual")
        out[f"{p}.ffn_down.bias"] = ParamInfo((d,), "bias")
    out["output_norm.weight"] = ParamInfo((d,), "norm")
    out["output_norm.bias"] = ParamInfo((d,), "norm_bias")
    if not cfg.tied_output:
        out["output.weight"] = ParamInfo((V, d), "matrix")
    return out


def lora_targets(cfg: GPT2Config) -> dict[str, LoraTarget]:
    """qkv (the fused projection), o, up, down."""
    d, f = cfg.d_model, cfg.d_ff
    return {
        "qkv": LoraTarget("attn_qkv", "attn_in", d, 3 * d),
        "o": LoraTarget("attn_output", "attn_out", d, d),
        "up": LoraTarget("ffn_up", "ffn_in", d, f),
        "down": LoraTarget("ffn_down", "ffn_mid", f, d),
    }


def metadata(cfg: GPT2Config, name: str) -> dict[str, Any]:
    """The ``gpt2.*`` metadata llama.cpp's converter writes (F32 weights)."""
    a = "gpt2"
    out = {
        "general.architecture": a,
        "general.name": name,
        f"{a}.block_count": cfg.n_layer,
        f"{a}.context_length": int(cfg.context_length or cfg.n_ctx_train),
        f"{a}.embedding_length": cfg.d_model,
        f"{a}.feed_forward_length": cfg.d_ff,
        f"{a}.attention.head_count": cfg.n_head,
        f"{a}.attention.layer_norm_epsilon": float(cfg.norm_eps),
    }
    return uint32_counts(out)


#: ``toy train from-scratch --arch gpt2`` size presets (the vocabulary comes from the tokenizer)
PRESETS: dict[str, dict[str, Any]] = {
    "tiny": dict(d_model=128, n_layer=4, n_head=4, d_ff=512),
    "small": dict(d_model=384, n_layer=6, n_head=6, d_ff=1536),
    "gpt2-124m": dict(d_model=768, n_layer=12, n_head=12, d_ff=3072),
}


def train_config(dims: Mapping[str, Any], n_vocab: int, context: int) -> GPT2Config:
    """The config a from-scratch run trains: as many learned positions as
    the training context, no grouped heads, head size d_model / n_head."""
    if dims["n_head_kv"] != dims["n_head"]:
        msg = f"model.n_head_kv={dims['n_head_kv']}: gpt2 has one K/V head per head (n_head)"
        raise ConfigError(msg, field="model.n_head_kv")
    if dims["head_dim"] * dims["n_head"] != dims["d_model"]:
        msg = f"model.head_dim={dims['head_dim']}: gpt2's head size is d_model / n_head"
        raise ConfigError(msg, field="model.head_dim")
    return GPT2Config(
        n_vocab=n_vocab,
        d_model=dims["d_model"],
        n_layer=dims["n_layer"],
        n_head=dims["n_head"],
        d_ff=dims["d_ff"],
        n_ctx_train=context,
        norm_eps=dims["norm_eps"],
        tied_output=dims["tied_output"],
        context_length=context,
    )


ARCH = LMArchitecture(
    family="gpt2",
    hf="toy.models.gpt2_hf",
    names=("gpt2",),
    presets=PRESETS,
    lora_names=("qkv", "o", "up", "down"),
    lora_default=("qkv", "o"),
    config_from_metadata=GPT2Config.from_metadata,
    forward=forward,
    params=params,
    lora_targets=lora_targets,
    attention_scale=attention_scale,
    output_weight=output_weight,
    final_norm=final_norm,
    metadata=metadata,
    train_config=train_config,
    card=decoder_card,
    # LayerNorm when the file names no epsilon; learned positions come from position_embd.weight itself. The
    # pairing is llama.cpp's rope type for gpt2 (NEOX), which only a file with rope keys would use.
    traits={"gpt2": Traits(norm="layer", rope_pairs="neox")},
)

__all__ = [
    "ARCH",
    "PRESETS",
    "GPT2Config",
    "final_norm",
    "forward",
    "lora_targets",
    "metadata",
    "params",
    "train_config",
]
