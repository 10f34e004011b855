"""Importing Gemma 2 / Gemma 3 Hugging Face folders (``toy.convert.import_hf``
over ``toy.models.gemma_hf``) with their SentencePiece tokenizers
(``toy.convert.hf_tokenizer``).

Where each expected value comes from, none of it from toy:

- the file: llama.cpp's own ``convert_hf_to_gguf.py`` (the pinned
  llama-cpp-python sdist) on the same seeded transformers folder
  (``gemma_ref``): toy's import must be the same file, byte for byte
  (every metadata key, value and type; every tensor), for each shape
  (Gemma 2 tied; Gemma 3 tied with linear RoPE scaling; Gemma 3 untied with
  a final soft-cap), each output type, and F16 / BF16 checkpoints (where the
  converter's ``1 + w`` on the norms is computed in the source's precision);
- the model: transformers' greedy tokens (``gemma_ref.hf_greedy``) equal
  toy's on the imported file;
- the tokenizer: Hugging Face's ``GemmaTokenizerFast`` ids equal toy's on
  the imported file, and the special-token logic equals llama.cpp's
  ``gguf.SpecialVocab`` (the sdist's, run in a subprocess) on folders made to
  exercise its branches.

Refusals: what toy's Gemma does not compute (the converter would write a
file that differs from transformers' model) names the config field; a
missing ``sentencepiece`` package names the extra to install; nothing is
written to OUT.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

from toy.convert import HFImportError, import_hf
from toy.convert.hf_tokenizer import special_vocab
from toy_testsupport import gemma_ref, gpt2_ref, hf_llama_ref
from toy_testsupport.hf_checks import assert_same_gguf, converted_once, edit_config

pytest.importorskip("transformers")
pytest.importorskip("sentencepiece")

SHAPES = sorted(gemma_ref.SHAPES)
NAME = gemma_ref.MODEL_NAME
PROMPT = "The quick brown fox jumps over the lazy dog. Once upon a time, there was"
N_GEN = 16
TEXTS = [
    "Hello world",
    "Hello  world",
    "   leading spaces",
    "a\tb\t\tc",
    "line one\nline two\n\n",
    "1234567890 and 3.14159",
    "\u00dcber na\u00efve caf\u00e9",
    "\u4eca\u65e5\u306f\u6771\u4eac\u306b\u884c\u304d\u307e\u3059\u3002",
    "Emoji \U0001f600 and a rare \u0416",
    "<start_of_turn>user\nHi<end_of_turn>\n",
]


@pytest.fixture(scope="module")
def bf16_ref(tmp_path_factory):
    """llama.cpp's BF16 output of a gemma_ref folder (gemma_ref caches f32/f16/q8_0 only)."""
    return converted_once(tmp_path_factory.mktemp("bf16"), gemma_ref.hf_dir, "bf16")


def _reference(shape: str, outtype: str, bf16_ref):
    """(the converter's file, the general.name it carries)."""
    if outtype == "bf16":
        return bf16_ref(shape), hf_llama_ref.MODEL_NAME
    return gemma_ref.gguf_path(shape, 0, outtype), NAME


@pytest.mark.parametrize("shape", SHAPES)
def test_f32_import_is_the_converters_file(shape, tmp_path):
    out = tmp_path / "toy.gguf"
    report = import_hf(gemma_ref.hf_dir(shape), out, "f32", name=NAME)
    assert report.arch == gemma_ref.SHAPES[shape]["arch"]
    assert report.tied == gemma_ref.SHAPES[shape]["tie_word_embeddings"]
    assert_same_gguf(gemma_ref.gguf_path(shape, 0, "f32"), out)


@pytest.mark.slow
@pytest.mark.parametrize("outtype", ["f16", "bf16", "q8_0"])
@pytest.mark.parametrize("shape", SHAPES)
def test_import_is_the_converters_file(shape, outtype, tmp_path, bf16_ref):
    ref, name = _reference(shape, outtype, bf16_ref)
    out = tmp_path / "toy.gguf"
    import_hf(gemma_ref.hf_dir(shape), out, outtype, name=name)
    assert_same_gguf(ref, out)


