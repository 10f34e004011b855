"""The vocabulary a GGUF file carries, read and checked: tokens, types, ids, flags.

``Vocab.from_gguf(metadata)`` turns the ``tokenizer.*`` keys into one validated
record that the tokenizer builder (``toy.tokenizer.build``) and the
``Tokenizer`` share. It also settles, the way llama.cpp does, what the file
leaves implicit:

- token attributes from ``tokenizer.ggml.token_type`` (1 normal, 2 unknown,
  3 control, 4 user-defined, 5 unused, 6 byte; a missing array means all
  normal); tokens that llama.cpp recognises by text as end-of-turn / FIM /
  end-of-generation markers are forced to control, as llama.cpp does;
- special ids: metadata wins; the "llama" model defaults to bos=1, eos=2,
  unk=0 like llama.cpp;
- ``add_bos`` / ``add_eos`` / ``add_space_prefix`` defaults per model and
  pre-tokenizer, overridden by the metadata flags;
- the end-of-generation set (``eog_ids``): eos, eot, eom, the FIM pad/repo/sep
  tokens and every token whose text llama.cpp lists as EOG.

Invariants: ids are ``0 <= id < n_tokens`` or None; token texts are unique and
non-empty (an empty text is renamed ``[EMPTY_<id>]`` as llama.cpp does); every
problem raises ``TokenizerError`` naming the key and the offending value.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from toy.errors import ToyError
from toy.tokenizer.pretok import PreTokenizerSpec, pre_tokenizer_spec, supported_pre_tokenizers


class TokenizerError(ToyError):
    """A tokenizer cannot be built from the metadata, or was used wrongly
    (the file or the input is at fault: the CLI exits 2)."""

    exit_code = 2


#: ``tokenizer.ggml.model`` values toy builds tokenizers for.
SUPPORTED_MODELS = ("gpt2", "llama")

# GGUF token types (llama.cpp ``llama_token_type``) and attribute bits
# (``llama_token_attr``) they map to.
TYPE_UNDEFINED, TYPE_NORMAL, TYPE_UNKNOWN, TYPE_CONTROL, TYPE_USER_DEFINED, TYPE_UNUSED, TYPE_BYTE = range(7)
ATTR_UNDEFINED = 0
ATTR_UNKNOWN = 1 << 0
ATTR_UNUSED = 1 << 1
ATTR_NORMAL = 1 << 2
ATTR_CONTROL = 1 << 3
ATTR_USER_DEFINED = 1 << 4
ATTR_BYTE = 1 << 5
_TYPE_TO_ATTR = {
    TYPE_UNDEFINED: ATTR_UNDEFINED,
    TYPE_NORMAL: ATTR_NORMAL,
    TYPE_UNKNOWN: ATTR_UNKNOWN,
    TYPE_CONTROL: ATTR_CONTROL,
    TYPE_USER_DEFINED: ATTR_USER_DEFINED,
    TYPE_UNUSED: ATTR_UNUSED,
    TYPE_BYTE: ATTR_BYTE,
}
_ATTR_TABLE = np.array([_TYPE_TO_ATTR.get(t, ATTR_UNDEFINED) for t in range(max(_TYPE_TO_ATTR) + 1)], np.int64)

# Token texts llama.cpp treats as end of generation (``special_eog_ids``).
EOG_TEXTS = frozenset(
    {
        "<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<|flush|>", "<|calls|>",
        "<end_of_turn>", "<|endoftext|>", "</s>", "<|eom_id|>", "<EOT>", "_<EOT>", "[EOT]", "[EOS]",
        "<|end_of_text|>", "<end_of_utterance>", "<eos>", "<turn|>", "<|tool_response>",
        "<｜end▁of▁sentence｜>", "[e~[",
    }
)  # fmt: skip
# Texts llama.cpp uses to find a missing eot / eom / FIM id (these become control tokens).
_DETECT_TEXTS: dict[str, tuple[str, ...]] = {
    "eot": ("<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<|end_of_text|>",
            "<EOT>", "_<EOT>", "[EOT]", "<｜end▁of▁sentence｜>", "<end_of_utterance>"),
    "eom": ("<|eom_id|>",),
    "fim_pre": ("<|fim_prefix|>", "<fim-prefix>", "<fim_prefix>", "<｜fim▁begin｜>", "<PRE>", "▁<PRE>",
                "<|code_prefix|>", "<|prefix|>"),
    "fim_suf": ("<|fim_suffix|>", "<fim-suffix>", "<fim_suffix>", "<｜fim▁hole｜>", "<SUF>", "▁<SUF>",
                "<|code_suffix|>", "<|suffix|>"),
    "fim_mid": ("<|fim_middle|>", "<fim-middle>", "<fim_middle>", "<｜fim▁end｜>", "<MID>", "▁<MID>",
                "<|code_middle|>", "<|middle|>"),
    "fim_pad": ("<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]"),
    "fim_rep": ("<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>"),
    "fim_sep": ("<|file_sep|>",),
}  # fmt: skip

_ID_KEYS = {
    "bos": "tokenizer.ggml.bos_token_id",
    "eos": "tokenizer.ggml.eos_token_id",
    "unk": "tokenizer.ggml.unknown_token_id",
    "sep": "tokenizer.ggml.seperator_token_id",  # sic: the GGUF key is spelled this way
    "pad": "tokenizer.ggml.padding_token_id",
    "eot": "tokenizer.ggml.eot_token_id",
    "eom": "tokenizer.ggml.eom_token_id",
    "fim_pre": "tokenizer.ggml.fim_pre_token_id",
    "fim_suf": "tokenizer.ggml.fim_suf_token_id",
    "fim_mid": "tokenizer.ggml.fim_mid_token_id",
    "fim_pad": "tokenizer.ggml.fim_pad_token_id",
    "fim_rep": "tokenizer.ggml.fim_rep_token_id",
    "fim_sep": "tokenizer.ggml.fim_sep_token_id",
}
_LLAMA_DEFAULT_IDS = {"bos": 1, "eos": 2, "unk": 0}


@dataclass(frozen=True)
class Vocab:
    """A checked GGUF vocabulary. ``attrs[i]`` holds llama.cpp attribute bits;
    ``special`` maps bos/eos/unk/sep/pad/eot/eom/fim_* to an id or None."""

    model: str
    pre: str | None
    pre_spec: PreTokenizerSpec | None  # None for the "llama" model
    tokens: list[str]
    attrs: list[int]
    scores: np.ndarray | None  # float32, one per token ("llama" merge priority)
    merges: list[tuple[str, str]]
    special: dict[str, int | None]
    add_bos: bool
    add_eos: bool
    add_space_prefix: bool
    clean_spaces: bool
    eog_ids: frozenset[int]
    #: text -> id (``tokens`` inverted), kept from reading so the tokenizer builder need not rebuild it
    ids: dict[str, int] | None = field(default=None, compare=False, repr=False)

    @property
    def n_tokens(self) -> int:
        return len(self.tokens)

    @classmethod
    def from_gguf(cls, metadata: Mapping[str, Any]) -> Vocab:
        model = metadata.get("tokenizer.ggml.model")
        if model is None:
            raise TokenizerError("the metadata has no tokenizer.ggml.model: this file carries no tokenizer")
        if model not in SUPPORTED_MODELS:
            raise TokenizerError(
                f"unsupported tokenizer model {model!r}: toy builds tokenizers for {', '.join(SUPPORTED_MODELS)}",
                hint="convert the model with a byte-level BPE (gpt2) or SentencePiece BPE (llama) vocabulary",
            )
        tokens, by_text = _tokens(metadata)
        n = len(tokens)
        attrs = _attrs(metadata, n)
        scores = _scores(metadata, n)

        pre, pre_spec = None, None
        if model == "gpt2":
            pre = metadata.get("tokenizer.ggml.pre") or None
            pre_spec = pre_tokenizer_spec(pre)
            if pre_spec is None:
                raise TokenizerError(
                    f"unsupported pre-tokenizer {pre!r} (tokenizer.ggml.pre)",
                    hint="supported: " + ", ".join(supported_pre_tokenizers()),
                )
            merges = _merges(metadata)
            add_bos, add_space_prefix, clean_spaces = pre_spec.add_bos, False, pre_spec.clean_spaces
        else:  # llama: SentencePiece-style BPE
            merges = []
            add_bos, add_space_prefix, clean_spaces = True, True, False
            if scores is None:
                raise TokenizerError("tokenizer model 'llama' needs tokenizer.ggml.scores (merge priorities)")

        special = {name: _opt_id(metadata, key, n) for name, key in _ID_KEYS.items()}
        if model == "llama":
            for name, default in _LLAMA_DEFAULT_IDS.items():
                if special[name] is None and default < n:
                    special[name] = default
        for name, texts in _DETECT_TEXTS.items():
            if special[name] is None:
                # llama.cpp takes the first match in hash order; the lowest id is a stable stand-in
                found = min((by_text[t] for t in texts if t in by_text), default=None)
                special[name] = found
                if found is not None:
                    attrs[found] |= ATTR_CONTROL  # llama.cpp overrides the type of detected tokens

        eog = {by_text[t] for t in EOG_TEXTS if t in by_text}
        for i in eog:
            attrs[i] |= ATTR_CONTROL
        eog.update(
            tid for k in ("eos", "eot", "eom", "fim_pad", "fim_rep", "fim_sep") if (tid := special[k]) is not None
        )

        add_bos = _opt_bool(metadata, "tokenizer.ggml.add_bos_token", add_bos)
        add_eos = _opt_bool(metadata, "tokenizer.ggml.add_eos_token", False)
        add_space_prefix = _opt_bool(metadata, "tokenizer.ggml.add_space_prefix", add_space_prefix)
        if add_bos and special["bos"] is None:
            raise TokenizerError("tokenizer.ggml.add_bos_token is true but the vocabulary has no BOS token")
        if add_eos and special["eos"] is None:
            raise TokenizerError("tokenizer.ggml.add_eos_token is true but the vocabulary has no EOS token")
        return cls(
            model=model,
            pre=pre,
            pre_spec=pre_spec,
            tokens=tokens,
            attrs=attrs,
            scores=scores,
            merges=merges,
            special=special,
            add_bos=add_bos,
            add_eos=add_eos,
            add_space_prefix=add_space_prefix,
            clean_spaces=clean_spaces,
            eog_ids=frozenset(eog),
            ids=by_text,
        )


def _tokens(metadata: Mapping[str, Any]) -> tuple[list[str], dict[str, int]]:
    """The token texts and their inverse (text -> id)."""
    raw = _str_list(metadata, "tokenizer.ggml.tokens")
    if raw is None:
        raise TokenizerError("tokenizer.ggml.tokens is missing: the file carries no vocabulary")
    if not raw:
        raise TokenizerError("tokenizer.ggml.tokens is empty")
    tokens = [t if t else f"[EMPTY_{i}]" for i, t in enumerate(raw)] if "" in raw else raw
    by_text = {t: i for i, t in enumerate(tokens)}
    if len(by_text) != len(tokens):
        seen: set[str] = set()
        dup = next(t for t in tokens if t in seen or seen.add(t))  # type: ignore[func-returns-value]  # add's None: go on
        raise TokenizerError(f"tokenizer.ggml.tokens holds {dup!r} more than once (llama.cpp rejects this too)")
    return tokens, by_text


def _str_list(metadata: Mapping[str, Any], key: str) -> list[str] | None:
    """A string array as a list (decoded once; the reader may hand a lazy sequence)."""
    raw = metadata.get(key)
    if raw is None:
        return None
    # the GGUF reader's lazy form (str items, UTF-8 validated when read): one
    # native pass; a StringArray exists only once the reader is imported, and
    # importing it here would import toy_ggml
    reader = sys.modules.get("toy.gguf.reader")
    if reader is not None and isinstance(raw, reader.StringArray):
        strings: list[str] = raw.tolist()
        return strings
    if not isinstance(raw, Sequence) or isinstance(raw, (str, bytes)):
        raise TokenizerError(f"{key} is not an array of strings")
    items = list(raw)
    if not all(isinstance(t, str) for t in items):
        raise TokenizerError(f"{key} is not an array of strings")
    return items


def _int_array(metadata: Mapping[str, Any], key: str, n: int) -> np.ndarray | None:
    raw = metadata.get(key)
    if raw is None:
        return None
    try:
        arr = np.asarray(raw)
    except Exception:  # ragged or odd values
        raise TokenizerError(f"{key} is not a numeric array") from None
    if arr.ndim != 1 or arr.dtype.kind not in "iuf":
        raise TokenizerError(f"{key} is not a numeric array")
    if len(arr) < n:
        raise TokenizerError(f"{key} has {len(arr)} entries for {n} tokens")
    return arr[:n]


def _attrs(metadata: Mapping[str, Any], n: int) -> list[int]:
    types = _int_array(metadata, "tokenizer.ggml.token_type", n)
    if types is None:
        return [ATTR_NORMAL] * n
    # one table lookup for the whole array; types outside the table are undefined
    codes = types.astype(np.int64)
    known = (codes >= 0) & (codes < len(_ATTR_TABLE))
    attrs: list[int] = np.where(known, _ATTR_TABLE[np.where(known, codes, 0)], ATTR_UNDEFINED).tolist()
    return attrs


def _scores(metadata: Mapping[str, Any], n: int) -> np.ndarray | None:
    scores = _int_array(metadata, "tokenizer.ggml.scores", n)
    return None if scores is None else scores.astype(np.float32)


def _merges(metadata: Mapping[str, Any]) -> list[tuple[str, str]]:
    lazy = metadata.get("tokenizer.ggml.merges")
    reader = sys.modules.get("toy.gguf.reader")
    if reader is not None and isinstance(lazy, reader.StringArray):
        pairs: list[tuple[str, str]] | int = lazy.pairs()  # one native pass; the loop below only to name a bad entry
        if not isinstance(pairs, int):
            return pairs
    raw = _str_list(metadata, "tokenizer.ggml.merges")
    if raw is None:
        raise TokenizerError("tokenizer model 'gpt2' needs tokenizer.ggml.merges")
    merges = []
    for i, m in enumerate(raw):
        pos = m.find(" ", 1)  # as llama.cpp: the first space after the first character
        if pos < 0:
            raise TokenizerError(f"tokenizer.ggml.merges[{i}] = {m!r} is not two tokens separated by a space")
        merges.append((m[:pos], m[pos + 1 :]))
    return merges


def _opt_id(metadata: Mapping[str, Any], key: str, n: int) -> int | None:
    v = metadata.get(key)
    if v is None:
        return None
    if isinstance(v, (bool, float, str)) or not isinstance(v, (int, np.integer)):
        raise TokenizerError(f"{key} = {v!r} is not an integer token id")
    v = int(v)
    if v < 0 or v >= n:
        # llama.cpp ignores out-of-range ids (and -1 means "none" in some converters)
        return None
    return v


def _opt_bool(metadata: Mapping[str, Any], key: str, default: bool) -> bool:
    v = metadata.get(key)
    if v is None:
        return default
    if not isinstance(v, (bool, np.bool_)):
        raise TokenizerError(f"{key} = {v!r} is not a boolean")
    return bool(v)
