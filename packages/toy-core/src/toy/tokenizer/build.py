"""Build an HF ``tokenizers.Tokenizer`` and the piece tables from a ``Vocab``.

Nothing is downloaded and no file is written: the tokenizer is assembled from
the GGUF vocabulary alone.

- ``gpt2`` (byte-level BPE): the GGUF tokens are already in GPT-2's
  byte-to-unicode alphabet and the merges are ranked pairs, so they feed
  ``models.BPE`` directly. The pre-tokenizer is the llama.cpp regex list for
  ``tokenizer.ggml.pre`` (``toy.tokenizer.pretok``) followed by the byte-level
  mapping.
- ``llama`` (SentencePiece-style BPE): spaces become ``▁``, one ``▁`` is
  prepended to every text fragment when ``add_space_prefix`` (llama.cpp adds it
  to the first fragment and to every fragment after a special token), and a
  character that is not in the vocabulary falls back to ``<0xXX>`` byte tokens.
  llama.cpp merges the adjacent pair whose concatenation is the vocabulary entry
  with the highest score; the same result comes from BPE merges ranked by the
  merged token's score, generated here from every split of every token whose
  two halves are both tokens.
- control and unknown tokens become *special* added tokens (matched in text
  only when special parsing is on); user-defined tokens become plain added
  tokens, matched always, as in llama.cpp.

Piece tables (``token_to_piece``) follow ``llama_vocab::token_to_piece``: byte
tokens give their byte, normal tokens their text decoded (GPT-2 alphabet back to
bytes, or ``▁`` back to a space), control/unknown tokens their text only when
special tokens are rendered, user-defined tokens always their text, unused and
undefined tokens nothing.

Known, documented differences from llama.cpp, none reachable with the vocabularies
toy ships: equal-score SentencePiece merges are ordered by token id instead of by
position; a merge whose halves or result are not tokens is dropped; two special
tokens that overlap in the text are matched leftmost-longest.
"""

from __future__ import annotations

import re

import numpy as np
from tokenizers import AddedToken, decoders, models, normalizers
from tokenizers import Tokenizer as HFTokenizer

from toy._native.pieces import build_pieces as native_pieces
from toy.tokenizer.vocab import (
    ATTR_BYTE,
    ATTR_CONTROL,
    ATTR_NORMAL,
    ATTR_UNKNOWN,
    ATTR_USER_DEFINED,
    TokenizerError,
    Vocab,
)

