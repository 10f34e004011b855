"""The Gemma family (gemma2, gemma3): config from GGUF and the forward graph.

llama.cpp's layout and semantics (its converter's ``Gemma2Model`` /
``Gemma3Model`` and its ``gemma2`` / ``gemma3`` graphs), one code path:

- the token embedding scaled by float32 sqrt(d_model) (the head, tied to
  the embedding unless a gemma3 file has ``output.weight``, is not);
- RMSNorm gains as llama.cpp stores them: the converter writes Gemma's
  ``1 + w``, so the graph multiplies by the stored gain;
- every block: ``x += post_attention_norm(attn(attn_norm(x)))``, then
  ``x += post_ffw_norm(ffn(ffn_norm(x)))``; the feed-forward is GeGLU,
  ``down(gelu_tanh(gate(h)) * up(h))``;
- gemma3: per-head QK RMSNorm before RoPE;
- RoPE in NeoX halves over the whole head;
- sliding-window attention on some layers (``swa_layers``): gemma2 on the
  even layers (window ``attention.sliding_window``, 4096 without the key),
  gemma3 on the layers with ``i % 6 < 5`` when the file has a window (none
  without); ``attention.sliding_window_pattern`` (per-layer booleans, or a
  period n: SWA unless ``i % n == n - 1``) overrides either, as in llama.cpp.
  A query on a sliding layer sees the W latest positions, itself included;
- RoPE bases per kind of layer: gemma2 one base for all (``rope.freq_base``,
  default 10000; ``rope.freq_base_swa`` for sliding layers when given);
  gemma3 ``rope.freq_base`` with linear scaling (1/factor) on global layers,
  ``rope.freq_base_swa`` (default 10000) unscaled on sliding ones;
- the attention scale 1/sqrt(head_dim), except llama.cpp's 27B shapes (46
  layers for gemma2, 62 for gemma3): 1/sqrt(d_model // n_head).
  ``query_pre_attn_scalar`` is not in the file (the converter drops it);
  llama.cpp uses this rule, and so does toy;
- gemma2 soft-caps: the attention scores ``c · tanh(s / c)`` before the mask
  (``attn_logit_softcapping``, default 50) and the logits (``final_...``,
  default 30); gemma3 caps the logits only when its file has the key.

GELU: ``gelu="table"`` (files load so) is ggml's, which on the CPU reads a
float16 table as llama.cpp's graph does; ``"exact"`` is the float32 tanh
formula, as Hugging Face computes it (``common.gelu_tanh``). GeGLU is built
as GELU then MUL, not ggml's fused GEGLU (which has no backward): on the CPU
the forward bits are the same as llama.cpp's ``ggml_geglu_split``, and both
ops train (GELU's backward is toy-ggml patch 0002, TANH's, for the soft-caps
and the exact GELU, patch 0012). Gemma 3n
(``gemma3n``) and vision towers are refused by name (``toy.models``).

This module is the family's ``ARCH`` in the registry (``toy.models``). Shapes
are NumPy order, activations ``(T, d)``; weights are used as bound.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from toy.models import LMArchitecture, LoraTarget, ParamInfo, UnsupportedModelError, validate
from toy.models.card import Lines
from toy.models.common import (
    final_softcapped,
    gelu_tanh,
    head_weight,
    lora_linear,
    shape_metadata,
    train_shape_fields,
    uint32_counts,
)

SUPPORTED_ARCHITECTURES = ("gemma2", "gemma3")
# the RMSNorm epsilon of a file without attention.layer_norm_rms_epsilon (the model runs and the card shows it)
DEFAULT_RMS_EPS = 1e-6

_LAYER_TENSORS = (
    "attn_norm.weight",
    "attn_q.weight",
    "attn_k.weight",
    "attn_v.weight",
    "attn_output.weight",
    "post_attention_norm.weight",
    "ffn_norm.weight",
    "ffn_gate.weight",
    "ffn_up.weight",
    "ffn_down.weight",
    "post_ffw_norm.weight",
)
_BIG = {"gemma2": 46, "gemma3": 62}  # llama.cpp's 27B layer counts (another attention scale)


@dataclass(frozen=True)
class GemmaConfig:
    n_vocab: int
    d_model: int
    n_layer: int
    n_head: int
    n_head_kv: int
    head_dim: int
    d_ff: int
    rms_eps: float
    rope_base: float  # global layers
    rope_base_swa: float  # sliding-window layers
    rope_freq_scale: float = 1.0  # global layers (linear scaling: 1 / factor)
    sliding_window: int = 0  # W of the sliding layers (0: no sliding layer)
    swa_layers: tuple[bool, ...] = ()  # per layer: attends through the window
    attn_softcap: float = 0.0
    final_softcap: float = 0.0
    qk_norm: bool = False
    tied_output: bool = True
    context_length: int | None = None
    architecture: str = "gemma3"
    gelu: str = "table"  # "table" (ggml's, as llama.cpp) or "exact" (see the module docstring)

    @property
    def rope_dims(self) -> int:
        return self.head_dim

    @property
    def attn_scale(self) -> float:
        """In float32 arithmetic, as llama.cpp computes it (``1.0f / std::sqrt(float(n))``)."""
        import numpy as np  # lazy: the registry (and `toy train --help`) loads this module without numpy

        n = self.d_model // self.n_head if self.n_layer == _BIG.get(self.architecture) else self.head_dim
        return float(np.float32(1.0) / np.sqrt(np.float32(n)))

    def window(self, layer: int) -> int:
        return self.sliding_window if self.swa_layers and self.swa_layers[layer] else 0

    @classmethod
    def from_metadata(cls, metadata: Mapping[str, Any], tensors: Mapping[str, Any]) -> GemmaConfig:
        arch = metadata.get("general.architecture")
        if arch == "gemma":  # the family's name is llama.cpp's Gemma 1 architecture
            raise UnsupportedModelError(
                "architecture 'gemma' (Gemma 1) is not supported: its graph (no post-sublayer norms, "
                "no soft-caps) is not implemented",
                hint=f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}",
            )
        if arch not in SUPPORTED_ARCHITECTURES:
            raise UnsupportedModelError(
                f"architecture {arch!r} is not a Gemma model toy runs",
                hint=f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}",
            )
        vision = sorted(n for n in tensors if n.startswith(("v.", "mm.")))
        if vision:
            raise UnsupportedModelError(
                f"this {arch} file holds a vision tower ({vision[0]!r} and {len(vision) - 1} more tensors)",
                hint="toy runs Gemma's text model: use a text-only GGUF (llama.cpp keeps the vision tower in a separate mmproj file)",
            )

        validate.check_counts(arch, metadata)  # before any count sizes a loop (toy.models.validate)

        def key(suffix: str):
            return metadata.get(f"{arch}.{suffix}")

        def num(suffix: str, default=None):
            v = key(suffix)
            if v is None:
                return default
            if isinstance(v, (str, bytes)) or hasattr(v, "__len__"):
                raise UnsupportedModelError(f"{arch}.{suffix}: per-layer or non-numeric values are not supported")
            return v

        dims = {k: num(k) for k in ("block_count", "embedding_length", "attention.head_count", "feed_forward_length")}
        missing = [k for k, v in dims.items() if v is None]
        if missing:
            raise UnsupportedModelError(f"{arch} metadata lacks {', '.join(f'{arch}.{k}' for k in missing)}")
        n_layer, d, H, d_ff = (int(dims[k]) for k in dims)
        validate.require(arch, ("token_embd.weight", "output_norm.weight"), tensors)  # before the blocks
        validate.check_blocks(f"{arch}.block_count", n_layer, tensors)
        Hkv = int(num("attention.head_count_kv", H))
        if H < 1 or Hkv < 1 or H % Hkv:
            raise UnsupportedModelError(
                f"{arch}.attention.head_count = {H} is not a multiple of {arch}.attention.head_count_kv = {Hkv}"
            )
        D = int(num("attention.key_length", d // H))
        if int(num("attention.value_length", D)) != D:
            raise UnsupportedModelError(
                f"{arch}.attention.value_length = {num('attention.value_length')} != the key head size {D} "
                f"({arch}.attention.key_length)"
            )
        qk_norm = arch == "gemma3"
        need = ["token_embd.weight", "output_norm.weight"]
        for i in range(n_layer):
            need += [f"blk.{i}.{n}" for n in _LAYER_TENSORS]
            if qk_norm:
                need += [f"blk.{i}.attn_q_norm.weight", f"blk.{i}.attn_k_norm.weight"]
        absent = [n for n in need if n not in tensors]
        if absent:
            more = f" (and {len(absent) - 1} more)" if len(absent) > 1 else ""
            raise UnsupportedModelError(f"the {arch} model lacks tensor {absent[0]!r}{more}")

        # sliding windows
        window = num("attention.sliding_window")
        if arch == "gemma2":
            window, period = int(window if window is not None else 4096), 2
        else:
            window, period = int(window or 0), 6
        pattern = key("attention.sliding_window_pattern")
        if not window:
            swa: tuple[bool, ...] = ()
        elif pattern is None or isinstance(pattern, (int, float)) and not isinstance(pattern, bool):
            n = validate.whole(metadata, f"{arch}.attention.sliding_window_pattern", 0, validate.LIMITS["context"])
            n = period if n is None else n
            swa = tuple(n == 0 or i % n < n - 1 for i in range(n_layer))
        elif isinstance(pattern, (bool, str, bytes)) or not hasattr(pattern, "__len__"):
            raise UnsupportedModelError(
                f"{arch}.attention.sliding_window_pattern = {validate.show(pattern)}: expected a period "
                "or one boolean per layer"
            )
        else:
            swa = tuple(bool(x) for x in pattern)
            if len(swa) != n_layer:
                raise UnsupportedModelError(
                    f"{arch}.attention.sliding_window_pattern has {len(swa)} entries for {n_layer} layers"
                )

        # RoPE: global and sliding layers
        base = float(num("rope.freq_base", 10000.0))
        stype = key("rope.scaling.type")
        scale = 1.0
        if isinstance(stype, str) and stype not in ("", "none"):
            if stype != "linear":
                raise UnsupportedModelError(
                    f"rope scaling {stype!r} is not supported for {arch}", hint="supported: none, linear"
                )
            factor = float(num("rope.scaling.factor", 1.0))
            if not factor > 0:
                raise UnsupportedModelError(f"{arch}.rope.scaling.factor={factor} must be > 0")
            scale = 1.0 / factor
        if arch == "gemma2":  # llama.cpp: the sliding layers take the global base and scale unless told
            base_swa = float(num("rope.freq_base_swa", base))
            if scale != 1.0:
                raise UnsupportedModelError("rope scaling on gemma2 is not supported")
        else:
            base_swa = float(num("rope.freq_base_swa", 10000.0))

        if arch == "gemma2":
            attn_cap = float(num("attn_logit_softcapping", 50.0))
            final_cap = float(num("final_logit_softcapping", 30.0))
        else:
            if num("attn_logit_softcapping", 0.0):
                raise UnsupportedModelError("an attention soft-cap on gemma3 is not supported (llama.cpp has none)")
            attn_cap, final_cap = 0.0, float(num("final_logit_softcapping", 0.0))
        if attn_cap < 0 or final_cap < 0:
            raise UnsupportedModelError(f"soft-caps must be >= 0 (attention {attn_cap}, final {final_cap})")
        vocab = num("vocab_size")
        ctx = num("context_length")
        cfg = cls(
            n_vocab=int(vocab) if vocab is not None else int(tensors["token_embd.weight"].shape[0]),
            d_model=d,
            n_layer=n_layer,
            n_head=H,
            n_head_kv=Hkv,
            head_dim=D,
            d_ff=d_ff,
            rms_eps=float(num("attention.layer_norm_rms_epsilon", DEFAULT_RMS_EPS)),
            rope_base=base,
            rope_base_swa=base_swa,
            rope_freq_scale=scale,
            sliding_window=window if any(swa) else 0,
            swa_layers=swa if any(swa) else (),
            attn_softcap=attn_cap,
            final_softcap=final_cap,
            qk_norm=qk_norm,
            tied_output=arch == "gemma2" or "output.weight" not in tensors,
            context_length=int(ctx) if ctx is not None else None,
            architecture=arch,
        )
        validate.check_shapes(arch, params(cfg), tensors, validate.lm_sources(arch, metadata, cfg), validate.LM_AXES)
        validate.check_vocab(arch, metadata, cfg.n_vocab)
        return cfg


def forward(
    ctx,
    cfg: GemmaConfig,
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
    """The Gemma forward of T tokens with a pluggable attention (the
    protocol of ``toy.models``; see ``toy.models.llama.forward`` for the
    arguments). ``attend`` applies the layer's scale, soft-cap and window.
    Returns logits (N or T, V), soft-capped when the model caps them, or
    with ``head=False`` the final normed hidden states."""
    T, H, Hkv, D, eps = tokens.shape[0], cfg.n_head, cfg.n_head_kv, cfg.head_dim, cfg.rms_eps
    mm, lin = lora_linear(ctx, weights, lora, row_invariant)

    def norm(x, gamma):
        return ctx.mul(ctx.rms_norm(x, eps), gamma)

    def proj(x, p: str, which: str, heads: int, layer: int):
        y = ctx.reshape(lin(f"{p}.attn_{which}.weight", x), (T, heads, D))
        if cfg.qk_norm and which in "qk":
            y = norm(y, weights[f"{p}.attn_{which}_norm.weight"])
        if which in "qk":
            swa = cfg.window(layer) > 0
            y = ctx.rope(
                y,
                pos,
                D,
                mode="neox",
                freq_base=cfg.rope_base_swa if swa else cfg.rope_base,
                freq_scale=1.0 if swa and cfg.architecture == "gemma3" else cfg.rope_freq_scale,
                n_ctx_orig=int(cfg.context_length or 0),
            )
        return y

    x = ctx.scale(ctx.get_rows(weights["token_embd.weight"], tokens), float(math.sqrt(float(cfg.d_model))))
    for i in range(cfg.n_layer):
        p = f"blk.{i}"
        h = norm(x, weights[f"{p}.attn_norm.weight"])
        a = attend(i, proj(h, p, "q", H, i), proj(h, p, "k", Hkv, i), proj(h, p, "v", Hkv, i))  # (T, H*D)
        a = norm(lin(f"{p}.attn_output.weight", a), weights[f"{p}.post_attention_norm.weight"])
        x = ctx.add(x, a)
        if out_rows is not None and i == cfg.n_layer - 1:
            x = ctx.get_rows(x, out_rows)  # (N, d): the rows whose logits are wanted
        h = norm(x, weights[f"{p}.ffn_norm.weight"])
        g = ctx.mul(gelu_tanh(ctx, lin(f"{p}.ffn_gate.weight", h), cfg.gelu), lin(f"{p}.ffn_up.weight", h))
        f = norm(lin(f"{p}.ffn_down.weight", g), weights[f"{p}.post_ffw_norm.weight"])
        x = ctx.add(x, f)
        if taps is not None:
            taps.append(x)  # the residual stream after the block (see toy.models.llama.forward)
    x = final_norm(ctx, cfg, weights, x)
    if not head:
        return x  # (N, d)
    return final_softcapped(ctx, ARCH, cfg, mm(head_weight(weights, output_weight(cfg)), x))  # (N, V)


def final_norm(ctx, cfg: GemmaConfig, weights, x):
    """The norm before the head (``output_norm``) of a residual stream ``x``."""
    return ctx.mul(ctx.rms_norm(x, cfg.rms_eps), weights["output_norm.weight"])


def output_weight(cfg: GemmaConfig) -> str:
    return "token_embd.weight" if cfg.tied_output else "output.weight"


def params(cfg: GemmaConfig) -> dict[str, ParamInfo]:
    """The trainable tensors, GGUF name -> ``ParamInfo``, in the converter's
    order. Norm gains are stored as llama.cpp stores Gemma's (1 + w), so a
    fresh gain is 1 like any other; the projections into the residual
    stream are ``residual``."""
    H, Hkv, D, d, f = cfg.n_head, cfg.n_head_kv, cfg.head_dim, cfg.d_model, cfg.d_ff
    out: dict[str, ParamInfo] = {"token_embd.weight": ParamInfo((cfg.n_vocab, d), "embedding")}
    for i in range(cfg.n_layer):
        p = f"blk.{i}"
        out[f"{p}.attn_norm.weight"] = ParamInfo((d,), "norm")
        out[f"{p}.attn_q.weight"] = ParamInfo((H * D, d), "matrix")
        out[f"{p}.attn_k.weight"] = ParamInfo((Hkv * D, d), "matrix")
        out[f"{p}.attn_v.weight"] = ParamInfo((Hkv * D, d), "matrix")
        if cfg.qk_norm:
            out[f"{p}.attn_q_norm.weight"] = ParamInfo((D,), "norm")
            out[f"{p}.attn_k_norm.weight"] = ParamInfo((D,), "norm")
        out[f"{p}.attn_output.weight"] = ParamInfo((d, H * D), "residual")
        out[f"{p}.post_attention_norm.weight"] = ParamInfo((d,), "norm")
        out[f"{p}.ffn_norm.weight"] = ParamInfo((d,), "norm")
        out[f"{p}.ffn_gate.weight"] = ParamInfo((f, d), "matrix")
        out[f"{p}.ffn_up.weight"] = ParamInfo((f, d), "matrix")
        out[f"{p}.ffn_down.weight"] = ParamInfo((d, f), "residual")
        out[f"{p}.post_ffw_norm.weight"] = ParamInfo((d,), "norm")
    out["output_norm.weight"] = ParamInfo((d,), "norm")
    if not cfg.tied_output:
        out["output.weight"] = ParamInfo((cfg.n_vocab, d), "matrix")
    return out


def lora_targets(cfg: GemmaConfig) -> dict[str, LoraTarget]:
    """q, k, v, o on attention; gate, up, down on the feed-forward."""
    H, Hkv, D, d, f = cfg.n_head, cfg.n_head_kv, cfg.head_dim, cfg.d_model, cfg.d_ff
    return {
        "q": LoraTarget("attn_q", "attn_in", d, H * D),
        "k": LoraTarget("attn_k", "attn_in", d, Hkv * D),
        "v": LoraTarget("attn_v", "attn_in", d, Hkv * D),
        "o": LoraTarget("attn_output", "attn_out", H * D, d),
        "gate": LoraTarget("ffn_gate", "ffn_in", d, f),
        "up": LoraTarget("ffn_up", "ffn_in", d, f),
        "down": LoraTarget("ffn_down", "ffn_mid", f, d),
    }


def metadata(cfg: GemmaConfig, name: str) -> dict[str, Any]:
    """The llama.cpp metadata of a model of this config (F32 weights), the
    keys its converter writes for the architecture, plus what llama.cpp
    reads that the converter leaves to defaults when they differ (a sliding
    pattern other than the default, RoPE bases)."""
    a = cfg.architecture
    out: dict[str, Any] = {
        "general.architecture": a,
        "general.name": name,
        **shape_metadata(a, cfg, 8192),
        f"{a}.attention.layer_norm_rms_epsilon": float(cfg.rms_eps),
        f"{a}.rope.freq_base": float(cfg.rope_base),
        f"{a}.rope.freq_base_swa": float(cfg.rope_base_swa),
    }
    if cfg.rope_freq_scale != 1.0:
        out[f"{a}.rope.scaling.type"] = "linear"
        out[f"{a}.rope.scaling.factor"] = float(1.0 / cfg.rope_freq_scale)
    if a == "gemma2":
        out[f"{a}.attn_logit_softcapping"] = float(cfg.attn_softcap)
        out[f"{a}.final_logit_softcapping"] = float(cfg.final_softcap)
        out[f"{a}.attention.sliding_window"] = int(cfg.sliding_window or 0)
        default = tuple(i % 2 == 0 for i in range(cfg.n_layer))
    else:
        if cfg.final_softcap:
            out[f"{a}.final_logit_softcapping"] = float(cfg.final_softcap)
        if cfg.sliding_window:
            out[f"{a}.attention.sliding_window"] = int(cfg.sliding_window)
        default = tuple(i % 6 < 5 for i in range(cfg.n_layer))
    if cfg.sliding_window and cfg.swa_layers != default:
        out[f"{a}.attention.sliding_window_pattern"] = [bool(x) for x in cfg.swa_layers]
    return uint32_counts(out)


#: ``toy train from-scratch --arch gemma`` size presets (the vocabulary comes from the tokenizer)
PRESETS: dict[str, dict[str, Any]] = {
    "tiny": dict(d_model=128, n_layer=6, n_head=4, n_head_kv=1, d_ff=512, rope_base=1000000.0),
    "small": dict(d_model=384, n_layer=6, n_head=6, n_head_kv=2, d_ff=1536, rope_base=1000000.0),
}


def train_config(d: Mapping[str, Any], n_vocab: int, context: int) -> GemmaConfig:
    """The config a from-scratch run trains: Gemma 3 (QK-norm, no attention
    soft-cap), sliding windows of half the context on five layers in six,
    RoPE base ``rope_base`` on global layers and 10000 on sliding ones, the
    context length = the training context."""
    fields = train_shape_fields(d, n_vocab)
    window = max(1, context // 2)
    return GemmaConfig(
        **fields,
        rope_base_swa=10000.0,
        sliding_window=window,
        swa_layers=tuple(i % 6 < 5 for i in range(d["n_layer"])),
        qk_norm=True,
        context_length=context,
        architecture="gemma3",
    )


def _summary(metadata: Mapping[str, Any], tensors: Mapping[str, Any]) -> dict[str, Any]:
    """Gemma's own facts for ``toy describe`` (``ModelSummary.extra``)."""
    try:
        cfg = GemmaConfig.from_metadata(metadata, tensors)
    except UnsupportedModelError:
        return {}  # toy describe still shows the generic fields
    swa = [i for i in range(cfg.n_layer) if cfg.window(i)]
    return {
        "mlp": "geglu",
        "rope_base": cfg.rope_base,
        "sliding_window": cfg.sliding_window,
        "sliding_layers": swa,
        "global_layers": [i for i in range(cfg.n_layer) if i not in swa],
        "rope_base_swa": cfg.rope_base_swa,
        "rope_freq_scale": cfg.rope_freq_scale,
        "rope_freq_scale_swa": 1.0 if cfg.architecture == "gemma3" else cfg.rope_freq_scale,
        "attn_softcap": cfg.attn_softcap,
        "final_softcap": cfg.final_softcap,
        "attn_scale": cfg.attn_scale,
        "embed_scale": float(math.sqrt(float(cfg.d_model))),
    }


