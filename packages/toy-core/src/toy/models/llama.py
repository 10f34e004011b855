"""The llama family (llama, qwen2, qwen3): config from GGUF and the forward graph.

One code path for the whole family. The variants are fields of ``LlamaConfig``,
read from GGUF metadata and tensor names (through ``toy.models.card``'s
parsing): grouped-query attention (``n_head_kv < n_head``), tied or untied
output head, Q/K/V biases (qwen2), per-head QK RMSNorm (qwen3), a head size
other than ``d_model / n_head``, and the RoPE pairing (``"normal"``: adjacent
pairs, which llama GGUF files need because the converter permutes Q/K rows;
``"neox"``: halves, for qwen2/qwen3).

``forward_logits`` builds the causal forward of ONE sequence over the whole
sequence (no KV cache): shapes are NumPy order, activations ``(T, d)``.
Invariants:

- attention is batched over heads: Q ``(H, T, D)`` against K ``(H_kv, T, D)``
  in one ``mul_mat`` (ggml's broadcast gives query head ``h`` the key/value
  head ``h // (H / H_kv)``, exactly GQA grouping), one ``soft_max`` with the
  causal mask input (F32 ``(T, T)``, 0 / -inf) and scale ``1/sqrt(D)``, one
  ``mul_mat`` with V; never one GEMM per head;
- K and V may be rounded to a KV type (F16, as llama.cpp's default cache)
  and padded with masked zero rows to an attention length ``n_kv >= T`` (the
  mask's width); neither changes the math beyond that rounding;
- weights are used as bound (quantized weights stay quantized; on the CPU
  they are the file mapping itself);
- ``LlamaModel`` builds the graph for a sequence length once and reuses it:
  a later call of the same length is uploads + one compute.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

import toy_ggml
from toy.errors import BadInputError
from toy.models.card import summary_from

SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "qwen3")


class UnsupportedModelError(BadInputError):
    """The file is not a llama-family model toy can run (architecture,
    missing tensor, unsupported variant); the message says which."""


_ROPE_MODE = {"llama": "normal", "qwen2": "neox", "qwen3": "neox"}
_LAYER_TENSORS = (
    "attn_norm.weight",
    "attn_q.weight",
    "attn_k.weight",
    "attn_v.weight",
    "attn_output.weight",
    "ffn_norm.weight",
    "ffn_gate.weight",
    "ffn_up.weight",
    "ffn_down.weight",
)


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
        if s.per_layer:
            raise UnsupportedModelError(f"per-layer {', '.join(s.per_layer)} is not supported")
        rope = _rope_scaling(arch, metadata, s, "rope_freqs.weight" in tensors)
        if s.qkv_fused:
            raise UnsupportedModelError("a fused attn_qkv tensor is not supported (expected attn_q/attn_k/attn_v)")
        if s.head_dim_v not in (None, s.head_dim):
            raise UnsupportedModelError(
                f"value head size {s.head_dim_v} != key head size {s.head_dim} is not supported"
            )
        need = ["token_embd.weight", "output_norm.weight"]
        for i in range(s.n_layer):
            need += [f"blk.{i}.{n}" for n in _LAYER_TENSORS]
            if s.qkv_bias:
                need += [f"blk.{i}.attn_{x}.bias" for x in "qkv"]
            if s.qk_norm:
                need += [f"blk.{i}.attn_q_norm.weight", f"blk.{i}.attn_k_norm.weight"]
        missing = [n for n in need if n not in tensors]
        if missing:
            more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
            raise UnsupportedModelError(f"the {arch} model lacks tensor {missing[0]!r}{more}")
        if s.n_head % s.n_head_kv:
            raise UnsupportedModelError(f"head_count {s.n_head} is not a multiple of head_count_kv {s.n_head_kv}")
        vocab = s.vocab if s.vocab is not None else int(tensors["token_embd.weight"].shape[0])
        return cls(
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
            rope_mode=_ROPE_MODE[arch],
            tied_output=bool(s.tied_output),
            qkv_bias=s.qkv_bias,
            qk_norm=s.qk_norm,
            context_length=s.context_length,
            architecture=arch,
            **rope,
        )

    @classmethod
    def from_gguf(cls, gf) -> LlamaConfig:
        """The config of an open ``GGUFFile`` (ToyError if it is not a
        supported llama-family model or lacks a tensor)."""
        return cls.from_metadata(gf.metadata, gf.tensors)


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


def causal_mask(n_tokens: int, n_kv: int | None = None) -> np.ndarray:
    """F32 (T, n_kv) (n_kv >= T, default T): 0 where key position <= query
    position, -inf after (the padding columns past T included)."""
    n_kv = n_tokens if n_kv is None else n_kv
    if n_kv < n_tokens:
        raise ValueError(f"causal_mask: n_kv={n_kv} < n_tokens={n_tokens}")
    m = np.zeros((n_tokens, n_kv), np.float32)
    m[np.triu_indices(n_tokens, 1, n_kv)] = -np.inf
    return m


def padded_length(n_tokens: int, pad: int) -> int:
    """n_tokens rounded up to a multiple of pad (>= 1)."""
    return -(-n_tokens // pad) * pad


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
):
    """The llama-family forward of T tokens with a pluggable attention.

    ``tokens``/``pos`` I32 (T,); ``attend(layer, q, k, v)`` gets Q (T, H, D)
    and K, V (T, H_kv, D) (Q and K already roped) and returns the attention
    output (T, H * D) before the output projection: the full-sequence causal
    attention below, or the KV-cache attention of ``toy.engine.llm``.
    ``out_rows`` (I32 (N,), optional) keeps only those rows after the last
    attention block, so the last FFN and the head run on N rows.
    ``row_invariant`` makes every weight product sum a row exactly as a
    one-row product would (``Context.mul_mat``), so a token's result does
    not depend on the tokens batched with it. Returns logits (N or T, V),
    or with ``head=False`` the final normed hidden states (N or T, d).

    ``lora`` (optional) maps a weight's GGUF name (``blk.{i}.attn_q.weight``
    …; the attention and feed-forward projections) to LoRA terms
    ``(a, b, scale, drop)``: the product with that weight becomes
    ``W x + Σ scale · B (A (x ⊙ drop))`` with A (r, in), B (out, r) and
    ``drop`` None or an F32 (T, in) dropout mask already scaled by 1/(1-p)
    — llama.cpp's ``build_lora_mm`` for inference, the trainable path of
    ``toy.train.lora``.
    """
    T, H, Hkv, D, eps = tokens.shape[0], cfg.n_head, cfg.n_head_kv, cfg.head_dim, cfg.rms_eps
    rope_args = cfg.rope_args()
    freqs = weights["rope_freqs.weight"] if cfg.rope_scaling == "llama3" else None

    def mm(w, x):
        return ctx.mul_mat(w, x, row_invariant=row_invariant)

    def lin(name: str, x):
        y = mm(weights[name], x)
        for a, b, s, drop in lora.get(name, ()) if lora else ():
            xa = x if drop is None else ctx.mul(x, drop)
            y = ctx.add(y, ctx.scale(mm(b, mm(a, xa)), s))
        return y

    def norm(x, gamma):
        return ctx.mul(ctx.rms_norm(x, eps), gamma)

    def proj(x, p: str, which: str, heads: int):
        y = lin(f"{p}.attn_{which}.weight", x)
        if cfg.qkv_bias:
            y = ctx.add(y, weights[f"{p}.attn_{which}.bias"])
        y = ctx.reshape(y, (T, heads, D))
        if cfg.qk_norm and which in "qk":
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
        g = ctx.swiglu(lin(f"{p}.ffn_gate.weight", h), lin(f"{p}.ffn_up.weight", h))
        x = ctx.add(x, lin(f"{p}.ffn_down.weight", g))
    x = norm(x, weights["output_norm.weight"])
    if not head:
        return x  # (N, d)
    return mm(weights["token_embd.weight" if cfg.tied_output else "output.weight"], x)  # (N, V)


def attention(ctx, q, k, v, mask, scale: float, row_invariant: bool = False):
    """Causal attention batched over heads: q (H, Tq, D), k (H_kv, n_kv, D),
    v (H_kv, D, n_kv) (V transposed, as the KV cache stores it), mask F32
    (Tq, n_kv) 0 / -inf -> (Tq, H * D). Query head h reads key/value head
    h // (H / H_kv) (ggml's broadcast in mul_mat: GQA grouping)."""
    kq = ctx.soft_max(ctx.mul_mat(k, q, row_invariant=row_invariant), mask, scale)  # (H, Tq, n_kv)
    a = ctx.mul_mat(v, kq, row_invariant=row_invariant)  # (H, Tq, D)
    H, T, D = a.shape
    return ctx.reshape(ctx.cont(ctx.permute(a, (1, 0, 2))), (T, H * D))


