"""Gemma 2 and Gemma 3's Hugging Face counterparts (``Gemma2ForCausalLM``,
``Gemma3ForCausalLM``), as data: the ``HF`` object ``toy.convert`` reads to
import and export them (types in ``toy.models.hf``).

Tensors: the names are llama's (``model.layers.{i}.self_attn.q_proj`` ...)
plus Gemma's four norms per block (``input_layernorm``,
``post_attention_layernorm``, ``pre_feedforward_layernorm``,
``post_feedforward_layernorm``) and, on Gemma 3, the per-head
``q_norm``/``k_norm``. Hugging Face's Gemma RMSNorm multiplies by ``1 + w``;
llama.cpp's converter stores ``1 + w`` (op ``"plus_one"`` on every
``*norm.weight``), so the graph multiplies by the stored gain. The
converter adds the 1 to the tensor as loaded: in float16 for an F16
checkpoint, in float32 for F32 and BF16 ones (BF16 is widened first); the
norm is written F32 either way. No Q/K row permutation: Gemma's RoPE is
the NeoX layout Hugging Face uses.

The head: Gemma 2's converter drops ``lm_head.weight`` (llama.cpp's gemma2
always uses the embedding), so a Gemma 2 row for it has no GGUF tensor and
no export fill; a Gemma 2 config that unties the head is refused. Gemma 3
keeps ``lm_head.weight`` as ``output.weight`` when the checkpoint has one.

Metadata (``metadata_from_hf``): the keys ``Gemma2Model`` /
``Gemma3Model.set_gguf_parameters`` write, in their order and types, with
``general.file_type`` as a placeholder row where the converter writes it
(the engine fills the value). The converter reads ``config.json`` through
``transformers.AutoConfig``, so a field the file omits takes the
configuration class's default (``DEFAULTS``: transformers 4.57's
``Gemma2Config`` / ``Gemma3TextConfig``); the counts that size the model
are required here. Gemma 3's RoPE (the global layers' base, linear scaling,
the sliding layers' base) is read from ``rope_scaling`` / ``rope_theta`` /
``rope_local_base_freq`` or from the newer ``rope_parameters`` with its
``full_attention`` / ``sliding_attention`` parts, as the converter reads it.
The tokenizer is a SentencePiece model (``tokenizer.model``,
``toy.convert.hf_tokenizer``); the converter then adds
``tokenizer.ggml.add_space_prefix`` = false after the tokenizer keys
(``tokenizer_metadata_after``).

Refused (``HFMappingError`` naming the field), because the converter would
write a file whose model (llama.cpp's graph, toy's ``toy.models.gemma``)
computes something else than transformers, or would fail:

- ``Gemma3ForConditionalGeneration``: the multimodal wrapper (its text
  weights live under ``language_model``); toy imports the text model;
- an activation other than GELU's tanh form; ``attention_bias``;
- ``query_pre_attn_scalar`` other than the head size llama.cpp scales by
  (``head_dim``; ``hidden_size / num_attention_heads`` for the 27B layer
  counts): the converter drops the field;
- a pattern of sliding layers (``layer_types``, ``sliding_window_pattern``)
  other than llama.cpp's (Gemma 2: even layers; Gemma 3: five in six, or
  none when ``sliding_window_pattern`` is 1): the converter does not write it;
- Gemma 2: a ``rope_theta`` other than 10000 or any RoPE scaling (the
  converter writes neither), a missing soft-cap or window, an untied head;
- Gemma 3: an attention soft-cap, bidirectional attention, RoPE scaling
  other than linear on the global layers, any on the sliding ones.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Collection, Mapping
from typing import Any

from toy.models.hf import LLAMA_STYLE_LINEAR, HFFamily, HFMappingError, HFTensor, MetaEntry

ARCHS = ("gemma2", "gemma3")
CLASSES = {"Gemma2ForCausalLM": "gemma2", "Gemma3ForCausalLM": "gemma3"}
EXPORT_CLASSES = {"gemma2": "Gemma2ForCausalLM", "gemma3": "Gemma3ForCausalLM"}
#: transformers' ``ACT2FN`` names of the tanh form of GELU (what llama.cpp's and toy's Gemma compute)
GELU_TANH = ("gelu_pytorch_tanh", "gelu_new", "gelu_fast")
#: what transformers 4.57's config classes give a field config.json omits (what the converter then reads)
DEFAULTS: dict[str, dict[str, Any]] = {
    "gemma2": {
        "max_position_embeddings": 8192,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "hidden_activation": "gelu_pytorch_tanh",
        "query_pre_attn_scalar": 256,
        "sliding_window": 4096,
        "final_logit_softcapping": 30.0,
        "attn_logit_softcapping": 50.0,
        "tie_word_embeddings": True,
        "attention_bias": False,
    },
    "gemma3": {
        "max_position_embeddings": 131072,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1_000_000.0,
        "rope_local_base_freq": 10000.0,
        "hidden_activation": "gelu_pytorch_tanh",
        "query_pre_attn_scalar": 256,
        "sliding_window": 4096,
        "final_logit_softcapping": None,
        "attn_logit_softcapping": None,
        "tie_word_embeddings": True,
        "attention_bias": False,
        "use_bidirectional_attention": False,
    },
}
#: llama.cpp's 27B layer counts, whose attention scale is 1/sqrt(hidden_size / num_attention_heads)
_BIG = {"gemma2": 46, "gemma3": 62}
#: the sliding-window period llama.cpp assumes (a layer i slides unless i % period == period - 1)
_PERIOD = {"gemma2": 2, "gemma3": 6}

_LINEAR = LLAMA_STYLE_LINEAR  # a block's linear modules: Hugging Face -> GGUF stem (PEFT's names too)


def _check_arch(arch: str) -> None:
    if arch not in ARCHS:
        raise HFMappingError(
            f"architecture {arch!r} is not a Gemma model",
            hint="toy.models.gemma_hf maps gemma2 and gemma3",
            field="architecture",
        )


# ------------------------------------------------------------------ tensors


def tensors(arch: str, cfg: Any) -> list[HFTensor]:
    """One row per Hugging Face parameter of a Gemma 2/3 model with toy config
    ``cfg`` (``toy.models.gemma.GemmaConfig``: ``n_layer``, ``head_dim``,
    ``qk_norm``, ``tied_output``), in the order an export writes them."""
    _check_arch(arch)

    def norm(hf: str, gguf: str) -> HFTensor:
        return HFTensor(hf, gguf, op="plus_one")

    rows = [HFTensor("model.embed_tokens.weight", "token_embd.weight")]
    for i in range(int(cfg.n_layer)):
        h, g = f"model.layers.{i}", f"blk.{i}"
        rows.append(norm(f"{h}.input_layernorm.weight", f"{g}.attn_norm.weight"))
        for x in "qkv":
            rows.append(HFTensor(f"{h}.self_attn.{x}_proj.weight", f"{g}.attn_{x}.weight"))
        if arch == "gemma3":
            for x in "qk":
                hf = f"{h}.self_attn.{x}_norm.weight"
                rows.append(
                    norm(hf, f"{g}.attn_{x}_norm.weight")
                    if cfg.qk_norm
                    # a gain of 1 in llama.cpp's storage: Hugging Face's w = 0
                    else HFTensor(hf, None, fill=0.0, fill_shape=(int(cfg.head_dim),))
                )
        rows.append(HFTensor(f"{h}.self_attn.o_proj.weight", f"{g}.attn_output.weight"))
        rows.append(norm(f"{h}.post_attention_layernorm.weight", f"{g}.post_attention_norm.weight"))
        rows.append(norm(f"{h}.pre_feedforward_layernorm.weight", f"{g}.ffn_norm.weight"))
        for m in ("mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"):
            rows.append(HFTensor(f"{h}.{m}.weight", f"{g}.{_LINEAR[m]}.weight"))
        rows.append(norm(f"{h}.post_feedforward_layernorm.weight", f"{g}.post_ffw_norm.weight"))
    rows.append(norm("model.norm.weight", "output_norm.weight"))
    if arch == "gemma2":
        # the converter drops it (llama.cpp's gemma2 uses the embedding); an export of a tied model writes none
        rows.append(HFTensor("lm_head.weight", None, optional=True))
    else:
        rows.append(HFTensor("lm_head.weight", "output.weight", optional=bool(cfg.tied_output)))
    return rows


# ------------------------------------------------------------------ export


def config_to_hf(arch: str, cfg: Any) -> dict[str, Any]:
    """``config.json``'s model fields for an export of toy config ``cfg``
    (``GemmaConfig``); ``HFMappingError`` for what Hugging Face's class
    cannot express."""
    _check_arch(arch)
    if arch == "gemma3" and cfg.attn_softcap:
        raise HFMappingError(
            "a gemma3 model with attention logit soft-capping has no Hugging Face equivalent",
            hint="Hugging Face's Gemma 3 has no attention soft-cap",
            field="gemma3.attn_logit_softcapping",
        )
    if arch == "gemma2" and cfg.rope_freq_scale != 1.0:
        raise HFMappingError(
            "RoPE scaling on gemma2 cannot be exported (Hugging Face's gemma2 has none)",
            hint="export a gemma2 model without RoPE scaling",
            field="gemma2.rope.scaling.type",
        )
    if arch == "gemma2" and cfg.qk_norm:
        raise HFMappingError(
            "the gemma2 model has QK-norm tensors, which Hugging Face's gemma2 lacks",
            hint="export it as gemma3",
            field="general.architecture",
        )
    if any(cfg.swa_layers) and not cfg.sliding_window:
        raise HFMappingError(
            f"{arch}.attention.sliding_window is 0 while layers slide",
            hint="give the model a sliding window",
            field=f"{arch}.attention.sliding_window",
        )
    if arch == "gemma2" and cfg.rope_base_swa != cfg.rope_base:
        raise HFMappingError(
            "gemma2 with a sliding-window RoPE base other than the global one cannot be exported",
            hint="Hugging Face's gemma2 has one rope_theta for every layer",
            field="gemma2.rope.freq_base_swa",
        )
    swa = cfg.swa_layers or (False,) * cfg.n_layer
    config: dict[str, Any] = {
        "model_type": "gemma2" if arch == "gemma2" else "gemma3_text",
        "vocab_size": cfg.n_vocab,
        "hidden_size": cfg.d_model,
        "intermediate_size": cfg.d_ff,
        "num_hidden_layers": cfg.n_layer,
        "num_attention_heads": cfg.n_head,
        "num_key_value_heads": cfg.n_head_kv,
        "head_dim": cfg.head_dim,
        "hidden_activation": "gelu_pytorch_tanh",
        "max_position_embeddings": cfg.context_length or 8192,
        "rms_norm_eps": cfg.rms_eps,
        "rope_theta": cfg.rope_base,
        # the attention scale is 1/sqrt(query_pre_attn_scalar): toy's (llama.cpp's) choice of n, back
        "query_pre_attn_scalar": round(1.0 / cfg.attn_scale**2),
        "sliding_window": cfg.sliding_window or None,
        "layer_types": ["sliding_attention" if s else "full_attention" for s in swa],
        "final_logit_softcapping": cfg.final_softcap or None,
        "attn_logit_softcapping": cfg.attn_softcap or None,
        "tie_word_embeddings": cfg.tied_output,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
        "use_cache": True,
    }
    if arch == "gemma3":
        config["rope_local_base_freq"] = cfg.rope_base_swa
        config["rope_scaling"] = (
            {"rope_type": "linear", "factor": 1.0 / cfg.rope_freq_scale} if cfg.rope_freq_scale != 1.0 else None
        )
    return config


# ------------------------------------------------------------------ import


def _fail(field: str, message: str, hint: str) -> HFMappingError:
    return HFMappingError(f"config.json: {message}", hint=hint, field=field)


def _get(arch: str, config: Mapping[str, Any], key: str) -> Any:
    return config[key] if key in config else DEFAULTS[arch].get(key)


def _count(arch: str, config: Mapping[str, Any], key: str) -> int:
    v = _get(arch, config, key)
    if v is None:
        raise _fail(key, f"{key} is missing", f"a {arch} config.json gives {key} (a positive integer)")
    if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
        raise _fail(key, f"{key} is {v!r}, not a positive integer", f"set {key} to a positive integer")
    return v


def _number(arch: str, config: Mapping[str, Any], key: str, value: Any = None, *, what: str = "") -> float:
    v = _get(arch, config, key) if value is None else value
    if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v) or v <= 0:
        name = what or key
        raise _fail(key, f"{name} is {v!r}, not a positive number", f"set {name} to a positive number")
    return float(v)


def _flag(arch: str, config: Mapping[str, Any], key: str) -> bool:
    v = _get(arch, config, key)
    if v is None:
        return False
    if not isinstance(v, bool):
        raise _fail(key, f"{key} is {v!r}, not true or false", f"set {key} to true or false")
    return v


def _rope(arch: str, config: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(global, sliding) RoPE parameters as the converter sees them: ``rope_parameters`` (its
    ``full_attention``/``sliding_attention`` parts, or one dict for all layers), else ``rope_scaling``
    with ``rope_theta`` and ``rope_local_base_freq`` mirrored in."""
    key = "rope_parameters" if "rope_parameters" in config else "rope_scaling"
    raw = config.get(key) or {}
    if not isinstance(raw, Mapping):
        raise _fail(key, f"{key} is {raw!r}, not an object", f"set {key} to null or an object with rope_type")
    if "full_attention" in raw or "sliding_attention" in raw:
        parts = [raw.get("full_attention") or {}, raw.get("sliding_attention") or {}]
        for part, name in zip(parts, ("full_attention", "sliding_attention"), strict=True):
            if not isinstance(part, Mapping):
                raise _fail(f"{key}.{name}", f"{key}.{name} is not an object", "give rope_type and rope_theta")
        return dict(parts[0]), dict(parts[1])
    full = dict(raw)
    if "rope_type" not in full and "type" in full:
        full["rope_type"] = full["type"]
    full.setdefault("rope_theta", _get(arch, config, "rope_theta"))
    local = {"rope_theta": _get(arch, config, "rope_local_base_freq")} if arch == "gemma3" else {}
    return full, local


