"""Import a Hugging Face model folder into one GGUF file, without torch,
transformers or llama.cpp's converter.

``import_hf(folder, out, type="f32")`` reads ``config.json``, the
safetensors weights (``toy.convert.safetensors_io``: one file or shards with
an index; F32, F16, BF16) and the tokenizer (``tokenizer.json``,
``tokenizer_config.json``), and writes ``out`` with the metadata keys,
tensor names, tensor layout and tensor types llama.cpp's
``convert_hf_to_gguf.py`` (the one of the pinned llama-cpp-python sdist)
writes for the same folder. Supported: ``LlamaForCausalLM``,
``Qwen2ForCausalLM``, ``Qwen3ForCausalLM``.

How it streams: every header is read first, so the GGUF header (names,
shapes, types, offsets) is known before a weight is touched; then each
tensor goes in blocks of rows (``BLOCK_BYTES`` of source, whole heads
where the Q/K rows are permuted): a block is mapped, converted, appended
and its memory released before the next. Peak memory is a few blocks plus
Python's, not a tensor and not the model. The file is written under a temporary name in OUT's folder and
renamed at the end; on any error the temporary file is removed and OUT is
left as it was.

Conversions, as the converter does them:

- BF16 weights are widened to float32 (exact); F16 stay F16 until the
  output type is applied.
- Types: 1-D tensors and ``*_norm.weight`` are F32 whatever ``type`` is;
  other tensors get ``type`` (F32, F16, BF16 or Q8_0). A Q8_0 tensor whose
  rows are not a multiple of 32 falls back to F16. F16 is NumPy's
  round-to-nearest-even, BF16 is round-to-nearest-even on the top 16 bits
  (NaN kept quiet), Q8_0 is ggml's reference quantizer.
- Llama's Q and K projections: Hugging Face stores each head's rows in the
  "rotate half" order (the two members of a RoPE pair are ``head_dim/2``
  rows apart); llama.cpp's ``llama`` architecture rotates adjacent pairs
  (rows ``2i, 2i+1``). So the rows of each head are interleaved back: the
  head's ``(2, head_dim/2)`` row grid is transposed. Qwen2/Qwen3 use
  llama.cpp's NEOX rotation, which is HF's order, and are copied as they are.
- Tied embeddings: a folder without ``lm_head.weight`` gets no
  ``output.weight``; toy and llama.cpp then use ``token_embd.weight``.

The tokenizer (byte-level BPE only): tokens by id (ids below
``vocab_size`` that the tokenizer does not use become ``[PAD<id>]`` of type
UNUSED), types (added tokens marked special, or spelled ``<|...|>``, are
CONTROL; other added tokens USER_DEFINED; the rest NORMAL), merges, special
token ids (``tokenizer_config.json``'s ``*_token`` looked up among the added
tokens, then ``config.json``'s ``*_token_id``), ``add_bos``/``add_eos``
(from the post-processor, then ``tokenizer_config.json``), the chat template.

``tokenizer.ggml.pre`` (how llama.cpp splits text before BPE): llama.cpp's
converter tokenizes a probe text and looks the hash of the ids up in a
table. toy instead reads the pre-tokenizer definition in ``tokenizer.json``
and names it when it is one of the splits ``toy.tokenizer.pretok`` knows:
GPT-2's byte-level regex (``gpt-2``), the Llama 3 regex (``llama-bpe``), the
Qwen2 regex (``qwen2``), single digits then GPT-2 (``smollm``), llama.cpp's
fallback split (``default``), whether spelled as Hugging Face files spell
them or as toy's own tokenizer export writes them. Any other
definition is refused with an error naming it, rather than guessed. Where
several llama.cpp names share one split (the converter's hash also sees the
vocabulary), toy writes the name listed here, so that key can differ from
the converter's while the tokenization is the same.

Naming keys: ``general.name`` is ``name`` or the folder's name; the
converter's guesses of ``general.basename``/``finetune``/``version`` from the
folder name and model card are not reproduced (the one stated exception to
byte equality besides ``tokenizer.ggml.pre`` above).

Refused with ``HFImportError`` naming the field or tensor: an architecture
outside the list, a config field of the wrong type or missing, a
``rope_scaling`` other than none, ``hidden_act`` other than silu,
``mlp_bias``, a tensor the mapping does not know, a missing tokenizer.
"""

