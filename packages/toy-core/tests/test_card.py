"""Model cards: ModelSummary from GGUF metadata and the algorithm card's
shapes, for llama, qwen2, qwen3, gpt2, an unknown architecture and the real
model (expectations read with the independent ``gguf`` package)."""

from __future__ import annotations

import gguf
import numpy as np
import pytest

from toy.gguf import GGUFFile, GGUFWriter
from toy.models.card import algorithm_card, summarize, summary_from
from toy_testsupport import toy_test_models as mp


def _summary(path):
    with GGUFFile(path) as gf:
        return summarize(gf)


def test_llama_summary_and_card(tmp_path):
    s = _summary(mp.write_tiny_model(tmp_path / "l.gguf", n_layer=3, d=64, n_head=4, n_head_kv=2, d_ff=160))
    assert (s.architecture, s.name, s.n_layer, s.d_model) == ("llama", "tiny-llama", 3, 64)
    assert (s.n_head, s.n_head_kv, s.head_dim, s.d_ff, s.vocab, s.context_length) == (4, 2, 16, 160, 96, 128)
    assert (s.rope_base, s.rope_dims, s.rope_scaling) == (10000.0, 16, None)
    assert s.norm == "rms" and s.norm_eps == pytest.approx(1e-6)
    assert s.positions == "rope" and s.mlp == "swiglu"
    assert s.tied_output is True and not s.qkv_bias and not s.qk_norm
    assert s.weight_types == {"F32": s.n_tensors}
    assert s.n_params == 96 * 64 + 64 + 3 * (64 + 64 * 64 + 2 * 32 * 64 + 64 * 64 + 64 + 3 * 160 * 64)
    assert (s.tokenizer_model, s.tokenizer_pre, s.chat_template) == ("gpt2", "default", True)
    assert s.file_type == 0

    card = algorithm_card(s)
    for text in [
        "Algorithm: P ← llama(x | θ)",
        "T ≤ 128",
        "L = 3 layers, d = 64, d_ff = 160, V = 96",
        "H = 4 query heads, H_kv = 2 key/value heads (grouped-query, 2 query heads share each), d_h = 16",
        "X ← W_e[x, :]",
        "for l = 1, …, 3 do",
        "RMSNorm(X | γ_1[l]), ε = 1e-06",
        "Q ∈ ℝ^{T×4×16}, K ∈ ℝ^{T×2×16}, V ∈ ℝ^{T×2×16}",
        "θ_i = 10000^(−2i/16), all 16 dims, pairs (2i, 2i+1); no scaling",
        "g ← ⌈h/2⌉",
        "/ √16 + M",
        "W_o ∈ ℝ^{64×64}",
        "SwiGLU: W_gate, W_up ∈ ℝ^{64×160}, W_down ∈ ℝ^{160×64}",
        "Z ← X·W_eᵀ",
        "Z ∈ ℝ^{T×96}; output head tied",
        "return P = softmax(Z)",
    ]:
        assert text in card, f"{text!r} not in card:\n{card}"
    lines = [ln for ln in card.splitlines() if ln[:3].strip().rstrip(":").isdigit()]
    assert [int(ln.split(":")[0]) for ln in lines] == list(range(1, len(lines) + 1))  # numbered 1..n


def test_untied_bias_qknorm_variants(tmp_path):
    s = _summary(mp.write_tiny_model(tmp_path / "q2.gguf", arch="qwen2", tied=False, qkv_bias=True))
    assert s.tied_output is False and s.qkv_bias and not s.qk_norm
    card = algorithm_card(s)
    assert "Q ← Y·W_q[l] + b_q[l];  K ← Y·W_k[l] + b_k[l];  V ← Y·W_v[l] + b_v[l]" in card
    assert "NeoX pairs" in card
    assert "untied output head W_u ∈ ℝ^{64×96}" in card

    s = _summary(mp.write_tiny_model(tmp_path / "q3.gguf", arch="qwen3", qk_norm=True, n_head_kv=4))
    assert s.qk_norm and s.n_head_kv == s.n_head
    card = algorithm_card(s)
    assert "K ← RMSNorm(K | γ_k[l])" in card and "over d_h = 16 (QK-norm)" in card
    assert "H = 4 heads, d_h = 16" in card and "⌈" not in card  # no grouping when H_kv = H


def test_gpt2_card(tmp_path):
    s = _summary(mp.write_tiny_model(tmp_path / "g.gguf", arch="gpt2", d=64, n_head=4, d_ff=256))
    assert s.positions == "learned" and s.norm == "layer" and s.mlp == "gelu"
    assert s.qkv_fused and s.qkv_bias and s.biases and s.n_head_kv == 4
    assert s.rope_base is None
    card = algorithm_card(s)
    for text in [
        "X ← W_e[x, :] + W_p[0:T, :]",
        "learned positions W_p ∈ ℝ^{128×64}",
        "LayerNorm(X | γ_1[l], β_1[l])",
        "[Q, K, V] ← Y·W_qkv[l] + b_qkv[l]",
        "W_qkv ∈ ℝ^{64×192}",
        "+ b_o[l]",
        "GELU(Y·W_up[l] + b_up[l])·W_down[l] + b_down[l]",
        "LayerNorm(x | γ, β)",
    ]:
        assert text in card, f"{text!r} not in card:\n{card}"
    assert "RoPE" not in card


