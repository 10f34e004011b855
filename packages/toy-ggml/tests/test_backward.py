"""Gradients of every op that has a backward in our ggml tree and that toy binds.

Method: the loss is ``sum(out * W)`` for a fixed random ``W`` (so every output
element gets a distinct upstream gradient), or the op's own scalar output for
cross_entropy_loss. ggml's gradient (``Graph.build_backward``) is compared with
central finite differences of the same loss, computed by ggml's own forward in
float32: each parameter element is moved by +-eps and the same graph is
recomputed. The step actually taken is measured in float32
(``float32(x + eps) - float32(x - eps)``), not assumed to be ``2 * eps``.

Tolerances (unless a test says otherwise): eps = 1e-2 and
``|grad - fd| <= 2e-3 + 1e-2 * |fd|``. That covers float32 rounding of a loss of
order 1-10 divided by the step (~1e-4) and the O(eps**2) truncation error of
central differences for the smooth ops here (~1e-4). Non-smooth ops (relu, max
pooling) get inputs at least 5 * eps away from their kinks.

The ops whose backward toy patches in (NORM, GELU and GELU_ERF, see
packages/toy-ggml/patches/) are also compared with a NumPy float64 reference of
the analytic derivative, to ~1e-4 relative (GELU and GELU_ERF, whose gradient is
patch 0029's one-pass GELU_BACK op: to a few float32 ulp).
GELU's CPU forward rounds its input to float16 and reads a float16 table, so
finite differences of it agree with the true derivative only to about 1e-2
(and use a larger step).

Expected values come only from NumPy or finite differences.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys

import numpy as np
import pytest

import toy_ggml as tg

F32 = tg.GGMLType.F32
I32 = tg.GGMLType.I32

EPS = 1e-2
RTOL = 1e-2
ATOL = 2e-3

_TYPE_OF = {np.dtype(np.float32): F32, np.dtype(np.int32): I32}

_FD_RUNTIME = None


def _fd_runtime():
    """A one-thread CPU runtime for the finite-difference recomputations: they
    are hundreds of tiny computes, where a thread pool's barriers cost more
    than the work (badly so on a loaded machine). The gradient under test is
    always computed on the runtime the test passes in (the ``rt`` fixture)."""
    global _FD_RUNTIME
    if _FD_RUNTIME is None or _FD_RUNTIME.closed:
        _FD_RUNTIME = tg.Runtime("cpu", threads=1)
    return _FD_RUNTIME


# ---------------------------------------------------------------------------
# the generic checker


def ggml_grads(rt, build, params, consts=(), *, scalar=False, upstream=None, seed=7, fd_eps=None):
    """Build ``out = build(ctx, *param_tensors, *const_tensors)``, take
    ``loss = sum(out * upstream)`` (``out`` itself when ``scalar``), and return
    ``(grads, fd, upstream)``: ggml's gradients for each param and, when
    ``fd_eps`` is given, central finite differences of the loss (else None).
    ``upstream`` defaults to a fixed standard-normal array of out's shape."""
    params = [np.ascontiguousarray(p, dtype=np.float32) for p in params]
    consts = [np.ascontiguousarray(c) for c in consts]
    with tg.Context(max_tensors=4096) as ctx:
        pts = [ctx.tensor(F32, p.shape, name=f"param{i}").set_param() for i, p in enumerate(params)]
        cts = [ctx.tensor(_TYPE_OF[c.dtype], c.shape, name=f"const{i}") for i, c in enumerate(consts)]
        out = build(ctx, *pts, *cts)
        if scalar:
            assert out.size == 1
            loss = out
            w = None
        else:
            if upstream is None:
                upstream = np.random.default_rng(seed).standard_normal(out.shape).astype(np.float32)
            upstream = np.asarray(upstream, dtype=np.float32)
            assert upstream.shape == out.shape, (upstream.shape, out.shape)
            w = ctx.tensor(F32, out.shape, name="upstream")
            loss = ctx.sum(ctx.mul(out, w))
        loss.set_loss()
        g = tg.Graph(ctx, size=16384, grads=True)
        g.build_forward(loss)
        g.build_backward()
        grad_ts = [g.grad(p) for p in pts]
        for i, gt in enumerate(grad_ts):
            assert gt is not None, f"param{i} got no gradient"
        # a gradient can be a view (e.g. through transpose); read a cont() of it
        readers = [gt if gt.is_contiguous else ctx.cont(gt) for gt in grad_ts]
        extra = [r for r, gt in zip(readers, grad_ts) if r is not gt]
        if extra:
            g.build_forward(*extra)
        ctx.allocate(rt)
        # ctx.allocate must have given every tensor memory, gradients included
        assert all(gt.allocated for gt in grad_ts)
        for t, v in zip(pts, params):
            t.set(v)
        for t, v in zip(cts, consts):
            t.set(v)
        if w is not None:
            w.set(upstream)
        g.reset()
        rt.compute(g)
        grads = [r.numpy().astype(np.float64) for r in readers]
        loss0 = float(loss.numpy().reshape(-1)[0])
        assert all(gr.shape == p.shape for gr, p in zip(grads, params))

        fd = None
        if fd_eps is not None:
            fd = []
            fd_rt = _fd_runtime()
            fd_rt.compute(g)  # same forward on the other runtime: same loss
            assert float(loss.numpy().reshape(-1)[0]) == pytest.approx(loss0, rel=1e-5, abs=1e-6)
            for t, p in zip(pts, params):
                est = np.zeros(p.shape, dtype=np.float64)
                work = p.copy()
                flat = work.reshape(-1)
                for j in range(flat.size):
                    x0 = flat[j]
                    xp = np.float32(x0 + np.float32(fd_eps))
                    xm = np.float32(x0 - np.float32(fd_eps))
                    flat[j] = xp
                    t.set(work)
                    fd_rt.compute(g)
                    lp = float(loss.numpy().reshape(-1)[0])
                    flat[j] = xm
                    t.set(work)
                    fd_rt.compute(g)
                    lm = float(loss.numpy().reshape(-1)[0])
                    flat[j] = x0
                    est.reshape(-1)[j] = (lp - lm) / (float(xp) - float(xm))
                t.set(p)
                fd.append(est)
        return grads, fd, upstream


