"""The llama family (llama, qwen2, qwen3, and their mixture-of-experts
relatives olmoe, qwen2moe, qwen3moe): config from GGUF and the forward graph.

One code path for the whole family. The variants are fields of ``LlamaConfig``,
read from GGUF metadata and tensor names (through ``toy.models.card``'s
parsing): grouped-query attention (``n_head_kv < n_head``), tied or untied
output head, Q/K/V biases (qwen2, qwen2moe), per-head QK RMSNorm (qwen3,
qwen3moe) or QK RMSNorm over the whole projection (olmoe:
``qk_norm_full``), a head size other than ``d_model / n_head``, the RoPE
pairing (``"normal"``: adjacent pairs, which llama GGUF files need because
the converter permutes Q/K rows; ``"neox"``: halves, for the others), and a
routed mixture-of-experts feed-forward instead of the dense one
(``n_expert > 0``: ``toy.models.moe``, with qwen2moe's shared expert and
qwen3moe's renormalised expert weights).

This module is the family's ``ARCH`` in the registry (``toy.models``): the
protocol's config, metadata, forward, parameters, LoRA targets and attention
scale (1/sqrt(head_dim)). Shapes are NumPy order, activations ``(T, d)``;
weights are used as bound (quantized weights stay quantized; on the CPU they
are the file mapping itself).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from toy.models import LMArchitecture, LoraTarget, ParamInfo, Traits, UnsupportedModelError, moe, validate
from toy.models.card import decoder_card, summary_from
from toy.models.common import head_weight, lora_linear, shape_metadata, train_shape_fields, uint32_counts

SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "qwen3", "olmoe", "qwen2moe", "qwen3moe")
MOE_ARCHITECTURES = ("olmoe", "qwen2moe", "qwen3moe")

# what each name fixes that its file does not say, as llama.cpp decides it: RMSNorm and RoPE always; the
# RoPE pairing ("normal" for llama, whose converter permutes Q/K rows; "neox" for the others); olmoe's
# QK-norm over the whole projection and expert width = feed_forward_length; qwen3moe's renormalised
# expert weights. The config, moe.config_fields and the model card (toy.models.card) read it.
_TRAITS = {
    "llama": Traits(norm="rms", rope=True, rope_pairs="normal"),
    "qwen2": Traits(norm="rms", rope=True, rope_pairs="neox"),
    "qwen3": Traits(norm="rms", rope=True, rope_pairs="neox"),
    "olmoe": Traits(norm="rms", rope=True, rope_pairs="neox", qk_norm_full=True, expert_width_is_ff=True),
    "qwen2moe": Traits(norm="rms", rope=True, rope_pairs="neox"),
    "qwen3moe": Traits(norm="rms", rope=True, rope_pairs="neox", expert_weights_norm=True),
}
_ATTN_TENSORS = (
    "attn_norm.weight",
    "attn_q.weight",
    "attn_k.weight",
    "attn_v.weight",
    "attn_output.weight",
    "ffn_norm.weight",
)
_DENSE_FFN_TENSORS = ("ffn_gate.weight", "ffn_up.weight", "ffn_down.weight")


@dataclass(frozen=True)
class LlamaConfig:
    n_vocab: int
    d_model: int
    n_layer: int
    n_head: int
    n_head_kv: int
    head_dim: int
    d_ff: int
    rms_eps: float
    rope_base: float
    rope_dims: int
    rope_mode: str  # "normal" (llama) or "neox" (qwen2, qwen3)
    tied_output: bool
    qkv_bias: bool = False
    qk_norm: bool = False
    context_length: int | None = None
    architecture: str = "llama"
    # RoPE scaling: None, "linear" (positions / factor), "yarn" (YaRN ramp
    # between interpolated and extrapolated frequencies plus a magnitude
    # factor) or "llama3" (per-frequency divisors in the rope_freqs.weight
    # tensor). freq_scale = 1 / factor. attn_factor multiplies cos/sin.
    rope_scaling: str | None = None
    rope_freq_scale: float = 1.0
    rope_orig_ctx: int = 0
    yarn_ext_factor: float = 0.0
    yarn_beta_fast: float = 32.0
    yarn_beta_slow: float = 1.0
    rope_attn_factor: float = 1.0
    # QK-norm over the whole Q and K projections before the head split (olmoe), not per head
    qk_norm_full: bool = False
    # mixture of experts (toy.models.moe): 0 experts is the dense feed-forward
    n_expert: int = 0
    n_expert_used: int = 0
    d_ff_expert: int = 0
    d_ff_shared: int = 0  # qwen2moe's shared expert (0: none)
    expert_weights_norm: bool = False  # renormalise the k experts' probabilities (qwen3moe)

    def rope_args(self) -> dict[str, Any]:
        """Keyword arguments of ``toy_ggml.Context.rope`` for this model
        (the rope_freqs tensor, when there is one, is passed separately)."""
        return dict(
            mode=self.rope_mode,
            freq_base=self.rope_base,
            freq_scale=self.rope_freq_scale,
            n_ctx_orig=self.rope_orig_ctx,
            ext_factor=self.yarn_ext_factor,
            attn_factor=self.rope_attn_factor,
            beta_fast=self.yarn_beta_fast,
            beta_slow=self.yarn_beta_slow,
        )

    @classmethod
    def from_metadata(cls, metadata: Mapping[str, Any], tensors: Mapping[str, Any]) -> LlamaConfig:
        arch = metadata.get("general.architecture")
        if arch not in SUPPORTED_ARCHITECTURES:
            raise UnsupportedModelError(
                f"architecture {arch!r} is not a llama-family model",
                hint=f"supported architectures: {', '.join(SUPPORTED_ARCHITECTURES)}",
            )
        validate.check_counts(arch, metadata)  # before any count sizes a loop (toy.models.validate)
        s = summary_from(metadata, tensors)
        missing_keys = [
            k
            for k, v in (
                ("block_count", s.n_layer),
                ("embedding_length", s.d_model),
                ("attention.head_count", s.n_head),
                ("feed_forward_length", s.d_ff),
            )
            if v is None
        ]
        if missing_keys:
            raise UnsupportedModelError(f"{arch} metadata lacks {', '.join(f'{arch}.{k}' for k in missing_keys)}")
        # summary_from derives the rest from those keys (head_count_kv defaults to head_count, key_length to
        # embedding_length / head_count) and, every llama-family name having rotary positions (_TRAITS), the rope
        assert s.n_layer is not None and s.d_model is not None and s.n_head is not None and s.d_ff is not None
        assert s.n_head_kv is not None and s.head_dim is not None
        validate.require(arch, ("token_embd.weight", "output_norm.weight"), tensors)  # before the blocks
        validate.check_blocks(f"{arch}.block_count", s.n_layer, tensors)
        if s.rope_base is None or s.rope_dims is None:  # summary_from leaves them unset for learned positions
            raise UnsupportedModelError(
                f"the {arch} model carries position_embd.weight (learned positions); llama-family models rotate"
            )
        if s.per_layer:
            raise UnsupportedModelError(
                f"per-layer values of {', '.join(f'{arch}.{k}' for k in s.per_layer)} are not supported"
            )
        rope = _rope_scaling(arch, metadata, s, "rope_freqs.weight" in tensors)
        moe_fields = moe.config_fields(arch, metadata, tensors, s.d_ff, _TRAITS[arch])
        if arch in MOE_ARCHITECTURES and not moe_fields:
            raise UnsupportedModelError(f"the {arch} metadata lacks {arch}.expert_count")
        if s.qkv_fused:
            raise UnsupportedModelError("a fused attn_qkv tensor is not supported (expected attn_q/attn_k/attn_v)")
        if s.head_dim_v not in (None, s.head_dim):
            raise UnsupportedModelError(
                f"{arch}.attention.value_length = {s.head_dim_v} != the key head size {s.head_dim} "
                f"({arch}.attention.key_length) is not supported"
            )
        need = ["token_embd.weight", "output_norm.weight"]
        ffn_names = moe.layer_tensors(_Shared(moe_fields.get("d_ff_shared", 0))) if moe_fields else _DENSE_FFN_TENSORS
        for i in range(s.n_layer):
            need += [f"blk.{i}.{n}" for n in (*_ATTN_TENSORS, *ffn_names)]
            if s.qkv_bias:
                need += [f"blk.{i}.attn_{x}.bias" for x in "qkv"]
            if s.qk_norm:
                need += [f"blk.{i}.attn_q_norm.weight", f"blk.{i}.attn_k_norm.weight"]
        missing = [n for n in need if n not in tensors]
        if missing:
            more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
            raise UnsupportedModelError(f"the {arch} model lacks tensor {missing[0]!r}{more}")
        if s.n_head % s.n_head_kv:
            raise UnsupportedModelError(
                f"{arch}.attention.head_count = {s.n_head} is not a multiple of "
                f"{arch}.attention.head_count_kv = {s.n_head_kv}"
            )
        vocab = s.vocab if s.vocab is not None else int(tensors["token_embd.weight"].shape[0])
        cfg = cls(
            n_vocab=vocab,
            d_model=s.d_model,
            n_layer=s.n_layer,
            n_head=s.n_head,
            n_head_kv=s.n_head_kv,
            head_dim=s.head_dim,
            d_ff=s.d_ff,
            rms_eps=s.norm_eps if s.norm_eps is not None else 1e-5,
            rope_base=s.rope_base,
            rope_dims=s.rope_dims,
            rope_mode=_TRAITS[arch].rope_pairs,
            tied_output=bool(s.tied_output),
            qkv_bias=s.qkv_bias,
            qk_norm=s.qk_norm,
            context_length=s.context_length,
            architecture=arch,
            qk_norm_full=_TRAITS[arch].qk_norm_full,
            **rope,
            **moe_fields,
        )
        validate.check_shapes(arch, params(cfg), tensors, validate.lm_sources(arch, metadata, cfg), validate.LM_AXES)
        validate.check_vocab(arch, metadata, cfg.n_vocab)
        if s.rope_dims % 2 or s.rope_dims > s.head_dim:
            raise UnsupportedModelError(
                f"{arch}.rope.dimension_count = {s.rope_dims}: RoPE rotates pairs of a head's values, so it must be "
                f"even and at most the head size {s.head_dim}"
            )
        return cfg

    @classmethod
    def from_gguf(cls, gf) -> LlamaConfig:
        """The config of an open ``GGUFFile`` (ToyError if it is not a
        supported llama-family model or lacks a tensor)."""
        return cls.from_metadata(gf.metadata, gf.tensors)


class _Shared:
    """What ``moe.layer_tensors`` reads of a config, before there is one."""

    def __init__(self, d_ff_shared: int):
        self.d_ff_shared = d_ff_shared


def _rope_scaling(arch: str, metadata: Mapping[str, Any], s, has_freqs: bool) -> dict[str, Any]:
    """The RoPE scaling fields of LlamaConfig from GGUF metadata, resolved the
    way llama.cpp resolves them: a scaling factor f gives freq_scale = 1/f;
    YaRN defaults to ext_factor 1, beta_fast 32, beta_slow 1 and the training
    context as the original context; the magnitude factor handed to ggml is
    the file's ``rope.scaling.attn_factor`` (ggml itself multiplies by
    1 + 0.1 ln f under YaRN)."""

    def num(key: str, default: float) -> float:
        v = metadata.get(f"{arch}.rope.scaling.{key}")
        return float(v) if v is not None else default

    kind = s.rope_scaling if s.rope_scaling not in (None, "none") else None
    out: dict[str, Any] = {"rope_attn_factor": num("attn_factor", 1.0)}
    if kind not in (None, "linear", "yarn"):
        raise UnsupportedModelError(
            f"rope scaling {kind!r} is not supported",
            hint="supported: none, linear, yarn, and llama3 frequency factors (rope_freqs.weight)",
        )
    if kind is not None:
        factor = s.rope_scaling_factor or 1.0
        if not factor > 0:
            raise UnsupportedModelError(f"{arch}.rope.scaling.factor={factor} must be > 0")
        out.update(rope_scaling=kind, rope_freq_scale=1.0 / factor)
    if kind == "yarn":
        if num("yarn_log_multiplier", 0.0) != 0.0:
            raise UnsupportedModelError("YaRN with rope.scaling.yarn_log_multiplier is not supported")
        out.update(
            yarn_ext_factor=num("yarn_ext_factor", 1.0),
            yarn_beta_fast=num("yarn_beta_fast", 32.0),
            yarn_beta_slow=num("yarn_beta_slow", 1.0),
        )
    out["rope_orig_ctx"] = int(s.rope_orig_context or s.context_length or 0)
    if has_freqs:
        if kind is not None:
            raise UnsupportedModelError(f"rope_freqs.weight together with {kind} rope scaling is not supported")
        out["rope_scaling"] = "llama3"
    return out


def forward(
    ctx,
    cfg: LlamaConfig,
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
    """The llama-family forward of T tokens with a pluggable attention.

    ``tokens``/``pos`` I32 (T,); ``attend(layer, q, k, v)`` gets Q (T, H, D)
    and K, V (T, H_kv, D) (Q and K already roped) and returns the attention
    output (T, H * D) before the output projection (``toy.models.common``'s
    full-sequence and batched attention, or the KV-cache attention of
    ``toy.engine.llm``). ``out_rows`` (I32 (N,), optional) keeps only those
    rows after the last attention block, so the last FFN and the head run
    on N rows. ``row_invariant`` makes every weight product sum a row
    exactly as a one-row product would (``Context.mul_mat``), so a token's
    result does not depend on the tokens batched with it. Returns logits
    (N or T, V), or with ``head=False`` the final normed hidden states.

    ``lora`` (optional) maps a weight's GGUF name (``blk.{i}.attn_q.weight``
    …; the attention and feed-forward projections) to LoRA terms
    ``(a, b, scale, drop)``: the product with that weight becomes
    ``W x + Σ scale · B (A (x ⊙ drop))`` with A (r, in), B (out, r) and
    ``drop`` None or an F32 (T, in) dropout mask already scaled by 1/(1-p)
    — llama.cpp's ``build_lora_mm`` for inference, the trainable path of
    ``toy.train.lora``.

    ``taps`` (a list, optional) receives the residual stream after each
    block, (T, d) (N rows after the last block with ``out_rows``), before
    the final norm: the logit lens, CKA and the activation diagnostics read
    them (``final_norm`` and the head turn one into logits).
    """
    T, H, Hkv, D, eps = tokens.shape[0], cfg.n_head, cfg.n_head_kv, cfg.head_dim, cfg.rms_eps
    rope_args = cfg.rope_args()
    freqs = weights["rope_freqs.weight"] if cfg.rope_scaling == "llama3" else None
    mm, lin = lora_linear(ctx, weights, lora, row_invariant)

    def norm(x, gamma):
        return ctx.mul(ctx.rms_norm(x, eps), gamma)

    def proj(x, p: str, which: str, heads: int):
        y = lin(f"{p}.attn_{which}.weight", x)
        if cfg.qkv_bias:
            y = ctx.add(y, weights[f"{p}.attn_{which}.bias"])
        if cfg.qk_norm and cfg.qk_norm_full and which in "qk":  # olmoe: over the whole projection
            y = norm(y, weights[f"{p}.attn_{which}_norm.weight"])
        y = ctx.reshape(y, (T, heads, D))
        if cfg.qk_norm and not cfg.qk_norm_full and which in "qk":
            y = norm(y, weights[f"{p}.attn_{which}_norm.weight"])
        if which in "qk":
            y = ctx.rope(y, pos, cfg.rope_dims, freq_factors=freqs, **rope_args)
        return y

    x = ctx.get_rows(weights["token_embd.weight"], tokens)  # (T, d)
    for i in range(cfg.n_layer):
        p = f"blk.{i}"
        h = norm(x, weights[f"{p}.attn_norm.weight"])
        a = attend(i, proj(h, p, "q", H), proj(h, p, "k", Hkv), proj(h, p, "v", Hkv))  # (T, H*D)
        x = ctx.add(x, lin(f"{p}.attn_output.weight", a))
        if out_rows is not None and i == cfg.n_layer - 1:
            x = ctx.get_rows(x, out_rows)  # (N, d): the rows whose logits are wanted
        h = norm(x, weights[f"{p}.ffn_norm.weight"])
        if cfg.n_expert:
            x = ctx.add(x, moe.ffn(ctx, cfg, weights, lin, p, h, row_invariant, lora))
            if taps is not None:
                taps.append(x)
            continue
        g = ctx.swiglu(lin(f"{p}.ffn_gate.weight", h), lin(f"{p}.ffn_up.weight", h))
        x = ctx.add(x, lin(f"{p}.ffn_down.weight", g))
        if taps is not None:
            taps.append(x)
    x = final_norm(ctx, cfg, weights, x)
    if not head:
        return x  # (N, d)
    return mm(head_weight(weights, output_weight(cfg)), x)  # (N, V)


def final_norm(ctx, cfg: LlamaConfig, weights, x):
    """The norm before the head (``output_norm``) of a residual stream ``x``."""
    return ctx.mul(ctx.rms_norm(x, cfg.rms_eps), weights["output_norm.weight"])


def output_weight(cfg: LlamaConfig) -> str:
    return "token_embd.weight" if cfg.tied_output else "output.weight"


def attention_scale(cfg: LlamaConfig, layer: int) -> float:
    """1/sqrt(head_dim) in float32 arithmetic, as llama.cpp computes it
    (``1.0f/sqrtf(float(n_embd_head))``): for some head sizes (24, 72, 96,
    112) the double-precision value rounds to a float32 one ulp away from
    llama.cpp's, and the softmax of Q·K then differs in the last bits."""
    import numpy as np  # lazy: the registry (and `toy train --help`) loads this module without numpy

    return float(np.float32(1.0) / np.sqrt(np.float32(cfg.head_dim)))


