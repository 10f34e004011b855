"""quantize_model: metadata kept (file_type updated), tensors converted one at a
time, checked against toy_ggml's own quantize/dequantize and read back with
the independent ``gguf`` package."""

from __future__ import annotations

import gguf
import numpy as np
import pytest

import toy_ggml
from toy.gguf import GGUFFile, GGUFWriter
from toy.gguf.convert import (
    LLAMA_FTYPES,
    SUPPORTED_TARGETS,
    TARGET_FTYPE,
    ftype_label,
    parse_target,
    quantize_model,
    tensor_target,
)
from toy_ggml import GGMLType
from toy_testsupport import toy_test_models as mp


def _gguf_value(field):
    return field.contents()


def _same_metadata(src: GGUFFile, dst: GGUFFile, changed: dict) -> None:
    for key, value in src.metadata.items():
        assert key in dst.metadata, key
        assert dst.types[key] == src.types[key], key
        want = changed.get(key, value)
        got = dst.metadata[key]
        if isinstance(want, np.ndarray):
            np.testing.assert_array_equal(got, want)
        else:
            assert got == want, key


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return mp.write_tiny_model(tmp_path_factory.mktemp("src") / "tiny-f32.gguf", tied=False, qkv_bias=True)


@pytest.mark.parametrize("target", ["Q8_0", "Q4_1", "F16"])
def test_f32_model_converts_like_ggml_and_reads_back_with_gguf(tiny, tmp_path, target):
    dst = tmp_path / f"tiny-{target}.gguf"
    seen = []
    report = quantize_model(tiny, dst, target, progress=lambda i, n, name: seen.append((i, n, name)))
    t = GGMLType[target]
    with GGUFFile(tiny) as src, GGUFFile(dst) as out:
        assert [s[2] for s in seen] == list(src.tensors) and seen[-1][:2] == (len(src.tensors),) * 2
        assert report.n_tensors == len(src.tensors) and not report.fallbacks
        changed = {"general.file_type": TARGET_FTYPE[t]}
        _same_metadata(src, out, changed)
        extra = set(out.metadata) - set(src.metadata)
        assert extra == ({"general.quantization_version"} if target != "F16" else set())
        assert list(out.tensors) == list(src.tensors)

        ref_reader = gguf.GGUFReader(dst)
        assert int(ref_reader.fields["general.file_type"].contents()) == TARGET_FTYPE[t]
        assert ref_reader.fields["toy.test.f64"].contents() == 0.125
        assert ref_reader.fields["general.name"].contents() == "tiny-llama"
        ref_tensors = {rt.name: rt for rt in ref_reader.tensors}
        assert list(ref_tensors) == list(src.tensors)

        for name, info in src.tensors.items():
            x = src.tensor_to_float(name)
            o = out.tensors[name]
            rt = ref_tensors[name]
            assert o.shape == info.shape
            assert tuple(int(d) for d in reversed(rt.shape)) == info.shape  # gguf reports ggml order
            if len(info.shape) == 1:
                assert o.dtype == GGMLType.F32
                np.testing.assert_array_equal(out.tensor_to_float(name), x)
                continue
            assert o.dtype == t and rt.tensor_type == gguf.GGMLQuantizationType[target]
            ref_bytes = toy_ggml.quantize(x, int(t))
            assert bytes(out.tensor_bytes(name)) == ref_bytes.tobytes()
            ref = toy_ggml.dequantize(ref_bytes, int(t), info.shape)
            np.testing.assert_array_equal(out.tensor_to_float(name), ref)
            # the gguf package's own NumPy dequantizer agrees
            other = gguf.quants.dequantize(rt.data, rt.tensor_type).reshape(info.shape)
            np.testing.assert_allclose(other, ref, rtol=1e-6, atol=1e-7)


