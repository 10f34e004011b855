"""The logit lens and linear CKA (``toy.eval.lens``, ``toy.eval.cka``)
against independent float64 NumPy references.

- Lens logits of layer L are the logits of the same model cut after block
  L (same final norm and head): the NumPy references
  (``toy_testsupport.reference.llama_np``, ``toy_testsupport.gpt2_np``)
  run with ``n_layer = L + 1`` give them without any toy code.
- CKA's reference is the feature-space form of linear CKA,
  ‖Y_cᵀ X_c‖²_F / (‖X_cᵀ X_c‖_F ‖Y_cᵀ Y_c‖_F), over the references'
  residual streams (their ``hidden`` lists); toy computes the Gram form.

Tolerances: toy's forward is float32, the references float64; on these
tiny models (weights ~0.1) logits agree to ~1e-5 and probabilities,
KL and CKA to ~1e-5.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

import toy
import toy.eval as E
from toy.errors import BadInputError
from toy.eval.cka import cka_matrix, linear_cka
from toy.eval.lens import lens_logits, parse_positions, residual_streams
from toy.eval.score import window_logits
from toy.gguf import GGUFFile
from toy_testsupport import gpt2_np, tiny_archs
from toy_testsupport import toy_test_models as mp
from toy_testsupport.reference import llama_np

VOCAB = 96
MD = {"tokenizer.ggml.merges": []}  # tokens "t0".."t95": the tests pass token ids


def ids_of(n, seed=3):
    return [int(t) for t in np.random.default_rng(seed).integers(2, VOCAB, size=n)]


def log_softmax(z):
    z = z - z.max(axis=-1, keepdims=True)
    return z - np.log(np.exp(z).sum(axis=-1, keepdims=True))


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    d = tmp_path_factory.mktemp("lens")

    def write(name, **kw):
        return mp.write_tiny_model(d / f"{name}.gguf", extra_metadata=MD, **kw)

    return {
        "llama": write("llama", seed=1, n_layer=3, tied=False),
        "llama_b": write("llama_b", seed=2, n_layer=3, tied=False),
        "llama4": write("llama4", seed=5, n_layer=4, tied=True),
        "gpt2": write("gpt2", arch="gpt2", seed=3, n_layer=3),
        "other_vocab": write("other_vocab", seed=1, vocab=80),
    }


def llama_ref(path, ids):
    """(per-layer lens logits (L, T, V), hidden states [(T, d)] * L), float64."""
    from toy.models.llama import LlamaConfig

    with GGUFFile(path) as gf:
        cfg = LlamaConfig.from_gguf(gf)
        w = llama_np.load_weights(gf)
    hidden: list = []
    llama_np.forward_logits(cfg, w, np.asarray(ids), hidden=hidden)
    cut = [llama_np.forward_logits(replace(cfg, n_layer=k + 1), w, np.asarray(ids)) for k in range(cfg.n_layer)]
    return np.stack(cut), hidden


def gpt2_ref(path, ids):
    cfg, w = gpt2_np.load_gguf(path)
    hidden: list = []
    gpt2_np.forward(cfg, w, ids, hidden=hidden)
    cut = [gpt2_np.forward({**cfg, "n_layer": k + 1}, w, ids) for k in range(cfg["n_layer"])]
    return np.stack(cut), hidden


REFS = {"llama": llama_ref, "gpt2": gpt2_ref}
# logits: float32 vs float64; gpt2 also through ggml's float16 GELU table (see test_gpt2_inference's GELU_TOL)
TOL = {"llama": 5e-5, "gpt2": 5e-3}


# ---------------------------------------------------------------- the logit lens


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_lens_logits_equal_the_reference_cut_after_each_block(models, arch):
    ids = ids_of(12)
    ref, hidden = REFS[arch](models[arch], ids)
    with toy.load(models[arch], threads=1) as m:
        got, final = lens_logits(m, ids)
        streams, _ = residual_streams(m, ids)
    assert got.shape == ref.shape == (3, 12, VOCAB)
    assert got.dtype == np.float32
    np.testing.assert_allclose(got, ref, rtol=0, atol=TOL[arch])
    for s, h in zip(streams, hidden):
        np.testing.assert_allclose(s, h, rtol=0, atol=TOL[arch])
    # the last layer's lens is the model's own output (the same graph's head)
    np.testing.assert_array_equal(got[-1], final)


def check_top(top, ref_lp, tol):
    """``top`` [(id, text, prob)] is the reference's top k: in falling order, each
    probability the reference's, and none below the reference's k-th (up to tol)."""
    k = len(top)
    probs = np.exp(ref_lp)
    got = [q for _, _, q in top]
    assert got == sorted(got, reverse=True) and len({i for i, _, _ in top}) == k
    assert got == pytest.approx(probs[[i for i, _, _ in top]], abs=tol)
    assert min(got) >= np.sort(probs)[-k] - tol


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_lens_summary_matches_the_reference(models, arch):
    ids = ids_of(10, seed=11)
    ref, _ = REFS[arch](models[arch], ids)
    lp = log_softmax(ref)  # (L, T, V)
    positions = [0, 4, 9]
    tol = TOL[arch] / 2  # on probabilities and KL (both within the logits' error here)
    with toy.load(models[arch], threads=1) as m:
        res = E.logit_lens(m, ids, top_k=4, positions=positions)
    assert res.n_layer == 3 and res.n_tokens == 10 and [p.position for p in res.positions] == positions
    for p in res.positions:
        t = p.position
        assert p.id == ids[t] and p.next_id == (ids[t + 1] if t + 1 < 10 else None)
        pf = np.exp(lp[-1, t])
        check_top(p.final, lp[-1, t], tol)
        for c in p.layers:
            kl = float((pf * (lp[-1, t] - lp[c.layer, t])).sum())
            assert c.kl == pytest.approx(kl, abs=tol)
            check_top(c.top, lp[c.layer, t], tol)
            if p.next_id is None:
                assert c.next_prob is None
            else:
                assert c.next_prob == pytest.approx(np.exp(lp[c.layer, t, p.next_id]), abs=tol)
        assert p.layers[-1].kl == pytest.approx(0.0, abs=1e-9)
        assert p.layers[0].kl > 1e-3  # a tiny random model's first layer is far from its output


def cut_after(src, dst, keep: int):
    """``src`` with only its first ``keep`` blocks (block_count and the blk.* tensors)."""
    from toy.gguf import GGUFWriter

    with GGUFFile(src) as f:
        w = GGUFWriter(dst)
        for k, v in f.metadata.items():
            w.add(k, keep if k.endswith(".block_count") else v, f.types[k])
        for name in f.tensors:
            if not name.startswith("blk.") or int(name.split(".")[1]) < keep:
                w.add_tensor(name, f.tensor_to_float(name))
        return w.write()


@pytest.mark.parametrize("name", tiny_archs.NAMES)
def test_every_architectures_lens_is_the_engines_output_of_the_model_cut_there(tmp_path, name):
    """Every architecture (soft-caps, sliding windows, experts): layer L's
    lens equals the engine's logits of the same file cut after block L, and
    the last layer's the engine's own (an F32 KV cache: the lens keeps K and
    V float32; the engine's default F16 cache moves logits ~5e-3)."""
    path = tiny_archs.write(tmp_path / f"{name}.gguf", name)
    with toy.load(path, threads=1, kv_type="f32") as m:
        ids = m.prompt_ids("the lens of every layer")
        got, final = lens_logits(m, ids)
        engine = window_logits(m, np.asarray(ids, np.int32))
    assert got.shape[0] == tiny_archs.N_LAYER
    np.testing.assert_array_equal(got[-1], final)
    np.testing.assert_allclose(final, engine, rtol=0, atol=1e-4)
    for layer in range(tiny_archs.N_LAYER - 1):
        cut = cut_after(path, tmp_path / f"cut{layer}.gguf", layer + 1)
        with toy.load(cut, threads=1, kv_type="f32") as m:
            want = window_logits(m, np.asarray(ids, np.int32))
        np.testing.assert_allclose(got[layer], want, rtol=0, atol=1e-4)
        assert np.abs(got[layer] - final).max() > 1e-3  # an earlier layer's lens is something else


def test_lens_of_text_tokenizes_like_a_prompt(tmp_path):
    path = tiny_archs.write(tmp_path / "llama.gguf", "llama")
    with toy.load(path, threads=1) as m:
        res = E.logit_lens(m, "hello there", top_k=2, positions=[0, 1])
        ids = m.prompt_ids("hello there")
    assert [p.id for p in res.positions] == ids[:2]
    assert res.positions[0].next_id == ids[1]
    assert len(res.positions[0].layers[0].top) == 2
    d = res.to_dict()
    assert d["positions"][1]["layers"][1]["kl"] == res.positions[1].layers[1].kl
    assert d["positions"][0]["next"] == {"id": ids[1], "text": res.positions[0].next_text}


def test_lens_positions_from_the_end_and_max_tokens(models):
    ids = ids_of(10, seed=2)
    with toy.load(models["llama"], threads=1) as m:
        tail = E.logit_lens(m, ids, top_k=1, positions=[-1, 0])
        cut = E.logit_lens(m, ids, top_k=1, positions=[-1], max_tokens=6)
        short = E.logit_lens(m, ids[:6], top_k=1, positions=[5])
    assert [p.position for p in tail.positions] == [9, 0] and tail.positions[0].next_id is None
    assert cut.n_tokens == 6 and cut.positions == short.positions


def test_lens_refuses_bad_inputs(models):
    with toy.load(models["llama"], threads=1, n_ctx=16) as m:
        with pytest.raises(BadInputError, match="outside the text's 4 tokens"):
            E.logit_lens(m, ids_of(4), positions=[4])
        with pytest.raises(BadInputError, match="exceed the model's 128-token context"):
            E.logit_lens(m, ids_of(129))
        with pytest.raises(BadInputError, match="no tokens"):
            E.logit_lens(m, [])
        with pytest.raises(BadInputError, match="top_k"):
            E.logit_lens(m, ids_of(4), top_k=-1)
        with pytest.raises(BadInputError, match="max_tokens=0"):
            E.logit_lens(m, ids_of(4), max_tokens=0)


def test_parse_positions():
    assert parse_positions(None, 5) == [0, 1, 2, 3, 4]
    assert parse_positions("all", 3) == [0, 1, 2]
    assert parse_positions("0, 3-4,-1", 10) == [0, 3, 4, 9]
    assert parse_positions("-3--1", 10) == [7, 8, 9]
    for bad, frag in [("x", "not an integer"), ("10", "outside"), ("-11", "outside"), ("5-2", "backwards"),
                      (",", "no positions")]:  # fmt: skip
        with pytest.raises(BadInputError, match=frag):
            parse_positions(bad, 10)


# ---------------------------------------------------------------- CKA


def cka_features(x, y):
    """Linear CKA in its feature-space form (Kornblith et al. 2019, eq. for
    the linear kernel), float64."""
    x = np.asarray(x, np.float64) - np.mean(x, axis=0)
    y = np.asarray(y, np.float64) - np.mean(y, axis=0)
    return np.linalg.norm(y.T @ x) ** 2 / (np.linalg.norm(x.T @ x) * np.linalg.norm(y.T @ y))


def test_linear_cka_equals_the_feature_space_form():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((40, 16))
    y = x @ rng.standard_normal((16, 24)) + 0.5 * rng.standard_normal((40, 24))
    z = rng.standard_normal((40, 8))
    for a, b in [(x, y), (x, z), (y, z)]:
        assert linear_cka(a, b) == pytest.approx(cka_features(a, b), rel=1e-12)
        assert linear_cka(a, b) == pytest.approx(linear_cka(b, a), rel=1e-12)
    m = cka_matrix([x, y], [x, y, z])
    assert m.shape == (2, 3)
    assert m[0, 2] == pytest.approx(cka_features(x, z), rel=1e-12)
    assert m[1, 1] == pytest.approx(1.0, abs=1e-12)


def test_linear_cka_invariances():
    rng = np.random.default_rng(1)
    x = rng.standard_normal((50, 12))
    y = np.tanh(x @ rng.standard_normal((12, 12)))
    q, _ = np.linalg.qr(rng.standard_normal((12, 12)))  # orthogonal
    base = linear_cka(x, y)
    assert linear_cka(x, x) == pytest.approx(1.0, abs=1e-12)
    assert linear_cka(x @ q, y) == pytest.approx(base, rel=1e-10)
    assert linear_cka(3.7 * x, y) == pytest.approx(base, rel=1e-10)
    assert linear_cka(x + 5.0, y) == pytest.approx(base, rel=1e-10)  # column means removed
    # not invariant to an anisotropic scaling: the property tests above can fail
    assert abs(linear_cka(x * np.linspace(0.1, 10, 12), y) - base) > 1e-3
    assert 0.0 <= base <= 1.0


@pytest.mark.parametrize("seed", range(40))
def test_linear_cka_properties(seed):
    """For random activations of random shapes (seeded): symmetric, in
    [0, 1], 1 against itself, and the same after an orthogonal transform, an
    isotropic scaling or a shift of either side; the Gram form equals the
    feature-space form."""
    rng = np.random.default_rng(seed)
    t, dx, dy = (int(v) for v in rng.integers([3, 1, 1], [41, 25, 25]))
    scale = float(10 ** rng.uniform(-3, 3))
    x = rng.standard_normal((t, dx))
    y = np.tanh(x @ rng.standard_normal((dx, dy))) + 0.3 * rng.standard_normal((t, dy))
    q, _ = np.linalg.qr(rng.standard_normal((dy, dy)))
    base = linear_cka(x, y)
    assert base == pytest.approx(cka_features(x, y), rel=1e-9, abs=1e-12)
    assert base == pytest.approx(linear_cka(y, x), rel=1e-12, abs=1e-15)
    assert -1e-12 <= base <= 1.0 + 1e-12
    assert linear_cka(x, x) == pytest.approx(1.0, abs=1e-12)
    assert linear_cka(x, y @ q) == pytest.approx(base, rel=1e-8, abs=1e-12)
    assert linear_cka(scale * x, y) == pytest.approx(base, rel=1e-8, abs=1e-12)
    assert linear_cka(x, y - 7.0 * scale) == pytest.approx(base, rel=1e-8, abs=1e-12)


def test_cka_of_a_constant_layer_is_nan_and_null_in_json():
    x = np.ones((6, 4))
    assert np.isnan(linear_cka(x, np.arange(24.0).reshape(6, 4)))
    res = E.CKAResult(cka_matrix([x], [np.arange(24.0).reshape(6, 4)]), 6)
    assert res.to_dict()["matrix"] == [[None]]


def test_cka_of_a_checkpoint_with_itself_is_one(models):
    ids = ids_of(20, seed=5)
    with toy.load(models["llama"], threads=1) as a, toy.load(models["llama"], threads=1) as b:
        res = E.layer_cka(a, b, ids)
    assert res.matrix.shape == (3, 3) and res.n_tokens == 20
    assert res.diagonal == pytest.approx([1.0, 1.0, 1.0], abs=1e-12)
    assert (res.matrix <= 1.0 + 1e-12).all()


@pytest.mark.parametrize("pair", [("llama", "llama_b"), ("llama", "llama4"), ("gpt2", "llama")])
def test_cka_matches_the_reference(models, pair):
    ids = ids_of(24, seed=8)
    ha = REFS["gpt2" if pair[0] == "gpt2" else "llama"](models[pair[0]], ids)[1]
    hb = REFS["gpt2" if pair[1] == "gpt2" else "llama"](models[pair[1]], ids)[1]
    want = np.array([[cka_features(x, y) for y in hb] for x in ha])
    with toy.load(models[pair[0]], threads=1) as a, toy.load(models[pair[1]], threads=1) as b:
        res = E.layer_cka(a, b, ids)
    assert res.matrix.shape == want.shape
    np.testing.assert_allclose(res.matrix, want, rtol=0, atol=1e-4 if "gpt2" in pair else 1e-5)  # GELU table
    assert (res.diagonal is None) == (want.shape[0] != want.shape[1])


def test_cka_refuses_different_vocabularies(models):
    with toy.load(models["llama"], threads=1) as a, toy.load(models["other_vocab"], threads=1) as b:
        with pytest.raises(BadInputError, match="vocabularies differ"):
            E.layer_cka(a, b, ids_of(8))
        with pytest.raises(BadInputError, match="at least 2 tokens"):
            E.layer_cka(a, a, ids_of(1))
