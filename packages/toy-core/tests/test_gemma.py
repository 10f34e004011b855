"""Gemma 2 and Gemma 3 inference (``toy.models.gemma``) against Hugging Face
and against itself.

The models are ``gemma_ref``'s: seeded random ``Gemma2ForCausalLM`` /
``Gemma3ForCausalLM`` converted by llama.cpp's own converter, with a sliding
window of 8 that the 40-token sequences here exceed, both layer kinds
(gemma2: sliding on even layers; gemma3: layers 0-4 and 6 sliding, 5
global), soft-caps that bite, and an untied gemma3 head.

- Logits of whole sequences equal transformers' float32 eager forward within
  ``HF_ATOL`` (measured <= 7e-6) with the exact tanh GELU (toy's default is
  ggml's float16-table GELU, as llama.cpp, whose logits differ from HF's by
  ~3e-3; that one is compared with llama.cpp itself in
  test_gemma_llamacpp.py).
- Step-by-step decode through the KV cache (F32 cache; with and without flash
  attention, whose ``logit_softcap`` carries the attention cap) equals the
  whole-sequence forward within ``STEP_ATOL`` (measured <= 4e-6), for
  positions far past the window.
- Batched decode is bit-identical to solo decode (the server's promise).
- The window is not ignored: without it the logits past position 8 move.
- The config read from the file has the pattern, bases and caps HF's config
  says; variants toy does not run are refused by name.
"""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import numpy as np
import pytest

from toy import models
from toy.engine.llm import LLMEngine
from toy.gguf import GGUFFile
from toy_testsupport import gemma_ref
from toy_testsupport.reference.full import FullModel

SHAPES = ("gemma2-tiny", "gemma3-tiny", "gemma3-tiny-untied")
HF_ATOL = 1e-4
STEP_ATOL = 1e-4
N_TOK = 40
WINDOW = gemma_ref.SHAPES["gemma2-tiny"]["sliding_window"]


def _ids(seed: int = 0, n: int = N_TOK) -> list[int]:
    vocab = gemma_ref.sp_vocab_size()
    return [2] + [int(t) for t in np.random.default_rng(seed).integers(8, vocab, n - 1)]  # BOS, then text-ish ids


def _full(rt, shape, gelu="exact"):
    fm = FullModel.load(gemma_ref.gguf_path(shape, 0, "f32"), rt, kv_type=None)
    fm.cfg = dataclasses.replace(fm.cfg, gelu=gelu)
    return fm


@pytest.mark.parametrize("shape", SHAPES)
def test_logits_equal_transformers(rt, shape):
    ids = _ids()
    ref = gemma_ref.hf_logits(gemma_ref.hf_dir(shape, 0), ids)
    fm = _full(rt, shape)
    try:
        got = fm.logits(ids)
    finally:
        fm.close()
    assert got.shape == ref.shape
    assert np.abs(got - ref).max() <= HF_ATOL, np.abs(got - ref).max()


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("flash", [False, True], ids=["plain", "flash"])
def test_decode_equals_the_full_forward(rt, shape, flash):
    ids = _ids(1)
    fm = _full(rt, shape)
    eng = LLMEngine(fm.cfg, fm.weights, rt, n_ctx=64, n_slot=1, kv_type="f32", flash_attn=flash)
    try:
        full = fm.logits(ids)
        rows = [eng.prefill(0, ids[:5], all_logits=True)]
        rows += [eng.decode([0], [t]) for t in ids[5:]]
        step = np.concatenate(rows)
    finally:
        eng.close()
        fm.close()
    assert np.abs(step - full).max() <= STEP_ATOL, np.abs(step - full).max()


@pytest.mark.parametrize("shape", SHAPES)
def test_batched_decode_is_bit_identical_to_solo(rt, shape):
    a, b = _ids(2), _ids(3)
    fm = _full(rt, shape, gelu="table")
    eng = LLMEngine(fm.cfg, fm.weights, rt, n_ctx=64, n_slot=3)
    try:
        eng.prefill(0, a[:4])
        solo = [eng.decode([0], [t]) for t in a[4:30]]
        eng.prefill(1, a[:4])
        eng.prefill(2, b[:11])
        both = [eng.decode([1, 2], [t, u]) for t, u in zip(a[4:30], b[11:37])]
    finally:
        eng.close()
        fm.close()
    for s, bb in zip(solo, both):
        np.testing.assert_array_equal(bb[0:1], s)


def test_the_window_changes_the_logits_past_it(rt):
    ids = _ids(4)
    fm = _full(rt, "gemma3-tiny")
    try:
        with_window = fm.logits(ids)
        fm.cfg = dataclasses.replace(fm.cfg, sliding_window=10**6)  # the same layers, a window nothing exceeds
        fm._drop_steps()
        without = fm.logits(ids)
    finally:
        fm.close()
    np.testing.assert_array_equal(with_window[:WINDOW], without[:WINDOW])  # nothing to hide yet
    assert np.abs(with_window[WINDOW + 1 :] - without[WINDOW + 1 :]).max() > 0.05