def forward_logits(ctx, cfg: LlamaConfig, weights, tokens, pos, mask, n_tokens: int, kv_type=None):
    """Logits (T, n_vocab) F32 of one sequence without a KV cache: ``tokens``
    I32 (T,), ``pos`` I32 (T,) positions, ``mask`` F32 (T, n_kv) causal mask
    (``causal_mask``). With n_kv > T the keys and values get n_kv - T zero
    rows, masked out: the attention then has llama.cpp's padded KV length (a
    multiple of 32 without flash attention), so its F16 matmuls take the same
    kernels and sums. ``weights`` maps GGUF tensor names to ggml tensors
    (``bind_tensors``). ``kv_type`` (e.g. F16) rounds K and V to that type
    before attention, as a llama.cpp KV cache of that type does; None keeps
    them F32. This is the graph training differentiates (no in-place cache)."""
    T = n_tokens
    n_kv = mask.shape[-1]
    if mask.shape != (T, n_kv) or n_kv < T:
        raise ValueError(f"forward_logits: mask {mask.shape} must be ({T}, n_kv >= {T})")
    scale = 1.0 / math.sqrt(cfg.head_dim)

    def attend(_layer, q, k, v):
        q = ctx.permute(q, (1, 0, 2))  # (H, T, D)
        k = ctx.permute(k, (1, 0, 2))  # (Hkv, T, D)
        v = ctx.cont(ctx.permute(v, (1, 2, 0)))  # (Hkv, D, T)
        if n_kv > T:  # zero keys/values past T (masked): (Hkv, n_kv, D), (Hkv, D, n_kv)
            k = ctx.pad(ctx.cont(k), ((0, 0), (0, n_kv - T), (0, 0)))
            v = ctx.pad(v, ((0, 0), (0, 0), (0, n_kv - T)))
        if kv_type is not None:
            k, v = ctx.cast(k, kv_type), ctx.cast(v, kv_type)
        return attention(ctx, q, k, v, mask, scale)

    return forward(ctx, cfg, weights, tokens, pos, attend)


