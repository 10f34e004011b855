"""GGUF -> Hugging Face export (``toy.convert.hf_export``, ``toy export hf``).

References, all independent of the exporter: transformers' forward pass on
the exported folder (logits within 1e-4 of toy's on the same F32 weights),
``AutoTokenizer`` on the exported tokenizer (the same ids as toy's
tokenizer), and llama.cpp's own ``convert_hf_to_gguf.py`` run on the
exported folder (the same tensor bytes as the GGUF file exported: for
llama this re-applies the Q/K permutation the export undid; for gpt2 the
Conv1D transposes).
"""

from __future__ import annotations

import dataclasses
import json
import re

import numpy as np
import pytest

from toy.convert.hf_export import HFExportError, export_hf
from toy.gguf import GGUFFile
from toy.gguf.convert import quantize_model
from toy.tokenizer import Tokenizer
from toy_testsupport import gemma_ref, gpt2_ref, moe_ref, tiny_archs
from toy_testsupport.cli_helpers import assert_clean_error, run
from toy_testsupport.reference.full import FullModel

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

ATOL = 1e-4  # F32 logits, toy vs transformers
TEXTS = ["Hello world", "The quick brown fox, 42 times!", "  spaces and\nnew lines\t", "<|im_start|>user"]
IDS = [1, 5, 9, 20, 33, 7, 2, 40, 11, 3]


def _hf_logits(folder, ids) -> np.ndarray:
    # eager attention: transformers' default SDPA path drops Gemma 2's attention soft-cap
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager")
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].numpy()


def _toy_logits(rt, path, ids, gelu_exact: bool) -> np.ndarray:
    fm = FullModel.load(path, rt, kv_type=None)
    if gelu_exact:  # transformers' tanh GELU is the formula; toy's default reads ggml's f16 table
        fm.cfg = dataclasses.replace(fm.cfg, gelu="exact")
    try:
        return fm.logits(ids)
    finally:
        fm.close()


def _same_tensor_bytes(a_path, b_path) -> None:
    with GGUFFile(a_path) as a, GGUFFile(b_path) as b:
        assert set(a.tensors) == set(b.tensors)
        for name, t in a.tensors.items():
            assert (t.shape, t.dtype) == (b.tensors[name].shape, b.tensors[name].dtype), name
            assert bytes(a.tensor_bytes(name)) == bytes(b.tensor_bytes(name)), name


@pytest.mark.parametrize("name", tiny_archs.NAMES)
def test_tiny_model_loads_in_transformers_with_toys_logits(rt, tmp_path, name):
    src = tiny_archs.write(tmp_path / f"{name}.gguf", name, seed=3)
    report = export_hf(src, tmp_path / "hf")
    cfg = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert cfg["architectures"] == [report.hf_class] and report.dequantized == []
    ref = _hf_logits(tmp_path / "hf", IDS)
    got = _toy_logits(rt, src, IDS, gelu_exact=name in ("gpt2", "gemma2", "gemma3"))
    assert got.shape == ref.shape
    assert np.abs(got - ref).max() <= ATOL, np.abs(got - ref).max()
    # the tokenizer: AutoTokenizer from the folder encodes as toy does
    hf_tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    with GGUFFile(src) as gf:
        tok = Tokenizer.from_gguf(gf.metadata)
    for text in TEXTS:
        assert hf_tok(text)["input_ids"] == tok.encode(text), text


