"""Tokenizers built from GGUF metadata.

Two kinds of reference, never this code's own output:

- the real SmolLM2 vocabulary against llama.cpp itself: every string of
  ``fixtures/smollm2_tokenizer_llamacpp.json`` (recorded with
  llama-cpp-python 0.3.36 by ``tools/fixtures/record_tokenizer.py``) is
  tokenized with special parsing on and off, decoded and split into pieces, and
  compared with what llama.cpp produced;
- tiny hand-made vocabularies (SentencePiece "llama", and byte-level BPE with the
  "llama-bpe", "qwen2" and "gpt-2" pre-tokenizers) whose expected ids are worked
  out by hand from the rules llama.cpp implements; each test says how.
"""

from __future__ import annotations

import base64
import json
from pathlib import Path

import numpy as np
import pytest

from toy.errors import ToyError
from toy.tokenizer import IncrementalDecoder, Tokenizer, TokenizerError
from toy.tokenizer.tokenizer import clean_spaces

REF = json.loads((Path(__file__).parent / "fixtures" / "smollm2_tokenizer_llamacpp.json").read_text("utf-8"))
CASES = REF["cases"]
VARIANTS = ("tokenize_nobos_special", "tokenize_nobos_nospecial", "tokenize_bos_special")


def b64(s: str) -> bytes:
    return base64.b64decode(s)


def case_text(case: dict) -> str:
    text = b64(case["text_b64"]).decode("utf-8")
    assert text == case["text"]
    return text


@pytest.fixture(scope="module")
def smol(smollm2_path) -> Tokenizer:
    return Tokenizer.from_file(smollm2_path)


# --------------------------------------------------------------- llama.cpp parity (SmolLM2)


@pytest.mark.model
@pytest.mark.parametrize("case", CASES, ids=[c["name"] for c in CASES])
def test_encode_matches_llamacpp(smol, case):
    text = case_text(case)
    assert smol.encode(text, special=True) == case["tokenize_nobos_special"]["ids"]
    assert smol.encode(text, special=False) == case["tokenize_nobos_nospecial"]["ids"]
    # llama.cpp's add_special=True adds BOS only when the file says so (add_bos_token = false here)
    assert smol.encode(text, add_special=None, special=True) == case["tokenize_bos_special"]["ids"]


@pytest.mark.model
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("case", CASES, ids=[c["name"] for c in CASES])
def test_decode_and_pieces_match_llamacpp(smol, case, variant):
    ref = case[variant]
    ids = ref["ids"]
    # decode = llama_detokenize(remove_special=False, unparse_special=not skip_special)
    assert smol.decode_bytes(ids) == b64(ref["llama_detokenize_special_b64"])
    assert smol.decode_bytes(ids, skip_special=True) == b64(ref["llama_detokenize_b64"])
    assert smol.decode(ids) == b64(ref["llama_detokenize_special_b64"]).decode("utf-8", errors="replace")
    assert [smol.token_to_piece(i) for i in ids] == [b64(p) for p in ref["pieces_special_b64"]]
    assert [smol.token_to_piece(i, special=False) for i in ids] == [b64(p) for p in ref["pieces_b64"]]


@pytest.mark.model
@pytest.mark.parametrize("case", CASES, ids=[c["name"] for c in CASES])
def test_round_trip_where_llamacpp_round_trips(smol, case):
    text = case_text(case)
    if case["roundtrip_special"]:
        assert smol.decode(smol.encode(text)) == text
    if case["roundtrip_nospecial"]:
        assert smol.decode(smol.encode(text, special=False)) == text


@pytest.mark.model
def test_special_ids_and_flags_match_llamacpp(smol):
    v = REF["vocab"]
    assert smol.vocab_size == v["n_vocab"]
    assert (smol.model, smol.pre) == ("gpt2", "smollm")
    assert smol.bos_id == v["special_ids"]["bos"]
    assert smol.eos_id == v["special_ids"]["eos"]
    assert smol.pad_id == v["special_ids"]["pad"]
    assert smol.eot_id == v["special_ids"]["eot"]
    assert smol.unk_id == v["unk_id_from_metadata"]
    assert (smol.add_bos, smol.add_eos) == (v["add_bos"], v["add_eos"])
    assert smol.eog_ids == frozenset(v["eog_ids"])
    for name, text in v["special_texts"].items():
        i = v["special_ids"][name]
        if i >= 0 and name != "nl":
            assert smol.id_to_token(i) == text
    assert smol.token_to_id(v["special_texts"]["nl"]) == v["special_ids"]["nl"]
    for t in v["non_normal_tokens"]:
        assert smol.id_to_token(t["id"]) == t["text"]
        assert smol.is_control(t["id"]) == t["is_control"]
        assert smol.is_eog(t["id"]) == t["is_eog"]


