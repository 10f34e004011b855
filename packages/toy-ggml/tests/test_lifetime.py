"""Handle ownership: close(), use after close, dependencies between contexts,
and zero-copy memory (mmaps and bytearrays) bound into tensors.

The contract (toy_ggml._core, _handles.pxi): close() is idempotent; using a
closed handle raises ClosedError; memory that live objects still point into is
kept until they are gone; read-only memory is never written.

Cases that could crash the interpreter run in a child process, so a crash is
a failed test, not a dead test run.
"""

from __future__ import annotations

import gc
import mmap
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import toy_ggml as tg

F32 = tg.GGMLType.F32
I32 = tg.GGMLType.I32


def _allocated(rt, values, *, ctx=None):
    """A context holding one F32 tensor per array in ``values``, allocated and set."""
    ctx = ctx or tg.Context()
    ts = [ctx.tensor(F32, v.shape) for v in values]
    ctx.allocate(rt)
    for t, v in zip(ts, values):
        t.set(v)
    return ctx, ts


def _aligned_zeros(n: int) -> np.ndarray:
    """n float32 zeros at a 32-byte aligned address (buffer_from_memory needs it)."""
    raw = np.zeros(n * 4 + 32, np.uint8)
    off = (-raw.ctypes.data) % 32
    return raw[off : off + n * 4].view(np.float32)


def _run_child(code: str):
    env = dict(os.environ, GGML_NO_BACKTRACE="1")
    r = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=120, env=env
    )
    return r, f"rc={r.returncode}\nstdout:\n{r.stdout[-2000:]}\nstderr:\n{r.stderr[-2000:]}"


# ---------------------------------------------------------------------------
# close() is idempotent


def test_context_close_twice():
    ctx = tg.Context()
    ctx.close()
    ctx.close()
    assert ctx.closed


def test_context_with_block_closes():
    with tg.Context() as ctx:
        t = ctx.tensor(F32, (2,))
    assert ctx.closed
    with pytest.raises(tg.ClosedError):
        t.shape  # noqa: B018
    ctx.close()


def test_runtime_close_twice():
    r = tg.Runtime("cpu", threads=1)
    r.close()
    r.close()
    assert r.closed
    assert "closed" in repr(r)


def test_buffer_close_twice():
    arr = _aligned_zeros(64)
    buf = tg.buffer_from_memory(arr)
    buf.close()
    buf.close()
    assert buf.closed


def test_allocated_buffer_close_twice(rt):
    with tg.Context() as ctx:
        ctx.tensor(F32, (4,))
        buf = ctx.allocate(rt)
        assert buf is not None
        buf.close()
        buf.close()


# ---------------------------------------------------------------------------
# use after close raises ClosedError


def test_tensor_use_after_context_close(rt):
    ctx, (t,) = _allocated(rt, [np.arange(4, dtype=np.float32)])
    ctx.close()
    for use in (
        lambda: t.shape,
        lambda: t.dtype,
        lambda: t.name,
        lambda: t.size,
        lambda: t.numpy(),
        lambda: t.raw(),
        lambda: t.set(np.zeros(4, np.float32)),
        lambda: t.set_float(np.zeros(4, np.float32)),
        lambda: t.host_view(),
        lambda: t.set_param(),
        lambda: t.allocated,
    ):
        with pytest.raises(tg.ClosedError):
            use()
    assert "closed" in repr(t)


def test_ops_after_context_close():
    ctx = tg.Context()
    a = ctx.tensor(F32, (2, 3))
    ctx.close()
    with pytest.raises(tg.ClosedError):
        ctx.tensor(F32, (2,))
    with pytest.raises(tg.ClosedError):
        ctx.add(a, a)
    with pytest.raises(tg.ClosedError):
        ctx.mul_mat(a, a)
    with pytest.raises(tg.ClosedError):
        ctx.allocate()
    with pytest.raises(tg.ClosedError):
        ctx.tensors()
    with pytest.raises(tg.ClosedError):
        tg.Graph(ctx)
    # a tensor of a closed context used by an open one
    with tg.Context() as other:
        b = other.tensor(F32, (2, 3))
        with pytest.raises(tg.ClosedError):
            other.add(a, b)
        with pytest.raises(tg.ClosedError):
            other.add(b, a)


