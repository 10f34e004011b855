"""``Context.toy_ops`` and ``Runtime.toy_ops``: a context whose ``toy_ops`` is False builds the standard ops that
patch 0017's SUM_SQR and OPT_STEP_ADAMW_SCALED equal (``sum(sqr(a))``; ``opt_step_adamw(mul(grad, scale))``),
for a device that lacks toy's ops (the CUDA backend: docs/reference/cuda-fallbacks.md).

The promise is the numbers of the toy ops, bit for bit, on the CPU (tolerance 0: patch 0017 defines the toy ops
as those standard ops computed in one pass); the references are the toy-op forms computed in the same process and
NumPy in float64 (rtol 2e-7 for the sum, 1e-5 for the AdamW step, as test_optimizer_fused.py)."""

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


@pytest.fixture(scope="module")
def rt():
    r = tg.Runtime("cpu", threads=2)
    yield r
    r.close()


def _ops_of(t) -> list[str]:
    """The ops from t back to the inputs (depth first)."""
    out, stack = [], [t]
    while stack:
        x = stack.pop()
        out.append(x.op)
        stack.extend(x.sources)
    return out


def test_contexts_use_toy_ops_by_default_and_a_cpu_runtime_has_them(rt):
    with tg.Context() as ctx:
        assert ctx.toy_ops is True
    assert rt.toy_ops is True


@pytest.mark.parametrize("shape", [(7,), (9, 17), (1000, 24)])
def test_sum_sqr_without_toy_ops_is_sum_of_sqr_with_the_same_bits(rt, shape):
    x = (np.random.default_rng(1).standard_normal(shape) * 3.0).astype(F32)
    seen = {}

    def build(toy_ops):
        def f(ctx, a):
            ctx.toy_ops = toy_ops
            t = ctx.sum_sqr(a)
            seen[toy_ops] = _ops_of(t)
            return t

        return f

    std = eval_graph(rt, build(False), x)
    toy = eval_graph(rt, build(True), x)
    assert seen[False][:2] == ["SUM", "SQR"] and "SUM_SQR" not in seen[False]
    assert seen[True][0] == "SUM_SQR"
    assert std.tobytes() == toy.tobytes()
    np.testing.assert_allclose(std[0], np.sum(x.astype(np.float64) ** 2), rtol=2e-7)


def test_scaled_adamw_without_toy_ops_is_adamw_of_the_scaled_gradient_with_the_same_bits(rt):
    rng = np.random.default_rng(2)
    shape = (5, 33)
    w, g = rng.standard_normal(shape).astype(F32), (rng.standard_normal(shape) * 2).astype(F32)
    m = (rng.standard_normal(shape) * 0.1).astype(F32)
    v = (np.abs(rng.standard_normal(shape)) * 0.01).astype(F32)
    lr, b1, b2, eps, wd, t = 1e-2, 0.9, 0.999, 1e-8, 0.1, 3
    hp = np.array([lr, b1, b2, eps, wd, 1 / (1 - b1**t), 1 / (1 - b2**t)], F32)
    scale = np.array([0.37], F32)
    seen = {}

    def build(toy_ops):
        def f(ctx, p, gr, mm, vv, h, s):
            ctx.toy_ops = toy_ops
            p.set_param()
            step = ctx.opt_step_adamw(p, gr, mm, vv, h, s)
            seen[toy_ops] = _ops_of(step)
            return step, mm, vv

        return f

    std = eval_graph(rt, build(False), w, g, m, v, hp, scale)
    toy = eval_graph(rt, build(True), w, g, m, v, hp, scale)
    assert seen[False][0] == "OPT_STEP_ADAMW" and "MUL" in seen[False]
    assert seen[True][0] == "OPT_STEP_ADAMW_SCALED" and "MUL" not in seen[True]
    for a, b in zip(std, toy, strict=True):
        assert a.tobytes() == b.tobytes()
    # NumPy, float64: AdamW (decoupled weight decay, bias-corrected moments) on scale * g
    c1, c2 = (float(x) for x in hp[5:])
    gs = g.astype(np.float64) * scale[0]
    m_ref = b1 * m + (1 - b1) * gs
    v_ref = b2 * v + (1 - b2) * gs**2
    w_ref = w * (1 - lr * wd) - lr * (m_ref * c1) / (np.sqrt(v_ref * c2) + eps)
    np.testing.assert_allclose(std[0], w_ref, rtol=1e-5, atol=1e-6)
    # m's terms are up to ~0.1 and are rounded to float32 (ulp ~7e-9) before they cancel: an absolute bound
    np.testing.assert_allclose(std[1], m_ref, rtol=1e-5, atol=1e-7)