@pytest.mark.model
def test_longest_pieces_match_llamacpp(smol):
    pieces = [smol.token_to_piece(i) for i in range(smol.vocab_size)]
    assert max(map(len, pieces)) == REF["vocab"]["max_piece_bytes"]
    assert [i for i, p in enumerate(pieces) if len(p) > 32] == REF["vocab"]["ids_with_piece_longer_than_32_bytes"]


def _multibyte_cases() -> list[dict]:
    return [c for c in CASES if any(ord(ch) > 0x7FF for ch in c["text"])]  # emoji, CJK, Indic, …


@pytest.mark.model
@pytest.mark.parametrize("case", _multibyte_cases(), ids=lambda c: c["name"])
def test_incremental_decoding_never_splits_utf8(smol, case):
    ids = case["tokenize_nobos_special"]["ids"]
    dec = smol.incremental_decoder()
    chunks = [dec.feed(i) for i in ids] + [dec.flush()]
    for chunk in chunks:
        chunk.encode("utf-8")  # strict: no lone surrogates
        assert "\ufffd" not in chunk
    assert "".join(chunks) == smol.decode(ids) == case["text"]


@pytest.mark.model
def test_incremental_decoding_holds_back_partial_sequences(smol):
    # some token of the emoji strings carries only part of a character (llama.cpp's
    # pieces show it): the decoder must emit "" for it and the character later
    split = [
        c
        for c in _multibyte_cases()
        if any(_invalid_utf8(b64(p)) for p in c["tokenize_nobos_special"]["pieces_special_b64"])
    ]
    assert split, "the fixture should hold strings whose tokens split a character"
    ids = split[0]["tokenize_nobos_special"]["ids"]
    dec = IncrementalDecoder(smol)
    assert "" in [dec.feed(i) for i in ids]


def _invalid_utf8(b: bytes) -> bool:
    try:
        b.decode("utf-8")
        return False
    except UnicodeDecodeError:
        return True


@pytest.mark.model
def test_chat_rendering_tokenizes_like_llamacpp(smol):
    for r in REF["chat_template"]["renderings"]:
        assert smol.encode(r["jinja2_chat_formatter"]) == r["tokens_jinja2_chat_formatter"]
        assert smol.encode(r["llama_chat_apply_template_model"]) == r["tokens_llama_chat_apply_template_model"]


@pytest.mark.model
def test_bad_ids_and_text_raise(smol):
    with pytest.raises(TokenizerError, match="out of range"):
        smol.decode([1, smol.vocab_size])
    with pytest.raises(TokenizerError, match="out of range"):
        smol.token_to_piece(-1)
    with pytest.raises(TokenizerError, match="integer"):
        smol.decode([1.5])
    with pytest.raises(TokenizerError, match="str"):
        smol.encode(b"bytes")
    with pytest.raises(TokenizerError):
        smol.encode("lone surrogate \ud800")
    assert smol.decode(np.array([19556, 17], dtype=np.int32)) == smol.decode([19556, 17])
    assert smol.encode_batch(["Hello!", "<|im_end|>"]) == [smol.encode("Hello!"), smol.encode("<|im_end|>")]


# --------------------------------------------------------------- SentencePiece BPE ("llama")