def grad_check(rt, build, params, consts=(), *, eps=EPS, rtol=RTOL, atol=ATOL, scalar=False):
    """Assert ggml's gradients of every param match central finite differences."""
    grads, fd, _ = ggml_grads(rt, build, params, consts, scalar=scalar, fd_eps=eps)
    for i, (gr, est) in enumerate(zip(grads, fd)):
        assert np.all(np.isfinite(gr)), f"param{i}: non-finite ggml gradient\n{gr}"
        np.testing.assert_allclose(gr, est, rtol=rtol, atol=atol, err_msg=f"param{i}: ggml grad vs finite differences")
    return grads


def _normal(rng, shape, scale=1.0):
    return (rng.standard_normal(shape) * scale).astype(np.float32)


def _away_from_zero(rng, shape, margin=0.1):
    """Normal values with |x| >= margin (for ops with a kink at 0)."""
    x = rng.standard_normal(shape)
    x = np.where(np.abs(x) < margin, np.sign(x + 1e-12) * (margin + np.abs(x)), x)
    return x.astype(np.float32)


# ---------------------------------------------------------------------------
# elementwise binary


@pytest.mark.parametrize("op", ["add", "sub", "mul", "div"])
def test_binary_same_shape(rt, rng, op):
    a = _normal(rng, (3, 4))
    b = _normal(rng, (3, 4))
    if op == "div":
        b = (np.sign(b) * (1.0 + np.abs(b))).astype(np.float32)  # |b| >= 1
    grad_check(rt, lambda c, x, y: getattr(c, op)(x, y), [a, b])


@pytest.mark.parametrize("op", ["add", "mul"])
@pytest.mark.parametrize("bshape", [(1, 4), (4,), (3, 1)])
def test_binary_broadcast(rt, rng, op, bshape):
    # b broadcasts over a: its gradient is summed over the repeats (repeat_back)
    a = _normal(rng, (3, 4))
    b = _normal(rng, bshape)
    grad_check(rt, lambda c, x, y: getattr(c, op)(x, y), [a, b])


def test_mul_same_tensor_twice(rt, rng):
    # x * x: both contributions must be accumulated into one gradient
    a = _normal(rng, (2, 5))
    (gx,) = grad_check(rt, lambda c, x: c.mul(x, x), [a])
    assert np.all(np.isfinite(gx))


def test_scale(rt, rng):
    grad_check(rt, lambda c, x: c.scale(x, 1.7), [_normal(rng, (3, 4))])


def test_scale_with_bias(rt, rng):
    grad_check(rt, lambda c, x: c.scale(x, -0.6, bias=0.3), [_normal(rng, (3, 4))])


# ---------------------------------------------------------------------------
# elementwise unary


def test_sqr(rt, rng):
    grad_check(rt, lambda c, x: c.sqr(x), [_normal(rng, (3, 4))])


def test_sqrt(rt, rng):
    x = rng.uniform(0.5, 2.0, (3, 4)).astype(np.float32)
    grad_check(rt, lambda c, t: c.sqrt(t), [x])


def test_log(rt, rng):
    x = rng.uniform(0.5, 2.0, (3, 4)).astype(np.float32)
    grad_check(rt, lambda c, t: c.log(t), [x])


def test_exp(rt, rng):
    grad_check(rt, lambda c, x: c.exp(x), [_normal(rng, (3, 4), 0.7)])


def test_neg(rt, rng):
    grad_check(rt, lambda c, x: c.neg(x), [_normal(rng, (3, 4))])


def test_relu(rt, rng):
    x = _away_from_zero(rng, (3, 6), margin=5 * EPS)
    (gx,) = grad_check(rt, lambda c, t: c.relu(t), [x])
    assert np.all(gx[x < 0] == 0)


def test_silu(rt, rng):
    grad_check(rt, lambda c, x: c.silu(x), [_normal(rng, (3, 4), 1.5)])


def test_gelu_finite_differences(rt, rng):
    # float16 table in the CPU forward: larger step, ~1e-2 agreement (module notes)
    x = _normal(rng, (3, 6), 1.5)
    grad_check(rt, lambda c, t: c.gelu(t), [x], eps=0.1, rtol=2e-2, atol=2e-2)


def _gelu_prime(x):
    c = np.sqrt(2.0 / np.pi)
    a = 0.044715
    t = np.tanh(c * (x + a * x**3))
    return 0.5 * (1.0 + t) + 0.5 * x * (1.0 - t**2) * c * (1.0 + 3.0 * a * x**2)


def test_gelu_analytic(rt, rng):
    # patch 0029's GELU_BACK (tanh form) vs the tanh-approximation derivative in float64. The
    # kernel computes gelu' = s (1 + x q (1 - s)) with s = sigmoid(2u) from its own exp (a few
    # ulp): measured over 300,000 inputs in [-15, 15] and beyond, |err| <= 3.3 * 2**-24
    # absolute and 4.8 ulp relative where |gelu'| > 0.1. So |err| <= 1e-6 |ref| + 2**-21
    # |upstream|. Exact where the formula is: gelu'(+-0) = 0.5, 1 and 0 far out.
    special = [0.0, -0.0, 1e-30, -1e-30, 1e-7, -1e-7, 1.0, -1.0, 3.0, -3.0, 5.0, -5.0]
    special += [10.0, -10.0, 10.05, -10.05, 30.0, -30.0, 1e4, -1e4]
    x = np.concatenate([special, _normal(rng, (28,), 2.5).ravel(), np.linspace(-12, 12, 16)]).astype(np.float32)
    x = x.reshape(4, 16)
    (gx,), _, up = ggml_grads(rt, lambda c, t: c.gelu(t), [x])
    up64 = up.astype(np.float64)
    expected = up64 * _gelu_prime(x.astype(np.float64))
    err = np.abs(gx - expected)
    tol = 1e-6 * np.abs(expected) + 2.0**-21 * np.abs(up64)
    assert np.all(err <= tol), f"worst x={x.flat[np.argmax(err - tol)]}: err {err.max():.3g}"
    flat_g, flat_up = gx.ravel(), up64.ravel()
    for i, d in [(0, 0.5), (1, 0.5), (len(special) - 2, 1.0), (len(special) - 1, 0.0)]:
        assert flat_g[i] == np.float32(flat_up[i] * d), (x.flat[i], flat_g[i], flat_up[i])


