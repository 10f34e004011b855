"""GGUF writer: files toy writes read back identically in toy and in the
independent ``gguf`` package (PyPI, llama.cpp's own Python reader); the real
SmolLM2 file survives a read -> write -> read round trip byte for byte; writes
are atomic."""

from __future__ import annotations

import os

import gguf
import numpy as np
import pytest

import toy_ggml as tg
from toy.gguf import GGUFFile, GGUFWriter, TypeInfo, ValueType, copy_metadata


def all_types_writer(path, rng):
    w = GGUFWriter(path)
    w.add("general.architecture", "llama")
    w.add("t.u8", 200, TypeInfo(ValueType.UINT8))
    w.add("t.i8", -100, TypeInfo(ValueType.INT8))
    w.add("t.u16", 65535, TypeInfo(ValueType.UINT16))
    w.add("t.i16", -32768, TypeInfo(ValueType.INT16))
    w.add("t.u32", 4_000_000_000, TypeInfo(ValueType.UINT32))
    w.add("t.i32", -7)
    w.add("t.f32", 0.25)
    w.add("t.bool", True)
    w.add("t.u64", (1 << 64) - 1, TypeInfo(ValueType.UINT64))
    w.add("t.i64", -(1 << 62))
    w.add("t.f64", 1e300, TypeInfo(ValueType.FLOAT64))
    w.add("t.str", "héllo ✓")
    w.add("t.strs", ["a", "", "日本"])
    w.add("t.f32s", np.array([0.5, -1.5], np.float32))
    w.add("t.i32s", np.array([1, 2, 3], np.int32))
    w.add("t.bools", np.array([True, False]))
    w.add("t.nested", [np.array([1, 2], np.uint8), np.array([3], np.uint8)])
    tensors = {
        "f32": (rng.standard_normal((3, 5)).astype(np.float32), None),
        "f16": (rng.standard_normal((2, 4)).astype(np.float16), None),
        "i32": (np.arange(6, dtype=np.int32).reshape(2, 3), None),
        "q8": (rng.standard_normal((2, 64)).astype(np.float32), "Q8_0"),
        "q41": (rng.standard_normal((4, 32)).astype(np.float32), "Q4_1"),
        "vec": (rng.standard_normal(7).astype(np.float32), None),
    }
    for name, (arr, dt) in tensors.items():
        w.add_tensor(name, arr, dtype=dt)
    return w, tensors


def test_round_trip_toy_and_gguf_package(tmp_path):
    rng = np.random.default_rng(0)
    path = tmp_path / "all.gguf"
    w, tensors = all_types_writer(path, rng)
    w.write()

    with GGUFFile(path) as f:
        m = f.metadata
        assert m["t.u8"] == 200 and m["t.i8"] == -100 and m["t.u16"] == 65535 and m["t.i16"] == -32768
        assert m["t.u32"] == 4_000_000_000 and m["t.i32"] == -7 and m["t.f32"] == 0.25 and m["t.bool"] is True
        assert m["t.u64"] == (1 << 64) - 1 and m["t.i64"] == -(1 << 62) and m["t.f64"] == 1e300
        assert m["t.str"] == "héllo ✓" and m["t.strs"] == ["a", "", "日本"]
        assert m["t.f32s"].tolist() == [0.5, -1.5] and m["t.bools"].tolist() == [True, False]
        assert [a.tolist() for a in m["t.nested"]] == [[1, 2], [3]]
        assert f.types["t.i32"].type == ValueType.INT32 and f.types["t.f32"].type == ValueType.FLOAT32
        for name, (arr, dt) in tensors.items():
            info = f.tensors[name]
            assert info.shape == arr.shape
            if dt is None:
                np.testing.assert_array_equal(np.frombuffer(f.tensor_bytes(name), arr.dtype).reshape(arr.shape), arr)
            else:
                want = tg.quantize(arr, tg.GGMLType.parse(dt))
                assert bytes(f.tensor_bytes(name)) == want.tobytes()

    # the independent reader
    r = gguf.GGUFReader(path)
    assert r.fields["t.u8"].contents() == 200
    assert r.fields["t.u64"].contents() == (1 << 64) - 1
    assert r.fields["t.str"].contents() == "héllo ✓"
    assert r.fields["t.strs"].contents() == ["a", "", "日本"]
    assert r.fields["t.f32s"].contents() == [0.5, -1.5]
    assert r.fields["t.i32"].types == [gguf.GGUFValueType.INT32]
    by_name = {t.name: t for t in r.tensors}
    for name, (arr, dt) in tensors.items():
        t = by_name[name]
        assert tuple(int(d) for d in reversed(t.shape)) == arr.shape
        if dt is None:
            np.testing.assert_array_equal(np.asarray(t.data).reshape(arr.shape), arr)
        else:
            # gguf's own dequantization of our bytes equals ggml's dequantization of the same bytes
            ref = gguf.quants.dequantize(np.asarray(t.data), t.tensor_type).reshape(arr.shape)
            ours = tg.dequantize(tg.quantize(arr, tg.GGMLType.parse(dt)), tg.GGMLType.parse(dt), arr.shape)
            np.testing.assert_array_equal(ref, ours)