def test_fallbacks_follow_llama_cpp(tmp_path):
    rng = np.random.default_rng(1)
    src = mp.write_tiny_model(
        tmp_path / "src.gguf",
        extra_tensors={
            "odd.weight": rng.standard_normal((4, 48)).astype(np.float32),  # 48: no 32-block fits
            "wide.weight": rng.standard_normal((2, 256)).astype(np.float32),  # 256: a K-quant block
            "ids": np.arange(8, dtype=np.int32),
        },
    )
    r = quantize_model(src, tmp_path / "q8.gguf", "Q8_0")
    assert r.fallbacks == {"odd.weight": "F16"}
    r = quantize_model(src, tmp_path / "q4k.gguf", "q4_k_m")
    with GGUFFile(tmp_path / "q4k.gguf") as out:
        assert out.tensors["wide.weight"].dtype == GGMLType.Q4_K
        assert out.tensors["blk.0.attn_q.weight"].dtype == GGMLType.Q5_0  # rows of 64: Q4_K -> Q5_0
        assert out.tensors["odd.weight"].dtype == GGMLType.F16
        assert out.tensors["ids"].dtype == GGMLType.I32
        np.testing.assert_array_equal(np.frombuffer(out.tensor_bytes("ids"), np.int32), np.arange(8))
        assert out.metadata["general.file_type"] == 15
    assert r.fallbacks["blk.0.attn_q.weight"] == "Q5_0" and "wide.weight" not in r.fallbacks


def test_tensor_target_rules():
    Q8, F32, F16 = GGMLType.Q8_0, GGMLType.F32, GGMLType.F16
    assert tensor_target((576,), GGMLType.F32, Q8) == F32
    assert tensor_target((576,), GGMLType.F16, Q8) == F32  # 1-D becomes F32
    assert tensor_target((10, 576), GGMLType.Q4_1, Q8) == Q8
    assert tensor_target((10, 48), F32, Q8) == F16
    assert tensor_target((10, 48), GGMLType.Q4_1, F32) == F32  # F32/F16 targets take any row
    assert tensor_target((10, 576), F32, GGMLType.Q6_K) == Q8
    assert tensor_target((10, 576), F32, GGMLType.Q5_K) == GGMLType.Q5_1
    assert tensor_target((3, 4), GGMLType.I32, Q8) == GGMLType.I32


def test_quantized_source_widens_to_f32(tmp_path):
    q = tmp_path / "q41.gguf"
    quantize_model(mp.write_tiny_model(tmp_path / "src.gguf"), q, "Q4_1")
    out = tmp_path / "f32.gguf"
    quantize_model(q, out, "f32")
    with GGUFFile(q) as a, GGUFFile(out) as b:
        assert b.metadata["general.file_type"] == 0
        assert "general.quantization_version" in b.metadata  # kept from the source
        for name in a.tensors:
            assert b.tensors[name].dtype == GGMLType.F32
            np.testing.assert_array_equal(b.tensor_to_float(name), a.tensor_to_float(name))


def test_same_type_is_copied_byte_for_byte(tmp_path):
    q = tmp_path / "q8.gguf"
    quantize_model(mp.write_tiny_model(tmp_path / "src.gguf"), q, "Q8_0")
    again = tmp_path / "q8b.gguf"
    r = quantize_model(q, again, "Q8_0")
    assert r.converted == 0 and r.copied == r.n_tensors
    assert again.read_bytes() == q.read_bytes()


def test_alignment_and_file_type_added(tmp_path):
    g = GGUFWriter(tmp_path / "a.gguf", alignment=64)
    g.add("general.architecture", "llama")
    g.add_tensor("w.weight", np.ones((2, 32), np.float32))
    g.write()
    quantize_model(tmp_path / "a.gguf", tmp_path / "b.gguf", "Q8_0")
    with GGUFFile(tmp_path / "b.gguf") as b:
        assert b.alignment == 64
        assert b.metadata["general.file_type"] == 7 and b.metadata["general.quantization_version"] == 2


@pytest.mark.parametrize("bad", ["Q8_1", "nope", "I32", "IQ2_XXS", "", 99])
def test_bad_target_names_the_supported_types(tiny, tmp_path, bad):
    with pytest.raises(ValueError) as ei:
        quantize_model(tiny, tmp_path / "x.gguf", bad)
    assert "supported types: " + ", ".join(SUPPORTED_TARGETS) in str(ei.value)
    assert not (tmp_path / "x.gguf").exists()


