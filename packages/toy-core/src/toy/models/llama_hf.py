"""The llama family's Hugging Face counterpart, as data (``toy.models.hf``):
``LlamaForCausalLM``, ``Qwen2ForCausalLM``, ``Qwen3ForCausalLM``,
``OlmoeForCausalLM``, ``Qwen2MoeForCausalLM`` and ``Qwen3MoeForCausalLM``.

What llama.cpp's converter (``convert_hf_to_gguf.py`` of the pinned
llama-cpp-python sdist: ``conversion/llama.py``, ``qwen.py``, ``olmo.py`` and
``base.py``'s ``set_gguf_parameters``) does with these classes, written down
once for ``toy.convert`` to interpret both ways:

- the tensor table (``tensors``): one ``HFTensor`` per Hugging Face
  parameter. Only ``llama`` (``LlamaModel.undo_permute``) has its Q and K
  rows (weights and biases) interleaved into RoPE pairs (op
  ``"rope_pairs"``); qwen2/qwen3/olmoe/qwen2moe/qwen3moe keep Hugging Face's
  halves order (llama.cpp's NEOX rotation). The experts of a mixture of
  experts (``mlp.experts.{j}.{gate,up,down}_proj``) are rows ``expert=j`` of
  the stacked ``ffn_{gate,up,down}_exps``. Parameters a Hugging Face class
  always has but a GGUF file may lack are ``fill`` rows (``gguf=None``):
  Qwen2's Q/K/V biases (zero), Qwen3's and OLMoE's Q/K norms (one), llama's
  ``o_proj`` bias next to Q/K/V biases (zero; toy has no output bias, so an
  import refuses a non-zero one).
- the config (``config_from_hf``, ``metadata_from_hf``): the converter's
  keys in its order: the generic block (block count, context, widths,
  heads, RoPE scaling, RoPE base, RMS epsilon, experts, ``head_dim`` as
  key/value lengths), ``general.file_type``, then the class's own keys
  (llama: ``vocab_size`` and ``rope.dimension_count``; Qwen MoE: the expert
  and shared-expert widths). RoPE scaling is ``toy.models.rope_hf``'s.
- export (``config_to_hf``): ``config.json``'s fields for a toy config.

Refused (``HFMappingError`` naming the field), because toy's llama family
would compute something else than transformers: ``hidden_act`` other than
``silu``, ``mlp_bias``, partial rotary factors, Qwen's sliding window,
OLMoE's ``clip_qkv``, mixture-of-experts layouts llama.cpp does not run
(dense layers between sparse ones, ``norm_topk_prob`` other than what
llama.cpp hard-codes per architecture: renormalised for qwen3moe only).
OLMoE: the converter writes an RMS epsilon of 1e-5 whatever ``config.json``
says; toy writes ``rms_norm_eps`` (the same bytes for every released OLMoE,
whose epsilon is 1e-5, and the right model otherwise).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import Any

from toy.models import rope_hf
from toy.models.hf import LLAMA_STYLE_LINEAR, HFFamily, HFMappingError, HFTensor, MetaEntry
from toy.models.llama import MOE_ARCHITECTURES, SUPPORTED_ARCHITECTURES, LlamaConfig

CLASSES = {
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "OlmoeForCausalLM": "olmoe",
    "Qwen2MoeForCausalLM": "qwen2moe",
    "Qwen3MoeForCausalLM": "qwen3moe",
}
EXPORT_CLASS = {arch: cls for cls, arch in CLASSES.items()}
_MODEL_TYPE = {"qwen2moe": "qwen2_moe", "qwen3moe": "qwen3_moe"}
#: architectures whose converter permutes the Q/K rows into RoPE pairs
ROPE_PAIRS = ("llama",)
#: architectures whose Hugging Face attention always has Q/K/V biases
_ALWAYS_QKV_BIAS = ("qwen2", "qwen2moe")
#: architectures whose Hugging Face attention always has Q/K norms
_ALWAYS_QK_NORM = ("qwen3", "qwen3moe", "olmoe")
#: llama.cpp's renormalisation of the k experts' weights, per architecture (hard-coded there)
_NORM_TOPK = {"olmoe": False, "qwen2moe": False, "qwen3moe": True}
_SKIPPED = (".rotary_emb.inv_freq",)


def _bad(msg: str, field: str, hint: str) -> HFMappingError:
    return HFMappingError(msg, hint, field=field)


def _int(config: Mapping[str, Any], key: str, default: int | None = None) -> int:
    v = config.get(key, default)
    if v is None:
        raise _bad(f"config.json: {key} is missing", key, f"config.json must give {key} (an integer)")
    if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
        raise _bad(f"config.json: {key} is {v!r}, not a positive integer", key, f"set {key} to a positive integer")
    return v


def _float(config: Mapping[str, Any], key: str, default: float | None = None) -> float:
    v = config.get(key, default)
    if v is None:
        raise _bad(f"config.json: {key} is missing", key, f"config.json must give {key} (a number)")
    if not isinstance(v, (int, float)) or isinstance(v, bool) or not v > 0 or v == float("inf"):
        raise _bad(f"config.json: {key} is {v!r}, not a positive number", key, f"set {key} to a positive number")
    return float(v)


def _check(arch: str, config: Mapping[str, Any]) -> None:
    """Refuse what toy's llama family would compute differently from transformers."""
    act = config.get("hidden_act", "silu")
    if act != "silu":
        raise _bad(f"config.json: hidden_act {act!r} is not silu", "hidden_act", "toy's llama family uses SiLU")
    if config.get("mlp_bias"):
        raise _bad("config.json: mlp_bias is true", "mlp_bias", "toy's llama family has no MLP biases")
    prf = config.get("partial_rotary_factor")
    if prf not in (None, 1, 1.0):
        raise _bad(
            f"config.json: partial_rotary_factor {prf!r}: the converter rotates whole heads",
            "partial_rotary_factor",
            "toy imports llama-family models whose RoPE covers the whole head",
        )
    if config.get("use_sliding_window"):
        raise _bad(
            "config.json: use_sliding_window is true",
            "use_sliding_window",
            "toy's llama family attends to the whole context (llama.cpp's converter drops the window)",
        )
    if arch == "olmoe" and config.get("clip_qkv") is not None:
        raise _bad(
            f"config.json: clip_qkv is {config['clip_qkv']!r}",
            "clip_qkv",
            "toy's olmoe does not clamp Q/K/V (set clip_qkv to null only if the model was trained without it)",
        )
    if arch in MOE_ARCHITECTURES:
        step = config.get("decoder_sparse_step", 1)
        if step != 1 or config.get("mlp_only_layers"):
            raise _bad(
                "config.json: decoder_sparse_step / mlp_only_layers make some layers dense",
                "decoder_sparse_step" if step != 1 else "mlp_only_layers",
                "llama.cpp and toy run every layer of a mixture of experts sparse",
            )
        norm = config.get("norm_topk_prob", _NORM_TOPK[arch])
        if bool(norm) != _NORM_TOPK[arch]:
            raise _bad(
                f"config.json: norm_topk_prob is {norm!r}; llama.cpp's {arch} "
                + ("always renormalises" if _NORM_TOPK[arch] else "never renormalises")
                + " the chosen experts' weights",
                "norm_topk_prob",
                f"toy runs {arch} as llama.cpp does; this checkpoint needs the other choice",
            )
    rope_hf.rope_metadata_from_hf(arch, config)  # refuses a RoPE scaling toy does not run