def params(cfg: LlamaConfig) -> dict[str, ParamInfo]:
    """The trainable tensors of a model of this config: GGUF name ->
    ``ParamInfo`` (a linear weight is (d_out, d_in)), in the order llama.cpp's
    converter writes them. RoPE frequency factors are not trainable. The two
    projections that write into the residual stream are ``residual``."""
    H, Hkv, D, d = cfg.n_head, cfg.n_head_kv, cfg.head_dim, cfg.d_model
    out: dict[str, ParamInfo] = {"token_embd.weight": ParamInfo((cfg.n_vocab, d), "embedding")}
    for i in range(cfg.n_layer):
        p = f"blk.{i}"
        out[f"{p}.attn_norm.weight"] = ParamInfo((d,), "norm")
        for x, n in (("q", H), ("k", Hkv), ("v", Hkv)):
            out[f"{p}.attn_{x}.weight"] = ParamInfo((n * D, d), "matrix")
            if cfg.qkv_bias:
                out[f"{p}.attn_{x}.bias"] = ParamInfo((n * D,), "bias")
        if cfg.qk_norm:
            out[f"{p}.attn_q_norm.weight"] = ParamInfo((H * D if cfg.qk_norm_full else D,), "norm")
            out[f"{p}.attn_k_norm.weight"] = ParamInfo((Hkv * D if cfg.qk_norm_full else D,), "norm")
        out[f"{p}.attn_output.weight"] = ParamInfo((d, H * D), "residual")
        out[f"{p}.ffn_norm.weight"] = ParamInfo((d,), "norm")
        if cfg.n_expert:
            out.update(moe.params(cfg, p))
            continue
        out[f"{p}.ffn_gate.weight"] = ParamInfo((cfg.d_ff, d), "matrix")
        out[f"{p}.ffn_up.weight"] = ParamInfo((cfg.d_ff, d), "matrix")
        out[f"{p}.ffn_down.weight"] = ParamInfo((d, cfg.d_ff), "residual")
    out["output_norm.weight"] = ParamInfo((d,), "norm")
    if not cfg.tied_output:
        out["output.weight"] = ParamInfo((cfg.n_vocab, d), "matrix")
    return out


