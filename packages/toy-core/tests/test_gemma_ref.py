"""The Gemma reference models themselves (``gemma_ref``), checked before toy
runs any of them.

Where each expected value comes from:

- the model: Hugging Face ``transformers`` (``Gemma2ForCausalLM``,
  ``Gemma3ForCausalLM``, seeded random weights) and its float32 eager
  forward, ``gemma_ref.hf_logits`` / ``hf_greedy``;
- the file: llama.cpp's own ``convert_hf_to_gguf.py`` (llama-cpp-python
  0.3.36 sdist) run on that checkpoint, read back with the ``gguf`` package:
  its metadata (soft-caps, sliding window, local RoPE base), its tensors
  (equal to the HF state dict, norm weights as ``1 + w``) and its
  SentencePiece vocabulary;
- the tokenizer: HF ``GemmaTokenizerFast`` and ``apply_chat_template`` over
  the same SentencePiece model and template, against toy's tokenizer and
  chat template built from the GGUF.

The recipe is also checked for strength: greedy text that moves on, soft-caps
that bite and test sequences longer than the sliding window (the logits past
the window change when the window is widened). Files are cached
(``gemma_ref.cache_root()``): a first run builds them (about 20 s), later
runs only read them.
"""

from __future__ import annotations

import numpy as np
import pytest

from toy.tokenizer import ChatTemplate, ChatTemplateError, Tokenizer
from toy_testsupport import gemma_ref, gpt2_ref

SHAPES = sorted(gemma_ref.SHAPES)
PROMPT = "Once upon a time, there was a little"
LONG = "The capital of France is Paris, and the capital of Germany is Berlin. Water boils at 100 degrees."
N_GEN = 16
MIN_MARGIN = 5e-4  # greedy top-1 minus top-2 over N_GEN steps; measured >= 1.1e-3 (gemma2-tiny)

# llama.cpp token types (gguf.TokenType)
NORMAL, CONTROL, BYTE = 1, 3, 6

# strings the toy tokenizer must encode exactly as GemmaTokenizerFast does
TEXTS = [
    "Hello world",
    "Hello  world",
    "   leading spaces",
    "trailing spaces   ",
    " ",
    "",
    "\t",
    "a\tb\t\tc",
    "line one\nline two\n\n",
    "\r\n windows\r\n",
    "   \n\t  \n",
    "1234567890",
    "3.14159 and -7.5e-3",
    "x = 12345 + 678",
    "\u00dcber na\u00efve caf\u00e9 \u2014 \u00fcn\u00efc\u00f6d\u00e9",
    "Cr\u00e8me br\u00fbl\u00e9e \u00e0 No\u00ebl",
    "\u4eca\u65e5\u306f\u6771\u4eac\u306b\u884c\u304d\u307e\u3059\u3002",
    "\u4f60\u597d\uff0c\u4e16\u754c\uff01",
    "\uc548\ub155\ud558\uc138\uc694",
    "\U0001f600\U0001f680 emoji \U0001f44d\U0001f3fd \u2764\ufe0f",
    "\U0001d518\U0001d52b\U0001d526 outside the corpus \u2211\u222b\u221a \u2177 \ufb01 \u00bd \u00b2",
    "def f(x):\n    return x * 2\n",
    "The quick brown fox jumps over the lazy dog.",
    "\u2581 a literal U+2581",
    "<start_of_turn>user\nhi<end_of_turn>\n<start_of_turn>model\n",
    "<bos>text<eos>",
    "<mask> and [@BOS@]",
    "<pad><unk>",
    "<start_of_turn",
]

CONVERSATIONS = [
    [{"role": "user", "content": "Hello!"}],
    [
        {"role": "user", "content": " Hi there \n"},
        {"role": "assistant", "content": "Hello. How can I help?"},
        {"role": "user", "content": "Tell me a joke about caf\u00e9s \U0001f600."},
    ],
]


# (metadata, GGUFReader) of a converted file (cached), and its tensors by name
fields, tensors = gpt2_ref.read_gguf, gpt2_ref.gguf_tensors


@pytest.fixture(scope="module")
def hf_tok():
    return gemma_ref.hf_tokenizer(gemma_ref.hf_dir("gemma2-tiny"))


@pytest.fixture(scope="module")
def toy_tok():
    return Tokenizer.from_file(gemma_ref.gguf_path("gemma2-tiny"))


# ------------------------------------------------------------------ the recipe


def test_sentencepiece_model_is_deterministic():
    a, b = gemma_ref.sp_model_bytes(), gemma_ref.sp_model_bytes()
    assert a == b
    # the cached copy was trained in whichever process built the cache
    for shape in SHAPES:
        assert (gemma_ref.hf_dir(shape) / "tokenizer.model").read_bytes() == a


