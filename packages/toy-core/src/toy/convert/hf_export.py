"""A GGUF language model as a Hugging Face folder that ``transformers`` loads
with no GGUF involved.

``export_hf(model_path, folder)`` writes ``config.json`` (the Hugging Face
architecture's fields, read from the GGUF metadata through toy's registry
config), the weights as safetensors (``model.safetensors``, or numbered
shards plus ``model.safetensors.index.json`` above ``shard_bytes``), the
tokenizer (``tokenizer.json``, ``tokenizer_config.json`` with the chat
template, ``special_tokens_map.json``: ``toy.tokenizer.export``) and
``generation_config.json``, for every registered language architecture:
llama, qwen2, qwen3, gpt2, gemma2, gemma3 (as ``Gemma3ForCausalLM``, the
text model), olmoe, qwen2moe and qwen3moe.

How each tensor is written:

- F32, F16 and BF16 tensors keep their type and bytes (safetensors allows a
  type per tensor, so an F16 file's F32 norms stay F32): a round trip
  through llama.cpp's converter with the same ``--outtype`` gives the same
  bytes back. Quantized tensors are dequantized to F32 (through ggml); the
  report lists them.
- llama: llama.cpp's converter interleaves the rows of each Q and K head
  (rotary pairs next to each other, ggml's "normal" RoPE); the export undoes
  it, back to the halves layout Hugging Face's rotary embedding uses.
  qwen2/qwen3 files use the halves layout already ("neox") and are copied.
- gpt2: Hugging Face keeps GPT-2's projections as ``Conv1D`` (in, out)
  matrices; the export transposes them back.
- gemma2/gemma3: llama.cpp stores the RMSNorm gains as ``1 + w``; the
  export writes ``w`` (in F32), as Hugging Face's Gemma norms add the 1.
  The attention scale goes back as ``query_pre_attn_scalar``. Gemma 2's
  attention soft-cap needs ``attn_implementation="eager"`` in transformers
  (its default SDPA path drops it).
- olmoe/qwen2moe/qwen3moe: the stacked 3-D expert tensors are split into
  Hugging Face's per-expert matrices (a quantized one is dequantized once).

The safetensors files are written here, streaming one tensor at a time
(header first: every shape and type is known from the GGUF index), so the
export holds one tensor in memory, not the model; no torch, no
transformers. The folder appears complete or not at all: everything is
written into a temporary sibling folder that is renamed onto ``folder``
(which must not exist or be empty) at the end.

Refused with ``HFExportError`` (naming the field): an architecture outside
the registry, RoPE scaling other than linear (YaRN, llama3), partial rotary
dimensions, a RoPE attention factor, QK-norm or biases on a family whose
Hugging Face class has none, a qwen2moe model without a shared expert, and
any tensor the exporter does not map (it refuses rather than drop it).
"""

from __future__ import annotations

import json
import os
import shutil
import struct
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

import toy_ggml
from toy.errors import BadInputError

# above this many bytes of weights the safetensors file is split (transformers' default shard size)
DEFAULT_SHARD_BYTES = 5 * 10**9
SUPPORTED = ("llama", "qwen2", "qwen3", "gpt2", "gemma2", "gemma3", "olmoe", "qwen2moe", "qwen3moe")

_T = toy_ggml.GGMLType
# GGUF float type -> (safetensors dtype, NumPy view of the raw bytes, bytes per element)
_FLOATS: dict[int, tuple[str, Any, int]] = {
    int(_T.F32): ("F32", np.float32, 4),
    int(_T.F16): ("F16", np.float16, 2),
    int(_T.BF16): ("BF16", np.uint16, 2),  # NumPy has no bfloat16: the bits are moved, never computed on
}
_TORCH_DTYPE = {"F32": "float32", "F16": "float16", "BF16": "bfloat16"}


class HFExportError(BadInputError):
    """A model that cannot be written as a Hugging Face folder (the message names the field or tensor)."""


