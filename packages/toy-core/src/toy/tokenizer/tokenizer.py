"""``Tokenizer``: text <-> token ids for a GGUF model, with llama.cpp's semantics.

Built from GGUF metadata alone (``Tokenizer.from_gguf(metadata)`` or
``Tokenizer.from_file(path)``): ``toy.tokenizer.vocab`` reads and checks the
vocabulary, ``toy.tokenizer.build`` assembles an HF ``tokenizers`` pipeline for
encoding; decoding is done here from per-token byte pieces so that it matches
``llama_detokenize`` byte for byte.

Semantics (each mirrors llama.cpp):

- ``encode(text, add_special=None, special=True)``: ``special`` parses control
  tokens written in the text (``"<|im_start|>"`` -> one id); with
  ``special=False`` they are plain text. User-defined tokens always match.
  ``add_special`` adds BOS/EOS as the file's ``add_bos_token`` /
  ``add_eos_token`` say (None) or forces them on/off.
- ``decode(ids, skip_special=False)`` = ``llama_detokenize(ids,
  remove_special=False, unparse_special=not skip_special)``: control tokens
  render as their text unless ``skip_special``; with ``add_space_prefix`` the
  first token loses one leading space; the BPE families that llama.cpp marks
  ``clean_spaces`` get its space clean-up. Bytes that are not valid UTF-8 come
  out as U+FFFD; ``decode_bytes`` returns the raw bytes.
- ``token_to_piece(id, special=True)`` = ``llama_token_to_piece(id, lstrip=0,
  special)``: the token's bytes, which may be part of a UTF-8 sequence.
- ``special_spans(text)``: where ``encode(text, special=True)`` matches control
  tokens; ``encode_protected(text, plain_spans)``: ``encode`` with the control
  tokens overlapping ``plain_spans`` left as text (the chat injection rule of
  ``toy.tokenizer.chat``). It cuts at the other control tokens and encodes the
  pieces as plain text, which are the fragments ``encode`` itself tokenizes
  one at a time (a space prefix goes on every fragment, as in llama.cpp), so
  without spans to protect the ids are ``encode``'s.
- Long text (over ``toy.tokenizer.longtext.PIECE_CHARS`` characters) is
  encoded in pieces cut where no token can cross, a few pieces at a time, so
  memory stays bounded (HF ``tokenizers`` needs ~140 bytes per character of
  one text); the ids equal the whole text's, with the caveats that module
  states. ``encode_array`` returns the ids as an int32 array (no list of
  Python ints for a 20 MB text).
- ``IncrementalDecoder``: feed ids one at a time, get text that never splits a
  UTF-8 sequence; the concatenation of all chunks plus ``flush()`` equals
  ``decode`` for tokenizers without ``clean_spaces`` (llama.cpp streams raw
  pieces too and only cleans in ``llama_detokenize``).

Invariants: a ``Tokenizer`` is immutable after construction and safe to share
between threads (the plain-text copy of the HF tokenizer is built once, under a
lock, on first use); ids outside ``[0, vocab_size)`` raise ``TokenizerError``.
"""

from __future__ import annotations

import codecs
import dataclasses
import gc
import operator
import os
import threading
from collections.abc import Generator, Iterable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np
from tokenizers import Tokenizer as HFTokenizer

from toy.gguf import GGUFFile
from toy.tokenizer.build import build_hf_tokenizer, build_pieces
from toy.tokenizer.longtext import BATCH_CHARS, MAX_SCAN_CHARS, PIECE_CHARS, batches, cut_pieces, safe_cut, splittable
from toy.tokenizer.vocab import ATTR_CONTROL, ATTR_UNKNOWN, ATTR_USER_DEFINED, TokenizerError, Vocab


