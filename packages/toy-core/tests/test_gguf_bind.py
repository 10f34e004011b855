"""ggml tensors bound over a GGUF file: zero-copy and read-only on the CPU,
quantized types kept, the mapping alive as long as any tensor, and computing
with them matches the independent ``gguf`` package's dequantization."""

from __future__ import annotations

import gc

import gguf
import numpy as np
import pytest

import toy_ggml as tg
from toy.gguf import GGUFFile, GGUFWriter, bind_tensors


@pytest.fixture
def small_file(tmp_path):
    rng = np.random.default_rng(3)
    w = GGUFWriter(tmp_path / "m.gguf")
    arrays = {
        "w8": (rng.standard_normal((16, 64)).astype(np.float32), "Q8_0"),
        "w41": (rng.standard_normal((16, 64)).astype(np.float32), "Q4_1"),
        "n": (rng.standard_normal(64).astype(np.float32), None),
    }
    for k, (a, dt) in arrays.items():
        w.add_tensor(k, a, dtype=dt)
    w.write()
    return tmp_path / "m.gguf", arrays


def test_bind_is_zero_copy_and_read_only(small_file):
    path, arrays = small_file
    with GGUFFile(path) as f:
        b = bind_tensors(f)
        assert b.zero_copy
        for name, info in f.tensors.items():
            t = b[name]
            assert t.dtype == info.dtype and t.shape == info.shape
            assert t.readonly and t.device == "CPU_Mapped"
            assert bytes(t.raw()) == bytes(f.tensor_bytes(name))
        with pytest.raises(ValueError, match="read-only"):
            b["n"].set(np.zeros(64, np.float32))
        view = b["n"].host_view()
        assert not view.flags.writeable
        np.testing.assert_array_equal(view, arrays["n"][0])


def test_mapping_outlives_the_file_object(small_file):
    path, arrays = small_file
    f = GGUFFile(path)
    b = bind_tensors(f)
    f.close()
    del f
    gc.collect()
    np.testing.assert_array_equal(b["n"].numpy(), arrays["n"][0])
    b.close()


def test_compute_with_quantized_weights_matches_gguf_package(small_file):
    path, _ = small_file
    rng = np.random.default_rng(4)
    x = rng.standard_normal((5, 64)).astype(np.float32)
    reader = gguf.GGUFReader(path)
    ref_w = {
        t.name: gguf.quants.dequantize(np.asarray(t.data), t.tensor_type).reshape(16, 64)
        for t in reader.tensors
        if t.name.startswith("w")
    }
    with tg.Runtime("cpu", threads=2) as rt, GGUFFile(path) as f:
        b = bind_tensors(f)
        for name in ("w8", "w41"):
            with tg.Context() as ctx:
                xt = ctx.tensor(tg.GGMLType.F32, x.shape)
                y = ctx.mul_mat(b[name], xt)
                g = tg.Graph(ctx).build_forward(y)
                ctx.allocate(rt)
                xt.set(x)
                rt.compute(g)
                got = y.numpy()
            ref = x @ ref_w[name].T
            # ggml quantizes the activations to 8 bits inside quantized dot products
            rel = np.linalg.norm(got - ref) / np.linalg.norm(ref)
            assert rel < 1e-2, (name, rel)
        np.testing.assert_array_equal(b["w41"].to_float(), ref_w["w41"])


@pytest.mark.model
def test_bind_real_model(smollm2_path):
    with GGUFFile(smollm2_path) as f:
        b = bind_tensors(f)
        assert len(b.tensors) == len(f.tensors) == 272
        reader = gguf.GGUFReader(smollm2_path)
        for t in reader.tensors[:6]:
            ours = b[t.name]
            assert ours.dtype == tg.GGMLType(int(t.tensor_type))
            assert ours.shape == tuple(int(d) for d in reversed(t.shape))
            ref = gguf.quants.dequantize(np.asarray(t.data), t.tensor_type).reshape(ours.shape)
            np.testing.assert_array_equal(ours.to_float(), ref)


def test_bind_to_a_device_buffer_copies(small_file):
    # with a non-CPU runtime the tensors are copied into the device's buffer;
    # the CPU runtime is the only device here, so exercise the copy path by hand
    path, arrays = small_file
    with tg.Runtime("cpu", threads=1) as rt, GGUFFile(path) as f:
        ctx = tg.Context()
        t = ctx.tensor(f.tensors["w8"].dtype, f.tensors["w8"].shape)
        ctx.allocate(rt)
        t.set_raw(f.tensor_bytes("w8"))
        assert not t.readonly
        assert bytes(t.raw()) == bytes(f.tensor_bytes("w8"))
        ctx.close()
