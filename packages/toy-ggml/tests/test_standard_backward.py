"""Patch 0025: the backward built in a context with ``toy_ops`` False uses standard ops only.

A runtime whose backends are not all toy's CPU kernels (a GPU: ``Runtime.toy_ops`` False) gets
graphs whose backward a GPU backend can run whole. Three gradients change form:

- the input gradient through a frozen quantized weight (the QLoRA base): ggml's OUT_PROD on the
  weight dequantized by GET_ROWS, instead of patch 0018's toy-GEMM operand reading the quantized
  weight transposed;
- MUL_MAT_ID's expert gradient: one OUT_PROD over every slot with the one-hot routing as a mask,
  instead of patch 0016's OUT_PROD_ID;
- the gradient of rows gathered per matrix (GET_ROWS of a 3-D source, the MoE routing weights):
  a batched MUL_MAT with the one-hot routing, instead of GET_ROWS_BACK.

Each is run on the CPU both ways: the standard graph must hold none of the replaced ops (the
toy graph must, so the switch is what differs), and its gradients must match NumPy in float64
and the toy graph's (bit for bit where the standard form adds only exact zeros to the same terms
in the same order: the expert gradient and the routed gather; within rounding for the frozen
quantized weight, whose product sums in another order).
"""

from __future__ import annotations

import numpy as np
import pytest

import toy_ggml as tg

F32, I32 = tg.GGMLType.F32, tg.GGMLType.I32


def _grads(rt, build, params, frozen=(), consts=(), *, toy_ops: bool, seed: int = 3):
    """Gradients of ``sum(build(ctx, *params, *frozen, *consts) * up)`` for each param, the
    upstream ``up`` and the (op, first source's type, whether that source is contiguous) of every
    node. ``frozen``: (type, raw bytes, shape) of quantized tensors without gradient."""
    with tg.Context(max_tensors=4096) as ctx:
        ctx.toy_ops = toy_ops
        pts = [ctx.tensor(F32, p.shape).set_param() for p in params]
        fts = [ctx.tensor(t, shape) for t, _, shape in frozen]
        cts = [ctx.tensor(I32, c.shape) for c in consts]
        out = build(ctx, *pts, *fts, *cts)
        up = np.random.default_rng(seed).standard_normal(out.shape).astype(np.float32)
        tu = ctx.tensor(F32, out.shape)
        loss = ctx.sum(ctx.mul(out, tu)).set_loss()
        g = tg.Graph(ctx, size=16384, grads=True)
        g.build_forward(loss)
        g.build_backward()
        gts = [g.grad(p) for p in pts]
        readers = [t if t.is_contiguous else ctx.cont(t) for t in gts]
        g.build_forward(*readers)
        ctx.allocate(rt)
        for t, v in zip(pts, params):
            t.set(v)
        for t, (_, raw, _) in zip(fts, frozen):
            t.set_raw(raw)
        for t, v in zip(cts, consts):
            t.set(v)
        tu.set(up)
        g.reset()
        rt.compute(g)
        grads = [r.numpy().copy() for r in readers]
        nodes = [
            (n.op, n.sources[0].dtype if n.sources else None, n.sources[0].is_contiguous if n.sources else None)
            for n in g.nodes
        ]
    return grads, up, nodes


def _ops(nodes) -> set[str]:
    return {op for op, _, _ in nodes}


# --------------------------------------------------------------------------- frozen quantized weight

OUT, IN = 40, 256  # K-quants need rows of 256


@pytest.mark.parametrize(
    "qtype", [tg.GGMLType.Q4_0, tg.GGMLType.Q4_1, tg.GGMLType.Q8_0, tg.GGMLType.Q4_K], ids=lambda t: t.name
)
@pytest.mark.parametrize("n", [1, 7])
def test_input_gradient_through_a_frozen_quantized_weight(rt, qtype, n):
    rng = np.random.default_rng(n)
    w = rng.standard_normal((OUT, IN)).astype(np.float32)
    raw = tg.quantize(w, qtype)
    deq = tg.dequantize(raw, qtype, (OUT, IN)).astype(np.float64)
    x = rng.standard_normal((n, IN)).astype(np.float32)

    def build(c, xt, wt):
        return c.mul_mat(wt, xt)

    (std,), up, std_nodes = _grads(rt, build, [x], [(qtype, raw, (OUT, IN))], toy_ops=False)
    (toy,), _, toy_nodes = _grads(rt, build, [x], [(qtype, raw, (OUT, IN))], toy_ops=True)
    want = up.astype(np.float64) @ deq
    np.testing.assert_allclose(std, want, rtol=1e-5, atol=1e-4)
    np.testing.assert_allclose(std, toy, rtol=1e-5, atol=1e-5)
    # the toy graph reads the quantized weight transposed in a product; the standard one never
    quant_t = [(op, t, c) for op, t, c in toy_nodes if op == "MUL_MAT" and t == qtype and not c]
    assert quant_t, toy_nodes
    assert not [(op, t, c) for op, t, c in std_nodes if op in ("MUL_MAT", "OUT_PROD") and t == qtype and not c]
    assert "GET_ROWS" in _ops(std_nodes) and "OUT_PROD" in _ops(std_nodes)


# --------------------------------------------------------------------------- MUL_MAT_ID

E, T, S = 5, 4, 3
# (T, S): token 1 routes both its first slots to expert 1; expert 4 appears on tokens 0 and 2;
# expert 5 (of E + 1) is never routed
IDS = np.array([[0, 2, 4], [1, 1, 3], [4, 0, 2], [3, 2, 0]], np.int32)