class Tokenizer:
    """Encode and decode with the vocabulary of a GGUF model."""

    def __init__(self, vocab: Vocab):
        self._hf = build_hf_tokenizer(vocab)
        # the HF model holds the merges and the text -> id map now; the Python copies
        # (~8 MB and ~5 MB for a 49k vocabulary) are not needed again (GGUF writers copy the file's metadata)
        slim = vocab.merges or vocab.ids is not None
        self.vocab = dataclasses.replace(vocab, merges=[], ids=None) if slim else vocab
        self._hf_plain: HFTokenizer | None = None
        self._lock = threading.Lock()
        self._pieces, self._pieces_plain = build_pieces(vocab)
        mask = ATTR_CONTROL | ATTR_UNKNOWN
        self._control = frozenset(i for i, a in enumerate(vocab.attrs) if a & mask)  # the special added tokens
        added = (vocab.tokens[i] for i, a in enumerate(vocab.attrs) if a & (mask | ATTR_USER_DEFINED))
        self._splittable = splittable(vocab.model, added)  # long text may be encoded in pieces

    @classmethod
    def from_gguf(cls, metadata: Mapping[str, Any]) -> Tokenizer:
        """From the metadata dict of a GGUF file (``GGUFFile.metadata``)."""
        # ~250k strings and tuples are made here and none is garbage: the cyclic
        # collector would only rescan them as they pile up (~10-20 ms of a load)
        paused = gc.isenabled()
        gc.disable()
        try:
            return cls(Vocab.from_gguf(metadata))
        finally:
            if paused:
                gc.enable()

    @classmethod
    def from_file(cls, path: str | os.PathLike[str]) -> Tokenizer:
        """From a GGUF file on disk (reads the metadata only)."""
        with GGUFFile(path) as f:
            return cls.from_gguf(f.metadata)

    # -- facts ---------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        return self.vocab.n_tokens

    @property
    def model(self) -> str:
        """``tokenizer.ggml.model``: "gpt2" or "llama"."""
        return self.vocab.model

    @property
    def pre(self) -> str | None:
        """``tokenizer.ggml.pre`` (None for "llama", or when the file has none)."""
        return self.vocab.pre

    bos_id = property(lambda self: self.vocab.special["bos"], doc="BOS id or None.")
    eos_id = property(lambda self: self.vocab.special["eos"], doc="EOS id or None.")
    unk_id = property(lambda self: self.vocab.special["unk"], doc="Unknown-token id or None.")
    pad_id = property(lambda self: self.vocab.special["pad"], doc="Padding id or None.")
    eot_id = property(lambda self: self.vocab.special["eot"], doc="End-of-turn id or None.")
    add_bos = property(lambda self: self.vocab.add_bos, doc="Whether encode adds BOS by default.")
    add_eos = property(lambda self: self.vocab.add_eos, doc="Whether encode adds EOS by default.")

    @property
    def eog_ids(self) -> frozenset[int]:
        """Ids that end generation (eos, eot, eom, FIM pad/repo/sep, and the
        tokens llama.cpp recognises by text such as ``<|im_end|>``)."""
        return self.vocab.eog_ids

    def is_eog(self, token_id: int) -> bool:
        return token_id in self.vocab.eog_ids

    def is_control(self, token_id: int) -> bool:
        """True for control and unknown tokens (rendered only with special)."""
        return bool(self.vocab.attrs[self._check_id(token_id)] & (ATTR_CONTROL | ATTR_UNKNOWN))

    def id_to_token(self, token_id: int) -> str:
        """The vocabulary entry as stored in the file (GPT-2 alphabet, ``▁``)."""
        return self.vocab.tokens[self._check_id(token_id)]

    def token_to_id(self, token: str) -> int | None:
        token_id: int | None = self._hf.token_to_id(token)
        return token_id

    @property
    def hf(self) -> HFTokenizer:
        """The underlying HF tokenizer (special tokens parsed). Treat as read-only."""
        return self._hf

    # -- encode --------------------------------------------------------------

    def _encoder(self, special: bool) -> HFTokenizer:
        if special:
            return self._hf
        if self._hf_plain is None:
            with self._lock:
                if self._hf_plain is None:
                    plain = HFTokenizer.from_str(self._hf.to_str())
                    plain.encode_special_tokens = True  # control tokens in text stay text
                    self._hf_plain = plain
        return self._hf_plain

    def _ends(self, add_special: bool | None) -> tuple[list[int], list[int]]:
        """The ids ``add_special`` puts before and after a text's."""
        add_bos = self.vocab.add_bos if add_special is None else add_special
        add_eos = self.vocab.add_eos if add_special is None else add_special
        head = [self.bos_id] if add_bos and self.bos_id is not None else []
        return head, [self.eos_id] if add_eos and self.eos_id is not None else []

    def _wrap(self, ids: list[int], add_special: bool | None) -> list[int]:
        head, tail = self._ends(add_special)
        if head:
            ids.insert(0, head[0])
        ids += tail
        return ids

    def encode(self, text: str, add_special: bool | None = None, special: bool = True) -> list[int]:
        """Token ids for ``text``. ``add_special``: None = the file's
        add_bos/add_eos flags, True/False = add BOS and EOS or not.
        ``special``: parse control tokens written in the text."""
        if not isinstance(text, str):
            raise TokenizerError(f"encode() takes a str, not {type(text).__name__}")
        if len(text) > PIECE_CHARS:
            return self._wrap(self._encode_long(self._encoder(special), text).tolist(), add_special)
        try:
            # encode_batch_fast skips the offset bookkeeping encode() does (~30% faster on long text)
            ids = _encode_many(self._encoder(special), [text])[0].ids
        except Exception as e:  # e.g. a lone surrogate cannot cross into Rust
            raise TokenizerError(f"cannot tokenize the text: {e}") from e
        return self._wrap(ids, add_special)

    def encode_array(self, text: str, add_special: bool | None = None, special: bool = True) -> np.ndarray:
        """``encode`` as an int32 array: the ids of a long text never become a list of Python ints."""
        if not isinstance(text, str):
            raise TokenizerError(f"encode_array() takes a str, not {type(text).__name__}")
        if len(text) <= PIECE_CHARS:
            return np.asarray(self.encode(text, add_special, special), np.int32)
        ids = self._encode_long(self._encoder(special), text)
        head, tail = self._ends(add_special)
        return np.concatenate([np.asarray(head, np.int32), ids, np.asarray(tail, np.int32)])

    def encode_stream(self, blocks: Iterable[str], special: bool = True) -> Generator[np.ndarray, None, None]:
        """The ids (int32 arrays, no BOS/EOS) of the concatenation of ``blocks``, given as soon as a safe
        cut allows: the caller may stop early, having read only what it needed. Their concatenation is
        ``encode(''.join(blocks), add_special=False, special=special)``; a vocabulary whose text cannot be
        cut (``toy.tokenizer.longtext.splittable``) is encoded whole at the end."""
        hf, buf = self._encoder(special), ""
        for block in _slices(blocks, MAX_SCAN_CHARS if self._splittable else None):
            buf += block
            if not self._splittable or len(buf) < BATCH_CHARS:
                continue
            cut = safe_cut(buf, max(0, len(buf) - MAX_SCAN_CHARS), len(buf))
            if cut <= 0 and len(buf) < MAX_SCAN_CHARS:
                continue
            cut = cut if cut > 0 else len(buf)  # no safe point in MAX_SCAN_CHARS: the documented caveat
            head, buf = buf[:cut], buf[cut:]
            yield self._encode_long(hf, head)
        if buf:
            yield self._encode_long(hf, buf)

    def _encode_long(self, hf: HFTokenizer, text: str) -> np.ndarray:
        """The ids of ``text`` (no BOS/EOS), encoded piece by piece when the vocabulary allows it."""
        pieces = cut_pieces(text) if self._splittable else iter([text])
        parts = [np.zeros(0, np.int32)]
        try:
            for run in batches(pieces):
                parts += [np.asarray(enc.ids, np.int32) for enc in _encode_many(hf, run)]
        except Exception as e:  # e.g. a lone surrogate cannot cross into Rust
            raise TokenizerError(f"cannot tokenize the text: {e}") from e
        return np.concatenate(parts)

    def special_spans(self, text: str) -> list[tuple[int, int]]:
        """Character spans ``(start, end)`` of ``text`` that ``encode(text, special=True)`` reads as control
        (or unknown) tokens, in order: exactly the tokenizer's own matches."""
        return [(a, b) for a, b, _ in self._special_matches(text)]

    def _special_matches(self, text: str) -> list[tuple[int, int, int]]:
        if not isinstance(text, str):
            raise TokenizerError(f"expected a str, not {type(text).__name__}")
        if not text or not self._control:
            return []
        long = len(text) > PIECE_CHARS and self._splittable
        out, pos = [], 0
        try:
            for run in batches(cut_pieces(text)) if long else [[text]]:
                # offsets are needed here, so the plain batch encode (not _encode_many's fast one)
                for piece, enc in zip(run, self._hf.encode_batch(run, add_special_tokens=False)):
                    out += [(pos + a, pos + b, i) for i, (a, b) in zip(enc.ids, enc.offsets) if i in self._control]
                    pos += len(piece)
        except Exception as e:
            raise TokenizerError(f"cannot tokenize the text: {e}") from e
        return out

    def encode_protected(
        self, text: str, plain: Sequence[tuple[int, int]], add_special: bool | None = None
    ) -> list[int]:
        """``encode(text, add_special, special=True)``, except that control-token text overlapping a span of
        ``plain`` (character ranges, e.g. from ``ChatTemplate.render_protected``) stays plain text.

        With no spans this is ``encode``. Otherwise the text is cut at the control tokens outside the spans
        (the ones ``encode`` would match) and each piece between them is encoded as plain text: the same
        fragments ``encode`` itself tokenizes one by one, so text without such control tokens gives the same
        ids either way."""
        if not plain:
            return self.encode(text, add_special=add_special, special=True)
        cuts = [m for m in self._special_matches(text) if not any(m[0] < e and s < m[1] for s, e in plain)]
        return self._wrap(self._encode_cut(text, cuts), add_special)

    def _encode_cut(self, text: str, cuts: Sequence[tuple[int, int, int]]) -> list[int]:
        """Control tokens ``(start, end, id)`` at ``cuts`` (in order), the text between them encoded as plain."""
        pieces, pos = [], 0
        for a, b, _ in cuts:
            pieces.append(text[pos:a])
            pos = b
        pieces.append(text[pos:])
        hf = self._encoder(False)
        short = [p for p in pieces if len(p) <= PIECE_CHARS]
        try:
            encs = iter(_encode_many(hf, short))
        except Exception as e:
            raise TokenizerError(f"cannot tokenize the text: {e}") from e
        ids: list[int] = []
        for k, piece in enumerate(pieces):
            got = next(encs).ids if len(piece) <= PIECE_CHARS else self._encode_long(hf, piece).tolist()
            if piece:
                ids.extend(got)
            if k < len(cuts):
                ids.append(cuts[k][2])
        return ids

    def encode_batch(
        self, texts: Sequence[str], add_special: bool | None = None, special: bool = True
    ) -> list[list[int]]:
        """``encode`` for many texts at once (in parallel inside ``tokenizers``)."""
        if isinstance(texts, str) or not all(isinstance(t, str) for t in texts):
            raise TokenizerError("encode_batch() takes a sequence of str")
        hf, texts = self._encoder(special), list(texts)
        try:
            encs = iter(_encode_many(hf, [t for t in texts if len(t) <= PIECE_CHARS]))
        except Exception as e:
            raise TokenizerError(f"cannot tokenize the texts: {e}") from e
        long = (self._encode_long(hf, t).tolist() for t in texts if len(t) > PIECE_CHARS)  # one at a time
        return [self._wrap(next(encs).ids if len(t) <= PIECE_CHARS else next(long), add_special) for t in texts]

    # -- decode --------------------------------------------------------------

    def _check_id(self, token_id: int) -> int:
        try:
            i = operator.index(token_id)
        except TypeError:
            raise TokenizerError(f"token id {token_id!r} is not an integer") from None
        if not 0 <= i < self.vocab.n_tokens:
            raise TokenizerError(f"token id {i} is out of range [0, {self.vocab.n_tokens})")
        return i

    def _check_ids(self, ids: Iterable[int]) -> list[int]:
        if hasattr(ids, "tolist"):  # NumPy arrays
            ids = ids.tolist()
        try:
            out = [operator.index(i) for i in ids]
        except TypeError:
            raise TokenizerError("token ids must be integers") from None
        if out and (min(out) < 0 or max(out) >= self.vocab.n_tokens):
            bad = next(i for i in out if not 0 <= i < self.vocab.n_tokens)
            raise TokenizerError(f"token id {bad} is out of range [0, {self.vocab.n_tokens})")
        return out

    def token_to_piece(self, token_id: int, special: bool = True) -> bytes:
        """The bytes of one token (llama_token_to_piece, lstrip=0). With
        ``special=False`` control and unknown tokens give ``b""``."""
        i = self._check_id(token_id)
        return (self._pieces if special else self._pieces_plain)[i]

    def decode_bytes(self, ids: Iterable[int], skip_special: bool = False) -> bytes:
        """``llama_detokenize(ids, remove_special=False, unparse_special=not skip_special)``."""
        ids = self._check_ids(ids)
        if not ids:
            return b""
        pieces = self._pieces_plain if skip_special else self._pieces
        out = b"".join([pieces[i] for i in ids])
        if self.vocab.add_space_prefix and pieces[ids[0]][:1] == b" ":
            out = out[1:]  # llama.cpp strips one space from the first piece only
        if self.vocab.clean_spaces:
            out = clean_spaces(out)
        return out

    def decode(self, ids: Iterable[int], skip_special: bool = False) -> str:
        """Text for ``ids``; invalid UTF-8 becomes U+FFFD."""
        return self.decode_bytes(ids, skip_special).decode("utf-8", errors="replace")

    def incremental_decoder(self, skip_special: bool = False) -> IncrementalDecoder:
        return IncrementalDecoder(self, skip_special)

    def __repr__(self) -> str:
        return f"Tokenizer(model={self.model!r}, pre={self.pre!r}, vocab_size={self.vocab_size})"


