"""Patch 0018: toy's GEMM with a quantized first operand read transposed, and the input gradient
through a frozen quantized weight (a QLoRA base) that uses it.

``mul_mat(transpose(Wq), b, gemm=True)`` is ``b @ deq(Wq)``, with ``Wq`` dequantized while the GEMM
packs it. The claim is stronger than closeness: the kernel is the F32 one, so the result must be
bit-identical to ``mul_mat(transpose(W32), b, gemm=True)`` on the dequantized F32 matrix (itself
checked against a sequential-FMA reference in test_toy_gemm.py); NumPy (float64, on the dequantized
values) checks the values independently. Shapes cover several k blocks (256), several column
blocks (512) and the threads' column ranges (which must start on quantization blocks: 32 or 256
columns), partial register tiles and a batch axis; 1 to 3 threads.

The backward of ``mul_mat(Wq, x)`` with ``x`` trainable and ``Wq`` frozen is now that GEMM (a
MUL_MAT node, no OUT_PROD), with the same bits as the hinted F32 product's backward: checked in
test_out_prod_quantized.py.
"""

from __future__ import annotations

import numpy as np
import pytest

import toy_ggml as tg

F32 = tg.GGMLType.F32
T = tg.GGMLType
TYPES = [T.Q4_0, T.Q4_1, T.Q5_1, T.Q8_0, T.IQ4_NL, T.Q4_K, T.Q6_K]


def _cols(qtype) -> int:
    return 256 if qtype in (T.Q4_K, T.Q6_K) else 32


def _weights(rng, qtype, shape):
    w = rng.standard_normal(shape).astype(np.float32)
    raw = tg.quantize(w.reshape(-1, shape[-1]), qtype)
    return raw, tg.dequantize(raw, qtype, shape)


def _product(qtype, raw, deq, b, threads, quantized=True):
    """b @ deq over the last two axes, by mul_mat(transpose(W), b, gemm=True)."""
    with tg.Runtime("cpu", threads=threads) as rt, tg.Context(max_tensors=8) as cin, tg.Context(max_tensors=16) as ops:
        wt = cin.tensor(qtype if quantized else F32, deq.shape)
        bt = cin.tensor(F32, b.shape)
        out = ops.mul_mat(ops.transpose(wt), bt, gemm=True).set_output()
        g = tg.Graph(ops, size=64).build_forward(out)
        cin.allocate(rt)
        wt.set_raw(raw) if quantized else wt.set(deq)
        bt.set(b)
        rt.compute(g)
        assert [n.op for n in g.nodes][-1] == "MUL_MAT"
        return out.numpy().copy()


# (W's leading shape: rows K, then columns N in units of the type's block), rows of b (M)
CASES = [((40,), 8, 7), ((300,), 3, 33), ((2, 20), 8, 5), ((17,), 24, 9)]


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"K{c[0]}-N{c[1]}-M{c[2]}")
def test_quantized_operand_is_the_dequantized_product_bit_for_bit(qtype, case):
    lead, blocks, m = case
    n = blocks * _cols(qtype)
    if qtype in (T.Q4_K, T.Q6_K):
        n = min(n, 768)
    rng = np.random.default_rng(len(lead) * 1000 + lead[-1] + n + m)
    raw, deq = _weights(rng, qtype, lead + (n,))  # W: (..., K, N), each row N quantized values
    b = rng.standard_normal(lead[:-1] + (m, lead[-1])).astype(np.float32)  # (..., M, K)
    want = _product(qtype, raw, deq, b, 2, quantized=False)
    got = {th: _product(qtype, raw, deq, b, th) for th in (1, 2, 3)}
    for th, x in got.items():
        assert x.shape == lead[:-1] + (m, n)
        assert x.tobytes() == want.tobytes(), (qtype.name, th)
    ref = np.matmul(b.astype(np.float64), deq.astype(np.float64))
    np.testing.assert_allclose(got[1], ref, rtol=1e-4, atol=1e-4 * np.abs(ref).max())


def test_a_transposed_quantized_operand_needs_the_gemm():
    with tg.Context(max_tensors=8) as ctx:
        w = ctx.tensor(T.Q8_0, (8, 64))
        with pytest.raises(ValueError, match="transposed"):  # ggml's own kernels cannot read it
            ctx.mul_mat(ctx.transpose(w), ctx.tensor(F32, (3, 8)), gemm=False)
        assert ctx.mul_mat(ctx.transpose(w), ctx.tensor(F32, (3, 8)), gemm=True).shape == (3, 64)
        assert ctx.mul_mat(w, ctx.tensor(F32, (3, 64)), gemm=True).shape == (3, 8)  # not transposed: ggml's