def _scaling_text(freq_scale) -> str:
    return f", linear scaling ×{1.0 / freq_scale:g}" if freq_scale and freq_scale != 1.0 else ", no scaling"


def _describe_rows(extra: Mapping[str, Any]) -> list[tuple[str, str]]:
    def layers(ix) -> str:
        return ", ".join(map(str, ix)) if ix else "none"

    w = extra.get("sliding_window") or 0
    rows = [
        ("sliding window", f"{w} positions on layers {layers(extra.get('sliding_layers'))}" if w else "none"),
        ("global layers", layers(extra.get("global_layers"))),
        ("rope (global)", f"NeoX, base {extra.get('rope_base'):g}" + _scaling_text(extra.get("rope_freq_scale"))),
        (
            "rope (sliding)",
            f"NeoX, base {extra.get('rope_base_swa'):g}" + _scaling_text(extra.get("rope_freq_scale_swa")),
        ),
    ]
    caps = []
    if extra.get("attn_softcap"):
        caps.append(f"attention {extra['attn_softcap']:g}")
    if extra.get("final_softcap"):
        caps.append(f"logits {extra['final_softcap']:g}")
    rows.append(("soft-caps", ", ".join(caps) or "none"))
    rows.append(("embed scale", f"√d = {extra.get('embed_scale'):.6g}"))
    return rows


