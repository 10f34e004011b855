"""Train a byte-level BPE tokenizer on a corpus and describe it as GGUF metadata.

``train_bpe(paths, vocab_size)`` runs HF ``tokenizers``' BPE trainer over the
corpus that ``toy.corpus`` reads (files, folders, JSONL), streamed in
chunks, and returns the ``tokenizer.*`` keys a GGUF file needs so that toy
(``Tokenizer.from_gguf``) and llama.cpp load the same tokenizer.

Decisions:

- GPT-2 style: the pre-tokenizer is ``ByteLevel(add_prefix_space=False,
  use_regex=True)`` (the GPT-2 regex, then bytes mapped to GPT-2's printable
  alphabet) and all 256 byte symbols are in the initial alphabet, so every
  input is representable and there is no unknown token.
- ``tokenizer.ggml.pre`` is ``"gpt-2"``: the name that llama.cpp and
  ``toy.tokenizer.pretok`` both map to exactly that regex (there is no
  ``"gpt2"`` entry). As for every file with that name, llama.cpp's
  ``llama_detokenize`` cleans spaces before ``? ! . ,`` and in some
  contractions; the token pieces themselves (``token_to_piece``, streaming)
  are the exact bytes.
- One special token, ``<|endoftext|>``, id 0, typed control: it is BOS and EOS
  (the document separator of the token cache); no BOS is added on encode.

Invariants: ids are ``0..n-1`` in the order of ``tokenizer.ggml.tokens``; every
merge ``"a b"`` names two tokens whose concatenation is a token; the result
has at most ``vocab_size`` tokens (fewer when the corpus has too few pairs of
``min_frequency``). ``METADATA_TYPES`` gives the GGUF value types llama.cpp
expects for the keys whose Python value alone does not fix them.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

from toy.corpus import CHUNK_BYTES, Paths, corpus_files, iter_chunks
from toy.errors import DataError
from toy.gguf import TypeInfo, ValueType

EOT_TOKEN = "<|endoftext|>"
PRE_TOKENIZER = "gpt-2"
TOKEN_TYPE_NORMAL, TOKEN_TYPE_CONTROL = 1, 3
MIN_VOCAB = 256 + 1  # every byte, plus <|endoftext|>

#: GGUF value types for the keys ``train_bpe`` returns whose Python value is
#: ambiguous (llama.cpp reads token ids as UINT32 and rejects INT32).
METADATA_TYPES: dict[str, TypeInfo] = {
    "tokenizer.ggml.bos_token_id": TypeInfo(ValueType.UINT32),
    "tokenizer.ggml.eos_token_id": TypeInfo(ValueType.UINT32),
}


def hf_byte_level_bpe() -> HFTokenizer:
    """An untrained HF tokenizer with the byte-level pipeline ``train_bpe`` uses."""
    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    return tok


def train_hf_bpe(
    paths: Paths,
    vocab_size: int,
    *,
    min_frequency: int = 2,
    progress: Callable[[int, int], None] | None = None,
) -> HFTokenizer:
    """The trained HF tokenizer (``train_bpe`` turns it into GGUF metadata)."""
    if vocab_size < MIN_VOCAB:
        raise DataError(
            f"vocab_size {vocab_size} is too small: a byte-level BPE needs at least {MIN_VOCAB} "
            f"tokens (256 bytes and {EOT_TOKEN})"
        )
    if min_frequency < 1:
        raise DataError(f"min_frequency must be at least 1 (got {min_frequency})")
    files = corpus_files(paths)  # raises DataError now for a missing path, not inside the trainer
    total = sum(p.stat().st_size for p in files)
    seen = {"bytes": 0, "texts": 0}

    def texts() -> Iterator[str]:
        # chunks cut at line breaks: pre-tokenized words, and so pair counts, are
        # those of the whole file (see toy.corpus._safe_cut)
        for _, text, _, nbytes in iter_chunks(files, CHUNK_BYTES):
            seen["bytes"] += nbytes
            seen["texts"] += bool(text)
            if progress:
                progress(seen["bytes"], total)
            yield text

    tok = hf_byte_level_bpe()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=[EOT_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    try:
        tok.train_from_iterator(texts(), trainer=trainer)
    except DataError:
        raise
    except Exception as e:  # a DataError raised inside the iterator may come back wrapped
        cause = e.__cause__ or e.__context__
        if isinstance(cause, DataError):
            raise cause from None
        raise DataError(f"BPE training failed: {e}") from e
    if not seen["texts"]:
        raise DataError(f"the corpus ({', '.join(map(str, files[:3]))}) is empty: it holds no text to train on")
    if progress:
        progress(total, total)
    return tok


def gguf_metadata(tok: HFTokenizer) -> dict[str, Any]:
    """GGUF ``tokenizer.*`` metadata for a tokenizer made by ``train_hf_bpe``."""
    model = json.loads(tok.to_str())["model"]
    vocab: dict[str, int] = model["vocab"]
    tokens = [""] * len(vocab)
    for text, i in vocab.items():
        tokens[i] = text
    if tok.get_vocab_size() != len(vocab) or "" in tokens or tokens[0] != EOT_TOKEN:
        raise DataError("the trained vocabulary is not dense with <|endoftext|> at id 0")
    # tokenizers >= 0.20 serialises merges as [a, b] pairs, older versions as "a b"
    merges = [m if isinstance(m, str) else f"{m[0]} {m[1]}" for m in model["merges"]]
    token_type = np.full(len(tokens), TOKEN_TYPE_NORMAL, dtype=np.int32)
    token_type[0] = TOKEN_TYPE_CONTROL
    return {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": PRE_TOKENIZER,
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": token_type,
        "tokenizer.ggml.merges": merges,
        "tokenizer.ggml.bos_token_id": 0,
        "tokenizer.ggml.eos_token_id": 0,
        "tokenizer.ggml.add_bos_token": False,
    }


def train_bpe(
    paths: Paths,
    vocab_size: int,
    *,
    min_frequency: int = 2,
    progress: Callable[[int, int], None] | None = None,
) -> dict[str, Any]:
    """Train a byte-level BPE of at most ``vocab_size`` tokens on ``paths``;
    returns its GGUF ``tokenizer.*`` metadata (see the module docstring).
    ``progress(done_bytes, total_bytes)`` is called as the corpus is read."""
    return gguf_metadata(train_hf_bpe(paths, vocab_size, min_frequency=min_frequency, progress=progress))


def write_metadata(writer: Any, metadata: dict[str, Any]) -> None:
    """Add ``metadata`` to a ``toy.gguf.GGUFWriter`` with llama.cpp's value types."""
    for key, value in metadata.items():
        writer.add(key, value, METADATA_TYPES.get(key))


__all__ = [
    "EOT_TOKEN",
    "METADATA_TYPES",
    "PRE_TOKENIZER",
    "gguf_metadata",
    "hf_byte_level_bpe",
    "train_bpe",
    "train_hf_bpe",
    "write_metadata",
]