from __future__ import annotations

import json
import os
import re
import struct
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

import toy_ggml
from toy.convert.safetensors_io import SafetensorsFolder
from toy.errors import BadInputError
from toy.gguf.constants import DEFAULT_ALIGNMENT, MAGIC, ValueType
from toy.gguf.reader import TypeInfo
from toy.gguf.writer import _encode, publish

GGMLType = toy_ggml.GGMLType

#: HF ``architectures[0]`` -> GGUF architecture name
ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}

#: output type name -> (ggml type of 2-D weights, general.file_type)
TYPES: dict[str, tuple[GGMLType, int]] = {
    "f32": (GGMLType.F32, 0),
    "f16": (GGMLType.F16, 1),
    "bf16": (GGMLType.BF16, 32),
    "q8_0": (GGMLType.Q8_0, 7),
}

# per-layer HF name (after "model.layers.{i}.") -> GGUF name (after "blk.{i}.")
LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}
GLOBAL_NAMES = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
# HF buffers some checkpoints carry that no GGUF file holds
SKIPPED_SUFFIXES = (".rotary_emb.inv_freq",)

_LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)")

TOKEN_NORMAL, TOKEN_CONTROL, TOKEN_USER_DEFINED, TOKEN_UNUSED = 1, 3, 4, 5
SPECIAL_TYPES = ("bos", "eos", "unk", "sep", "pad", "cls", "mask")
_KEY_IDS = {
    "bos": "bos",
    "eos": "eos",
    "unk": "unknown",
    "sep": "seperator",
    "pad": "padding",
    "cls": "cls",
    "mask": "mask",
}


class HFImportError(BadInputError):
    """A Hugging Face folder toy cannot import as it is."""


@dataclass
class ImportReport:
    folder: Path
    out: Path
    arch: str
    type: str
    n_tensors: int = 0
    n_params: int = 0
    bytes_out: int = 0
    seconds: float = 0.0
    tied: bool = False
    pre: str = ""
    type_counts: dict[str, int] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        d = dict(self.__dict__)
        d["folder"], d["out"] = str(self.folder), str(self.out)
        return d


# ------------------------------------------------------------------ config


def _err(msg: str, field: str, hint: str) -> HFImportError:
    return HFImportError(msg, hint, field=field)


def _read_json(path: Path, what: str) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise _err(f"{path}: no such file", path.name, f"a Hugging Face model folder has a {what}") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise _err(f"{path}: not readable JSON ({e})", path.name, f"check the {what}") from None
    if not isinstance(data, dict):
        raise _err(f"{path}: not a JSON object", path.name, f"check the {what}")
    return data


def _int(cfg: dict[str, Any], key: str, default: int | None = None, positive: bool = True) -> int:
    v = cfg.get(key, default)
    if v is None:
        raise _err(f"config.json: {key} is missing", key, f"config.json must give {key} (an integer)")
    if not isinstance(v, int) or isinstance(v, bool) or (positive and v <= 0):
        raise _err(f"config.json: {key} is {v!r}, not a positive integer", key, f"set {key} to a positive integer")
    return v


def _float(cfg: dict[str, Any], key: str, default: float | None = None) -> float:
    v = cfg.get(key, default)
    if v is None:
        raise _err(f"config.json: {key} is missing", key, f"config.json must give {key} (a number)")
    if not isinstance(v, (int, float)) or isinstance(v, bool) or not np.isfinite(v) or v <= 0:
        raise _err(f"config.json: {key} is {v!r}, not a positive number", key, f"set {key} to a positive number")
    return float(v)


@dataclass
class _Config:
    hf_arch: str
    arch: str
    n_layer: int
    d_model: int
    d_ff: int
    n_head: int
    n_head_kv: int
    n_ctx: int
    eps: float
    vocab: int
    rope_theta: float | None
    head_dim: int | None  # config.json's head_dim, when it has one