def config_from_hf(arch: str, config: Mapping[str, Any], names: Collection[str]) -> LlamaConfig:
    """The toy config of the model an import of ``config`` and the checkpoint
    tensors ``names`` writes (HFFamily.config_from_hf)."""
    _check(arch, config)
    d = _int(config, "hidden_size")
    n_head = _int(config, "num_attention_heads")
    n_head_kv = _int(config, "num_key_value_heads", n_head)
    if n_head % n_head_kv:
        raise _bad(
            f"config.json: num_attention_heads {n_head} is not a multiple of num_key_value_heads {n_head_kv}",
            "num_key_value_heads",
            "grouped-query attention needs whole groups",
        )
    head_dim = _int(config, "head_dim") if config.get("head_dim") is not None else d // n_head
    d_ff = _int(config, "intermediate_size")
    moe: dict[str, Any] = {}
    if arch in MOE_ARCHITECTURES:
        n_expert = _int(config, "num_experts")
        used = _int(config, "num_experts_per_tok")
        if used > n_expert:
            raise _bad(
                f"config.json: num_experts_per_tok {used} > num_experts {n_expert}",
                "num_experts_per_tok",
                "a token cannot use more experts than the layer has",
            )
        shared = 0
        if arch == "qwen2moe" and "model.layers.0.mlp.shared_expert.up_proj.weight" in names:
            shared = _int(config, "shared_expert_intermediate_size")
        moe = dict(
            n_expert=n_expert,
            n_expert_used=used,
            d_ff_expert=d_ff if arch == "olmoe" else _int(config, "moe_intermediate_size"),
            d_ff_shared=shared,
            expert_weights_norm=_NORM_TOPK[arch],
        )
    theta = config.get("rope_theta")
    return LlamaConfig(
        n_vocab=_int(config, "vocab_size"),
        d_model=d,
        n_layer=_int(config, "num_hidden_layers"),
        n_head=n_head,
        n_head_kv=n_head_kv,
        head_dim=head_dim,
        d_ff=d_ff,
        rms_eps=_float(config, "rms_norm_eps"),
        rope_base=10000.0 if theta is None else _float(config, "rope_theta"),
        rope_dims=head_dim,
        rope_mode="normal" if arch in ROPE_PAIRS else "neox",
        tied_output="lm_head.weight" not in names,
        qkv_bias="model.layers.0.self_attn.q_proj.bias" in names,
        qk_norm="model.layers.0.self_attn.q_norm.weight" in names,
        context_length=_int(config, "max_position_embeddings"),
        architecture=arch,
        qk_norm_full=arch == "olmoe",
        **moe,
    )