def test_config_from_the_converted_files():
    with GGUFFile(gemma_ref.gguf_path("gemma2-tiny", 0, "f32")) as gf:
        g2 = models.config_from_gguf(gf)
    assert g2.architecture == "gemma2" and g2.tied_output and not g2.qk_norm
    assert g2.swa_layers == (True, False, True, False) and g2.sliding_window == WINDOW
    hf2 = gemma_ref.SHAPES["gemma2-tiny"]
    assert (g2.attn_softcap, g2.final_softcap) == (hf2["attn_logit_softcapping"], hf2["final_logit_softcapping"])
    assert g2.rope_base == g2.rope_base_swa == 10000.0
    with GGUFFile(gemma_ref.gguf_path("gemma3-tiny-untied", 0, "f32")) as gf:
        g3 = models.config_from_gguf(gf)
    hf3 = gemma_ref.SHAPES["gemma3-tiny-untied"]
    assert g3.architecture == "gemma3" and g3.qk_norm and not g3.tied_output
    assert g3.swa_layers == tuple(i % 6 < 5 for i in range(hf3["num_hidden_layers"]))
    assert g3.rope_base == hf3["rope_theta"] and g3.rope_base_swa == hf3["rope_local_base_freq"]
    assert g3.rope_freq_scale == 1.0 / hf3["rope_scaling"]["factor"]
    assert g3.attn_softcap == 0.0 and g3.final_softcap == (hf3["final_logit_softcapping"] or 0.0)
    assert g3.attn_scale == 1.0 / np.sqrt(hf3["head_dim"])


def _metadata(arch: str, **extra):
    md = {
        "general.architecture": arch,
        f"{arch}.block_count": 1,
        f"{arch}.embedding_length": 8,
        f"{arch}.attention.head_count": 2,
        f"{arch}.feed_forward_length": 16,
    }
    md.update(extra)
    return md


@pytest.mark.parametrize(
    "arch,match",
    [
        ("gemma3n", "Gemma 3n needs per-layer embeddings, AltUp"),
        ("gemma", "Gemma 1"),
        ("clip", "vision tower"),
        ("gemma-embedding", "EmbeddingGemma"),
    ],
)
def test_variants_toy_does_not_run_are_refused_by_name(arch, match):
    with pytest.raises(models.UnsupportedModelError, match=match):
        models.config_from_metadata(_metadata(arch), {})


def test_a_vision_tower_in_a_gemma3_file_is_refused():
    with pytest.raises(models.UnsupportedModelError, match="vision tower .'v.blk.0.attn_q.weight'"):
        models.config_from_metadata(_metadata("gemma3"), {"v.blk.0.attn_q.weight": None, "token_embd.weight": None})


def test_a_missing_tensor_is_named():
    with pytest.raises(models.UnsupportedModelError, match="lacks tensor 'token_embd.weight'"):
        models.config_from_metadata(_metadata("gemma2"), {})


def test_the_pattern_key_overrides_the_default():
    base = _metadata("gemma3", **{"gemma3.attention.sliding_window": 4, "gemma3.vocab_size": 8})
    tensors = dict.fromkeys(models.get("gemma3").params(_cfg(base)))
    cfg = models.config_from_metadata({**base, "gemma3.attention.sliding_window_pattern": [False]}, tensors)
    assert cfg.swa_layers == () and cfg.sliding_window == 0  # no sliding layer left
    cfg = models.config_from_metadata({**base, "gemma3.attention.sliding_window_pattern": 1}, tensors)
    assert cfg.swa_layers == ()  # a period of 1: every layer is global (llama.cpp's n - 1 = 0 sliding)


def _cfg(md):
    """A config for ``md`` with every tensor present (to list the tensors)."""
    from toy.models.gemma import GemmaConfig

    return GemmaConfig(
        n_vocab=8, d_model=8, n_layer=1, n_head=2, n_head_kv=2, head_dim=4, d_ff=16, rms_eps=1e-6,
        rope_base=1e4, rope_base_swa=1e4, qk_norm=md["general.architecture"] == "gemma3",
    )  # fmt: skip


def test_the_card_of_a_file_without_the_norm_epsilon_shows_the_default():
    """A file without ``attention.layer_norm_rms_epsilon`` runs with 1e-6 (the config's default); its
    algorithm card says so instead of failing to format a missing value."""
    from toy.models.card import algorithm_card, summary_from

    md = _metadata("gemma2", **{"gemma2.vocab_size": 8, "gemma2.context_length": 16})
    f32 = SimpleNamespace(name="F32")
    tensors = {n: SimpleNamespace(shape=p.shape, dtype=f32) for n, p in models.get("gemma2").params(_cfg(md)).items()}
    assert models.config_from_metadata(md, tensors).rms_eps == 1e-6
    card = algorithm_card(summary_from(md, tensors))
    assert "RMSNorm(X | γ_1[l]), ε = 1e-06" in card