def test_graph_after_context_close(rt):
    ctx = tg.Context()
    a = ctx.tensor(F32, (3,))
    out = ctx.sqr(a)
    g = tg.Graph(ctx).build_forward(out)
    ctx.allocate(rt)
    a.set(np.arange(3, dtype=np.float32))
    rt.compute(g)
    ctx.close()
    with pytest.raises(tg.ClosedError):
        g.build_forward(out)
    with pytest.raises(tg.ClosedError):
        rt.compute(g)
    with pytest.raises(tg.ClosedError):
        g.n_nodes  # noqa: B018
    with pytest.raises(tg.ClosedError):
        g.nodes  # noqa: B018
    assert "closed" in repr(g)


def test_runtime_use_after_close():
    r = tg.Runtime("cpu", threads=1)
    with tg.Context() as ctx:
        a = ctx.tensor(F32, (3,))
        g = tg.Graph(ctx).build_forward(ctx.sqr(a))
        r.close()
        with pytest.raises(tg.ClosedError):
            r.compute(g)
        with pytest.raises(tg.ClosedError):
            r.allocate(g)
        with pytest.raises(tg.ClosedError):
            r.backends  # noqa: B018
        with pytest.raises(tg.ClosedError):
            ctx.allocate(r)


def test_buffer_use_after_close():
    arr = _aligned_zeros(64)
    buf = tg.buffer_from_memory(arr)
    buf.close()
    with pytest.raises(tg.ClosedError):
        buf.size  # noqa: B018
    with tg.Context() as ctx:
        t = ctx.tensor(F32, (4,))
        with pytest.raises(tg.ClosedError):
            t.bind(buf, 0)


def test_to_float_after_context_close_raises_closed_error():
    r, detail = _run_child(
        """
        import numpy as np, toy_ggml as tg
        ctx = tg.Context()
        t = ctx.tensor(tg.GGMLType.F32, (4,))
        ctx.allocate()
        t.set(np.ones(4, np.float32))
        ctx.close()
        try:
            t.to_float()
            print("RESULT no exception")
        except tg.ClosedError:
            print("RESULT ClosedError")
        """
    )
    assert r.returncode == 0, "child crashed: " + detail
    assert "RESULT ClosedError" in r.stdout, detail


# ---------------------------------------------------------------------------
# objects that point into a context keep it alive


def test_del_context_while_tensors_live(rt):
    ctx = tg.Context()
    t = ctx.tensor(F32, (2, 6), name="t")
    r = ctx.reshape(t, (3, 4))
    v = ctx.view(t, (4,), offset=8 * 4)
    tt = ctx.transpose(t)
    ctx.allocate(rt)
    data = np.arange(12, dtype=np.float32).reshape(2, 6)
    t.set(data)
    del ctx
    gc.collect()
    np.testing.assert_array_equal(t.numpy(), data)
    np.testing.assert_array_equal(r.numpy(), data.reshape(3, 4))
    np.testing.assert_array_equal(v.numpy(), data.reshape(-1)[8:12])
    assert tt.shape == (6, 2)
    # the context is still usable through its tensors
    ctx2 = t.context
    out = ctx2.cont(tt)
    g = tg.Graph(ctx2).build_forward(out)
    rt.compute(g)
    np.testing.assert_array_equal(out.numpy(), data.T)
    del ctx2, out, g
    gc.collect()
    np.testing.assert_array_equal(t.numpy(), data)


def test_host_view_keeps_tensor_alive(rt):
    ctx, (t,) = _allocated(rt, [np.arange(6, dtype=np.float32)])
    hv = t.host_view()
    del ctx, t
    gc.collect()
    np.testing.assert_array_equal(hv, np.arange(6, dtype=np.float32))


