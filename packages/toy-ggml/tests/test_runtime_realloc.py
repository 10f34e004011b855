"""A Runtime switching between graphs: the scheduler reuses (and, when a
larger graph comes, replaces) its compute memory. Graphs computed earlier must
compute correctly again, and their op results must not be readable once their
memory went to another graph. (Before the fix, recomputing a small graph after
a larger one wrote into freed memory and crashed.)"""

from __future__ import annotations

import numpy as np
import pytest

import toy_ggml as tg


def chain(ctx, x, n):
    y = x
    for _ in range(n):
        y = ctx.add(ctx.scale(y, 0.5), x)
    return y


def reference(x, n):
    y = x
    for _ in range(n):
        y = 0.5 * y + x
    return y


def test_switching_graphs_recomputes_correctly(rng):
    x = rng.standard_normal((64, 64)).astype(np.float32)
    big = rng.standard_normal((512, 512)).astype(np.float32)
    with (
        tg.Runtime("cpu", threads=2) as rt,
        tg.Context(max_tensors=4096) as inputs,
        tg.Context(max_tensors=4096) as ctx,
    ):
        xs = inputs.tensor(tg.GGMLType.F32, x.shape)
        xb = inputs.tensor(tg.GGMLType.F32, big.shape)
        inputs.allocate(rt)
        xs.set(x)
        xb.set(big)
        small_out = chain(ctx, xs, 3)
        big_out = chain(ctx, xb, 40)  # needs far more scheduler memory
        g_small = tg.Graph(ctx).build_forward(small_out)
        g_big = tg.Graph(ctx).build_forward(big_out)
        for _ in range(3):
            rt.compute(g_small)
            np.testing.assert_allclose(small_out.numpy(), reference(x, 3), rtol=1e-5)
            rt.compute(g_big)
            np.testing.assert_allclose(big_out.numpy(), reference(big, 40), rtol=1e-5)
            # the small graph's result lost its memory to the big graph
            with pytest.raises(tg.GGMLError, match="no memory"):
                small_out.numpy()


def test_graph_rebuilt_after_scheduler_growth(rng):
    # a graph larger than the scheduler's node capacity makes the Runtime
    # replace its scheduler; the earlier graph must survive that too
    x = rng.standard_normal(16).astype(np.float32)
    with tg.Runtime("cpu", threads=1, graph_size=1024) as rt, tg.Context(max_tensors=8192) as ctx:
        xs = ctx.tensor(tg.GGMLType.F32, x.shape)
        a = chain(ctx, xs, 2)
        g_a = tg.Graph(ctx).build_forward(a)
        ctx_inputs_allocated = ctx.allocate(rt)  # every tensor so far gets its own memory
        assert ctx_inputs_allocated is not None
        xs.set(x)
        b = chain(ctx, xs, 1500)
        g_b = tg.Graph(ctx, size=8192).build_forward(b)
        rt.compute(g_a)
        rt.compute(g_b)
        np.testing.assert_allclose(b.numpy(), reference(x, 1500), rtol=1e-4)
        rt.compute(g_a)
        np.testing.assert_allclose(a.numpy(), reference(x, 2), rtol=1e-5)


def test_runtime_poll_range():
    """poll is ggml's thread-pool spin level; out of 0..100 is refused before C sees it."""
    for bad in (-1, 101):
        with pytest.raises(ValueError, match="poll="):
            tg.Runtime("cpu", threads=2, poll=bad)
    for ok in (0, 50):
        tg.Runtime("cpu", threads=2, poll=ok).close()


def test_backward_graph_survives_another_graph_in_between():
    """The loss-gradient seed is a leaf that build_backward creates; the
    scheduler gives it memory like any op result. After another graph was
    allocated on the same Runtime, that memory belongs to someone else: the
    Runtime must forget the seed's old address too (it once did not, and the
    second backward pass read garbage as d loss / d loss)."""
    rt = tg.Runtime("cpu", threads=1)
    cin = tg.Context(max_tensors=8)
    x = cin.tensor(tg.GGMLType.F32, (64,)).set_param()
    cin.allocate(rt)
    xs = np.arange(64, dtype=np.float32)
    x.set(xs)
    ops = tg.Context(max_tensors=256)
    loss = ops.sum(ops.sqr(ops.scale(x, 2.0))).set_loss().set_output()
    g = tg.Graph(ops, size=1024, grads=True).build_forward(loss).build_backward()
    gx = g.grad(x).set_output()
    seed = g.grad(loss).set_input()

    def grad():
        rt.allocate(g)
        seed.set(np.ones(1, np.float32))
        rt.compute(g)
        return gx.numpy().copy()

    np.testing.assert_array_equal(grad(), 8 * xs)  # d/dx sum((2x)^2) = 8x
    ops2 = tg.Context(max_tensors=64)
    other = tg.Graph(ops2, size=64).build_forward(ops2.exp(ops2.scale(x, 1e-3)).set_output())
    rt.compute(other)
    np.testing.assert_array_equal(grad(), 8 * xs)