def read_config(folder: Path) -> _Config:
    cfg = _read_json(folder / "config.json", "config.json")
    archs = cfg.get("architectures")
    if not isinstance(archs, list) or not archs or not isinstance(archs[0], str):
        raise _err(
            "config.json: architectures is missing or not a list of names",
            "architectures",
            'it names the model class, e.g. ["LlamaForCausalLM"]',
        )
    hf_arch = archs[0]
    if hf_arch not in ARCHITECTURES:
        raise _err(
            f"config.json: architecture {hf_arch!r} is not one toy imports",
            "architectures",
            f"toy imports {', '.join(ARCHITECTURES)}",
        )
    act = cfg.get("hidden_act", "silu")
    if act != "silu":
        raise _err(f"config.json: hidden_act {act!r} is not silu", "hidden_act", "toy's llama family uses SiLU")
    if cfg.get("mlp_bias"):
        raise _err("config.json: mlp_bias is true", "mlp_bias", "toy's llama family has no MLP biases")
    rs = cfg.get("rope_scaling")
    if rs is not None:
        rtype = rs.get("rope_type", rs.get("type")) if isinstance(rs, dict) else rs
        if rtype != "default":
            raise _err(
                f"config.json: rope_scaling type {rtype!r} is not supported by the importer",
                "rope_scaling",
                "toy imports models without RoPE scaling (rope_scaling null or rope_type 'default')",
            )
    n_head = _int(cfg, "num_attention_heads")
    n_head_kv = _int(cfg, "num_key_value_heads", n_head)
    if n_head % n_head_kv:
        raise _err(
            f"config.json: num_attention_heads {n_head} is not a multiple of num_key_value_heads {n_head_kv}",
            "num_key_value_heads",
            "grouped-query attention needs whole groups",
        )
    head_dim = cfg.get("head_dim")
    if head_dim is not None:
        head_dim = _int(cfg, "head_dim")
    theta = cfg.get("rope_theta")
    return _Config(
        hf_arch=hf_arch,
        arch=ARCHITECTURES[hf_arch],
        n_layer=_int(cfg, "num_hidden_layers"),
        d_model=_int(cfg, "hidden_size"),
        d_ff=_int(cfg, "intermediate_size"),
        n_head=n_head,
        n_head_kv=n_head_kv,
        n_ctx=_int(cfg, "max_position_embeddings"),
        eps=_float(cfg, "rms_norm_eps"),
        vocab=_int(cfg, "vocab_size"),
        rope_theta=None if theta is None else _float(cfg, "rope_theta"),
        head_dim=head_dim,
    )


# ------------------------------------------------------------------ tensors


def gguf_name(hf_name: str, n_layer: int) -> str | None:
    """The GGUF name of an HF llama-family tensor; None for a skipped buffer;
    HFImportError for a name the mapping does not know."""
    if hf_name.endswith(SKIPPED_SUFFIXES):
        return None
    if hf_name in GLOBAL_NAMES:
        return GLOBAL_NAMES[hf_name]
    m = _LAYER.fullmatch(hf_name)
    if m and m.group(2) in LAYER_NAMES and int(m.group(1)) < n_layer:
        return f"blk.{int(m.group(1))}.{LAYER_NAMES[m.group(2)]}"
    raise _err(
        f"tensor {hf_name!r} has no GGUF name in toy's llama-family mapping",
        hf_name,
        "the checkpoint holds a tensor this architecture does not have (an adapter, a vision tower, "
        "a layer past num_hidden_layers?)",
    )


