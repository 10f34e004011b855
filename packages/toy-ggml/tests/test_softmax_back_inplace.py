"""Patch 0005: SOFT_MAX_BACK is right when the graph allocator computes it in
place over its inputs.

An attention block (scores = K^T Q, a masked softmax, then V) is
differentiated twice: once with every tensor in its own memory
(``Context.allocate``: no reuse) and once with op results allocated by the
Runtime's scheduler, which reuses memory in place (upstream ggml then
overwrote the softmax output before reading it, and the query/key gradients
came out wrong while the value gradient was right). Both must agree exactly
(the same kernels run on the same values), and the no-reuse gradients must
equal a NumPy float64 reference of the same block.
"""

from __future__ import annotations

import numpy as np

import toy_ggml as tg

F32 = tg.GGMLType.F32
B, T, H, D = 2, 12, 4, 8
SCALE = 0.5


def _inputs():
    rng = np.random.default_rng(0)
    q = rng.standard_normal((B * H, T, D)).astype(np.float32)
    k = rng.standard_normal((B * H, T, D)).astype(np.float32)
    v = rng.standard_normal((B * H, D, T)).astype(np.float32)
    w = rng.standard_normal((B * H, T, D)).astype(np.float32)
    mask = np.broadcast_to(np.triu(np.full((T, T), -np.inf, np.float32), 1), (B, 1, T, T)).copy()
    return q, k, v, w, mask


def _ggml_grads(scheduler: bool):
    q, k, v, w, mask = _inputs()
    rt = tg.Runtime("cpu", threads=1)
    cin = tg.Context(max_tensors=16)
    qt, kt, vt = (cin.tensor(F32, a.shape).set_param() for a in (q, k, v))
    wt, mt = cin.tensor(F32, w.shape), cin.tensor(F32, mask.shape)
    ops = tg.Context(max_tensors=1024)
    scores = ops.reshape(ops.mul_mat(kt, qt), (B, H, T, T))
    probs = ops.reshape(ops.soft_max(scores, mt, SCALE), (B * H, T, T))
    out = ops.mul_mat(vt, probs)  # (B*H, T, D)
    loss = ops.sum(ops.mul(out, wt)).set_loss().set_output()
    g = tg.Graph(ops, size=4096, grads=True).build_forward(loss).build_backward()
    grads = [g.grad(t) for t in (qt, kt, vt)]
    grads = [(x if x.is_contiguous else ops.cont(x)).set_output() for x in grads]
    g.build_forward(*grads)
    cin.allocate(rt)
    if scheduler:
        seed = g.grad(loss).set_input()
        rt.allocate(g)
        seed.set(np.ones(1, np.float32))
    else:
        ops.allocate(rt)
        g.reset()
    for t, a in zip((qt, kt, vt, wt, mt), (q, k, v, w, mask)):
        t.set(a)
    rt.compute(g)
    res = [x.numpy().copy() for x in grads]
    ops.close()
    cin.close()
    rt.close()
    return res


def _numpy_grads():
    q, k, v, w, mask = (a.astype(np.float64) for a in _inputs())
    s = np.einsum("ntd,nsd->nts", q, k) * SCALE + np.repeat(mask, H, axis=1).reshape(B * H, T, T)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    # out[n,t,d] = sum_s p[n,t,s] v[n,d,s]; loss = sum(out * w)
    dp = np.einsum("ntd,nds->nts", w, v)
    dv = np.einsum("nts,ntd->nds", p, w)
    ds = p * (dp - (dp * p).sum(-1, keepdims=True)) * SCALE
    dq = np.einsum("nts,nsd->ntd", ds, k)
    dk = np.einsum("nts,ntd->nsd", ds, q)
    return dq, dk, dv


def test_in_place_softmax_backward_matches_separate_memory_and_numpy():
    own = _ggml_grads(scheduler=False)
    reused = _ggml_grads(scheduler=True)
    for name, a, b in zip("qkv", own, reused):
        np.testing.assert_array_equal(a, b, err_msg=f"gradient of {name}")
    for name, a, ref in zip("qkv", own, _numpy_grads()):
        np.testing.assert_allclose(a, ref, rtol=1e-4, atol=1e-5, err_msg=f"gradient of {name}")
