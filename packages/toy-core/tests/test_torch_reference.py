"""The PyTorch training reference (toy_testsupport/torch_llama.py) checked on its own:
its forward against the NumPy float64 reference (toy_testsupport.reference.llama_np) on
tiny models of every unscaled-RoPE variant, its autograd gradients against
central finite differences, block-causal packing against separate rows, and
its AdamW wrapper against the update written out in NumPy."""

from __future__ import annotations

import numpy as np
import pytest

from toy.gguf import GGUFFile
from toy.models.llama import LlamaConfig
from toy_testsupport import torch_llama
from toy_testsupport.reference import llama_np
from toy_testsupport.tiny_llama import ROPE_VARIANTS, VARIANTS, write_tiny

PLAIN_VARIANTS = [n for n in VARIANTS if n not in ROPE_VARIANTS]
V = 64  # tiny_llama's vocabulary


def _load(tmp_path, name):
    path = write_tiny(tmp_path / f"{name}.gguf", **VARIANTS[name])
    with GGUFFile(path) as gf:
        return LlamaConfig.from_gguf(gf), llama_np.load_weights(gf)


def _row(a):
    return np.asarray(a)[None, :]


@pytest.mark.parametrize("name", PLAIN_VARIANTS)
def test_logits_match_numpy_reference(tmp_path, name):
    cfg, w = _load(tmp_path, name)
    rng = np.random.default_rng(1)
    T = 9
    ids = rng.integers(0, V, size=T)
    ref = llama_np.forward_logits(cfg, w, ids)
    got = torch_llama.logits(w, cfg, _row(ids), _row(np.arange(T)), np.zeros((1, T), int))
    assert got.shape == (1, T, V) and got.dtype == np.float64
    np.testing.assert_allclose(got[0], ref, rtol=0, atol=1e-10)
    # rows of a batch are independent
    ids2 = rng.integers(0, V, size=T)
    both = torch_llama.logits(w, cfg, np.stack([ids, ids2]), np.tile(np.arange(T), (2, 1)), np.zeros((2, T), int))
    np.testing.assert_allclose(both[0], ref, rtol=0, atol=1e-10)
    np.testing.assert_allclose(both[1], llama_np.forward_logits(cfg, w, ids2), rtol=0, atol=1e-10)


@pytest.mark.parametrize("name", ROPE_VARIANTS)
def test_rope_scaling_is_refused(tmp_path, name):
    cfg, w = _load(tmp_path, name)
    assert cfg.rope_scaling is not None
    with pytest.raises(ValueError, match="RoPE scaling"):
        torch_llama.logits(w, cfg, np.zeros((1, 3), int), _row(np.arange(3)), np.zeros((1, 3), int))


@pytest.mark.parametrize("name", ["gqa_untied", "qwen2_bias_neox", "qwen3_qknorm_neox"])
def test_block_causal_packing_equals_separate_rows(tmp_path, name):
    cfg, w = _load(tmp_path, name)
    rng = np.random.default_rng(2)
    d1, d2 = rng.integers(0, V, size=5), rng.integers(0, V, size=6)
    packed = _row(np.concatenate([d1, d2]))
    pos = _row(np.concatenate([np.arange(5), np.arange(6)]))
    doc = _row(np.array([0] * 5 + [1] * 6))
    got = torch_llama.logits(w, cfg, packed, pos, doc)[0]
    alone1 = torch_llama.logits(w, cfg, _row(d1), _row(np.arange(5)), np.zeros((1, 5), int))[0]
    alone2 = torch_llama.logits(w, cfg, _row(d2), _row(np.arange(6)), np.zeros((1, 6), int))[0]
    np.testing.assert_allclose(got[:5], alone1, rtol=0, atol=1e-10)
    np.testing.assert_allclose(got[5:], alone2, rtol=0, atol=1e-10)
    np.testing.assert_allclose(got[5:], llama_np.forward_logits(cfg, w, d2), rtol=0, atol=1e-10)
    # without the doc boundary the second document sees the first
    mixed = torch_llama.logits(w, cfg, packed, pos, np.zeros((1, 11), int))[0]
    assert np.abs(mixed[5:] - alone2).max() > 1e-3

    # the gradient of the packed row is the sum of the separate rows' gradients
    t1, t2 = rng.integers(0, V, size=5), rng.integers(0, V, size=6)
    m1, m2 = np.array([1.0, 1, 0, 1, 1]), np.array([1.0, 0, 1, 1, 1, 0.5])
    lp, gp = torch_llama.loss_and_grads(
        w, cfg, packed, pos, doc, _row(np.concatenate([t1, t2])), _row(np.concatenate([m1, m2])), 7.0
    )
    l1, g1 = torch_llama.loss_and_grads(w, cfg, _row(d1), _row(np.arange(5)), np.zeros((1, 5)), _row(t1), _row(m1), 7.0)
    l2, g2 = torch_llama.loss_and_grads(w, cfg, _row(d2), _row(np.arange(6)), np.zeros((1, 6)), _row(t2), _row(m2), 7.0)
    assert lp == pytest.approx(l1 + l2, rel=1e-12)
    for n in w:
        np.testing.assert_allclose(gp[n], g1[n] + g2[n], rtol=0, atol=1e-12, err_msg=n)