def param_shapes(cfg: LlamaConfig) -> dict[str, tuple[int, ...]]:
    """The trainable tensors of a model of this config: GGUF name -> NumPy
    shape (a linear weight is (d_out, d_in)), in the order llama.cpp's
    converter writes them. RoPE frequency factors are not trainable."""
    H, Hkv, D, d = cfg.n_head, cfg.n_head_kv, cfg.head_dim, cfg.d_model
    out: dict[str, tuple[int, ...]] = {"token_embd.weight": (cfg.n_vocab, d)}
    for i in range(cfg.n_layer):
        p = f"blk.{i}"
        out[f"{p}.attn_norm.weight"] = (d,)
        for x, n in (("q", H), ("k", Hkv), ("v", Hkv)):
            out[f"{p}.attn_{x}.weight"] = (n * D, d)
            if cfg.qkv_bias:
                out[f"{p}.attn_{x}.bias"] = (n * D,)
        if cfg.qk_norm:
            out[f"{p}.attn_q_norm.weight"] = (D,)
            out[f"{p}.attn_k_norm.weight"] = (D,)
        out[f"{p}.attn_output.weight"] = (d, H * D)
        out[f"{p}.ffn_norm.weight"] = (d,)
        out[f"{p}.ffn_gate.weight"] = (cfg.d_ff, d)
        out[f"{p}.ffn_up.weight"] = (cfg.d_ff, d)
        out[f"{p}.ffn_down.weight"] = (d, cfg.d_ff)
    out["output_norm.weight"] = (d,)
    if not cfg.tied_output:
        out["output.weight"] = (cfg.n_vocab, d)
    return out


