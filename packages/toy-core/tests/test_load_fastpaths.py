"""The shortcuts ``toy.load`` takes give what the long way gave: the KV cache
starts as zeros in every type it supports (stored as zero bytes, not converted
from float zeros; on the CPU an anonymous mapping, its tensors apart), a lazy
GGUF string array decoded in one native pass equals the item-by-item decode
(the vocabulary and merges are read that way), merges split natively as
llama.cpp splits them, the BPE built from the unfiltered merges only when every
one is valid, and the byte pieces of a vocabulary made in one native pass equal
llama.cpp's rules applied token by token.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

import toy_ggml
from toy.engine.kv import KVCache
from toy.gguf import GGUFFile
from toy.gguf.reader import StringArray
from toy.gguf.writer import GGUFWriter
from toy.tokenizer import Tokenizer, TokenizerError
from toy.tokenizer.vocab import ATTR_BYTE, ATTR_CONTROL, ATTR_NORMAL, ATTR_UNKNOWN, ATTR_USER_DEFINED, Vocab


@pytest.mark.parametrize(("kv_type", "v_trans"), [("f16", True), ("f32", True), ("f16", False), ("q8_0", False)])
def test_kv_cache_starts_as_zeros(kv_type, v_trans):
    cfg = SimpleNamespace(n_layer=2, n_head_kv=2, head_dim=32)
    with toy_ggml.Runtime(toy_ggml.resolve_device("cpu"), threads=1) as rt:
        cache = KVCache(cfg, rt, n_ctx=48, n_slot=2, kv_type=kv_type, v_trans=v_trans)
        try:
            for t in cache.k + cache.v:
                assert not t.raw().any(), t.name
                assert (t.to_float() == 0).all(), t.name
                if t.dtype != toy_ggml.GGMLType.F32:  # the bytes storing float zeros through ggml gives
                    assert toy_ggml.quantize(np.zeros(t.shape, np.float32), t.dtype).tobytes() == t.raw().tobytes()
        finally:
            cache.close()


@pytest.mark.model
def test_string_array_tolist_equals_item_by_item(smollm2_path):
    with GGUFFile(smollm2_path) as gf:
        for key in ("tokenizer.ggml.tokens", "tokenizer.ggml.merges"):
            arr = gf.metadata[key]
            assert isinstance(arr, StringArray)
            fast = arr.tolist()
            assert fast == [arr[i] for i in range(len(arr))]
            assert all(type(s) is str for s in fast)
        vocab = Tokenizer.from_gguf(gf.metadata).vocab
        assert vocab.tokens == list(gf.metadata["tokenizer.ggml.tokens"])


def test_kv_cache_tensors_do_not_overlap():
    cfg = SimpleNamespace(n_layer=3, n_head_kv=2, head_dim=32)
    with toy_ggml.Runtime(toy_ggml.resolve_device("cpu"), threads=1) as rt:
        cache = KVCache(cfg, rt, n_ctx=40, n_slot=2, kv_type="f16", v_trans=True)
        try:
            tensors = cache.k + cache.v
            for i, t in enumerate(tensors):
                t.set_raw(np.full(t.nbytes, i + 1, np.uint8).tobytes())
            for i, t in enumerate(tensors):
                assert (t.raw() == i + 1).all(), t.name
        finally:
            cache.close()


def _split_like_llamacpp(m: str) -> tuple[str, str]:
    pos = m.find(" ", 1)  # the first space after the first character
    return m[:pos], m[pos + 1 :]


@pytest.fixture
def lazy(monkeypatch):
    """Every string array read lazily (as a vocabulary's are), however short."""
    from toy.gguf import reader

    monkeypatch.setattr(reader, "LAZY_STRINGS", 0)


def _tokenizer_gguf(path, tokens, merges, types=None):
    w = GGUFWriter(path)
    w.add("general.architecture", "llama")
    w.add("tokenizer.ggml.model", "gpt2")
    w.add("tokenizer.ggml.pre", "gpt-2")
    w.add("tokenizer.ggml.tokens", tokens)
    w.add("tokenizer.ggml.token_type", types or [1] * len(tokens))
    w.add("tokenizer.ggml.merges", merges)
    return w.write()


def test_merges_split_natively_as_llamacpp_splits_them(tmp_path, lazy):
    merges = ["a b", "é x", "  y", "ab c d", "日本 語", "x  ", "Ġ Ġ"]
    tokens = ["a", "b", "ab", "é", "x", "éx", " ", "y", " y", "c d", "abc d", "日本", "語", "日本語", "x ", "Ġ", "ĠĠ"]
    with GGUFFile(_tokenizer_gguf(tmp_path / "m.gguf", tokens, merges)) as gf:
        arr = gf.metadata["tokenizer.ggml.merges"]
        assert isinstance(arr, StringArray)
        assert arr.pairs() == [_split_like_llamacpp(m) for m in merges]
        assert Tokenizer.from_gguf(gf.metadata).encode("ab", add_special=False) == [tokens.index("ab")]


@pytest.mark.parametrize("bad", ["nospace", "x", " "])
def test_a_merge_without_a_space_is_named(tmp_path, lazy, bad):
    with GGUFFile(_tokenizer_gguf(tmp_path / "m.gguf", ["a", "b", "ab"], ["a b", bad])) as gf:
        assert gf.metadata["tokenizer.ggml.merges"].pairs() == 1
        with pytest.raises(TokenizerError, match=r"merges\[1\]"):
            Tokenizer.from_gguf(gf.metadata)


@pytest.mark.model
def test_real_merges_split_natively(smollm2_path):
    with GGUFFile(smollm2_path) as gf:
        arr = gf.metadata["tokenizer.ggml.merges"]
        assert arr.pairs() == [_split_like_llamacpp(m) for m in arr.tolist()]


def test_merges_whose_parts_are_not_tokens_are_left_out(tmp_path, lazy):
    # "x ." makes "x.", which is no token; "q r" names no tokens at all: the tokenizer drops both, as
    # llama.cpp does, and encodes as without them
    tokens = ["x", ".", "o", "k", "ok", "Ġ", "Ġx"]
    good = ["o k", "Ġ x"]
    with GGUFFile(_tokenizer_gguf(tmp_path / "a.gguf", tokens, good)) as gf:
        want = Tokenizer.from_gguf(gf.metadata).encode(" x.ok x.", add_special=False)
    with GGUFFile(_tokenizer_gguf(tmp_path / "b.gguf", tokens, ["x .", "o k", "q r", "Ġ x"])) as gf:
        assert Tokenizer.from_gguf(gf.metadata).encode(" x.ok x.", add_special=False) == want
    assert want == [tokens.index("Ġx"), 1, 4, 6, 1]


def _pieces_reference(vocab) -> tuple[list[bytes], list[bytes]]:
    """llama.cpp's token_to_piece rules, token by token in Python (what the native pass replaces)."""
    from toy.tokenizer.build import SPM_SPACE, _byte_piece, _gpt2_decode

    rendered, plain = [], []
    for text, attr in zip(vocab.tokens, vocab.attrs):
        if attr & (ATTR_CONTROL | ATTR_UNKNOWN):
            rendered.append(text.encode())
            plain.append(b"")
            continue
        if attr & ATTR_USER_DEFINED:
            piece = text.encode()
        elif attr & ATTR_NORMAL:
            piece = text.replace(SPM_SPACE, " ").encode() if vocab.model == "llama" else _gpt2_decode(text)
        elif attr & ATTR_BYTE:
            piece = _byte_piece(text)
        else:
            piece = b""
        rendered.append(piece)
        plain.append(piece)
    return rendered, plain


@pytest.mark.parametrize("model", ["gpt2", "llama"])
def test_native_pieces_equal_the_rules_token_by_token(model):
    from toy.tokenizer.build import build_pieces

    long = "Ġ" * 700  # longer than the native pass's first scratch buffer
    tokens = [
        "<s>",
        "<unk>",
        "Hi",
        "ĠĠx",
        "▁hello▁",
        "日本",
        "x\u4e00y",
        "ÿĀ",
        "<0x41>",
        "<0xZZ>",
        "<tool>",
        "unused",
        long,
    ]
    #          control unknown  normal...................................................... byte  byte   user  unused normal
    types = [3, 2, 1, 1, 1, 1, 1, 1, 6, 6, 4, 5, 1]
    md = {
        "tokenizer.ggml.model": model,
        "tokenizer.ggml.pre": "gpt-2",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": np.array(types, np.int32),
        "tokenizer.ggml.scores": np.zeros(len(tokens), np.float32),
        "tokenizer.ggml.merges": ["Ġ Ġ"],
    }
    vocab = Vocab.from_gguf(md)
    got = build_pieces(vocab)
    assert got == _pieces_reference(vocab)
    rendered, plain = got
    if model == "gpt2":
        assert rendered[3] == b"  x" and rendered[-1] == b" " * 700
        assert rendered[6].startswith(b"x[UNK_BYTE_0x")  # a character outside the byte alphabet
    else:
        assert rendered[4] == b" hello " and rendered[8] == b"A"
    assert plain[0] == plain[1] == b"" and rendered[0] == b"<s>"