def _card(s) -> str:
    """The algorithm card of a Gemma model (``toy.models.card``'s style)."""
    e = s.extra
    if not e:
        return f"(no algorithm card: toy cannot run this {s.architecture} file; `toy infer` says why)"
    L, d, H, Hkv, dh, dff, V = s.n_layer, s.d_model, s.n_head, s.n_head_kv or s.n_head, s.head_dim, s.d_ff, s.vocab
    W, eps = e.get("sliding_window") or 0, s.norm_eps if s.norm_eps is not None else DEFAULT_RMS_EPS
    title = f" — {s.name}" if s.name else ""
    head = [
        f"Algorithm: P ← {s.architecture}(x | θ), the forward pass of a decoder-only transformer{title}",
        f"Input:  x ∈ [V]^T, token ids, T ≤ {s.context_length}",
        "Output: P ∈ (0,1)^{T×V}, P[t, :] = p(x[t+1] | x[1:t])",
        f"Hyperparameters: L = {L} layers, d = {d}, d_ff = {dff}, V = {V}",
        f"Attention: H = {H} query heads, H_kv = {Hkv} key/value heads, d_h = {dh}",
    ]
    lines = Lines()
    lines.add(f"X ← W_e[x, :] · {e.get('embed_scale'):.6g}", f"X ∈ ℝ^{{T×{d}}}; scaled by √d")
    lines.add(f"for l = 1, …, {L} do")
    lines.add(f"  Y ← RMSNorm(X | γ_1[l]), ε = {eps:g}")
    lines.add("  Q ← Y·W_q[l];  K ← Y·W_k[l];  V ← Y·W_v[l]", f"Q ∈ ℝ^{{T×{H}×{dh}}}, K, V ∈ ℝ^{{T×{Hkv}×{dh}}}")
    if s.qk_norm:
        lines.add("  Q ← RMSNorm(Q | γ_q[l]);  K ← RMSNorm(K | γ_k[l])", f"per head, over d_h = {dh} (QK-norm)")
    base, base_swa = e.get("rope_base"), e.get("rope_base_swa")
    scaling = f", {s.rope_scaling} ×{s.rope_scaling_factor:g} on global layers" if s.rope_scaling else ""
    lines.add("  Q, K ← RoPE(Q, K)", f"NeoX halves; base {base:g} (global), {base_swa:g} (sliding){scaling}")
    lines.add(f"  S_h ← Q_h·K_gᵀ · {e.get('attn_scale'):.6g}", "g: the K/V head of query head h")
    if e.get("attn_softcap"):
        c = e["attn_softcap"]
        lines.add(f"  S_h ← {c:g} · tanh(S_h / {c:g})", "attention soft-cap")
    mask = f"M_l: causal, and on sliding layers t − t′ < {W}" if W else "M: causal"
    lines.add("  A_h ← softmax(S_h + M_l)·V_g", mask)
    lines.add("  X ← X + RMSNorm([A_1, …, A_H]·W_o[l] | γ_2[l])", "post-attention norm, then residual")
    lines.add("  Y ← RMSNorm(X | γ_3[l])")
    lines.add("  X ← X + RMSNorm((GELU(Y·W_gate[l]) ⊙ Y·W_up[l])·W_down[l] | γ_4[l])", "GeGLU; post-FFN norm")
    lines.add("end for")
    lines.add("X ← RMSNorm(X | γ_f)")
    lines.add("Z ← X·W_eᵀ" if s.tied_output else "Z ← X·W_u", f"Z ∈ ℝ^{{T×{V}}}")
    if e.get("final_softcap"):
        c = e["final_softcap"]
        lines.add(f"Z ← {c:g} · tanh(Z / {c:g})", "final soft-cap")
    lines.add("return P = softmax(Z), row by row")
    defs = (
        "where RMSNorm(x | γ) = γ ⊙ x / √(mean(x²) + ε) (γ as stored: Gemma's 1 + w); "
        "GELU(z) = ½z(1 + tanh(√(2/π)(z + 0.044715z³)))."
    )
    return "\n".join(head + lines.render() + [defs])