def _slices(blocks: Iterable[str], step: int | None) -> Iterator[str]:
    """``blocks`` cut into slices of at most ``step`` characters (None: as they are)."""
    for block in blocks:
        if step is None:
            yield block
            continue
        for k in range(0, len(block), step):
            yield block[k : k + step]


def _encode_many(hf: HFTokenizer, texts: list[str]) -> list[Any]:
    # encode_batch_fast (tokenizers >= 0.21) skips offset tracking; older versions have encode_batch only
    fast = getattr(hf, "encode_batch_fast", None) or hf.encode_batch
    encodings: list[Any] = fast(texts, add_special_tokens=False)
    return encodings


class IncrementalDecoder:
    """Streaming detokenizer: ``feed(id)`` returns the text that is complete so
    far (possibly ""), never half of a UTF-8 sequence; ``flush()`` returns what
    is left (an incomplete tail becomes U+FFFD) and resets the decoder."""

    def __init__(self, tokenizer: Tokenizer, skip_special: bool = False):
        self._tok = tokenizer
        self._pieces = tokenizer._pieces_plain if skip_special else tokenizer._pieces
        self._strip_first = tokenizer.vocab.add_space_prefix
        self.reset()

    def reset(self) -> None:
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._first = True

    def feed(self, token_id: int) -> str:
        piece = self._pieces[self._tok._check_id(token_id)]
        if self._first:
            self._first = False
            if self._strip_first and piece[:1] == b" ":
                piece = piece[1:]
        return self._utf8.decode(piece)

    def flush(self) -> str:
        tail = self._utf8.decode(b"", final=True)
        self.reset()
        return tail


