"""Cutting long text into pieces that tokenize to the same ids as the whole.

HF ``tokenizers`` needs about 140 bytes of memory per character of one text it
encodes (offsets, alignments and pre-token strings are kept per byte), so a
20 MB text costs ~2.8 GB. ``Tokenizer`` therefore encodes a text longer than
``PIECE_CHARS`` characters in pieces, a few at a time, cut where no token can
cross:

- before a space that sits between two printable non-space ASCII characters
  (``"word| next"``): every pre-tokenizer regex of the byte-level BPE families
  toy reads (``toy.tokenizer.pretok``) ends a piece after the character and
  starts the next one with the space, and none of their look-aheads reaches
  across;
- after a newline with printable ASCII on both sides, or before a line break
  (LF or CRLF) that follows an ASCII letter or digit (``toy.corpus``'s rule
  for training files).

The pieces' ids, concatenated, are the whole text's. Exactness caveats,
documented in docs/guide/tokenizers.md: a stretch of ``MAX_SCAN_CHARS`` characters
without such a point (one huge word, base64) is cut at a character boundary
instead, where the ids may differ from the whole text's (that bounds memory);
SentencePiece-style ("llama") vocabularies add a space prefix to every text
they encode and tokenizers with an added token that holds whitespace could
match across a cut, so ``splittable`` says no for those and they encode a
text whole.

Invariants: ``cut_pieces`` gives pieces whose concatenation is the text, each
non-empty; nothing here calls the tokenizer.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

#: a text longer than this (characters) is encoded in pieces of about this size
PIECE_CHARS = 1 << 16
#: the longest stretch searched for a safe cut before cutting anyway
MAX_SCAN_CHARS = 1 << 20
#: characters handed to one batch encode of pieces
BATCH_CHARS = 1 << 18


def splittable(model: str, added_tokens: Iterable[str]) -> bool:
    """Whether texts of this vocabulary may be cut at the safe points (module docstring)."""
    return model == "gpt2" and not any(any(c.isspace() for c in t) for t in added_tokens)


def _printable(c: str) -> bool:
    return "!" <= c <= "~"


def _alnum(c: str) -> bool:
    return c.isascii() and c.isalnum()


def safe_cut(text: str, lo: int, hi: int) -> int:
    """The last safe cut point ``p`` with ``lo < p <= hi`` (``0 < p < len(text)``), or -1."""
    hi = min(hi, len(text) - 2)
    sp, nl = text.rfind(" ", lo + 1, hi + 1), text.rfind("\n", lo, hi + 1)
    while max(sp, nl) > lo:
        if sp > nl:  # a space at sp: the cut goes before it
            if _printable(text[sp - 1]) and _printable(text[sp + 1]):
                return sp
            sp = text.rfind(" ", lo + 1, sp)
            continue
        i = nl
        before = text[i - 1]
        if i + 1 <= hi and _printable(before) and _printable(text[i + 1]):
            return i + 1
        j = i - 1 if before == "\r" else i
        if j > lo and _alnum(text[j - 1]):
            return j
        nl = text.rfind("\n", lo, i)
    return -1


def _next_cut(text: str, start: int, piece: int, scan: int) -> int:
    """Where the piece that starts at ``start`` ends (len(text) at the end)."""
    if len(text) - start <= piece:
        return len(text)
    cut = safe_cut(text, start, start + piece)
    if cut > start:
        return cut
    end = min(len(text), start + scan)  # no safe point in the first piece: look further, up to the bound
    pos = start + piece
    while pos < end:
        cut = safe_cut(text, pos, min(end, pos + piece))
        if cut > start:
            return cut
        pos += piece
    return end  # a cut at a character boundary (the caveat)


def cut_pieces(text: str, piece: int = PIECE_CHARS, scan: int = MAX_SCAN_CHARS) -> Iterator[str]:
    """``text`` in pieces of about ``piece`` characters, cut at safe points (see the module docstring)."""
    start = 0
    while start < len(text):
        end = _next_cut(text, start, piece, scan)
        yield text[start:end]
        start = end


def batches(pieces: Iterable[str], chars: int = BATCH_CHARS) -> Iterator[list[str]]:
    """Consecutive runs of ``pieces`` holding about ``chars`` characters each."""
    run: list[str] = []
    size = 0
    for p in pieces:
        if run and size + len(p) > chars:
            yield run
            run, size = [], 0
        run.append(p)
        size += len(p)
    if run:
        yield run


__all__ = ["BATCH_CHARS", "MAX_SCAN_CHARS", "PIECE_CHARS", "batches", "cut_pieces", "safe_cut", "splittable"]