def _loss_by_hand(cfg, w, tokens, pos, doc, targets, mask, normalizer):
    z = torch_llama.logits(w, cfg, tokens, pos, doc)
    z = z - z.max(axis=-1, keepdims=True)
    logp = z - np.log(np.exp(z).sum(axis=-1, keepdims=True))
    nll = -np.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]
    return float((mask * nll).sum() / normalizer)


@pytest.mark.parametrize("name", ["qwen2_bias_neox", "qwen3_qknorm_neox", "partial_rope_normal"])
def test_gradients_match_finite_differences(tmp_path, name):
    cfg, w = _load(tmp_path, name)
    rng = np.random.default_rng(3)
    B, T = 2, 7
    tokens = rng.integers(0, V, size=(B, T))
    targets = rng.integers(0, V, size=(B, T))
    pos = np.array([[0, 1, 2, 3, 0, 1, 2], [0, 1, 2, 3, 4, 5, 6]])
    doc = np.array([[0, 0, 0, 0, 1, 1, 1], [2, 2, 2, 2, 2, 2, 2]])
    mask = np.array([[1, 1, 1, 0, 1, 1, 0], [1, 1, 1, 1, 1, 0.5, 1]], np.float64)
    norm = 9.5
    batch = (tokens, pos, doc, targets, mask, norm)
    loss, grads = torch_llama.loss_and_grads(w, cfg, *batch)
    assert loss == pytest.approx(_loss_by_hand(cfg, w, *batch), rel=1e-12)
    assert set(grads) == set(w)
    used = np.unique(tokens)
    h = 1e-5
    for n, p in w.items():
        g = grads[n]
        assert g.shape == p.shape and g.dtype == np.float64
        for k in range(3):
            if n == "token_embd.weight" and k < 2:  # rows of tokens in the batch (an unused row's is ~0)
                idx = (int(rng.choice(used)), int(rng.integers(p.shape[1])))
            else:
                idx = tuple(int(rng.integers(s)) for s in p.shape)
            wp = dict(w)
            plus, minus = p.copy(), p.copy()
            plus[idx] += h
            minus[idx] -= h
            wp[n] = plus
            lp = _loss_by_hand(cfg, wp, *batch)
            wp[n] = minus
            lm = _loss_by_hand(cfg, wp, *batch)
            fd = (lp - lm) / (2 * h)
            assert g[idx] == pytest.approx(fd, rel=1e-6, abs=1e-9), f"{n}{idx}: autograd {g[idx]} vs fd {fd}"


def _adamw_numpy(p, g, m, v, t, *, lr, b1, b2, eps, wd):
    p = p * (1 - lr * wd)
    m = b1 * m + (1 - b1) * g
    v = b2 * v + (1 - b2) * g * g
    mhat, vhat = m / (1 - b1**t), v / (1 - b2**t)
    return p - lr * mhat / (np.sqrt(vhat) + eps), m, v


@pytest.mark.parametrize("max_grad_norm", [None, 0.5])
def test_adamw_step_matches_the_update_written_out(max_grad_norm):
    rng = np.random.default_rng(4)
    params = {
        "a.weight": rng.standard_normal((3, 4)),
        "a_norm.weight": rng.standard_normal(4),
        "b": rng.standard_normal(2),
    }
    no_decay = {"a_norm.weight", "b"}
    hp = dict(lr=1e-2, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1)
    mine = {n: p.copy() for n, p in params.items()}
    m = {n: np.zeros_like(p) for n, p in params.items()}
    v = {n: np.zeros_like(p) for n, p in params.items()}
    state, cur = None, params
    for t in range(1, 4):
        grads = {n: rng.standard_normal(p.shape) * (t if n == "b" else 1) for n, p in params.items()}
        norm = np.sqrt(sum((g * g).sum() for g in grads.values()))
        scale = 1.0 if max_grad_norm is None else min(1.0, max_grad_norm / (norm + 1e-6))
        cur, state, got_norm = torch_llama.adamw_step(
            cur, grads, state, **hp, no_decay=no_decay, max_grad_norm=max_grad_norm
        )
        assert got_norm == pytest.approx(norm, rel=1e-12)
        for n in params:
            wd = 0.0 if n in no_decay else hp["weight_decay"]
            mine[n], m[n], v[n] = _adamw_numpy(
                mine[n],
                grads[n] * scale,
                m[n],
                v[n],
                t,
                lr=hp["lr"],
                b1=hp["beta1"],
                b2=hp["beta2"],
                eps=hp["eps"],
                wd=wd,
            )
            np.testing.assert_allclose(cur[n], mine[n], rtol=1e-12, atol=1e-14, err_msg=f"step {t} {n}")
    if max_grad_norm is not None:
        assert scale < 1.0  # the clip was exercised
    assert not np.shares_memory(cur["b"], params["b"]) and not np.array_equal(cur["b"], params["b"])