@dataclass
class ExportReport:
    """What ``export_hf`` wrote."""

    folder: Path
    architecture: str
    hf_class: str
    files: list[Path] = field(default_factory=list)
    n_tensors: int = 0
    n_bytes: int = 0
    dequantized: list[str] = field(default_factory=list)  # GGUF tensors that were quantized (written as F32)

    def to_dict(self) -> dict[str, Any]:
        return {
            "folder": str(self.folder),
            "architecture": self.architecture,
            "hf_class": self.hf_class,
            "files": [str(p) for p in self.files],
            "n_tensors": self.n_tensors,
            "n_bytes": self.n_bytes,
            "dequantized": list(self.dequantized),
        }


# a transform of one tensor's array (NumPy order) on the way out
Transform = Callable[[np.ndarray], np.ndarray]


@dataclass(frozen=True)
class _Entry:
    hf_name: str
    gguf_name: str | None  # None: a tensor Hugging Face needs that the file does not carry (``fill``)
    transform: Transform | None = None
    fill: tuple[tuple[int, ...], float] | None = None  # (shape, value) when gguf_name is None
    as_f32: bool = False  # computed on (the transform does arithmetic): read as float32 whatever the type
    index: int | None = None  # one expert's matrix of a 3-D experts tensor


def _unpermute(n_head: int) -> Transform:
    """The inverse of llama.cpp's Q/K row permutation for ``n_head`` heads:
    within a head the converter moves row ``j`` of the second half next to
    row ``j`` of the first (pairs), this puts the halves back."""

    def undo(w: np.ndarray) -> np.ndarray:
        rows = w.shape[0]
        out: np.ndarray = w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
        return out

    return undo


