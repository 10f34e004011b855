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
"""

from __future__ import annotations

import json
import os
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


def export_hf(
    tokenizer: Tokenizer, template: ChatTemplate, folder: str | os.PathLike[str], n_ctx: int | None = None
) -> list[Path]:
    """Write the Hugging Face tokenizer folder; returns the files written."""
    out = Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    specials = special_tokens(tokenizer)
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
    _with_post_processor(tokenizer).save(str(paths[0]))
    paths[1].write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    special_map = {k: v for k, v in specials.items() if v is not None}
    paths[2].write_text(json.dumps(special_map, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    return paths


__all__ = ["export_hf", "special_tokens", "tokenizer_info"]
