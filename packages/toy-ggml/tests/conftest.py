"""Shared fixtures for toy_ggml tests.

``eval_graph`` is the one way tests run ops: it makes a fresh Context, turns
NumPy inputs into ggml tensors, lets the test build ops, allocates every
tensor of the context on the CPU runtime, uploads the inputs, computes, and
returns the outputs as NumPy arrays. Expected values always come from NumPy
(or a finite-difference estimate), never from ggml itself.
"""

from __future__ import annotations

import numpy as np
import pytest

import toy_ggml as tg


@pytest.fixture(scope="session")
def rt():
    r = tg.Runtime("cpu", threads=2)
    yield r
    r.close()


@pytest.fixture
def rng():
    return np.random.default_rng(1234)


_NP2GGML = {
    np.dtype(np.float32): tg.GGMLType.F32,
    np.dtype(np.float16): tg.GGMLType.F16,
    np.dtype(np.int32): tg.GGMLType.I32,
    np.dtype(np.int64): tg.GGMLType.I64,
}


def make_input(ctx, x, name=None):
    """A leaf tensor for input ``x``: a NumPy array (dtype picks the ggml type)
    or a ``(GGMLType, float_array)`` pair for quantized/BF16 data (stored via
    set_float, i.e. quantized by ggml)."""
    if isinstance(x, tuple):
        dtype, arr = x
        t = ctx.tensor(dtype, np.shape(arr), name=name)
        return t, ("float", np.asarray(arr, dtype=np.float32))
    arr = np.asarray(x)
    t = ctx.tensor(_NP2GGML[arr.dtype], arr.shape, name=name)
    return t, ("set", arr)


def eval_graph(rt, build, *inputs, max_tensors=512, params=()):
    """Compute ``build(ctx, *tensors)`` (one tensor or a tuple) and return
    NumPy copies of the output(s)."""
    with tg.Context(max_tensors=max_tensors) as ctx:
        made = [make_input(ctx, x, name=f"in{i}") for i, x in enumerate(inputs)]
        ts = [t for t, _ in made]
        out = build(ctx, *ts)
        outs = out if isinstance(out, tuple) else (out,)
        g = tg.Graph(ctx, size=4096).build_forward(*outs)
        ctx.allocate(rt)
        for t, (how, arr) in made:
            (t.set if how == "set" else t.set_float)(arr)
        rt.compute(g)
        res = tuple(
            o.numpy()
            if o.dtype in (tg.GGMLType.F32, tg.GGMLType.I32, tg.GGMLType.F16, tg.GGMLType.I64)
            else o.to_float()
            for o in outs
        )
        return res if isinstance(out, tuple) else res[0]