def forward_batch(ctx, cfg: LlamaConfig, weights, tokens, pos, mask, batch: int, keep=None, lora=None):
    """Logits (B*T, V) of B rows of T tokens at once, for training: ``tokens``
    and ``pos`` I32 (B*T,) (row-major), ``mask`` F32 (B, 1, T, T) additive
    attention mask (causal, or block-causal for packed documents), broadcast
    over heads. ``keep`` (F32 (B*T, 1), optional) multiplies the final hidden
    states before the head: a row multiplied by 0 contributes nothing to any
    weight's gradient (its zero hidden state makes the head's weight gradient
    vanish, and the 0 blocks the gradient flowing back), which is how rows
    without a target are taken out of the loss.

    Attention is batched over rows and heads together: Q (B*H, T, D) against
    K (B*H_kv, T, D) in one mul_mat, whose broadcast gives query head
    ``b*H + h`` the key/value head ``(b*H + h) // G = b*H_kv + h // G``
    (G = H / H_kv): GQA within each row. (A 4-D broadcast would read the same
    heads, but ggml's MUL_MAT backward only handles the 3-D one.) The scores
    are viewed as (B, H, T, T) for one soft_max with the mask, then one
    mul_mat with V (B*H_kv, D, T)."""
    N = tokens.shape[0]
    if N % batch:
        raise ValueError(f"forward_batch: {N} tokens do not split into {batch} rows")
    T, H, Hkv, D = N // batch, cfg.n_head, cfg.n_head_kv, cfg.head_dim
    if mask.shape != (batch, 1, T, T):
        raise ValueError(f"forward_batch: mask {mask.shape} must be ({batch}, 1, {T}, {T})")
    scale = 1.0 / math.sqrt(D)

    def heads(x, n, axes, shape):  # (N, n, D) -> rows-and-heads-major, contiguous
        return ctx.reshape(ctx.cont(ctx.permute(ctx.reshape(x, (batch, T, n, D)), axes)), shape)

    def attend(_layer, q, k, v):
        q = heads(q, H, (0, 2, 1, 3), (batch * H, T, D))
        k = heads(k, Hkv, (0, 2, 1, 3), (batch * Hkv, T, D))
        v = heads(v, Hkv, (0, 2, 3, 1), (batch * Hkv, D, T))
        kq = ctx.reshape(ctx.mul_mat(k, q), (batch, H, T, T))
        kq = ctx.reshape(ctx.soft_max(kq, mask, scale), (batch * H, T, T))
        a = ctx.reshape(ctx.mul_mat(v, kq), (batch, H, T, D))
        return ctx.reshape(ctx.cont(ctx.permute(a, (0, 2, 1, 3))), (N, H * D))

    h = forward(ctx, cfg, weights, tokens, pos, attend, head=False, lora=lora)  # (N, d)
    if keep is not None:
        h = ctx.mul(h, keep)
    return ctx.mul_mat(weights["token_embd.weight" if cfg.tied_output else "output.weight"], h)


@dataclass
class _Step:
    """The graph for one sequence length: inputs in their own allocated
    context, ops in another (memory from the runtime's scheduler)."""

    inputs: toy_ggml.Context
    ops: toy_ggml.Context
    graph: toy_ggml.Graph
    tokens: toy_ggml.Tensor
    out: toy_ggml.Tensor


