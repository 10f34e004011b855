"""The KV-cache engine (toy.engine.llm.LLMEngine) on tiny seeded models.

Every expected value comes from the float64 NumPy reference
(toy_testsupport.reference.llama_np, written from the math) or from an equality between
two engine paths (micro-batched vs one-batch prefill, batched vs solo
decode, truncated-and-refilled vs fresh cache).

Tolerances, relative to the largest |logit| of the reference:

- ``TOL_F32`` 1e-4: F32 weights and F32 K/V; only float32 rounding
  separates the engine from the float64 reference (observed <= 2e-6 on
  every variant over 40 tokens; the same bound as test_llama_forward);
- ``TOL_F16`` 1e-2: K/V (and, in ggml's CPU flash attention, Q and the
  V accumulator) rounded to F16, 11 significant bits, relative rounding
  4.9e-4 per value, amplified by two layers of these random models
  (observed <= 4e-3; test_llama_forward's F16 K/V test uses the same bound);
- ``TOL_Q8`` 0.15 for a Q8_0 KV cache against the unrounded reference: each
  block of 32 values shares one scale, 8-bit values (observed 5.1e-2). That
  check is loose, so the same run is also compared with the reference whose
  Q, K and V go through ggml's own Q8_0 round trip (ggml's CPU flash
  attention rounds Q to the K cache's dot-product type, Q8_0) within
  ``TOL_F32`` (observed 5e-7).
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest

import toy_ggml as tg
from toy.engine.llm import ContextOverflowError, LLMEngine
from toy.errors import ToyError
from toy.gguf import GGUFFile
from toy.gguf.convert import quantize_model
from toy.models.common import padded_length
from toy_testsupport.reference import llama_np
from toy_testsupport.reference.full import FullModel
from toy_testsupport.tiny_llama import ROPE_VARIANTS, VARIANTS, write_tiny

TOL_F32 = 1e-4
TOL_F16 = 1e-2
TOL_Q8 = 0.15
VOCAB = 64  # write_tiny's default vocabulary

# a model with head size 32 (a Q8_0 KV cache needs it) and d, d_ff multiples
# of 32 (so every weight matrix quantizes to Q8_0 without fallback)
WIDE = {"d": 64, "n_head": 2, "n_head_kv": 1, "head_dim": 32, "d_ff": 96, "seed": 11}


@pytest.fixture(scope="module")
def model_files(tmp_path_factory):
    """name -> path: every VARIANT, the wide F32 model and its Q8_0 copy."""
    d = tmp_path_factory.mktemp("tiny")
    files = {name: write_tiny(d / f"{name}.gguf", **kw) for name, kw in VARIANTS.items()}
    files["wide_f32"] = write_tiny(d / "wide_f32.gguf", **WIDE)
    quantize_model(files["wide_f32"], d / "wide_q8_0.gguf", "q8_0")
    files["wide_q8_0"] = d / "wide_q8_0.gguf"
    with GGUFFile(files["wide_q8_0"]) as gf:
        kinds = {gf.tensors[n].dtype for n in gf.tensors if n.endswith(".weight") and len(gf.tensors[n].shape) == 2}
    assert kinds == {tg.GGMLType.Q8_0}, kinds
    quantize_model(files["wide_f32"], d / "wide_q4_0.gguf", "q4_0")
    files["wide_q4_0"] = d / "wide_q4_0.gguf"
    quantize_model(files["wide_f32"], d / "wide_q4_1.gguf", "q4_1")
    files["wide_q4_1"] = d / "wide_q4_1.gguf"
    files["wide_tied_f32"] = write_tiny(d / "wide_tied_f32.gguf", **WIDE, tied=True)
    quantize_model(files["wide_tied_f32"], d / "wide_tied_q4_0.gguf", "q4_0")
    files["wide_tied_q4_0"] = d / "wide_tied_q4_0.gguf"
    return files


@pytest.fixture(scope="module")
def models(rt, model_files):
    """name -> FullModel (K/V unrounded, no padding) sharing the runtime."""
    opened = {}

    def get(name):
        if name not in opened:
            if name.endswith("_repack"):  # the weights in ggml's repacked layouts (toy.gguf.bind)
                opened[name] = FullModel.load(
                    model_files[name[: -len("_repack")]], rt, kv_type=None, kv_pad=1, repack=True
                )
            else:
                opened[name] = FullModel.load(model_files[name], rt, kv_type=None, kv_pad=1)
        if name.endswith("_repack") and not opened[name].weights.repacked:  # every test that asks
            pytest.skip(f"no repacked layout for {name} on this CPU ({tg.cpu_variant().tag})")
        return opened[name]

    yield get
    for m in opened.values():
        m.close()


def reference(model, ids, qkv_round=None):
    return llama_np.forward_logits(model.cfg, llama_np.load_weights(model.gguf), ids, qkv_round=qkv_round)


def rel_err(got, ref) -> float:
    return float(np.abs(np.asarray(got, np.float64) - ref).max() / np.abs(ref).max())


def engine(model, rt, **kw) -> LLMEngine:
    return LLMEngine(model.cfg, model.weights, rt, **kw)


def tokens(n, seed=10):
    return [int(t) for t in np.random.default_rng(seed).integers(0, VOCAB, size=n)]


def prefill_then_decode(e: LLMEngine, ids, k: int, slot: int = 0) -> np.ndarray:
    """Logits (len(ids), V): prefill of ids[:k] (all rows), then one decode
    step per remaining token."""
    rows = [e.prefill(slot, ids[:k], all_logits=True)]
    rows += [e.decode([slot], [t]) for t in ids[k:]]
    return np.concatenate(rows)


# 40 tokens: past rope_yarn's original context of 32, across the 32-cell
# padding of the attention length
SEQ = tokens(40)


# ---------------------------------------------------------------- vs the NumPy reference


@pytest.mark.parametrize("name", list(VARIANTS))
def test_prefill_then_decode_matches_reference(rt, models, name):
    m = models(name)
    ref = reference(m, SEQ)
    e = engine(m, rt, n_ctx=64, kv_type="f32")
    try:
        got = prefill_then_decode(e, SEQ, k=7)
        assert got.shape == (len(SEQ), VOCAB) and got.dtype == np.float32
        err = rel_err(got, ref)
        assert err < TOL_F32, f"{name}: max relative error {err:.2e}"
        assert e.cache.length(0) == len(SEQ) and e.cache.tokens(0) == SEQ
    finally:
        e.close()


def _unscaled(cfg):
    return dataclasses.replace(cfg, rope_scaling=None, rope_freq_scale=1.0, yarn_ext_factor=0.0, rope_attn_factor=1.0)


@pytest.mark.parametrize("name", ROPE_VARIANTS)
def test_rope_scaling_config_and_full_forward(models, name):
    """The scaling is read from the file (so the reference, which takes the
    same config, is not agreeing with the graph vacuously), it changes the
    logits, and FullModel's full-sequence forward matches the reference."""
    m = models(name)
    kw, cfg = VARIANTS[name], m.cfg
    want = {"rope_linear": "linear", "rope_yarn": "yarn", "rope_llama3_freqs": "llama3"}[name]
    assert cfg.rope_scaling == want
    assert cfg.rope_freq_scale == pytest.approx(1.0 / kw.get("rope_factor", 1.0))
    if name == "rope_yarn":
        assert (cfg.rope_orig_ctx, cfg.yarn_ext_factor, cfg.yarn_beta_fast, cfg.yarn_beta_slow) == (32, 1.0, 32.0, 1.0)
        assert len(SEQ) > cfg.rope_orig_ctx
    if name == "rope_llama3_freqs":
        np.testing.assert_array_equal(m.weights["rope_freqs.weight"].numpy(), kw["rope_freqs"])
    ref = reference(m, SEQ)
    plain = llama_np.forward_logits(_unscaled(cfg), llama_np.load_weights(m.gguf), SEQ)
    assert rel_err(plain, ref) > 100 * TOL_F32  # the scaling matters at this tolerance
    err = rel_err(m.logits(SEQ), ref)
    assert err < TOL_F32, f"{name}: FullModel max relative error {err:.2e}"


