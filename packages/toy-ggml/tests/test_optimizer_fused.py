"""Patch 0017: the gradient norm's sums of squares in one pass (``sum_sqr``) and AdamW on a scaled
gradient (``opt_step_adamw(..., scale)``), and the vectorised AdamW row.

Both replace ops the training step used before (``sum(sqr(g))`` and ``opt_step_adamw(mul(g, f))``)
and promise the same bits, so the references here are those ops themselves, computed in the same
process; NumPy (float64) checks the values independently. The thread count is varied because the
new kernels spread rows over threads, and row lengths 1..40 put elements in the vector lanes and in
the scalar tail (16-lane AVX-512, 8-lane AVX2, or scalar only, by CPU variant): a lane and the tail
must compute the same thing.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest

import toy_ggml as tg

F32 = np.float32


def _eval_graph():
    # pytest imports test modules by path (--import-mode=importlib): load conftest's helper the same way
    spec = importlib.util.spec_from_file_location("_toy_ggml_conftest", Path(__file__).with_name("conftest.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.eval_graph


eval_graph = _eval_graph()


def randn(rng, *shape, scale=1.0):
    return (rng.standard_normal(shape) * scale).astype(F32)


SHAPES = [(1,), (7,), (16,), (33,), (5, 33), (9, 17), (4, 3, 17), (2, 3, 4, 9), (1000, 24)]


@pytest.fixture(scope="module", params=[1, 2, 3])
def rt_threads(request):
    r = tg.Runtime("cpu", threads=request.param)
    yield r
    r.close()


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_sum_sqr_is_sum_of_sqr_bit_for_bit(rt_threads, rng, shape):
    x = randn(rng, *shape, scale=3.0)
    fused = eval_graph(rt_threads, lambda ctx, a: ctx.sum_sqr(a), x)
    plain = eval_graph(rt_threads, lambda ctx, a: ctx.sum(ctx.sqr(a)), x)
    assert fused.shape == (1,) and fused.dtype == F32
    assert fused.tobytes() == plain.tobytes()
    ref = np.sum(x.astype(np.float64) ** 2)
    np.testing.assert_allclose(fused[0], ref, rtol=2e-7)


def test_sum_sqr_reads_rows_through_their_strides(rt, rng):
    """A view whose rows are apart (a column slice): each row is consecutive, the rows are not."""
    x = randn(rng, 6, 40)

    def fused(ctx, a):
        return ctx.sum_sqr(ctx.view(a, (6, 25), strides=(40 * 4, 4), offset=3 * 4))

    got = eval_graph(rt, fused, x)
    np.testing.assert_allclose(got[0], np.sum(x[:, 3:28].astype(np.float64) ** 2), rtol=2e-7)


def test_sum_sqr_refuses_what_it_cannot_read(rt, rng):
    with tg.Context(max_tensors=8) as ctx:
        a = ctx.tensor(tg.GGMLType.F32, (4, 6))
        with pytest.raises(ValueError, match="sum_sqr"):
            ctx.sum_sqr(ctx.transpose(a))
        h = ctx.tensor(tg.GGMLType.F16, (4, 6))
        with pytest.raises(TypeError, match="sum_sqr"):
            ctx.sum_sqr(h)


def _state(rng, shape):
    w = randn(rng, *shape)
    g = randn(rng, *shape, scale=2.0)
    m = randn(rng, *shape, scale=0.1)
    v = (np.abs(randn(rng, *shape)) * 0.01).astype(F32)
    return w, g, m, v


def _hp(t=3, wd=0.1):
    lr, b1, b2, eps = 1e-2, 0.9, 0.999, 1e-8
    return np.array([lr, b1, b2, eps, wd, 1.0 / (1.0 - b1**t), 1.0 / (1.0 - b2**t)], F32)


def _adamw(rt, w, g, m, v, hp, scale=None, *, fused=True):
    def build(ctx, p, gr, mm, vv, h, *s):
        p.set_param()
        if not s:
            return ctx.opt_step_adamw(p, gr, mm, vv, h), mm, vv
        if fused:
            return ctx.opt_step_adamw(p, gr, mm, vv, h, s[0]), mm, vv
        return ctx.opt_step_adamw(p, ctx.mul(gr, s[0]), mm, vv, h), mm, vv

    extra = () if scale is None else (np.array([scale], F32),)
    return eval_graph(rt, build, w, g, m, v, hp, *extra)


@pytest.mark.parametrize("scale", [0.37, 1.0])
@pytest.mark.parametrize("shape", [(n,) for n in (1, 5, 8, 15, 16, 17, 31, 33, 40)] + [(7, 19), (3, 2, 48)])
def test_adamw_scaled_is_adamw_of_the_scaled_gradient(rt_threads, rng, shape, scale):
    w, g, m, v = _state(rng, shape)
    hp = _hp()
    got = _adamw(rt_threads, w, g, m, v, hp, scale)
    want = _adamw(rt_threads, w, g, m, v, hp, scale, fused=False)
    for a, b in zip(got, want):
        assert a.tobytes() == b.tobytes()
    # NumPy, float64: AdamW (decoupled weight decay, bias-corrected moments) on scale * g
    lr, b1, b2, eps, wd, c1, c2 = (float(h) for h in hp)
    gs = g.astype(np.float64) * F32(scale)
    m_ref = b1 * m + (1 - b1) * gs
    v_ref = b2 * v + (1 - b2) * gs**2
    w_ref = w * (1 - lr * wd) - lr * (m_ref * c1) / (np.sqrt(v_ref * c2) + eps)
    np.testing.assert_allclose(got[1], m_ref, rtol=1e-5, atol=1e-8)
    np.testing.assert_allclose(got[2], v_ref, rtol=1e-5, atol=1e-10)
    np.testing.assert_allclose(got[0], w_ref, rtol=1e-5, atol=1e-6)


def test_adamw_lanes_and_tail_agree(rt, rng):
    """A row of 40 made of 5 distinct (w, g, m, v) quadruples repeated: the vector lanes (the first 32
    elements with AVX-512 or AVX2) and the scalar tail (the last 8 or 0) must give each quadruple the
    same bits wherever it sits."""
    w0, g0, m0, v0 = _state(rng, (5,))
    idx = np.arange(40) % 5
    w, g, m, v = w0[idx], g0[idx], m0[idx], v0[idx]
    for scale in (None, 0.5):
        outs = _adamw(rt, w, g, m, v, _hp(), scale)
        for o in outs:
            for k in range(5):
                assert len({x.tobytes() for x in o[idx == k]}) == 1, (k, o[idx == k])


def test_adamw_does_not_depend_on_the_thread_count(rng):
    w, g, m, v = _state(rng, (37, 29))
    results = []
    for n in (1, 2, 4):
        with tg.Runtime("cpu", threads=n) as r:
            results.append(b"".join(x.tobytes() for x in _adamw(r, w, g, m, v, _hp(), 0.25)))
    assert len(set(results)) == 1


def test_adamw_scale_is_checked():
    with tg.Context(max_tensors=16) as ctx:
        p = ctx.tensor(tg.GGMLType.F32, (4,)).set_param()
        g, m, v = (ctx.tensor(tg.GGMLType.F32, (4,)) for _ in range(3))
        h = ctx.tensor(tg.GGMLType.F32, (7,))
        with pytest.raises(ValueError, match="scale must have 1 value"):
            ctx.opt_step_adamw(p, g, m, v, h, ctx.tensor(tg.GGMLType.F32, (2,)))
        with pytest.raises(TypeError, match="scale"):
            ctx.opt_step_adamw(p, g, m, v, h, ctx.tensor(tg.GGMLType.F16, (1,)))