def tensors(arch: str, cfg: LlamaConfig) -> list[HFTensor]:
    """Every Hugging Face parameter of a model of ``cfg`` and its GGUF tensor,
    in the order of Hugging Face's ``named_parameters``."""
    H, Hkv, D, d = cfg.n_head, cfg.n_head_kv, cfg.head_dim, cfg.d_model
    pairs = arch in ROPE_PAIRS
    bias_qkv = cfg.qkv_bias or arch in _ALWAYS_QKV_BIAS
    # Hugging Face's attention_bias (llama, qwen3, olmoe) covers o_proj too; qwen2's biases are Q/K/V only
    bias_o = cfg.qkv_bias and arch not in _ALWAYS_QKV_BIAS
    out = [HFTensor("model.embed_tokens.weight", "token_embd.weight")]
    for i in range(cfg.n_layer):
        g, h = f"blk.{i}", f"model.layers.{i}"
        out.append(HFTensor(f"{h}.input_layernorm.weight", f"{g}.attn_norm.weight"))
        for x, n in (("q", H), ("k", Hkv), ("v", Hkv)):
            op, heads = ("rope_pairs", n) if pairs and x != "v" else ("", 0)
            out.append(HFTensor(f"{h}.self_attn.{x}_proj.weight", f"{g}.attn_{x}.weight", op, heads))
            if cfg.qkv_bias:
                out.append(HFTensor(f"{h}.self_attn.{x}_proj.bias", f"{g}.attn_{x}.bias", op, heads))
            elif bias_qkv:
                out.append(HFTensor(f"{h}.self_attn.{x}_proj.bias", None, fill=0.0, fill_shape=(n * D,)))
        out.append(HFTensor(f"{h}.self_attn.o_proj.weight", f"{g}.attn_output.weight"))
        if bias_o:
            out.append(HFTensor(f"{h}.self_attn.o_proj.bias", None, fill=0.0, fill_shape=(d,)))
        if cfg.qk_norm or arch in _ALWAYS_QK_NORM:
            for x, n in (("q", H), ("k", Hkv)):
                name = f"{h}.self_attn.{x}_norm.weight"
                if cfg.qk_norm:
                    out.append(HFTensor(name, f"{g}.attn_{x}_norm.weight"))
                else:
                    out.append(HFTensor(name, None, fill=1.0, fill_shape=(n * D if cfg.qk_norm_full else D,)))
        out.append(HFTensor(f"{h}.post_attention_layernorm.weight", f"{g}.ffn_norm.weight"))
        if cfg.n_expert:
            out.append(HFTensor(f"{h}.mlp.gate.weight", f"{g}.ffn_gate_inp.weight"))
            for j in range(cfg.n_expert):
                for x in ("gate", "up", "down"):
                    out.append(HFTensor(f"{h}.mlp.experts.{j}.{x}_proj.weight", f"{g}.ffn_{x}_exps.weight", expert=j))
            if cfg.d_ff_shared:
                for x in ("gate", "up", "down"):
                    out.append(HFTensor(f"{h}.mlp.shared_expert.{x}_proj.weight", f"{g}.ffn_{x}_shexp.weight"))
                out.append(HFTensor(f"{h}.mlp.shared_expert_gate.weight", f"{g}.ffn_gate_inp_shexp.weight"))
            continue
        for x in ("gate", "up", "down"):
            out.append(HFTensor(f"{h}.mlp.{x}_proj.weight", f"{g}.ffn_{x}.weight"))
    out.append(HFTensor("model.norm.weight", "output_norm.weight"))
    if not cfg.tied_output:
        out.append(HFTensor("lm_head.weight", "output.weight"))
    return out