SPM_VOCAB = [
    # (text, token type, score); types: 1 normal, 2 unknown, 3 control, 6 byte
    ("<unk>", 2, 0.0),  # 0
    ("<s>", 3, 0.0),  # 1
    ("</s>", 3, 0.0),  # 2
    ("<0x0A>", 6, 0.0),  # 3  "\n"
    ("<0x3C>", 6, 0.0),  # 4  "<"
    ("<0x3E>", 6, 0.0),  # 5  ">"
    ("<0xC3>", 6, 0.0),  # 6  first byte of "é"
    ("<0xA9>", 6, 0.0),  # 7  second byte of "é"
    ("\u2581", 1, -100.0),  # 8  "▁"
    ("a", 1, -100.0),  # 9
    ("b", 1, -100.0),  # 10
    ("c", 1, -100.0),  # 11
    ("s", 1, -100.0),  # 12
    ("h", 1, -100.0),  # 13
    ("i", 1, -100.0),  # 14
    ("ab", 1, -10.0),  # 15
    ("bc", 1, -1.0),  # 16  scores higher than "ab": merged first
    ("\u2581h", 1, -5.0),  # 17
    ("\u2581hi", 1, -3.0),  # 18
    ("hi", 1, -2.0),  # 19
]


def spm_metadata(**extra) -> dict:
    md = {
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.tokens": [t for t, _, _ in SPM_VOCAB],
        "tokenizer.ggml.token_type": np.array([k for _, k, _ in SPM_VOCAB], dtype=np.int32),
        "tokenizer.ggml.scores": np.array([s for _, _, s in SPM_VOCAB], dtype=np.float32),
    }
    md.update(extra)
    return md


@pytest.fixture(scope="module")
def spm() -> Tokenizer:
    # no special ids in the metadata: llama.cpp's defaults for "llama" are bos=1, eos=2, unk=0
    return Tokenizer.from_gguf(spm_metadata())


def test_spm_defaults(spm):
    assert (spm.bos_id, spm.eos_id, spm.unk_id, spm.pad_id) == (1, 2, 0, None)
    assert (spm.add_bos, spm.add_eos) == (True, False)  # llama.cpp's SPM defaults
    assert spm.eog_ids == {2}  # eos, also "</s>" by text


def test_spm_merges_by_score_not_position(spm):
    # "abc" -> "▁abc" (space prefix) -> symbols ▁ a b c. Pairs in the vocabulary:
    # ab (-10) and bc (-1). llama.cpp merges the highest score first: bc. Then
    # "abc" and "▁a" are not tokens: done. -> ▁ a bc = 8 9 16 (left-first would give ab c).
    assert spm.encode("abc", add_special=False) == [8, 9, 16]


def test_spm_space_prefix_and_nested_merges(spm):
    # "hi abc" -> "▁hi▁abc": pairs ▁h (-5), hi (-2), ab (-10), bc (-1). Order: bc, hi,
    # then ▁+hi = "▁hi" (-3); "▁a", "abc", "hi▁" are not tokens.
    # -> ▁hi ▁ a bc = 18 8 9 16; the file's add_bos (default true for llama) puts BOS 1 first.
    assert spm.encode("hi abc", add_special=False) == [18, 8, 9, 16]
    assert spm.encode("hi abc") == [1, 18, 8, 9, 16]
    assert spm.encode("hi abc", add_special=True) == [1, 18, 8, 9, 16, 2]


def test_spm_byte_fallback(spm):
    # "é\n" -> "▁é\n": "é" and "\n" are not tokens -> their UTF-8 bytes as <0xXX> tokens:
    # ▁ <0xC3> <0xA9> <0x0A> = 8 6 7 3
    assert spm.encode("é\n", add_special=False) == [8, 6, 7, 3]


def test_spm_special_tokens_in_text(spm):
    # special=True: "<s>" is a control token; the text after it is a new fragment and
    # llama.cpp prefixes it with a space too: <s> ▁hi = 1 18.
    assert spm.encode("<s>hi", add_special=False) == [1, 18]
    # special=False: "▁<s>hi" is plain text; "<" and ">" are not tokens (bytes 4, 5),
    # "s" is 12, and "hi" merges: ▁ <0x3C> s <0x3E> hi = 8 4 12 5 19.
    assert spm.encode("<s>hi", add_special=False, special=False) == [8, 4, 12, 5, 19]


def test_spm_decode(spm):
    # pieces: ▁ -> " ", bytes -> their byte, control -> its text (or nothing when skipped);
    # add_space_prefix: the first token loses one leading space (llama_detokenize's lstrip).
    assert spm.decode([18, 8, 9, 16]) == "hi abc"
    assert spm.decode([1, 18, 8, 9, 16]) == "<s> hi abc"  # first piece "<s>": nothing to strip
    assert spm.decode([1, 18, 8, 9, 16], skip_special=True) == " hi abc"  # the empty BOS piece took the strip
    assert spm.decode([8, 6, 7, 3]) == "é\n"
    assert spm.token_to_piece(6) == b"\xc3"
    assert spm.token_to_piece(18) == b" hi"
    assert spm.token_to_piece(1) == b"<s>"
    assert spm.token_to_piece(1, special=False) == b""
    dec = spm.incremental_decoder()
    assert [dec.feed(i) for i in (8, 6, 7, 3)] == ["", "", "é", "\n"]
    assert dec.flush() == ""


