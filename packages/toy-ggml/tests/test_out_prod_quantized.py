"""The activations' gradient through a quantized weight (a frozen QLoRA base).

Patch 0007 made ggml's backward for it, OUT_PROD with a quantized first
operand, dequantize each weight row once per run of output rows instead of
once per output row. Since patch 0018 that gradient comes from toy's GEMM
reading the weight transposed (test_toy_gemm_quantized.py checks it bit for
bit against the F32 product); toy's graphs no longer reach the quantized
OUT_PROD (the CPU backend refuses one broadcast over batches, the only case
0018 leaves to it). The checks below, written for 0007, hold for the path
that replaced it.

The gradient of ``sum(w * mul_mat(Wq, x))`` with respect to ``x`` is
``w @ deq(Wq)``: checked against NumPy (float64, on the dequantized values)
for several token counts (1, odd, more than the threads split evenly) and
thread counts, and bit-identical whatever the thread count (every output
element sums the same terms in the same order).
"""

from __future__ import annotations

import numpy as np
import pytest

import toy_ggml as tg

F32 = tg.GGMLType.F32
OUT, IN = 40, 256  # K-quants need rows of 256


def _grad_x(qtype, n: int, threads: int, quantized: bool = True) -> tuple[np.ndarray, np.ndarray, list[str]]:
    """(d/dx of sum(up * mul_mat(W, x)), its float64 reference, the graph's ops). ``quantized``
    False: W is the F32 dequantized matrix and the product is toy's GEMM (gemm=True), whose
    input gradient reads W transposed: what patch 0018 must equal bit for bit."""
    rng = np.random.default_rng(n)
    w_f = rng.standard_normal((OUT, IN)).astype(np.float32)
    raw = tg.quantize(w_f, qtype)
    w_deq = tg.dequantize(raw, qtype, (OUT, IN))
    x = rng.standard_normal((n, IN)).astype(np.float32)
    up = rng.standard_normal((n, OUT)).astype(np.float32)
    rt = tg.Runtime("cpu", threads=threads)
    cin = tg.Context(max_tensors=8)
    wt = cin.tensor(qtype if quantized else F32, (OUT, IN))
    xt = cin.tensor(F32, (n, IN)).set_param()
    ut = cin.tensor(F32, (n, OUT))
    ops = tg.Context(max_tensors=256)
    loss = ops.sum(ops.mul(ops.mul_mat(wt, xt, gemm=not quantized), ut)).set_loss().set_output()
    g = tg.Graph(ops, size=1024, grads=True).build_forward(loss).build_backward()
    gx = g.grad(xt)
    gx = (gx if gx.is_contiguous else ops.cont(gx)).set_output()
    g.build_forward(gx)
    cin.allocate(rt)
    seed = g.grad(loss).set_input()
    rt.allocate(g)
    seed.set(np.ones(1, np.float32))
    wt.set_raw(raw) if quantized else wt.set(w_deq)
    xt.set(x)
    ut.set(up)
    rt.compute(g)
    got = gx.numpy().copy()
    names = [nd.op for nd in g.nodes]
    ops.close()
    cin.close()
    rt.close()
    return got, up.astype(np.float64) @ w_deq.astype(np.float64), names


@pytest.mark.parametrize("qtype", [tg.GGMLType.Q4_1, tg.GGMLType.Q8_0, tg.GGMLType.Q4_K], ids=lambda t: t.name)
@pytest.mark.parametrize("n", [1, 7, 33])
def test_quantized_weight_activation_gradient(qtype, n):
    got = {}
    for threads in (1, 2, 3):
        got[threads], ref, names = _grad_x(qtype, n, threads)
        assert "OUT_PROD" not in names  # patch 0018: toy's GEMM on the weight read transposed
        np.testing.assert_allclose(got[threads], ref, rtol=1e-5, atol=1e-4)
    np.testing.assert_array_equal(got[1], got[2])
    np.testing.assert_array_equal(got[1], got[3])
    f32, _, _ = _grad_x(qtype, n, 2, quantized=False)
    assert got[2].tobytes() == f32.tobytes()  # the hinted F32 product's gradient, bit for bit
