"""The tokenizer of a Hugging Face folder as llama.cpp's ``tokenizer.*``
metadata (``toy.convert.hf_import`` calls ``tokenizer_metadata``), the keys,
values, types and order ``convert_hf_to_gguf.py`` writes.

Which file: as the converter, ``tokenizer.model`` (SentencePiece) when the
folder has one and the architecture's converter class looks for it (the
family's ``HFFamily.sentencepiece``: llama, qwen2/qwen3, gemma2/gemma3),
otherwise ``tokenizer.json`` as byte-level BPE. No other architecture
knowledge lives here: what a class adds before or after these keys (llama's
``add_space_prefix`` from ``tokenizer_config.json``, Gemma's
``add_space_prefix`` false) is the family's (``toy.models.*_hf``).

SentencePiece (``tokenizer.ggml.model`` "llama", ``pre`` "default"): the
pieces, scores and kinds come from the model through the ``sentencepiece``
package, toy-core's optional ``sentencepiece`` extra, imported only here and
only for such a folder (without it the import names the extra to install).
The vocabulary has config.json's ``vocab_size`` entries (``[PAD<id>]``
UNUSED ones where the model has no piece), then ``added_tokens.json`` and
``tokenizer_config.json``'s ``added_tokens_decoder`` override entries
(``sentencepiece_vocab``).

BPE (``tokenizer.ggml.model`` "gpt2"): tokens by id (ids below
``vocab_size`` that the tokenizer does not use become ``[PAD<id>]`` of type
UNUSED), types (added tokens marked special, or spelled like control tokens,
are CONTROL; other added tokens USER_DEFINED; the rest NORMAL), the merges,
and ``tokenizer.ggml.pre`` named from the pre-tokenizer definition
(``pre_tokenizer_name``: llama.cpp hashes a probe text's ids instead).

Both then take the special tokens as llama.cpp's ``gguf.SpecialVocab``
finds them (``special_vocab``): the ids of ``tokenizer_config.json``'s
``*_token`` among tokenizer.json's added tokens, then ``config.json``'s
``*_token_id``; ``add_bos``/``add_eos``/``add_sep`` from the post-processor,
then ``tokenizer_config.json``; the chat template (``tokenizer_config.json``,
else ``chat_template.jinja`` / ``chat_template.json``; several named
templates are refused); tokenizer.json's lowercase / strip-accents
normalizer flags.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from toy.convert.hf_common import (
    err,
    read_json,
)
from toy.gguf.constants import ValueType
from toy.gguf.reader import TypeInfo
from toy.tokenizer.vocab import TYPE_BYTE, TYPE_CONTROL, TYPE_NORMAL, TYPE_UNKNOWN, TYPE_UNUSED, TYPE_USER_DEFINED

_CONTRACTIONS_HF = "(?i:'s|'t|'re|'ve|'m|'ll|'d)"


def _regex_tail(regex: str) -> str | None:
    """A Llama-3-style split regex without its case-insensitive contractions
    group (spelled as HF's ``(?i:...)`` or llama.cpp's ``(?:'[sS]|...)``)."""
    if regex.startswith(_CONTRACTIONS_HF):
        return regex[len(_CONTRACTIONS_HF) :]
    if regex.startswith("(?:'[sS]"):
        return regex[regex.index(")") + 1 :]
    return None


def _canon(regex: str) -> str:
    tail = _regex_tail(regex)
    return regex if tail is None else "(contractions)" + tail


def _known_splits() -> dict[tuple[str, ...], str]:
    """Split regexes (canonical) -> the llama.cpp name toy writes for them."""
    from toy.tokenizer import pretok

    return {
        tuple(_canon(r) for r in regexes): name
        for regexes, name in (
            ((pretok.LLAMA3,), "llama-bpe"),
            ((pretok.QWEN2,), "qwen2"),
            (pretok.DIGITS_GPT2, "smollm"),
            ((pretok.GPT2,), "gpt-2"),
            (pretok.DEFAULT, "default"),
        )
    }


def pre_tokenizer_name(pre: Any) -> str:
    """llama.cpp's ``tokenizer.ggml.pre`` name for a tokenizer.json
    ``pre_tokenizer`` definition (see the module docstring). Two spellings
    are read: the ones Hugging Face tokenizers carry (GPT-2's
    ``ByteLevel(use_regex=True)``; one ``Split`` then ``ByteLevel``;
    ``Digits`` then GPT-2's ``ByteLevel``) and the one toy's own tokenizer
    export writes (a ``Split`` per regex of ``toy.tokenizer.pretok``, then
    ``ByteLevel`` without its regex)."""

    def is_bytelevel(p: Any, regex: bool) -> bool:
        return isinstance(p, dict) and p.get("type") == "ByteLevel" and bool(p.get("use_regex", True)) == regex

    if is_bytelevel(pre, True):
        return "gpt-2"
    steps = pre.get("pretokenizers") if isinstance(pre, dict) and pre.get("type") == "Sequence" else None
    if isinstance(steps, list) and len(steps) >= 2 and all(isinstance(p, dict) for p in steps):
        first, last = steps[0], steps[-1]
        if (
            len(steps) == 2
            and first.get("type") == "Digits"
            and first.get("individual_digits")
            and is_bytelevel(last, True)
        ):
            return "smollm"
        if is_bytelevel(last, False):
            regexes: list[str] = []
            for p in steps[:-1]:
                pattern = p.get("pattern")
                regex = pattern.get("Regex") if isinstance(pattern, dict) else None
                if p.get("type") != "Split" or p.get("behavior") != "Isolated" or p.get("invert"):
                    break
                if not isinstance(regex, str):
                    break
                regexes.append(_canon(regex))
            else:
                name = _known_splits().get(tuple(regexes))
                if name is not None:
                    return name
    shown = json.dumps(pre)[:300]
    raise err(
        f"tokenizer.json: pre_tokenizer {shown} is not one toy can name for llama.cpp",
        "pre_tokenizer",
        "toy names GPT-2's byte-level split (gpt-2), Llama 3's (llama-bpe), Qwen2's (qwen2) and "
        "SmolLM's (smollm); convert this model with llama.cpp's convert_hf_to_gguf.py",
    )


def _token_text(entry: Any) -> str | None:
    if isinstance(entry, str):
        return entry
    content = entry.get("content") if isinstance(entry, dict) else None
    return content if isinstance(content, str) else None


def looks_special(text: str) -> bool:
    """Added tokens the converter marks CONTROL although not flagged special
    (``<pad>``, ``<|...|>``, Gemma's ``<mask>``/``<unusedN>`` ...)."""
    return (
        text in ("<pad>", "<mask>", "<2mass>", "[@BOS@]")
        or (text.startswith("<|") and text.endswith("|>"))
        or (text.startswith("<\uff5c") and text.endswith("\uff5c>"))
        or (text.startswith("<unused") and text.endswith(">"))
    )


# ------------------------------------------------------------------ special tokens

#: special token type -> the key of its id (the types llama.cpp's writer has a key for; ``cls`` has none)
_ID_KEYS = {
    "bos": "bos_token_id",
    "eos": "eos_token_id",
    "unk": "unknown_token_id",
    "sep": "seperator_token_id",
    "pad": "padding_token_id",
    "mask": "mask_token_id",
    "eot": "eot_token_id",
    "eom": "eom_token_id",
}
_ADD_KEYS = ("bos", "eos", "sep")  # add_<type>_token keys llama.cpp's writer has


@dataclass
class _Specials:
    """What llama.cpp's ``gguf.SpecialVocab`` finds in a folder, in its order."""

    ids: dict[str, int] = field(default_factory=dict)
    add: dict[str, bool] = field(default_factory=dict)
    merges: list[str] = field(default_factory=list)
    chat_template: str | None = None
    lowercase: bool | None = None
    strip_accents: bool | None = None


def _parse_normalizer(sv: _Specials, normalizer: Any) -> None:
    if not isinstance(normalizer, dict):
        return
    kind = normalizer.get("type")
    if kind == "Lowercase":
        sv.lowercase = True
    elif kind == "StripAccents":
        sv.strip_accents = True
    elif kind == "BertNormalizer":
        if "lowercase" in normalizer:
            sv.lowercase = bool(normalizer["lowercase"])
        if "strip_accents" in normalizer:
            sv.strip_accents = bool(normalizer["strip_accents"])
    elif kind == "Sequence":
        for n in normalizer.get("normalizers") or []:
            _parse_normalizer(sv, n)


def _merges(model: Any) -> list[str]:
    raw = model.get("merges") if isinstance(model, dict) else None
    out: list[str] = []
    for m in raw or []:
        if isinstance(m, str):
            out.append(m)
        elif isinstance(m, list) and len(m) == 2 and all(isinstance(p, str) for p in m):
            out.append(" ".join(p.replace(" ", "\u0120") for p in m))
        else:
            raise err(f"tokenizer.json: merge {m!r} is malformed", "model.merges", "merges are 'a b' or [a, b]")
    return out


def special_vocab(
    folder: Path,
    n_vocab: int,
    tj: dict[str, Any] | None,
    tc: dict[str, Any] | None,
    config_json: dict[str, Any],
    load_merges: bool,
) -> _Specials:
    """Special token ids, ``add_*_token`` flags, merges, chat template and
    normalizer flags as llama.cpp's ``gguf.SpecialVocab`` reads them:
    ``tokenizer.json`` (merges, normalizer, the post-processor's template),
    ``tokenizer_config.json`` (``*_token`` looked up among tokenizer.json's
    added tokens, ``add_*_token``, the chat template, else
    ``chat_template.jinja`` / ``chat_template.json``), then ``config.json``'s
    ``*_token_id`` for the types still unset. ``tc`` is changed as the
    converter changes it (its special tokens filled in from the template)."""
    sv = _Specials()
    types: list[str] = ["bos", "eos", "unk", "sep", "pad", "cls", "mask"]

    def set_id(typ: str, tid: Any) -> None:
        if not isinstance(tid, int) or isinstance(tid, bool):
            return
        if tid < 0:
            raise err(f"special token {typ} has id {tid}", f"{typ}_token_id", "token ids are not negative")
        if tid < n_vocab and typ not in sv.ids:
            sv.ids[typ] = tid

    added: list[Any] = []
    if tj is not None:
        if load_merges:
            sv.merges = _merges(tj.get("model"))
        _parse_normalizer(sv, tj.get("normalizer"))
        added = tj.get("added_tokens") or []
        if not isinstance(added, list):
            raise err("tokenizer.json: added_tokens is not a list", "added_tokens", "check tokenizer.json")
        cfg = tc if tc is not None else {}
        s_bos, s_cls = cfg.get("bos_token"), cfg.get("cls_token")
        s_eos, s_sep = cfg.get("eos_token"), cfg.get("sep_token")
        if not s_bos and s_cls and tc:
            tc["bos_token"] = s_bos = s_cls
        if not s_eos and s_sep and tc:
            tc["eos_token"] = s_eos = s_sep
        post = tj.get("post_processor")
        procs = post.get("processors", [post]) if isinstance(post, dict) else []
        for proc in procs if isinstance(procs, list) else []:
            kind = proc.get("type") if isinstance(proc, dict) else None
            if kind == "ByteLevel":
                sv.add.setdefault("bos", False)
                sv.add.setdefault("eos", False)
            elif kind == "RobertaProcessing":
                sv.add.update(bos=True, eos=True, sep=True)
                if not s_cls and tc:
                    s_cls = tc["cls_token"] = (proc.get("cls") or [s_bos])[0]
                if not s_sep and tc:
                    s_sep = tc["sep_token"] = (proc.get("sep") or [s_eos])[0]
            elif kind == "TemplateProcessing":
                single, pair = proc.get("single") or [], proc.get("pair") or []
                first = last = None
                if len(single) > 1:
                    first = (single[0].get("SpecialToken") or {}).get("id")
                    if first:
                        if not tc:
                            s_bos = first
                        elif first not in (s_bos, s_cls):
                            if not s_bos:
                                tc["bos_token"] = s_bos = first
                            if not s_cls:
                                tc["cls_token"] = s_cls = first
                        sv.add["bos"] = first in (s_bos, s_cls)
                    last = (single[-1].get("SpecialToken") or {}).get("id")
                    if last:
                        if not tc:
                            s_eos = last
                        elif last != s_eos:
                            if "eot" not in types:
                                types.append("eot")
                                tc["eot_token"] = s_eos
                            elif "eom" not in types:
                                types.append("eom")
                                tc["eom_token"] = s_eos
                            tc["eos_token"] = s_eos = last
                        sv.add["eos"] = last == s_eos
                if pair:
                    start = 1 if first and (pair[0].get("SpecialToken") or {}).get("id") == first else 0
                    stop = -1 if last and (pair[-1].get("SpecialToken") or {}).get("id") == last else None
                    pair = pair[slice(start, stop)]
                    if pair:
                        a = (pair[0].get("Sequence") or {}).get("id")
                        b = (pair[-1].get("Sequence") or {}).get("id")
                        middle = pair[1:-1]
                        if a == "A" and b == "B" and middle:
                            add_sep = False
                            entry = (middle[0].get("SpecialToken") or {}).get("id")
                            if entry and entry in (s_sep, s_eos) and not last:
                                add_sep = True
                            if len(middle) == 2:
                                entry = (middle[1].get("SpecialToken") or {}).get("id")
                                if entry and entry in (s_sep, s_eos):
                                    add_sep = True
                            sv.add["sep"] = add_sep
                            if add_sep and not s_sep and tc:
                                tc["sep_token"] = s_eos
    if tc:
        template: Any = None
        if (folder / "chat_template.jinja").is_file():
            template = (folder / "chat_template.jinja").read_text(encoding="utf-8")
            if any((folder / "additional_chat_templates").glob("*.jinja")):
                raise err(
                    f"{folder}: additional_chat_templates holds several chat templates",
                    "additional_chat_templates",
                    "toy imports one chat template; remove the additional ones",
                )
        elif (folder / "chat_template.json").is_file():
            template = read_json(folder / "chat_template.json", "chat_template.json").get("chat_template")
        template = tc.get("chat_template", template)
        if isinstance(template, list):
            raise err(
                "tokenizer_config.json: chat_template is a list of named templates",
                "chat_template",
                "toy imports one chat template (a string); keep the default one",
            )
        if isinstance(template, str):
            sv.chat_template = template
        for typ in types:
            flag = tc.get(f"add_{typ}_token")
            if isinstance(flag, bool) and typ not in sv.add:
                sv.add[typ] = flag
            text = _token_text(tc.get(f"{typ}_token"))
            if text is None:
                continue
            set_id(typ, next((a.get("id") for a in added if isinstance(a, dict) and a.get("content") == text), None))
    for typ in types:
        tid = config_json.get(f"{typ}_token_id")
        if tid is None and isinstance(config_json.get("text_config"), dict):
            tid = config_json["text_config"].get(f"{typ}_token_id")
        set_id(typ, tid)
    return sv


def _special_entries(sv: _Specials) -> list[tuple[str, Any, TypeInfo]]:
    S, U32, B = TypeInfo(ValueType.STRING), TypeInfo(ValueType.UINT32), TypeInfo(ValueType.BOOL)
    out: list[tuple[str, Any, TypeInfo]] = []
    if sv.merges:
        out.append(("tokenizer.ggml.merges", sv.merges, TypeInfo(ValueType.ARRAY, S)))
    out += [(f"tokenizer.ggml.{_ID_KEYS[t]}", i, U32) for t, i in sv.ids.items() if t in _ID_KEYS]
    out += [(f"tokenizer.ggml.add_{t}_token", v, B) for t, v in sv.add.items() if t in _ADD_KEYS]
    if sv.chat_template is not None:
        out.append(("tokenizer.chat_template", sv.chat_template, S))
    if sv.lowercase is not None:
        out.append(("tokenizer.ggml.normalizer.lowercase", sv.lowercase, B))
    if sv.strip_accents is not None:
        out.append(("tokenizer.ggml.normalizer.strip_accents", sv.strip_accents, B))
    return out


# ------------------------------------------------------------------ SentencePiece

#: llama.cpp's token types a SentencePiece vocabulary adds to hf_common's
SENTENCEPIECE_HINT = "install the extra: pip install 'toy-core[sentencepiece]' (the sentencepiece package)"


def _sentencepiece() -> Any:
    try:
        import sentencepiece
    except ImportError:
        raise err(
            "this folder's tokenizer is a SentencePiece model (tokenizer.model), and the sentencepiece "
            "package that reads it is not installed",
            "tokenizer.model",
            SENTENCEPIECE_HINT,
        ) from None
    return sentencepiece


def sentencepiece_vocab(
    folder: Path, vocab_size: int, tc: dict[str, Any] | None
) -> tuple[list[str], np.ndarray, np.ndarray]:
    """(tokens, scores, types) of ``tokenizer.model`` as llama.cpp's
    ``_create_vocab_sentencepiece`` makes them: ``vocab_size`` entries
    (``[PAD<id>]``, score -10000, UNUSED where the model has no piece; pieces
    past ``vocab_size`` dropped), each piece's score and kind (UNKNOWN,
    CONTROL, UNUSED, BYTE, else NORMAL), then ``added_tokens.json`` (score
    -1000, USER_DEFINED) and ``tokenizer_config.json``'s
    ``added_tokens_decoder`` (score -1000; CONTROL if special or spelled
    like a control token, else USER_DEFINED with ``▁`` written as a space)."""
    spm = _sentencepiece()
    path = folder / "tokenizer.model"
    proc = spm.SentencePieceProcessor()
    try:
        proc.LoadFromFile(str(path))
    except (OSError, RuntimeError) as e:
        raise err(f"{path}: not a SentencePiece model ({e})", "tokenizer.model", "check tokenizer.model") from None
    tokens = [f"[PAD{i}]" for i in range(vocab_size)]
    scores = np.full(vocab_size, -10000.0, dtype=np.float32)
    types = np.full(vocab_size, TYPE_UNUSED, dtype=np.int32)
    for i in range(min(proc.vocab_size(), vocab_size)):
        tokens[i] = proc.IdToPiece(i)
        scores[i] = proc.GetScore(i)
        if proc.IsUnknown(i):
            types[i] = TYPE_UNKNOWN
        elif proc.IsControl(i):
            types[i] = TYPE_CONTROL
        elif proc.IsUnused(i):
            types[i] = TYPE_UNUSED
        elif proc.IsByte(i):
            types[i] = TYPE_BYTE
        else:
            types[i] = TYPE_NORMAL
    added_path = folder / "added_tokens.json"
    if added_path.is_file():
        for text, tid in read_json(added_path, "added_tokens.json").items():
            if not isinstance(tid, int) or isinstance(tid, bool) or tid < 0:
                raise err(f"added_tokens.json: {text!r} has id {tid!r}", "added_tokens.json", "ids are integers")
            if tid < vocab_size:
                tokens[tid], scores[tid], types[tid] = text, -1000.0, TYPE_USER_DEFINED
    decoder = (tc or {}).get("added_tokens_decoder") or {}
    if not isinstance(decoder, dict):
        raise err("tokenizer_config.json: added_tokens_decoder is not an object", "added_tokens_decoder",
                  "it maps ids to tokens")  # fmt: skip
    for key, entry in decoder.items():
        content = entry.get("content") if isinstance(entry, dict) else None
        if not isinstance(content, str) or not str(key).isdigit():
            raise err(f"tokenizer_config.json: added token {key!r} is malformed", "added_tokens_decoder",
                      "each entry is an id with a content string")  # fmt: skip
        tid, text = int(key), content
        if tid >= vocab_size:
            continue
        if entry.get("special") or looks_special(text):
            types[tid] = TYPE_CONTROL
        else:
            text = text.replace("\u2581", " ")
            types[tid] = TYPE_USER_DEFINED
        scores[tid] = -1000.0
        tokens[tid] = text
    return tokens, scores, types


# ------------------------------------------------------------------ the keys


def tokenizer_metadata(
    folder: Path, vocab_size: int, arch: str, config_json: dict[str, Any]
) -> list[tuple[str, Any, TypeInfo]]:
    """The ``tokenizer.*`` keys of the folder's tokenizer, in the converter's
    order (module docstring); ``arch`` decides whether a ``tokenizer.model``
    is read (its family's ``HFFamily.sentencepiece``)."""
    from toy import models

    tc_path = folder / "tokenizer_config.json"
    tc = read_json(tc_path, "tokenizer_config.json") if tc_path.is_file() else None
    tj_path = folder / "tokenizer.json"
    S = TypeInfo(ValueType.STRING)
    sentencepiece = getattr(models.hf_family(arch), "sentencepiece", ())
    if arch in sentencepiece and (folder / "tokenizer.model").is_file():
        tj = read_json(tj_path, "tokenizer.json") if tj_path.is_file() else None
        pieces, scores, kinds = sentencepiece_vocab(folder, vocab_size, tc)
        sv = special_vocab(folder, len(pieces), tj, tc, config_json, load_merges=False)
        return [
            ("tokenizer.ggml.model", "llama", S),
            ("tokenizer.ggml.pre", "default", S),
            ("tokenizer.ggml.tokens", pieces, TypeInfo(ValueType.ARRAY, S)),
            ("tokenizer.ggml.scores", scores, TypeInfo(ValueType.ARRAY, TypeInfo(ValueType.FLOAT32))),
            ("tokenizer.ggml.token_type", kinds, TypeInfo(ValueType.ARRAY, TypeInfo(ValueType.INT32))),
            *_special_entries(sv),
        ]
    if not tj_path.is_file():
        raise err(
            f"{folder}: no tokenizer.json or tokenizer.model",
            "tokenizer.json",
            "toy imports the tokenizer from tokenizer.json (BPE) or tokenizer.model (SentencePiece); save it "
            "with the model: tokenizer.save_pretrained",
        )
    tj = read_json(tj_path, "tokenizer.json")
    model = tj.get("model")
    if not isinstance(model, dict) or model.get("type") != "BPE" or not isinstance(model.get("vocab"), dict):
        kind = model.get("type") if isinstance(model, dict) else None
        raise err(
            f"tokenizer.json: model type {kind!r} is not byte-level BPE",
            "model.type",
            "toy imports BPE tokenizers from tokenizer.json (Llama 3, Qwen, SmolLM, GPT-2 style) and "
            "SentencePiece ones from tokenizer.model",
        )
    pre = pre_tokenizer_name(tj.get("pre_tokenizer"))
    vocab: dict[int, str] = {}
    for tok, i in model["vocab"].items():
        if not isinstance(i, int):
            raise err(f"tokenizer.json: token {tok!r} has id {i!r}", "model.vocab", "ids are integers")
        vocab[i] = tok
    added = tj.get("added_tokens") or []
    added_by_id: dict[int, dict[str, Any]] = {}
    for a in added:
        if not isinstance(a, dict) or not isinstance(a.get("id"), int) or not isinstance(a.get("content"), str):
            raise err(f"tokenizer.json: added token {a!r} is malformed", "added_tokens", "each has an id and content")
        added_by_id[a["id"]] = a
        vocab[a["id"]] = a["content"]
    if vocab and max(vocab) >= vocab_size:
        raise err(
            f"tokenizer.json has token id {max(vocab)}, config.json's vocab_size is {vocab_size}",
            "vocab_size",
            "the tokenizer and the model do not belong together",
        )
    tokens: list[str] = []
    types = np.empty(vocab_size, dtype=np.int32)
    for i in range(vocab_size):
        tok = vocab.get(i)
        if tok is None:
            tokens.append(f"[PAD{i}]")
            types[i] = TYPE_UNUSED
            continue
        a = added_by_id.get(i)
        if a is None:
            types[i] = TYPE_NORMAL
        elif a.get("special") or looks_special(tok):
            types[i] = TYPE_CONTROL
        else:
            types[i] = TYPE_USER_DEFINED
        tokens.append(tok)
    _merges(model)  # malformed merges are an error even when the special vocabulary would not read them
    sv = special_vocab(folder, vocab_size, tj, tc, config_json, load_merges=True)

    return [
        ("tokenizer.ggml.model", "gpt2", S),
        ("tokenizer.ggml.pre", pre, S),
        ("tokenizer.ggml.tokens", tokens, TypeInfo(ValueType.ARRAY, S)),
        ("tokenizer.ggml.token_type", types, TypeInfo(ValueType.ARRAY, TypeInfo(ValueType.INT32))),
        *_special_entries(sv),
    ]