# inputs for GELU_ERF: 0, -0, tiny, subnormal, moderate, the tails and far out
_GELU_ERF_SPECIAL = np.array(
    [0.0, -0.0, 1e-30, -1e-30, 1e-40, -1e-40, 1e-7, -1e-7, 1.0, -1.0, 3.0, -3.0]
    + [5.0, -5.0, 10.0, -10.0, 30.0, -30.0, 1e4, -1e4],
    np.float32,
)


def _gelu_erf_prime(x):
    # d/dx 0.5 x (1 + erf(x/sqrt2)) = Phi(x) + x phi(x); Phi via erfc (no cancellation at x << 0)
    x = np.asarray(x, np.float64)
    cdf = np.array([0.5 * math.erfc(-v / math.sqrt(2.0)) for v in x.ravel()]).reshape(x.shape)
    return cdf + x * np.exp(-0.5 * x * x) / math.sqrt(2.0 * math.pi)


def test_gelu_erf_finite_differences(rt, rng):
    # The forward is float32 erff (no table), so the default step works with tighter
    # tolerances: central-difference truncation eps**2/6 * max|third derivative| (~0.6)
    # ~ 1e-5, float32 rounding of a loss of order 10 over the 2e-2 step ~ 5e-5 (measured:
    # max |grad - fd| 2.3e-5).
    x = np.concatenate([_normal(rng, (2, 8), 2.0).ravel(), [0.0, 1e-6, -1e-6, 0.5, -0.5, 10.0, -10.0, 2.0]])
    grad_check(rt, lambda c, t: c.gelu_erf(t), [x.astype(np.float32).reshape(3, 8)], rtol=1e-3, atol=3e-4)


def test_gelu_erf_analytic(rt, rng):
    # patched backward (0010-gelu-erf-backward.patch) vs the exact derivative in float64.
    # float32 error of Phi + x phi: erff and the 0.5 erf + 0.5 rounding are absolute,
    # <~ 2**-24 each (this is what is left where Phi cancels, x << 0); phi's exp argument
    # -x**2/2 carries a relative 2**-23 (1 + x**2/2), i.e. < 0.42 * 2**-22 absolute on
    # x phi(x); the final products are a few ulp relative. So |err| <= 1e-6 |ref| +
    # 2**-21 |upstream|. Measured on x in [-12, 12]: |err| <= 2.2 * 2**-24 (max err/tol 0.11),
    # relative <= 5e-7 where |gelu_erf'| > 0.1.
    x = np.concatenate([_GELU_ERF_SPECIAL, _normal(rng, (44,), 2.5).ravel()]).astype(np.float32).reshape(4, 16)
    (gx,), _, up = ggml_grads(rt, lambda c, t: c.gelu_erf(t), [x])
    assert np.all(np.isfinite(gx))
    up64 = up.astype(np.float64)
    expected = up64 * _gelu_erf_prime(x)
    err = np.abs(gx - expected)
    tol = 1e-6 * np.abs(expected) + 2.0**-21 * np.abs(up64)
    assert np.all(err <= tol), f"worst x={x.flat[np.argmax(err - tol)]}: err {err.max():.3g}"
    # exact where the float32 formula is: gelu_erf'(+-0) = 0.5 (no 0/0), 1 and 0 far out
    flat_g, flat_up = gx.ravel(), up64.ravel()
    for i, d in [(0, 0.5), (1, 0.5), (_GELU_ERF_SPECIAL.size - 2, 1.0), (_GELU_ERF_SPECIAL.size - 1, 0.0)]:
        assert flat_g[i] == np.float32(flat_up[i] * d), (x.flat[i], flat_g[i], flat_up[i])


def test_gelu_erf_differs_from_gelu_tanh(rt):
    # Not the tanh formula by mistake: near |x| ~ 2 the exact derivative and the tanh
    # approximation's differ by up to 8.7e-4 (at |x| = 2), far above either's error.
    x = np.array([[-2.5, -2.0, -1.5, 1.5, 2.0, 2.5]], np.float32)
    (g_erf,), _, _ = ggml_grads(rt, lambda c, t: c.gelu_erf(t), [x], upstream=np.ones_like(x))
    np.testing.assert_allclose(g_erf, _gelu_erf_prime(x), rtol=1e-6, atol=2.0**-21)
    assert np.max(np.abs(_gelu_erf_prime(x) - _gelu_prime(x.astype(np.float64)))) > 5e-4


def test_swiglu(rt, rng):
    a = _normal(rng, (3, 4), 1.5)
    b = _normal(rng, (3, 4))
    grad_check(rt, lambda c, x, y: c.swiglu(x, y), [a, b])


# ---------------------------------------------------------------------------
# reductions


def test_sum(rt, rng):
    (gx,) = grad_check(rt, lambda c, x: c.sum(x), [_normal(rng, (3, 4))])
    assert np.allclose(gx, gx.flat[0])  # d sum / dx is the one upstream value everywhere