def _routing(n_e: int, t: int, s: int, seed: int) -> np.ndarray:
    """(t, s) expert ids, distinct within a token, as a router's top-k picks them."""
    rng = np.random.default_rng(seed)
    return np.stack([rng.permutation(n_e)[:s] for _ in range(t)]).astype(np.int32)


@pytest.mark.parametrize("U", [1, S], ids=["broadcast-input", "input-per-slot"])
@pytest.mark.parametrize(("K", "M"), [(7, 6), (6, 7)], ids=["mask-the-gradient", "mask-the-input"])
@pytest.mark.parametrize("routing", ["by-hand", "top-2-of-8"])
def test_expert_gradient_without_out_prod_id(rt, U, K, M, routing):
    ids = IDS if routing == "by-hand" else _routing(8, 33, S, seed=U + K)
    n_t, n_e = ids.shape[0], (E + 1 if routing == "by-hand" else 8)
    rng = np.random.default_rng(U * 10 + K)
    w = rng.standard_normal((n_e, M, K)).astype(np.float32)
    b = rng.standard_normal((n_t, U, K)).astype(np.float32)

    def build(c, ww, x, i):
        return c.mul_mat_id(ww, x, i)

    (gw, gb), up, std_nodes = _grads(rt, build, [w, b], consts=[ids], toy_ops=False)
    (tw, tb), _, toy_nodes = _grads(rt, build, [w, b], consts=[ids], toy_ops=True)
    assert "OUT_PROD_ID" in _ops(toy_nodes)
    assert "OUT_PROD_ID" not in _ops(std_nodes)
    want_w = np.zeros((n_e, M, K))
    want_b = np.zeros((n_t, U, K))
    for t in range(n_t):
        for s in range(S):
            e = ids[t, s]
            want_w[e] += np.outer(up[t, s].astype(np.float64), b[t, s % U].astype(np.float64))
            want_b[t, s % U] += w[e].astype(np.float64).T @ up[t, s].astype(np.float64)
    np.testing.assert_allclose(gw, want_w, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(gb, want_b, rtol=1e-5, atol=1e-5)
    if routing == "by-hand":
        assert not gw[E].any()  # the expert nobody chose
    # the CPU's OUT_PROD adds each expert's routed terms in slot order, as OUT_PROD_ID does, and
    # exact zeros for the rest: the same bits
    assert gw.tobytes() == tw.tobytes()
    assert gb.tobytes() == tb.tobytes()  # the input's gradient is built the same way in both


@pytest.mark.parametrize("qtype", [tg.GGMLType.Q8_0, tg.GGMLType.Q4_K], ids=lambda t: t.name)
def test_input_gradient_through_frozen_quantized_experts(rt, qtype):
    rng = np.random.default_rng(9)
    M, K = 6, 256
    w = rng.standard_normal((E, M, K)).astype(np.float32)
    raw = tg.quantize(w.reshape(-1, K), qtype)
    deq = tg.dequantize(raw, qtype, (E * M, K)).reshape(E, M, K).astype(np.float64)
    b = rng.standard_normal((T, 1, K)).astype(np.float32)

    def build(c, x, ww, i):
        return c.mul_mat_id(ww, x, i)

    (gb,), up, std_nodes = _grads(rt, build, [b], [(qtype, raw, (E, M, K))], [IDS], toy_ops=False)
    (tb,), _, toy_nodes = _grads(rt, build, [b], [(qtype, raw, (E, M, K))], [IDS], toy_ops=True)
    assert "CPY" in _ops(toy_nodes) and "GET_ROWS" in _ops(std_nodes)  # cast there, gather here
    want = np.zeros((T, 1, K))
    for t in range(T):
        for s in range(S):
            want[t, 0] += deq[IDS[t, s]].T @ up[t, s].astype(np.float64)
    np.testing.assert_allclose(gb, want, rtol=1e-5, atol=1e-4)
    assert gb.tobytes() == tb.tobytes()  # the same dequantized values, the same product


# --------------------------------------------------------------------------- GET_ROWS of a 3-D source


@pytest.mark.parametrize("D", [1, 3])
def test_gradient_of_rows_gathered_per_matrix(rt, D):
    # the router's gather: probabilities (T, E, D), each token's k chosen experts (T, k); token 1
    # gathers expert 0 twice (its gradient is the sum of both)
    rng = np.random.default_rng(10 + D)
    p = rng.standard_normal((T, E, D)).astype(np.float32)
    idx = np.array([[4, 1], [0, 0], [3, 2], [2, 4]], np.int32)

    def build(c, a, i):
        return c.get_rows(a, i)

    (gp,), up, std_nodes = _grads(rt, build, [p], consts=[idx], toy_ops=False)
    (tp,), _, toy_nodes = _grads(rt, build, [p], consts=[idx], toy_ops=True)
    assert "GET_ROWS_BACK" in _ops(toy_nodes)
    assert "GET_ROWS_BACK" not in _ops(std_nodes)
    want = np.zeros((T, E, D), np.float64)
    for t in range(T):
        for k in range(idx.shape[1]):
            want[t, idx[t, k]] += up[t, k]
    np.testing.assert_allclose(gp, want, rtol=1e-6, atol=1e-7)
    assert gp.tobytes() == tp.tobytes()  # one or two nonzero terms and exact zeros: the same sums