def test_rope_yarn_ramp():
    """The reference's YaRN angles at the corr dims of the rope_yarn variant
    (n_dims 8, base 100, original context 32: low 0, high 2): pair 0 keeps
    the extrapolated frequency, pair 1 the mean of both, pairs 2-3 the
    interpolated one; magnitude 1 + 0.1 ln 4."""
    pos = np.arange(3)
    ang, mscale = llama_np.rope_angles(
        pos, 8, 100.0, freq_scale=0.25, ext_factor=1.0, n_ctx_orig=32, beta_fast=32.0, beta_slow=1.0
    )
    theta = 100.0 ** (-2.0 * np.arange(4) / 8)
    mix = np.array([1.0, 0.5, 0.0, 0.0])
    np.testing.assert_allclose(ang, pos[:, None] * theta * (0.25 * (1 - mix) + mix), rtol=1e-15)
    assert mscale == pytest.approx(1 + 0.1 * np.log(4.0))
    lin, ms = llama_np.rope_angles(pos, 8, 100.0, freq_scale=0.25, freq_factors=np.array([1.0, 2.0, 4.0, 8.0]))
    np.testing.assert_allclose(lin, pos[:, None] * 0.25 * theta / [1.0, 2.0, 4.0, 8.0], rtol=1e-15)
    assert ms == 1.0