def test_sentencepiece_layout():
    import sentencepiece as spm

    sp = spm.SentencePieceProcessor(model_proto=gemma_ref.sp_model_bytes())
    assert sp.vocab_size() == gemma_ref.SP_VOCAB_SIZE == gemma_ref.sp_vocab_size()
    pieces = [sp.id_to_piece(i) for i in range(sp.vocab_size())]
    assert pieces[:8] == [*gemma_ref.SPECIAL_PIECES, *gemma_ref.USER_SYMBOLS]
    assert pieces[8:264] == [f"<0x{b:02X}>" for b in range(256)]
    assert (sp.pad_id(), sp.eos_id(), sp.bos_id(), sp.unk_id()) == (0, 1, 2, 3)
    # a "\t" piece: without it HF's GemmaConverter renames <0x09> to "\t" and
    # HF and the GGUF would disagree on tabs
    assert "\t" in pieces and "\n" in pieces and "\u2581\u2581" in pieces


@pytest.mark.parametrize("shape", SHAPES)
def test_hf_config(shape):
    import json

    spec = gemma_ref.SHAPES[shape]
    cfg = json.loads((gemma_ref.hf_dir(shape) / "config.json").read_text())
    assert cfg["vocab_size"] == gemma_ref.SP_VOCAB_SIZE
    assert cfg["query_pre_attn_scalar"] == cfg["head_dim"] == spec["head_dim"]
    assert cfg["hidden_activation"] == "gelu_pytorch_tanh"
    assert cfg["sliding_window"] == spec["sliding_window"] == 8
    assert cfg.get("tie_word_embeddings", True) is spec["tie_word_embeddings"]  # omitted when default
    if spec["arch"] == "gemma2":
        assert cfg["architectures"] == ["Gemma2ForCausalLM"]
        assert cfg["rope_theta"] == 10000.0 and cfg["num_hidden_layers"] != 46
        assert cfg["attn_logit_softcapping"] and cfg["final_logit_softcapping"]
    else:
        assert cfg["architectures"] == ["Gemma3ForCausalLM"]
        assert cfg["attn_logit_softcapping"] is None and cfg["use_bidirectional_attention"] is False
        assert "sliding_window_pattern" not in cfg
        # llama.cpp's fixed pattern: every 6th layer global
        assert cfg["layer_types"] == ["full_attention" if i % 6 == 5 else "sliding_attention" for i in range(7)]
    # the weights were redrawn: norm weights near 1 (scale about 2), matrices 1/sqrt(fan_in)
    sd = gemma_ref.hf_state_dict(gemma_ref.hf_dir(shape))
    norms = np.concatenate([v for k, v in sd.items() if k.endswith("norm.weight")])
    assert abs(norms.mean() - gemma_ref.NORM_MEAN) < 0.05 and abs(norms.std() - gemma_ref.NORM_STD) < 0.05
    q = sd["model.layers.0.self_attn.q_proj.weight"]
    assert abs(q.std() * q.shape[1] ** 0.5 - gemma_ref.WEIGHT_GAIN) < 0.1


# ------------------------------------------------------------------ the converted file


@pytest.mark.parametrize("shape", SHAPES)
def test_gguf_metadata(shape):
    spec = gemma_ref.SHAPES[shape]
    arch = spec["arch"]
    kv, _ = fields(gemma_ref.gguf_path(shape))
    assert kv["general.architecture"] == arch
    assert kv["general.name"] == gemma_ref.MODEL_NAME
    assert kv["general.file_type"] == 0
    expect = {
        "context_length": 256,
        "embedding_length": 64,
        "block_count": spec["num_hidden_layers"],
        "feed_forward_length": 128,
        "attention.head_count": 4,
        "attention.head_count_kv": spec["num_key_value_heads"],
        "attention.key_length": 16,
        "attention.value_length": 16,
        "attention.sliding_window": 8,
    }
    for k, v in expect.items():
        assert kv[f"{arch}.{k}"] == v, k
    final = f"{arch}.final_logit_softcapping"
    if arch == "gemma2":
        assert kv["gemma2.attn_logit_softcapping"] == spec["attn_logit_softcapping"]
        assert kv[final] == spec["final_logit_softcapping"]
        # not converted: llama.cpp uses base 10000, no scaling, as the HF config does
        assert not any(k.startswith("gemma2.rope") for k in kv)
    else:
        assert "gemma3.attn_logit_softcapping" not in kv
        assert kv["gemma3.rope.freq_base"] == spec["rope_theta"]
        assert kv["gemma3.rope.freq_base_swa"] == spec["rope_local_base_freq"]
        assert kv["gemma3.rope.scaling.type"] == "linear" and kv["gemma3.rope.scaling.factor"] == 2.0
        if spec["final_logit_softcapping"] is None:
            assert final not in kv
        else:
            assert kv[final] == spec["final_logit_softcapping"]