def _rope_type(part: Mapping[str, Any]) -> Any:
    t = part.get("rope_type", part.get("type"))
    return None if t == "default" else t


def _sliding_layers(arch: str, config: Mapping[str, Any], n_layer: int) -> tuple[list[bool], list[bool]]:
    """(Hugging Face's sliding layers, llama.cpp's for the file the converter writes)."""
    pattern = config.get("sliding_window_pattern", config.get("_sliding_window_pattern", _PERIOD[arch]))
    if not isinstance(pattern, int) or isinstance(pattern, bool) or pattern <= 0:
        raise _fail("sliding_window_pattern", f"sliding_window_pattern is {pattern!r}", "a positive integer period")
    types = config.get("layer_types")
    if types is None:
        hf = [bool((i + 1) % pattern) for i in range(n_layer)]
    elif (
        not isinstance(types, list)
        or len(types) != n_layer
        or any(t not in ("sliding_attention", "full_attention") for t in types)
    ):
        raise _fail(
            "layer_types",
            f"layer_types is {types!r}",
            f"one of 'sliding_attention' / 'full_attention' per layer ({n_layer})",
        )
    else:
        hf = [t == "sliding_attention" for t in types]
    if arch == "gemma3" and config.get("sliding_window_pattern") == 1:
        return hf, [False] * n_layer  # the converter writes no window: llama.cpp slides nowhere
    period = _PERIOD[arch]
    return hf, [i % period < period - 1 for i in range(n_layer)]