def lora_targets(cfg: LlamaConfig) -> dict[str, LoraTarget]:
    """q, k, v, o on attention; gate, up, down on a dense feed-forward, or
    ``router`` (``ffn_gate_inp``) on a mixture of experts, whose experts
    (3-D tensors) take no trained adapter (an imported one's 3-D pairs are
    applied at inference: ``toy.models.moe.ffn``)."""
    H, Hkv, D, d, f = cfg.n_head, cfg.n_head_kv, cfg.head_dim, cfg.d_model, cfg.d_ff
    out = {
        "q": LoraTarget("attn_q", "attn_in", d, H * D),
        "k": LoraTarget("attn_k", "attn_in", d, Hkv * D),
        "v": LoraTarget("attn_v", "attn_in", d, Hkv * D),
        "o": LoraTarget("attn_output", "attn_out", H * D, d),
    }
    if cfg.n_expert:
        out["router"] = LoraTarget("ffn_gate_inp", "ffn_in", d, cfg.n_expert)
        return out
    out["gate"] = LoraTarget("ffn_gate", "ffn_in", d, f)
    out["up"] = LoraTarget("ffn_up", "ffn_in", d, f)
    out["down"] = LoraTarget("ffn_down", "ffn_mid", f, d)
    return out


def metadata(cfg: LlamaConfig, name: str) -> dict[str, Any]:
    """The llama.cpp metadata of a llama model of this config (F32 weights):
    key -> value, or (value, TypeInfo) where llama.cpp insists on a type
    (it refuses a file whose counts are INT32 instead of UINT32). A
    checkpoint is always written as ``llama`` (qwen2/qwen3 variants are not
    trained from scratch)."""
    a = "llama"
    out = {
        "general.architecture": a,
        "general.name": name,
        f"{a}.vocab_size": cfg.n_vocab,
        **shape_metadata(a, cfg, 2048),
        f"{a}.rope.dimension_count": cfg.rope_dims,
        f"{a}.rope.freq_base": float(cfg.rope_base),
        f"{a}.attention.layer_norm_rms_epsilon": float(cfg.rms_eps),
    }
    return uint32_counts(out)