def test_failure_leaves_nothing_behind(tmp_path):
    bad = np.ones((2, 32), np.float32)
    bad[1, 3] = np.nan
    src = mp.write_tiny_model(tmp_path / "src" / "nan.gguf", extra_tensors={"nan.weight": bad})
    out = tmp_path / "out"
    out.mkdir()
    with pytest.raises(ValueError, match="nan.weight"):
        quantize_model(src, out / "q.gguf", "Q8_0")
    assert list(out.iterdir()) == []  # no output, no spill file


def test_ftype_table_matches_llama_h():
    # values from enum llama_ftype, llama.cpp include/llama.h (llama-cpp-python 0.3.36)
    expect = {
        "ALL_F32": 0,
        "MOSTLY_F16": 1,
        "MOSTLY_Q4_0": 2,
        "MOSTLY_Q4_1": 3,
        "MOSTLY_Q8_0": 7,
        "MOSTLY_Q5_0": 8,
        "MOSTLY_Q5_1": 9,
        "MOSTLY_Q2_K": 10,
        "MOSTLY_Q3_K_M": 12,
        "MOSTLY_Q4_K_M": 15,
        "MOSTLY_Q5_K_M": 17,
        "MOSTLY_Q6_K": 18,
        "MOSTLY_IQ4_NL": 25,
        "MOSTLY_BF16": 32,
    }
    for name, v in expect.items():
        assert LLAMA_FTYPES[v] == name
    # the independent gguf package agrees on every value both know
    for member in gguf.LlamaFileType:
        if member.value in LLAMA_FTYPES and member.name != "GUESSED":
            assert LLAMA_FTYPES[member.value] == member.name, member
    assert ftype_label(3) == "Q4_1" and ftype_label(0) == "F32" and ftype_label(4) is None
    assert parse_target("q8_0") == GGMLType.Q8_0 and parse_target("Q5_K_M") == GGMLType.Q5_K


@pytest.mark.model
def test_real_model_q4_1_to_q8_0_keeps_keys_and_tensors(tmp_path, smollm2_path):
    src_path = smollm2_path
    dst = tmp_path / "smollm2.Q8_0.gguf"
    report = quantize_model(src_path, dst, "Q8_0")
    # the output read by the independent gguf package (a 6 s parse, so once),
    # compared with the source as toy reads it
    ref = gguf.GGUFReader(dst)
    skip = {"GGUF.version", "GGUF.tensor_count", "GGUF.kv_count"}
    with GGUFFile(src_path) as src:
        assert [k for k in ref.fields if k not in skip] == list(src.metadata)
        for key, value in src.metadata.items():
            field = ref.fields[key]
            assert int(field.types[0]) == int(src.types[key].type), key
            got = field.contents()
            if key == "general.file_type":
                assert got == 7
            elif isinstance(value, np.ndarray):
                np.testing.assert_array_equal(np.asarray(got), value)
            else:
                assert got == value, key
        assert [t.name for t in ref.tensors] == list(src.tensors)
        for rt in ref.tensors:
            info = src.tensors[rt.name]
            assert tuple(int(d) for d in reversed(rt.shape)) == info.shape
            if len(info.shape) == 1:
                assert rt.tensor_type == gguf.GGMLQuantizationType.F32
            else:
                assert rt.tensor_type == gguf.GGMLQuantizationType.Q8_0
        # token_embd was Q8_0 already: copied byte for byte
        by_name = {rt.name: rt for rt in ref.tensors}
        assert bytes(by_name["token_embd.weight"].data) == bytes(src.tensor_bytes("token_embd.weight"))
        assert report.copied == 62 and report.converted == 210 and not report.fallbacks
        name = "blk.0.ffn_down.weight"
        x = src.tensor_to_float(name)
        want = toy_ggml.dequantize(toy_ggml.quantize(x, int(GGMLType.Q8_0)), int(GGMLType.Q8_0), x.shape)
        got = gguf.quants.dequantize(by_name[name].data, by_name[name].tensor_type).reshape(x.shape)
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)