def _transpose(w: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(w.T)


def _meta_int(metadata: dict[str, Any], key: str) -> int | None:
    v = metadata.get(key)
    return int(v) if isinstance(v, (int, np.integer)) else None


def _llama_plan(arch: str, cfg: Any, tensors: dict[str, Any]) -> tuple[list[_Entry], dict[str, Any]]:
    key = f"{arch}.rope"
    if cfg.rope_scaling not in (None, "linear"):
        raise HFExportError(
            f"{key}.scaling.type = {cfg.rope_scaling!r} cannot be exported yet (only none and linear)",
            hint="export a model without RoPE scaling, or one with linear scaling",
            field=f"{key}.scaling.type",
        )
    if cfg.rope_attn_factor != 1.0:
        raise HFExportError(
            f"{key}.scaling.attn_factor = {cfg.rope_attn_factor} has no Hugging Face {arch} equivalent",
            hint="export a model whose attention factor is 1",
            field=f"{key}.scaling.attn_factor",
        )
    if cfg.rope_dims != cfg.head_dim:
        raise HFExportError(
            f"{key}.dimension_count = {cfg.rope_dims} rotates part of each head (head size {cfg.head_dim}); "
            f"Hugging Face's {arch} rotates whole heads",
            hint="only models whose rotary dimensions equal the head size can be exported",
            field=f"{key}.dimension_count",
        )
    if cfg.qk_norm and arch not in ("qwen3", "qwen3moe", "olmoe"):
        raise HFExportError(
            f"the {arch} model has QK-norm tensors (attn_q_norm/attn_k_norm), which Hugging Face's {arch} lacks",
            hint="export it as qwen3 (general.architecture = qwen3), whose class has per-head QK-norm",
            field="general.architecture",
        )
    if cfg.qk_norm_full != (arch == "olmoe"):  # Hugging Face: olmoe normalises whole projections, qwen3 heads
        raise HFExportError(f"the {arch} model's QK-norm layout has no Hugging Face {arch} equivalent",
                            field="general.architecture")  # fmt: skip
    if arch == "olmoe" and cfg.n_head * cfg.head_dim != cfg.d_model:
        raise HFExportError(
            f"olmoe with head_count * key_length = {cfg.n_head * cfg.head_dim} != embedding_length {cfg.d_model}: "
            "Hugging Face's olmoe sizes its QK-norm by the embedding length",
            field="olmoe.attention.key_length",
        )
    if arch == "qwen2moe" and not cfg.d_ff_shared:
        raise HFExportError("a qwen2moe model without a shared expert has no Hugging Face equivalent",
                            field="qwen2moe.expert_shared_feed_forward_length")  # fmt: skip
    H, Hkv, D, d = cfg.n_head, cfg.n_head_kv, cfg.head_dim, cfg.d_model
    permuted = arch == "llama"  # the converter permutes llama's Q/K rows only
    # Hugging Face's qwen2 always has q/k/v biases; llama has one switch for q/k/v/o biases
    bias_qkv = cfg.qkv_bias or arch in ("qwen2", "qwen2moe")
    bias_o = cfg.qkv_bias and arch == "llama"
    if cfg.qkv_bias and arch in ("qwen3", "qwen3moe", "olmoe"):
        raise HFExportError(f"the {arch} model has Q/K/V biases, which Hugging Face's {arch} lacks",
                            field="general.architecture")  # fmt: skip
    out = [_Entry("model.embed_tokens.weight", "token_embd.weight")]
    for i in range(cfg.n_layer):
        g, h = f"blk.{i}", f"model.layers.{i}"
        out.append(_Entry(f"{h}.input_layernorm.weight", f"{g}.attn_norm.weight"))
        for x, n in (("q", H), ("k", Hkv), ("v", Hkv)):
            undo = _unpermute(n) if permuted and x != "v" else None
            out.append(_Entry(f"{h}.self_attn.{x}_proj.weight", f"{g}.attn_{x}.weight", undo))
            if bias_qkv:
                b = f"{g}.attn_{x}.bias"
                out.append(
                    _Entry(f"{h}.self_attn.{x}_proj.bias", b, undo)
                    if b in tensors
                    else _Entry(f"{h}.self_attn.{x}_proj.bias", None, fill=((n * D,), 0.0))
                )
        out.append(_Entry(f"{h}.self_attn.o_proj.weight", f"{g}.attn_output.weight"))
        if bias_o:
            out.append(_Entry(f"{h}.self_attn.o_proj.bias", None, fill=((d,), 0.0)))
        if arch in ("qwen3", "qwen3moe", "olmoe"):
            for x, n_heads in (("q", H), ("k", Hkv)):
                n = f"{g}.attn_{x}_norm.weight"
                size = n_heads * D if arch == "olmoe" else D
                out.append(
                    _Entry(f"{h}.self_attn.{x}_norm.weight", n)
                    if n in tensors
                    else _Entry(f"{h}.self_attn.{x}_norm.weight", None, fill=((size,), 1.0))
                )
        out.append(_Entry(f"{h}.post_attention_layernorm.weight", f"{g}.ffn_norm.weight"))
        if cfg.n_expert:
            out.append(_Entry(f"{h}.mlp.gate.weight", f"{g}.ffn_gate_inp.weight"))
            for hf, gg in (("gate_proj", "ffn_gate_exps"), ("up_proj", "ffn_up_exps"), ("down_proj", "ffn_down_exps")):
                out += [
                    _Entry(f"{h}.mlp.experts.{j}.{hf}.weight", f"{g}.{gg}.weight", index=j) for j in range(cfg.n_expert)
                ]
            if cfg.d_ff_shared:
                out.append(_Entry(f"{h}.mlp.shared_expert_gate.weight", f"{g}.ffn_gate_inp_shexp.weight"))
                for hf, gg in (
                    ("gate_proj", "ffn_gate_shexp"),
                    ("up_proj", "ffn_up_shexp"),
                    ("down_proj", "ffn_down_shexp"),
                ):
                    out.append(_Entry(f"{h}.mlp.shared_expert.{hf}.weight", f"{g}.{gg}.weight"))
            continue
        for hf, gg in (("gate_proj", "ffn_gate"), ("up_proj", "ffn_up"), ("down_proj", "ffn_down")):
            out.append(_Entry(f"{h}.mlp.{hf}.weight", f"{g}.{gg}.weight"))
    out.append(_Entry("model.norm.weight", "output_norm.weight"))
    if not cfg.tied_output:
        out.append(_Entry("lm_head.weight", "output.weight"))
    config: dict[str, Any] = {
        "model_type": _MODEL_TYPE.get(arch, arch),
        "vocab_size": cfg.n_vocab,
        "hidden_size": d,
        "intermediate_size": cfg.d_ff_expert if arch == "olmoe" else cfg.d_ff,
        "num_hidden_layers": cfg.n_layer,
        "num_attention_heads": H,
        "num_key_value_heads": Hkv,
        "head_dim": D,
        "hidden_act": "silu",
        "max_position_embeddings": cfg.context_length or 2048,
        "rms_norm_eps": cfg.rms_eps,
        "rope_theta": cfg.rope_base,
        "rope_scaling": (
            {"rope_type": "linear", "factor": 1.0 / cfg.rope_freq_scale} if cfg.rope_scaling == "linear" else None
        ),
        "tie_word_embeddings": cfg.tied_output,
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
        "use_cache": True,
    }
    if arch in ("llama", "qwen3", "qwen3moe", "olmoe"):
        config["attention_bias"] = bias_o if arch == "llama" else False
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
    return out, config


_MODEL_TYPE = {"qwen2moe": "qwen2_moe", "qwen3moe": "qwen3_moe"}


def _gpt2_plan(cfg: Any, tensors: dict[str, Any]) -> tuple[list[_Entry], dict[str, Any]]:
    out = [
        _Entry("transformer.wte.weight", "token_embd.weight"),
        _Entry("transformer.wpe.weight", "position_embd.weight"),
    ]
    for i in range(cfg.n_layer):
        g, h = f"blk.{i}", f"transformer.h.{i}"
        for hf, gg in (("ln_1", "attn_norm"), ("ln_2", "ffn_norm")):
            out += [_Entry(f"{h}.{hf}.weight", f"{g}.{gg}.weight"), _Entry(f"{h}.{hf}.bias", f"{g}.{gg}.bias")]
        for hf, gg in (
            ("attn.c_attn", "attn_qkv"),
            ("attn.c_proj", "attn_output"),
            ("mlp.c_fc", "ffn_up"),
            ("mlp.c_proj", "ffn_down"),
        ):
            out += [
                _Entry(f"{h}.{hf}.weight", f"{g}.{gg}.weight", _transpose),
                _Entry(f"{h}.{hf}.bias", f"{g}.{gg}.bias"),
            ]
    out += [
        _Entry("transformer.ln_f.weight", "output_norm.weight"),
        _Entry("transformer.ln_f.bias", "output_norm.bias"),
    ]
    if not cfg.tied_output:
        out.append(_Entry("lm_head.weight", "output.weight"))
    config = {
        "model_type": "gpt2",
        "vocab_size": cfg.n_vocab,
        "n_positions": cfg.n_ctx_train,
        "n_ctx": cfg.n_ctx_train,
        "n_embd": cfg.d_model,
        "n_layer": cfg.n_layer,
        "n_head": cfg.n_head,
        "n_inner": cfg.d_ff,
        "activation_function": "gelu_new",
        "layer_norm_epsilon": cfg.norm_eps,
        "tie_word_embeddings": cfg.tied_output,
        "resid_pdrop": 0.0,
        "embd_pdrop": 0.0,
        "attn_pdrop": 0.0,
        "initializer_range": 0.02,
        "scale_attn_weights": True,
        "use_cache": True,
    }
    return out, config


def _gemma_minus_one(w: np.ndarray) -> np.ndarray:
    """llama.cpp stores Gemma's RMSNorm gains as 1 + w; Hugging Face's Gemma norms add the 1 themselves."""
    out: np.ndarray = (w - np.float32(1.0)).astype(np.float32)
    return out


def _gemma_plan(arch: str, cfg: Any, tensors: dict[str, Any]) -> tuple[list[_Entry], dict[str, Any]]:
    if arch == "gemma3" and cfg.attn_softcap:
        raise HFExportError("a gemma3 model with attention logit soft-capping has no Hugging Face equivalent",
                            field="gemma3.attn_logit_softcapping")  # fmt: skip
    if arch == "gemma2" and cfg.rope_freq_scale != 1.0:
        raise HFExportError("RoPE scaling on gemma2 cannot be exported (Hugging Face's gemma2 has none)",
                            field="gemma2.rope.scaling.type")  # fmt: skip
    if arch == "gemma2" and cfg.qk_norm:
        raise HFExportError("the gemma2 model has QK-norm tensors, which Hugging Face's gemma2 lacks",
                            hint="export it as gemma3", field="general.architecture")  # fmt: skip
    if any(cfg.swa_layers) and not cfg.sliding_window:
        raise HFExportError(f"{arch}.attention.sliding_window is 0 while layers slide",
                            field=f"{arch}.attention.sliding_window")  # fmt: skip

    def norm(hf: str, gg: str) -> _Entry:
        return _Entry(hf, gg, _gemma_minus_one, as_f32=True)

    out = [_Entry("model.embed_tokens.weight", "token_embd.weight")]
    for i in range(cfg.n_layer):
        g, h = f"blk.{i}", f"model.layers.{i}"
        out.append(norm(f"{h}.input_layernorm.weight", f"{g}.attn_norm.weight"))
        for x in "qkv":
            out.append(_Entry(f"{h}.self_attn.{x}_proj.weight", f"{g}.attn_{x}.weight"))
        if arch == "gemma3":
            for x in "qk":
                n = f"{g}.attn_{x}_norm.weight"
                out.append(
                    norm(f"{h}.self_attn.{x}_norm.weight", n)
                    if n in tensors
                    else _Entry(f"{h}.self_attn.{x}_norm.weight", None, fill=((cfg.head_dim,), 0.0))
                )
        out.append(_Entry(f"{h}.self_attn.o_proj.weight", f"{g}.attn_output.weight"))
        out.append(norm(f"{h}.post_attention_layernorm.weight", f"{g}.post_attention_norm.weight"))
        out.append(norm(f"{h}.pre_feedforward_layernorm.weight", f"{g}.ffn_norm.weight"))
        for hf, gg in (("gate_proj", "ffn_gate"), ("up_proj", "ffn_up"), ("down_proj", "ffn_down")):
            out.append(_Entry(f"{h}.mlp.{hf}.weight", f"{g}.{gg}.weight"))
        out.append(norm(f"{h}.post_feedforward_layernorm.weight", f"{g}.post_ffw_norm.weight"))
    out.append(norm("model.norm.weight", "output_norm.weight"))
    if not cfg.tied_output:
        out.append(_Entry("lm_head.weight", "output.weight"))
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
    elif cfg.rope_base_swa != cfg.rope_base:
        raise HFExportError("gemma2 with a sliding-window RoPE base other than the global one cannot be exported",
                            field="gemma2.rope.freq_base_swa")  # fmt: skip
    return out, config


_HF_CLASS = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "gpt2": "GPT2LMHeadModel",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3": "Gemma3ForCausalLM",
    "olmoe": "OlmoeForCausalLM",
    "qwen2moe": "Qwen2MoeForCausalLM",
    "qwen3moe": "Qwen3MoeForCausalLM",
}