def test_micro_batched_prefill(rt, models):
    m = models("gqa_untied")
    ids = tokens(11, seed=3)
    ref = reference(m, ids)
    one, micro = engine(m, rt, n_ctx=32, kv_type="f32"), engine(m, rt, n_ctx=32, kv_type="f32", n_batch=3)
    try:
        a, b = one.prefill(0, ids, all_logits=True), micro.prefill(0, ids, all_logits=True)
        assert micro.stats.computes == 4 and one.stats.computes == 1  # 3 + 3 + 3 + 2 tokens
        assert b.shape == a.shape == (11, VOCAB)
        # different matrix shapes may sum in another order: float32 rounding apart
        np.testing.assert_allclose(b, a, rtol=0, atol=1e-5 * np.abs(a).max())
        assert rel_err(b, ref) < TOL_F32
        np.testing.assert_array_equal(a.argmax(1), b.argmax(1))
        # last-token logits only: the last micro-batch's last row (its final
        # FFN and head run on that one row, so float32 rounding apart)
        micro.cache.clear()
        np.testing.assert_allclose(micro.prefill(0, ids), b[-1], rtol=0, atol=1e-5 * np.abs(a).max())
        # greedy continuations agree
        greedy = []
        for e, row in ((one, a[-1]), (micro, b[-1])):
            out = []
            for _ in range(8):
                out.append(int(np.argmax(row)))
                row = e.decode([0], [out[-1]])[0]
            greedy.append(out)
        assert greedy[0] == greedy[1]
    finally:
        one.close()
        micro.close()


@pytest.mark.parametrize("kv_type", ["f32", "f16"])
def test_flash_attention(rt, models, kv_type):
    m = models("gqa_untied")
    ref = reference(m, SEQ)
    e = engine(m, rt, n_ctx=64, kv_type=kv_type, flash_attn=True)
    try:
        err = rel_err(prefill_then_decode(e, SEQ, k=7), ref)
        assert err < (TOL_F32 if kv_type == "f32" else TOL_F16), f"flash attention, {kv_type} K/V: {err:.2e}"
    finally:
        e.close()