@pytest.mark.parametrize("shape", SHAPES)
def test_gguf_tensors_equal_hf(shape):
    from gguf import GGMLQuantizationType

    spec = gemma_ref.SHAPES[shape]
    sd = gemma_ref.hf_state_dict(gemma_ref.hf_dir(shape))
    got = tensors(gemma_ref.gguf_path(shape))
    assert set(got) == {gemma_ref.gguf_name(k) for k in sd}
    assert ("output.weight" in got) is (not spec["tie_word_embeddings"])
    assert ("blk.0.attn_q_norm.weight" in got) is (spec["arch"] == "gemma3")
    for i in range(spec["num_hidden_layers"]):
        assert f"blk.{i}.post_attention_norm.weight" in got and f"blk.{i}.post_ffw_norm.weight" in got
    for name, w in sd.items():
        t = got[gemma_ref.gguf_name(name)]
        assert t.tensor_type == GGMLQuantizationType.F32, name
        data = np.asarray(t.data).reshape(w.shape)
        # norm weights are stored as 1 + w (computed in float32, as HF does at run time)
        want = np.float32(1.0) + w if name.endswith("norm.weight") else w
        np.testing.assert_array_equal(data, want, err_msg=name)


@pytest.mark.parametrize("outtype", ["f16", "q8_0"])
def test_gguf_outtypes(outtype):
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    shape = "gemma3-tiny-untied"
    sd = gemma_ref.hf_state_dict(gemma_ref.hf_dir(shape))
    kv, _ = fields(gemma_ref.gguf_path(shape, outtype=outtype))
    assert kv["general.file_type"] == {"f16": 1, "q8_0": 7}[outtype]
    qtype = GGMLQuantizationType[outtype.upper()]
    for name, t in tensors(gemma_ref.gguf_path(shape, outtype=outtype)).items():
        hf = next(v for k, v in sd.items() if gemma_ref.gguf_name(k) == name)
        if hf.ndim == 1:
            assert t.tensor_type == GGMLQuantizationType.F32, name  # norms stay F32
            continue
        assert t.tensor_type == qtype, name
        deq = dequantize(np.asarray(t.data), t.tensor_type).reshape(hf.shape)
        tol = np.abs(hf).max() * (2.0**-10 if outtype == "f16" else 1.0 / 127)
        assert np.abs(deq - hf).max() <= tol, name


def test_gguf_tokenizer():
    import sentencepiece as spm

    sp = spm.SentencePieceProcessor(model_proto=gemma_ref.sp_model_bytes())
    for shape in SHAPES:
        kv, _ = fields(gemma_ref.gguf_path(shape))
        assert kv["tokenizer.ggml.model"] == "llama" and kv["tokenizer.ggml.pre"] == "default"
        assert kv["tokenizer.ggml.add_space_prefix"] is False  # llama.cpp's SPM default is True
        assert kv["tokenizer.ggml.add_bos_token"] is True and kv["tokenizer.ggml.add_eos_token"] is False
        ids = {k: kv[f"tokenizer.ggml.{k}_token_id"] for k in ("padding", "eos", "bos", "unknown")}
        assert ids == {"padding": 0, "eos": 1, "bos": 2, "unknown": 3}
        tokens = list(kv["tokenizer.ggml.tokens"])
        assert tokens == [sp.id_to_piece(i) for i in range(sp.vocab_size())]
        # pad/eos/bos/unk and the four user symbols all CONTROL (HF's added tokens,
        # or "looks special" for <mask> and [@BOS@]), the 256 byte pieces BYTE
        types = list(kv["tokenizer.ggml.token_type"])
        assert types == [CONTROL] * 8 + [BYTE] * 256 + [NORMAL] * (len(tokens) - 264)
        assert kv["tokenizer.chat_template"] == gemma_ref.chat_template_text()


# ------------------------------------------------------------------ the HF forward


@pytest.mark.parametrize("shape", SHAPES)
def test_hf_greedy_moves_on(shape, hf_tok):
    d = gemma_ref.hf_dir(shape)
    ids = hf_tok.encode(PROMPT)
    out = gemma_ref.hf_greedy(d, ids, N_GEN)
    assert len(out) == N_GEN and len(set(out)) >= N_GEN // 2, out
    logits = gemma_ref.hf_logits(d, ids + out[:-1])[len(ids) - 1 :]
    assert list(logits.argmax(axis=1)) == out
    top2 = np.sort(logits, axis=1)[:, -2:]
    margins = top2[:, 1] - top2[:, 0]
    assert margins.min() > MIN_MARGIN and np.median(margins) > 0.05, margins