def _plan(arch: str, cfg: Any, tensors: dict[str, Any]) -> tuple[list[_Entry], dict[str, Any]]:
    if arch == "gpt2":
        return _gpt2_plan(cfg, tensors)
    if arch in ("gemma2", "gemma3"):
        return _gemma_plan(arch, cfg, tensors)
    return _llama_plan(arch, cfg, tensors)


def _out_type(gf: Any, e: _Entry) -> tuple[str, tuple[int, ...], bool]:
    """(safetensors dtype, Hugging Face shape, dequantized?) of one entry."""
    if e.gguf_name is None:
        assert e.fill is not None
        return "F32", e.fill[0], False
    t = gf.tensors[e.gguf_name]
    shape = tuple(t.shape) if e.index is None else tuple(t.shape[1:])
    if e.transform is _transpose:
        shape = shape[::-1]
    f = _FLOATS.get(int(t.dtype))
    return (f[0] if f and not e.as_f32 else "F32"), shape, f is None


def _array(gf: Any, e: _Entry, last: dict[str, np.ndarray]) -> np.ndarray:
    """One entry's array. ``last`` keeps the previous dequantized tensor, so that the experts of one 3-D
    tensor (consecutive entries) dequantize it once."""
    if e.gguf_name is None:
        assert e.fill is not None
        return np.full(e.fill[0], e.fill[1], np.float32)
    t = gf.tensors[e.gguf_name]
    f = _FLOATS.get(int(t.dtype))
    if f is None or e.as_f32:
        if e.gguf_name not in last:
            last.clear()
            last[e.gguf_name] = gf.tensor_to_float(e.gguf_name)
        a = last[e.gguf_name]
    else:
        a = np.frombuffer(gf.tensor_bytes(e.gguf_name), dtype=f[1]).reshape(t.shape)
    if e.index is not None:
        a = a[e.index]
    return e.transform(a) if e.transform is not None else a


