"""Patch 0011: toy's F32 GEMM (``Context.mul_mat(..., gemm=True)``).

What the patch claims, and how each claim is checked here:

* every output element is ONE chain of fused multiply-adds over k, in order,
  from 0: checked bit for bit against ``fma_chain``, a NumPy evaluation of
  exactly that chain (float64 products of float32 values are exact, so
  ``float32(a*b + c)`` computed in float64 is the fused result except when
  the float64 sum is inexact AND lands on a float32 rounding midpoint, which
  these fixed seeded inputs do not hit: the test would show it, reproducibly).
  Shapes cover partial tiles in both directions, several k blocks (256) and
  column blocks (512), batches, src0 broadcast over src1's batches, and
  transposed or permuted operands read in place;
* the same on every CPU variant this machine runs (a child process per
  variant, ``TOY_GGML_CPU_VARIANT``), compared with the same reference;
* independent of the thread count and of the other rows in the product;
* its error obeys the bound of sequential summation against float64:
  ``|fl - exact| <= gamma_K * sum_k |a_k b_k|``, gamma_K = K u / (1 - K u);
* gradients (autograd through a hinted product: the backward products are
  hinted too and read the transposed operands in place) equal the analytic
  ones (dW = dY^T X, dX = dY W) computed in float64 within the same bound,
  and finite differences for a batched product;
* bad operands are a ValueError before anything reaches C.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

import toy_ggml as tg

F32 = tg.GGMLType.F32
U = 2.0**-24


def fma_chain(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """(..., M, N) float32: out[m, n] = fma(x[m, K-1], w[n, K-1], ... fma(x[m, 0], w[n, 0], 0))
    for x (..., M, K), w (..., N, K) (w broadcast over x's leading axes by repetition, as ggml)."""
    x = np.asarray(x, np.float32)
    w = np.asarray(w, np.float32)
    lead = x.shape[:-2]
    if w.shape[:-2] != lead:  # ggml's broadcast: batch j uses w's batch j // (x_extent // w_extent)
        reps = [a // b for a, b in zip(lead, w.shape[:-2])]
        for ax, r in enumerate(reps):
            w = np.repeat(w, r, axis=ax)
    acc = np.zeros(lead + (x.shape[-2], w.shape[-2]), np.float32)
    for k in range(x.shape[-1]):
        prod = x[..., :, k, None].astype(np.float64) * w[..., None, :, k].astype(np.float64)
        acc = (prod + acc).astype(np.float32)
    return acc


def _product(rt, x, w, *, transpose_x=False, transpose_w=False, permute=None, gemm=True):
    """mul_mat(w, x) computed by ggml: ``transpose_*`` stores the operand's
    last two axes swapped and multiplies a transposed view of it;
    ``permute`` = (axes_x, axes_w): store np.transpose(op, inverse) and
    multiply ctx.permute(stored, axes)."""
    with tg.Context(max_tensors=32) as ctx:

        def operand(a, transposed, axes):
            if axes is not None:
                inv = np.argsort(axes)
                stored = np.ascontiguousarray(np.transpose(a, inv))
                t = ctx.tensor(F32, stored.shape)
                return t, stored, ctx.permute(t, axes)
            if transposed:
                stored = np.ascontiguousarray(np.swapaxes(a, -1, -2))
                t = ctx.tensor(F32, stored.shape)
                return t, stored, ctx.transpose(t)
            t = ctx.tensor(F32, a.shape)
            return t, a, t

        px, pw = permute if permute is not None else (None, None)
        tx, sx, vx = operand(x, transpose_x, px)
        tw, sw, vw = operand(w, transpose_w, pw)
        out = ctx.mul_mat(vw, vx, gemm=gemm)
        g = tg.Graph(ctx, size=64).build_forward(out)
        ctx.allocate(rt)
        tx.set(sx)
        tw.set(sw)
        rt.compute(g)
        return out.numpy().copy()


SHAPES = [  # (batch, M rows of x, N rows of w, K)
    ((), 1, 1, 1),
    ((), 7, 33, 5),
    ((), 8, 32, 256),  # whole tiles, one k block
    ((), 9, 31, 257),  # one row and one column past a tile, one k past a block
    ((), 37, 65, 600),  # three k blocks
    ((), 20, 530, 40),  # two column blocks (512 + 18)
    ((3,), 13, 17, 70),  # batched
    ((2, 3), 5, 40, 33),  # two batch axes
]


@pytest.mark.parametrize("batch,m,n,k", SHAPES)
def test_every_output_is_one_fma_chain(rt, batch, m, n, k):
    rng = np.random.default_rng([m, n, k])
    x = rng.standard_normal(batch + (m, k)).astype(np.float32)
    w = rng.standard_normal(batch + (n, k)).astype(np.float32)
    ref = fma_chain(x, w)
    np.testing.assert_array_equal(_product(rt, x, w), ref)
    np.testing.assert_array_equal(_product(rt, x, w, transpose_x=True), ref)
    np.testing.assert_array_equal(_product(rt, x, w, transpose_w=True), ref)
    np.testing.assert_array_equal(_product(rt, x, w, transpose_x=True, transpose_w=True), ref)


def test_broadcast_weight_batches(rt):
    rng = np.random.default_rng(5)
    x = rng.standard_normal((6, 11, 48)).astype(np.float32)
    w = rng.standard_normal((2, 19, 48)).astype(np.float32)  # batch j of x uses w's batch j // 3
    np.testing.assert_array_equal(_product(rt, x, w), fma_chain(x, w))


def test_permuted_attention_views(rt):
    """Q (B, H, T, D) and K as permuted views of (B, T, H, D) activations,
    V as a (B, H, D, T) view: what toy-vit's attention multiplies."""
    rng = np.random.default_rng(6)
    B, T, H, D = 2, 23, 3, 16
    q = rng.standard_normal((B, H, T, D)).astype(np.float32)
    k = rng.standard_normal((B, H, T, D)).astype(np.float32)
    got = _product(rt, q, k, permute=((0, 2, 1, 3), (0, 2, 1, 3)))
    np.testing.assert_array_equal(got, fma_chain(q, k))
    p = rng.standard_normal((B, H, T, T)).astype(np.float32)
    vt = rng.standard_normal((B, H, D, T)).astype(np.float32)
    got = _product(rt, p, vt, permute=(None, (0, 2, 3, 1)))
    np.testing.assert_array_equal(got, fma_chain(p, vt))


def test_rows_and_threads_do_not_change_a_result():
    rng = np.random.default_rng(7)
    x = rng.standard_normal((41, 300)).astype(np.float32)
    w = rng.standard_normal((70, 300)).astype(np.float32)
    outs = []
    for threads in (1, 2, 3):
        r = tg.Runtime("cpu", threads=threads)
        try:
            outs.append(_product(r, x, w))
            if threads == 2:
                alone = [_product(r, x[i : i + 1], w) for i in (0, 17, 40)]
        finally:
            r.close()
    for o in outs[1:]:
        np.testing.assert_array_equal(o, outs[0])
    for i, a in zip((0, 17, 40), alone):
        np.testing.assert_array_equal(a[0], outs[0][i])


def test_error_within_the_sequential_summation_bound(rt):
    rng = np.random.default_rng(8)
    K = 5000
    x = rng.standard_normal((6, K)).astype(np.float32)
    w = rng.standard_normal((40, K)).astype(np.float32)
    got = _product(rt, x, w).astype(np.float64)
    exact = x.astype(np.float64) @ w.astype(np.float64).T
    bound = K * U / (1 - K * U) * (np.abs(x).astype(np.float64) @ np.abs(w).astype(np.float64).T)
    assert np.all(np.abs(got - exact) <= bound)


def _grads(rt, x, w, dy, *, gemm=True):
    """dW and dX of loss = sum(mul_mat(w, x) * dy) by ggml's autograd."""
    with tg.Context(max_tensors=256) as ctx:
        tw = ctx.tensor(F32, w.shape).set_param()
        tx = ctx.tensor(F32, x.shape).set_param()
        td = ctx.tensor(F32, dy.shape)
        loss = ctx.sum(ctx.mul(ctx.mul_mat(tw, tx, gemm=gemm), td)).set_loss()
        g = tg.Graph(ctx, size=512, grads=True)
        g.build_forward(loss)
        g.build_backward()
        gw, gx = g.grad(tw), g.grad(tx)
        g.build_forward(gw.set_output(), gx.set_output())
        ctx.allocate(rt)
        tw.set(w)
        tx.set(x)
        td.set(dy)
        g.reset()
        rt.compute(g)
        return gw.numpy().copy(), gx.numpy().copy()


@pytest.mark.parametrize("batch", [(), (3,)])
def test_gradients_are_the_transposed_products(rt, batch):
    rng = np.random.default_rng(9)
    M, N, K = 50, 36, 70
    x = rng.standard_normal(batch + (M, K)).astype(np.float32)
    w = rng.standard_normal(batch + (N, K)).astype(np.float32)
    dy = rng.standard_normal(batch + (M, N)).astype(np.float32)
    gw, gx = _grads(rt, x, w, dy)
    x64, w64, d64 = (a.astype(np.float64) for a in (x, w, dy))
    dw = np.swapaxes(d64, -1, -2) @ x64  # (N, K), summed over M
    dx = d64 @ w64  # (M, K), summed over N
    bw = M * U / (1 - M * U) * (np.swapaxes(np.abs(d64), -1, -2) @ np.abs(x64))
    bx = N * U / (1 - N * U) * (np.abs(d64) @ np.abs(w64))
    assert np.all(np.abs(gw - dw) <= bw + 1e-30)
    assert np.all(np.abs(gx - dx) <= bx + 1e-30)
    # and they are toy GEMM products themselves: each an FMA chain over the summed axis
    np.testing.assert_array_equal(gw, fma_chain(np.swapaxes(dy, -1, -2), np.swapaxes(x, -1, -2)))
    np.testing.assert_array_equal(gx, fma_chain(dy, np.swapaxes(w, -1, -2)))


def test_gradients_match_finite_differences(rt):
    """A batched attention-like product through permuted views, through a
    softmax, so the gradient reaches the views' backward too."""
    rng = np.random.default_rng(10)
    B, T, H, D = 2, 5, 2, 4
    q0 = rng.standard_normal((B, T, H, D)).astype(np.float32)
    k0 = rng.standard_normal((B, T, H, D)).astype(np.float32)
    up = rng.standard_normal((B, H, T, T)).astype(np.float32)

    def loss_and_grads(qv, kv, want_grads):
        with tg.Context(max_tensors=256) as ctx:
            tq = ctx.tensor(F32, qv.shape).set_param()
            tk = ctx.tensor(F32, kv.shape).set_param()
            tu = ctx.tensor(F32, up.shape)
            q = ctx.permute(tq, (0, 2, 1, 3))
            k = ctx.permute(tk, (0, 2, 1, 3))
            s = ctx.soft_max(ctx.mul_mat(k, q, gemm=True), None, 0.5)
            loss = ctx.sum(ctx.mul(s, tu)).set_loss().set_output()
            g = tg.Graph(ctx, size=512, grads=want_grads)
            g.build_forward(loss)
            outs = []
            if want_grads:
                g.build_backward()
                outs = [g.grad(tq).set_output(), g.grad(tk).set_output()]
                g.build_forward(*outs)
            ctx.allocate(rt)
            tq.set(qv)
            tk.set(kv)
            tu.set(up)
            if want_grads:
                g.reset()
            rt.compute(g)
            return float(loss.numpy().reshape(-1)[0]), [o.numpy().copy() for o in outs]

    _, (gq, gk) = loss_and_grads(q0, k0, True)
    eps = 1e-2
    for arr, grad, which in ((q0, gq, 0), (k0, gk, 1)):
        flat = arr.reshape(-1)
        for i in range(0, flat.size, 7):
            p, m = flat.copy(), flat.copy()
            p[i] += eps
            m[i] -= eps
            step = float(np.float32(p[i]) - np.float32(m[i]))
            args_p = (p.reshape(arr.shape), k0) if which == 0 else (q0, p.reshape(arr.shape))
            args_m = (m.reshape(arr.shape), k0) if which == 0 else (q0, m.reshape(arr.shape))
            fd = (loss_and_grads(*args_p, False)[0] - loss_and_grads(*args_m, False)[0]) / step
            assert abs(grad.reshape(-1)[i] - fd) <= 2e-3 + 1e-2 * abs(fd), (which, i, grad.reshape(-1)[i], fd)


def test_bad_operands_are_value_errors():
    with tg.Context(max_tensors=16) as ctx:
        with pytest.raises(ValueError, match="exclude each other"):
            ctx.mul_mat(ctx.tensor(F32, (5, 8)), ctx.tensor(F32, (2, 8)), row_invariant=True, gemm=True)
        # views whose last two axes are both strided (the contiguous axis moved to the front)
        strided_a = ctx.permute(ctx.tensor(F32, (8, 4, 3)), (2, 1, 0))  # (3, 4, 8)
        with pytest.raises(ValueError, match="neither of its last two axes contiguous"):
            ctx.mul_mat(strided_a, ctx.tensor(F32, (3, 2, 8)), gemm=True)
        strided_b = ctx.permute(ctx.tensor(F32, (8, 2, 3)), (2, 1, 0))  # (3, 2, 8)
        with pytest.raises(ValueError, match="neither of its last two axes contiguous"):
            ctx.mul_mat(ctx.tensor(F32, (3, 5, 8)), strided_b, gemm=True)


def test_context_default_and_override():
    with tg.Context(max_tensors=16) as ctx:
        assert ctx.gemm is False
        ctx.gemm = True
        w, x = ctx.tensor(F32, (5, 8)), ctx.tensor(F32, (2, 8))
        ctx.mul_mat(w, x, row_invariant=True)  # an explicit row_invariant wins over the default
        ctx.mul_mat(ctx.transpose(ctx.tensor(F32, (8, 5))), x)  # the default takes a transposed a
        with pytest.raises(ValueError, match="transposed"):
            ctx.mul_mat(ctx.transpose(ctx.tensor(F32, (8, 5))), x, gemm=False)


_CHILD = r"""
import json, sys
import numpy as np
sys.path.insert(0, sys.argv[1])
import test_toy_gemm as t
import toy_ggml as tg
rt = tg.Runtime("cpu", threads=2)
ok = []
for batch, m, n, k in t.SHAPES:
    rng = np.random.default_rng([m, n, k])
    x = rng.standard_normal(batch + (m, k)).astype(np.float32)
    w = rng.standard_normal(batch + (n, k)).astype(np.float32)
    ok.append(bool(np.array_equal(t._product(rt, x, w, transpose_w=True), t.fma_chain(x, w))))
print(json.dumps({"variant": tg.cpu_variant().tag, "ok": ok}))
"""


def test_every_cpu_variant_computes_the_same_chain():
    here = os.path.dirname(os.path.abspath(__file__))
    runnable = [c.tag for c in tg.cpu_variant().candidates if not c.missing]
    if len(runnable) < 2:
        pytest.skip("this build has one CPU variant this machine runs")
    for tag in runnable:
        env = dict(os.environ, TOY_GGML_CPU_VARIANT=tag)
        proc = subprocess.run(
            [sys.executable, "-c", _CHILD, here], env=env, capture_output=True, text=True, timeout=600
        )
        assert proc.returncode == 0, proc.stderr[-2000:]
        res = json.loads(proc.stdout.strip().splitlines()[-1])
        assert res["variant"] == tag
        assert all(res["ok"]), (tag, res["ok"])