def permute_rows(w: np.ndarray, n_head: int) -> np.ndarray:
    """Interleave each head's rows from HF's rotate-half order to adjacent
    pairs: within a head of ``r`` rows, the row grid ``(2, r/2)`` is
    transposed to ``(r/2, 2)``."""
    rows = w.shape[0]
    out: np.ndarray = w.reshape(n_head, 2, rows // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
    return out


def out_type(gname: str, shape: tuple[int, ...], target: GGMLType) -> GGMLType:
    if len(shape) <= 1 or gname.endswith("_norm.weight"):
        return GGMLType.F32
    if target == GGMLType.Q8_0 and shape[-1] % 32:
        return GGMLType.F16
    return target


def to_bf16(x: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bits (uint16), round to nearest even, NaN kept a quiet NaN."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    nan = (u & 0x7FFFFFFF) > 0x7F800000
    rounded = (u + (0x7FFF + ((u >> 16) & 1))) >> 16
    quiet = ((u >> 16) | 0x0040) & 0xFFFF
    return np.where(nan, quiet, rounded).astype(np.uint16)


def encode_tensor(x: np.ndarray, gt: GGMLType) -> bytes:
    if gt == GGMLType.F32:
        return np.ascontiguousarray(x, dtype=np.float32).tobytes()
    if gt == GGMLType.F16:
        return np.ascontiguousarray(x, dtype=np.float16).tobytes()
    if gt == GGMLType.BF16:
        return to_bf16(x).tobytes()
    return toy_ggml.quantize(np.ascontiguousarray(x, dtype=np.float32), int(gt)).tobytes()


def nbytes_of(shape: tuple[int, ...], gt: GGMLType) -> int:
    traits = toy_ggml.type_info(gt)
    n = 1
    for d in shape:
        n *= d
    return n // traits.block_size * traits.type_size


# ------------------------------------------------------------------ tokenizer

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
    raise _err(
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


def tokenizer_metadata(folder: Path, cfg: _Config, config_json: dict[str, Any]) -> list[tuple[str, Any, TypeInfo]]:
    tj_path = folder / "tokenizer.json"
    if not tj_path.is_file():
        raise _err(
            f"{folder}: no tokenizer.json",
            "tokenizer.json",
            "toy imports the tokenizer from tokenizer.json (save it with the model: tokenizer.save_pretrained)",
        )
    tj = _read_json(tj_path, "tokenizer.json")
    tc_path = folder / "tokenizer_config.json"
    tc = _read_json(tc_path, "tokenizer_config.json") if tc_path.is_file() else {}
    model = tj.get("model")
    if not isinstance(model, dict) or model.get("type") != "BPE" or not isinstance(model.get("vocab"), dict):
        kind = model.get("type") if isinstance(model, dict) else None
        raise _err(
            f"tokenizer.json: model type {kind!r} is not byte-level BPE",
            "model.type",
            "toy imports BPE tokenizers (Llama 3, Qwen, SmolLM, GPT-2 style); SentencePiece models are not imported yet",
        )
    pre = pre_tokenizer_name(tj.get("pre_tokenizer"))
    vocab: dict[int, str] = {}
    for tok, i in model["vocab"].items():
        if not isinstance(i, int):
            raise _err(f"tokenizer.json: token {tok!r} has id {i!r}", "model.vocab", "ids are integers")
        vocab[i] = tok
    added = tj.get("added_tokens") or []
    added_by_id: dict[int, dict[str, Any]] = {}
    for a in added:
        if not isinstance(a, dict) or not isinstance(a.get("id"), int) or not isinstance(a.get("content"), str):
            raise _err(f"tokenizer.json: added token {a!r} is malformed", "added_tokens", "each has an id and content")
        added_by_id[a["id"]] = a
        vocab[a["id"]] = a["content"]
    if vocab and max(vocab) >= cfg.vocab:
        raise _err(
            f"tokenizer.json has token id {max(vocab)}, config.json's vocab_size is {cfg.vocab}",
            "vocab_size",
            "the tokenizer and the model do not belong together",
        )
    tokens: list[str] = []
    types = np.empty(cfg.vocab, dtype=np.int32)
    for i in range(cfg.vocab):
        tok = vocab.get(i)
        if tok is None:
            tokens.append(f"[PAD{i}]")
            types[i] = TOKEN_UNUSED
            continue
        a = added_by_id.get(i)
        if a is None:
            types[i] = TOKEN_NORMAL
        elif a.get("special") or (tok.startswith("<|") and tok.endswith("|>")) or tok in ("<pad>", "<mask>"):
            types[i] = TOKEN_CONTROL
        else:
            types[i] = TOKEN_USER_DEFINED
        tokens.append(tok)
    merges_raw = model.get("merges") or []
    merges: list[str] = []
    for m in merges_raw:
        if isinstance(m, str):
            merges.append(m)
        elif isinstance(m, list) and len(m) == 2 and all(isinstance(p, str) for p in m):
            merges.append(" ".join(p.replace(" ", "\u0120") for p in m))
        else:
            raise _err(f"tokenizer.json: merge {m!r} is malformed", "model.merges", "merges are 'a b' or [a, b]")

    special: dict[str, int] = {}
    add: dict[str, bool] = {}
    post = tj.get("post_processor")
    if isinstance(post, dict):
        for p in post.get("processors", [post]) if post.get("type") == "Sequence" else [post]:
            if isinstance(p, dict) and p.get("type") == "ByteLevel":
                add.setdefault("bos", False)
                add.setdefault("eos", False)
            elif isinstance(p, dict) and p.get("type") == "TemplateProcessing":
                single = p.get("single") or []
                bos_t, eos_t = _token_text(tc.get("bos_token")), _token_text(tc.get("eos_token"))
                if len(single) > 1:
                    first = (single[0].get("SpecialToken") or {}).get("id")
                    last = (single[-1].get("SpecialToken") or {}).get("id")
                    if first:
                        add["bos"] = first == bos_t
                    if last:
                        add["eos"] = last == eos_t
    for typ in SPECIAL_TYPES:
        flag = tc.get(f"add_{typ}_token")
        if isinstance(flag, bool) and typ not in add:
            add[typ] = flag
        text = _token_text(tc.get(f"{typ}_token"))
        if text is None:
            continue
        tid = next((a["id"] for a in added if a["content"] == text), None)
        if isinstance(tid, int) and 0 <= tid < cfg.vocab:
            special.setdefault(typ, tid)
    for typ in SPECIAL_TYPES:
        tid = config_json.get(f"{typ}_token_id")
        if isinstance(tid, int) and not isinstance(tid, bool) and 0 <= tid < cfg.vocab:
            special.setdefault(typ, tid)

    S, U32, B = TypeInfo(ValueType.STRING), TypeInfo(ValueType.UINT32), TypeInfo(ValueType.BOOL)
    out: list[tuple[str, Any, TypeInfo]] = []
    if cfg.arch == "llama" and isinstance(tc.get("add_prefix_space"), bool):
        out.append(("tokenizer.ggml.add_space_prefix", tc["add_prefix_space"], B))
    out += [
        ("tokenizer.ggml.model", "gpt2", S),
        ("tokenizer.ggml.pre", pre, S),
        ("tokenizer.ggml.tokens", tokens, TypeInfo(ValueType.ARRAY, S)),
        ("tokenizer.ggml.token_type", types, TypeInfo(ValueType.ARRAY, TypeInfo(ValueType.INT32))),
    ]
    if merges:
        out.append(("tokenizer.ggml.merges", merges, TypeInfo(ValueType.ARRAY, S)))
    for typ in SPECIAL_TYPES:
        if typ in special:
            out.append((f"tokenizer.ggml.{_KEY_IDS[typ]}_token_id", special[typ], U32))
    for typ in SPECIAL_TYPES:
        if typ in add:
            out.append((f"tokenizer.ggml.add_{typ}_token", add[typ], B))
    template = tc.get("chat_template")
    if template is None:
        for name in ("chat_template.jinja",):
            if (folder / name).is_file():
                template = (folder / name).read_text(encoding="utf-8")
    if isinstance(template, str):
        out.append(("tokenizer.chat_template", template, S))
    return out


# ------------------------------------------------------------------ writing


def _size_label(n: int) -> str:
    """A parameter count as llama.cpp's converter labels it ("3.2M", "135M")."""
    scale, suffix = 1e-3, "K"
    for limit, sc, suf in ((1e12, 1e-12, "T"), (1e9, 1e-9, "B"), (1e6, 1e-6, "M")):
        if n > limit:
            scale, suffix = sc, suf
            break
    v = n * scale
    digits = max(2 - len(str(round(v)).lstrip("0")), 0)
    return f"{v:.{digits}f}{suffix}"


@dataclass
class _Plan:
    hf_name: str
    name: str
    shape: tuple[int, ...]
    type: GGMLType
    permute: int  # heads to permute by, 0 for none


def import_hf(
    folder: str | os.PathLike[str],
    out: str | os.PathLike[str],
    type: str = "f32",
    name: str | None = None,
    progress: Callable[[int, int, str], None] | None = None,
) -> ImportReport:
    """Convert the HF model in ``folder`` to the GGUF file ``out`` (see the
    module docstring); ``name`` is general.name (default: the folder's name)."""
    t0 = time.perf_counter()
    src = Path(folder)
    dst = Path(out)
    key = str(type).strip().lower()
    if key not in TYPES:
        raise _err(f"unknown output type {type!r}", "type", f"choose one of {', '.join(TYPES)}")
    target, file_type = TYPES[key]
    if not src.is_dir():
        raise _err(f"{src}: not a folder", "folder", "pass a Hugging Face model folder (config.json, *.safetensors)")
    config_json = _read_json(src / "config.json", "config.json")
    cfg = read_config(src)
    weights = SafetensorsFolder(src)

    plans: list[_Plan] = []
    for hf_name, ref in weights.tensors.items():
        gname = gguf_name(hf_name, cfg.n_layer)
        if gname is None:
            continue
        perm = 0
        if cfg.arch == "llama" and hf_name.endswith(("q_proj.weight", "q_proj.bias")):
            perm = cfg.n_head
        elif cfg.arch == "llama" and hf_name.endswith(("k_proj.weight", "k_proj.bias")):
            perm = cfg.n_head_kv
        if perm and ref.shape[0] % (2 * perm):
            raise _err(
                f"tensor {hf_name!r}: {ref.shape[0]} rows do not split into {perm} heads of pairs",
                hf_name,
                "the checkpoint does not match config.json's head counts",
            )
        plans.append(_Plan(hf_name, gname, ref.shape, out_type(gname, ref.shape, target), perm))
    names = {p.name for p in plans}
    want = ["token_embd.weight", "output_norm.weight"]
    for i in range(cfg.n_layer):
        want += [
            f"blk.{i}.{n}"
            for n in (
                "attn_norm.weight",
                "ffn_norm.weight",
                "attn_q.weight",
                "attn_k.weight",
                "attn_v.weight",
                "attn_output.weight",
                "ffn_gate.weight",
                "ffn_up.weight",
                "ffn_down.weight",
            )
        ]
    if cfg.arch == "qwen2":
        want += [f"blk.{i}.attn_{x}.bias" for i in range(cfg.n_layer) for x in "qkv"]
    if cfg.arch == "qwen3":
        want += [f"blk.{i}.attn_{x}_norm.weight" for i in range(cfg.n_layer) for x in "qk"]
    missing = [n for n in want if n not in names]
    if missing:
        raise _err(
            f"{src}: the weights lack {missing[0]}" + (f" and {len(missing) - 1} more" if len(missing) > 1 else ""),
            missing[0],
            "a shard may be missing, or the checkpoint is not a complete " + cfg.hf_arch,
        )
    emb = weights.tensors["model.embed_tokens.weight"].shape
    if emb != (cfg.vocab, cfg.d_model):
        raise _err(
            f"tensor 'model.embed_tokens.weight' has shape {emb}, config.json says ({cfg.vocab}, {cfg.d_model})",
            "model.embed_tokens.weight",
            "the weights and config.json do not belong together",
        )

    n_params = 0
    for p in plans:
        c = 1
        for d in p.shape:
            c *= d
        n_params += c
    arch = cfg.arch
    S, U32, F32 = TypeInfo(ValueType.STRING), TypeInfo(ValueType.UINT32), TypeInfo(ValueType.FLOAT32)
    meta: list[tuple[str, Any, TypeInfo]] = [
        ("general.architecture", arch, S),
        ("general.type", "model", S),
        ("general.name", name if name is not None else src.resolve().name, S),
        ("general.size_label", _size_label(n_params), S),
        (f"{arch}.block_count", cfg.n_layer, U32),
        (f"{arch}.context_length", cfg.n_ctx, U32),
        (f"{arch}.embedding_length", cfg.d_model, U32),
        (f"{arch}.feed_forward_length", cfg.d_ff, U32),
        (f"{arch}.attention.head_count", cfg.n_head, U32),
        (f"{arch}.attention.head_count_kv", cfg.n_head_kv, U32),
    ]
    if cfg.rope_theta is not None:
        meta.append((f"{arch}.rope.freq_base", cfg.rope_theta, F32))
    meta.append((f"{arch}.attention.layer_norm_rms_epsilon", cfg.eps, F32))
    if cfg.head_dim is not None:
        meta += [
            (f"{arch}.attention.key_length", cfg.head_dim, U32),
            (f"{arch}.attention.value_length", cfg.head_dim, U32),
        ]
    meta.append(("general.file_type", file_type, U32))
    if arch == "llama":
        rope_dim = cfg.head_dim if cfg.head_dim is not None else cfg.d_model // cfg.n_head
        meta += [(f"{arch}.vocab_size", cfg.vocab, U32), (f"{arch}.rope.dimension_count", rope_dim, U32)]
    meta.append(("general.quantization_version", 2, U32))
    meta += tokenizer_metadata(src, cfg, config_json)

    report = ImportReport(src, dst, arch, key, n_params=n_params, tied="output.weight" not in names)
    report.pre = next(v for k, v, _ in meta if k == "tokenizer.ggml.pre")
    _write(dst, meta, plans, weights, report, progress)
    report.seconds = time.perf_counter() - t0
    return report


#: rows converted at once: a tensor is read, permuted and encoded in blocks of about this many source bytes, so the
#: peak memory is a block's, not a whole embedding's (a 0.5B model's is 200 MB in F32)
BLOCK_BYTES = 16 << 20


def _row_blocks(p: _Plan) -> list[tuple[int, int, int]]:
    """``(start, stop, heads)`` blocks of ``p``'s rows, in order: whole heads
    when the rows are permuted (the permutation moves rows within a head
    only; ``heads`` is the block's head count, 0 for no permutation), and
    whole quantization rows always (a block holds whole rows)."""
    rows = p.shape[0] if p.shape else 1
    row_bytes = 4
    for d in p.shape[1:]:
        row_bytes *= d
    unit = rows // p.permute if p.permute else 1  # rows per head
    per_block = max(1, BLOCK_BYTES // max(1, row_bytes * unit)) * unit
    out = []
    for start in range(0, rows, per_block):
        stop = min(rows, start + per_block)
        out.append((start, stop, (stop - start) // unit if p.permute else 0))
    return out or [(0, rows, p.permute)]


def _write(
    dst: Path,
    meta: list[tuple[str, Any, TypeInfo]],
    plans: list[_Plan],
    weights: SafetensorsFolder,
    report: ImportReport,
    progress: Callable[[int, int, str], None] | None,
) -> None:
    a = DEFAULT_ALIGNMENT
    header: list[bytes] = [MAGIC, struct.pack("<IQQ", 3, len(plans), len(meta))]
    for k, v, info in meta:
        kb = k.encode()
        header += [struct.pack("<Q", len(kb)), kb, struct.pack("<I", int(info.type))]
        _encode(header, v, info, k)
    offset = 0
    sizes = []
    for p in plans:
        nb = p.name.encode()
        dims = tuple(reversed(p.shape))
        header.append(struct.pack("<Q", len(nb)) + nb + struct.pack("<I", len(dims)))
        header.append(struct.pack(f"<{len(dims)}Q", *dims))
        header.append(struct.pack("<IQ", int(p.type), offset))
        size = nbytes_of(p.shape, p.type)
        sizes.append(size)
        offset = (offset + size + a - 1) // a * a
    head = b"".join(header)
    dst.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{dst.name}.", suffix=".tmp", dir=dst.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(head)
            f.write(b"\0" * ((-len(head)) % a))
            for i, (p, size) in enumerate(zip(plans, sizes)):
                if progress is not None:
                    progress(i, len(plans), p.name)
                written = 0
                for start, stop, heads in _row_blocks(p):
                    x = weights.read_rows(p.hf_name, start, stop)
                    if heads:
                        x = permute_rows(x, heads)
                    data = encode_tensor(x, p.type)
                    del x
                    f.write(data)
                    written += len(data)
                    del data
                if written != size:  # a bug, not bad input
                    raise AssertionError(f"{p.name}: {written} bytes, expected {size}")
                f.write(b"\0" * ((-size) % a))
                report.type_counts[p.type.name] = report.type_counts.get(p.type.name, 0) + 1
            f.flush()
            os.fsync(f.fileno())
        publish(tmp, dst)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    report.n_tensors = len(plans)
    report.bytes_out = dst.stat().st_size