def _parse(arch: str, config: Mapping[str, Any]) -> dict[str, Any]:
    """config.json's fields the import uses, checked (module docstring's refusals)."""
    _check_arch(arch)
    cls = config.get("architectures")
    if isinstance(cls, list) and cls and cls[0] in REFUSED:
        raise _fail("architectures", f"{cls[0]} is the multimodal Gemma 3", REFUSED[cls[0]])
    p: dict[str, Any] = {}
    for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads"):
        if k not in config:
            raise _fail(k, f"{k} is missing", f"a {arch} config.json gives {k} (a positive integer)")
        p[k] = _count(arch, config, k)
    for k in ("num_key_value_heads", "head_dim"):
        if k not in config:
            raise _fail(k, f"{k} is missing", f"a {arch} config.json gives {k} (a positive integer)")
        p[k] = _count(arch, config, k)
    if p["num_attention_heads"] % p["num_key_value_heads"]:
        raise _fail(
            "num_key_value_heads",
            f"num_attention_heads {p['num_attention_heads']} is not a multiple of num_key_value_heads "
            f"{p['num_key_value_heads']}",
            "grouped-query attention needs whole groups",
        )
    p["max_position_embeddings"] = _count(arch, config, "max_position_embeddings")
    p["rms_norm_eps"] = _number(arch, config, "rms_norm_eps")
    act = config.get("hidden_activation") or config.get("hidden_act") or DEFAULTS[arch]["hidden_activation"]
    if act not in GELU_TANH:
        raise _fail(
            "hidden_activation",
            f"hidden_activation {act!r} is not the tanh form of GELU",
            f"toy's {arch} (llama.cpp's graph) computes GELU's tanh form ({', '.join(GELU_TANH)})",
        )
    if _flag(arch, config, "attention_bias"):
        raise _fail("attention_bias", "attention_bias is true", f"toy's {arch} has no attention biases")
    # the attention scale: llama.cpp's is fixed by the shape, HF's by query_pre_attn_scalar
    n = p["head_dim"]
    if p["num_hidden_layers"] == _BIG[arch]:
        n = p["hidden_size"] // p["num_attention_heads"]
    q = _get(arch, config, "query_pre_attn_scalar")
    if q != n:
        raise _fail(
            "query_pre_attn_scalar",
            f"query_pre_attn_scalar is {q!r}, but llama.cpp's {arch} scales attention by 1/sqrt({n})",
            "the converter drops the field: the file would compute another attention; toy imports only "
            f"models with query_pre_attn_scalar = {n}",
        )
    # soft-caps and the sliding window
    window = _get(arch, config, "sliding_window")
    final_cap = _get(arch, config, "final_logit_softcapping")
    attn_cap = _get(arch, config, "attn_logit_softcapping")
    if arch == "gemma2":
        p["attn_logit_softcapping"] = _number(arch, config, "attn_logit_softcapping")
        p["final_logit_softcapping"] = _number(arch, config, "final_logit_softcapping")
    else:
        if attn_cap is not None:
            raise _fail(
                "attn_logit_softcapping",
                f"attn_logit_softcapping is {attn_cap!r}",
                "Gemma 3 has no attention soft-cap (llama.cpp's converter refuses one); set it to null",
            )
        p["final_logit_softcapping"] = None if not final_cap else _number(arch, config, "final_logit_softcapping")
        if _flag(arch, config, "use_bidirectional_attention"):
            raise _fail(
                "use_bidirectional_attention",
                "use_bidirectional_attention is true",
                "toy's gemma3 (llama.cpp's graph) is causal",
            )
    hf_swa, cpp_swa = _sliding_layers(arch, config, p["num_hidden_layers"])
    if any(cpp_swa) or arch == "gemma2":
        p["sliding_window"] = _count(arch, config, "sliding_window") if window is not None else None
        if p["sliding_window"] is None:
            raise _fail("sliding_window", "sliding_window is null", f"a {arch} model with sliding layers needs it")
    else:
        p["sliding_window"] = None
    if hf_swa != cpp_swa:
        shown = "".join("S" if s else "F" for s in hf_swa)
        raise _fail(
            "layer_types",
            f"the sliding (S) and full (F) attention layers {shown} are not llama.cpp's {arch} pattern "
            + "".join("S" if s else "F" for s in cpp_swa),
            "the converter does not write the pattern, so the file would attend differently",
        )
    # RoPE
    full, local = _rope(arch, config)
    field = "rope_parameters" if "rope_parameters" in config else "rope_scaling"
    p["rope_theta"] = _number(arch, config, "rope_theta", full.get("rope_theta"), what="rope_theta")
    kind = _rope_type(full)
    if arch == "gemma2":
        if kind is not None:
            raise _fail(field, f"{field} type {kind!r} on gemma2", "llama.cpp's gemma2 has no RoPE scaling")
        if p["rope_theta"] != 10000.0:
            raise _fail(
                "rope_theta",
                f"rope_theta is {p['rope_theta']}, not 10000",
                "llama.cpp's gemma2 converter writes no RoPE base: the file would use 10000",
            )
        p["rope_factor"] = None
    else:
        if kind not in (None, "linear"):
            raise _fail(
                field,
                f"{field} type {kind!r} is not supported for gemma3",
                "toy's gemma3 imports no RoPE scaling or linear scaling on the global layers",
            )
        factor = full.get("factor")
        p["rope_factor"] = None
        if kind == "linear" and factor is not None:
            p["rope_factor"] = _number(arch, config, field, factor, what=f"{field}.factor")
        if _rope_type(local) is not None:
            raise _fail(
                field,
                f"the sliding layers' RoPE type {_rope_type(local)!r}",
                "llama.cpp's gemma3 rotates the sliding layers unscaled",
            )
        p["rope_local_theta"] = _number(
            arch, config, "rope_local_base_freq", local.get("rope_theta"), what="the sliding layers' rope_theta"
        )
    p["swa"] = cpp_swa  # equal to Hugging Face's (checked above)
    return p


