"""GPT-2's Hugging Face counterpart (``GPT2LMHeadModel``), as data: the
``HF`` object ``toy.convert`` reads to import and export GPT-2 (types in
``toy.models.hf``).

Tensors: Hugging Face's GPT-2 keeps its four projections in ``Conv1D``
modules, whose weights are stored ``(in, out)``; llama.cpp's converter
transposes them to the ``(out, in)`` of every other GGUF matrix (op
``"transpose"``). Everything else is copied. The head: a checkpoint's
``lm_head.weight`` becomes ``output.weight`` (the converter maps it whatever
``tie_word_embeddings`` says, and so does ``config_from_hf``); without one
the file has no ``output.weight`` and the token embedding is the head. An
export writes ``lm_head.weight`` for an untied model only.

The causal-mask buffers ``attn.bias`` and ``attn.masked_bias`` that older
checkpoints saved are not parameters and are skipped. A checkpoint saved
from the bare ``GPT2Model`` (OpenAI's own ``gpt2`` folders) names the
tensors without the ``transformer.`` prefix; the converter's name map knows
both spellings, and ``config_from_hf`` picks the one the checkpoint uses.

Metadata (``metadata_from_hf``): the six ``gpt2.*`` keys llama.cpp's
``GPT2Model.set_gguf_parameters`` writes, in its order and with its types,
then ``general.file_type`` (its value left to the engine). Two of them are
not what a reader of ``config.json`` might expect, and are kept so that the
file equals the converter's: ``context_length`` is the legacy ``n_ctx``
field (``n_positions`` when the folder lacks it, where the converter stops
with a KeyError), and ``feed_forward_length`` is always ``4 * n_embd``. The
tokenizer is GPT-2's byte-level BPE, which the generic tokenizer import
handles (``tokenizer.ggml.pre`` ``gpt-2``); GPT-2 adds no keys of its own.

What is refused, because toy's GPT-2 (``toy.models.gpt2``, llama.cpp's graph)
computes something else, or the file would describe a different model
(``HFMappingError`` naming the field):

- ``activation_function`` other than the tanh form of GELU (``gelu_new``,
  ``gelu_pytorch_tanh``, ``gelu_fast``): the graph's GELU is the tanh form;
- ``n_inner`` other than null or ``4 * n_embd``: the converter writes
  ``4 * n_embd`` as the feed-forward length whatever the weights hold;
- ``scale_attn_weights`` false (the graph always scales scores by
  ``1/sqrt(head_dim)``) and ``scale_attn_by_inverse_layer_idx`` true (it
  never divides by the layer's index);
- ``add_cross_attention`` true (an encoder-decoder block, no such tensors);
- counts that are not positive integers, ``n_embd`` not a multiple of
  ``n_head``, a non-positive ``layer_norm_epsilon``.

``reorder_and_upcast_attn`` only changes the precision of a half-precision
attention in transformers; toy computes attention in float32 either way, so
it is accepted. Dropout rates and ``use_cache`` do not change inference.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Any

from toy.models.gpt2 import GPT2Config
from toy.models.hf import HFFamily, HFMappingError, HFTensor, MetaEntry

ARCH = "gpt2"
#: GELU variants of transformers' ``ACT2FN`` that compute the tanh approximation toy's graph uses
GELU_TANH = ("gelu_new", "gelu_pytorch_tanh", "gelu_fast")
#: per block: Hugging Face module -> GGUF stem; the weights of these Conv1D modules are transposed
_PROJECTIONS = {
    "attn.c_attn": "attn_qkv",
    "attn.c_proj": "attn_output",
    "mlp.c_fc": "ffn_up",
    "mlp.c_proj": "ffn_down",
}
_NORMS = {"ln_1": "attn_norm", "ln_2": "ffn_norm"}
#: the prefix of ``GPT2LMHeadModel``'s body; a checkpoint saved from the bare ``GPT2Model`` lacks it
PREFIX = "transformer."


@dataclass(frozen=True)
class ImportConfig(GPT2Config):
    """The toy config of an import, plus how the checkpoint spells its names:
    ``hf_prefix`` is ``PREFIX``, or ``""`` for a ``GPT2Model`` checkpoint
    (``wte.weight``, ``h.0.ln_1.weight``: OpenAI's own ``gpt2`` folders)."""

    hf_prefix: str = PREFIX


def _check_arch(arch: str) -> None:
    if arch != ARCH:
        raise HFMappingError(
            f"architecture {arch!r} is not gpt2", hint="toy.models.gpt2_hf maps gpt2 only", field="architecture"
        )


def tensors(arch: str, cfg: Any) -> list[HFTensor]:
    """One row per Hugging Face parameter of a ``GPT2LMHeadModel`` with toy
    config ``cfg`` (``toy.models.gpt2.GPT2Config``: ``n_layer``,
    ``tied_output``; an ``ImportConfig``'s ``hf_prefix``); ``lm_head.weight``
    only for an untied head."""
    _check_arch(arch)
    p = getattr(cfg, "hf_prefix", PREFIX)
    rows = [
        HFTensor(f"{p}wte.weight", "token_embd.weight"),
        HFTensor(f"{p}wpe.weight", "position_embd.weight"),
    ]
    for i in range(int(cfg.n_layer)):
        h, g = f"{p}h.{i}", f"blk.{i}"
        for hf, gg in _NORMS.items():
            rows += [HFTensor(f"{h}.{hf}.weight", f"{g}.{gg}.weight"), HFTensor(f"{h}.{hf}.bias", f"{g}.{gg}.bias")]
        for hf, gg in _PROJECTIONS.items():
            rows += [
                HFTensor(f"{h}.{hf}.weight", f"{g}.{gg}.weight", op="transpose"),
                HFTensor(f"{h}.{hf}.bias", f"{g}.{gg}.bias"),
            ]
    rows += [
        HFTensor(f"{p}ln_f.weight", "output_norm.weight"),
        HFTensor(f"{p}ln_f.bias", "output_norm.bias"),
    ]
    if not cfg.tied_output:
        rows.append(HFTensor("lm_head.weight", "output.weight"))
    return rows


def config_to_hf(arch: str, cfg: Any) -> dict[str, Any]:
    """``config.json``'s model fields for an export of toy config ``cfg``."""
    _check_arch(arch)
    if cfg.n_head_kv != cfg.n_head:
        raise HFMappingError(
            f"a gpt2 model with {cfg.n_head_kv} key/value heads for {cfg.n_head} query heads",
            hint="Hugging Face's GPT-2 has one key/value head per query head",
            field="gpt2.attention.head_count_kv",
        )
    return {
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


def _count(config: Mapping[str, Any], key: str, default: int | None = None) -> int:
    v = config.get(key, default)
    if v is None:
        raise HFMappingError(f"config.json: {key} is missing", hint=f"a GPT-2 config.json gives {key}", field=key)
    if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
        raise HFMappingError(
            f"config.json: {key} is {v!r}, not a positive integer", hint=f"set {key} to a positive integer", field=key
        )
    return v


def _flag(config: Mapping[str, Any], key: str, default: bool, want: bool, why: str) -> None:
    v = config.get(key, default)
    if not isinstance(v, bool):
        raise HFMappingError(f"config.json: {key} is {v!r}, not true or false", hint=f"set {key} to {want}", field=key)
    if v != want:
        raise HFMappingError(f"config.json: {key} is {str(v).lower()}: {why}", hint="toy cannot import it", field=key)


def _read(config: Mapping[str, Any]) -> dict[str, Any]:
    """config.json's GPT-2 fields, checked (module docstring: what is refused)."""
    n_layer = _count(config, "n_layer")
    n_embd = _count(config, "n_embd")
    n_head = _count(config, "n_head")
    vocab = _count(config, "vocab_size")
    n_positions = _count(config, "n_positions", 1024)
    n_ctx = _count(config, "n_ctx") if config.get("n_ctx") is not None else n_positions
    if n_embd % n_head:
        raise HFMappingError(
            f"config.json: n_embd {n_embd} is not a multiple of n_head {n_head}",
            hint="every GPT-2 head has n_embd / n_head dimensions",
            field="n_head",
        )
    n_inner = config.get("n_inner")
    if n_inner is not None and n_inner != 4 * n_embd:
        raise HFMappingError(
            f"config.json: n_inner {n_inner!r} is not 4 * n_embd = {4 * n_embd}",
            hint="llama.cpp's GPT-2 (and so toy's import) takes the feed-forward width to be 4 * n_embd",
            field="n_inner",
        )
    act = config.get("activation_function", "gelu_new")
    if act not in GELU_TANH:
        raise HFMappingError(
            f"config.json: activation_function {act!r} is not the tanh form of GELU",
            hint=f"toy's GPT-2 computes GELU's tanh form ({', '.join(GELU_TANH)})",
            field="activation_function",
        )
    _flag(config, "scale_attn_weights", True, True, "attention scores are then not scaled by 1/sqrt(head_dim)")
    _flag(
        config,
        "scale_attn_by_inverse_layer_idx",
        False,
        False,
        "attention scores are then divided by the layer's number, which toy's GPT-2 does not do",
    )
    _flag(config, "add_cross_attention", False, False, "cross-attention blocks belong to an encoder-decoder model")
    eps = config.get("layer_norm_epsilon", 1e-5)
    if not isinstance(eps, (int, float)) or isinstance(eps, bool) or not math.isfinite(eps) or eps <= 0:
        raise HFMappingError(
            f"config.json: layer_norm_epsilon is {eps!r}, not a positive number",
            hint="set layer_norm_epsilon to a positive number (GPT-2's is 1e-5)",
            field="layer_norm_epsilon",
        )
    return {
        "n_layer": n_layer,
        "n_embd": n_embd,
        "n_head": n_head,
        "vocab": vocab,
        "n_positions": n_positions,
        "n_ctx": n_ctx,
        "eps": float(eps),
    }


def metadata_from_hf(arch: str, config: Mapping[str, Any]) -> list[MetaEntry]:
    """The ``gpt2.*`` keys llama.cpp's converter writes for this
    ``config.json``, then the place of ``general.file_type`` (module
    docstring); refuses what toy's GPT-2 does not compute."""
    _check_arch(arch)
    c = _read(config)
    return [
        (f"{ARCH}.block_count", c["n_layer"], "uint32"),
        (f"{ARCH}.context_length", c["n_ctx"], "uint32"),
        (f"{ARCH}.embedding_length", c["n_embd"], "uint32"),
        (f"{ARCH}.feed_forward_length", 4 * c["n_embd"], "uint32"),
        (f"{ARCH}.attention.head_count", c["n_head"], "uint32"),
        (f"{ARCH}.attention.layer_norm_epsilon", c["eps"], "float32"),
        ("general.file_type", None, "uint32"),  # the engine fills in the output type
    ]


def config_from_hf(arch: str, config: Mapping[str, Any], names: Collection[str]) -> ImportConfig:
    """The toy config of the GGUF an import of this folder writes: the head
    is untied when the checkpoint holds ``lm_head.weight``; the position
    table has ``n_positions`` rows; the names are read without the
    ``transformer.`` prefix when the checkpoint's token embedding lacks it."""
    _check_arch(arch)
    c = _read(config)
    bare = f"{PREFIX}wte.weight" not in names and "wte.weight" in names
    return ImportConfig(
        n_vocab=c["vocab"],
        d_model=c["n_embd"],
        n_layer=c["n_layer"],
        n_head=c["n_head"],
        d_ff=4 * c["n_embd"],
        n_ctx_train=c["n_positions"],
        norm_eps=c["eps"],
        tied_output="lm_head.weight" not in names,
        context_length=min(c["n_ctx"], c["n_positions"]),
        hf_prefix="" if bare else PREFIX,
    )


def example_config(arch: str) -> Any:
    """A two-layer GPT-2 with an untied head (every tensor the mapping has)."""
    _check_arch(arch)
    return GPT2Config(n_vocab=32, d_model=8, n_layer=2, n_head=2, d_ff=32, n_ctx_train=16, tied_output=False)


HF = HFFamily(
    classes={"GPT2LMHeadModel": ARCH},
    export_class={ARCH: "GPT2LMHeadModel"},
    tensors=tensors,
    config_to_hf=config_to_hf,
    metadata_from_hf=metadata_from_hf,
    config_from_hf=config_from_hf,
    peft_prefix="transformer.h",
    peft_modules=dict(_PROJECTIONS),
    example_config=example_config,
    skipped=(".attn.bias", ".attn.masked_bias"),
)

__all__ = [
    "GELU_TANH",
    "HF",
    "PREFIX",
    "ImportConfig",
    "config_from_hf",
    "config_to_hf",
    "example_config",
    "metadata_from_hf",
    "tensors",
]
