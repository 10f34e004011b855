"""Tokenizers and chat templates built from GGUF metadata.

- ``Tokenizer``: encode/decode with llama.cpp's semantics, built on HF
  ``tokenizers`` from the vocabulary inside the GGUF file (no download).
- ``IncrementalDecoder``: streaming detokenization that never splits UTF-8.
- ``ChatTemplate``: renders ``tokenizer.chat_template`` in a time- and
  size-limited Jinja sandbox; ChatML when the file has none.
- ``TokenizerError`` / ``ChatTemplateError``: what goes wrong, as ``ToyError``.
"""

from toy.tokenizer.chat import DEFAULT_CHAT_TEMPLATE, ChatTemplate, ChatTemplateError
from toy.tokenizer.pretok import PRE_TOKENIZERS, supported_pre_tokenizers
from toy.tokenizer.tokenizer import IncrementalDecoder, Tokenizer
from toy.tokenizer.vocab import SUPPORTED_MODELS, TokenizerError, Vocab

__all__ = [
    "DEFAULT_CHAT_TEMPLATE",
    "PRE_TOKENIZERS",
    "SUPPORTED_MODELS",
    "ChatTemplate",
    "ChatTemplateError",
    "IncrementalDecoder",
    "Tokenizer",
    "TokenizerError",
    "Vocab",
    "supported_pre_tokenizers",
]