def _retyped(shape: str, dtype: str, dst):
    """A copy of a gemma_ref folder whose weights are stored as ``dtype`` (torch's rounding)."""
    import torch
    from safetensors.torch import load_file, save_file

    shutil.copytree(gemma_ref.hf_dir(shape), dst)
    weights = load_file(str(dst / "model.safetensors"))
    save_file({k: v.to(getattr(torch, dtype)) for k, v in weights.items()}, str(dst / "model.safetensors"),
              metadata={"format": "pt"})  # fmt: skip
    return dst


@pytest.mark.slow
@pytest.mark.parametrize(
    ("shape", "dtype", "outtype"),
    [
        ("gemma2-tiny", "float16", "f32"),
        ("gemma3-tiny-untied", "float16", "f16"),
        ("gemma3-tiny-untied", "bfloat16", "f32"),
        ("gemma3-tiny", "bfloat16", "bf16"),
    ],
)
def test_half_precision_checkpoints(shape, dtype, outtype, tmp_path):
    """F16 and BF16 checkpoints: the converter adds Gemma's 1 to the norms in
    the checkpoint's precision (F16 stays F16, BF16 is widened to F32 first);
    the file must still be the converter's."""
    folder = _retyped(shape, dtype, tmp_path / "hf")
    ref = hf_llama_ref.convert(folder, tmp_path / "ref.gguf", outtype)
    out = tmp_path / "toy.gguf"
    import_hf(folder, out, outtype, name=hf_llama_ref.MODEL_NAME)
    assert_same_gguf(ref, out)


@pytest.mark.slow
@pytest.mark.parametrize("shape", ["gemma2-tiny", "gemma3-tiny-untied"])
def test_vocabulary_padded_to_vocab_size(shape, tmp_path):
    """config.json's vocab_size above the SentencePiece model's pieces: the
    converter pads the vocabulary with ``[PAD<id>]`` UNUSED tokens (and keeps
    every embedding row); so does the import."""
    from toy.gguf import GGUFFile

    fields = {k: v for k, v in gemma_ref.SHAPES[shape].items() if k != "arch"}
    n = gemma_ref.sp_vocab_size() + 9
    folder = gemma_ref.make_hf_gemma(tmp_path / "hf", arch=gemma_ref.SHAPES[shape]["arch"], seed=1, vocab_size=n,
                                     **fields)  # fmt: skip
    ref = hf_llama_ref.convert(folder, tmp_path / "ref.gguf", "f32")
    out = tmp_path / "toy.gguf"
    import_hf(folder, out, "f32", name=hf_llama_ref.MODEL_NAME)
    assert_same_gguf(ref, out)
    with GGUFFile(out) as gf:
        assert list(gf.metadata["tokenizer.ggml.tokens"])[-1] == f"[PAD{n - 1}]"
        assert gf.tensors["token_embd.weight"].shape == (n, fields["hidden_size"])


