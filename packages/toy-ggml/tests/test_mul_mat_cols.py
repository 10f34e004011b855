"""Patch 0008: for Q4_1 and Q8_0 weights, ggml's CPU MUL_MAT computes each
weight row against up to 8 activation rows at once (the weight block is
loaded and unpacked once), with every output summed by the same operations
in the same order as ggml's one-row ``vec_dot`` kernel.

So the claims checked here are exact (``assert_array_equal``), not within a
tolerance:

* a product over n activation rows equals, row for row, the same rows
  multiplied one at a time (batch invariance: a sequence decoded alone or with
  others gets the same logits), for n around every group and tile boundary;
* it equals ggml's unpatched ``vec_dot`` loop, which a 3-D weight still takes
  (the patch only covers 2-D weights): the first slice of a stacked
  ``[2, out, in]`` weight multiplied by the same activations;
* a 3-D activation tensor against a 2-D weight (the broadcast case, whose
  output columns the patched loop addresses itself) equals its slices
  multiplied separately;
* the result does not depend on the thread count.

And, as a check of the arithmetic itself, the products agree with NumPy in
float64 on the dequantized weights within the error of the activations'
8-bit quantization.
"""

from __future__ import annotations

import numpy as np
import pytest

import toy_ggml as tg

Q = tg.GGMLType
OUT, IN = 37, 256  # 37 rows: not a multiple of the 16-row tile
NS = (1, 2, 3, 4, 5, 7, 8, 9, 15, 16, 17, 24, 33)


def _weights(qt, rng, shape):
    w = rng.standard_normal(shape).astype(np.float32)
    raw = tg.quantize(w.reshape(-1, shape[-1]), qt)
    return raw, tg.dequantize(raw, qt, (int(np.prod(shape[:-1])), shape[-1])).reshape(shape)


def _products(qt, raw, wshape, xs, threads=2, row_invariant=True):
    """Evaluate mul_mat(W, x) for every x in ``xs`` in one graph."""
    rt = tg.Runtime("cpu", threads=threads)
    try:
        with tg.Context(max_tensors=64) as ctx:
            w = ctx.tensor(qt, wshape)
            ins = [ctx.tensor(Q.F32, x.shape) for x in xs]
            outs = [ctx.mul_mat(w, t, row_invariant=row_invariant) for t in ins]
            g = tg.Graph(ctx, size=256).build_forward(*outs)
            ctx.allocate(rt)
            w.set_raw(raw)
            for t, x in zip(ins, xs):
                t.set(x)
            rt.compute(g)
            return [o.numpy().copy() for o in outs]
    finally:
        rt.close()


# Without patch 0004's hint a Q8_0 batch goes to tinyBLAS (a different sum
# order, patch 0004's subject); Q4_1 has no tinyBLAS kernel, so its plain
# products take the patched loop too.
@pytest.mark.parametrize(
    "qt,row_invariant",
    [(Q.Q4_1, True), (Q.Q4_1, False), (Q.Q8_0, True)],
    ids=["Q4_1-hinted", "Q4_1-plain", "Q8_0-hinted"],
)
def test_batch_equals_rows_alone(qt, row_invariant):
    rng = np.random.default_rng(8)
    raw, _ = _weights(qt, rng, (OUT, IN))
    for n in NS:
        x = rng.standard_normal((n, IN)).astype(np.float32)
        batch, *alone = _products(
            qt, raw, (OUT, IN), [x] + [x[i : i + 1] for i in range(n)], row_invariant=row_invariant
        )
        for i in range(n):
            np.testing.assert_array_equal(batch[i : i + 1], alone[i], err_msg=f"n={n} row {i}")


@pytest.mark.parametrize("qt", [Q.Q4_1, Q.Q8_0], ids=lambda q: q.name)
def test_equals_unpatched_vec_dot(qt):
    rng = np.random.default_rng(80)
    raw2, _ = _weights(qt, rng, (2, OUT, IN))
    raw1 = raw2[: len(raw2) // 2]  # the first slice's rows, as a 2-D weight
    for n in NS:
        x = rng.standard_normal((n, IN)).astype(np.float32)
        (patched,) = _products(qt, raw1, (OUT, IN), [x])
        (stacked,) = _products(qt, raw2, (2, OUT, IN), [np.stack([x, x])])
        np.testing.assert_array_equal(patched, stacked[0], err_msg=f"n={n}")


@pytest.mark.parametrize("qt", [Q.Q4_1, Q.Q8_0], ids=lambda q: q.name)
def test_broadcast_activations(qt):
    rng = np.random.default_rng(81)
    raw, _ = _weights(qt, rng, (OUT, IN))
    x = rng.standard_normal((3, 2, 11, IN)).astype(np.float32)
    whole, *parts = _products(qt, raw, (OUT, IN), [x] + [x[a, b] for a in range(3) for b in range(2)])
    assert whole.shape == (3, 2, 11, OUT)
    for k, (a, b) in enumerate((a, b) for a in range(3) for b in range(2)):
        np.testing.assert_array_equal(whole[a, b], parts[k], err_msg=f"slice {a},{b}")


# (37, 19): ggml splits the work into 16-row chunks; (16, 20): too few chunks,
# so ggml gives each thread a range of activation rows instead, which then
# start mid-tile (e.g. rows 10..19 with 2 threads)
@pytest.mark.parametrize("rows,n", [(OUT, 19), (16, 20)])
@pytest.mark.parametrize("qt", [Q.Q4_1, Q.Q8_0], ids=lambda q: q.name)
def test_threads_and_numpy(qt, rows, n):
    rng = np.random.default_rng(82)
    raw, w = _weights(qt, rng, (rows, IN))
    x = rng.standard_normal((n, IN)).astype(np.float32)
    results = [_products(qt, raw, (rows, IN), [x], threads=t)[0] for t in (1, 2, 3)]
    np.testing.assert_array_equal(results[0], results[1])
    np.testing.assert_array_equal(results[0], results[2])
    ref = x.astype(np.float64) @ w.astype(np.float64).T
    # the activations are rounded to 8 bits per value (scale max|x|/127 per
    # block of 32): error per product well under 1 % of the row's magnitude
    scale = np.abs(ref).max()
    np.testing.assert_allclose(results[0], ref, rtol=0, atol=0.01 * scale)
    assert not np.array_equal(results[0], ref.astype(np.float32))  # quantized, not exact
    alone = [_products(qt, raw, (rows, IN), [x[i : i + 1]], threads=2)[0] for i in range(n)]
    np.testing.assert_array_equal(results[1], np.concatenate(alone))
