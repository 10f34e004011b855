"""A 19-piece SentencePiece-style vocabulary for token-step tests.

The pieces spell short English words, a stop string split across tokens
("ST" + "OP"), and the three UTF-8 bytes of "€" as byte tokens, so a test can
pick exactly the text each step emits. ``tokenizer()`` builds a toy
``Tokenizer`` from it as GGUF metadata would (BOS 1, EOS ``EOS``).
Used by the decoding-state unit tests and the library/server token-step
comparison.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from toy.tokenizer import Tokenizer

NORMAL = ["\u2581Hello", "\u2581wor", "ld", "!", "ST", "OP", "\u2581the", "\u2581end", ".", "\u2581", "a", "b"]
PIECES = ["<unk>", "<s>", "</s>", *NORMAL, "<0x0A>", "<0xE2>", "<0x82>", "<0xAC>"]
ID = {p.replace("\u2581", " "): i for i, p in enumerate(PIECES)}
EOS = ID["</s>"]
N_VOCAB = len(PIECES)


def tokenizer(**metadata: Any) -> Tokenizer:
    """The vocabulary as a Tokenizer; ``metadata`` adds or overrides GGUF keys."""
    types = [2, 3, 3] + [1] * len(NORMAL) + [6] * 4  # control <unk>/<s>/</s>, normal pieces, byte tokens
    md = {
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.tokens": PIECES,
        "tokenizer.ggml.token_type": np.array(types, dtype=np.int32),
        "tokenizer.ggml.scores": np.zeros(len(PIECES), dtype=np.float32),
        "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": EOS,
        **metadata,
    }
    return Tokenizer.from_gguf(md)
