"""Model cards: what a GGUF model is, and its forward pass as pseudocode.

``summarize(gguf_file)`` (or ``summary_from(metadata, tensors)``) reads the
config from GGUF metadata and tensor names into a ``ModelSummary``: dims,
context, rope, norms, the variants (tied head, QKV bias, QK-norm, GQA), weight
types, parameter count, tokenizer. It never touches tensor data.

``algorithm_card(summary)`` writes the forward pass in the style of Phuong &
Hutter, "Formal Algorithms for Transformers" (2022): numbered lines with the
model's real shapes. Row convention: activations are ``X ∈ ℝ^{T×d}`` and a
linear map is ``X·W`` with ``W ∈ ℝ^{d_in×d_out}`` (GGUF stores ``W`` with
ggml ``ne = [d_in, d_out]``, i.e. NumPy shape ``(d_out, d_in)``).

This module keeps no table of families: it asks the registry
(``toy.models.get``) for the file's ``ARCH``, built in or added by another
distribution (entry-point group ``toy.architectures``, e.g. toy-vit's
``vit``), and reads its members (``toy.models.protocol``):

- ``traits[name]`` (a ``Traits``): what the name fixes that the file does
  not say: the norm and positions of a file without their keys, the RoPE
  pairing, olmoe's QK-norm span and expert width, qwen3moe's renormalised
  expert weights;
- ``summary(metadata, tensors)``: fills ``ModelSummary.extra`` (JSON-able
  facts); ``describe_rows(extra)``: ``extra_rows``' ``(label, text)`` lines;
- ``card(summary)``: the algorithm card. The llama and gpt2 families use
  ``decoder_card`` (RoPE or learned positions, RMSNorm or LayerNorm, SwiGLU,
  GELU or routed experts), Gemma and toy-vit write their own; a name
  without one (or unknown) gets the generic fields only.

An architecture with ``language_model = False`` gets ``language_model =
False`` in its summary and no LM-only fields (vocabulary, head tying), so
``toy describe`` leaves those rows out.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from toy import models
from toy.models.protocol import Architecture, Traits


@dataclass
class ModelSummary:
    architecture: str | None
    name: str | None = None
    n_layer: int | None = None
    d_model: int | None = None
    n_head: int | None = None
    n_head_kv: int | None = None
    head_dim: int | None = None
    head_dim_v: int | None = None
    d_ff: int | None = None
    vocab: int | None = None
    context_length: int | None = None
    rope_base: float | None = None
    rope_dims: int | None = None
    rope_scaling: str | None = None  # None, "linear", "yarn", ...
    rope_scaling_factor: float | None = None
    rope_orig_context: int | None = None
    norm: str | None = None  # "rms" or "layer"
    norm_eps: float | None = None
    positions: str | None = None  # "rope", "learned" or None
    mlp: str | None = None  # "swiglu", "gelu", "geglu" (a family's own summary says) or None
    tied_output: bool | None = None
    qkv_bias: bool = False
    qkv_fused: bool = False
    qk_norm: bool = False
    biases: bool = False  # output/MLP/norm biases (gpt2 style)
    n_params: int = 0
    n_tensors: int = 0
    file_type: int | None = None
    weight_types: dict[str, int] = field(default_factory=dict)  # type -> tensor count
    weight_params: dict[str, int] = field(default_factory=dict)  # type -> elements
    tokenizer_model: str | None = None
    tokenizer_pre: str | None = None
    chat_template: bool = False
    per_layer: dict[str, list[int]] = field(default_factory=dict)  # keys whose value varies by layer
    # a mixture of experts (0 experts: a dense feed-forward)
    n_expert: int = 0
    n_expert_used: int = 0
    d_ff_expert: int | None = None
    d_ff_shared: int | None = None
    expert_weights_norm: bool = False
    expert_types: dict[str, int] = field(default_factory=dict)  # weight type of the expert tensors -> count
    language_model: bool = True  # False for a plugin architecture that is not one (no vocab, tokenizer…)
    extra: dict[str, Any] = field(default_factory=dict)  # a plugin architecture's own facts

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _scalar(v: Any) -> Any:
    """A metadata value as a Python scalar (per-layer arrays: the first)."""
    if v is None or isinstance(v, (bool, int, float, str)):
        return v
    if hasattr(v, "item") and getattr(v, "ndim", 1) == 0:  # a NumPy scalar
        return v.item()
    try:
        items = list(v)
    except TypeError:
        return v
    return _scalar(items[0]) if items else None


def _int(v: Any) -> int | None:
    v = _scalar(v)
    if isinstance(v, float) and not math.isfinite(v):
        return None  # NaN or infinity is no count (the config readers refuse it, naming the key)
    return int(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None


def _float(v: Any) -> float | None:
    v = _scalar(v)
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None


def _arch(name: str | None) -> Architecture | None:
    """The registry's ``ARCH`` for a ``general.architecture`` value, or None
    (none, unknown, refused, or a plugin that does not load)."""
    if not name:
        return None
    try:
        return models.get(name)
    except models.UnsupportedModelError:
        return None


def _traits(arch: Architecture | None, name: str | None) -> Traits:
    """What ``name`` fixes that its file does not say (``ARCH.traits``;
    nothing for an unknown name)."""
    traits: Mapping[str, Traits] = getattr(arch, "traits", None) or {}
    return traits.get(name or "", Traits())


def summary_from(metadata: Mapping[str, Any], tensors: Mapping[str, Any]) -> ModelSummary:
    """Build a summary from GGUF metadata and ``{name: TensorInfo}``."""
    arch = metadata.get("general.architecture")
    arch = arch if isinstance(arch, str) else None

    def get(suffix: str) -> Any:
        return metadata.get(f"{arch}.{suffix}") if arch else None

    registered = _arch(arch)  # its ARCH in the registry, or None
    traits = _traits(registered, arch)
    s = ModelSummary(architecture=arch)
    name = metadata.get("general.name")
    s.name = name if isinstance(name, str) else None
    s.n_layer = _int(get("block_count"))
    s.d_model = _int(get("embedding_length"))
    s.n_head = _int(get("attention.head_count"))
    s.n_head_kv = _int(get("attention.head_count_kv")) or s.n_head
    s.d_ff = _int(get("feed_forward_length"))
    for key in ("attention.head_count", "attention.head_count_kv", "feed_forward_length"):
        v = get(key)
        if v is not None and not isinstance(v, (int, float, str)):
            vals = [int(x) for x in v]
            if len(set(vals)) > 1:
                s.per_layer[key] = vals
    s.head_dim = _int(get("attention.key_length"))
    if s.head_dim is None and s.d_model and s.n_head:
        s.head_dim = s.d_model // s.n_head
    s.head_dim_v = _int(get("attention.value_length")) or s.head_dim
    s.context_length = _int(get("context_length"))

    s.vocab = _int(get("vocab_size"))
    tokens = metadata.get("tokenizer.ggml.tokens")
    if s.vocab is None and tokens is not None and not isinstance(tokens, str) and hasattr(tokens, "__len__"):
        s.vocab = len(tokens)  # a list or the reader's lazy StringArray
    if s.vocab is None and "token_embd.weight" in tensors:
        s.vocab = int(tensors["token_embd.weight"].shape[0])

    # norms: the key present decides; the architecture's traits when neither is
    rms, ln = _float(get("attention.layer_norm_rms_epsilon")), _float(get("attention.layer_norm_epsilon"))
    if rms is not None:
        s.norm, s.norm_eps = "rms", rms
    elif ln is not None:
        s.norm, s.norm_eps = "layer", ln
    else:
        s.norm = traits.norm

    has = tensors.__contains__
    if has("position_embd.weight"):
        s.positions = "learned"
    elif traits.rope or get("rope.freq_base") is not None or get("rope.dimension_count") is not None:
        s.positions = "rope"
    if s.positions == "rope":
        s.rope_base = _float(get("rope.freq_base")) or 10000.0  # llama.cpp's default
        s.rope_dims = _int(get("rope.dimension_count")) or s.head_dim
        stype = get("rope.scaling.type")
        if isinstance(stype, str) and stype not in ("none", ""):
            s.rope_scaling = stype
            s.rope_scaling_factor = _float(get("rope.scaling.factor"))
            s.rope_orig_context = _int(get("rope.scaling.original_context_length"))
        elif get("rope.scale_linear") is not None:  # older files
            s.rope_scaling, s.rope_scaling_factor = "linear", _float(get("rope.scale_linear"))

    if has("blk.0.ffn_gate.weight"):
        s.mlp = "swiglu"
    elif has("blk.0.ffn_up.weight"):
        s.mlp = "gelu"  # an up/down MLP without a gate
    s.n_expert = _int(get("expert_count")) or 0
    if s.n_expert:
        s.mlp = "moe"  # routed SwiGLU experts
        s.n_expert_used = _int(get("expert_used_count")) or 0
        if traits.expert_width_is_ff:
            s.d_ff_expert = s.d_ff
        else:
            s.d_ff_expert = _int(get("expert_feed_forward_length")) or (
                s.d_ff // s.n_expert_used if s.d_ff and s.n_expert_used else None
            )
        if has("blk.0.ffn_up_shexp.weight"):
            s.d_ff_shared = _int(get("expert_shared_feed_forward_length")) or s.d_ff
        s.expert_weights_norm = traits.expert_weights_norm  # llama.cpp's graphs: fixed per architecture
        for n, t in tensors.items():
            if n.endswith("_exps.weight"):
                s.expert_types[t.dtype.name] = s.expert_types.get(t.dtype.name, 0) + 1
    s.qkv_fused = has("blk.0.attn_qkv.weight")
    s.qkv_bias = has("blk.0.attn_q.bias") or has("blk.0.attn_qkv.bias")
    s.qk_norm = has("blk.0.attn_q_norm.weight")
    s.biases = has("blk.0.attn_output.bias") or has("blk.0.ffn_up.bias") or has("blk.0.attn_norm.bias")
    if tensors:
        s.tied_output = not has("output.weight")

    s.n_tensors = len(tensors)
    for t in tensors.values():
        size = 1
        for d in t.shape:
            size *= int(d)
        s.n_params += size
        tname = t.dtype.name
        s.weight_types[tname] = s.weight_types.get(tname, 0) + 1
        s.weight_params[tname] = s.weight_params.get(tname, 0) + size
    s.weight_types = dict(sorted(s.weight_types.items(), key=lambda kv: -s.weight_params[kv[0]]))
    s.weight_params = {k: s.weight_params[k] for k in s.weight_types}
    ft = metadata.get("general.file_type")
    s.file_type = ft if isinstance(ft, int) and not isinstance(ft, bool) else None

    tm, tp = metadata.get("tokenizer.ggml.model"), metadata.get("tokenizer.ggml.pre")
    s.tokenizer_model = tm if isinstance(tm, str) else None
    s.tokenizer_pre = tp if isinstance(tp, str) else None
    s.chat_template = any(k == "tokenizer.chat_template" or k.startswith("tokenizer.chat_template.") for k in metadata)
    if registered is not None:
        if not getattr(registered, "language_model", True):
            s.language_model, s.tied_output, s.vocab = False, None, None
        own = getattr(registered, "summary", None)
        if own is not None:
            s.extra = dict(own(metadata, tensors))
            s.mlp = s.extra.pop("mlp", s.mlp)  # a family may name its feed-forward (Gemma: "geglu")
    return s


def extra_rows(s: ModelSummary) -> list[tuple[str, str]]:
    """``(label, text)`` rows of an architecture's ``extra`` facts for
    ``toy describe`` (its ``describe_rows``; none without a ``summary``)."""
    registered = _arch(s.architecture) if s.extra else None
    rows = getattr(registered, "describe_rows", None)
    if rows is None:
        return [(k, str(v)) for k, v in s.extra.items()]
    return list(rows(s.extra))


def summarize(gf) -> ModelSummary:
    """The summary of an open ``GGUFFile``."""
    return summary_from(gf.metadata, gf.tensors)


# -- the algorithm card


def _num(x: float | None) -> str:
    if x is None:
        return "?"
    if float(x).is_integer() and abs(x) < 1e15:
        return str(int(x))
    return f"{x:.6g}"


def _d(v: int | None) -> str:
    return "?" if v is None else str(v)


class _Lines:
    """Numbered pseudocode lines with right-hand ▷ comments."""

    def __init__(self) -> None:
        self.rows: list[tuple[str, str]] = []

    def add(self, code: str, note: str = "") -> None:
        self.rows.append((code, note))

    def render(self) -> list[str]:
        width = max((len(c) for c, _ in self.rows), default=0)
        digits = len(str(len(self.rows)))
        out = []
        for i, (code, note) in enumerate(self.rows, 1):
            line = f"{i:>{digits}}: {code}"
            if note:
                line = f"{i:>{digits}}: {code:<{width}}  ▷ {note}"
            out.append(line.rstrip())
        return out


def _rope_text(s: ModelSummary, traits: Traits) -> str:
    style = "NeoX pairs (i, i+n/2)" if traits.rope_pairs == "neox" else "pairs (2i, 2i+1)"
    dims = f"{_d(s.rope_dims)} of {_d(s.head_dim)} dims" if s.rope_dims != s.head_dim else f"all {_d(s.head_dim)} dims"
    text = f"θ_i = {_num(s.rope_base)}^(−2i/{_d(s.rope_dims)}), {dims}, {style}"
    if s.rope_scaling:
        extra = f", original context {s.rope_orig_context}" if s.rope_orig_context else ""
        text += f"; {s.rope_scaling} scaling ×{_num(s.rope_scaling_factor)}{extra}"
    else:
        text += "; no scaling"
    return text


def _norm(s: ModelSummary, gamma: str, beta: str) -> str:
    eps = f"ε = {_num(s.norm_eps)}" if s.norm_eps is not None else "ε"
    if s.norm == "layer":
        b = f", {beta}" if s.biases else ""
        return f"LayerNorm(X | {gamma}{b}), {eps}"
    return f"RMSNorm(X | {gamma}), {eps}"


def algorithm_card(s: ModelSummary) -> str:
    """The forward pass of the model as numbered pseudocode with real shapes:
    its architecture's ``card`` (see the module docstring)."""
    write = getattr(_arch(s.architecture), "card", None)
    if write is not None:
        return str(write(s))
    with_cards = sorted(n for n in models.registered() if getattr(models.get(n), "card", None) is not None)
    return (
        f"(no algorithm card: toy writes cards for {', '.join(with_cards)}, and this model is "
        f"{s.architecture or '?'!r}; the fields above are read from its metadata)"
    )