def test_spm_without_space_prefix():
    tok = Tokenizer.from_gguf(spm_metadata(**{"tokenizer.ggml.add_space_prefix": False}))
    # "abc": a b c -> bc first -> a bc = 9 16; nothing is stripped when decoding
    assert tok.encode("abc", add_special=False) == [9, 16]
    assert tok.decode([8, 9]) == " a"


def test_spm_needs_scores():
    md = spm_metadata()
    del md["tokenizer.ggml.scores"]
    with pytest.raises(TokenizerError, match="scores"):
        Tokenizer.from_gguf(md)


# --------------------------------------------------------------- byte-level BPE pre-tokenizers

# Byte-level alphabet: "Ġ" is the space byte, "Ċ" the newline byte (GPT-2's byte map).
BPE_TOKENS = [
    "<|endoftext|>",  # 0 control
    "<|begin_of_text|>",  # 1 control
    *["H", "i", "Ġ", "1", "2", "3", "4", "5", "x", ".", "o", "k", "Ċ", "Y", "e", "s", "'", "S"],  # 2..19
    "Hi",  # 20
    "12",  # 21
    "123",  # 22
    "45",  # 23
    "Ġx",  # 24
    "ok",  # 25
    ".ok",  # 26 in the vocabulary, but no merge builds it
    "ĊĊ",  # 27
    "Ye",  # 28
    "Yes",  # 29
    "'S",  # 30
    "34",  # 31
    "<tool>",  # 32 user-defined
]
BPE_TYPES = [3, 3] + [1] * 30 + [4]
BPE_MERGES = ["H i", "1 2", "12 3", "3 4", "4 5", "Ġ x", "o k", "Ċ Ċ", "Y e", "Ye s", "' S"]  # rank = position
TEXT = "Hi 12345 x.ok\n\nYes'S"


def bpe_metadata(pre: str, **extra) -> dict:
    md = {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": pre,
        "tokenizer.ggml.tokens": BPE_TOKENS,
        "tokenizer.ggml.token_type": np.array(BPE_TYPES, dtype=np.int32),
        "tokenizer.ggml.merges": BPE_MERGES,
        "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 0,
    }
    md.update(extra)
    return md


def test_llama3_pre_tokenizer():
    tok = Tokenizer.from_gguf(bpe_metadata("llama-bpe"))
    # llama3 regex, leftmost match, first alternative that matches:
    #   "Hi" (letters) | " " (a space before a digit: only \s+ matches) | "123" "45" (\p{N}{1,3})
    #   | " x" (one non-letter may lead letters) | ".ok" (same rule) | "\n\n" (\s*[\r\n]+)
    #   | "Yes" | "'S" (contractions are case-insensitive)
    # ignore_merges (llama3): a piece that is a token is taken whole, so ".ok" -> 26 although
    # no merge builds it. Hi=20 Ġ=4 123=22 45=23 Ġx=24 .ok=26 ĊĊ=27 Yes=29 'S=30.
    expected = [20, 4, 22, 23, 24, 26, 27, 29, 30]
    assert tok.encode(TEXT, add_special=False) == expected
    assert tok.add_bos  # llama.cpp turns add_bos on for the llama3 family unless the file says otherwise
    assert tok.encode(TEXT) == [1, *expected]
    # clean_spaces (on for llama3): llama_detokenize drops the space before "." -> "Hi."
    assert tok.decode([20, 4, 11]) == "Hi."


def test_qwen2_pre_tokenizer():
    tok = Tokenizer.from_gguf(bpe_metadata("qwen2"))
    # qwen2 = llama3 with single digits: "1" "2" "3" "4" "5" are separate pieces (5..9), and
    # no ignore_merges: ".ok" runs the merges: . o k -> (o k) -> "." "ok" = 11 25.
    expected = [20, 4, 5, 6, 7, 8, 9, 24, 11, 25, 27, 29, 30]
    assert tok.encode(TEXT, add_special=False) == expected
    assert not tok.add_bos and tok.encode(TEXT) == expected
    assert tok.decode([20, 4, 11]) == "Hi ."  # qwen2 keeps spaces (clean_spaces off)


