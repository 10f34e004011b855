"""GGUF reader: good files parse to the values the spec says, and one test per
failure kind raises GGUFError naming the file and the problem."""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np
import pytest

import toy_ggml as tg
from toy.gguf import GGUFError, GGUFFile, ValueType
from toy_testsupport import gguf_bytes as gb


def write(tmp_path, data: bytes, name="m.gguf") -> Path:
    p = tmp_path / name
    p.write_bytes(data)
    return p


def good_file() -> bytes:
    w = np.arange(8, dtype=np.float32)
    return gb.build(
        [
            gb.kv("general.architecture", gb.STR, gb.s("llama")),
            gb.kv("a.u8", gb.U8, struct.pack("<B", 200)),
            gb.kv("a.i8", gb.I8, struct.pack("<b", -5)),
            gb.kv("a.u16", gb.U16, struct.pack("<H", 60000)),
            gb.kv("a.i16", gb.I16, struct.pack("<h", -300)),
            gb.kv("a.u32", gb.U32, struct.pack("<I", 4_000_000_000)),
            gb.kv("a.i32", gb.I32, struct.pack("<i", -7)),
            gb.kv("a.f32", gb.F32, struct.pack("<f", 0.5)),
            gb.kv("a.bool", gb.BOOL, b"\x01"),
            gb.kv("a.u64", gb.U64, struct.pack("<Q", 1 << 60)),
            gb.kv("a.i64", gb.I64, struct.pack("<q", -(1 << 40))),
            gb.kv("a.f64", gb.F64, struct.pack("<d", 2.25)),
            gb.kv("a.strs", gb.ARR, gb.arr(gb.STR, [gb.s("x"), gb.s("é"), gb.s("")])),
            gb.kv("a.ints", gb.ARR, gb.arr(gb.I32, [struct.pack("<i", v) for v in (1, -2, 3)])),
            gb.kv("a.nested", gb.ARR, gb.arr(gb.ARR, [gb.arr(gb.U8, [b"\x01", b"\x02"]), gb.arr(gb.U8, [b"\x03"])])),
        ],
        [("w", [8], 0, 0, w.tobytes()), ("v", [4, 2], 0, 32, (w * 2).tobytes())],
    )


def test_good_file_values_and_types(tmp_path):
    with GGUFFile(write(tmp_path, good_file())) as f:
        m, t = f.metadata, f.types
        assert f.version == 3 and f.architecture == "llama" and f.alignment == 32
        assert m["a.u8"] == 200 and t["a.u8"].type == ValueType.UINT8
        assert m["a.i8"] == -5 and m["a.u16"] == 60000 and m["a.i16"] == -300
        assert m["a.u32"] == 4_000_000_000 and m["a.i32"] == -7 and m["a.f32"] == 0.5
        assert m["a.bool"] is True and m["a.u64"] == 1 << 60 and m["a.i64"] == -(1 << 40) and m["a.f64"] == 2.25
        assert m["a.strs"] == ["x", "é", ""] and t["a.strs"].sub.type == ValueType.STRING
        assert m["a.ints"].dtype == np.dtype("<i4") and m["a.ints"].tolist() == [1, -2, 3]
        assert [x.tolist() for x in m["a.nested"]] == [[1, 2], [3]]
        assert t["a.nested"].sub.type == ValueType.ARRAY and t["a.nested"].sub.sub.type == ValueType.UINT8
        assert list(f.tensors) == ["w", "v"]
        assert f.tensors["v"].shape == (2, 4) and f.tensors["v"].dtype == tg.GGMLType.F32
        np.testing.assert_array_equal(np.frombuffer(f.tensor_bytes("w"), np.float32), np.arange(8))
        np.testing.assert_array_equal(f.tensor_to_float("v"), (np.arange(8, dtype=np.float32) * 2).reshape(2, 4))
        assert f.n_params == 16
        with pytest.raises(TypeError):
            f.tensor_bytes("w")[0] = 1  # read-only


def test_version_2_is_read(tmp_path):
    data = gb.build([gb.kv("k", gb.U32, gb.u32(1))], version=2)
    with GGUFFile(write(tmp_path, data)) as f:
        assert f.version == 2 and f.metadata["k"] == 1


def expect_error(tmp_path, data: bytes, *fragments: str):
    p = write(tmp_path, data)
    with pytest.raises(GGUFError) as ei:
        GGUFFile(p)
    msg = str(ei.value)
    assert str(p) in msg, msg
    for frag in fragments:
        assert frag in msg, msg
    return msg


def test_bad_magic(tmp_path):
    expect_error(tmp_path, b"GGML" + b"\0" * 40, "not a GGUF file", "magic")


def test_too_short(tmp_path):
    expect_error(tmp_path, b"GGUF", "not a GGUF file")


def test_unknown_version(tmp_path):
    expect_error(tmp_path, gb.build([], version=4), "unsupported GGUF version 4")


def test_big_endian_file_gets_a_hint(tmp_path):
    data = bytearray(gb.build([]))
    data[4:8] = struct.pack(">I", 3)
    expect_error(tmp_path, bytes(data), "big-endian")


def test_absurd_counts(tmp_path):
    expect_error(tmp_path, gb.build([], n_kv=1 << 40), "absurd metadata count")
    expect_error(tmp_path, gb.build([], n_tensors=1 << 40), "absurd tensor count")


def test_truncated_everywhere(tmp_path):
    data = good_file()
    head_end = data.index(b"w\x01\x00\x00\x00") + 64  # well past the tensor infos
    for cut in list(range(8, 40)) + list(range(40, head_end, 7)):
        p = write(tmp_path, data[:cut], name=f"cut{cut}.gguf")
        with pytest.raises(GGUFError):
            GGUFFile(p)