_ITEM = {"F32": 4, "F16": 2, "BF16": 2}


def _shards(sizes: list[int], limit: int) -> list[list[int]]:
    """Indices of the entries in each shard: in order, a new shard when the next tensor would pass ``limit``."""
    out: list[list[int]] = [[]]
    used = 0
    for i, n in enumerate(sizes):
        if out[-1] and used + n > limit:
            out.append([])
            used = 0
        out[-1].append(i)
        used += n
    return out


def _write_safetensors(
    path: Path, items: list[tuple[str, str, tuple[int, ...], int]], arrays: Iterator[np.ndarray]
) -> None:
    """Write one safetensors file: ``items`` (name, dtype, shape, nbytes) give the header; ``arrays`` the
    data, one at a time, in the same order."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, dtype, shape, nbytes in items:
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # the data starts 8-byte aligned
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for (name, _, shape, nbytes), a in zip(items, arrays, strict=True):
            data = np.ascontiguousarray(a).tobytes()
            if len(data) != nbytes or tuple(a.shape) != tuple(shape):  # a bug here must not write a wrong file
                raise AssertionError(f"{name}: {a.shape} / {len(data)} bytes, planned {shape} / {nbytes}")
            f.write(data)


def _check_folder(folder: Path) -> None:
    if folder.exists() and (not folder.is_dir() or any(folder.iterdir())):
        what = "is not a folder" if not folder.is_dir() else "is not empty"
        raise HFExportError(f"{folder} {what}", hint="pass a new or empty folder: the export never overwrites files",
                            field="folder")  # fmt: skip


def export_hf(
    model_path: str | os.PathLike[str],
    folder: str | os.PathLike[str],
    *,
    shard_bytes: int = DEFAULT_SHARD_BYTES,
) -> ExportReport:
    """Write the GGUF model at ``model_path`` as a Hugging Face folder ``folder`` (new or empty)."""
    from toy import models
    from toy.gguf.reader import GGUFFile
    from toy.tokenizer import ChatTemplate, Tokenizer
    from toy.tokenizer.export import export_hf as export_tokenizer

    if shard_bytes <= 0:
        raise HFExportError(f"shard_bytes must be positive, not {shard_bytes}", field="shard_bytes")
    dest = Path(folder)
    _check_folder(dest)
    with GGUFFile(model_path) as gf:
        arch = gf.architecture
        if arch not in SUPPORTED:
            known = arch in models.registered()
            raise HFExportError(
                f"{gf.path if hasattr(gf, 'path') else model_path}: general.architecture = {arch!r} "
                + ("cannot be exported to Hugging Face yet" if known else "is not a model toy knows"),
                hint=f"exportable architectures: {', '.join(SUPPORTED)}",
                field="general.architecture",
            )
        cfg = models.config_from_gguf(gf)
        entries, config = _plan(arch, cfg, dict(gf.tensors))
        extra = sorted(set(gf.tensors) - {e.gguf_name for e in entries} - {"rope_freqs.weight"})
        if extra:
            raise HFExportError(
                f"tensor {extra[0]!r} has no place in Hugging Face's {arch}"
                + (f" (and {len(extra) - 1} more)" if len(extra) > 1 else ""),
                hint="the file carries tensors toy's exporter does not map; it refuses rather than drop them",
                field=extra[0],
            )
        tok = Tokenizer.from_gguf(gf.metadata)
        template = ChatTemplate.from_gguf(gf.metadata)
        meta = gf.metadata
        specials = {k: _meta_int(meta, f"tokenizer.ggml.{k}_token_id") for k in ("bos", "eos", "pad")}
        plans = [_out_type(gf, e) for e in entries]
        dtypes = {p[0] for p in plans}
        report = ExportReport(dest, arch, _HF_CLASS[arch])
        report.dequantized = [e.gguf_name for e, p in zip(entries, plans, strict=True) if p[2] and e.gguf_name]
        config = {
            "architectures": [_HF_CLASS[arch]],
            **config,
            "bos_token_id": specials["bos"],
            "eos_token_id": specials["eos"],
            # the widest type the weights use: what from_pretrained(torch_dtype="auto") picks
            "torch_dtype": _TORCH_DTYPE["F32" if "F32" in dtypes or len(dtypes) > 1 else dtypes.pop()],
        }
        if specials["pad"] is not None:
            config["pad_token_id"] = specials["pad"]
        items = []
        for e, (dtype, shape, _) in zip(entries, plans, strict=True):
            n = _ITEM[dtype]
            for s in shape:
                n *= s
            items.append((e.hf_name, dtype, shape, n))
        groups = _shards([it[3] for it in items], shard_bytes)

        tmp = dest.parent / f".{dest.name}.export-{os.getpid()}"
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir(parents=True)
        try:
            names: list[str] = []
            weight_map: dict[str, str] = {}
            for k, idx in enumerate(groups, 1):
                name = "model.safetensors" if len(groups) == 1 else f"model-{k:05d}-of-{len(groups):05d}.safetensors"
                last: dict[str, np.ndarray] = {}
                _write_safetensors(tmp / name, [items[i] for i in idx], (_array(gf, entries[i], last) for i in idx))
                names.append(name)
                weight_map.update({items[i][0]: name for i in idx})
            total = sum(it[3] for it in items)
            if len(groups) > 1:
                index = {"metadata": {"total_size": total}, "weight_map": weight_map}
                (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
                names.append("model.safetensors.index.json")
            (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
            gen = {k + "_token_id": v for k, v in specials.items() if v is not None}
            (tmp / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
            n_ctx = config.get("max_position_embeddings", config.get("n_positions"))
            tok_files = export_tokenizer(tok, template, tmp, n_ctx=n_ctx)
            names += ["config.json", "generation_config.json", *(p.name for p in tok_files)]
            if dest.exists():
                dest.rmdir()  # empty (checked above)
            os.replace(tmp, dest)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    report.files = [dest / n for n in names]
    report.n_tensors = len(items)
    report.n_bytes = total
    return report


__all__ = ["DEFAULT_SHARD_BYTES", "SUPPORTED", "ExportReport", "HFExportError", "export_hf"]
