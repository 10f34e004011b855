"""Tensor.sources and Tensor.view_source: a graph's structure as ggml holds
it (``src`` without the empty slots, ``view_src``), which a step trace
reads to group nodes by layer."""

from __future__ import annotations

import toy_ggml as tg


def test_sources_are_the_op_inputs_in_order_and_views_name_their_memory():
    with tg.Context(max_tensors=32) as ctx:
        a = ctx.tensor(tg.GGMLType.F32, (4, 3), name="a")
        b = ctx.tensor(tg.GGMLType.F32, (2, 3), name="b")
        y = ctx.mul_mat(a, b)
        s = ctx.add(y, y)
        t = ctx.transpose(y)
        r = ctx.reshape(ctx.cont(t), (8,))

        assert a.sources == () and a.view_source is None  # a leaf
        assert [x.address for x in y.sources] == [a.address, b.address]
        assert [x.name for x in y.sources] == ["a", "b"]
        assert [x.address for x in s.sources] == [y.address, y.address]
        assert y.view_source is None
        assert t.view_source is not None and t.view_source.address == y.address  # a view reads y's memory
        assert [x.address for x in t.sources] == [y.address]
        assert r.view_source is not None and r.view_source.address == r.sources[0].address  # reshape: a view


def test_graph_nodes_sources_reach_the_graph_leaves():
    with tg.Context(max_tensors=32) as inputs, tg.Context(max_tensors=32) as ctx:
        w = inputs.tensor(tg.GGMLType.F32, (8, 8), name="blk.0.w")
        x = inputs.tensor(tg.GGMLType.F32, (2, 8), name="x")
        out = ctx.sum_rows(ctx.silu(ctx.mul_mat(w, x)))
        g = tg.Graph(ctx).build_forward(out)
        seen = set()
        stack = [out]
        while stack:
            n = stack.pop()
            if n.address in seen:
                continue
            seen.add(n.address)
            stack.extend(n.sources)
        assert {w.address, x.address} <= seen
        assert {n.address for n in g.nodes} <= seen