@pytest.mark.parametrize("shape", SHAPES)
def test_hf_sliding_window_matters(shape, hf_tok):
    d = gemma_ref.hf_dir(shape)
    w = gemma_ref.SHAPES[shape]["sliding_window"]
    ids = hf_tok.encode(LONG)
    assert len(ids) > 4 * w
    base = gemma_ref.hf_logits(d, ids)
    assert np.isfinite(base).all()
    for wider in (w + 1, 256):
        diff = np.abs(gemma_ref.hf_logits(d, ids, sliding_window=wider) - base).max(axis=1)
        assert diff[:w].max() < 1e-6  # the window covers these positions either way
        assert diff[w:].min() > 1e-3, diff  # every position past it sees the window


@pytest.mark.parametrize("shape", [s for s in SHAPES if gemma_ref.SHAPES[s]["final_logit_softcapping"]])
def test_hf_final_softcap_bites(shape, hf_tok):
    d = gemma_ref.hf_dir(shape)
    cap = gemma_ref.SHAPES[shape]["final_logit_softcapping"]
    ids = hf_tok.encode(LONG)
    capped = gemma_ref.hf_logits(d, ids)
    raw = gemma_ref.hf_logits(d, ids, final_logit_softcapping=None)
    np.testing.assert_allclose(capped, cap * np.tanh(raw / cap), atol=1e-5)
    assert np.abs(raw).max() > 1.4 * cap  # tanh far from linear at the top logits
    assert np.abs(capped - raw).max() > 1.0


def test_hf_attention_softcap_bites(hf_tok):
    d = gemma_ref.hf_dir("gemma2-tiny")
    ids = hf_tok.encode(LONG)
    diff = np.abs(gemma_ref.hf_logits(d, ids) - gemma_ref.hf_logits(d, ids, attn_logit_softcapping=None))
    assert diff.max() > 1.0


# ------------------------------------------------------------------ toy's tokenizer on the file


def test_toy_tokenizer_facts(toy_tok):
    assert toy_tok.model == "llama" and toy_tok.vocab_size == gemma_ref.SP_VOCAB_SIZE
    assert (toy_tok.bos_id, toy_tok.eos_id, toy_tok.unk_id, toy_tok.pad_id) == (2, 1, 3, 0)
    assert toy_tok.add_bos is True and toy_tok.add_eos is False
    assert toy_tok.eog_ids == {1, 7}  # <eos> and <end_of_turn> (llama.cpp finds EOT by its text)


@pytest.mark.parametrize("text", TEXTS)
def test_toy_tokenizer_matches_hf(text, hf_tok, toy_tok):
    want = hf_tok.encode(text, add_special_tokens=False)
    assert toy_tok.encode(text, add_special=False) == want
    assert toy_tok.encode(text) == hf_tok.encode(text) == [2, *want]
    assert toy_tok.decode(want) == hf_tok.decode(want)


def test_toy_tokenizer_same_for_every_shape():
    files = [gemma_ref.hf_dir(s) for s in SHAPES]
    for name in ("tokenizer.model", "tokenizer.json", "tokenizer_config.json"):
        assert len({(d / name).read_bytes() for d in files}) == 1, name


@pytest.mark.parametrize("messages", CONVERSATIONS, ids=["one-turn", "three-turns"])
def test_toy_chat_template_matches_hf(messages, hf_tok, toy_tok):
    kv = fields(gemma_ref.gguf_path("gemma2-tiny"))[0]
    tmpl = ChatTemplate.from_gguf(kv)
    text = tmpl.render(messages, add_generation_prompt=True)
    assert text == hf_tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text.startswith("<bos><start_of_turn>user\n") and text.endswith("<start_of_turn>model\n")
    # the rendered text carries its own <bos>: encode it without adding another
    ids = toy_tok.encode(text, add_special=False)
    assert ids == list(hf_tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=True))
    assert ids[0] == 2 and ids.count(2) == 1


def test_toy_chat_template_rejects_system_role(hf_tok):
    from jinja2 import TemplateError

    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    tmpl = ChatTemplate.from_gguf(fields(gemma_ref.gguf_path("gemma2-tiny"))[0])
    with pytest.raises(ChatTemplateError, match="System role not supported"):
        tmpl.render(messages)
    with pytest.raises(TemplateError, match="System role not supported"):
        hf_tok.apply_chat_template(messages, tokenize=False)
