"""Byte-level BPE training: the GGUF metadata ``train_bpe`` returns must give,
through toy's own GGUF tokenizer (``Tokenizer.from_gguf``), exactly the ids of
the HF tokenizer that was trained, decode back to the bytes, and survive a
write/read round trip through a GGUF file."""

from __future__ import annotations

import json

import numpy as np
import pytest

from toy.gguf import GGUFFile, GGUFWriter, ValueType
from toy.tokenizer import Tokenizer
from toy.train.bpe import gguf_metadata, train_bpe, train_hf_bpe, write_metadata
from toy.train.data import DataError

CORPUS = [
    "Hello world! The quick brown fox jumps over the lazy dog.",
    "Café, naïve, Zürich, São Paulo — déjà vu.",
    "Emoji: 😀 👍🏽 🇫🇷 and CJK 日本語のテキスト.",
    "Digits 0123456789, 3.14159, 2024-01-01, 1,000,000.",
    "def f(x):\n    return x  +  1\n\n\tindented\ttabs\r\nwindows line",
    "it's we're they've I'm you'll he'd",
]
SAMPLES = [
    "Hello world",
    "hello   world  with   several    spaces",
    "Zürich café naïve façade",
    "😀👍🏽 emoji 🇫🇷 and 日本",
    "numbers 1234567890 and 3.14",
    "line one\nline two\n\n\nafter blanks\r\ncrlf\ttab",
    "   leading and trailing   ",
    "unseen: qzxj ÆØÅ ✓ \u00a0nbsp \x00 nul",
    "it's they've We'RE",
]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    d = tmp_path_factory.mktemp("corpus")
    (d / "a.txt").write_text("\n".join(CORPUS[:3]) * 3, "utf-8")
    (d / "sub").mkdir()
    (d / "sub" / "b.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in CORPUS[3:] * 3), "utf-8")
    return d


@pytest.fixture(scope="module")
def trained(corpus):
    hf = train_hf_bpe(corpus, 420, min_frequency=2)
    return hf, gguf_metadata(hf)


def test_metadata_shape(trained):
    hf, meta = trained
    tokens = meta["tokenizer.ggml.tokens"]
    assert meta["tokenizer.ggml.model"] == "gpt2" and meta["tokenizer.ggml.pre"] == "gpt-2"
    assert tokens[0] == "<|endoftext|>" and 257 < len(tokens) <= 420 and len(set(tokens)) == len(tokens)
    tt = meta["tokenizer.ggml.token_type"]
    assert tt.dtype == np.int32 and tt[0] == 3 and (tt[1:] == 1).all() and len(tt) == len(tokens)
    assert meta["tokenizer.ggml.bos_token_id"] == meta["tokenizer.ggml.eos_token_id"] == 0
    assert meta["tokenizer.ggml.add_bos_token"] is False
    vocab = set(tokens)
    assert len(meta["tokenizer.ggml.merges"]) == len(tokens) - 257  # every non-byte token comes from a merge
    for m in meta["tokenizer.ggml.merges"]:
        a, b = m.split(" ")
        assert a in vocab and b in vocab and a + b in vocab
    assert {hf.id_to_token(i) for i in range(hf.get_vocab_size())} == vocab


def test_from_gguf_encodes_like_hf(trained):
    hf, meta = trained
    tok = Tokenizer.from_gguf(meta)
    assert tok.vocab_size == hf.get_vocab_size() and tok.eos_id == 0 and tok.bos_id == 0
    for s in SAMPLES + CORPUS:
        ids = tok.encode(s, add_special=False)
        assert ids == hf.encode(s, add_special_tokens=False).ids, s
        assert b"".join(tok.token_to_piece(i) for i in ids) == s.encode("utf-8")  # exact bytes
        assert tok.decode(ids) == s  # none of these texts meets llama.cpp's space clean-up
        assert hf.decode(ids) == s
    assert tok.encode("a<|endoftext|>b", add_special=False) == tok.encode("a") + [0] + tok.encode("b")
    assert tok.encode("x", add_special=None) == tok.encode("x", add_special=False)  # no BOS added
    assert tok.is_control(0) and tok.decode([0], skip_special=True) == ""


def test_gguf_round_trip(trained, tmp_path):
    hf, meta = trained
    path = tmp_path / "tok.gguf"
    w = GGUFWriter(path)
    w.add("general.architecture", "llama")
    write_metadata(w, meta)
    w.add_tensor("token_embd.weight", np.zeros((len(meta["tokenizer.ggml.tokens"]), 4), np.float32))
    w.write()
    with GGUFFile(path) as f:
        assert f.types["tokenizer.ggml.eos_token_id"].type == ValueType.UINT32
        assert f.types["tokenizer.ggml.token_type"].sub.type == ValueType.INT32
        assert list(f.metadata["tokenizer.ggml.tokens"]) == meta["tokenizer.ggml.tokens"]
        tok = Tokenizer.from_gguf(f.metadata)
    for s in SAMPLES:
        assert tok.encode(s, add_special=False) == hf.encode(s, add_special_tokens=False).ids
    assert Tokenizer.from_file(path).decode(tok.encode(SAMPLES[3])) == SAMPLES[3]


def test_train_bpe_progress_and_determinism(corpus):
    seen = []
    a = train_bpe(corpus, 300, progress=lambda d, t: seen.append((d, t)))
    b = train_bpe(corpus, 300)
    total = sum(p.stat().st_size for p in corpus.rglob("*") if p.is_file())
    assert seen[-1] == (total, total) and all(d <= t for d, t in seen)
    assert a["tokenizer.ggml.tokens"] == b["tokenizer.ggml.tokens"]
    assert a["tokenizer.ggml.merges"] == b["tokenizer.ggml.merges"]
    assert len(a["tokenizer.ggml.tokens"]) == 300


def test_train_bpe_errors(tmp_path, corpus):
    with pytest.raises(DataError, match="at least 257"):
        train_bpe(corpus, 256)
    with pytest.raises(DataError, match="no such file"):
        train_bpe(tmp_path / "missing", 300)
    (tmp_path / "empty.txt").write_text("")
    with pytest.raises(DataError, match="empty"):
        train_bpe(tmp_path / "empty.txt", 300)
    (tmp_path / "bad.jsonl").write_text('{"text": "ok"}\n{"text": 1}\n')
    with pytest.raises(DataError, match=r"bad\.jsonl:2"):
        train_bpe(tmp_path / "bad.jsonl", 300)
