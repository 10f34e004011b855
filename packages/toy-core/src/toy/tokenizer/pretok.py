"""Pre-tokenizers for byte-level BPE vocabularies, keyed by ``tokenizer.ggml.pre``.

A GGUF file names its pre-tokenizer (``tokenizer.ggml.pre``); llama.cpp maps
that name to a list of regular expressions (``llm_tokenizer_bpe`` in
``llama-vocab.cpp``). The text is split by the first expression, every piece
again by the next, and so on: a match becomes a piece of its own and so does the
unmatched text between matches ("isolated" splitting). BPE then runs inside each
piece, so no token ever crosses a piece boundary.

This module holds that table, written for HF ``tokenizers`` (Oniguruma regexes,
``pre_tokenizers.Split(..., behavior="isolated")``), plus the per-name flags
llama.cpp sets next to it:

- ``ignore_merges``: a piece that is itself a vocabulary entry becomes that
  token without running the merges (llama3 family);
- ``clean_spaces``: ``llama_detokenize`` removes spaces before ``?!.,`` and some
  apostrophes (on by default for BPE, off for the names that turn it off);
- ``add_bos``: the default for ``tokenizer.ggml.add_bos_token`` when the file
  does not say.

Invariants: the regex strings are the ones llama.cpp uses (its llama3/qwen2
forms spell the case-insensitive contractions as ``'[sS]`` …, which Oniguruma
reads the same way); the GPT-2 expression carries the trailing ``|\\s+`` that
llama.cpp's hand-written matcher implements. Names not in the table are
rejected rather than guessed.
"""

from __future__ import annotations

from dataclasses import dataclass

from tokenizers import Regex
from tokenizers import pre_tokenizers as pt

# GPT-2: contractions, letters, numbers, other symbols, whitespace runs that keep
# their last space for the next word.
GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"

# Llama 3 (tiktoken cl100k style): case-insensitive contractions, one optional
# non-letter before a letter run, digits in groups of up to three, newlines kept
# with the symbols before them.
LLAMA3 = (
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
    r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# Qwen2: Llama 3 with single digits.
QWEN2 = (
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
    r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# llama.cpp's fallback for BPE files without a known pre-tokenizer ("default").
DEFAULT = (
    r"[\p{P}\$\+<=>\^~\|]+",
    GPT2,
    r"\p{N}+",
    r"[0-9][0-9][0-9]",
)

# StarCoder / SmolLM: every digit on its own, then GPT-2.
DIGITS_GPT2 = (r"\p{N}", GPT2)


@dataclass(frozen=True)
class PreTokenizerSpec:
    """How llama.cpp pre-tokenizes one family of ``tokenizer.ggml.pre`` names."""

    family: str
    regexes: tuple[str, ...]
    ignore_merges: bool = False
    clean_spaces: bool = True
    add_bos: bool = False

    def build(self) -> pt.PreTokenizer:
        """The HF pre-tokenizer: one isolated regex split per expression, then
        the GPT-2 byte-to-unicode mapping (without GPT-2's own regex)."""
        steps: list[pt.PreTokenizer] = [pt.Split(Regex(r), behavior="isolated", invert=False) for r in self.regexes]
        steps.append(pt.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False))
        return pt.Sequence(steps)


_LLAMA3 = PreTokenizerSpec("llama3", (LLAMA3,), ignore_merges=True, add_bos=True)
_LLAMA3_REGEX = PreTokenizerSpec("llama3-regex", (LLAMA3,))
_QWEN2 = PreTokenizerSpec("qwen2", (QWEN2,), clean_spaces=False)
_SMOLLM = PreTokenizerSpec("smollm", DIGITS_GPT2, clean_spaces=False)
_STARCODER = PreTokenizerSpec("starcoder", DIGITS_GPT2)
_GPT2 = PreTokenizerSpec("gpt-2", (GPT2,))
_GPT2_NOCLEAN = PreTokenizerSpec("gpt-2", (GPT2,), clean_spaces=False)
_DEFAULT = PreTokenizerSpec("default", DEFAULT)

#: ``tokenizer.ggml.pre`` name -> spec. Names, regexes and flags follow
#: llama.cpp's ``llama_vocab::impl::load`` and ``llm_tokenizer_bpe``.
PRE_TOKENIZERS: dict[str, PreTokenizerSpec] = {
    "default": _DEFAULT,
    # llama 3 family
    "llama3": _LLAMA3,
    "llama-v3": _LLAMA3,
    "llama-bpe": _LLAMA3,
    "falcon3": _LLAMA3,
    "falcon-h1": _LLAMA3,
    "pixtral": _LLAMA3,
    "midm-2.0": _LLAMA3,
    "lfm2": _LLAMA3,
    "dbrx": _LLAMA3_REGEX,
    "smaug-bpe": _LLAMA3_REGEX,
    # qwen2 family
    "qwen2": _QWEN2,
    "deepseek-r1-qwen": _QWEN2,
    "megrez": PreTokenizerSpec("qwen2", (QWEN2,)),
    "stablelm2": PreTokenizerSpec("qwen2", (QWEN2,)),
    # digits split one by one, then GPT-2
    "smollm": _SMOLLM,
    "command-r": PreTokenizerSpec("starcoder", DIGITS_GPT2, clean_spaces=False),
    "starcoder": _STARCODER,
    "refact": _STARCODER,
    "codeshell": _STARCODER,
    "exaone": _STARCODER,
    # plain GPT-2
    "gpt-2": _GPT2,
    "phi-2": _GPT2,
    "mpt": _GPT2,
    "olmo": _GPT2,
    "jais": _GPT2,
    "exaone4": _GPT2,
    "trillion": _GPT2_NOCLEAN,
    "granite-docling": _GPT2_NOCLEAN,
}


def pre_tokenizer_spec(name: str | None) -> PreTokenizerSpec | None:
    """The spec for a ``tokenizer.ggml.pre`` value; a missing or empty name
    means llama.cpp's "default"; an unknown name gives None."""
    if not name:
        return _DEFAULT
    return PRE_TOKENIZERS.get(name)


def supported_pre_tokenizers() -> list[str]:
    return sorted(PRE_TOKENIZERS)
