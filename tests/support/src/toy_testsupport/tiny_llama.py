"""Tiny seeded llama-family GGUF models for forward and engine tests.

``write_tiny(path, **kw)`` writes a random model with F32 weights (a few KB;
every config variant of ``toy.models.llama.LlamaConfig`` is a keyword);
``VARIANTS`` names the keyword sets the tests run over (one per variant,
kept small so each test stays fast).

Test modules import it as ``from toy_testsupport.tiny_llama import
write_tiny, VARIANTS``.
"""

from __future__ import annotations

import numpy as np


def write_tiny(
    path,
    *,
    seed=0,
    arch="llama",
    vocab=64,
    d=32,
    n_layer=2,
    n_head=4,
    n_head_kv=2,
    head_dim=8,
    d_ff=48,
    tied=False,
    qkv_bias=False,
    qk_norm=False,
    rope_dims=None,
    rope_base=10000.0,
    rope_scaling=None,
    rope_factor=None,
    rope_orig_ctx=None,
    rope_freqs=None,
    context_length=128,
):
    """A seeded random llama-family model with F32 weights.

    RoPE scaling: ``rope_scaling`` "linear" or "yarn" writes
    ``{arch}.rope.scaling.type`` with ``rope.scaling.factor`` = ``rope_factor``
    and, when given, ``rope.scaling.original_context_length`` =
    ``rope_orig_ctx``; ``rope_freqs`` (array of rope_dims/2 values) writes the
    F32 tensor ``rope_freqs.weight`` (llama3-style per-frequency divisors).
    The random weights depend only on ``seed`` and the shapes, not on the
    RoPE settings (``rope_freqs`` is written after them)."""
    from toy.gguf import GGUFWriter

    rng = np.random.default_rng(seed)

    def rnd(*shape, scale=0.3):
        return (rng.standard_normal(shape) * scale).astype(np.float32)

    def gamma(n):
        return (1.0 + 0.1 * rng.standard_normal(n)).astype(np.float32)

    if rope_scaling not in (None, "linear", "yarn"):
        raise ValueError(f"rope_scaling={rope_scaling!r}: expected None, 'linear' or 'yarn'")
    w = GGUFWriter(path)
    w.add("general.architecture", arch)
    w.add(f"{arch}.block_count", n_layer)
    w.add(f"{arch}.embedding_length", d)
    w.add(f"{arch}.attention.head_count", n_head)
    w.add(f"{arch}.attention.head_count_kv", n_head_kv)
    w.add(f"{arch}.feed_forward_length", d_ff)
    w.add(f"{arch}.context_length", context_length)
    w.add(f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)
    w.add(f"{arch}.rope.freq_base", rope_base)
    if head_dim != d // n_head:
        w.add(f"{arch}.attention.key_length", head_dim)
        w.add(f"{arch}.attention.value_length", head_dim)
    if rope_dims is not None:
        w.add(f"{arch}.rope.dimension_count", rope_dims)
    if rope_scaling is not None:
        w.add(f"{arch}.rope.scaling.type", rope_scaling)
        w.add(f"{arch}.rope.scaling.factor", float(rope_factor if rope_factor is not None else 1.0))
        if rope_orig_ctx is not None:
            w.add(f"{arch}.rope.scaling.original_context_length", int(rope_orig_ctx))
    w.add_tensor("token_embd.weight", rnd(vocab, d, scale=1.0))
    w.add_tensor("output_norm.weight", gamma(d))
    if not tied:
        w.add_tensor("output.weight", rnd(vocab, d))
    for i in range(n_layer):
        p = f"blk.{i}"
        w.add_tensor(f"{p}.attn_norm.weight", gamma(d))
        w.add_tensor(f"{p}.attn_q.weight", rnd(n_head * head_dim, d))
        w.add_tensor(f"{p}.attn_k.weight", rnd(n_head_kv * head_dim, d))
        w.add_tensor(f"{p}.attn_v.weight", rnd(n_head_kv * head_dim, d))
        if qkv_bias:
            w.add_tensor(f"{p}.attn_q.bias", rnd(n_head * head_dim))
            w.add_tensor(f"{p}.attn_k.bias", rnd(n_head_kv * head_dim))
            w.add_tensor(f"{p}.attn_v.bias", rnd(n_head_kv * head_dim))
        if qk_norm:
            w.add_tensor(f"{p}.attn_q_norm.weight", gamma(head_dim))
            w.add_tensor(f"{p}.attn_k_norm.weight", gamma(head_dim))
        w.add_tensor(f"{p}.attn_output.weight", rnd(d, n_head * head_dim))
        w.add_tensor(f"{p}.ffn_norm.weight", gamma(d))
        w.add_tensor(f"{p}.ffn_gate.weight", rnd(d_ff, d))
        w.add_tensor(f"{p}.ffn_up.weight", rnd(d_ff, d))
        w.add_tensor(f"{p}.ffn_down.weight", rnd(d, d_ff))
    if rope_freqs is not None:
        freqs = np.asarray(rope_freqs, np.float32).reshape(-1)
        want = (rope_dims if rope_dims is not None else head_dim) // 2
        if len(freqs) != want:
            raise ValueError(f"rope_freqs has {len(freqs)} values, expected rope_dims/2 = {want}")
        w.add_tensor("rope_freqs.weight", freqs)
    w.write()
    return path


VARIANTS = {
    "gqa_untied": {},
    "mha_tied": {"n_head_kv": 4, "tied": True},
    "gqa_4to1": {"n_head_kv": 1, "seed": 1},
    "qwen2_bias_neox": {"arch": "qwen2", "qkv_bias": True, "tied": True, "seed": 2},
    "qwen3_qknorm_neox": {"arch": "qwen3", "qk_norm": True, "seed": 3},
    "head_dim_12": {"head_dim": 12, "seed": 4},
    "partial_rope_normal": {"head_dim": 12, "rope_dims": 8, "seed": 5},
    "partial_rope_neox": {"arch": "qwen2", "head_dim": 12, "rope_dims": 8, "seed": 6},
    # RoPE scaling. linear: every angle halved.
    "rope_linear": {"rope_scaling": "linear", "rope_factor": 2.0, "seed": 7},
    # yarn: factor 4 over an original context of 32 (tests run past it). Base
    # 100 puts YaRN's ramp over pairs 0..2 of the 4 (corr dims low 0, high 2):
    # pair 0 extrapolated, pair 1 half-and-half, pairs 2-3 interpolated; with
    # base 10000 the ramp would be a step between pairs 0 and 1.
    "rope_yarn": {"rope_scaling": "yarn", "rope_factor": 4.0, "rope_orig_ctx": 32, "rope_base": 100.0, "seed": 8},
    # llama3: per-pair frequency divisors between 1 and 8 (head_dim 8: 4 pairs)
    "rope_llama3_freqs": {"rope_freqs": np.array([1.0, 1.75, 3.5, 8.0], np.float32), "seed": 9},
}

ROPE_VARIANTS = ("rope_linear", "rope_yarn", "rope_llama3_freqs")

__all__ = ["ROPE_VARIANTS", "VARIANTS", "write_tiny"]