def test_flash_attention_with_exact_batching_ignores_the_chunking(rt, models):
    """An exact-batching engine with flash attention (toy serve --flash-attn) gives a 100-token prompt
    the same logits and K/V whole (the attention reaches ggml's tiled kernel from 64 rows, which
    patch 0020's switch turns off) or cut into micro-batches of 64 or 7 tokens, and the same decode
    steps after it."""
    m = models("gqa_untied")
    ids = tokens(100, seed=3)
    results = []
    for n_batch in (512, 64, 7):
        e = engine(m, rt, n_ctx=128, flash_attn=True, exact_batching=True, n_batch=n_batch)
        try:
            rows = e.prefill(0, ids, all_logits=True)
            assert e.stats.computes == -(-len(ids) // n_batch)
            steps = [e.decode([0], [int(np.argmax(rows[-1]))])[0]]
            for _ in range(4):
                steps.append(e.decode([0], [int(np.argmax(steps[-1]))])[0])
            results.append((rows, np.stack(steps)))
        finally:
            e.close()
    for rows, steps in results[1:]:
        np.testing.assert_array_equal(rows, results[0][0])
        np.testing.assert_array_equal(steps, results[0][1])
    assert rel_err(results[0][0], reference(m, ids)) < TOL_F16


def test_f16_kv_without_flash_attention(rt, models):
    m = models("gqa_untied")
    e = engine(m, rt, n_ctx=64)  # the default KV type: f16
    try:
        err = rel_err(prefill_then_decode(e, SEQ, k=7), reference(m, SEQ))
        assert 0 < err < TOL_F16
    finally:
        e.close()


def _q8_0_round(x: np.ndarray) -> np.ndarray:
    """x (..., D) through ggml's Q8_0 quantize/dequantize (blocks of 32 along D)."""
    a = np.ascontiguousarray(x, np.float32)
    return tg.dequantize(tg.quantize(a, tg.GGMLType.Q8_0), tg.GGMLType.Q8_0, a.shape)


def test_q8_0_kv_cache(rt, models):
    m = models("wide_f32")
    with pytest.raises(ToyError, match="flash attention"):
        engine(m, rt, n_ctx=64, kv_type="q8_0")
    with pytest.raises(ToyError, match="multiple of 32"):  # head size 8
        engine(models("gqa_untied"), rt, n_ctx=64, kv_type="q8_0", flash_attn=True)
    e = engine(m, rt, n_ctx=64, kv_type="q8_0", flash_attn=True)
    try:
        got = prefill_then_decode(e, SEQ, k=7)
    finally:
        e.close()
    err = rel_err(got, reference(m, SEQ))
    assert 0 < err < TOL_Q8, f"Q8_0 K/V vs the unrounded reference: {err:.2e}"
    err = rel_err(got, reference(m, SEQ, qkv_round=_q8_0_round))
    assert err < TOL_F32, f"Q8_0 K/V vs the Q8_0-rounded reference: {err:.2e}"


# ---------------------------------------------------------------- batch invariance


def _greedy_schedule(e: LLMEngine, prompts, schedule):
    """Prefill prompt j into slot j, then one decode call per entry of
    ``schedule`` (a list of slot lists), each slot fed its greedy token.
    Returns per slot (logit rows (1 + steps, V), greedy tokens)."""
    rows = [[e.prefill(j, p)] for j, p in enumerate(prompts)]
    toks = [[] for _ in prompts]
    for slots in schedule:
        feed = [int(np.argmax(rows[s][-1])) for s in slots]
        out = e.decode(slots, feed)
        assert out.shape == (len(slots), VOCAB)
        for r, (s, t) in enumerate(zip(slots, feed)):
            toks[s].append(t)
            rows[s].append(out[r])
    return [(np.stack(r), t) for r, t in zip(rows, toks)]


SCHEDULES = {
    "all": [[0, 1, 2]] * 20,
    # subsets in other orders; slot 1 idles while [2, 0] decode
    "subsets": [[0, 1, 2]] * 5 + [[2, 0]] * 10 + [[1]] * 5 + [[1, 2, 0]] * 5,
    # consecutive runs of slots not starting at 0: one 4-D attention over a slot range
    "ranges": [[0, 1, 2]] * 5 + [[1, 2]] * 15 + [[0, 1]] * 3,
}


@pytest.mark.parametrize("attn", ["f16", "f16_flash"])
@pytest.mark.parametrize("schedule", list(SCHEDULES))
@pytest.mark.parametrize(
    "name", ["gqa_untied", "wide_q8_0", "wide_q4_0_repack", "wide_tied_q4_0_repack", "wide_q8_0_repack"]
)
def test_batched_decode_is_bit_exact(rt, models, name, schedule, attn):
    m = models(name)
    rng = np.random.default_rng(5)
    # Without flash attention the engine raises the pad to a multiple of
    # ggml's dot-product step (64 on AVX-512 CPU variants, 32 on AVX2).
    pad = 32 if attn == "f16_flash" else math.lcm(32, tg.sum_step())
    # with pad 32: 5, 30 and 45 tokens, attention lengths 32, 32 -> 64
    # (crossing during the steps) and 64 -> 96 -- the slots' padded lengths differ
    prompts = [[int(t) for t in rng.integers(0, VOCAB, size=n)] for n in (5, pad - 2, 2 * pad - 19)]
    plan = SCHEDULES[schedule]
    # flash attention pads the attention length to 256 by default (capped at
    # n_ctx): pad to 32 here too, so that the slots' lengths differ
    kw = {"kv_type": "f16", "flash_attn": attn == "f16_flash", "kv_pad": 32, "n_ctx": 3 * pad}
    solo = engine(m, rt, **kw)
    together = engine(m, rt, n_slot=3, **kw)
    assert solo.kv_pad == together.kv_pad == pad
    try:
        alone = []
        for j, p in enumerate(prompts):
            solo.cache.clear()
            steps = sum(j in s for s in plan)
            alone.append(_greedy_schedule(solo, [p], [[0]] * steps)[0])
        batched = _greedy_schedule(together, prompts, plan)
        # consecutive slots (without flash attention) took the one-attention path
        one = [k for k in together._graphs if k[0] == "decode1"]
        assert bool(one) == (attn == "f16"), one
        # the last step's attention lengths (the cached length padded to 32) differ
        assert len({padded_length(together.cache.length(j), pad) for j in range(3)}) == 3
        for j in range(3):
            rows, toks = batched[j]
            rows0, toks0 = alone[j]
            assert toks == toks0, f"slot {j}: greedy tokens differ"
            assert rows.shape == rows0.shape
            assert np.array_equal(rows, rows0), f"slot {j}: max |diff| {np.abs(rows - rows0).max():.3g}"
            assert together.cache.tokens(j) == prompts[j] + toks
    finally:
        solo.close()
        together.close()


# ---------------------------------------------------------------- context and cache bookkeeping


def test_context_overflow(rt, models):
    m = models("gqa_untied")
    ids = tokens(17, seed=4)
    e = engine(m, rt, n_ctx=16, n_slot=2, kv_type="f32", n_batch=4)
    try:
        with pytest.raises(ContextOverflowError, match=r"\b17 tokens exceed the context of 16 tokens") as exc:
            e.prefill(0, ids)
        assert isinstance(exc.value, ToyError) and exc.value.field == "prompt"  # the server's param: the input
        assert e.cache.length(0) == 0 and e.stats.computes == 0  # raised before any compute
        e.prefill(0, ids[:10])
        with pytest.raises(ContextOverflowError, match=r"\b17 tokens .* 16 tokens \(10 already in the sequence\)"):
            e.prefill(0, ids[10:])
        assert e.cache.length(0) == 10 and e.cache.tokens(0) == ids[:10]
        # exactly full is fine: the attention length is capped at n_ctx (16, not 32)
        full = e.prefill(0, ids[10:16], all_logits=True)
        assert rel_err(full, reference(m, ids[:16])[10:]) < TOL_F32
        assert e.cache.length(0) == 16
        with pytest.raises(ContextOverflowError, match=r"\b17 tokens exceed the context of 16"):
            e.decode([0], [1])
        e.prefill(1, ids[:5])
        computes = e.stats.computes
        with pytest.raises(ContextOverflowError):  # one full slot fails the whole step
            e.decode([1, 0], [1, 2])
        assert (e.cache.length(0), e.cache.length(1), e.stats.computes) == (16, 5, computes)
        row = e.decode([1], [ids[5]])[0]
        assert rel_err(row, reference(m, ids[:6])[-1]) < TOL_F32
    finally:
        e.close()


def test_truncate_and_prefix_reuse(rt, models):
    m = models("qwen2_bias_neox")
    ids = tokens(12, seed=6)
    other = ids[:7] + tokens(5, seed=7)
    assert other[7:] != ids[7:]
    e, fresh = engine(m, rt, n_ctx=32, kv_type="f32"), engine(m, rt, n_ctx=32, kv_type="f32")
    try:
        first = e.prefill(0, ids, all_logits=True)
        assert e.cache.common_prefix(0, ids) == 12
        assert e.cache.common_prefix(0, ids[:5]) == 5
        assert e.cache.common_prefix(0, ids + [1, 2]) == 12
        assert e.cache.common_prefix(0, other) == 7
        assert e.cache.common_prefix(0, []) == 0
        # the same suffix again after truncation
        e.cache.truncate(0, 7)
        assert e.cache.length(0) == 7 and e.cache.tokens(0) == ids[:7]
        again = e.prefill(0, ids[7:], all_logits=True)
        np.testing.assert_allclose(again, first[7:], rtol=0, atol=1e-5 * np.abs(first).max())
        fresh.prefill(0, ids[:7])
        np.testing.assert_array_equal(again, fresh.prefill(0, ids[7:], all_logits=True))
        # another suffix over the stale cells
        e.cache.truncate(0, e.cache.common_prefix(0, other))
        got = e.prefill(0, other[7:], all_logits=True)
        assert rel_err(got, reference(m, other)[7:]) < TOL_F32
        # decode right after a truncation: the stale cells past it are masked
        e.cache.truncate(0, 9)
        row = e.decode([0], [5])[0]
        assert rel_err(row, reference(m, other[:9] + [5])[-1]) < TOL_F32
        e.cache.truncate(0, 40)  # past the length: nothing to drop
        assert e.cache.length(0) == 10
        with pytest.raises(ToyError):
            e.cache.truncate(0, -1)
        e.cache.clear()
        assert e.cache.length(0) == 0
        np.testing.assert_array_equal(e.prefill(0, ids, all_logits=True), first)
    finally:
        e.close()
        fresh.close()


def test_graph_reuse(rt, models):
    m = models("gqa_untied")
    pad = math.lcm(32, tg.sum_step())  # the engine's attention-length step without flash attention
    e = engine(m, rt, n_ctx=2 * pad, kv_type="f32")
    try:
        assert e.kv_pad == pad
        e.prefill(0, [1, 2, 3])
        builds = e.stats.graph_builds
        e.prefill(0, [4, 5, 6])  # same size and attention length: the graph is reused
        assert e.stats.graph_builds == builds
        e.decode([0], [7])  # position 6: attention length pad
        builds = e.stats.graph_builds
        for t in range(pad - 7):  # positions 7 .. pad - 1, all within the first pad cells
            e.decode([0], [t])
        assert e.cache.length(0) == pad and e.stats.graph_builds == builds
        e.decode([0], [1])  # position pad: attention length 2 * pad, a new graph
        assert e.stats.graph_builds == builds + 1
        assert e.stats.decode_tokens == pad - 5 and e.stats.prefill_tokens == 6
    finally:
        e.close()


# ---------------------------------------------------------------- bad inputs


def test_bad_inputs(rt, models):
    m = models("gqa_untied")
    with pytest.raises(ToyError):
        engine(m, rt, n_ctx=16, n_batch=0)
    with pytest.raises(ToyError, match="q4_0"):
        engine(m, rt, n_ctx=16, kv_type="q4_0")
    e = engine(m, rt, n_ctx=16, n_slot=2, kv_type="f32")
    try:
        with pytest.raises(ToyError, match=str(VOCAB)):
            e.prefill(0, [1, VOCAB])
        with pytest.raises(ToyError, match="-1"):
            e.prefill(0, [-1])
        with pytest.raises(ToyError, match="no tokens"):
            e.prefill(0, [])
        with pytest.raises(ToyError, match="slot 2"):
            e.prefill(2, [1])
        e.prefill(0, [1, 2])
        e.prefill(1, [3])
        with pytest.raises(ToyError, match="distinct"):
            e.decode([0, 0], [1, 2])
        with pytest.raises(ToyError):
            e.decode([], [])
        with pytest.raises(ToyError, match="vocabulary"):
            e.decode([0, 1], [1, VOCAB])
        with pytest.raises(ToyError, match="vocabulary"):
            e.decode([0], [-1])
        with pytest.raises(ToyError, match="2 tokens for 1 slots"):
            e.decode([0], [1, 2])
        with pytest.raises(ToyError, match="slot 5"):
            e.decode([5], [1])
        assert (e.cache.length(0), e.cache.length(1), e.stats.computes) == (2, 1, 2)
    finally:
        e.close()


def test_bad_negative_id_is_named(rt, models):
    e = engine(models("gqa_untied"), rt, n_ctx=16, kv_type="f32")
    try:
        with pytest.raises(ToyError, match="token id -1 "):
            e.prefill(0, [5, -1])
    finally:
        e.close()


def _like_plain(rt, packed, plain, ids) -> np.ndarray:
    """Prefill (5 tokens) then decode logits of ``packed``: within float32 rounding of ``plain``'s, the same
    greedy tokens; returns them."""
    want = prefill_then_decode(engine(plain, rt, n_ctx=64), ids, 5)
    got = prefill_then_decode(engine(packed, rt, n_ctx=64), ids, 5)
    assert rel_err(got, want) < 1e-5, rel_err(got, want)
    assert [int(np.argmax(r)) for r in got] == [int(np.argmax(r)) for r in want]
    return got


def test_repacked_weights_give_the_plain_logits_within_rounding(rt, models):
    """The Q4_0 model with its projections in ggml's repacked layout (toy.gguf.bind, ``repack``): prefill and
    decode logits within float32 rounding of the same file's plain weights (the same quantized values, the
    products summed in the repacked kernels' order), and the same greedy tokens."""
    packed, plain = models("wide_q4_0_repack"), models("wide_q4_0")
    names = packed.weights.repacked
    assert names and all(n.startswith("blk.") or n == "output.weight" for n in names)
    assert not any(n.endswith(("token_embd.weight", "norm.weight")) for n in names)
    assert not plain.weights.repacked
    _like_plain(rt, packed, plain, tokens(12, seed=3))
    assert "output.weight" in names and not packed.weights.product_copies  # an untied head is repacked itself


@pytest.mark.parametrize("qtype", ["q8_0", "q4_1"])
def test_toys_own_layouts_give_the_plain_logits_bit_for_bit(rt, models, qtype):
    """Q8_0 and Q4_1 in toy's repacked layouts (patch 0028: Q4_1 with AVX2, Q8_0 with AVX-512 VNNI): every
    product sums as the plain layout's one-row kernel does, so decode logits are the plain model's bit for
    bit, and so is a prefill that takes that kernel: Q4_1's always (the plain layout has no tinyBLAS kernel
    for it), Q8_0's with exact batching (unhinted, the plain Q8_0 prefill goes to tinyBLAS, whose sums need
    not be these)."""
    packed, plain = models(f"wide_{qtype}_repack"), models(f"wide_{qtype}")
    assert {n.split(".", 2)[-1] for n in packed.weights.repacked} >= {"attn_q.weight", "ffn_down.weight"}
    ids = tokens(12, seed=4)
    for kw in ({}, {"exact_batching": True}) if qtype == "q8_0" else ({},):
        want = prefill_then_decode(engine(plain, rt, n_ctx=64, **kw), ids, 5)
        got = prefill_then_decode(engine(packed, rt, n_ctx=64, **kw), ids, 5)
        if kw or qtype == "q4_1":
            assert got.tobytes() == want.tobytes(), kw
        else:
            assert rel_err(got, want) < 1e-5, rel_err(got, want)


def test_tied_head_reads_a_repacked_copy_of_the_embedding(rt, models, model_files):
    """A head tied to the Q4_0 token embedding: the embedding stays in the file for its lookup (GET_ROWS reads
    it), and the head's product reads a repacked copy (``product_copies``): logits within float32 rounding of
    the plain weights' and of the same load without the copy, and the same greedy tokens. (Exact batching
    with the copy: test_batched_decode_is_bit_exact's ``wide_tied_q4_0_repack``.)"""
    packed, plain = models("wide_tied_q4_0_repack"), models("wide_tied_q4_0")
    assert "output.weight" not in packed.gguf.tensors
    assert "token_embd.weight" not in packed.weights.repacked
    head = packed.weights.product_copies["token_embd.weight"]
    assert head is not packed.weights["token_embd.weight"]
    with pytest.raises(tg.GGMLError):  # a repacked tensor cannot be read back
        head.raw()
    assert np.array_equal(packed.weights["token_embd.weight"].raw(), plain.weights["token_embd.weight"].raw())
    assert not plain.weights.product_copies
    ids = tokens(12, seed=4)
    got = _like_plain(rt, packed, plain, ids)
    uncopied = FullModel.load(model_files["wide_tied_q4_0"], rt, kv_type=None, kv_pad=1, repack=True)
    try:
        uncopied.weights.product_copies.clear()  # the projections repacked, the head on the file's embedding
        other = prefill_then_decode(engine(uncopied, rt, n_ctx=64), ids, 5)
    finally:
        uncopied.close()
    assert not np.array_equal(got, other)  # the head's product went through the repacked kernel
    assert rel_err(got, other) < 1e-5, rel_err(got, other)


def test_a_damaged_weight_is_named_when_repacking_and_loads_as_it_is_without(rt, model_files, tmp_path):
    """A Q4_0 projection with a NaN block scale (ggml's row check refuses to repack it): the load with
    ``repack`` is a GGUFError naming the tensor (raised from the threads that repack, the other weights'
    buffer freed), and ``repack=False`` loads the file as it is."""
    from toy.gguf import GGUFError

    src = model_files["wide_q4_0"]
    with GGUFFile(src) as gf:
        info = gf.tensors["blk.1.ffn_up.weight"]
        at = gf.data_offset + info.offset
    if not rt.repack_layout(info.dtype, info.shape):
        pytest.skip(f"no repacked Q4_0 layout on this CPU ({tg.cpu_variant().tag})")
    data = bytearray(src.read_bytes())
    data[at : at + 2] = np.array([np.nan], np.float16).tobytes()  # the first block's scale
    bad = tmp_path / "damaged.gguf"
    bad.write_bytes(bytes(data))
    with pytest.raises(GGUFError, match=r"'blk\.1\.ffn_up\.weight' \(Q4_0\)") as e:
        FullModel.load(bad, rt, kv_type=None, kv_pad=1, repack=True)
    if "repack=False" not in str(e.value) + str(getattr(e.value, "hint", "")):
        raise AssertionError(f"no hint to load without repacking: {e.value!r}")
    m = FullModel.load(bad, rt, kv_type=None, kv_pad=1, repack=False)
    m.close()