def test_sum_as_loss(rt, rng):
    # the loss itself is sum(x): gradient exactly 1
    (gx,), _, _ = ggml_grads(rt, lambda c, x: c.sum(x), [_normal(rng, (2, 3))], scalar=True)
    np.testing.assert_array_equal(gx, np.ones((2, 3)))


def test_sum_rows(rt, rng):
    grad_check(rt, lambda c, x: c.sum_rows(x), [_normal(rng, (2, 3, 4))])


def test_mean(rt, rng):
    grad_check(rt, lambda c, x: c.mean(x), [_normal(rng, (3, 5))])


def test_repeat(rt, rng):
    grad_check(rt, lambda c, x: c.repeat(x, (3, 4)), [_normal(rng, (1, 4))])
    grad_check(rt, lambda c, x: c.repeat(x, (2, 3, 4)), [_normal(rng, (3, 2))])


# ---------------------------------------------------------------------------
# norms


def test_rms_norm(rt, rng):
    grad_check(rt, lambda c, x: c.rms_norm(x, 1e-5), [_normal(rng, (3, 6))])


def test_norm_finite_differences(rt, rng):
    grad_check(rt, lambda c, x: c.norm(x, 1e-5), [_normal(rng, (3, 6))])


@pytest.mark.parametrize("eps", [1e-5, 0.5])
def test_norm_analytic(rt, rng, eps):
    # patched backward (0031's NORM_BACK; 0001's composed graph without toy_ops) vs
    # dx = (g - mean(g) - y * mean(g * y)) / sigma per row
    x = _normal(rng, (4, 8), 2.0) + 3.0
    (gx,), _, up = ggml_grads(rt, lambda c, t: c.norm(t, eps), [x])
    x64 = x.astype(np.float64)
    g = up.astype(np.float64)
    xc = x64 - x64.mean(-1, keepdims=True)
    sigma = np.sqrt((xc**2).mean(-1, keepdims=True) + eps)
    y = xc / sigma
    expected = (g - g.mean(-1, keepdims=True) - y * (g * y).mean(-1, keepdims=True)) / sigma
    np.testing.assert_allclose(gx, expected, rtol=1e-4, atol=1e-5 * np.abs(expected).max())


def test_norm_backward_is_one_op_and_the_standard_backward_composes_it(rt, rng):
    # patch 0031: with toy_ops (a CPU runtime) NORM's gradient is one NORM_BACK node; off
    # (patch 0025's standard backward, for a GPU) the composed graph of patch 0001. Both are
    # the derivative: within 1e-5 of each other relative to the largest gradient, on rows of
    # GPT-2's and the ViT's widths and an odd one.
    for shape in [(5, 64), (3, 768), (2, 37)]:
        x = _normal(rng, shape, 2.0) + 1.0
        up = _normal(rng, shape)
        got = {on: _op_grads(rt, lambda c, t: c.norm(t, 1e-5), x, up, toy_ops=on) for on in (True, False)}
        fused, fused_ops = got[True]
        composed, composed_ops = got[False]
        assert fused_ops == ["NONE", "NORM", "MUL", "SUM", "REPEAT", "MUL", "NORM_BACK"]
        assert "NORM_BACK" not in composed_ops and len(composed_ops) - 6 == 13
        np.testing.assert_allclose(fused, composed, rtol=0, atol=1e-5 * np.abs(composed).max())


def test_norm_then_affine(rt, rng):
    # LayerNorm as used by GPT-2: norm(x) * gamma + beta, all three trained
    x = _normal(rng, (3, 5))
    gamma = _normal(rng, (5,))
    beta = _normal(rng, (5,))
    grad_check(rt, lambda c, t, gm, bt: c.add(c.mul(c.norm(t, 1e-5), gm), bt), [x, gamma, beta])


# ---------------------------------------------------------------------------
# matmul


def test_mul_mat(rt, rng):
    a = _normal(rng, (3, 4))  # (M, K)
    b = _normal(rng, (5, 4))  # (N, K)
    grad_check(rt, lambda c, x, y: c.mul_mat(x, y), [a, b])


def test_mul_mat_batched(rt, rng):
    a = _normal(rng, (2, 3, 4))
    b = _normal(rng, (2, 2, 4))
    grad_check(rt, lambda c, x, y: c.mul_mat(x, y), [a, b])


def test_mul_mat_broadcast_3d(rt, rng):
    # a's leading extent 2 broadcasts over b's 4: a's gradient sums the repeats
    a = _normal(rng, (2, 3, 4))
    b = _normal(rng, (4, 2, 4))
    grad_check(rt, lambda c, x, y: c.mul_mat(x, y), [a, b])


def test_mul_mat_only_b_is_param(rt, rng):
    a = _normal(rng, (3, 4))
    b = _normal(rng, (2, 4))
    grad_check(rt, lambda c, y, x: c.mul_mat(x, y), [b], [a])


# ---------------------------------------------------------------------------
# layout


def test_cont(rt, rng):
    grad_check(rt, lambda c, x: c.cont(x), [_normal(rng, (3, 4))])


def test_reshape(rt, rng):
    grad_check(rt, lambda c, x: c.reshape(x, (2, 6)), [_normal(rng, (3, 4))])
    grad_check(rt, lambda c, x: c.reshape(x, (2, 3, 2)), [_normal(rng, (12,))])


def test_view_contiguous_slice(rt, rng):
    # rows 1..2 of a (4, 6) parameter: the other rows get zero gradient
    x = _normal(rng, (4, 6))
    (gx,) = grad_check(rt, lambda c, t: c.view(t, (2, 6), offset=6 * 4), [x])
    assert np.all(gx[[0, 3]] == 0)


def test_view_strided(rt, rng):
    # every other row, first 3 columns (a non-contiguous view)
    x = _normal(rng, (4, 6))
    (gx,) = grad_check(rt, lambda c, t: c.cont(c.view(t, (2, 3), strides=(2 * 6 * 4, 4), offset=4)), [x])
    touched = np.zeros((4, 6), bool)
    touched[0::2, 1:4] = True
    assert np.all(gx[~touched] == 0)


