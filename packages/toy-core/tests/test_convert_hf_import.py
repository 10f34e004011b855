"""Hugging Face folder -> GGUF import (``toy.convert.import_hf``, ``toy convert``).

References, independent of the importer: llama.cpp's own
``convert_hf_to_gguf.py`` (the pinned llama-cpp-python sdist, run in a
subprocess) on the same seeded random transformers folder
(``toy_testsupport.hf_llama_ref``): every metadata key (value and type) and
every tensor (name, shape, type, bytes) must be equal, and in fact the whole
file is; transformers' forward on the folder gives the greedy tokens and
logits toy gives on the imported file.

Bad input (missing shard, truncated file, a header that lies about offsets,
config fields of the wrong type, an unknown architecture or rope scaling, no
tokenizer) must raise a ``BadInputError`` naming the field and leave nothing
at OUT.
"""

from __future__ import annotations

import json
import shutil
import struct
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from toy.convert import HFImportError, SafetensorsError, import_hf
from toy.errors import BadInputError
from toy.gguf import GGUFFile
from toy_testsupport import gpt2_ref, hf_llama_ref
from toy_testsupport.cli_helpers import assert_clean_error, run
from toy_testsupport.hf_checks import assert_nothing_written, assert_same_gguf, edit_config

pytest.importorskip("transformers")

ARCHS = ("llama", "qwen2", "qwen3")
TYPES = ("f32", "f16", "bf16", "q8_0")
FIELDS = {"llama": {}, "qwen2": {}, "qwen3": {"head_dim": 8}}
IDS = [464, 2068, 7586, 21831, 18045, 625, 262, 16931, 3290, 13]


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    """``made(tag, **kw)``: a seeded HF folder (built once per tag)."""
    root = tmp_path_factory.mktemp("hf")
    cache: dict[str, object] = {}

    def get(tag: str, **kw):
        if tag not in cache:
            cache[tag] = hf_llama_ref.make_hf_llama(root / tag, **kw)
        return cache[tag]

    return get


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """``converted(folder, outtype)``: llama.cpp's converter output (once each)."""
    root = tmp_path_factory.mktemp("ref")
    cache: dict[tuple[str, str], object] = {}

    def get(folder, outtype: str):
        key = (str(folder), outtype)
        if key not in cache:
            cache[key] = hf_llama_ref.convert(folder, root / f"{len(cache)}-{outtype}.gguf", outtype)
        return cache[key]

    return get


def _folder(made, arch: str):
    return made(arch, arch=arch, **FIELDS[arch])


@pytest.mark.slow
@pytest.mark.parametrize("outtype", TYPES)
@pytest.mark.parametrize("arch", ARCHS)
def test_matches_llamacpp_converter(made, converted, tmp_path, arch, outtype):
    folder = _folder(made, arch)
    out = tmp_path / "toy.gguf"
    report = import_hf(folder, out, outtype, name=hf_llama_ref.MODEL_NAME)
    assert report.arch == arch and report.pre == "gpt-2" and not report.tied
    assert_same_gguf(converted(folder, outtype), out)


@pytest.mark.parametrize("outtype", ["f32", "q8_0"])
@pytest.mark.parametrize("block_bytes", [1, 700])
def test_tensors_converted_in_row_blocks_match_the_converter(
    made, converted, tmp_path, monkeypatch, outtype, block_bytes
):
    """Tensors go in blocks of rows (``BLOCK_BYTES``; a 0.5B model's embedding
    is 200 MB): with blocks of one row, or of one head for the permuted Q/K
    rows, and with blocks of a few rows, the file is still the converter's."""
    import toy.convert.hf_import as hi

    monkeypatch.setattr(hi, "BLOCK_BYTES", block_bytes)
    folder = _folder(made, "llama")
    q = hi._row_blocks((64, 32), "rope_pairs", 4)  # 4 heads of 16 rows, permuted
    assert q == [(0, 16, 1), (16, 32, 1), (32, 48, 1), (48, 64, 1)]  # one head per block
    plain = hi._row_blocks((64, 32), "", 0)
    assert plain[0] == ((0, 1, 0) if block_bytes == 1 else (0, 5, 0)) and plain[-1][1] == 64
    out = tmp_path / "toy.gguf"
    import_hf(folder, out, outtype, name=hf_llama_ref.MODEL_NAME)
    assert_same_gguf(converted(folder, outtype), out)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("tag", "kw", "outtype"),
    [
        ("tied", dict(arch="llama", tie=True), "f32"),
        ("sharded", dict(arch="llama", shards="1MB"), "q8_0"),
        ("bf16src", dict(arch="qwen2", dtype="bfloat16"), "f32"),
        ("bf16src", dict(arch="qwen2", dtype="bfloat16"), "f16"),
        ("f16src", dict(arch="llama", dtype="float16"), "f32"),
        ("f16src", dict(arch="llama", dtype="float16"), "bf16"),
        ("f16src", dict(arch="llama", dtype="float16"), "q8_0"),
        ("qwen3tied", dict(arch="qwen3", tie=True, head_dim=16), "f16"),
    ],
)
def test_variants_match_converter(made, converted, tmp_path, tag, kw, outtype):
    folder = made(tag, **kw)
    if tag == "sharded":
        assert (folder / "model.safetensors.index.json").is_file()
        assert len(list(folder.glob("model-*.safetensors"))) > 1
    out = tmp_path / "toy.gguf"
    report = import_hf(folder, out, outtype, name=hf_llama_ref.MODEL_NAME)
    assert report.tied == kw.get("tie", False)
    assert_same_gguf(converted(folder, outtype), out)


