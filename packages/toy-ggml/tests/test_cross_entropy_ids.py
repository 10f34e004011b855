"""Patch 0030: ``cross_entropy_loss`` with I32 target ids instead of one-hot rows.

The ids form must give the one-hot form's results bit for bit (finite logits): the loss
(each row's log-softmax at its target, the rows added in patch 0022's order) and the
gradient of the logits (the softmax minus the one-hot row, scaled). A negative id is a row
without a target, the same as an all-zero label row. The expected values are the one-hot
form's own outputs (ggml's stock kernel on the same logits) and, for the loss, NumPy's
log-softmax in float64.
"""

from __future__ import annotations

import numpy as np
import pytest

import toy_ggml as tg

F32, I32 = tg.GGMLType.F32, tg.GGMLType.I32


def _ce(rt, logits: np.ndarray, ids: np.ndarray, *, form: str):
    """(loss, d loss / d logits) with the labels as ids (form "ids") or one-hot rows."""
    n, v = logits.shape
    with tg.Context(max_tensors=64) as ctx:
        x = ctx.tensor(F32, (n, v)).set_param()
        if form == "ids":
            lab = ctx.tensor(I32, (n,))
        else:
            lab = ctx.tensor(F32, (n, v))
        loss = ctx.cross_entropy_loss(x, lab).set_loss().set_output()
        g = tg.Graph(ctx, size=256, grads=True)
        g.build_forward(loss)
        g.build_backward()
        gx = g.grad(x)
        ctx.allocate(rt)
        x.set(logits)
        if form == "ids":
            lab.set(ids.astype(np.int32))
        else:
            onehot = np.zeros((n, v), np.float32)
            kept = ids >= 0
            onehot[np.flatnonzero(kept), ids[kept]] = 1.0
            lab.set(onehot)
        g.reset()
        rt.compute(g)
        ops = [node.op for node in g.nodes]
        return loss.numpy().copy(), gx.numpy().copy(), ops


@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("n, v", [(1, 1), (5, 7), (17, 320), (64, 1031)])
def test_ids_give_the_one_hot_bits(n, v, threads):
    rng = np.random.default_rng(n * 1000 + v)
    logits = (rng.standard_normal((n, v)) * 4.0).astype(np.float32)
    ids = rng.integers(0, v, n)
    ids[rng.random(n) < 0.25] = -1  # rows without a target
    if n > 1:
        ids[0], ids[-1] = -1, v - 1
    rt = tg.Runtime("cpu", threads=threads)
    try:
        loss_i, grad_i, ops = _ce(rt, logits, ids, form="ids")
        loss_h, grad_h, _ = _ce(rt, logits, ids, form="onehot")
    finally:
        rt.close()
    assert "CROSS_ENTROPY_LOSS" in ops and "CROSS_ENTROPY_LOSS_BACK" in ops
    assert loss_i.view(np.uint32).tolist() == loss_h.view(np.uint32).tolist()
    assert np.array_equal(grad_i.view(np.uint32), grad_h.view(np.uint32))
    # and it is the cross-entropy: the mean over all N rows of -log softmax at the target
    x = logits.astype(np.float64)
    lsm = x - x.max(axis=1, keepdims=True)
    lsm -= np.log(np.exp(lsm).sum(axis=1, keepdims=True))
    kept = ids >= 0
    want = -lsm[np.flatnonzero(kept), ids[kept]].sum() / n
    assert loss_i[0] == pytest.approx(want, rel=1e-5, abs=1e-6)


def test_no_target_at_all_gives_zero_loss_and_the_softmax_gradient(rt):
    logits = np.arange(12, dtype=np.float32).reshape(3, 4)
    ids = np.full(3, -1)
    loss, grad, _ = _ce(rt, logits, ids, form="ids")
    loss_h, grad_h, _ = _ce(rt, logits, ids, form="onehot")
    assert loss[0] == 0.0 and loss.view(np.uint32)[0] == loss_h.view(np.uint32)[0]
    assert np.array_equal(grad.view(np.uint32), grad_h.view(np.uint32))


def test_bad_ids_are_refused():
    with tg.Context(max_tensors=16) as ctx:
        x = ctx.tensor(F32, (4, 8))
        with pytest.raises(ValueError, match="target ids"):
            ctx.cross_entropy_loss(x, ctx.tensor(I32, (3,)))  # one id per row
        with pytest.raises(ValueError, match="target ids"):
            ctx.cross_entropy_loss(x, ctx.tensor(I32, (4, 1)))  # a vector
        with pytest.raises(ValueError, match="target ids"):
            ctx.cross_entropy_loss(ctx.tensor(F32, (2, 2, 8)), ctx.tensor(I32, (4,)))  # 2-D logits
        ctx.toy_ops = False  # a GPU's standard ops read F32 label rows only
        with pytest.raises(ValueError, match="toy_ops"):
            ctx.cross_entropy_loss(x, ctx.tensor(I32, (4,)))