def metadata_from_hf(arch: str, config: Mapping[str, Any]) -> list[MetaEntry]:
    """The converter's architecture keys for ``config``, in its order, with
    the ``general.file_type`` placeholder where it writes that key."""
    a = arch
    U32, F32 = "uint32", "float32"
    out: list[MetaEntry] = [
        (f"{a}.block_count", _int(config, "num_hidden_layers"), U32),
        (f"{a}.context_length", _int(config, "max_position_embeddings"), U32),
        (f"{a}.embedding_length", _int(config, "hidden_size"), U32),
        (f"{a}.feed_forward_length", _int(config, "intermediate_size"), U32),
        (f"{a}.attention.head_count", _int(config, "num_attention_heads"), U32),
    ]
    if config.get("num_key_value_heads") is not None:
        out.append((f"{a}.attention.head_count_kv", _int(config, "num_key_value_heads"), U32))
    out += rope_hf.rope_metadata_from_hf(arch, config)
    if config.get("rope_theta") is not None:
        out.append((f"{a}.rope.freq_base", _float(config, "rope_theta"), F32))
    out.append((f"{a}.attention.layer_norm_rms_epsilon", _float(config, "rms_norm_eps"), F32))
    if arch in MOE_ARCHITECTURES:
        out.append((f"{a}.expert_count", _int(config, "num_experts"), U32))
        out.append((f"{a}.expert_used_count", _int(config, "num_experts_per_tok"), U32))
    if config.get("head_dim") is not None:
        out.append((f"{a}.attention.key_length", _int(config, "head_dim"), U32))
        out.append((f"{a}.attention.value_length", _int(config, "head_dim"), U32))
    out.append(("general.file_type", None, U32))
    if arch == "llama":
        head_dim = config.get("head_dim")
        rope_dim = _int(config, "head_dim") if head_dim is not None else _rope_dim(config)
        out += [(f"{a}.vocab_size", _int(config, "vocab_size"), U32), (f"{a}.rope.dimension_count", rope_dim, U32)]
    if arch in ("qwen2moe", "qwen3moe"):
        if config.get("moe_intermediate_size") is not None:
            out.append((f"{a}.expert_feed_forward_length", _int(config, "moe_intermediate_size"), U32))
        if config.get("shared_expert_intermediate_size") is not None:
            out.append((f"{a}.expert_shared_feed_forward_length", _int(config, "shared_expert_intermediate_size"), U32))
    return out