class LlamaModel:
    """A llama-family GGUF model bound zero-copy on a Runtime; ``logits(ids)``
    runs the full causal forward with a graph built once per sequence length.

    ``kv_type``: the type K and V are rounded to before attention; F16 (the
    default) is what llama.cpp's default KV cache does, None keeps them F32.
    ``kv_pad``: the attention length is T rounded up to a multiple of it
    (zero, masked keys/values); 32 (the default) is llama.cpp's KV padding
    without flash attention. With both defaults our logits agree with
    llama.cpp's to float32 rounding; kv_pad=1 is the plain forward.

    Graphs are cached per sequence length (the ``max_graphs`` most recent
    lengths): a repeated length is token uploads plus one compute. Switching
    between cached graphs is safe: the Runtime re-allocates a graph whose
    scheduler memory went to another one.
    """

    def __init__(
        self, cfg: LlamaConfig, gf, weights, runtime: toy_ggml.Runtime, kv_type=toy_ggml.GGMLType.F16, kv_pad: int = 32
    ):
        if kv_pad < 1:
            raise ValueError(f"kv_pad={kv_pad} must be >= 1")
        self.cfg, self.gguf, self.weights, self.runtime = cfg, gf, weights, runtime
        self.kv_type, self.kv_pad = kv_type, kv_pad
        self._steps: dict[int, _Step] = {}  # insertion order = least recently built first
        self.max_graphs = 8
        self.n_builds = 0

    @classmethod
    def load(
        cls, path: str | Path, runtime: toy_ggml.Runtime, kv_type=toy_ggml.GGMLType.F16, kv_pad: int = 32
    ) -> LlamaModel:
        from toy.gguf import GGUFFile, bind_tensors

        gf = GGUFFile(path)
        try:
            cfg = LlamaConfig.from_gguf(gf)
            weights = bind_tensors(gf, runtime)
        except BaseException:
            gf.close()
            raise
        return cls(cfg, gf, weights, runtime, kv_type=kv_type, kv_pad=kv_pad)

    def _build(self, n: int) -> _Step:
        cin = toy_ggml.Context(max_tensors=8)
        tokens = cin.tensor(toy_ggml.GGMLType.I32, (n,), name="tokens")
        pos = cin.tensor(toy_ggml.GGMLType.I32, (n,), name="pos")
        n_kv = padded_length(n, self.kv_pad)
        mask = cin.tensor(toy_ggml.GGMLType.F32, (n, n_kv), name="mask")
        cin.allocate(self.runtime)
        pos.set(np.arange(n, dtype=np.int32))
        mask.set(causal_mask(n, n_kv))
        size = 64 * self.cfg.n_layer + 256
        ops = toy_ggml.Context(max_tensors=size)
        out = forward_logits(ops, self.cfg, self.weights, tokens, pos, mask, n, kv_type=self.kv_type)
        out.set_output()
        graph = toy_ggml.Graph(ops, size=max(2048, size)).build_forward(out)
        self.n_builds += 1
        return _Step(cin, ops, graph, tokens, out)

    def _drop_steps(self) -> None:
        for s in self._steps.values():
            s.ops.close()
            s.inputs.close()
        self._steps.clear()

    def logits(self, ids: Sequence[int] | np.ndarray) -> np.ndarray:
        """Logits (T, n_vocab) float32 for token ids (T,)."""
        ids = np.asarray(ids, dtype=np.int32).reshape(-1)
        n = len(ids)
        if n == 0:
            raise ValueError("logits: no tokens")
        if self.cfg.context_length and n > self.cfg.context_length:
            raise ValueError(f"logits: {n} tokens exceed the context length {self.cfg.context_length}")
        step = self._steps.get(n)
        if step is None:
            if len(self._steps) >= self.max_graphs:
                oldest = self._steps.pop(next(iter(self._steps)))
                oldest.ops.close()
                oldest.inputs.close()
            step = self._steps[n] = self._build(n)
        step.tokens.set(ids)
        self.runtime.compute(step.graph)
        return step.out.numpy()

    def close(self) -> None:
        self._drop_steps()
        self.weights.close()
        self.gguf.close()

    def __enter__(self) -> LlamaModel:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


__all__ = [
    "SUPPORTED_ARCHITECTURES",
    "UnsupportedModelError",
    "LlamaConfig",
    "LlamaModel",
    "attention",
    "causal_mask",
    "forward",
    "forward_batch",
    "forward_logits",
    "param_shapes",
    "padded_length",
]