@pytest.mark.slow
def test_llama_with_a_sentencepiece_tokenizer(tmp_path):
    """A llama folder with a tokenizer.model: llama.cpp's LlamaModel reads it
    before tokenizer.json (SentencePiece keys, no Gemma ``add_space_prefix``);
    the import is the converter's file (vocab_size above the model's pieces:
    padded)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    folder = tmp_path / "hf"
    gemma_ref.gemma_tokenizer_files(folder)  # tokenizer.model and tokenizer.json: the model wins
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=gemma_ref.sp_vocab_size() + 3, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
        bos_token_id=2, eos_token_id=1, pad_token_id=0,
    )  # fmt: skip
    LlamaForCausalLM(config).save_pretrained(str(folder))
    ref = hf_llama_ref.convert(folder, tmp_path / "ref.gguf", "f32")
    out = tmp_path / "toy.gguf"
    import_hf(folder, out, "f32", name=hf_llama_ref.MODEL_NAME)
    assert_same_gguf(ref, out)


def test_norms_plus_one_in_the_source_precision(tmp_path):
    """The F16 case is not vacuous: 1 + w rounded to float16 differs from
    1 + w in float32 for these norm weights, and the import has the former."""
    from toy.gguf import GGUFFile

    folder = _retyped("gemma3-tiny-untied", "float16", tmp_path / "hf")
    out = tmp_path / "toy.gguf"
    import_hf(folder, out, "f32", name=NAME)
    w = gpt2_ref.hf_state_dict(folder)["model.layers.0.input_layernorm.weight"]  # float16 values, as float32
    in_f16 = (w.astype(np.float16) + np.float16(1)).astype(np.float32)
    in_f32 = w.astype(np.float32) + np.float32(1)
    assert not np.array_equal(in_f16, in_f32)
    with GGUFFile(out) as gf:
        got = np.frombuffer(gf.tensor_bytes("blk.0.attn_norm.weight"), np.float32)
    np.testing.assert_array_equal(got, in_f16)


@pytest.mark.slow
@pytest.mark.parametrize("shape", SHAPES)
def test_toy_runs_the_import_like_transformers(shape, tmp_path):
    """transformers' greedy tokens and tokenizer ids, from toy on the import."""
    import toy

    folder = gemma_ref.hf_dir(shape)
    out = tmp_path / "toy.gguf"
    import_hf(folder, out, "f32")
    hf_tok = gemma_ref.hf_tokenizer(folder)
    ids = list(hf_tok(PROMPT)["input_ids"])
    assert len(ids) > 2 * gemma_ref.SHAPES[shape]["sliding_window"]  # the window matters
    want = gemma_ref.hf_greedy(folder, ids, N_GEN)
    with toy.load(out, threads=1, n_ctx=96, kv_type="f32") as m:
        assert m.tokenize(PROMPT) == ids
        got = list(m.generate(ids, max_tokens=N_GEN, temperature=0, ignore_eos=True).tokens)
    assert got == want
    assert len(set(want)) > N_GEN // 2  # greedy text that moves on


def test_tokenizer_of_the_import(tmp_path):
    """toy's tokenizer on the imported file gives the converter's file's ids
    and GemmaTokenizerFast's (BOS added as the file says)."""
    from toy.tokenizer import Tokenizer

    folder = gemma_ref.hf_dir("gemma2-tiny")
    out = tmp_path / "toy.gguf"
    import_hf(folder, out, "f32")
    mine = Tokenizer.from_file(out)
    theirs = Tokenizer.from_file(gemma_ref.gguf_path("gemma2-tiny", 0, "f32"))
    hf_tok = gemma_ref.hf_tokenizer(folder)
    for text in TEXTS:
        want = list(hf_tok(text)["input_ids"])
        assert mine.encode(text) == theirs.encode(text) == want, text


# ------------------------------------------------------------------ refusals


def _copy(shape: str, tmp_path, **changes):
    folder = tmp_path / "hf"
    shutil.copytree(gemma_ref.hf_dir(shape), folder)
    return edit_config(folder, **changes)


def _refused(folder, tmp_path, field: str, *fragments: str) -> HFImportError:
    out = tmp_path / "out" / "m.gguf"
    out.parent.mkdir()
    with pytest.raises(HFImportError) as ei:
        import_hf(folder, out, "f32")
    e = ei.value
    assert e.field == field, (e.field, str(e))
    assert e.hint
    for f in fragments:
        assert f in str(e) + " " + str(e.hint), (f, str(e), e.hint)
    assert list(out.parent.iterdir()) == []  # nothing written, no temporary left
    return e