SPM_SPACE = "\u2581"  # "▁", SentencePiece's visible space
_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def gpt2_byte_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map: printable Latin-1
    bytes map to themselves, the other 68 bytes to U+0100.. in byte order."""
    keep = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    table = {b: chr(b) for b in keep}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(0x100 + extra)
            extra += 1
    return table


_BYTE_TO_UNICODE = gpt2_byte_to_unicode()
# str.translate table: alphabet character -> the Latin-1 character of its byte.
# Latin-1 characters outside the alphabet map to U+FFFF so that .encode("latin-1")
# fails and the slow path reproduces llama.cpp's "[UNK_BYTE_0x..]" text.
_UNICODE_TO_LATIN1 = {ord(c): chr(b) for b, c in _BYTE_TO_UNICODE.items()}
for _b in range(256):
    _UNICODE_TO_LATIN1.setdefault(_b, "\uffff")


# code point -> byte for the alphabet's characters, -1 for every other one (the last entry
# stands for all code points past the table)
_ALPHABET_BYTE = np.full(max(map(ord, _BYTE_TO_UNICODE.values())) + 2, -1, np.int16)
for _b, _c in _BYTE_TO_UNICODE.items():
    _ALPHABET_BYTE[ord(_c)] = _b


def _gpt2_decode(text: str) -> bytes:
    try:
        return text.translate(_UNICODE_TO_LATIN1).encode("latin-1")
    except UnicodeEncodeError:
        pass
    out = bytearray()  # llama_decode_text: unknown characters become a visible marker
    for ch in text:
        b = _UNICODE_TO_LATIN1.get(ord(ch))
        if b is not None and b != "\uffff":
            out += b.encode("latin-1")
        else:
            out += b"[UNK_BYTE_0x" + ch.encode("utf-8").hex().encode() + text.encode("utf-8") + b"]"
    return bytes(out)


def _spm_piece(text: str) -> bytes:
    return text.replace(SPM_SPACE, " ").encode("utf-8")


def _byte_piece(text: str) -> bytes:
    m = _BYTE_TOKEN.fullmatch(text)
    return bytes([int(m.group(1), 16)]) if m else text.encode("utf-8")


def build_pieces(vocab: Vocab) -> tuple[list[bytes], list[bytes]]:
    """(pieces with special tokens rendered, pieces with control/unknown tokens
    empty), indexed by token id. Control and unknown tokens render as their
    text; user-defined ones as their text; normal ones through the model's
    alphabet (byte-level: each character one byte; SentencePiece: ``▁`` is a
    space); byte tokens ``<0xAB>`` as their byte; unused/undefined ones as
    nothing (llama.cpp's ``token_to_piece``). One native pass
    (``toy._native.pieces``)."""
    return native_pieces(
        vocab.tokens,
        vocab.attrs,
        vocab.model != "llama",
        _ALPHABET_BYTE,
        ATTR_CONTROL | ATTR_UNKNOWN,
        ATTR_USER_DEFINED,
        ATTR_NORMAL,
        ATTR_BYTE,
        _spm_piece,
        _byte_piece,
        _gpt2_decode,
    )


def _spm_merges(vocab: Vocab, ids: dict[str, int]) -> list[tuple[str, str]]:
    """Merges for a SentencePiece vocabulary: every (left, right) split of a
    token into two tokens, ranked by the merged token's score (highest first),
    ties by token id."""
    assert vocab.scores is not None
    scores = vocab.scores.tolist()
    ranked: list[tuple[float, int, int, str, str]] = []
    for tid, text in enumerate(vocab.tokens):
        if len(text) < 2:
            continue
        for cut in range(1, len(text)):
            left, right = text[:cut], text[cut:]
            if left in ids and right in ids:
                ranked.append((-scores[tid], tid, cut, left, right))
    ranked.sort()
    return [(left, right) for _, _, _, left, right in ranked]


def _gpt2_merges(vocab: Vocab, ids: dict[str, int]) -> list[tuple[str, str]]:
    return [(a, b) for a, b in vocab.merges if a in ids and b in ids and (a + b) in ids]


def build_hf_tokenizer(vocab: Vocab) -> HFTokenizer:
    """The HF tokenizer for ``vocab`` with special tokens parsed in text; set
    ``encode_special_tokens = True`` on a copy for plain-text parsing."""
    ids = vocab.ids if vocab.ids is not None else {t: i for i, t in enumerate(vocab.tokens)}
    try:
        if vocab.model == "gpt2":
            spec = vocab.pre_spec
            assert spec is not None
            try:  # a well-formed file: every merge's parts and result are tokens
                model = models.BPE(vocab=ids, merges=vocab.merges, ignore_merges=spec.ignore_merges)
            except Exception:  # the BPE refuses the others: leave them out, as llama.cpp ignores them
                model = models.BPE(vocab=ids, merges=_gpt2_merges(vocab, ids), ignore_merges=spec.ignore_merges)
            tok = HFTokenizer(model)
            tok.pre_tokenizer = spec.build()
            tok.decoder = decoders.ByteLevel()
        else:
            unk = vocab.special["unk"]
            model = models.BPE(
                vocab=ids,
                merges=_spm_merges(vocab, ids),
                unk_token=vocab.tokens[unk] if unk is not None else None,
                byte_fallback=True,
                fuse_unk=False,
            )
            tok = HFTokenizer(model)
            steps = [normalizers.Replace(" ", SPM_SPACE)]
            if vocab.add_space_prefix:
                steps.insert(0, normalizers.Prepend(SPM_SPACE))
            tok.normalizer = normalizers.Sequence(steps)
            tok.decoder = decoders.Sequence(
                [decoders.Replace(SPM_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
            )
        special, user = [], []
        for t, a in zip(vocab.tokens, vocab.attrs):
            if a & (ATTR_CONTROL | ATTR_UNKNOWN):
                special.append(AddedToken(t, special=True, normalized=False))
            elif a & ATTR_USER_DEFINED:
                user.append(AddedToken(t, special=False, normalized=False))
        if special:
            tok.add_special_tokens(special)
        if user:
            tok.add_tokens(user)
    except TokenizerError:
        raise
    except Exception as e:  # tokenizers raises plain Exception subclasses
        raise TokenizerError(f"cannot build the {vocab.model!r} tokenizer: {e}") from e
    return tok
