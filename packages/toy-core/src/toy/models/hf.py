"""What a family knows about its Hugging Face counterpart, as data: the types
of the ``hf`` member of an ``ARCH`` (``toy.models``' docstring).

A built-in family names a module in ``LMArchitecture.hf`` (``toy.models.
llama_hf``, ``gpt2_hf``, ``gemma_hf``) whose ``HF`` is an ``HFFamily``; the
registry imports it only when asked (``toy.models.hf_family``), so resolving an
architecture never loads it. ``toy.convert`` (import and export of models
and PEFT adapters) and the generated mapping tables of the reference read
only these objects: no table of Hugging Face names lives outside the
families.

The one table, both ways
------------------------
``HFFamily.tensors(architecture, cfg)`` lists one ``HFTensor`` per Hugging
Face parameter of a model with toy config ``cfg``: its Hugging Face name, its
GGUF name and the operation (``op``, by name, so the reference can print it)
that turns the Hugging Face array into the GGUF array (import); export applies
the inverse. The ops are implemented once, in ``toy.convert``:

- ``""``: the same array;
- ``"rope_pairs"``: llama.cpp's Q/K row order for ``heads`` heads (each head's
  rotate-half rows interleaved into adjacent pairs; export undoes it);
- ``"transpose"``: a matrix transposed (GPT-2's ``Conv1D`` stores (in, out));
- ``"plus_one"``: the GGUF value is the Hugging Face value plus 1 (Gemma's
  RMSNorm gains, which Hugging Face applies as ``1 + w``).

``expert=j`` marks the Hugging Face matrix of expert ``j`` of the stacked 3-D
GGUF tensor ``gguf`` (mixture-of-experts families). ``gguf=None`` is a
Hugging Face parameter no GGUF file holds: export writes the constant
``fill`` of shape ``fill_shape`` (a zero bias, a unit norm); with ``fill``
None as well, it is a parameter the converter drops (Gemma 2's
``lm_head.weight``): an import drops it, an export writes nothing for it.
``optional``: an import may find the checkpoint without it (then the GGUF
lacks it too).

Config both ways: ``config_to_hf(architecture, cfg)`` gives ``config.json``'s
architecture fields for an export; ``metadata_from_hf(architecture, config)``
the GGUF metadata of the architecture (keys, values and GGUF value types,
in the order llama.cpp's converter writes them) for an import. Each raises
``HFMappingError`` naming the field it cannot carry over.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from typing import Any

from toy.errors import BadInputError

#: the tensor operations a mapping may name -> what they do (import direction); the reference prints these
OPS: Mapping[str, str] = {
    "": "copied",
    "rope_pairs": "rows of each head interleaved into RoPE pairs (llama.cpp's Q/K order)",
    "transpose": "transposed (Hugging Face's Conv1D keeps (in, out))",
    "plus_one": "1 added (llama.cpp stores Gemma's norm gains as 1 + w)",
}


class HFMappingError(BadInputError):
    """A config or tensor that has no counterpart on the other side (the
    message and ``field`` name it). ``toy.convert`` raises it as its own
    ``HFImportError`` / ``HFExportError``."""


@dataclass(frozen=True)
class HFTensor:
    """One Hugging Face parameter and its GGUF tensor (module docstring)."""

    hf: str
    gguf: str | None
    op: str = ""
    heads: int = 0  # "rope_pairs": the heads the rows split into
    expert: int | None = None  # this expert's matrix of the stacked GGUF tensor
    fill: float | None = None  # gguf None: the constant export writes
    fill_shape: tuple[int, ...] = ()
    optional: bool = False  # import: the checkpoint may lack it

    def __post_init__(self) -> None:
        if self.op not in OPS:
            raise ValueError(f"unknown op {self.op!r}")


#: the linear modules of a block (inside ``model.layers.{i}``) of Hugging Face's llama-style classes (Llama,
#: Qwen, Gemma, the MoE attention) -> GGUF stem: their tensor names' middles and PEFT's module names
LLAMA_STYLE_LINEAR: Mapping[str, str] = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}

#: one metadata entry of an import: (key, value, GGUF value type name: "string", "uint32", "float32", "bool",
#: "array[string]", "array[float32]", "array[int32]")
MetaEntry = tuple[str, Any, str]


@dataclass(frozen=True)
class HFFamily:
    """A family's Hugging Face counterpart (module docstring)."""

    #: config.json's ``architectures[0]`` -> general.architecture (what an import accepts)
    classes: Mapping[str, str]
    #: general.architecture -> the class an export writes
    export_class: Mapping[str, str]
    tensors: Callable[[str, Any], list[HFTensor]]
    config_to_hf: Callable[[str, Any], dict[str, Any]]
    metadata_from_hf: Callable[[str, Mapping[str, Any]], list[MetaEntry]]
    #: PEFT: the blocks' module prefix (``model.layers``) and module (inside a block) -> GGUF stem
    peft_prefix: str = "model.layers"
    peft_modules: Mapping[str, str] = field(default_factory=dict)
    #: architectures whose Q/K rows the converter permutes (a LoRA ``B`` takes the same permutation)
    rope_pairs: tuple[str, ...] = ()
    #: tokenizer keys an architecture's converter adds, from ``tokenizer_config.json`` (written before the
    #: generic ``tokenizer.ggml.*`` keys; e.g. llama's ``add_space_prefix``)
    tokenizer_metadata: Callable[[str, Mapping[str, Any]], list[MetaEntry]] | None = None
    #: import: GGUF tensors the converter computes from config.json rather than reads (llama3 RoPE's
    #: ``rope_freqs.weight``): (architecture, config) -> [(GGUF name, float32 array in NumPy order)]
    extra_tensors: Callable[[str, Mapping[str, Any]], list[tuple[str, Any]]] | None = None
    #: architecture -> a small toy config of it with every optional tensor present (biases, QK-norm, an untied
    #: head, experts and a shared expert where the architecture has them): what the generated mapping tables
    #: of the reference (tools/hf_tables.py) list
    example_config: Callable[[str], Any] | None = None
    #: import: (architecture, config.json, the checkpoint's tensor names) -> the toy config of the model the
    #: import writes; ``tensors(architecture, that config)`` is then the import's table (every row not
    #: ``optional`` must be in the checkpoint, every checkpoint tensor must have a row or be ``skipped``)
    config_from_hf: Callable[[str, Mapping[str, Any], Collection[str]], Any] | None = None
    #: import: suffixes of checkpoint names that are buffers, not parameters, dropped as the converter
    #: drops them (``.rotary_emb.inv_freq``)
    skipped: tuple[str, ...] = ()
    #: import: tokenizer keys an architecture's converter adds AFTER the generic ``tokenizer.ggml.*`` keys
    #: (chat template included): (architecture, the ``tokenizer.ggml.model`` written: ``"llama"`` for a
    #: SentencePiece vocabulary, ``"gpt2"`` for BPE) -> entries (Gemma's ``add_space_prefix`` False)
    tokenizer_metadata_after: Callable[[str, str], list[MetaEntry]] | None = None
    #: import: architectures whose converter reads the tokenizer from ``tokenizer.model`` (SentencePiece) when
    #: the folder has one, before ``tokenizer.json`` (llama, qwen2, qwen3, gemma2, gemma3; the others never look)
    sentencepiece: tuple[str, ...] = ()
    #: import: ``config.json`` classes refused with a reason (a multimodal wrapper of a text model the
    #: family imports): class -> the hint the error gives
    refused_classes: Mapping[str, str] = field(default_factory=dict)
    #: export: config.json's ``rope_scaling`` (None: no scaling), from what ``config_to_hf`` cannot see:
    #: (architecture, cfg, the GGUF's metadata, its ``rope_freqs.weight`` as NumPy or None) -> the dict; raises
    #: ``HFMappingError`` for a scaling Hugging Face cannot express (``toy.models.rope_hf``)
    rope_scaling_to_hf: Callable[[str, Any, Mapping[str, Any], Any], dict[str, Any] | None] | None = None


__all__ = ["LLAMA_STYLE_LINEAR", "OPS", "HFFamily", "HFMappingError", "HFTensor", "MetaEntry"]