# no ``traits``: the generic summary reads Gemma's norm and RoPE from the file's keys as for any model, and
# its own summary, rows and card (above) say the rest
ARCH = LMArchitecture(
    family="gemma",
    hf="toy.models.gemma_hf",
    names=SUPPORTED_ARCHITECTURES,
    presets=PRESETS,
    lora_names=("q", "k", "v", "o", "gate", "up", "down"),
    lora_default=("q", "k", "v", "o"),
    config_from_metadata=GemmaConfig.from_metadata,
    forward=forward,
    params=params,
    lora_targets=lora_targets,
    attention_scale=lambda cfg, layer: cfg.attn_scale,
    output_weight=output_weight,
    final_norm=final_norm,
    metadata=metadata,
    train_config=train_config,
    sliding_window=lambda cfg, layer: cfg.window(layer),
    attention_softcap=lambda cfg, layer: cfg.attn_softcap,
    final_softcap=lambda cfg: cfg.final_softcap,
    summary=_summary,
    describe_rows=_describe_rows,
    card=_card,
)

__all__ = [
    "ARCH",
    "PRESETS",
    "SUPPORTED_ARCHITECTURES",
    "GemmaConfig",
    "final_norm",
    "forward",
    "lora_targets",
    "metadata",
    "output_weight",
    "params",
    "train_config",
]
