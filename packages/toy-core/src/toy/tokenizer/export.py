"""A GGUF model's tokenizer as a Hugging Face tokenizer folder, and as the
``/tokenizer_info`` description servers publish.

``export_hf(tokenizer, template, folder)`` writes ``tokenizer.json`` (the
``tokenizers`` pipeline toy encodes with, plus a post-processor that adds
BOS/EOS where the GGUF file says to), ``tokenizer_config.json`` (the special
tokens, the chat template, ``model_max_length``) and
``special_tokens_map.json``. ``transformers.AutoTokenizer.from_pretrained``
(a ``PreTrainedTokenizerFast``) then encodes as ``toy`` does, with
``add_special_tokens=True`` as the file's ``add_bos_token``/``add_eos_token``
say, and its ``apply_chat_template`` renders the model's template. Tools
that insist on a tokenizer folder (lm-evaluation-harness with a
``tokenizer=`` argument, vLLM-style clients) can use it offline.

Decisions: special tokens are written as their text (``<|im_end|>``);
``pad_token`` is the file's padding token or, when it has none, EOS
(evaluation harnesses pad with it and never score it); a template-less file
gets toy's default ChatML template, as ``toy infer --chat`` uses.

A SentencePiece vocabulary (``tokenizer.ggml.model`` "llama": Gemma, Llama 2)
also gets ``tokenizer.model`` when ``export_hf`` is given the file's
``metadata`` (``sentencepiece_model``): a SentencePiece ``ModelProto`` built
with the ``sentencepiece`` package's own protobuf module (toy-core's optional
``sentencepiece`` extra, imported only then; without it the file is skipped
and a note says so), so that llama.cpp's ``convert_hf_to_gguf.py`` and
``toy convert``, which read such a vocabulary from ``tokenizer.model``, get
the file's tokens, scores and types back. The pieces keep their text and
score; their kind follows the GGUF token type (normal, unknown, control,
user-defined, unused, byte), except that the added tokens llama.cpp's
converter scored -1000 (Gemma's ``<start_of_turn>``) are user-defined pieces,
which SentencePiece matches in text as Hugging Face does, and the unknown id
is SentencePiece's one unknown piece. Where the model alone would not give a
token's GGUF type back, ``tokenizer_config.json``'s ``added_tokens_decoder``
lists it (special for control tokens), as ``save_pretrained`` writes it and
both converters read it. The trainer spec says BPE (what llama.cpp's SPM
tokenizer is: merges by score), the unk/bos/eos/pad ids, and byte fallback
when there are byte pieces; the normalizer is the identity with
SentencePiece's whitespace escaping, and a dummy prefix as
``tokenizer.ggml.add_space_prefix`` says.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tokenizers import Tokenizer as HFTokenizer
from tokenizers.processors import TemplateProcessing

if TYPE_CHECKING:
    from toy.tokenizer.chat import ChatTemplate
    from toy.tokenizer.tokenizer import Tokenizer


def _text(tokenizer: Tokenizer, token_id: int | None) -> str | None:
    if token_id is None:
        return None
    return tokenizer.token_to_piece(token_id).decode("utf-8", errors="replace")


def special_tokens(tokenizer: Tokenizer) -> dict[str, str | None]:
    """bos/eos/unk/pad token texts (pad falls back to eos)."""
    eos = _text(tokenizer, tokenizer.eos_id)
    pad = _text(tokenizer, tokenizer.pad_id)
    return {
        "bos_token": _text(tokenizer, tokenizer.bos_id),
        "eos_token": eos,
        "unk_token": _text(tokenizer, tokenizer.unk_id),
        "pad_token": pad if pad is not None else eos,
    }


def _matched_specials(tokenizer: Tokenizer) -> dict[str, str | None]:
    """``special_tokens`` without the ones that are ordinary vocabulary
    entries: transformers makes every named special token an added token
    that it splits out of any text, so naming an ordinary token (a GGUF whose
    padding id is ``"``) would tokenize text differently from toy. Control
    tokens and the tokenizer's added tokens are named; the ids stay in
    config.json either way."""
    added = {t.content for t in tokenizer.hf.get_added_tokens_decoder().values()}
    ids = {"bos_token": tokenizer.bos_id, "eos_token": tokenizer.eos_id, "unk_token": tokenizer.unk_id}
    ids["pad_token"] = tokenizer.pad_id if tokenizer.pad_id is not None else tokenizer.eos_id
    out: dict[str, str | None] = {}
    for key, text in special_tokens(tokenizer).items():
        tid = ids[key]
        out[key] = text if tid is not None and (tokenizer.is_control(tid) or text in added) else None
    return out


def tokenizer_info(tokenizer: Tokenizer, template: ChatTemplate, n_ctx: int | None = None) -> dict[str, Any]:
    """What ``GET /tokenizer_info`` answers (vLLM's shape, which lm-evaluation-harness reads)."""
    info: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        **special_tokens(tokenizer),
        "chat_template": template.source,
        "add_bos_token": bool(tokenizer.add_bos),
        "add_eos_token": bool(tokenizer.add_eos),
        "vocab_size": tokenizer.vocab_size,
    }
    if n_ctx is not None:
        info["model_max_length"] = n_ctx
    return info


def _with_post_processor(tokenizer: Tokenizer) -> HFTokenizer:
    hf = HFTokenizer.from_str(tokenizer.hf.to_str())
    bos, eos = tokenizer.bos_id, tokenizer.eos_id
    add_bos = bool(tokenizer.add_bos) and bos is not None
    add_eos = bool(tokenizer.add_eos) and eos is not None
    if add_bos or add_eos:
        b, e = _text(tokenizer, bos), _text(tokenizer, eos)
        single = (f"{b} " if add_bos else "") + "$A" + (f" {e}" if add_eos else "")
        pair = single + " " + (f"{b}:1 " if add_bos else "") + "$B:1" + (f" {e}:1" if add_eos else "")
        specials = ([(b, bos)] if add_bos else []) + ([(e, eos)] if add_eos and e != b else [])
        hf.post_processor = TemplateProcessing(single=single, pair=pair, special_tokens=specials)
    else:
        hf.post_processor = None
    return hf


# ------------------------------------------------------------------ SentencePiece (tokenizer.model)

SENTENCEPIECE_EXTRA = "toy-core[sentencepiece]"
_ADDED_SCORE = -1000.0  # the score llama.cpp's converter gives added tokens


def _pb2() -> Any:
    """``sentencepiece``'s protobuf module (ImportError without the package or protobuf)."""
    from sentencepiece import sentencepiece_model_pb2

    return sentencepiece_model_pb2


def _meta_id(metadata: Mapping[str, Any], key: str) -> int | None:
    v = metadata.get(f"tokenizer.ggml.{key}")
    return None if v is None or isinstance(v, (bool, str)) else int(v)


def _spm_plan(metadata: Mapping[str, Any]) -> tuple[list[str], list[float], list[int], dict[int, bool], dict[str, int]]:
    """(pieces, scores, SentencePiece kinds, {id: special} of the tokens ``added_tokens_decoder`` must list,
    the unk/bos/eos/pad ids). SentencePiece's piece kinds have llama.cpp's token type numbers (NORMAL 1,
    UNKNOWN 2, CONTROL 3, USER_DEFINED 4, UNUSED 5, BYTE 6)."""
    from toy.tokenizer import vocab as v

    tokens = [str(t) for t in metadata["tokenizer.ggml.tokens"]]
    n = len(tokens)
    raw_scores = metadata.get("tokenizer.ggml.scores")
    scores = [float(x) for x in raw_scores] if raw_scores is not None else [0.0] * n
    raw_types = metadata.get("tokenizer.ggml.token_type")
    types = [int(x) for x in raw_types] if raw_types is not None else [v.TYPE_NORMAL] * n
    unk = _meta_id(metadata, "unknown_token_id")
    if unk is None or not 0 <= unk < n:  # llama.cpp's default for SPM is 0; the file's own UNKNOWN token first
        unk = next((i for i, t in enumerate(types) if t == v.TYPE_UNKNOWN), 0)
    ids = {"unk": unk}
    for key, name in (("bos", "bos_token_id"), ("eos", "eos_token_id"), ("pad", "padding_token_id")):
        i = _meta_id(metadata, name)
        if i is not None and 0 <= i < n and i != unk:
            ids[key] = i
    reserved = set(ids.values())
    pieces, kinds, decoder = [], [], {}
    for i, (text, score, typ) in enumerate(zip(tokens, scores, types, strict=True)):
        if i == unk:
            kind = v.TYPE_UNKNOWN  # SentencePiece has exactly one unknown piece
        elif typ == v.TYPE_USER_DEFINED or (typ == v.TYPE_CONTROL and score == _ADDED_SCORE and i not in reserved):
            kind = v.TYPE_USER_DEFINED  # an added token: matched in text, as Hugging Face matches it
        elif typ == v.TYPE_UNKNOWN:
            kind = v.TYPE_CONTROL  # a second unknown token
        elif typ in (v.TYPE_NORMAL, v.TYPE_CONTROL, v.TYPE_UNUSED, v.TYPE_BYTE):
            kind = typ
        else:
            kind = v.TYPE_NORMAL
        if typ == v.TYPE_USER_DEFINED:
            text = text.replace(" ", "\u2581")  # the converter wrote the piece's ▁ as a space
        # what the converter reads back from the kind alone (a user-defined piece reads as NORMAL); the
        # control and user-defined tokens it would get wrong come from added_tokens_decoder
        back = v.TYPE_NORMAL if kind == v.TYPE_USER_DEFINED else kind
        if back != typ and typ in (v.TYPE_CONTROL, v.TYPE_USER_DEFINED):
            decoder[i] = typ == v.TYPE_CONTROL
        pieces.append(text)
        kinds.append(kind)
    return pieces, scores, kinds, decoder, ids


def sentencepiece_model(metadata: Mapping[str, Any], add_space_prefix: bool) -> bytes:
    """The serialized SentencePiece ``ModelProto`` of a GGUF SentencePiece
    vocabulary (module docstring); ImportError without the ``sentencepiece``
    extra."""
    pb2 = _pb2()
    pieces, scores, kinds, _, ids = _spm_plan(metadata)
    m = pb2.ModelProto()
    for text, score, kind in zip(pieces, scores, kinds, strict=True):
        p = m.pieces.add()
        p.piece, p.score, p.type = text, score, kind
    t = m.trainer_spec
    t.model_type = pb2.TrainerSpec.BPE  # llama.cpp's SPM tokenizer: SentencePiece BPE, merges by score
    t.vocab_size = len(pieces)
    t.hard_vocab_limit = False
    t.byte_fallback = pb2.ModelProto.SentencePiece.BYTE in kinds
    t.unk_id, t.unk_piece = ids["unk"], pieces[ids["unk"]]
    for key in ("bos", "eos", "pad"):
        setattr(t, f"{key}_id", ids.get(key, -1))
        if key in ids:
            setattr(t, f"{key}_piece", pieces[ids[key]])
    ns = m.normalizer_spec
    ns.name = "identity"
    ns.precompiled_charsmap = b""
    ns.add_dummy_prefix = bool(add_space_prefix)
    ns.remove_extra_whitespaces = False
    ns.escape_whitespaces = True
    data: bytes = m.SerializeToString()
    return data


def _added_tokens_decoder(tokenizer: Tokenizer, metadata: Mapping[str, Any]) -> dict[str, Any]:
    """``tokenizer_config.json``'s ``added_tokens_decoder``: the tokens ``tokenizer.model`` alone would not
    type as the file does, with tokenizer.json's flags."""
    decoder = _spm_plan(metadata)[3]
    tokens = metadata["tokenizer.ggml.tokens"]
    hf_added = tokenizer.hf.get_added_tokens_decoder()
    out: dict[str, Any] = {}
    for i, special in decoder.items():
        a = hf_added.get(i)
        out[str(i)] = {
            "content": str(tokens[i]),
            "lstrip": bool(a.lstrip) if a is not None else False,
            "normalized": bool(a.normalized) if a is not None else not special,
            "rstrip": bool(a.rstrip) if a is not None else False,
            "single_word": bool(a.single_word) if a is not None else False,
            "special": special,
        }
    return out


def export_hf(
    tokenizer: Tokenizer,
    template: ChatTemplate,
    folder: str | os.PathLike[str],
    n_ctx: int | None = None,
    *,
    metadata: Mapping[str, Any] | None = None,
    notes: list[str] | None = None,
) -> list[Path]:
    """Write the Hugging Face tokenizer folder; returns the files written. With the GGUF ``metadata`` of a
    SentencePiece vocabulary it also writes ``tokenizer.model`` (module docstring); when it cannot (no
    ``sentencepiece``), a sentence saying so is appended to ``notes``."""
    out = Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    specials = _matched_specials(tokenizer)
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        **{k: v for k, v in specials.items() if v is not None},
        "chat_template": template.source,
        "add_bos_token": bool(tokenizer.add_bos),
        "add_eos_token": bool(tokenizer.add_eos),
        "clean_up_tokenization_spaces": False,
        "model_max_length": n_ctx if n_ctx is not None else 1_000_000_000,
    }
    paths = [out / "tokenizer.json", out / "tokenizer_config.json", out / "special_tokens_map.json"]
    if metadata is not None and metadata.get("tokenizer.ggml.model") == "llama":  # SentencePiece
        decoder = _added_tokens_decoder(tokenizer, metadata)
        if decoder:
            config["added_tokens_decoder"] = decoder
        try:
            model = sentencepiece_model(metadata, tokenizer.vocab.add_space_prefix)
        except ImportError as e:
            if notes is not None:
                notes.append(
                    f"tokenizer.model (the SentencePiece vocabulary llama.cpp's converter and `toy convert` read) "
                    f"was not written: {e.name or 'sentencepiece'} is not installed; "
                    f"pip install '{SENTENCEPIECE_EXTRA}' adds it"
                )
        else:
            (out / "tokenizer.model").write_bytes(model)
            paths.append(out / "tokenizer.model")
    _with_post_processor(tokenizer).save(str(paths[0]))
    paths[1].write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    special_map = {k: v for k, v in specials.items() if v is not None}
    paths[2].write_text(json.dumps(special_map, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    return paths


__all__ = ["SENTENCEPIECE_EXTRA", "export_hf", "sentencepiece_model", "special_tokens", "tokenizer_info"]
