"""toy.eval: logprobs, perplexity, compare and lmc.

References:
- tiny seeded F32 models (``toy_test_models.write_tiny_model``) against the
  NumPy float64 forward (``toy_testsupport.reference.llama_np``), with the windows of
  llama-perplexity re-derived here by hand from its definition (not through
  ``toy.eval.windows``);
- the real SmolLM2 Q4_1 file against llama.cpp: ``fixtures/eval_llamacpp.json``,
  recorded once by ``tools/fixtures/record_eval_llamacpp.py`` with
  llama-cpp-python 0.3.36 (its provenance field says how). The text,
  ``fixtures/eval_text.md``, is a frozen copy of this project's
  docs/concepts/inference.md (our own prose; its sha256 is in the fixture).

Models load with ``kv_type="f32"`` for the NumPy comparisons (the reference
keeps K and V in float64), and with the defaults (F16 KV, as llama.cpp) for
the llama.cpp comparisons.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pytest

import toy
import toy.eval as E
from toy.errors import BadInputError
from toy.eval.windows import NLLStats, count_windows, windows
from toy.gguf import GGUFFile
from toy_testsupport import toy_test_models as mp
from toy_testsupport.reference import llama_np

FIX = Path(__file__).parent / "fixtures"
VOCAB = 96


def ref_logprobs(path, ids) -> np.ndarray:
    """(T, V) float64 log-softmax of the NumPy reference's logits."""
    from toy.models.llama import LlamaConfig

    with GGUFFile(path) as gf:
        cfg = LlamaConfig.from_gguf(gf)
        w = llama_np.load_weights(gf)
        logits = llama_np.forward_logits(cfg, w, np.asarray(ids))
    z = logits - logits.max(axis=1, keepdims=True)
    return z - np.log(np.exp(z).sum(axis=1, keepdims=True))


def ids_of(n, seed=3):
    return [int(t) for t in np.random.default_rng(seed).integers(2, VOCAB, size=n)]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    d = tmp_path_factory.mktemp("eval")
    md = {"tokenizer.ggml.merges": []}  # tokens "t0".."t95", no merges: the tests pass token ids

    def write(name, **kw):
        return mp.write_tiny_model(d / f"{name}.gguf", tied=False, **kw)

    return {
        "a": write("a", seed=1, extra_metadata=md),
        "b": write("b", seed=2, extra_metadata=md),
        "bos": write("bos", seed=1, extra_metadata={**md, "tokenizer.ggml.add_bos_token": True}),
        "small": write("small", seed=1, d_ff=64, extra_metadata=md),
    }


# ---------------------------------------------------------------- windows


def test_window_layout_is_llama_perplexity_s():
    ids = list(range(100, 150))  # 50 tokens
    got = list(windows(ids, 16, bos_id=7))
    assert len(got) == 3 == count_windows(50, 16)  # the 2-token tail is not scored
    for i, w in enumerate(got):
        assert w.start == 16 * i
        assert w.ids[0] == 7 and list(w.ids[1:]) == ids[16 * i + 1 : 16 * i + 16]
        assert list(w.rows) == list(range(8, 15))  # context//2 .. context-2
        assert list(w.targets) == ids[16 * i + 9 : 16 * i + 16]  # original tokens, never the BOS
    assert list(next(windows(ids, 16)).ids) == ids[:16]  # no BOS when the model adds none
    strided = list(windows(ids, 16, stride=4, bos_id=7))
    assert len(strided) == (50 - 16 + 3) // 4 == 9
    w = strided[-1]
    assert w.start == 32 and list(w.ids) == ids[32:48]  # no BOS with a stride (see the module docstring)
    assert list(w.rows) == [11, 12, 13, 14] and list(w.targets) == ids[44:48]
    assert len(list(windows(ids, 16, max_chunks=2))) == 2


@pytest.mark.parametrize(
    "n, kw, fragment",
    [
        (10, {"context": 16}, "needs at least 16"),
        (50, {"context": 2}, "at least 4"),
        (50, {"context": 16, "stride": 16}, "smaller"),
        (50, {"context": 16, "max_chunks": 0}, "max_chunks"),
    ],
)
def test_window_layout_errors(n, kw, fragment):
    with pytest.raises(BadInputError, match=fragment):
        list(windows(list(range(n)), **kw))