@pytest.mark.parametrize("memory", ["allocated", "mmap"])
def test_host_view_survives_context_close(tmp_path, memory):
    path = tmp_path / "data.bin"
    r, detail = _run_child(
        f"""
        import gc, mmap
        import numpy as np, toy_ggml as tg
        n = 1 << 18   # 1 MiB: large allocations are unmapped when freed
        data = np.arange(n, dtype=np.float32)
        ctx = tg.Context()
        t = ctx.tensor(tg.GGMLType.F32, (n,))
        if {memory!r} == "mmap":
            open({str(path)!r}, "wb").write(data.tobytes())
            with open({str(path)!r}, "rb") as f:
                mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
            buf = tg.buffer_from_memory(mm)
            t.bind(buf, 0)
            del mm, buf
        else:
            ctx.allocate()
            t.set(data)
        hv = t.host_view()
        ctx.close()
        gc.collect()
        junk = [np.full(n, 7.0, np.float32) for _ in range(4)]   # reuse freed memory
        print("RESULT", "same" if np.array_equal(hv, data) else "changed")
        """
    )
    assert r.returncode == 0, "child crashed: " + detail
    assert "RESULT same" in r.stdout, detail


def test_compute_context_keeps_weights_context_alive(rt, rng):
    w_val = rng.standard_normal((3, 4)).astype(np.float32)
    x_val = rng.standard_normal((2, 4)).astype(np.float32)
    wctx, (w,) = _allocated(rt, [w_val])
    ctx = tg.Context()
    x = ctx.tensor(F32, (2, 4))
    out = ctx.mul_mat(w, x)
    g = tg.Graph(ctx).build_forward(out)
    del w, wctx  # the user drops the weights context without closing it
    gc.collect()
    ctx.allocate(rt)
    x.set(x_val)
    rt.compute(g)
    np.testing.assert_allclose(out.numpy(), x_val @ w_val.T, rtol=1e-5, atol=1e-5)
    ctx.close()
    gc.collect()


def test_closing_a_depended_on_context_defers_the_free(rt, rng):
    w_val = rng.standard_normal((3, 4)).astype(np.float32)
    x_val = rng.standard_normal((2, 4)).astype(np.float32)
    wctx, (w,) = _allocated(rt, [w_val])
    ctx = tg.Context()
    x = ctx.tensor(F32, (2, 4))
    out = ctx.mul_mat(w, x)
    g = tg.Graph(ctx).build_forward(out)
    wctx.close()  # ctx still depends on it
    assert wctx.closed
    with pytest.raises(tg.ClosedError):
        w.numpy()  # closed for new use ...
    with pytest.raises(tg.ClosedError):
        ctx.add(w, w)
    ctx.allocate(rt)
    x.set(x_val)
    rt.compute(g)  # ... but the graph that points into it still computes
    np.testing.assert_allclose(out.numpy(), x_val @ w_val.T, rtol=1e-5, atol=1e-5)
    x.set(2 * x_val)
    rt.compute(g)
    np.testing.assert_allclose(out.numpy(), 2 * x_val @ w_val.T, rtol=1e-5, atol=1e-5)
    ctx.close()  # now both are freed
    gc.collect()


def test_closing_runtime_with_live_context_defers(rng):
    r = tg.Runtime("cpu", threads=1)
    data = rng.standard_normal(5).astype(np.float32)
    ctx, (t,) = _allocated(r, [data])
    r.close()
    assert r.closed
    np.testing.assert_array_equal(t.numpy(), data)
    with tg.Context() as other:
        a = other.tensor(F32, (2,))
        with pytest.raises(tg.ClosedError):
            r.compute(tg.Graph(other).build_forward(other.sqr(a)))
    ctx.close()
    gc.collect()


def test_closing_bound_buffer_defers():
    data = _aligned_zeros(64)
    buf = tg.buffer_from_memory(data)
    with tg.Context() as ctx:
        t = ctx.tensor(F32, (8,))
        t.bind(buf, 32)
        buf.close()  # the context still points into it
        assert buf.closed
        t.set(np.arange(8, dtype=np.float32))
        np.testing.assert_array_equal(t.numpy(), np.arange(8, dtype=np.float32))
        np.testing.assert_array_equal(data[8:16], np.arange(8, dtype=np.float32))


# ---------------------------------------------------------------------------
# zero-copy memory


@pytest.fixture
def ro_mapping(tmp_path):
    """(mmap opened ACCESS_READ, float32 values, byte offset of the values)."""
    values = (np.arange(24, dtype=np.float32) - 7.5) * 0.25
    header = np.zeros(64, np.uint8)  # the tensor starts at a 32-byte aligned offset
    path = tmp_path / "weights.bin"
    path.write_bytes(header.tobytes() + values.tobytes())
    with open(path, "rb") as f:
        mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    yield mm, values, 64
    gc.collect()
    try:
        mm.close()
    except BufferError:
        pass