def test_custom_alignment(tmp_path):
    w = GGUFWriter(tmp_path / "a.gguf", alignment=64)
    w.add_tensor("a", np.ones(3, np.float32))
    w.add_tensor("b", np.ones(5, np.float32))
    w.write()
    with GGUFFile(tmp_path / "a.gguf") as f:
        assert f.alignment == 64
        assert all(t.offset % 64 == 0 for t in f.tensors.values())
    r = gguf.GGUFReader(tmp_path / "a.gguf")
    assert r.alignment == 64


def test_writer_rejects_bad_input(tmp_path):
    w = GGUFWriter(tmp_path / "x.gguf")
    w.add("k", 1)
    with pytest.raises(ValueError, match="duplicate metadata key"):
        w.add("k", 2)
    with pytest.raises(ValueError, match="not a valid UINT8"):
        w.add("u", 300, TypeInfo(ValueType.UINT8))
    with pytest.raises(ValueError, match="empty list"):
        w.add("e", [])
    with pytest.raises(ValueError, match="cannot store"):
        w.add("o", object())
    w.add_tensor("t", np.zeros(4, np.float32))
    with pytest.raises(ValueError, match="duplicate tensor name"):
        w.add_tensor("t", np.zeros(4, np.float32))
    with pytest.raises(ValueError, match="longer than"):
        w.add_tensor("x" * 64, np.zeros(4, np.float32))
    with pytest.raises(ValueError, match="block"):
        w.add_tensor("q", np.zeros((2, 16), np.float32), dtype="Q8_0")
    with pytest.raises(ValueError, match="needs"):
        w.add_tensor_bytes("r", (4,), "F32", b"\0" * 15)
    with pytest.raises(ValueError, match="power of two"):
        GGUFWriter(tmp_path / "y.gguf", alignment=48)


def test_write_is_atomic(tmp_path, monkeypatch):
    path = tmp_path / "m.gguf"
    w = GGUFWriter(path)
    w.add("v", 1)
    w.write()
    before = path.read_bytes()

    w2 = GGUFWriter(path)
    w2.add("v", 2)
    w2.add_tensor("t", np.zeros(1000, np.float32))

    def boom(*a, **k):
        raise OSError("disk full (simulated)")

    monkeypatch.setattr(os, "replace", boom)
    with pytest.raises(OSError, match="simulated"):
        w2.write()
    monkeypatch.undo()
    assert path.read_bytes() == before  # the old file is untouched
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.gguf"]  # no temp file left behind
    w2.write()
    with GGUFFile(path) as f:
        assert f.metadata["v"] == 2


@pytest.mark.model
@pytest.mark.slow
def test_real_model_round_trip(tmp_path, smollm2_path):
    out = tmp_path / "copy.gguf"
    with GGUFFile(smollm2_path) as src:
        w = GGUFWriter(out, alignment=src.alignment)
        copy_metadata(src, w)
        for info in src.tensors.values():
            w.add_tensor_bytes(info.name, info.shape, info.dtype, src.tensor_bytes(info.name))
        w.write()
        with GGUFFile(out) as dst:
            assert list(dst.metadata) == list(src.metadata)
            for k in src.metadata:
                assert dst.types[k] == src.types[k], k
                a, b = src.metadata[k], dst.metadata[k]
                if isinstance(a, np.ndarray):
                    np.testing.assert_array_equal(a, b)
                else:
                    assert a == b, k
            assert list(dst.tensors) == list(src.tensors)
            for name, info in src.tensors.items():
                d = dst.tensors[name]
                assert (d.shape, d.dtype, d.nbytes) == (info.shape, info.dtype, info.nbytes)
                assert dst.tensor_bytes(name) == src.tensor_bytes(name), name
    # gguf reads the copy with the same keys, types and tensor bytes as the original
    ra, rb = gguf.GGUFReader(smollm2_path), gguf.GGUFReader(out)
    assert [f for f in ra.fields if not f.startswith("GGUF.")] == [f for f in rb.fields if not f.startswith("GGUF.")]
    for name, fa in ra.fields.items():
        if name.startswith("GGUF."):
            continue
        fb = rb.fields[name]
        assert fa.types == fb.types, name
        assert fa.contents() == fb.contents(), name
    for ta, tb in zip(ra.tensors, rb.tensors):
        assert ta.name == tb.name and ta.tensor_type == tb.tensor_type
        assert np.array_equal(np.asarray(ta.data), np.asarray(tb.data)), ta.name