def test_sharded_export_loads_like_a_single_file(tmp_path):
    src = tiny_archs.write(tmp_path / "llama.gguf", "llama", seed=1)
    export_hf(src, tmp_path / "one")
    report = export_hf(src, tmp_path / "many", shard_bytes=20_000)
    shards = sorted(p.name for p in (tmp_path / "many").glob("model-*.safetensors"))
    assert len(shards) > 2 and not (tmp_path / "many" / "model.safetensors").exists()
    index = json.loads((tmp_path / "many" / "model.safetensors.index.json").read_text())
    assert sorted(set(index["weight_map"].values())) == shards
    assert index["metadata"]["total_size"] == report.n_bytes
    from safetensors.numpy import load_file

    one = load_file(tmp_path / "one" / "model.safetensors")
    many = {k: v for s in shards for k, v in load_file(tmp_path / "many" / s).items()}
    assert one.keys() == many.keys() == index["weight_map"].keys()
    for k in one:
        assert np.array_equal(one[k], many[k]), k
    assert np.array_equal(_hf_logits(tmp_path / "many", IDS), _hf_logits(tmp_path / "one", IDS))


@pytest.mark.parametrize("dtype", ["f16", "bf16"])
def test_f16_and_bf16_tensors_keep_their_type_and_bytes(tmp_path, dtype):
    from safetensors import safe_open

    src = tiny_archs.write(tmp_path / "qwen2.gguf", "qwen2")  # qwen2: no tensor is transformed
    half = tmp_path / f"{dtype}.gguf"
    quantize_model(src, half, dtype)
    report = export_hf(half, tmp_path / "hf")
    assert report.dequantized == []
    want = {"f16": torch.float16, "bf16": torch.bfloat16}[dtype]
    seen = set()
    with GGUFFile(half) as gf, safe_open(tmp_path / "hf" / "model.safetensors", "pt") as st:
        for hf_name in st.keys():
            gg = _qwen2_gguf_name(hf_name)
            t, info = st.get_tensor(hf_name), gf.tensors[gg]
            assert t.dtype == (want if info.dtype.name == dtype.upper() else torch.float32), hf_name
            raw = t.view(torch.int16) if t.dtype != torch.float32 else t
            assert raw.numpy().tobytes() == bytes(gf.tensor_bytes(gg)), hf_name
            seen.add(gg)
        assert seen == set(gf.tensors)


# Hugging Face's qwen2 names -> llama.cpp's (written out here, independently of the exporter's table)
_QWEN2_TOP = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight"}
_QWEN2_LAYER = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    **{f"self_attn.{x}_proj.{k}": f"attn_{x}.{k}" for x in "qkv" for k in ("weight", "bias")},
    "self_attn.o_proj.weight": "attn_output.weight",
    **{f"mlp.{x}_proj.weight": f"ffn_{x}.weight" for x in ("gate", "up", "down")},
}


def _qwen2_gguf_name(hf_name: str) -> str:
    if hf_name in _QWEN2_TOP:
        return _QWEN2_TOP[hf_name]
    m = re.fullmatch(r"model\.layers\.(\d+)\.(.+)", hf_name)
    assert m is not None and m.group(2) in _QWEN2_LAYER, hf_name
    return f"blk.{m.group(1)}.{_QWEN2_LAYER[m.group(2)]}"


@pytest.mark.parametrize("outtype", ["f32", "f16"])
def test_gpt2_round_trip_through_llamacpps_converter_gives_the_same_bytes(tmp_path, outtype):
    src = gpt2_ref.gguf_path("tiny", 0, outtype)  # llama.cpp's converter output for a transformers GPT-2
    export_hf(src, tmp_path / "hf")
    back = gpt2_ref.convert_to_gguf(tmp_path / "hf", tmp_path / "back.gguf", outtype)
    _same_tensor_bytes(src, back)