def test_buffer_from_readonly_mmap(ro_mapping):
    mm, values, off = ro_mapping
    buf = tg.buffer_from_memory(mm)
    assert buf.readonly
    assert buf.is_host
    assert buf.size == len(mm)
    with tg.Context() as ctx:
        t = ctx.tensor(F32, (4, 6), name="w")
        t.bind(buf, off)
        assert t.allocated
        assert t.readonly
        np.testing.assert_array_equal(t.numpy(), values.reshape(4, 6))
        hv = t.host_view()
        np.testing.assert_array_equal(hv, values.reshape(4, 6))
        assert not hv.flags.writeable
        with pytest.raises(ValueError):
            hv[0, 0] = 1.0
        with pytest.raises(ValueError):
            hv.setflags(write=True)
        with pytest.raises(ValueError):
            t.set(np.zeros((4, 6), np.float32))
        with pytest.raises(ValueError):
            t.set_float(np.zeros((4, 6), np.float32))
        with pytest.raises(ValueError):
            t.set_raw(np.zeros(96, np.uint8))
        np.testing.assert_array_equal(np.frombuffer(mm, np.float32, offset=off), values)


def test_readonly_mapping_is_usable_as_graph_input(rt, ro_mapping):
    mm, values, off = ro_mapping
    buf = tg.buffer_from_memory(mm)
    with tg.Context() as ctx:
        w = ctx.tensor(F32, (4, 6))
        w.bind(buf, off)
        x = ctx.tensor(F32, (2, 6))
        out = ctx.mul_mat(w, x)
        g = tg.Graph(ctx).build_forward(out)
        ctx.allocate(rt)
        xv = np.linspace(-1, 1, 12, dtype=np.float32).reshape(2, 6)
        x.set(xv)
        rt.compute(g)
        np.testing.assert_allclose(out.numpy(), xv @ values.reshape(4, 6).T, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("how", ["cpy", "cpy_into_view", "set_rows"])
def test_graph_writing_into_readonly_mapping_raises(rt, ro_mapping, how):
    mm, values, off = ro_mapping
    buf = tg.buffer_from_memory(mm)
    with tg.Context() as ctx:
        t = ctx.tensor(F32, (4, 6), name="mapped")
        t.bind(buf, off)
        src = ctx.tensor(F32, (4, 6))
        if how == "cpy":
            out = ctx.cpy(src, t)
        elif how == "cpy_into_view":
            out = ctx.cpy(ctx.view(src, (6,)), ctx.view(t, (6,), offset=6 * 4))
        else:
            idx = ctx.tensor(I32, (1,))
            out = ctx.set_rows(t, ctx.view(src, (1, 6)), idx)
        g = tg.Graph(ctx).build_forward(out)
        ctx.allocate(rt)
        src.set(np.full((4, 6), 99.0, np.float32))
        for x in ctx.tensors():
            if x.dtype == I32 and x.allocated:
                x.set(np.zeros(x.shape, np.int32))
        with pytest.raises(tg.GGMLError, match="read-only"):
            rt.compute(g)
        np.testing.assert_array_equal(t.numpy(), values.reshape(4, 6))


def test_mapping_outlives_mmap_and_buffer_objects(rt, tmp_path):
    values = np.arange(16, dtype=np.float32) * 1.5
    path = tmp_path / "w.bin"
    path.write_bytes(values.tobytes())
    with open(path, "rb") as f:
        mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    buf = tg.buffer_from_memory(mm)
    ctx = tg.Context()
    t = ctx.tensor(F32, (4, 4))
    t.bind(buf, 0)
    with pytest.raises(BufferError):
        mm.close()  # exported to the buffer: Python refuses to unmap it
    del mm, buf
    gc.collect()
    np.testing.assert_array_equal(t.numpy(), values.reshape(4, 4))
    hv = t.host_view()
    out = ctx.sum(t)
    g = tg.Graph(ctx).build_forward(out)
    rt.compute(g)
    assert out.numpy()[0] == pytest.approx(values.sum())
    del ctx, t, out, g
    gc.collect()
    np.testing.assert_array_equal(hv, values.reshape(4, 4))  # the view keeps the mapping


def _aligned_slice(ba: bytearray, nbytes: int, misalign: int = 0):
    addr = np.frombuffer(ba, np.uint8).ctypes.data
    start = (-addr) % 32 + misalign
    return start, memoryview(ba)[start : start + nbytes]


def test_writable_bytearray_buffer(rt):
    ba = bytearray(256)
    start, mv = _aligned_slice(ba, 128)
    buf = tg.buffer_from_memory(mv)
    assert not buf.readonly
    with tg.Context() as ctx:
        t = ctx.tensor(F32, (8,))
        t.bind(buf, 0)
        u = ctx.tensor(F32, (8,))
        u.bind(buf, 64)
        assert not t.readonly
        t.set(np.arange(8, dtype=np.float32))
        np.testing.assert_array_equal(np.frombuffer(ba, np.float32, 8, start), np.arange(8, dtype=np.float32))
        # writes through a writable host_view land in the bytearray too
        hv = t.host_view()
        assert hv.flags.writeable
        hv[0] = 42.0
        assert np.frombuffer(ba, np.float32, 1, start)[0] == 42.0
        # and so does a graph that writes into bound memory
        src = ctx.tensor(F32, (8,))
        out = ctx.cpy(ctx.scale(src, 2.0), u)
        g = tg.Graph(ctx).build_forward(out)
        ctx.allocate(rt)
        src.set(np.arange(8, dtype=np.float32))
        rt.compute(g)
        np.testing.assert_array_equal(np.frombuffer(ba, np.float32, 8, start + 64), 2 * np.arange(8))
        del hv


def test_bytes_give_readonly_buffer():
    data = np.arange(8, dtype=np.float32).tobytes()
    try:
        buf = tg.buffer_from_memory(data)
    except ValueError as e:  # bytes objects are not 32-byte aligned in general
        assert "aligned" in str(e)
        return
    assert buf.readonly


def test_misaligned_memory_raises_value_error():
    ba = bytearray(256)
    for misalign in (1, 4, 16):
        _, mv = _aligned_slice(ba, 64, misalign)
        with pytest.raises(ValueError, match="aligned"):
            tg.buffer_from_memory(mv)
    arr = np.zeros(80, np.uint8)
    off = (-arr.ctypes.data) % 32 + 8
    with pytest.raises(ValueError, match="aligned"):
        tg.buffer_from_memory(arr[off : off + 64])


def test_empty_memory_raises_value_error():
    with pytest.raises(ValueError):
        tg.buffer_from_memory(bytearray())


def test_bind_checks():
    data = _aligned_zeros(16)
    buf = tg.buffer_from_memory(data)
    with tg.Context() as ctx:
        t = ctx.tensor(F32, (8,))
        with pytest.raises(ValueError):
            t.bind(buf, 40)  # 32 bytes from offset 40 in a 64-byte buffer
        t.bind(buf, 0)
        with pytest.raises(tg.GGMLError):
            t.bind(buf, 0)  # already has memory
        v = ctx.view(ctx.tensor(F32, (8,)), (4,))
        with pytest.raises(tg.GGMLError):
            v.bind(buf, 32)  # views are bound through their source


# ---------------------------------------------------------------------------
# tensors without memory, runtime arguments


def test_reading_unallocated_tensor_raises():
    with tg.Context() as ctx:
        t = ctx.tensor(F32, (3,), name="nomem")
        assert not t.allocated
        assert t.device is None
        for use in (t.numpy, t.raw, t.host_view, t.to_float, lambda: t.set(np.zeros(3, np.float32))):
            with pytest.raises(tg.GGMLError, match="no memory"):
                use()


def test_runtime_unknown_device_lists_devices():
    with pytest.raises(ValueError) as ei:
        tg.Runtime("no-such-device-7", threads=1)
    msg = str(ei.value)
    assert "no-such-device-7" in msg
    for d in tg.devices():
        assert d.name in msg


@pytest.mark.parametrize("threads", [0, -1, 513])
def test_runtime_bad_threads(threads):
    with pytest.raises(ValueError, match="threads"):
        tg.Runtime("cpu", threads=threads)


def test_runtime_after_failed_init_is_harmless():
    with pytest.raises(ValueError):
        tg.Runtime("cpu", threads=0)
    gc.collect()  # the half-made object must deallocate cleanly