@pytest.mark.slow
@pytest.mark.parametrize("arch", ARCHS)
def test_toy_runs_the_import_like_transformers(made, tmp_path, arch):
    """toy on the imported F32 file: transformers' greedy tokens and logits."""
    import toy

    folder = _folder(made, arch)
    out = tmp_path / "toy.gguf"
    import_hf(folder, out, "f32")
    hf = gpt2_ref.load_causal_lm(folder)
    want_logits = gpt2_ref.model_logits(hf, IDS, threads=2)
    want_greedy = gpt2_ref.model_greedy(hf, IDS, 8, threads=2)
    with toy.load(out, threads=2, n_ctx=64, kv_type="f32") as m:
        got_logits = np.asarray(m.logits(IDS), np.float32)
        got_greedy = list(m.generate(IDS, max_tokens=8, temperature=0, ignore_eos=True).tokens)
        assert m.tokenize("Hello world") == gpt2_ref.tokenize(folder, "Hello world")
    assert got_greedy == want_greedy
    np.testing.assert_allclose(got_logits, want_logits, atol=2e-4, rtol=0)


# ------------------------------------------------------------------ bad input


def _copy(src, dst):
    shutil.copytree(src, dst)
    return dst


def _header(path) -> tuple[int, dict]:
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return n, json.loads(raw[8 : 8 + n])


def _write_header(path, header: dict) -> None:
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    new = json.dumps(header, separators=(",", ":")).encode()
    new += b" " * (n - len(new))
    assert len(new) == n
    path.write_bytes(raw[:8] + new + raw[8 + n :])


@pytest.fixture
def small(made, tmp_path):
    """A fresh copy of the tiny llama folder, and an OUT path inside tmp_path."""
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    return _copy(_folder(made, "llama"), tmp_path / "hf"), out_dir / "m.gguf"


def _refused(folder, out, exc=BadInputError, *fragments, field=None):
    with pytest.raises(exc) as ei:
        import_hf(folder, out, "f32")
    msg = str(ei.value)
    for f in fragments:
        assert f in msg, msg
    assert ei.value.hint
    if field is not None:
        assert ei.value.field == field
    assert_nothing_written(out)
    return ei.value


@pytest.mark.slow
def test_missing_shard(made, tmp_path):
    folder = _copy(made("sharded", arch="llama", shards="1MB"), tmp_path / "hf")
    shard = sorted(folder.glob("model-*.safetensors"))[-1]
    shard.unlink()
    _refused(folder, tmp_path / "m.gguf", SafetensorsError, shard.name, "missing", field=shard.name)


def test_truncated_safetensors(small):
    folder, out = small
    st = folder / "model.safetensors"
    st.write_bytes(st.read_bytes()[:-1000])
    _refused(folder, out, SafetensorsError, "model.safetensors", "truncated")


def test_truncated_header(small):
    folder, out = small
    st = folder / "model.safetensors"
    st.write_bytes(st.read_bytes()[:100])
    _refused(folder, out, SafetensorsError, "header length")


def test_header_lies_about_offsets(small):
    folder, out = small
    st = folder / "model.safetensors"
    _, h = _header(st)
    name = "model.layers.0.mlp.up_proj.weight"
    b, e = h[name]["data_offsets"]
    h[name]["data_offsets"] = [b + 4, e]  # four bytes short of the shape
    _write_header(st, h)
    _refused(folder, out, SafetensorsError, name, "data_offsets")