@pytest.mark.parametrize("shape", ["gemma2-tiny", "gemma3-tiny", "olmoe-tiny", "qwen2moe-tiny", "qwen3moe-tiny"])
def test_gemma_and_moe_round_trip_through_llamacpps_converter_gives_the_same_bytes(tmp_path, shape):
    """Gemma's norm gains (stored by llama.cpp as 1 + w) come back exactly; the experts, split into
    Hugging Face's per-expert matrices, are stacked again. The exported tokenizer files alone give the
    converter the original vocabulary: Gemma's through the tokenizer.model the export writes
    (test_convert_hf_spm_export.py checks every tokenizer key), the MoE models' BPE through
    tokenizer.json, whose probe-text tokenization the converter recognises as GPT-2's pre-tokenizer
    (it did not while the export named the file's padding token, an ordinary ``"``, as special)."""
    ref = gemma_ref if shape.startswith("gemma") else moe_ref
    src = ref.gguf_path(shape, 0, "f32")
    export_hf(src, tmp_path / "hf")
    back = gpt2_ref.convert_to_gguf(tmp_path / "hf", tmp_path / "back.gguf", "f32")
    _same_tensor_bytes(src, back)
    with GGUFFile(src) as a, GGUFFile(back) as b:
        for k in ("tokenizer.ggml.model", "tokenizer.ggml.pre", "tokenizer.ggml.tokens", "tokenizer.ggml.merges"):
            assert (k in a.metadata) == (k in b.metadata), k
            if k in a.metadata:
                want, got = a.metadata[k], b.metadata[k]
                assert (list(want) == list(got)) if isinstance(want, list) else want == got, k


@pytest.mark.parametrize(
    ("shape", "outtype"),
    [
        ("tiny", "f16"),
        ("gemma2-tiny", "f32"),
        ("gemma3-tiny", "f32"),
        ("olmoe-tiny", "f32"),
        ("qwen2moe-tiny", "f16"),
        ("qwen3moe-tiny", "f32"),
    ],
)
def test_round_trip_through_toys_own_import_gives_the_same_bytes(tmp_path, shape, outtype):
    """GGUF -> Hugging Face -> GGUF with toy both ways (the same tables read in both directions): every
    tensor comes back with its type and bytes (toy's import, like the converter, reads Gemma's
    vocabulary from the exported tokenizer.model)."""
    from toy.convert import import_hf

    ref = gpt2_ref if shape == "tiny" else gemma_ref if shape.startswith("gemma") else moe_ref
    src = ref.gguf_path(shape, 0, outtype)
    export_hf(src, tmp_path / "hf")
    import_hf(tmp_path / "hf", tmp_path / "back.gguf", outtype)
    _same_tensor_bytes(src, tmp_path / "back.gguf")


@pytest.mark.parametrize("name", tiny_archs.NAMES)
def test_tiny_model_round_trips_through_toys_own_import(tmp_path, name):
    """Every registered architecture's tiny model, exported and imported back by toy: the same tensors
    (llama's Q/K rows interleaved back, GPT-2's matrices transposed back, Gemma's norms plus one)."""
    from toy.convert import HFImportError, import_hf

    src = tiny_archs.write(tmp_path / f"{name}.gguf", name, seed=3)
    export_hf(src, tmp_path / "hf")
    if name == "gpt2":  # tiny_archs' GPT-2 has n_inner = 2 * n_embd, which llama.cpp's converter writes as 4 * n_embd
        with pytest.raises(HFImportError) as ei:
            import_hf(tmp_path / "hf", tmp_path / "back.gguf", "f32")
        assert ei.value.field == "n_inner" and not (tmp_path / "back.gguf").exists()
        return
    import_hf(tmp_path / "hf", tmp_path / "back.gguf", "f32")
    _same_tensor_bytes(src, tmp_path / "back.gguf")


def test_smollm2_exports_dequantized_and_round_trips(rt, tmp_path, smollm2_path):
    """The bundled SmolLM2 (Q4_1, llama): exported dequantized; transformers' logits equal toy's on the
    F32 dequantization of the same file; llama.cpp's converter gives that F32 file's bytes back (the
    Q/K permutation undone and redone); AutoTokenizer encodes as toy does."""
    f32 = tmp_path / "f32.gguf"
    quantize_model(smollm2_path, f32, "f32")
    report = export_hf(smollm2_path, tmp_path / "hf")
    with GGUFFile(smollm2_path) as gf:
        quantized = sorted(n for n, t in gf.tensors.items() if t.dtype.name not in ("F32", "F16", "BF16"))
        tok = Tokenizer.from_gguf(gf.metadata)
    assert sorted(report.dequantized) == quantized and quantized
    back = gpt2_ref.convert_to_gguf(tmp_path / "hf", tmp_path / "back.gguf", "f32", model_name="SmolLM2")
    _same_tensor_bytes(f32, back)
    hf_tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    for text in TEXTS:
        assert hf_tok(text)["input_ids"] == tok.encode(text), text
    ids = tok.encode("The capital of France is")
    ref = _hf_logits(tmp_path / "hf", ids)
    got = _toy_logits(rt, f32, ids, gelu_exact=False)
    assert np.abs(got - ref).max() <= ATOL, np.abs(got - ref).max()