@pytest.mark.parametrize("axes", [(1, 0, 2), (2, 0, 1), (0, 2, 1)])
def test_permute(rt, rng, axes):
    grad_check(rt, lambda c, x: c.cont(c.permute(x, axes)), [_normal(rng, (2, 3, 4))])


def test_transpose(rt, rng):
    grad_check(rt, lambda c, x: c.cont(c.transpose(x)), [_normal(rng, (3, 4))])


def test_transpose_into_mul_mat(rt, rng):
    # x.T used as mul_mat's b (gradient flows back through cont and transpose)
    x = _normal(rng, (4, 3))
    w = _normal(rng, (2, 4))
    grad_check(rt, lambda c, t, ww: c.mul_mat(ww, c.cont(c.transpose(t))), [x, w])


def test_cpy(rt, rng):
    # copy a (3, 4) parameter into a (4, 3) target: gradient reshaped back
    target = np.zeros((4, 3), np.float32)
    grad_check(rt, lambda c, x, tgt: c.cpy(x, tgt), [_normal(rng, (3, 4))], [target])


def test_get_rows(rt, rng):
    # duplicated and unused rows: duplicates accumulate, unused rows get 0
    table = _normal(rng, (5, 4))
    idx = np.array([3, 0, 3, 1], np.int32)
    (gt,) = grad_check(rt, lambda c, t, i: c.get_rows(t, i), [table], [idx])
    assert np.all(gt[[2, 4]] == 0)


# ---------------------------------------------------------------------------
# attention pieces


def test_soft_max(rt, rng):
    grad_check(rt, lambda c, x: c.soft_max(x), [_normal(rng, (3, 5))])


def test_soft_max_scaled(rt, rng):
    grad_check(rt, lambda c, x: c.soft_max(x, scale=0.7), [_normal(rng, (2, 3, 4))])


def test_soft_max_with_constant_mask(rt, rng):
    x = _normal(rng, (3, 4))
    mask = np.triu(np.full((3, 4), -np.inf, np.float32), k=2)
    grad_check(rt, lambda c, t, m: c.soft_max(t, m), [x], [mask])


@pytest.mark.parametrize("n_past", [0, 1])
def test_diag_mask_inf_then_soft_max(rt, rng, n_past):
    x = _normal(rng, (2, 4, 4))
    (gx,) = grad_check(rt, lambda c, t: c.soft_max(c.diag_mask_inf(t, n_past)), [x])
    masked = np.triu(np.ones((4, 4), bool), k=n_past + 1)
    assert np.all(gx[:, masked] == 0)


@pytest.mark.parametrize("mode", ["normal", "neox"])
@pytest.mark.parametrize("n_dims", [4, 2])
def test_rope(rt, rng, mode, n_dims):
    x = _normal(rng, (3, 2, 4))  # (T, H, D)
    pos = np.array([0, 3, 7], np.int32)
    grad_check(rt, lambda c, t, p: c.rope(t, p, n_dims, mode=mode), [x], [pos])


def test_rope_with_constant_freq_factors(rt, rng):
    x = _normal(rng, (2, 2, 4))
    pos = np.array([1, 5], np.int32)
    ff = np.array([1.0, 4.0], np.float32)
    grad_check(rt, lambda c, t, p, f: c.rope(t, p, 4, freq_factors=f, freq_base=100.0), [x], [pos, ff])


def test_cross_entropy_loss(rt, rng):
    logits = _normal(rng, (3, 5))
    labels = rng.dirichlet(np.ones(5), size=3).astype(np.float32)
    grad_check(rt, lambda c, x, y: c.cross_entropy_loss(x, y), [logits], [labels], scalar=True)


def test_cross_entropy_loss_analytic(rt, rng):
    # d/dlogits of mean_rows(-sum(labels * log_softmax)) = (softmax - labels) / rows
    logits = _normal(rng, (3, 5))
    labels = rng.dirichlet(np.ones(5), size=3).astype(np.float32)
    (gx,), _, _ = ggml_grads(rt, lambda c, x, y: c.cross_entropy_loss(x, y), [logits], [labels], scalar=True)
    z = logits.astype(np.float64)
    sm = np.exp(z - z.max(-1, keepdims=True))
    sm /= sm.sum(-1, keepdims=True)
    np.testing.assert_allclose(gx, (sm - labels) / 3, rtol=1e-4, atol=1e-6)


# ---------------------------------------------------------------------------
# vision


@pytest.mark.parametrize("op", ["avg", "max"])
def test_pool_2d(rt, rng, op):
    # distinct values 0.1 apart so the max never changes under the +-eps step
    x = (rng.permutation(32).reshape(1, 2, 4, 4) * 0.1 - 1.6).astype(np.float32)
    grad_check(rt, lambda c, t: c.pool_2d(t, op), [x])


def test_im2col(rt, rng):
    kernel = np.zeros((2, 2, 2, 2), np.float32)  # only its shape is used
    x = _normal(rng, (1, 2, 3, 3))
    grad_check(rt, lambda c, t, k: c.im2col(k, t), [x], [kernel])


def _conv_2d_np(k, x, p):
    n, _, h, w = x.shape
    oc, _, kh, kw = k.shape
    xp = np.pad(x, ((0, 0), (0, 0), (p, p), (p, p)))
    out = np.zeros((n, oc, h + 2 * p - kh + 1, w + 2 * p - kw + 1))
    for i in range(out.shape[2]):
        for j in range(out.shape[3]):
            out[:, :, i, j] = np.einsum("nchw,ochw->no", xp[:, :, i : i + kh, j : j + kw], k)
    return out


