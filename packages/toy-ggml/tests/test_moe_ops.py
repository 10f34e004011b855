"""The mixture-of-experts ops toy-ggml patches 0015 and 0016 make usable:
MUL_MAT_ID's backward (through the new OUT_PROD_ID op), the batched GET_ROWS
gradient the router's gather needs, CLAMP's backward, the row-invariant hint
on MUL_MAT_ID, and ``Context.argsort_top_k``.

Gradients are compared with central finite differences of ggml's own forward
(``test_backward.grad_check``: the same tolerances as every backward test),
and where the forward quantizes (frozen quantized experts) with the analytic
gradient in NumPy float64 on the dequantized weights.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest

import toy_ggml as tg


def _backward_helpers():
    """test_backward.py's gradient checkers (pytest imports test modules by path, not by name)."""
    spec = importlib.util.spec_from_file_location("_toy_test_backward", Path(__file__).with_name("test_backward.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.ggml_grads, mod.grad_check


ggml_grads, grad_check = _backward_helpers()

F32, I32 = tg.GGMLType.F32, tg.GGMLType.I32
E, M, K, T, S = 5, 6, 7, 4, 3
# (T, S): token 1 routes both its first slots to expert 1; expert 4 appears on tokens 0 and 2
IDS = np.array([[0, 2, 4], [1, 1, 3], [4, 0, 2], [3, 2, 0]], np.int32)


@pytest.mark.parametrize("U", [1, S], ids=["broadcast-input", "input-per-slot"])
def test_mul_mat_id_gradients_match_finite_differences(rt, U):
    rng = np.random.default_rng(U)
    w = rng.standard_normal((E, M, K)).astype(np.float32)
    b = rng.standard_normal((T, U, K)).astype(np.float32)
    grad_check(rt, lambda c, ww, x, i: c.mul_mat_id(ww, x, i), [w, b], [IDS])


def test_mul_mat_id_expert_gradient_is_the_routed_outer_products(rt):
    # d experts[e] = sum over (t, s) routed to e of grad[t, s] (outer) b[t, s]: exactly what the
    # OUT_PROD_ID kernel sums, checked against NumPy (an expert no token chose gets zeros)
    rng = np.random.default_rng(7)
    w = rng.standard_normal((E + 1, M, K)).astype(np.float32)  # expert 5: never routed
    b = rng.standard_normal((T, S, K)).astype(np.float32)
    (gw, gb), _, up = ggml_grads(rt, lambda c, ww, x, i: c.mul_mat_id(ww, x, i), [w, b], [IDS])
    want = np.zeros((E + 1, M, K))
    for t in range(T):
        for s in range(S):
            want[IDS[t, s]] += np.outer(up[t, s].astype(np.float64), b[t, s].astype(np.float64))
    np.testing.assert_allclose(gw, want, rtol=1e-5, atol=1e-5)
    assert not gw[E].any()


def test_mul_mat_id_gradients_do_not_depend_on_threads():
    rng = np.random.default_rng(8)
    w = rng.standard_normal((E, M, K)).astype(np.float32)
    b = rng.standard_normal((T, 1, K)).astype(np.float32)
    outs = []
    for threads in (1, 2, 3):
        r = tg.Runtime("cpu", threads=threads)
        try:
            (gw, gb), _, _ = ggml_grads(r, lambda c, ww, x, i: c.mul_mat_id(ww, x, i), [w, b], [IDS])
            outs.append((gw, gb))
        finally:
            r.close()
    for gw, gb in outs[1:]:
        np.testing.assert_array_equal(gw, outs[0][0])
        np.testing.assert_array_equal(gb, outs[0][1])


def test_input_gradient_through_frozen_quantized_experts(rt):
    # QLoRA through an MoE: the experts stay Q8_0 (no gradient); the input's gradient is the
    # product with the dequantized experts, transposed (NumPy float64 on the same values)
    rng = np.random.default_rng(9)
    K32 = 64  # a Q8_0 row is whole blocks of 32
    w = rng.standard_normal((E, M, K32)).astype(np.float32)
    raw = tg.quantize(w.reshape(-1, K32), tg.GGMLType.Q8_0)
    deq = tg.dequantize(raw, tg.GGMLType.Q8_0, (E * M, K32)).reshape(E, M, K32).astype(np.float64)
    b = rng.standard_normal((T, 1, K32)).astype(np.float32)
    up = rng.standard_normal((T, S, M)).astype(np.float32)
    with tg.Context(max_tensors=256) as ctx:
        tw = ctx.tensor(tg.GGMLType.Q8_0, (E, M, K32))
        tb = ctx.tensor(F32, b.shape).set_param()
        ti = ctx.tensor(I32, IDS.shape)
        tu = ctx.tensor(F32, up.shape)
        loss = ctx.sum(ctx.mul(ctx.mul_mat_id(tw, tb, ti), tu)).set_loss()
        g = tg.Graph(ctx, size=512, grads=True)
        g.build_forward(loss)
        g.build_backward()
        gb = g.grad(tb).set_output()
        g.build_forward(gb)
        ctx.allocate(rt)
        tw.set_raw(raw)
        tb.set(b)
        ti.set(IDS)
        tu.set(up)
        g.reset()
        rt.compute(g)
        got = gb.numpy().copy()
    want = np.zeros((T, 1, K32))
    for t in range(T):
        for s in range(S):
            want[t, 0] += deq[IDS[t, s]].T @ up[t, s].astype(np.float64)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-4)


def test_batched_get_rows_gradient(rt):
    # the router's gather: probabilities (T, E, 1), each token's k chosen experts (T, k)
    rng = np.random.default_rng(10)
    p = rng.standard_normal((T, E, 1)).astype(np.float32)
    idx = np.array([[4, 1], [0, 0], [3, 2], [2, 4]], np.int32)  # token 1 gathers expert 0 twice
    grad_check(rt, lambda c, a, i: c.get_rows(a, i), [p], [idx])


def test_clamp_gradient(rt):
    # inside the bounds the derivative is 1, outside 0 (inputs kept 5 eps from the bounds)
    x = np.array([[-3.0, -1.2, -0.5, 0.0, 0.7, 1.3, 2.5, 0.2]], np.float32)
    grad_check(rt, lambda c, a: c.clamp(a, -1.0, 1.0), [x])
    (g,), _, up = ggml_grads(rt, lambda c, a: c.clamp(a, -1.0, float("inf")), [x])
    np.testing.assert_array_equal(g, np.where(x > -1.0, up, 0.0).astype(np.float32))


def test_argsort_top_k(rt):
    # largest first; equal values: the lower index first (rows of at most 16, libstdc++)
    x = np.array([[0.1, 0.9, 0.5, 0.9, 0.3], [2.0, 2.0, 2.0, 1.0, 3.0]], np.float32)
    with tg.Context(max_tensors=16) as ctx:
        t = ctx.tensor(F32, x.shape)
        out = ctx.cont(ctx.argsort_top_k(t, 3))
        g = tg.Graph(ctx, size=16).build_forward(out)
        ctx.allocate(rt)
        t.set(x)
        rt.compute(g)
        got = out.numpy().copy()
    np.testing.assert_array_equal(got, [[1, 3, 2], [4, 0, 1]])
    with tg.Context(max_tensors=16) as ctx, pytest.raises(ValueError, match="k=6"):
        ctx.argsort_top_k(ctx.tensor(F32, (2, 5)), 6)


@pytest.mark.parametrize("qt", [tg.GGMLType.Q4_K, tg.GGMLType.Q6_K, tg.GGMLType.Q8_0])
def test_row_invariant_mul_mat_id(rt, qt):
    # patch 0015: with the hint, 24 tokens routed mostly to one expert (>= 8 rows: the tiled
    # K-quant path without it) give each token the bits it gets alone
    rng = np.random.default_rng(11)
    Kq, n = 256, 24
    w = rng.standard_normal((3, 16, Kq)).astype(np.float32)
    raw = tg.quantize(w.reshape(-1, Kq), qt)
    b = rng.standard_normal((n, 1, Kq)).astype(np.float32)
    ids = np.where(np.arange(n) % 5 == 0, 2, 0).astype(np.int32).reshape(n, 1)

    def run(xs, ii):
        with tg.Context(max_tensors=16) as ctx:
            tw = ctx.tensor(qt, (3, 16, Kq))
            tb = ctx.tensor(F32, xs.shape)
            ti = ctx.tensor(I32, ii.shape)
            out = ctx.mul_mat_id(tw, tb, ti, row_invariant=True)
            g = tg.Graph(ctx, size=16).build_forward(out)
            ctx.allocate(rt)
            tw.set_raw(raw)
            tb.set(xs)
            ti.set(ii)
            rt.compute(g)
            return out.numpy().copy()

    batch = run(b, ids)
    for t in (0, 5, 13, 23):
        np.testing.assert_array_equal(batch[t : t + 1], run(b[t : t + 1], ids[t : t + 1]))