def metadata_from_hf(arch: str, config: Mapping[str, Any]) -> list[MetaEntry]:
    """The ``gemma2.*`` / ``gemma3.*`` keys llama.cpp's converter writes for
    this ``config.json`` (module docstring), in its order, with the
    ``general.file_type`` placeholder; ``HFMappingError`` for a refused
    field."""
    p = _parse(arch, config)
    U, F = "uint32", "float32"
    a = arch
    file_type: MetaEntry = ("general.file_type", None, U)
    if arch == "gemma2":
        return [
            (f"{a}.context_length", p["max_position_embeddings"], U),
            (f"{a}.embedding_length", p["hidden_size"], U),
            (f"{a}.block_count", p["num_hidden_layers"], U),
            (f"{a}.feed_forward_length", p["intermediate_size"], U),
            (f"{a}.attention.head_count", p["num_attention_heads"], U),
            (f"{a}.attention.head_count_kv", p["num_key_value_heads"], U),
            (f"{a}.attention.layer_norm_rms_epsilon", p["rms_norm_eps"], F),
            (f"{a}.attention.key_length", p["head_dim"], U),
            (f"{a}.attention.value_length", p["head_dim"], U),
            file_type,
            (f"{a}.attn_logit_softcapping", p["attn_logit_softcapping"], F),
            (f"{a}.final_logit_softcapping", p["final_logit_softcapping"], F),
            (f"{a}.attention.sliding_window", p["sliding_window"], U),
        ]
    out: list[MetaEntry] = [
        (f"{a}.block_count", p["num_hidden_layers"], U),
        (f"{a}.context_length", p["max_position_embeddings"], U),
        (f"{a}.embedding_length", p["hidden_size"], U),
        (f"{a}.feed_forward_length", p["intermediate_size"], U),
        (f"{a}.attention.head_count", p["num_attention_heads"], U),
        (f"{a}.attention.head_count_kv", p["num_key_value_heads"], U),
    ]
    if p["rope_factor"] is not None:
        out += [(f"{a}.rope.scaling.type", "linear", "string"), (f"{a}.rope.scaling.factor", p["rope_factor"], F)]
    out += [
        (f"{a}.rope.freq_base", p["rope_theta"], F),
        (f"{a}.rope.freq_base_swa", p["rope_local_theta"], F),
        (f"{a}.attention.layer_norm_rms_epsilon", p["rms_norm_eps"], F),
        (f"{a}.attention.key_length", p["head_dim"], U),
        (f"{a}.attention.value_length", p["head_dim"], U),
        file_type,
    ]
    if p["final_logit_softcapping"]:
        out.append((f"{a}.final_logit_softcapping", p["final_logit_softcapping"], F))
    if p["sliding_window"] is not None:
        out.append((f"{a}.attention.sliding_window", p["sliding_window"], U))
    return out