def test_header_overlapping_tensors(small):
    folder, out = small
    st = folder / "model.safetensors"
    _, h = _header(st)
    a, b = "model.layers.0.mlp.up_proj.weight", "model.layers.0.mlp.gate_proj.weight"
    h[a]["data_offsets"] = list(h[b]["data_offsets"])  # same shape: points at b's bytes
    _write_header(st, h)
    _refused(folder, out, SafetensorsError, "overlap")


def test_header_with_a_gap_or_trailing_bytes(small):
    """The tensors must tile the data section exactly, as the safetensors
    library requires (it refuses a gap: MetadataIncompleteBuffer)."""
    folder, out = small
    st = folder / "model.safetensors"
    st.write_bytes(st.read_bytes() + b"\0" * 8)
    _refused(folder, out, SafetensorsError, "after the last tensor")
    st.write_bytes(st.read_bytes()[:-8])
    n, h = _header(st)
    # 8 zero bytes before the last tensor's data, its offsets moved past them
    last = max((k for k in h if k != "__metadata__"), key=lambda k: h[k]["data_offsets"][1])
    b, e = h[last]["data_offsets"]
    h[last]["data_offsets"] = [b + 8, e + 8]
    _write_header(st, h)
    raw = st.read_bytes()
    st.write_bytes(raw[: 8 + n + b] + b"\0" * 8 + raw[8 + n + b :])
    _refused(folder, out, SafetensorsError, "gap")


def test_read_metadata_and_read_ref(small):
    from safetensors.numpy import load_file

    from toy.convert.safetensors_io import read_header, read_metadata, read_ref

    folder, _ = small
    st = folder / "model.safetensors"
    assert read_metadata(st) == {"format": "pt"}
    want = load_file(st)
    for ref in read_header(st):
        np.testing.assert_array_equal(read_ref(ref), want[ref.name])
        if ref.shape and ref.shape[0] > 2:
            np.testing.assert_array_equal(read_ref(ref, 1, 3), want[ref.name][1:3])


@pytest.mark.parametrize(
    ("changes", "field", "fragment"),
    [
        ({"num_hidden_layers": "2"}, "num_hidden_layers", "'2'"),
        ({"hidden_size": 32.0}, "hidden_size", "32.0"),
        ({"rms_norm_eps": "1e-5"}, "rms_norm_eps", "1e-5"),
        ({"num_attention_heads": ...}, "num_attention_heads", "missing"),
        ({"num_key_value_heads": 3}, "num_key_value_heads", "multiple"),
        ({"architectures": ["MistralForCausalLM"]}, "architectures", "MistralForCausalLM"),
        ({"architectures": "LlamaForCausalLM"}, "architectures", "architectures"),
        ({"rope_scaling": {"rope_type": "dynamic", "factor": 4.0}}, "rope_scaling.rope_type", "dynamic"),
        ({"hidden_act": "gelu"}, "hidden_act", "gelu"),
        ({"num_hidden_layers": 1}, "model.layers.1.input_layernorm.weight", "model.layers.1"),
        ({"num_hidden_layers": 3}, "model.layers.2.input_layernorm.weight", "blk.2.attn_norm.weight"),
        ({"vocab_size": 50000}, "lm_head.weight", "50000"),  # the first tensor in the checkpoint
    ],
)
def test_bad_config(small, changes, field, fragment):
    folder, out = small
    edit_config(folder, **changes)
    _refused(folder, out, HFImportError, fragment, field=field)


def test_a_parameter_toy_has_no_place_for_must_be_neutral(made, converted, tmp_path):
    """llama with ``attention_bias``: Hugging Face has Q/K/V and ``o_proj`` biases, toy (and its GGUF
    tables) Q/K/V only. A non-zero ``o_proj`` bias is refused naming it; a zero one is dropped, and every
    tensor written equals the converter's (which also writes the zero ``attn_output.bias``)."""
    from safetensors.numpy import load_file, save_file

    folder = _copy(made("obias", arch="llama", attention_bias=True), tmp_path / "hf")
    out = tmp_path / "out" / "m.gguf"
    out.parent.mkdir()
    _refused(
        folder, out, HFImportError, "model.layers.0.self_attn.o_proj.bias", field="model.layers.0.self_attn.o_proj.bias"
    )
    st = folder / "model.safetensors"
    tensors = load_file(st)
    for k in tensors:
        if k.endswith("o_proj.bias"):
            tensors[k] = np.zeros_like(tensors[k])
    save_file(tensors, st, metadata={"format": "pt"})
    import_hf(folder, out, "f32", name=hf_llama_ref.MODEL_NAME)
    ref = converted(folder, "f32")
    with GGUFFile(ref) as a, GGUFFile(out) as b:
        assert sorted(set(a.tensors) - set(b.tensors)) == [f"blk.{i}.attn_output.bias" for i in range(2)]
        for n in b.tensors:
            assert bytes(a.tensor_bytes(n)) == bytes(b.tensor_bytes(n)), n
            if n.endswith("attn_q.bias"):
                assert np.any(np.asarray(b.tensor_to_float(n)) != 0)