def _np_grad(f, x, h=1e-6):
    """Central differences of a float64 NumPy function (exact for the linear conv)."""
    x = x.astype(np.float64)
    g = np.zeros_like(x)
    for j in range(x.size):
        xp, xm = x.copy(), x.copy()
        xp.flat[j] += h
        xm.flat[j] -= h
        g.flat[j] = (f(xp) - f(xm)) / (2 * h)
    return g


def test_conv_2d(rt, rng):
    # ggml_conv_2d runs im2col in float16 even for an F32 kernel (and mul_mat then
    # converts the kernel to float16), so finite differences of ggml's forward are
    # too noisy; the reference is the gradient of a float64 NumPy convolution and
    # the tolerance is float16's.
    kernel = _normal(rng, (2, 2, 2, 2))
    x = _normal(rng, (1, 2, 3, 3))
    (gk, gx), _, up = ggml_grads(rt, lambda c, k, t: c.conv_2d(k, t, p0=1, p1=1), [kernel, x])
    up = up.astype(np.float64)
    x64, k64 = x.astype(np.float64), kernel.astype(np.float64)
    np.testing.assert_allclose(gk, _np_grad(lambda k: (_conv_2d_np(k, x64, 1) * up).sum(), k64), rtol=1e-2, atol=1e-2)
    np.testing.assert_allclose(gx, _np_grad(lambda t: (_conv_2d_np(k64, t, 1) * up).sum(), x64), rtol=1e-2, atol=1e-2)


# ---------------------------------------------------------------------------
# allocation order and reset()


def test_allocate_after_build_backward_covers_gradients(rt, rng):
    with tg.Context() as ctx:
        x = ctx.tensor(F32, (2, 3)).set_param()
        loss = ctx.sum(ctx.sqr(x)).set_loss()
        g = tg.Graph(ctx, grads=True).build_forward(loss).build_backward()
        gx, gl = g.grad(x), g.grad(loss)
        assert gx is not None and gl is not None
        assert not gx.allocated
        ctx.allocate(rt)
        assert gx.allocated and gl.allocated
        xv = _normal(rng, (2, 3))
        x.set(xv)
        g.reset()
        rt.compute(g)
        np.testing.assert_array_equal(gl.numpy(), [1.0])  # reset() seeds d loss = 1
        np.testing.assert_allclose(gx.numpy(), 2 * xv, rtol=1e-6)


def test_gradients_made_after_allocate_need_memory_too(rt, rng):
    # allocate before build_backward: the gradient tensors are new and have no
    # memory; reset() refuses, a second allocate() gives them memory
    with tg.Context() as ctx:
        x = ctx.tensor(F32, (4,)).set_param()
        loss = ctx.sum(ctx.exp(x)).set_loss()
        g = tg.Graph(ctx, grads=True).build_forward(loss)
        ctx.allocate(rt)
        xv = _normal(rng, (4,))
        x.set(xv)
        g.build_backward()
        assert not g.grad(x).allocated
        with pytest.raises(tg.GGMLError, match="no memory"):
            g.reset()
        ctx.allocate(rt)
        g.reset()
        rt.compute(g)
        np.testing.assert_allclose(g.grad(x).numpy(), np.exp(xv), rtol=1e-5)
        np.testing.assert_array_equal(x.numpy(), xv)  # the first allocation was kept


def test_reset_rezeroes_between_steps(rt, rng):
    # computing twice with reset() in between gives the same gradient (no accumulation)
    with tg.Context() as ctx:
        x = ctx.tensor(F32, (3,)).set_param()
        loss = ctx.sum(ctx.mul(x, x)).set_loss()
        g = tg.Graph(ctx, grads=True).build_forward(loss).build_backward()
        ctx.allocate(rt)
        xv = _normal(rng, (3,))
        x.set(xv)
        for _ in range(3):
            g.reset()
            rt.compute(g)
            np.testing.assert_allclose(g.grad(x).numpy(), 2 * xv, rtol=1e-6)


# ---------------------------------------------------------------------------
# a small composite: one transformer-ish block


def test_small_block(rt, rng):
    x = _normal(rng, (2, 3))
    w1 = _normal(rng, (4, 3), 0.5)
    w2 = _normal(rng, (3, 4), 0.5)

    def build(c, xx, a, b):
        h = c.rms_norm(xx, 1e-5)
        h = c.silu(c.mul_mat(a, h))  # (2, 4)
        h = c.mul_mat(b, h)  # b (3, 4) -> (2, 3)
        return c.soft_max(c.add(h, xx))

    grad_check(rt, build, [x, w1, w2])


# ---------------------------------------------------------------------------
# Gradients that arrive as a transposed view.
#
# Upstream ggml's backward for TRANSPOSE/PERMUTE hands the op below a
# transposed (non-contiguous) view of the gradient; many backward kernels then
# abort on a contiguity assert and SILU_BACK silently computes a wrong
# gradient. toy patch 0003 makes that gradient contiguous. Each case runs in
# its own process: ``op(x) -> transpose -> cont -> sum(* W)``. A pass is a
# process that exits normally and either matches the finite-difference
# gradient or refuses with a toy_ggml error; an abort, a crash or a wrong
# gradient is a failure.

_TESTS_DIR = __file__.rsplit("/", 1)[0]

_ISOLATED = """
import sys
sys.path.insert(0, {tests_dir!r})
import numpy as np
import toy_ggml as tg
from test_backward import grad_check
rt = tg.Runtime("cpu", threads=2)
rng = np.random.default_rng(5)
x = (rng.uniform(0.3, 1.5, (4, 4)) * np.where(rng.random((4, 4)) < 0.5, -1, 1)).astype(np.float32)
y = rng.uniform(0.5, 1.5, (4, 4)).astype(np.float32)
idx = np.array([1, 0, 3, 3], np.int32)
target = np.zeros((4, 4), np.float32)
params = {{1: [x], 2: [x, y]}}[{n_params}]
consts = {consts}
try:
    grad_check(rt, lambda c, *a: c.cont(c.transpose({expr})), params, consts{kw})
    print("RESULT OK")
except AssertionError as e:
    print("RESULT WRONG", str(e)[:2000])
except tg.GGMLError as e:
    print("RESULT REFUSED", type(e).__name__, e)
"""