def _rope_dim(config: Mapping[str, Any]) -> int:
    return _int(config, "hidden_size") // _int(config, "num_attention_heads")


def tokenizer_metadata(arch: str, tokenizer_config: Mapping[str, Any]) -> list[MetaEntry]:
    """llama's converter writes ``add_space_prefix`` from ``tokenizer_config.json``'s ``add_prefix_space``."""
    flag = tokenizer_config.get("add_prefix_space")
    if arch == "llama" and isinstance(flag, bool):
        return [("tokenizer.ggml.add_space_prefix", flag, "bool")]
    return []


def config_to_hf(arch: str, cfg: LlamaConfig) -> dict[str, Any]:
    """``config.json``'s architecture fields for an export of ``cfg``."""
    key = f"{arch}.rope"
    if cfg.rope_dims != cfg.head_dim:
        raise _bad(
            f"{key}.dimension_count = {cfg.rope_dims} rotates part of each head (head size {cfg.head_dim}); "
            f"Hugging Face's {arch} rotates whole heads",
            f"{key}.dimension_count",
            "only models whose rotary dimensions equal the head size can be exported",
        )
    if cfg.qk_norm and arch not in _ALWAYS_QK_NORM:
        raise _bad(
            f"the {arch} model has QK-norm tensors (attn_q_norm/attn_k_norm), which Hugging Face's {arch} lacks",
            "general.architecture",
            "export it as qwen3 (general.architecture = qwen3), whose class has per-head QK-norm",
        )
    if cfg.qk_norm_full != (arch == "olmoe"):  # Hugging Face: olmoe normalises whole projections, qwen3 heads
        raise _bad(
            f"the {arch} model's QK-norm layout has no Hugging Face {arch} equivalent",
            "general.architecture",
            "only olmoe normalises whole Q/K projections",
        )
    if arch == "olmoe" and cfg.n_head * cfg.head_dim != cfg.d_model:
        raise _bad(
            f"olmoe with head_count * key_length = {cfg.n_head * cfg.head_dim} != embedding_length {cfg.d_model}: "
            "Hugging Face's olmoe sizes its QK-norm by the embedding length",
            "olmoe.attention.key_length",
            "only olmoe models whose heads fill the embedding can be exported",
        )
    if arch == "qwen2moe" and not cfg.d_ff_shared:
        raise _bad(
            "a qwen2moe model without a shared expert has no Hugging Face equivalent",
            "qwen2moe.expert_shared_feed_forward_length",
            "Hugging Face's Qwen2-MoE always has a shared expert",
        )
    config: dict[str, Any] = {
        "model_type": _MODEL_TYPE.get(arch, arch),
        "vocab_size": cfg.n_vocab,
        "hidden_size": cfg.d_model,
        "intermediate_size": cfg.d_ff_expert if arch == "olmoe" else cfg.d_ff,
        "num_hidden_layers": cfg.n_layer,
        "num_attention_heads": cfg.n_head,
        "num_key_value_heads": cfg.n_head_kv,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": cfg.context_length or 2048,
        "rms_norm_eps": cfg.rms_eps,
        "rope_theta": cfg.rope_base,
        "rope_scaling": None,  # the engine sets it (HF.rope_scaling_to_hf: toy.models.rope_hf)
        "tie_word_embeddings": cfg.tied_output,
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
        "use_cache": True,
    }
    if arch in ("llama", "qwen3", "qwen3moe", "olmoe"):
        config["attention_bias"] = cfg.qkv_bias
    if arch == "llama":
        config["mlp_bias"] = False
        config["pretraining_tp"] = 1
    elif arch != "olmoe":
        config.update(use_sliding_window=False, sliding_window=None, max_window_layers=cfg.n_layer)
    if cfg.n_expert:
        config.update(
            num_experts=cfg.n_expert,
            num_experts_per_tok=cfg.n_expert_used,
            norm_topk_prob=cfg.expert_weights_norm,
            output_router_logits=False,
            router_aux_loss_coef=0.01,
        )
        if arch == "olmoe":
            config["clip_qkv"] = None
        else:
            config.update(moe_intermediate_size=cfg.d_ff_expert, decoder_sparse_step=1, mlp_only_layers=[])
        if arch == "qwen2moe":
            config["shared_expert_intermediate_size"] = cfg.d_ff_shared
    return config