def clean_spaces(text: bytes) -> bytes:
    """llama_detokenize's ``clean_spaces`` passes, ported as written (in place,
    including its quirks): drop the space before ``? ! . ,``; turn `` ' `` into
    ``'``; drop the space before ``'s 'm 're 've``."""
    t = bytearray(text)
    n = len(t)

    # pass 1: " ?", " !", " .", " ,"
    total = 1 if n else 0
    for i in range(1, n):
        x = t[i]
        if t[i - 1] == 0x20 and x in b"?!.,":
            total -= 1
        t[total] = x
        total += 1
    n = total

    # pass 2: a lone apostrophe between spaces
    total = 1 if n else 0
    i = 1
    while i < n:
        x = t[i]
        if x == 0x27 and i + 1 < n and t[i - 1] == 0x20 and t[i + 1] == 0x20:
            total -= 1
            i += 1
            t[i] = 0  # llama.cpp overwrites the skipped space with NUL
        t[total] = x
        total += 1
        i += 1
    n = total

    # pass 3: contractions " 's", " 'm", " 're", " 've"
    total = 1 if n else 0
    for i in range(1, n):
        x = t[i]
        if t[i - 1] == 0x20 and x == 0x27 and i + 1 < n:
            x1 = t[i + 1]
            if x1 in b"sm":
                total -= 1
            elif x1 not in b"td" and i + 2 < n:
                x2 = t[i + 2]
                if (x1, x2) in ((0x72, 0x65), (0x76, 0x65)):  # "re", "ve"
                    total -= 1
        t[total] = x
        total += 1
    return bytes(t[:total])