@pytest.mark.parametrize(
    ("shape", "changes", "field", "fragment"),
    [
        ("gemma2-tiny", {"query_pre_attn_scalar": 64}, "query_pre_attn_scalar", "1/sqrt(16)"),
        ("gemma2-tiny", {"hidden_activation": "gelu"}, "hidden_activation", "tanh"),
        ("gemma2-tiny", {"rope_theta": 20000.0}, "rope_theta", "10000"),
        ("gemma2-tiny", {"rope_scaling": {"rope_type": "linear", "factor": 2.0}}, "rope_scaling", "linear"),
        ("gemma2-tiny", {"attn_logit_softcapping": None}, "attn_logit_softcapping", "None"),
        ("gemma2-tiny", {"tie_word_embeddings": False}, "tie_word_embeddings", "lm_head"),
        ("gemma2-tiny", {"layer_types": ["full_attention"] * 4}, "layer_types", "FFFF"),
        ("gemma2-tiny", {"num_key_value_heads": 3}, "num_key_value_heads", "multiple"),
        ("gemma2-tiny", {"hidden_size": "64"}, "hidden_size", "positive integer"),
        ("gemma2-tiny", {"head_dim": ...}, "head_dim", "missing"),
        ("gemma3-tiny", {"attn_logit_softcapping": 50.0}, "attn_logit_softcapping", "soft-cap"),
        ("gemma3-tiny", {"rope_scaling": {"rope_type": "yarn", "factor": 2.0}}, "rope_scaling", "yarn"),
        ("gemma3-tiny", {"use_bidirectional_attention": True}, "use_bidirectional_attention", "causal"),
        ("gemma3-tiny", {"layer_types": ..., "sliding_window_pattern": 3}, "layer_types", "SSFSSFS"),
        ("gemma3-tiny", {"attention_bias": True}, "attention_bias", "biases"),
        ("gemma3-tiny", {"architectures": ["Gemma3ForConditionalGeneration"]}, "architectures", "text model"),
    ],
)
def test_config_refusals(shape, changes, field, fragment, tmp_path):
    _refused(_copy(shape, tmp_path, **changes), tmp_path, field, fragment)


def test_gemma3_sliding_pattern_one_means_no_window(tmp_path):
    """``sliding_window_pattern`` 1: every layer attends fully in transformers,
    and the converter then writes no window (llama.cpp slides nowhere)."""
    from toy.gguf import GGUFFile

    folder = _copy("gemma3-tiny", tmp_path, layer_types=..., sliding_window_pattern=1)
    out = tmp_path / "toy.gguf"
    import_hf(folder, out, "f32")
    with GGUFFile(out) as gf:
        assert "gemma3.attention.sliding_window" not in gf.metadata
        assert gf.metadata["gemma3.rope.scaling.factor"] == 2.0


def test_missing_sentencepiece_names_the_extra(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "sentencepiece", None)  # `import sentencepiece` now raises ImportError
    folder = gemma_ref.hf_dir("gemma3-tiny")
    _refused(folder, tmp_path, "tokenizer.model", "toy-core[sentencepiece]")


def test_corrupt_tokenizer_model(tmp_path):
    folder = _copy("gemma2-tiny", tmp_path)
    (folder / "tokenizer.model").write_bytes(b"not a protobuf")
    _refused(folder, tmp_path, "tokenizer.model", "SentencePiece")


def test_without_tokenizer_model_the_bpe_reading_refuses_gemmas_split(tmp_path):
    """Without tokenizer.model the converter reads tokenizer.json as BPE and
    names its pre-tokenizer by a hash table that has no entry for this one;
    toy refuses it too (naming the field) rather than guess."""
    folder = _copy("gemma3-tiny", tmp_path)
    (folder / "tokenizer.model").unlink()
    _refused(folder, tmp_path, "pre_tokenizer")


# ------------------------------------------------------------------ special tokens, against gguf.SpecialVocab

_SPECIAL_VOCAB = """
import json, sys
from pathlib import Path
from gguf.vocab import SpecialVocab
out = {}
for d in sys.argv[1:]:
    sv = SpecialVocab(Path(d), load_merges=True, n_vocab=16)
    out[d] = {"ids": list(sv.special_token_ids.items()), "add": list(sv.add_special_token.items()),
              "merges": sv.merges, "chat_template": sv.chat_template,
              "lower": sv.normalizer_lowercase, "strip": sv.normalizer_strip_accents}
print(json.dumps(out))
"""


def _added(*names: str) -> list[dict]:
    return [{"id": 10 + i, "content": n, "special": True} for i, n in enumerate(names)]


def _single(*parts: str) -> list[dict]:
    return [{"SpecialToken": {"id": p, "type_id": 0}} if p != "A" else {"Sequence": {"id": "A", "type_id": 0}}
            for p in parts]  # fmt: skip


def _pair(*parts: str) -> list[dict]:
    return [
        {"Sequence": {"id": p, "type_id": 0}} if p in ("A", "B") else {"SpecialToken": {"id": p, "type_id": 0}}
        for p in parts
    ]