def test_missing_tokenizer(small):
    folder, out = small
    (folder / "tokenizer.json").unlink()
    _refused(folder, out, HFImportError, "tokenizer.json", field="tokenizer.json")


def test_unknown_pre_tokenizer(small):
    folder, out = small
    tj = json.loads((folder / "tokenizer.json").read_text())
    tj["pre_tokenizer"] = {"type": "Whitespace"}
    (folder / "tokenizer.json").write_text(json.dumps(tj))
    _refused(folder, out, HFImportError, "Whitespace", field="pre_tokenizer")


def test_bad_type_and_existing_out_untouched(small):
    folder, out = small
    out.write_bytes(b"old")
    with pytest.raises(HFImportError, match="q4_k"):
        import_hf(folder, out, "q4_k")
    (folder / "config.json").write_text("{not json")
    with pytest.raises(HFImportError, match="config.json"):
        import_hf(folder, out, "f32")
    assert out.read_bytes() == b"old"
    assert sorted(p.name for p in out.parent.iterdir()) == ["m.gguf"]


def test_pre_tokenizer_names():
    """The names toy gives tokenizer.json pre-tokenizer definitions (the
    regexes are the ones HF's Llama 3 and Qwen2 tokenizer.json files carry)."""
    from toy.convert.hf_tokenizer import pre_tokenizer_name

    tail = r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
    llama3 = "(?i:'s|'t|'re|'ve|'m|'ll|'d)" + tail
    qwen2 = llama3.replace(r"\p{N}{1,3}", r"\p{N}")

    def seq(regex):
        return {
            "type": "Sequence",
            "pretokenizers": [
                {"type": "Split", "pattern": {"Regex": regex}, "behavior": "Isolated", "invert": False},
                {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False},
            ],
        }

    assert pre_tokenizer_name(seq(llama3)) == "llama-bpe"
    assert pre_tokenizer_name(seq(qwen2)) == "qwen2"
    assert pre_tokenizer_name({"type": "ByteLevel", "add_prefix_space": False, "use_regex": True}) == "gpt-2"
    smol = {
        "type": "Sequence",
        "pretokenizers": [
            {"type": "Digits", "individual_digits": True},
            {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True},
        ],
    }
    assert pre_tokenizer_name(smol) == "smollm"
    with pytest.raises(HFImportError, match="pre_tokenizer"):
        pre_tokenizer_name(seq(llama3.replace(r"\p{N}{1,3}", r"\p{N}{1,2}")))


@pytest.mark.parametrize("name", ["gpt-2", "llama-bpe", "qwen2", "smollm", "default"])
def test_pre_tokenizer_of_toys_own_export(name):
    """The pre-tokenizer toy's tokenizer export writes for a name (the
    ``tokenizers`` library's own JSON of it) is named back the same."""
    from tokenizers import Tokenizer, models

    from toy.convert.hf_tokenizer import pre_tokenizer_name
    from toy.tokenizer.pretok import PRE_TOKENIZERS

    tok = Tokenizer(models.BPE(vocab={"a": 0}, merges=[]))
    tok.pre_tokenizer = PRE_TOKENIZERS[name].build()
    assert pre_tokenizer_name(json.loads(tok.to_str())["pre_tokenizer"]) == name


def test_bf16_rounding_matches_torch():
    """toy's float32 -> bfloat16 rounding against torch's (nearest even, NaN quiet)."""
    torch = pytest.importorskip("torch")
    from toy.convert.hf_import import to_bf16

    rng = np.random.default_rng(0)
    x = np.concatenate(
        [
            rng.standard_normal(4096).astype(np.float32) * 10,
            np.array([0.0, -0.0, np.inf, -np.inf, 1e-40, 3.3895314e38, 1.00390625, 1.01171875], np.float32),
        ]
    )
    want = torch.from_numpy(x).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    np.testing.assert_array_equal(to_bf16(x), want)
    nan = to_bf16(np.array([np.nan], np.float32))
    assert (nan[0] & 0x7F80) == 0x7F80 and (nan[0] & 0x7F) != 0