def test_gpt2_pre_tokenizer():
    tok = Tokenizer.from_gguf(bpe_metadata("gpt-2"))
    # GPT-2 regex: "Hi" | " 12345" ( ?\p{N}+) | " x" | "." | "ok" | "\n" "\n" (\s+(?!\S) leaves
    # the last newline, then \s+) | "Yes" | "'" "S" (contractions are lowercase only).
    # " 12345" -> Ġ 1 2 3 4 5, merges by rank: (1 2) r1, (12 3) r2, (4 5) r4 -> Ġ 123 45.
    expected = [20, 4, 22, 23, 24, 11, 25, 14, 14, 29, 18, 19]
    assert tok.encode(TEXT, add_special=False) == expected


def test_bpe_special_and_user_defined_tokens():
    tok = Tokenizer.from_gguf(bpe_metadata("qwen2"))
    # control tokens match only with special=True; user-defined ones always (llama.cpp's
    # tokenizer_st_partition skips only control/unknown tokens when parse_special is false)
    assert tok.encode("Hi<|endoftext|>", add_special=False) == [20, 0]
    assert tok.encode("Hi<tool>", add_special=False, special=False) == [20, 32]
    assert tok.token_to_piece(32, special=False) == b"<tool>"
    assert tok.token_to_piece(0, special=False) == b""
    assert tok.decode([20, 0, 32], skip_special=True) == "Hi<tool>"
    assert tok.eog_ids == {0}  # eos, also "<|endoftext|>" by text


def test_clean_spaces_port():
    # llama_detokenize's three passes: " ?!.," lose their space; " ' " -> "'"; " 's", " 'm",
    # " 're", " 've" lose their space, " 't", " 'd", " 'll" keep it.
    assert clean_spaces(b"Hi , you ! ok .") == b"Hi, you! ok."
    assert clean_spaces(b"a ' b") == b"a'b"
    assert (
        clean_spaces(b"it 's I 'm we 're they 've don 't I 'd we 'll") == b"it's I'm we're they've don 't I 'd we 'll"
    )
    assert clean_spaces(b"") == b""


# --------------------------------------------------------------- errors


@pytest.mark.parametrize("model", ["bert", "t5", "rwkv", "no_vocab"])
def test_unsupported_model(model):
    with pytest.raises(TokenizerError) as e:
        Tokenizer.from_gguf({"tokenizer.ggml.model": model, "tokenizer.ggml.tokens": ["a", "b"]})
    assert repr(model) in str(e.value) and "gpt2" in str(e.value) and "llama" in str(e.value)
    assert isinstance(e.value, ToyError)


def test_unknown_pre_tokenizer():
    with pytest.raises(TokenizerError, match="'no-such-pre'") as e:
        Tokenizer.from_gguf(bpe_metadata("no-such-pre"))
    assert "llama-bpe" in e.value.hint and "qwen2" in e.value.hint


@pytest.mark.parametrize(
    "change, match",
    [
        ({"tokenizer.ggml.model": None}, "no tokenizer"),
        ({"tokenizer.ggml.tokens": None}, "tokens is missing"),
        ({"tokenizer.ggml.tokens": "abc"}, "not an array of strings"),
        ({"tokenizer.ggml.tokens": ["a", "a"]}, "more than once"),
        ({"tokenizer.ggml.merges": None}, "merges"),
        ({"tokenizer.ggml.merges": ["nospace"]}, "merges\\[0\\]"),
        ({"tokenizer.ggml.token_type": np.array([1], dtype=np.int32)}, "token_type has 1 entries"),
        ({"tokenizer.ggml.bos_token_id": "1"}, "not an integer"),
        ({"tokenizer.ggml.add_bos_token": True, "tokenizer.ggml.bos_token_id": None}, "no BOS"),
    ],
)
def test_bad_metadata(change, match):
    md = {k: v for k, v in {**bpe_metadata("qwen2"), **change}.items() if v is not None}
    with pytest.raises(TokenizerError, match=match):
        Tokenizer.from_gguf(md)