def test_nll_stats_match_numpy():
    v = np.random.default_rng(0).gamma(2.0, size=1000)
    s = NLLStats()
    s.add(v[:300])
    s.add(v[300:])
    assert s.count == 1000 and s.mean == pytest.approx(v.mean(), rel=1e-12)
    se = v.std(ddof=0) / np.sqrt(999)  # llama-perplexity: sqrt((E[x²] − E[x]²) / (n − 1))
    assert s.mean_stderr == pytest.approx(se, rel=1e-9)
    assert s.ppl_stderr == pytest.approx(se * np.exp(v.mean()), rel=1e-9)


# ---------------------------------------------------------------- tiny models vs NumPy


def test_logprobs_equal_numpy_reference(tiny):
    ids = ids_of(21)
    with toy.load(tiny["a"], n_ctx=32, kv_type="f32", threads=1) as m:
        res = E.logprobs(m, ids, top_k=4)
    ref = ref_logprobs(tiny["a"], ids)
    assert [t.id for t in res.tokens] == ids and res.tokens[0].logprob is None and res.n_scored == 20
    for i in range(1, len(ids)):
        t, row = res.tokens[i], ref[i - 1]
        assert t.logprob == pytest.approx(row[ids[i]], abs=2e-5)
        assert t.rank == 1 + int((row > row[ids[i]] + 1e-6).sum())
        order = np.argsort(-row)[:4]
        assert [j for j, _, _ in t.top] == [int(j) for j in order]
        np.testing.assert_allclose([lp for _, _, lp in t.top], row[order], atol=2e-5)
    assert res.nll == pytest.approx(-np.mean([ref[i - 1][ids[i]] for i in range(1, len(ids))]), abs=2e-5)