def test_forged_string_length(tmp_path):
    data = gb.build([])[:24] + struct.pack("<Q", 1 << 60) + b"key"
    data = data[:16] + struct.pack("<Q", 1) + data[24:]  # one kv
    expect_error(tmp_path, data, "limit")


def test_forged_array_count(tmp_path):
    payload = struct.pack("<IQ", gb.U32, 1 << 61)
    expect_error(tmp_path, gb.build([gb.kv("k", gb.ARR, payload)]), "does not fit")
    payload = struct.pack("<IQ", gb.STR, 1 << 61)
    expect_error(tmp_path, gb.build([gb.kv("k", gb.ARR, payload)]), "does not fit")


def test_forged_string_in_array(tmp_path):
    payload = struct.pack("<IQ", gb.STR, 2) + gb.s("ok") + struct.pack("<Q", 1 << 50) + b"xx"
    expect_error(tmp_path, gb.build([gb.kv("k", gb.ARR, payload)]), "string 1 of 'k'")


def test_unknown_value_type(tmp_path):
    expect_error(tmp_path, gb.build([gb.kv("k", 99, b"")]), "unknown value type 99")
    expect_error(tmp_path, gb.build([gb.kv("k", gb.ARR, struct.pack("<IQ", 77, 0))]), "unknown array element type 77")


def test_duplicate_key(tmp_path):
    expect_error(tmp_path, gb.build([gb.kv("k", gb.U32, gb.u32(1)), gb.kv("k", gb.U32, gb.u32(2))]), "duplicate key")


def test_invalid_utf8(tmp_path):
    expect_error(tmp_path, gb.build([gb.kv("k", gb.STR, gb.s(b"\xff\xfe"))]), "not valid UTF-8")
    payload = gb.arr(gb.STR, [gb.s("a"), gb.s(b"\xc3")])
    expect_error(tmp_path, gb.build([gb.kv("k", gb.ARR, payload)]), "not valid UTF-8")


def test_bool_array_values(tmp_path):
    expect_error(tmp_path, gb.build([gb.kv("k", gb.ARR, gb.arr(gb.BOOL, [b"\x01", b"\x02"]))]), "bool array")


def test_nesting_depth(tmp_path):
    payload = gb.arr(gb.U8, [])
    for _ in range(12):
        payload = gb.arr(gb.ARR, [payload])
    expect_error(tmp_path, gb.build([gb.kv("k", gb.ARR, payload)]), "nested deeper")


def test_alignment_must_be_a_power_of_two(tmp_path):
    expect_error(tmp_path, gb.build([gb.kv("general.alignment", gb.U32, gb.u32(24))]), "power of two")
    expect_error(tmp_path, gb.build([gb.kv("general.alignment", gb.U64, struct.pack("<Q", 32))]), "uint32")


def test_custom_alignment_is_used(tmp_path):
    blob = np.ones(4, np.float32).tobytes()
    data = gb.build([gb.kv("general.alignment", gb.U32, gb.u32(64))], [("w", [4], 0, 64, blob)], alignment=64)
    with GGUFFile(write(tmp_path, data)) as f:
        assert f.alignment == 64 and f.data_offset % 64 == 0
        np.testing.assert_array_equal(np.frombuffer(f.tensor_bytes("w"), np.float32), 1)


def tensor_file(dims=(8,), tag=0, offset=0, nbytes=32, name="w", extra=()):
    return gb.build([], [(name, list(dims), tag, offset, b"\0" * nbytes), *extra])


def test_tensor_bad_dims(tmp_path):
    expect_error(tmp_path, tensor_file(dims=()), "0 dimensions")
    expect_error(tmp_path, tensor_file(dims=(1, 1, 1, 1, 8)), "5 dimensions")
    expect_error(tmp_path, tensor_file(dims=(8, 0)), "bad dimensions")
    expect_error(tmp_path, tensor_file(dims=(1 << 40, 1 << 40)), "bad dimensions")


def test_tensor_unknown_type(tmp_path):
    expect_error(tmp_path, tensor_file(tag=4), "unknown ggml type 4")
    expect_error(tmp_path, tensor_file(tag=1000), "unknown ggml type 1000")


def test_tensor_not_whole_blocks(tmp_path):
    expect_error(tmp_path, tensor_file(dims=(16,), tag=int(tg.GGMLType.Q8_0)), "block size 32")


def test_tensor_outside_file(tmp_path):
    data = tensor_file()
    expect_error(tmp_path, data[:-4], "lies outside the file")
    data = gb.build([], [("w", [8], 0, 1 << 40, b"")])
    expect_error(tmp_path, data, "lies outside the file")


def test_tensor_misaligned(tmp_path):
    expect_error(tmp_path, gb.build([], [("w", [2], 0, 8, b"\0" * 8)]), "not aligned")


def test_duplicate_and_overlapping_tensors(tmp_path):
    blob = b"\0" * 32
    expect_error(tmp_path, gb.build([], [("w", [8], 0, 0, blob), ("w", [8], 0, 32, blob)]), "duplicate tensor name")
    expect_error(tmp_path, gb.build([], [("a", [8], 0, 0, blob), ("b", [16], 0, 0, blob * 2)]), "overlap")


def test_tensor_name_too_long(tmp_path):
    expect_error(tmp_path, tensor_file(name="x" * 64), "longer than ggml's 63 bytes")


def test_missing_file_and_directory(tmp_path):
    with pytest.raises(GGUFError, match="no such file") as ei:
        GGUFFile(tmp_path / "nope.gguf")
    assert ei.value.hint
    with pytest.raises(GGUFError, match="is a directory"):
        GGUFFile(tmp_path)
