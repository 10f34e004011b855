"""The GPT-2 reference models themselves (``gpt2_ref``, ``gpt2_np``), checked
before toy runs any of them.

Where each expected value comes from:

- the model: Hugging Face ``transformers`` (``GPT2LMHeadModel``, seeded
  random weights) and its float32 forward, ``gpt2_ref.hf_logits``;
- the file: llama.cpp's own ``convert_hf_to_gguf.py`` (llama-cpp-python
  0.3.36 sdist) run on that checkpoint, read back with the ``gguf`` package;
  its tensors must equal the HF state dict (Conv1D weights are ``(in, out)``
  in HF, ``(out, in)`` in NumPy order of the GGUF), and the converter must
  recognise the tokenizer's pre-tokenizer as ``gpt-2`` by its hash;
- ``gpt2_np``: a float64 NumPy forward written from the math, which must
  agree with HF within ``TOL`` (float32 rounding only, observed ~3e-6);
- ``fixtures/gpt2_llamacpp.json``: llama.cpp's greedy tokens for the same
  files (``tools/fixtures/record_gpt2_llamacpp.py``); the files re-created
  here must hash to the recorded sha256, and HF's greedy tokens must match.

The converted files are cached (``gpt2_ref.cache_root()``), so only a first
run pays for building them (~10 s per tiny file, more for small124m, which is
``slow``).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from toy_testsupport import gpt2_np, gpt2_ref

HERE = Path(__file__).resolve().parent
FIXTURE = HERE / "fixtures" / "gpt2_llamacpp.json"
TOL = 1e-4  # |gpt2_np - hf_logits|, absolute (logits are O(1))
LOGIT_TOL = 2e-2  # |llama.cpp - hf| on the recorded first logits (llama.cpp keeps K/V in F16)


PROMPTS = ["The capital of France is", "Once upon a time, there was a little", "1, 2, 3, 4, 5,"]


fields = gpt2_ref.read_gguf  # (metadata, GGUFReader) of a file, cached


def expected_tensors(cfg: dict, *, tied: bool = True) -> dict[str, tuple[int, ...]]:
    """GGUF tensor name -> shape in NumPy order (the reverse of ggml's ne)."""
    d, L, V, P = cfg["n_embd"], cfg["n_layer"], gpt2_ref.N_VOCAB, cfg["n_positions"]
    out = {
        "token_embd.weight": (V, d),
        "position_embd.weight": (P, d),
        "output_norm.weight": (d,),
        "output_norm.bias": (d,),
    }
    if not tied:
        out["output.weight"] = (V, d)
    for i in range(L):
        b = f"blk.{i}."
        out |= {
            b + "attn_norm.weight": (d,),
            b + "attn_norm.bias": (d,),
            b + "attn_qkv.weight": (3 * d, d),
            b + "attn_qkv.bias": (3 * d,),
            b + "attn_output.weight": (d, d),
            b + "attn_output.bias": (d,),
            b + "ffn_norm.weight": (d,),
            b + "ffn_norm.bias": (d,),
            b + "ffn_up.weight": (4 * d, d),
            b + "ffn_up.bias": (4 * d,),
            b + "ffn_down.weight": (d, 4 * d),
            b + "ffn_down.bias": (d,),
        }
    return out


def hf_as_gguf(sd: dict[str, np.ndarray], n_layer: int) -> dict[str, np.ndarray]:
    """The HF state dict under GGUF names in NumPy order (Conv1D ``(in, out)``
    weights transposed to ``(out, in)``)."""
    out = {
        "token_embd.weight": sd["transformer.wte.weight"],
        "position_embd.weight": sd["transformer.wpe.weight"],
        "output_norm.weight": sd["transformer.ln_f.weight"],
        "output_norm.bias": sd["transformer.ln_f.bias"],
    }
    if "lm_head.weight" in sd:
        out["output.weight"] = sd["lm_head.weight"]
    names = {
        "ln_1": "attn_norm",
        "attn.c_attn": "attn_qkv",
        "attn.c_proj": "attn_output",
        "ln_2": "ffn_norm",
        "mlp.c_fc": "ffn_up",
        "mlp.c_proj": "ffn_down",
    }
    for i in range(n_layer):
        for hf, gg in names.items():
            w = sd[f"transformer.h.{i}.{hf}.weight"]
            out[f"blk.{i}.{gg}.weight"] = w if hf.startswith("ln_") else w.T
            out[f"blk.{i}.{gg}.bias"] = sd[f"transformer.h.{i}.{hf}.bias"]
    return out


def gguf_arrays(reader) -> dict[str, np.ndarray]:
    from gguf.quants import dequantize

    return {
        t.name: dequantize(t.data, t.tensor_type).reshape(tuple(int(n) for n in reversed(t.shape.tolist())))
        for t in reader.tensors
    }


@pytest.fixture(scope="module")
def tiny():
    return gpt2_ref.hf_dir("tiny", 0), gpt2_ref.gguf_path("tiny", 0, "f32")


@pytest.fixture(scope="module")
def small():
    return gpt2_ref.hf_dir("small124m", 0), gpt2_ref.gguf_path("small124m", 0, "f32")


def fixture_model(shape: str, outtype: str) -> dict:
    rec = json.loads(FIXTURE.read_text())
    for m in rec["models"]:
        if m["recipe"]["shape"] == shape and m["recipe"]["outtype"] == outtype and m["recipe"]["seed"] == 0:
            return m
    raise AssertionError(f"{FIXTURE.name} has no {shape}/{outtype} model")


# ---------------------------------------------------------------- the file


def test_metadata_is_gpt2_with_the_real_vocabulary(tiny):
    hf, path = tiny
    f, _ = fields(path)
    cfg = gpt2_ref.SHAPES["tiny"]
    assert f["general.architecture"] == "gpt2"
    assert f["gpt2.block_count"] == cfg["n_layer"]
    assert f["gpt2.context_length"] == cfg["n_positions"]
    assert f["gpt2.embedding_length"] == cfg["n_embd"]
    assert f["gpt2.feed_forward_length"] == 4 * cfg["n_embd"]
    assert f["gpt2.attention.head_count"] == cfg["n_head"]
    assert f["gpt2.attention.layer_norm_epsilon"] == pytest.approx(1e-5)
    assert f["general.file_type"] == 0  # all F32
    # the converter's own hash check found GPT-2's pre-tokenizer
    assert f["tokenizer.ggml.model"] == "gpt2"
    assert f["tokenizer.ggml.pre"] == "gpt-2"
    # the tokenizer files round-trip (they come from llama.cpp's ggml-vocab-gpt-2.gguf)
    vocab = json.loads((hf / "vocab.json").read_text(encoding="utf-8"))
    assert f["tokenizer.ggml.tokens"] == sorted(vocab, key=vocab.get)
    merges = (hf / "merges.txt").read_text(encoding="utf-8").splitlines()
    assert merges[0].startswith("#version") and f["tokenizer.ggml.merges"] == merges[1:]
    # every token NORMAL (1) but <|endoftext|>, CONTROL (3)
    assert f["tokenizer.ggml.token_type"] == [1] * 50256 + [3]
    assert f["tokenizer.ggml.bos_token_id"] == f["tokenizer.ggml.eos_token_id"] == 50256
    assert f["tokenizer.ggml.add_bos_token"] is False
    assert gpt2_ref.tokenize(hf, "Hello world") == [15496, 995]  # GPT-2's well-known ids


def test_tensor_names_shapes_and_values_equal_hf(tiny):
    hf, path = tiny
    _, r = fields(path)
    cfg = gpt2_ref.SHAPES["tiny"]
    got = gguf_arrays(r)
    assert {n: a.shape for n, a in got.items()} == expected_tensors(cfg, tied=True)
    assert all(t.tensor_type.name == "F32" for t in r.tensors)
    sd = gpt2_ref.hf_state_dict(hf)
    assert "lm_head.weight" not in sd  # tied: saved once, as wte
    want = hf_as_gguf(sd, cfg["n_layer"])
    assert sorted(want) == sorted(got)
    for name, a in got.items():
        np.testing.assert_array_equal(a, want[name], err_msg=name)
    # the fused QKV: rows [0, d) are Q, [d, 2d) K, [2d, 3d) V
    d = cfg["n_embd"]
    c_attn = sd["transformer.h.0.attn.c_attn.weight"]
    np.testing.assert_array_equal(got["blk.0.attn_qkv.weight"][d : 2 * d], c_attn[:, d : 2 * d].T)


def test_q8_0_file_quantizes_the_matrices_only():
    hf = gpt2_ref.hf_dir("tiny", 0)
    f, r = fields(gpt2_ref.gguf_path("tiny", 0, "q8_0"))
    assert f["general.file_type"] == 7
    types = {t.name: t.tensor_type.name for t in r.tensors}
    for name, ty in types.items():
        matrix = name.endswith(".weight") and ("attn_" in name or "ffn_" in name) and "norm" not in name
        want = "Q8_0" if matrix or name == "token_embd.weight" else "F32"
        assert ty == want, name
    want = hf_as_gguf(gpt2_ref.hf_state_dict(hf), gpt2_ref.SHAPES["tiny"]["n_layer"])
    for name, a in gguf_arrays(r).items():
        w = want[name]
        if types[name] == "F32":
            np.testing.assert_array_equal(a, w, err_msg=name)
        else:  # scale d = absmax/127 per 32 values, stored as F16: error <= d/2 + 127 d 2^-11
            d = np.abs(w.reshape(-1, 32)).max(axis=1, keepdims=True) / 127
            assert np.all(np.abs(a.reshape(-1, 32) - w.reshape(-1, 32)) <= d * 0.57 + 1e-7), name


def test_conversion_is_deterministic(tiny, tmp_path):
    _, path = tiny
    hf = gpt2_ref.make_hf_gpt2(tmp_path / "again", seed=0, **gpt2_ref.SHAPES["tiny"])
    again = gpt2_ref.convert_to_gguf(hf, tmp_path / "again.gguf", "f32")
    assert gpt2_ref.sha256(again) == gpt2_ref.sha256(path)


def test_untied_model_writes_output_weight(tmp_path):
    cfg = {"n_layer": 1, "n_embd": 32, "n_head": 2, "n_positions": 16}
    hf = gpt2_ref.make_hf_gpt2(tmp_path / "untied", seed=3, tie=False, **cfg)
    sd = gpt2_ref.hf_state_dict(hf)
    assert "lm_head.weight" in sd
    path = gpt2_ref.convert_to_gguf(hf, tmp_path / "untied.gguf", "f32")
    _, r = fields.__wrapped__(path)
    got = gguf_arrays(r)
    assert {n: a.shape for n, a in got.items()} == expected_tensors(cfg, tied=False)
    np.testing.assert_array_equal(got["output.weight"], sd["lm_head.weight"])
    ids = [464, 3139, 286, 4881, 318]
    cfg_np, w = gpt2_np.load_gguf(r)
    np.testing.assert_allclose(gpt2_np.forward(cfg_np, w, ids), gpt2_ref.hf_logits(hf, ids), rtol=0, atol=TOL)


# ---------------------------------------------------------------- the forward


def check_np_forward(hf, path, prompts):
    cfg, w = gpt2_np.load_gguf(fields(path)[1])
    worst = 0.0
    for text in prompts:
        ids = gpt2_ref.tokenize(hf, text)
        ref = gpt2_np.forward(cfg, w, ids)
        got = gpt2_ref.hf_logits(hf, ids)
        assert got.shape == (len(ids), gpt2_ref.N_VOCAB) and got.dtype == np.float32
        worst = max(worst, float(np.abs(ref - got).max()))
    assert worst < TOL, worst


def test_numpy_forward_matches_hf(tiny):
    check_np_forward(*tiny, PROMPTS)


def test_hf_greedy_is_argmax_of_hf_logits(tiny):
    hf, _ = tiny
    ids = gpt2_ref.tokenize(hf, PROMPTS[0])
    out = gpt2_ref.hf_greedy(hf, ids, 3)
    seq = ids + out
    logits = gpt2_ref.hf_logits(hf, seq)
    assert out == [int(np.argmax(logits[len(ids) - 1 + i])) for i in range(3)]
    assert len(set(gpt2_ref.hf_greedy(hf, ids, 16))) > 4  # not one token repeated


# ---------------------------------------------------------------- llama.cpp


def check_fixture(shape, hf, path):
    m = fixture_model(shape, "f32")
    assert m["recipe"] == gpt2_ref.recipe(shape, 0, "f32")
    assert gpt2_ref.sha256(path) == m["sha256"], (
        "the re-created GGUF differs from the recorded one (torch, transformers or the recipe changed?): "
        "re-record with tools/fixtures/record_gpt2_llamacpp.py"
    )
    for p in m["prompts"]:
        assert gpt2_ref.tokenize(hf, p["text"]) == p["ids"]
        logits = gpt2_ref.hf_logits(hf, p["ids"])[-1]
        np.testing.assert_allclose(logits[:8], p["last_logits_head"], rtol=0, atol=LOGIT_TOL)
        assert gpt2_ref.hf_greedy(hf, p["ids"], len(p["greedy"])) == p["greedy"], p["text"]


def test_hf_greedy_matches_llamacpp_fixture(tiny):
    check_fixture("tiny", *tiny)


# ---------------------------------------------------------------- GPT-2 124M shape


@pytest.mark.slow
def test_small124m_file_and_forward(small):
    hf, path = small
    f, r = fields(path)
    cfg = gpt2_ref.SHAPES["small124m"]
    assert f["general.architecture"] == "gpt2" and f["tokenizer.ggml.pre"] == "gpt-2"
    assert f["gpt2.block_count"] == 12 and f["gpt2.attention.head_count"] == 12
    got = gguf_arrays(r)
    assert {n: a.shape for n, a in got.items()} == expected_tensors(cfg, tied=True)
    want = hf_as_gguf(gpt2_ref.hf_state_dict(hf), cfg["n_layer"])
    for name, a in got.items():
        np.testing.assert_array_equal(a, want[name], err_msg=name)
    del got, want
    check_np_forward(hf, path, PROMPTS[:1])


@pytest.mark.slow
def test_small124m_hf_greedy_matches_llamacpp_fixture(small):
    check_fixture("small124m", *small)