# ------------------------------------------------------------------ CLI


@pytest.mark.slow
def test_cli_convert(made, converted, tmp_path, capsys):
    folder = _folder(made, "qwen2")
    out = tmp_path / "cli.gguf"
    code, stdout, err = run(capsys, "convert", folder, "-o", out, "--type", "q8_0", "--name", hf_llama_ref.MODEL_NAME)
    assert code == 0, err
    assert stdout.splitlines()[0] == str(out)
    assert "qwen2:" in stdout and "Q8_0" in stdout
    assert_same_gguf(converted(folder, "q8_0"), out)
    code, stdout, err = run(capsys, "convert", folder, "-o", tmp_path / "j.gguf", "--json")
    assert code == 0 and json.loads(stdout)["arch"] == "qwen2"


def test_cli_errors(small, capsys, tmp_path):
    folder, out = small
    edit_config(folder, architectures=["GPTJForCausalLM"])
    code, _, err = run(capsys, "convert", folder, "-o", out)
    assert_clean_error(code, err, 2, "GPTJForCausalLM", hint=True)
    assert_nothing_written(out)
    code, _, err = run(capsys, "convert", tmp_path / "nope", "-o", out)
    assert_clean_error(code, err, 2, "no such folder", hint=True)


# ------------------------------------------------------------------ memory

_RSS_SCRIPT = textwrap.dedent(
    """
    import json, re, sys
    from toy.convert import import_hf
    r = import_hf(sys.argv[1], sys.argv[2], "f32")
    # VmHWM: this process's peak resident set (getrusage's ru_maxrss would
    # carry over the forking pytest process's peak across exec)
    status = open("/proc/self/status").read()
    hwm = int(re.search(r"VmHWM:\\s+(\\d+) kB", status).group(1))
    print(json.dumps({"maxrss_kb": hwm, "bytes_out": r.bytes_out, "seconds": r.seconds}))
    """
)


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads VmHWM from /proc/self/status")
def test_peak_rss_135m_class(tmp_path):
    """Converting a SmolLM2-135M-shaped F32 folder (random weights written by
    transformers) peaks below 1.5x the output's size (the whole process,
    Python and imports included)."""
    folder = hf_llama_ref.make_hf_llama(
        tmp_path / "hf",
        arch="llama",
        tie=True,
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        max_position_embeddings=2048,
        shards="200MB",
    )
    out = tmp_path / "m.gguf"
    proc = subprocess.run(
        [sys.executable, "-c", _RSS_SCRIPT, str(folder), str(out)], capture_output=True, text=True, check=True
    )
    rec = json.loads(proc.stdout.strip().splitlines()[-1])
    peak = rec["maxrss_kb"] * 1024
    print(f"135M-class F32: {rec['bytes_out'] / 1e6:.0f} MB out, peak RSS {peak / 1e6:.0f} MB, {rec['seconds']:.1f} s")
    assert rec["bytes_out"] == out.stat().st_size > 500e6
    assert peak < 1.5 * rec["bytes_out"]


# ------------------------------------------------------------------ 124M class


@pytest.mark.slow
def test_124m_class_llama_matches_the_converter(tmp_path):
    """A GPT-2-small-sized llama (hidden 768, 12 layers, 12 heads with 4 KV
    heads, intermediate 2304, GPT-2's 50257-token vocabulary, tied head;
    121M parameters) imported in F32: every tensor's bytes (and the
    whole file) equal llama.cpp's converter's."""
    folder = hf_llama_ref.make_hf_llama(
        tmp_path / "hf",
        arch="llama",
        tie=True,
        hidden_size=768,
        intermediate_size=2304,
        num_hidden_layers=12,
        num_attention_heads=12,
        num_key_value_heads=4,
        max_position_embeddings=1024,
        shards="150MB",
    )
    try:
        ref = hf_llama_ref.convert(folder, tmp_path / "ref.gguf", "f32")
        out = tmp_path / "toy.gguf"
        report = import_hf(folder, out, "f32", name=hf_llama_ref.MODEL_NAME)
        assert report.tied and 120e6 < report.n_params < 130e6
        assert_same_gguf(ref, out)
    finally:  # 1.5 GB of files: the test run keeps every tmp_path until the next runs
        shutil.rmtree(tmp_path, ignore_errors=True)