def test_rope_scaling_and_partial_rotary(tmp_path):
    md = {
        "general.architecture": "llama",
        "llama.block_count": 1,
        "llama.embedding_length": 64,
        "llama.attention.head_count": 2,
        "llama.rope.dimension_count": 16,
        "llama.rope.freq_base": 500000.0,
        "llama.rope.scaling.type": "yarn",
        "llama.rope.scaling.factor": 4.0,
        "llama.rope.scaling.original_context_length": 8192,
        "llama.feed_forward_length": np.array([96], dtype=np.uint32),  # a per-layer array
    }
    s = summary_from(md, {})
    assert (s.head_dim, s.n_head_kv, s.d_ff, s.rope_scaling, s.rope_scaling_factor) == (32, 2, 96, "yarn", 4.0)
    card = algorithm_card(s)
    assert "16 of 32 dims" in card and "yarn scaling ×4, original context 8192" in card and "500000" in card


def test_unknown_architecture_gets_generic_fields(tmp_path):
    g = GGUFWriter(tmp_path / "m.gguf")
    g.add("general.architecture", "mamba")
    g.add("mamba.block_count", 4)
    g.add("mamba.embedding_length", 32)
    g.add("mamba.context_length", 1024)
    g.add_tensor("token_embd.weight", np.zeros((10, 32), np.float32))
    g.write()
    s = _summary(tmp_path / "m.gguf")
    assert (s.architecture, s.n_layer, s.d_model, s.context_length, s.vocab) == ("mamba", 4, 32, 1024, 10)
    assert s.positions is None and s.mlp is None and s.n_params == 320
    card = algorithm_card(s)
    assert card.startswith("(no algorithm card") and "'mamba'" in card
    assert s.to_dict()["architecture"] == "mamba"

    empty = summary_from({}, {})
    assert empty.architecture is None and algorithm_card(empty).startswith("(no algorithm card")


@pytest.mark.model
def test_real_model_summary_matches_its_metadata(smollm2_path):
    path = smollm2_path
    ref = gguf.GGUFReader(path)  # the independent reader: expectations come from here

    def val(key):
        return ref.fields[key].contents()

    arch = val("general.architecture")
    n_head, n_kv, d = (
        val(f"{arch}.attention.head_count"),
        val(f"{arch}.attention.head_count_kv"),
        val(f"{arch}.embedding_length"),
    )
    names = {t.name for t in ref.tensors}
    s = _summary(path)
    assert s.architecture == arch == "llama"
    assert s.n_layer == val(f"{arch}.block_count")
    assert s.d_model == d
    assert (s.n_head, s.n_head_kv) == (n_head, n_kv)
    assert s.head_dim == d // n_head
    assert s.d_ff == val(f"{arch}.feed_forward_length")
    assert s.vocab == val(f"{arch}.vocab_size") == len(ref.fields["tokenizer.ggml.tokens"].data)
    assert s.context_length == val(f"{arch}.context_length")
    assert s.rope_base == val(f"{arch}.rope.freq_base")
    assert s.rope_dims == val(f"{arch}.rope.dimension_count")
    assert s.norm_eps == pytest.approx(val(f"{arch}.attention.layer_norm_rms_epsilon"))
    assert s.tied_output == ("output.weight" not in names)
    assert s.qkv_bias == ("blk.0.attn_q.bias" in names)
    assert s.n_params == sum(int(t.n_elements) for t in ref.tensors)
    assert s.n_tensors == len(ref.tensors)
    counts = {}
    for t in ref.tensors:
        counts[t.tensor_type.name] = counts.get(t.tensor_type.name, 0) + 1
    assert s.weight_types == dict(sorted(counts.items(), key=lambda kv: -s.weight_params[kv[0]]))
    assert s.file_type == val("general.file_type")
    assert s.tokenizer_model == val("tokenizer.ggml.model") and s.tokenizer_pre == val("tokenizer.ggml.pre")
    assert s.chat_template == ("tokenizer.chat_template" in ref.fields)

    card = algorithm_card(s)
    hd = d // n_head
    for text in [
        f"for l = 1, …, {s.n_layer} do",
        f"Q ∈ ℝ^{{T×{n_head}×{hd}}}, K ∈ ℝ^{{T×{n_kv}×{hd}}}",
        f"/ √{hd} + M",
        f"θ_i = {int(s.rope_base)}^(−2i/{s.rope_dims})",
        f"Z ∈ ℝ^{{T×{s.vocab}}}",
        f"T ≤ {s.context_length}",
        f"W_gate, W_up ∈ ℝ^{{{d}×{s.d_ff}}}",
    ]:
        assert text in card, f"{text!r} not in card:\n{card}"


def test_vocab_from_tokens_when_the_key_is_missing(tmp_path):
    from toy.gguf import GGUFFile

    g = GGUFWriter(tmp_path / "v.gguf")
    g.add("general.architecture", "llama")
    g.add("tokenizer.ggml.tokens", [f"tok{i}" for i in range(3000)])  # long: the reader keeps it lazy
    g.write()
    with GGUFFile(tmp_path / "v.gguf") as gf:
        assert summarize(gf).vocab == 3000
    assert summary_from({"tokenizer.ggml.tokens": ["a", "b"]}, {}).vocab == 2