@pytest.mark.parametrize("which, stride", [("a", 0), ("bos", 0), ("a", 5)])
def test_perplexity_equals_numpy_reference(tiny, which, stride):
    ids = ids_of(70, seed=4)
    C = 16
    with toy.load(tiny[which], n_ctx=C, kv_type="f32", threads=1) as m:
        res = E.perplexity(m, ids, context=C, stride=stride)
    nll = []
    starts = range(0, 70 - C + 1, C) if stride == 0 else range(0, ((70 - C + stride - 1) // stride) * stride, stride)
    for s in starts:
        w = list(ids[s : s + C])
        if which == "bos":
            w[0] = 1  # the tiny tokenizer's BOS
        lp = ref_logprobs(tiny[which], w)
        first = C // 2 if stride == 0 else C - stride - 1
        nll += [-lp[j, ids[s + j + 1]] for j in range(first, C - 1)]
    nll = np.array(nll)
    assert res.n_scored == len(nll) and res.n_windows == len(starts)
    assert res.nll == pytest.approx(nll.mean(), abs=1e-5)
    assert res.ppl == pytest.approx(np.exp(nll.mean()), rel=1e-5)
    se = np.sqrt(((nll**2).mean() - nll.mean() ** 2) / (len(nll) - 1))
    assert res.nll_stderr == pytest.approx(se, rel=1e-3)
    assert res.window_ppl[-1] == res.ppl


def test_bos_substitution_changes_the_figure(tiny):
    ids = ids_of(40, seed=5)
    with (
        toy.load(tiny["a"], n_ctx=16, kv_type="f32", threads=1) as a,
        toy.load(tiny["bos"], n_ctx=16, kv_type="f32", threads=1) as b,
    ):
        assert E.perplexity(a, ids, context=16).ppl != E.perplexity(b, ids, context=16).ppl


def test_compare_self_and_other(tiny):
    ids = ids_of(64, seed=6)
    C = 16
    with (
        toy.load(tiny["a"], n_ctx=C, kv_type="f32", threads=1) as a,
        toy.load(tiny["b"], n_ctx=C, kv_type="f32", threads=1) as b,
    ):
        same = E.compare(a, a, ids, context=C)
        assert same.kl_mean == 0.0 and same.kl_percentiles["max"] == 0.0
        assert same.top1_agreement == 1.0 and same.ppl_a == same.ppl_b
        other = E.compare(a, b, ids, context=C)
        pa = E.perplexity(a, ids, context=C)
    kl, agree, n = [], 0, 0
    for s in range(0, 64, C):
        la = ref_logprobs(tiny["a"], ids[s : s + C])[C // 2 : C - 1]
        lb = ref_logprobs(tiny["b"], ids[s : s + C])[C // 2 : C - 1]
        kl += list((np.exp(la) * (la - lb)).sum(axis=1))
        agree += int((la.argmax(1) == lb.argmax(1)).sum())
        n += len(la)
    assert other.n_scored == n == 28
    assert other.kl_mean == pytest.approx(np.mean(kl), rel=1e-4) and other.kl_mean > 0.01
    assert other.kl_percentiles["p50"] == pytest.approx(np.percentile(kl, 50), rel=1e-4)
    assert other.kl_percentiles["max"] == pytest.approx(max(kl), rel=1e-4)
    assert other.top1_agreement == agree / n
    assert other.ppl_a == pytest.approx(pa.ppl, rel=1e-12)


def test_context_larger_than_loaded_is_an_error(tiny):
    with toy.load(tiny["a"], n_ctx=16, threads=1) as m:
        with pytest.raises(BadInputError, match="exceeds the 16 tokens"):
            E.perplexity(m, ids_of(80), context=32)
        with pytest.raises(BadInputError, match="exceed the model's 16-token"):
            E.logprobs(m, ids_of(20))


# ---------------------------------------------------------------- lmc


def test_lmc_endpoints_are_the_checkpoints_own_losses(tiny):
    ids = ids_of(64, seed=7)
    C = 16
    res = E.lmc(tiny["a"], tiny["b"], ids, [0.0, 0.5, 1.0], context=C, threads=1)
    own = []
    for p in (tiny["a"], tiny["b"]):
        with toy.load(p, n_ctx=C, threads=1) as m:
            own.append(E.perplexity(m, ids, context=C).nll)
    assert [p.alpha for p in res.points] == [0.0, 0.5, 1.0]
    assert res.points[0].nll == own[0] and res.points[2].nll == own[1]  # exactly: same weights, same kernels
    # the middle point against NumPy with interpolated weights
    from toy.models.llama import LlamaConfig

    with GGUFFile(tiny["a"]) as ga, GGUFFile(tiny["b"]) as gb:
        cfg = LlamaConfig.from_gguf(ga)
        wa, wb = llama_np.load_weights(ga), llama_np.load_weights(gb)
    mid = {k: 0.5 * wa[k].astype(np.float64) + 0.5 * wb[k] for k in wa}
    nll = []
    for s in range(0, 64, C):
        logits = llama_np.forward_logits(cfg, mid, np.asarray(ids[s : s + C]))
        z = logits - logits.max(1, keepdims=True)
        lp = z - np.log(np.exp(z).sum(1, keepdims=True))
        nll += [-lp[j, ids[s + j + 1]] for j in range(C // 2, C - 1)]
    assert res.points[1].nll == pytest.approx(np.mean(nll), abs=2e-3)  # F16 KV cache vs float64
    line = 0.5 * (own[0] + own[1])
    assert res.barrier == pytest.approx(res.points[1].nll - line, abs=1e-12)


def test_lmc_names_the_first_mismatch(tiny):
    with pytest.raises(BadInputError, match="d_ff"):
        E.lmc(tiny["a"], tiny["small"], ids_of(64), context=16, threads=1)


def test_parse_alphas():
    assert E.parse_alphas("0, 0.25,1") == [0.0, 0.25, 1.0]
    for bad, frag in [("", "no alphas"), ("0,x", "not a number"), ("0,nan", "not finite"), ("0,0", "repeat")]:
        with pytest.raises(BadInputError, match=frag):
            E.parse_alphas(bad)


# ---------------------------------------------------------------- inputs and runs


def test_read_eval_text(tmp_path):
    (tmp_path / "a.txt").write_bytes(b"\xef\xbb\xbfhello\nworld\n")
    assert E.read_eval_text(tmp_path / "a.txt") == "hello\nworld\n"
    (tmp_path / "b.jsonl").write_text('{"text": "one"}\n{"text": "two"}\n')
    assert E.read_eval_text(tmp_path / "b.jsonl") == "one\n\ntwo"
    (tmp_path / "bad.jsonl").write_text('{"text": "one"}\n{"text": 3}\n')
    with pytest.raises(BadInputError, match=":2"):
        E.read_eval_text(tmp_path / "bad.jsonl")
    with pytest.raises(BadInputError, match="no such file"):
        E.read_eval_text(tmp_path / "missing.txt")


def test_eval_run_bundle(tmp_path):
    with E.eval_run("perplexity", {"model": "m.gguf"}, runs_dir=tmp_path, model={"path": "m.gguf"}) as w:
        w.event("eval", name="perplexity", loss=1.5, ppl=4.48)
    with pytest.raises(RuntimeError):
        with E.eval_run("lmc", {"model": "m.gguf"}, runs_dir=tmp_path) as w:
            raise RuntimeError("boom")
    runs = sorted(
        tmp_path.iterdir(),
        key=lambda p: json.loads((p / "events.jsonl").read_text().splitlines()[0])["config"]["command"],
    )
    ev = [json.loads(x) for x in (runs[1] / "events.jsonl").read_text().splitlines()]
    assert ev[0]["run_kind"] == "eval" and ev[0]["config"] == {"command": "perplexity", "model": "m.gguf"}
    assert [e["kind"] for e in ev] == ["run_start", "eval", "run_end"] and ev[-1]["reason"] == "completed"
    ev = [json.loads(x) for x in (runs[0] / "events.jsonl").read_text().splitlines()]
    assert ev[-1]["reason"] == "errored" and "boom" in ev[-1]["error"]


# ---------------------------------------------------------------- the real model vs llama.cpp


@pytest.fixture(scope="module")
def lcpp():
    return json.loads((FIX / "eval_llamacpp.json").read_text())


@pytest.mark.avx2_reference
@pytest.mark.model
def test_perplexity_equals_llama_cpp(smollm2_path, lcpp):
    text = (FIX / "eval_text.md").read_text(encoding="utf-8")
    assert hashlib.sha256((FIX / "eval_text.md").read_bytes()).hexdigest() == lcpp["text_sha256"]
    ref = lcpp["perplexity"]
    with toy.load(smollm2_path, n_ctx=lcpp["context"], device="cpu") as m:
        ids = E.text_ids(m, E.read_eval_text(FIX / "eval_text.md"))
        assert E.read_eval_text(FIX / "eval_text.md") == text
        assert len(ids) == lcpp["n_tokens"]
        assert hashlib.sha256(np.asarray(ids, "<i4").tobytes()).hexdigest() == lcpp["ids_sha256"]
        res = E.perplexity(m, ids, context=lcpp["context"], max_chunks=ref["chunks"])
    assert res.n_scored == ref["n_scored"]
    assert res.ppl == pytest.approx(ref["ppl"], rel=1e-3)  # the issue's bound; seen: equal to ~1e-12
    assert res.ppl_stderr == pytest.approx(ref["ppl_stderr"], rel=1e-3)
    sums = np.diff([0.0] + [np.log(p) * n for p, n in zip(res.window_ppl, np.arange(1, 9) * (res.n_scored // 8))])
    np.testing.assert_allclose(sums, ref["window_nll_sums"], rtol=1e-4)


@pytest.mark.avx2_reference
@pytest.mark.model
def test_compare_q4_1_against_f32_equals_llama_cpp(smollm2_path, lcpp, tmp_path):
    from toy.gguf import quantize_model

    f32 = tmp_path / "smollm2-F32.gguf"
    quantize_model(smollm2_path, f32, "f32")
    ref = lcpp["compare"]
    with toy.load(f32, n_ctx=256, device="cpu") as a, toy.load(smollm2_path, n_ctx=256, device="cpu") as b:
        ids = E.text_ids(b, E.read_eval_text(FIX / "eval_text.md"))
        res = E.compare(a, b, ids, context=lcpp["context"], max_chunks=ref["chunks"])
    assert res.n_scored == ref["n_scored"]
    assert 0 < res.kl_mean < 0.01
    assert res.kl_mean == pytest.approx(ref["kl_mean"], rel=0.02)
    assert res.kl_percentiles["p99"] == pytest.approx(ref["kl_p99"], rel=0.05)
    assert abs(res.top1_agreement - ref["top1_agreement"]) <= 2 / res.n_scored
    assert res.ppl_a == pytest.approx(ref["ppl_a"], rel=1e-3)
    assert res.ppl_b == pytest.approx(ref["ppl_b"], rel=1e-3)