def decoder_card(s: ModelSummary) -> str:
    """The algorithm card of a decoder-only transformer in the llama or gpt2
    style, from the summary and the architecture's ``traits`` (the RoPE
    pairing, olmoe's QK-norm span): the ``card`` of those families."""
    arch = s.architecture or "?"
    traits = _traits(_arch(s.architecture), s.architecture)
    if s.n_layer is None or s.d_model is None or s.n_head is None:
        return f"(no algorithm card: the {arch} metadata lacks block_count, embedding_length or attention.head_count)"
    L, d, H, Hkv, dh, dff, V = s.n_layer, s.d_model, s.n_head, s.n_head_kv or s.n_head, s.head_dim, s.d_ff, s.vocab
    dv = s.head_dim_v or dh
    T = f"T ≤ {s.context_length}" if s.context_length else "T"
    title = f" — {s.name}" if s.name else ""
    head = [
        f"Algorithm: P ← {arch}(x | θ), the forward pass of a decoder-only transformer{title}",
        f"Input:  x ∈ [V]^T, token ids, {T}",
        "Output: P ∈ (0,1)^{T×V}, P[t, :] = p(x[t+1] | x[1:t])",
        f"Hyperparameters: L = {L} layers, d = {d}, d_ff = {_d(dff)}, V = {_d(V)}",
    ]
    if Hkv != H:
        share = f", {H // Hkv} query heads share each" if H % Hkv == 0 else ""
        head.append(
            f"Attention: H = {H} query heads, H_kv = {Hkv} key/value heads (grouped-query{share}), d_h = {_d(dh)}"
        )
    else:
        head.append(f"Attention: H = {H} heads, d_h = {_d(dh)}")
    lines = _Lines()
    fused = s.qkv_fused
    if s.positions == "learned":
        lines.add(
            "X ← W_e[x, :] + W_p[0:T, :]", f"X ∈ ℝ^{{T×{d}}}; learned positions W_p ∈ ℝ^{{{s.context_length}×{d}}}"
        )
    else:
        lines.add("X ← W_e[x, :]", f"X ∈ ℝ^{{T×{d}}}, W_e ∈ ℝ^{{{_d(V)}×{d}}}")
    lines.add(f"for l = 1, …, {L} do")
    lines.add("  Y ← " + _norm(s, "γ_1[l]", "β_1[l]"), f"Y ∈ ℝ^{{T×{d}}}")
    b = " + b" if s.qkv_bias else ""
    if fused:
        lines.add(
            f"  [Q, K, V] ← Y·W_qkv[l]{' + b_qkv[l]' if s.qkv_bias else ''}",
            f"W_qkv ∈ ℝ^{{{d}×{H * (dh or 0) + 2 * Hkv * (dh or 0)}}}; Q ∈ ℝ^{{T×{H}×{dh}}}, K, V ∈ ℝ^{{T×{Hkv}×{dh}}}",
        )
    else:
        lines.add(
            f"  Q ← Y·W_q[l]{b and ' + b_q[l]'};  K ← Y·W_k[l]{b and ' + b_k[l]'};  V ← Y·W_v[l]{b and ' + b_v[l]'}",
            f"Q ∈ ℝ^{{T×{H}×{dh}}}, K ∈ ℝ^{{T×{Hkv}×{dh}}}, V ∈ ℝ^{{T×{Hkv}×{dv}}}",
        )
    if s.qk_norm:
        eps = f", ε = {_num(s.norm_eps)}" if s.norm_eps is not None else ""
        where = (
            "over the whole projection, before the head split (QK-norm)"
            if traits.qk_norm_full
            else (f"per head, over d_h = {dh} (QK-norm)")
        )
        lines.add("  Q ← RMSNorm(Q | γ_q[l]);  K ← RMSNorm(K | γ_k[l])" + eps, where)
    if s.positions == "rope":
        lines.add("  Q, K ← RoPE(Q, K; positions 0, …, T−1)", _rope_text(s, traits))
    if Hkv != H and H % Hkv == 0:
        grp = H // Hkv
        attn = f"  for h = 1, …, {H}: g ← ⌈h/{grp}⌉;  A_h ← softmax(Q_h·K_gᵀ / √{dh} + M)·V_g"
    else:
        attn = f"  for h = 1, …, {H}: A_h ← softmax(Q_h·K_hᵀ / √{dh} + M)·V_h"
    lines.add(attn, f"M[t, t′] = 0 if t′ ≤ t else −∞ (causal); A_h ∈ ℝ^{{T×{dv}}}")
    bo = " + b_o[l]" if s.biases else ""
    lines.add(f"  X ← X + [A_1, …, A_{H}]·W_o[l]{bo}", f"W_o ∈ ℝ^{{{H * (dv or 0)}×{d}}}; residual")
    lines.add("  Y ← " + _norm(s, "γ_2[l]", "β_2[l]"))
    if s.mlp == "moe":
        E, k, F = s.n_expert, s.n_expert_used, _d(s.d_ff_expert)
        lines.add("  p ← softmax(Y·W_r[l])", f"router W_r ∈ ℝ^{{{d}×{E}}}; p ∈ (0,1)^{{T×{E}}}")
        norm_w = ", renormalised to sum 1" if s.expert_weights_norm else ""
        lines.add(f"  S_t ← the {k} largest p[t, :], w_t ← p[t, S_t]{norm_w}", f"top-{k} of {E} experts per token")
        lines.add(
            "  X_t ← X_t + Σ_{e∈S_t} w_t[e]·(SiLU(Y_t·W_gate[l,e]) ⊙ Y_t·W_up[l,e])·W_down[l,e]",
            f"SwiGLU experts: W_gate, W_up ∈ ℝ^{{{E}×{d}×{F}}}, W_down ∈ ℝ^{{{E}×{F}×{d}}}",
        )
        if s.d_ff_shared:
            lines.add(
                "  X ← X + σ(Y·w_s[l]) ⊙ (SiLU(Y·S_gate[l]) ⊙ Y·S_up[l])·S_down[l]",
                f"shared expert of width {s.d_ff_shared}, gated by σ",
            )
    elif s.mlp == "gelu":
        bu, bd = (" + b_up[l]", " + b_down[l]") if s.biases else ("", "")
        lines.add(
            f"  X ← X + GELU(Y·W_up[l]{bu})·W_down[l]{bd}",
            f"W_up ∈ ℝ^{{{d}×{_d(dff)}}}, W_down ∈ ℝ^{{{_d(dff)}×{d}}}; GELU tanh approximation",
        )
    else:
        lines.add(
            "  X ← X + (SiLU(Y·W_gate[l]) ⊙ Y·W_up[l])·W_down[l]",
            f"SwiGLU: W_gate, W_up ∈ ℝ^{{{d}×{_d(dff)}}}, W_down ∈ ℝ^{{{_d(dff)}×{d}}}",
        )
    lines.add("end for")
    lines.add("X ← " + _norm(s, "γ_f", "β_f"))
    if s.tied_output:
        lines.add("Z ← X·W_eᵀ", f"Z ∈ ℝ^{{T×{_d(V)}}}; output head tied to the token embedding")
    else:
        lines.add("Z ← X·W_u", f"Z ∈ ℝ^{{T×{_d(V)}}}; untied output head W_u ∈ ℝ^{{{d}×{_d(V)}}}")
    lines.add("return P = softmax(Z), row by row")
    defs = []
    if s.norm == "layer":
        defs.append("LayerNorm(x | γ, β) = γ ⊙ (x − mean(x)) / √(var(x) + ε) + β")
    else:
        defs.append("RMSNorm(x | γ) = γ ⊙ x / √(mean(x²) + ε)")
    if s.mlp == "gelu":
        defs.append("GELU(z) = ½z(1 + tanh(√(2/π)(z + 0.044715z³)))")
    else:
        defs.append("SiLU(z) = z·σ(z)")
    if s.mlp == "moe":
        defs.append("the experts of a token are computed by three expert-indexed products (mul_mat_id)")
    if s.positions == "rope":
        defs.append("RoPE rotates each pair of a head by angle (position · θ_i)")
    return "\n".join(head + lines.render() + ["where " + "; ".join(defs) + "."])


#: the numbered-lines builder of the cards, for plugin architectures' own cards
Lines = _Lines

__all__ = ["Lines", "ModelSummary", "algorithm_card", "decoder_card", "extra_rows", "summarize", "summary_from"]