_TRANSPOSED_CONSUMER_CASES = [
    # (id, expression over a[0] (x), a[1] (y or a const), params, consts, xfail reason or None)
    # (all pass since toy patch 0003; the reason slot stays for future ggml bumps)
    ("add", "c.add(a[0], a[1])", 2, "[]", None),
    ("sqr", "c.sqr(a[0])", 1, "[]", None),
    ("exp", "c.exp(a[0])", 1, "[]", None),
    ("relu", "c.relu(a[0])", 1, "[]", None),
    ("mul_mat", "c.mul_mat(a[0], a[1])", 2, "[]", None),
    ("reshape", "c.reshape(c.reshape(a[0], (16,)), (4, 4))", 1, "[]", None),
    ("sub", "c.sub(a[0], a[1])", 2, "[]", None),
    ("mul", "c.mul(a[0], a[1])", 2, "[]", None),
    ("div", "c.div(a[0], a[1])", 2, "[]", None),
    ("scale", "c.scale(a[0], 1.5)", 1, "[]", None),
    ("sqrt", "c.sqrt(c.add(c.sqr(a[0]), a[1]))", 2, "[]", None),
    ("neg", "c.neg(a[0])", 1, "[]", None),
    ("silu", "c.silu(a[0])", 1, "[]", None),
    ("gelu", "c.gelu(a[0])", 1, "[]", None),
    ("gelu_erf", "c.gelu_erf(a[0])", 1, "[]", None),
    ("swiglu", "c.swiglu(a[0], a[1])", 2, "[]", None),
    ("sum_rows", "c.repeat(c.sum_rows(a[0]), (4, 4))", 1, "[]", None),
    ("mean", "c.repeat(c.mean(a[0]), (4, 4))", 1, "[]", None),
    ("rms_norm", "c.rms_norm(a[0], 1e-5)", 1, "[]", None),
    ("norm", "c.norm(a[0], 1e-5)", 1, "[]", None),
    ("soft_max", "c.soft_max(a[0])", 1, "[]", None),
    ("get_rows", "c.get_rows(a[0], a[1])", 1, "[idx]", None),
    ("cont", "c.cont(a[0])", 1, "[]", None),
    ("cpy", "c.cpy(a[0], a[1])", 1, "[target]", None),
]


# GELU's CPU forward reads a float16 table: finite differences need a wide step
# and tolerance (as in test_gelu_finite_differences)
_CASE_KW = {"gelu": ", eps=0.1, rtol=2e-2, atol=2e-2"}


def _case_param(case):
    name, expr, n_params, consts, reason = case
    marks = [pytest.mark.xfail(strict=True, reason=reason)] if reason else []
    return pytest.param(expr, n_params, consts, id=name, marks=marks)


@pytest.mark.parametrize("expr, n_params, consts", [_case_param(c) for c in _TRANSPOSED_CONSUMER_CASES])
def test_backward_with_transposed_gradient(expr, n_params, consts):
    kw = next((v for k, v in _CASE_KW.items() if f"c.{k}(" in expr), "")
    code = _ISOLATED.format(tests_dir=_TESTS_DIR, n_params=n_params, consts=consts, expr=expr, kw=kw)
    env = dict(os.environ, GGML_NO_BACKTRACE="1")  # no gdb attach on abort (slow)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    detail = f"rc={r.returncode}\nstdout:\n{r.stdout[-3000:]}\nstderr:\n{r.stderr[-3000:]}"
    assert r.returncode == 0, "process died (abort/crash): " + detail
    assert "RESULT OK" in r.stdout or "RESULT REFUSED" in r.stdout, detail


def test_rope_with_permuted_consumer(rt, rng):
    # the gradient reaches ROPE_BACK as a permuted view; rope handles strides
    x = _normal(rng, (3, 2, 4))
    pos = np.array([0, 1, 2], np.int32)
    grad_check(rt, lambda c, t, p: c.cont(c.permute(c.rope(t, p, 4), (1, 0, 2))), [x], [pos])


def test_tanh_finite_differences(rt, rng):
    # patch 0012: d tanh = (1 - tanh^2) dx. Smooth everywhere; the default step and tolerances.
    x = np.concatenate([_normal(rng, (2, 8), 1.5).ravel(), [0.0, 1e-6, -1e-6, 0.5, -0.5, 3.0, -3.0, 0.1]])
    grad_check(rt, lambda c, t: c.tanh(t), [x.astype(np.float32).reshape(3, 8)])


def test_tanh_analytic(rt, rng):
    # patch 0012 vs 1 - tanh(x)^2 in float64. The backward reads the forward's float32
    # tanh y (a few ulp of y) and computes 1 - y*y in float32: |err| <= ~4 ulp(1) |upstream|
    # = 2**-21 |upstream| absolute, plus float32 rounding of the product. Far out the
    # derivative is exactly 0 (y rounds to +-1).
    x = (
        np.concatenate(
            [
                np.array([0.0, -0.0, 1e-30, 1e-7, -1e-7, 1.0, -1.0, 5.0, -5.0, 20.0, -20.0, 1e4], np.float32),
                _normal(rng, (52,), 2.0).ravel(),
            ]
        )
        .astype(np.float32)
        .reshape(4, 16)
    )
    (gx,), _, up = ggml_grads(rt, lambda c, t: c.tanh(t), [x])
    up64 = up.astype(np.float64)
    expected = up64 * (1.0 - np.tanh(x.astype(np.float64)) ** 2)
    err = np.abs(gx - expected)
    tol = 1e-6 * np.abs(expected) + 2.0**-21 * np.abs(up64)
    assert np.all(err <= tol), f"worst x={x.flat[np.argmax(err - tol)]}: err {err.max():.3g}"
    assert gx.flat[0] == np.float32(up.flat[0])  # tanh'(0) = 1 exactly
    assert gx.flat[9] == 0.0 and gx.flat[10] == 0.0 and gx.flat[11] == 0.0  # |x| >= 20: y = +-1