def config_from_hf(arch: str, config: Mapping[str, Any], names: Collection[str]) -> Any:
    """The toy ``GemmaConfig`` of the file an import of this folder writes
    (``names``: the checkpoint's tensors, which decide Gemma 3's head)."""
    from toy.models.gemma import GemmaConfig

    p = _parse(arch, config)
    tie = _flag(arch, config, "tie_word_embeddings") if "tie_word_embeddings" in config else True
    if arch == "gemma2" and not tie:
        raise _fail(
            "tie_word_embeddings",
            "tie_word_embeddings is false on gemma2",
            "llama.cpp's gemma2 always uses the token embedding as the head (the converter drops lm_head)",
        )
    has_head = "lm_head.weight" in names
    if not tie and not has_head:
        raise HFMappingError(
            "the checkpoint has no lm_head.weight while config.json's tie_word_embeddings is false",
            hint="a shard may be missing",
            field="lm_head.weight",
        )
    swa = tuple(p["swa"]) if p["sliding_window"] and any(p["swa"]) else ()
    return GemmaConfig(
        n_vocab=p["vocab_size"],
        d_model=p["hidden_size"],
        n_layer=p["num_hidden_layers"],
        n_head=p["num_attention_heads"],
        n_head_kv=p["num_key_value_heads"],
        head_dim=p["head_dim"],
        d_ff=p["intermediate_size"],
        rms_eps=_f32(p["rms_norm_eps"]),
        rope_base=_f32(p["rope_theta"]),
        rope_base_swa=_f32(p["rope_local_theta"] if arch == "gemma3" else p["rope_theta"]),
        rope_freq_scale=1.0 / _f32(p["rope_factor"]) if p["rope_factor"] else 1.0,
        sliding_window=(p["sliding_window"] or 0) if swa else 0,
        swa_layers=swa,
        attn_softcap=_f32(p.get("attn_logit_softcapping") or 0.0),
        final_softcap=_f32(p["final_logit_softcapping"] or 0.0),
        qk_norm=arch == "gemma3",
        tied_output=arch == "gemma2" or not has_head,
        context_length=p["max_position_embeddings"],
        architecture=arch,
    )


