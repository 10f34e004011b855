"""Runtime.compute(profile=True): every node of the graph is computed and
timed once, in graph order, named by its op as ggml describes it; the results
are bit-identical to an unprofiled compute (the same kernels run, one node at
a time); the scheduler's callback is removed afterwards."""

from __future__ import annotations

import numpy as np
import pytest

import toy_ggml as tg


@pytest.mark.parametrize("threads", [1, 2])
def test_profile_times_every_node_and_changes_no_result(rng, threads):
    a = rng.standard_normal((48, 96)).astype(np.float32)
    b = rng.standard_normal((40, 96)).astype(np.float32)
    with (
        tg.Runtime("cpu", threads=threads) as rt,
        tg.Context(max_tensors=16) as inputs,
        tg.Context(max_tensors=64) as ctx,
    ):
        ta = inputs.tensor(tg.GGMLType.F32, a.shape)
        tb = inputs.tensor(tg.GGMLType.F32, b.shape)
        inputs.allocate(rt)
        ta.set(a)
        tb.set(b)
        y = ctx.soft_max(ctx.silu(ctx.mul_mat(ta, tb)))
        out = ctx.sum_rows(ctx.cont(ctx.transpose(y)))
        g = tg.Graph(ctx).build_forward(out)

        assert rt.compute(g) is None
        plain = out.numpy().copy()
        nodes = rt.compute(g, profile=True)
        assert np.array_equal(out.numpy(), plain)

        want = [n.op for n in g.nodes]
        # one record per node, in order; unary and GLU ops by their own name (Tensor.op's "UNARY:SILU" is "SILU")
        assert [op for op, _, _ in nodes] == [op.split(":")[-1] for op in want]
        assert [name for _, name, _ in nodes] == [n.name for n in g.nodes]
        assert all(isinstance(s, float) and 0.0 <= s < 10.0 for _, _, s in nodes)
        assert {"MUL_MAT", "SILU", "SOFT_MAX", "SUM_ROWS", "TRANSPOSE", "CONT"} <= {op for op, _, _ in nodes}

        assert rt.compute(g) is None  # the callback is gone: a plain compute again
        assert np.array_equal(out.numpy(), plain)