# ------------------------------------------------------------ refusals, atomic writes, the CLI


def test_an_architecture_outside_the_registry_is_refused_and_nothing_is_written(tmp_path):
    from toy.gguf import GGUFWriter

    w = GGUFWriter(tmp_path / "mamba.gguf")
    w.add("general.architecture", "mamba")
    w.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
    w.write()
    with pytest.raises(HFExportError, match="general.architecture = 'mamba'") as e:
        export_hf(tmp_path / "mamba.gguf", tmp_path / "hf")
    assert e.value.field == "general.architecture" and e.value.hint
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mamba.gguf"]


def test_a_non_empty_folder_is_refused(tmp_path):
    src = tiny_archs.write(tmp_path / "llama.gguf", "llama")
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "keep.txt").write_text("mine")
    with pytest.raises(HFExportError, match="not empty"):
        export_hf(src, tmp_path / "hf")
    assert [p.name for p in (tmp_path / "hf").iterdir()] == ["keep.txt"]


def test_a_failure_midway_leaves_nothing(tmp_path, monkeypatch):
    import toy.tokenizer.export

    src = tiny_archs.write(tmp_path / "llama.gguf", "llama")

    def broken(*a, **k):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(toy.tokenizer.export, "export_hf", broken)
    with pytest.raises(OSError):
        export_hf(src, tmp_path / "hf")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["llama.gguf"]


def test_partial_rotary_dimensions_are_refused_naming_the_key(tmp_path):
    from toy.gguf import GGUFWriter

    src = tiny_archs.write(tmp_path / "llama.gguf", "llama")
    edited = tmp_path / "partial.gguf"
    with GGUFFile(src) as gf:
        w = GGUFWriter(edited)
        for k, v in gf.metadata.items():
            w.add(k, tiny_archs.HEAD_DIM // 2 if k == "llama.rope.dimension_count" else v, gf.types[k])
        for n in gf.tensors:
            w.add_tensor(n, gf.tensor_to_float(n))
        w.write()
    with pytest.raises(HFExportError, match="llama.rope.dimension_count") as e:
        export_hf(edited, tmp_path / "hf")
    assert e.value.field == "llama.rope.dimension_count"
    assert not (tmp_path / "hf").exists()


def test_cli_exports_and_says_it_dequantized(capsys, tmp_path):
    src = tiny_archs.write(tmp_path / "qwen2.gguf", "qwen2")
    q8 = tmp_path / "q8.gguf"
    quantize_model(src, q8, "q8_0")
    code, out, err = run(capsys, "export", "hf", q8, "-o", tmp_path / "hf", "--shard-size", "30KB", "--json")
    assert code == 0, err
    report = json.loads(out)
    assert report["dequantized"] and "dequantized to F32" in err
    assert (tmp_path / "hf" / "model.safetensors.index.json").exists()
    code, out, err = run(capsys, "export", "hf", q8, "-o", tmp_path / "hf")
    assert_clean_error(code, err, 2, "not empty", hint=True)
    code, out, err = run(capsys, "export", "hf", q8, "-o", tmp_path / "x", "--shard-size", "lots")
    assert_clean_error(code, err, 2, "--shard-size", hint=True)
    assert not (tmp_path / "x").exists()