#: ``toy train from-scratch`` size presets (the vocabulary comes from the tokenizer)
PRESETS: dict[str, dict[str, Any]] = {
    "tiny": dict(d_model=128, n_layer=4, n_head=4, n_head_kv=2, d_ff=352, rope_base=10000.0),
    "small": dict(d_model=384, n_layer=6, n_head=6, n_head_kv=2, d_ff=1024, rope_base=10000.0),
    "smollm2-135m": dict(d_model=576, n_layer=30, n_head=9, n_head_kv=3, d_ff=1536, rope_base=100000.0),
}


def train_config(d: Mapping[str, Any], n_vocab: int, context: int) -> LlamaConfig:
    """The config a from-scratch run trains (``d``: ``resolve_shape``'s
    dimensions): RoPE over the whole head in llama's "normal" pairing (what
    llama.cpp runs for ``general.architecture = llama``), the context length
    = the training context."""
    return LlamaConfig(
        **train_shape_fields(d, n_vocab),
        rope_dims=d["head_dim"],
        rope_mode="normal",
        context_length=context,
    )


ARCH = LMArchitecture(
    family="llama",
    hf="toy.models.llama_hf",
    names=SUPPORTED_ARCHITECTURES,
    presets=PRESETS,
    lora_names=("q", "k", "v", "o", "gate", "up", "down", "router"),
    lora_default=("q", "k", "v", "o"),
    config_from_metadata=LlamaConfig.from_metadata,
    forward=forward,
    params=params,
    lora_targets=lora_targets,
    attention_scale=attention_scale,
    output_weight=output_weight,
    final_norm=final_norm,
    metadata=metadata,
    train_config=train_config,
    card=decoder_card,
    traits=_TRAITS,
)

__all__ = [
    "ARCH",
    "PRESETS",
    "SUPPORTED_ARCHITECTURES",
    "LlamaConfig",
    "attention_scale",
    "final_norm",
    "forward",
    "lora_targets",
    "metadata",
    "output_weight",
    "params",
    "train_config",
]