# --------------------------------------------------------------------------- patch 0029: GELU_BACK


def _op_grads(rt, build, x, up, *, toy_ops=True):
    """dx of ``sum(build(ctx, x) * up)`` and the op of every node of the graph, built in a
    context with ``toy_ops`` as given."""
    with tg.Context(max_tensors=256) as ctx:
        ctx.toy_ops = toy_ops
        t = ctx.tensor(F32, x.shape).set_param()
        u = ctx.tensor(F32, x.shape)
        loss = ctx.sum(ctx.mul(build(ctx, t), u)).set_loss()
        g = tg.Graph(ctx, size=1024, grads=True)
        g.build_forward(loss)
        g.build_backward()
        gx = g.grad(t)
        ctx.allocate(rt)
        t.set(x)
        u.set(up)
        g.reset()
        rt.compute(g)
        return gx.numpy().astype(np.float64), [n.op for n in g.nodes]


def _gelu_graph_grads(rt, form, x, up, *, toy_ops=True):
    """``_op_grads`` of GELU (form "tanh": ``gelu``, "erf": ``gelu_erf``)."""
    gelu = (lambda c, t: c.gelu(t)) if form == "tanh" else (lambda c, t: c.gelu_erf(t))
    return _op_grads(rt, gelu, x, up, toy_ops=toy_ops)


@pytest.mark.parametrize("form", ["tanh", "erf"])
def test_gelu_backward_is_one_op_and_the_standard_backward_composes_it(rt, rng, form):
    # toy_ops on (a CPU runtime): GELU's gradient is one GELU_BACK node; off (patch 0025's
    # standard backward, for a GPU): the composed graph (13 nodes through TANH, 9 through ERF).
    # Both are the derivative: within 1e-4 relative of each other (the composed tanh form goes
    # through 1 - tanh^2, which loses relative precision in the tails).
    x = _normal(rng, (3, 40), 2.0)
    up = _normal(rng, (3, 40))
    fused, fused_ops = _gelu_graph_grads(rt, form, x, up, toy_ops=True)
    composed, composed_ops = _gelu_graph_grads(rt, form, x, up, toy_ops=False)
    # forward: GELU, MUL, SUM; the loss's backward: REPEAT, MUL; then GELU's
    unary = "UNARY:GELU" if form == "tanh" else "UNARY:GELU_ERF"
    assert fused_ops == ["NONE", unary, "MUL", "SUM", "REPEAT", "MUL", "GELU_BACK"]
    assert "GELU_BACK" not in composed_ops
    assert ("UNARY:TANH" if form == "tanh" else "UNARY:ERF") in composed_ops
    assert len(composed_ops) - 6 == (13 if form == "tanh" else 9)  # the composed graphs' nodes
    np.testing.assert_allclose(fused, composed, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("form", ["tanh", "erf"])
def test_gelu_backward_bits_do_not_depend_on_the_position_in_a_row(rt, rng, form):
    # The vector lanes and the scalar tail do the same operations: each element's gradient
    # is the same bits whether it lands in a 16- or 8-wide block or in the tail (rows of
    # 1..40 elements cut at every offset of one sequence).
    x = np.concatenate([_normal(rng, (72,), 3.0).ravel(), [0.0, -0.0, 9.99, -9.99, 10.1, -10.1, 40.0, -40.0]])
    x = x.astype(np.float32)
    up = _normal(rng, x.shape)
    whole, _ = _gelu_graph_grads(rt, form, x[None], up[None])
    for n in (1, 7, 8, 9, 15, 16, 17, 33, 40):
        for off in (0, 1, 5, 13):
            part, _ = _gelu_graph_grads(rt, form, x[None, off : off + n], up[None, off : off + n])
            assert np.array_equal(part[0].view(np.int64), whole[0, off : off + n].view(np.int64)), (n, off)


_GELU_BACK_VARIANT_CHILD = r"""
import hashlib, sys
import numpy as np
import toy_ggml as tg
sys.path.insert(0, {tests_dir!r})
from test_backward import _gelu_graph_grads
rng = np.random.default_rng(5)
x = np.concatenate([rng.uniform(-12, 12, 20_024), rng.standard_normal(3) * 1e3]).astype(np.float32)  # rows of 2861
up = rng.standard_normal(x.shape).astype(np.float32)
rt = tg.Runtime("cpu", threads=2)
h = hashlib.sha256()
for form in ("tanh", "erf"):
    gx, _ = _gelu_graph_grads(rt, form, x.reshape(7, -1), up.reshape(7, -1))
    h.update(gx.astype(np.float32).tobytes())
print(tg.cpu_variant().tag, h.hexdigest())
"""


def test_gelu_backward_is_the_same_on_every_cpu_variant():
    # patch 0029: the scalar, AVX2 and AVX-512 forms do the same operations in the same order
    runnable = [c.tag for c in tg.cpu_variant().candidates if not c.missing]
    if len(runnable) < 2:
        pytest.skip("this build has one CPU variant this machine runs")
    code = _GELU_BACK_VARIANT_CHILD.format(tests_dir=_TESTS_DIR)
    digests = {}
    for tag in runnable:
        env = dict(os.environ, TOY_GGML_CPU_VARIANT=tag)
        proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
        assert proc.returncode == 0, proc.stderr[-2000:]
        got_tag, digest = proc.stdout.split()[-2:]
        assert got_tag == tag
        digests[tag] = digest
    assert len(set(digests.values())) == 1, digests