def example_config(arch: str) -> LlamaConfig:
    """A small config of ``arch`` with every tensor it may have (the reference's tables)."""
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ValueError(f"{arch!r} is not a llama-family architecture")
    moe = arch in MOE_ARCHITECTURES
    return LlamaConfig(
        n_vocab=32,
        d_model=16,
        n_layer=2,
        n_head=2,
        n_head_kv=2 if arch == "olmoe" else 1,
        head_dim=8,
        d_ff=32,
        rms_eps=1e-5,
        rope_base=10000.0,
        rope_dims=8,
        rope_mode="normal" if arch in ROPE_PAIRS else "neox",
        tied_output=False,
        qkv_bias=arch in ("llama", "qwen2", "qwen2moe"),
        qk_norm=arch in _ALWAYS_QK_NORM,
        context_length=64,
        architecture=arch,
        qk_norm_full=arch == "olmoe",
        n_expert=2 if moe else 0,
        n_expert_used=1 if moe else 0,
        d_ff_expert=(32 if arch == "olmoe" else 8) if moe else 0,
        d_ff_shared=8 if arch == "qwen2moe" else 0,
        expert_weights_norm=arch == "qwen3moe",
    )


HF = HFFamily(
    classes=CLASSES,
    export_class=EXPORT_CLASS,
    tensors=tensors,
    config_to_hf=config_to_hf,
    metadata_from_hf=metadata_from_hf,
    peft_prefix="model.layers",
    peft_modules={
        **LLAMA_STYLE_LINEAR,
        "mlp.gate": "ffn_gate_inp",
        # qwen2moe's shared expert (imported adapters; the stacked experts are the tensors' rows with expert=J)
        "mlp.shared_expert.gate_proj": "ffn_gate_shexp",
        "mlp.shared_expert.up_proj": "ffn_up_shexp",
        "mlp.shared_expert.down_proj": "ffn_down_shexp",
        "mlp.shared_expert_gate": "ffn_gate_inp_shexp",
    },
    rope_pairs=ROPE_PAIRS,
    sentencepiece=("llama", "qwen2", "qwen3"),  # LlamaModel / Qwen2Model / Qwen3Model read tokenizer.model first
    tokenizer_metadata=tokenizer_metadata,
    extra_tensors=rope_hf.rope_extra_tensors,
    rope_scaling_to_hf=rope_hf.rope_scaling_to_hf,
    example_config=example_config,
    config_from_hf=config_from_hf,
    skipped=_SKIPPED,
)

__all__ = ["CLASSES", "EXPORT_CLASS", "HF", "config_from_hf", "config_to_hf", "metadata_from_hf", "tensors"]