def _f32(x: float) -> float:
    """``x`` as the file stores it (float32), so the config equals the one toy reads back from the file."""
    out: float = struct.unpack("<f", struct.pack("<f", x))[0]
    return out


def tokenizer_metadata_after(arch: str, tokenizer_model: str) -> list[MetaEntry]:
    """Gemma's converter adds ``add_space_prefix`` = false after a SentencePiece vocabulary."""
    _check_arch(arch)
    return [("tokenizer.ggml.add_space_prefix", False, "bool")] if tokenizer_model == "llama" else []


def example_config(arch: str) -> Any:
    """A two-layer model of ``arch`` with every tensor the mapping has (Gemma 3: QK-norm, an untied head)."""
    _check_arch(arch)
    from toy.models.gemma import GemmaConfig

    return GemmaConfig(
        n_vocab=32,
        d_model=16,
        n_layer=2,
        n_head=2,
        n_head_kv=1,
        head_dim=8,
        d_ff=32,
        rms_eps=1e-6,
        rope_base=10000.0,
        rope_base_swa=10000.0,
        sliding_window=4,
        swa_layers=(True, False),
        attn_softcap=50.0 if arch == "gemma2" else 0.0,
        final_softcap=30.0 if arch == "gemma2" else 0.0,
        qk_norm=arch == "gemma3",
        tied_output=arch == "gemma2",
        context_length=64,
        architecture=arch,
    )


#: classes an import refuses, with the hint
REFUSED = {
    "Gemma3ForConditionalGeneration": (
        "toy imports Gemma 3's text model (Gemma3ForCausalLM): this folder is the multimodal model, "
        "whose vision tower llama.cpp keeps in a separate mmproj file; save its language model alone "
        "(model.language_model with a Gemma3TextConfig) and import that"
    )
}

HF = HFFamily(
    classes=CLASSES,
    export_class=EXPORT_CLASSES,
    tensors=tensors,
    config_to_hf=config_to_hf,
    metadata_from_hf=metadata_from_hf,
    peft_prefix="model.layers",
    peft_modules=dict(_LINEAR),
    example_config=example_config,
    config_from_hf=config_from_hf,
    tokenizer_metadata_after=tokenizer_metadata_after,
    sentencepiece=ARCHS,
    refused_classes=REFUSED,
)

__all__ = [
    "ARCHS",
    "DEFAULTS",
    "GELU_TANH",
    "HF",
    "config_from_hf",
    "config_to_hf",
    "example_config",
    "metadata_from_hf",
    "tensors",
    "tokenizer_metadata_after",
]