# (tokenizer.json parts, tokenizer_config.json or None, config.json, chat_template.jinja or None)
SPECIAL_CASES = {
    "template-bos": (
        {"post_processor": {"type": "TemplateProcessing", "single": _single("<s>", "A"),
                            "pair": _pair("<s>", "A", "<s>", "B")}, "added_tokens": _added("<s>", "</s>")},
        {"bos_token": "<s>", "eos_token": "</s>", "add_eos_token": False},
        {"pad_token_id": 3},
        None,
    ),
    "template-eot": (
        {"post_processor": {"type": "TemplateProcessing", "single": _single("<s>", "A", "<eot>"),
                            "pair": _pair("<s>", "A", "<eot>", "B", "<eot>")},
         "added_tokens": _added("<s>", "</s>", "<eot>")},
        {"bos_token": {"content": "<s>"}, "eos_token": "</s>"},
        {"eos_token_id": 11, "bos_token_id": 5},
        "{{ messages }}",
    ),
    "template-sep": (
        {"post_processor": {"type": "TemplateProcessing", "single": _single("[CLS]", "A", "[SEP]"),
                            "pair": _pair("[CLS]", "A", "[SEP]", "B", "[SEP]")},
         "added_tokens": _added("[CLS]", "[SEP]", "[PAD]"),
         "normalizer": {"type": "BertNormalizer", "lowercase": True, "strip_accents": False}},
        {"cls_token": "[CLS]", "sep_token": "[SEP]", "pad_token": "[PAD]", "chat_template": "x"},
        {},
        None,
    ),
    "bytelevel-merges": (
        {"post_processor": {"type": "Sequence", "processors": [{"type": "ByteLevel"}]},
         "model": {"type": "BPE", "merges": [["a", "b"], ["a b", "c"]]}, "added_tokens": _added("<|end|>"),
         "normalizer": {"type": "Sequence", "normalizers": [{"type": "Lowercase"}]}},
        {"eos_token": "<|end|>", "add_bos_token": True, "unk_token": "<|missing|>"},
        {"bos_token_id": 99, "pad_token_id": 1},
        "{{ jinja }}",
    ),
    "roberta": (
        {"post_processor": {"type": "RobertaProcessing", "sep": ["</s>", 2], "cls": ["<s>", 0]},
         "added_tokens": _added("<s>", "</s>", "<mask>")},
        {"bos_token": "<s>", "mask_token": "<mask>"},
        {},
        None,
    ),
    "no-tokenizer-config": (
        {"post_processor": {"type": "TemplateProcessing", "single": _single("<s>", "A"), "pair": []},
         "added_tokens": _added("<s>")},
        None,
        {"eos_token_id": 2, "text_config": {"bos_token_id": 4}},
        None,
    ),
}  # fmt: skip


def test_special_tokens_as_llamacpps_special_vocab(tmp_path):
    folders = {}
    for name, (tj, tc, config, template) in SPECIAL_CASES.items():
        d = tmp_path / name
        d.mkdir()
        (d / "tokenizer.json").write_text(json.dumps(tj))
        if tc is not None:
            (d / "tokenizer_config.json").write_text(json.dumps(tc))
        (d / "config.json").write_text(json.dumps(config))
        if template is not None:
            (d / "chat_template.jinja").write_text(template)
        folders[name] = d
    lcpp = gpt2_ref.llama_cpp_dir()
    env = dict(os.environ, PYTHONPATH=str(lcpp / "gguf-py"))
    proc = subprocess.run(
        [sys.executable, "-c", _SPECIAL_VOCAB, *map(str, folders.values())],
        env=env, capture_output=True, text=True, check=True,
    )  # fmt: skip
    want = json.loads(proc.stdout)
    for name, d in folders.items():
        tj, tc, config, _ = SPECIAL_CASES[name]
        sv = special_vocab(d, 16, tj, None if tc is None else dict(tc), config, load_merges=True)
        w = want[str(d)]
        got = {"ids": [list(x) for x in sv.ids.items()], "add": [list(x) for x in sv.add.items()]}
        assert got == {"ids": w["ids"], "add": w["add"]}, name
        assert (sv.merges, sv.chat_template) == (w["merges"], w["chat_template"]), name
        assert (sv.lowercase, sv.strip_accents) == (w["lower"], w["strip"]), name
