"""The tensor types of llama.cpp's K-quant mixes ("mostly Q4_K_M" and friends).

llama.cpp's quantizer (``llama_model_quantize``, ``src/llama-quant.cpp`` of
the llama.cpp in llama-cpp-python 0.3.36) does not write a "mostly Q4_K_M"
file in Q4_K alone: it picks each tensor's type from the tensor's role, its
layer and the model's shape. ``toy quantize`` writes the same mix for its
K-quant targets, tensor for tensor; both quantize with ggml's own functions,
so the same F32 or F16 input gives the same types and the same bytes
(``tests/test_quant_mix.py`` checks this against files llama.cpp wrote,
recorded by ``tools/fixtures/record_quant_mix.py``).

Mixes (toy's target, also accepted under llama.cpp's name -> the file type):

========  ==============  =====================
target    llama.cpp name  ``general.file_type``
========  ==============  =====================
``Q2_K``  ``Q2_K``        10 (MOSTLY_Q2_K)
``Q3_K``  ``Q3_K_M``      12 (MOSTLY_Q3_K_M)
``Q4_K``  ``Q4_K_M``      15 (MOSTLY_Q4_K_M)
``Q5_K``  ``Q5_K_M``      17 (MOSTLY_Q5_K_M)
``Q6_K``  ``Q6_K``        18 (MOSTLY_Q6_K)
========  ==============  =====================

llama.cpp's other K mixes (``Q2_K_S``, ``Q3_K_S``, ``Q3_K_L``, ``Q4_K_S``,
``Q5_K_S``: ``OTHER_K_MIXES``) are not written; ``toy.gguf.convert``
refuses them by name. The non-K targets (``Q8_0``, ``Q4_0`` ... ``IQ4_NL``,
``F16`` ...) are not mixes in toy: every quantizable matrix gets the type.

1. Kept as they are (``quantizable`` is False; llama.cpp's
   ``tensor_allows_quantization``): tensors of fewer than two dimensions
   once trailing extents of 1 are dropped (ggml's ``ggml_n_dims``: norms,
   biases, and Qwen2-MoE's shared-expert gate ``ffn_gate_inp_shexp``, whose
   ggml shape is {D, 1}; llama.cpp writes it with one dimension, and so
   does toy), names not ending in ``weight``, ``*_norm.weight``, the MoE
   router ``ffn_gate_inp.weight`` (routing is sensitive and the tensor is
   small), learned positions ``position_embd.weight`` and BERT's
   ``token_types.weight``, and the small tensors of other families in
   ``_NEVER_QUANTIZED`` (Mamba's conv1d, RWKV's time-mix, T5's relative
   bias, multimodal patch embeddings ...).
2. Each quantizable tensor gets the mix's default type ``T`` (the target),
   changed by the first rule of its *role* (``category``: a name
   substring, llama.cpp's ``tensor_get_category``) that applies:

   ==================================  =====================================================
   role                                type (``mb(i, n)``: ``use_more_bits``, below)
   ==================================  =====================================================
   ``output.weight``; ``token_embd``   Q6_K, or Q8_0 when its rows (ne0) are not a multiple
   when the file has no ``output``     of 256 — the output matrix's error reaches every
   (tied embeddings)                   logit
   ``attn_v`` (and fused ``attn_qkv``  Q2_K: Q4_K if n_head/n_head_kv >= 4 else Q3_K;
   or ``attn_kv_b``), the i-th of n    Q3_K_M: Q5_K for i < 2, else Q4_K; Q4_K_M: Q6_K if
                                       mb(i, n); Q5_K_M: Q6_K if mb(i, n). Then a "70B"
                                       model (``is_70b``) lifts Q3_K/Q4_K to Q5_K, and a
                                       model of exactly 8 experts takes Q8_0
   ``attn_k``                          Q8_0 when the model has exactly 8 experts
   ``ffn_down*`` (dense, ``_exps``,    Q2_K: Q3_K; Q3_K_M: Q5_K for layer < n_layer/16, else
   ``_shexp``) of layer i              Q4_K; Q4_K_M and Q5_K_M: Q6_K if mb(i, n_layer)
   ``attn_output``                     8 experts: Q5_K for Q2_K, Q3_K_M, Q4_K_M; otherwise
                                       Q2_K: Q3_K, Q3_K_M: Q4_K
   anything else (``attn_q``,          T
   ``ffn_gate*``, ``ffn_up*``, an
   untied ``token_embd``, ...)
   ==================================  =====================================================

   ``use_more_bits(i, n)`` is true for the first and last eighth of the
   layers and every third layer between: ``i < n/8 or i >= 7n/8 or
   (i - n/8) % 3 == 2`` (integer division): the layers where quantization
   error hurts most get the extra bits.

   Why these tensors: the output matrix's error reaches every logit;
   ``attn_v`` and ``ffn_down`` write what a layer adds to the residual
   stream, and ``attn_v`` is small when KV heads are shared, so its extra
   bits cost little (llama.cpp's reason for the 70B rule: its ``attn_v`` is
   8 times smaller than ``attn_q``); in an 8-expert model attention is a
   small share of the weights (llama.cpp's comment: Q8_0 ``attn_k`` and
   ``attn_v`` cost Mixtral about 128 MB).
3. The row fallback (llama.cpp's ``tensor_type_fallback``): a type whose
   block does not divide the row (ne0; K-quants need 256, the others 32)
   becomes Q2_K/Q3_K -> Q4_0, Q4_K -> Q5_0, Q5_K -> Q5_1, Q6_K -> Q8_0, and
   F16 when even that block does not divide it.

Which attention tensor is the i-th and which layer an ``ffn_down`` is in
follow llama.cpp's walk over the tensors: sorted by layer (``blk.N.``;
other tensors first), then by name; ``attn_v`` tensors are counted in that
order, and so are ``ffn_down`` tensors of a dense model, whose count is
their layer; a MoE model (more than one expert) takes the layer from the
name. The model facts come from the metadata (``ModelFacts``): the layer
count, the expert count, the first layer's head counts, and whether
llama.cpp loads it as a "70B" (80-layer llama with grouped KV heads,
80-layer qwen2/deci/olmo, 68-layer jais2).

Not modelled, as toy's quantizer has no such options: llama.cpp's
importance matrix, ``--pure``, ``--leave-output-tensor``,
``--output-tensor-type``, ``--token-embedding-type``, ``--tensor-type``
overrides and layer pruning. Falcon has rules of its own and is refused;
toy does not run it. Architectures toy does not run get the rules above,
which is what llama.cpp does for all but a few (GLM-5's indexer tensors,
for one).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from enum import Enum
from typing import Any

from toy_ggml import GGMLType, type_info

# toy's K-quant target -> the llama_ftype of llama.cpp's mix it writes
MIX_FTYPE: dict[GGMLType, int] = {
    GGMLType.Q2_K: 10,
    GGMLType.Q3_K: 12,
    GGMLType.Q4_K: 15,
    GGMLType.Q5_K: 17,
    GGMLType.Q6_K: 18,
}
MIX_NAME: dict[GGMLType, str] = {
    GGMLType.Q2_K: "Q2_K",
    GGMLType.Q3_K: "Q3_K_M",
    GGMLType.Q4_K: "Q4_K_M",
    GGMLType.Q5_K: "Q5_K_M",
    GGMLType.Q6_K: "Q6_K",
}
# llama.cpp's K-quant mixes toy does not write (name -> llama_ftype)
OTHER_K_MIXES: dict[str, int] = {"Q3_K_S": 11, "Q3_K_L": 13, "Q4_K_S": 14, "Q5_K_S": 16, "Q2_K_S": 21}

# llama.cpp's tensor_type_fallback: the type a row the block does not divide gets instead
FALLBACK: dict[GGMLType, GGMLType] = {
    GGMLType.Q2_K: GGMLType.Q4_0,
    GGMLType.Q3_K: GGMLType.Q4_0,
    GGMLType.Q4_K: GGMLType.Q5_0,
    GGMLType.Q5_K: GGMLType.Q5_1,
    GGMLType.Q6_K: GGMLType.Q8_0,
}

# name substrings llama.cpp never quantizes (besides the rules in `quantizable`): small
# tensors of families toy does not run, listed so a file of theirs gets llama.cpp's types
_NEVER_QUANTIZED = (
    "ffn_gate_inp.weight",  # MoE routers
    "ffn_gate_tid2eid.weight",  # DeepSeek-V4's token -> expert table
    "altup",  # Gemma 3n
    "laurel",
    "per_layer_model_proj",
    "ssm_conv1d",  # Mamba
    "shortconv.conv.weight",  # LFM2
    "indexer.k_proj.weight",  # MiniMax
    "indexer.q_proj.weight",
    "time_mix_first.weight",  # RWKV
    "time_mix_w0.weight",
    "time_mix_w1.weight",
    "time_mix_w2.weight",
    "time_mix_v0.weight",
    "time_mix_v1.weight",
    "time_mix_v2.weight",
    "time_mix_a0.weight",
    "time_mix_a1.weight",
    "time_mix_a2.weight",
    "time_mix_g1.weight",
    "time_mix_g2.weight",
    "time_mix_decay_w1.weight",
    "time_mix_decay_w2.weight",
    "time_mix_lerp_fused.weight",
    "attn_rel_b.weight",  # T5
    ".position_embd",  # multimodal towers
    "sam.pos_embd",
    "sam.neck.",
    "sam.net_",
    ".rel_pos",
    ".patch_embd",
    ".patch_merger",
    "a.rvq.codebook",  # audio codebooks
    "mm.a.code_embd",
)
# whole names never quantized: learned positions (GPT-2) and token types (BERT)
_NEVER_QUANTIZED_NAMES = ("position_embd.weight", "token_types.weight")

# architectures llama.cpp loads as LLM_TYPE_70B at this layer count (the llama case also
# needs grouped KV heads and not 8 experts; see ModelFacts.is_70b)
_70B_LAYERS = {"llama": 80, "qwen2": 80, "deci": 80, "olmo": 80, "jais2": 68}
# architectures whose mix has rules of their own, not modelled here
_REFUSED_ARCHS = ("falcon",)

_LAYER = re.compile(r"blk\.(\d+)\.")


class Category(Enum):
    """A tensor's role as llama.cpp's quantizer sees it (``tensor_get_category``)."""

    OUTPUT = "output"
    TOKEN_EMBD = "token_embd"
    ATTN_QKV = "attn_qkv"
    ATTN_KV_B = "attn_kv_b"
    ATTN_V = "attn_v"
    ATTN_K = "attn_k"
    ATTN_Q = "attn_q"
    ATTN_OUTPUT = "attn_output"
    FFN_UP = "ffn_up"
    FFN_GATE = "ffn_gate"
    FFN_DOWN = "ffn_down"
    OTHER = "other"


# first match wins, in this order: (name substring, category)
_CATEGORY_SUBSTRINGS = (
    ("attn_qkv.weight", Category.ATTN_QKV),
    ("attn_kv_b.weight", Category.ATTN_KV_B),
    ("attn_v.weight", Category.ATTN_V),
    ("attn_k.weight", Category.ATTN_K),
    ("attn_q.weight", Category.ATTN_Q),
    ("attn_output.weight", Category.ATTN_OUTPUT),
    ("ffn_up", Category.FFN_UP),  # dense, _exps and _shexp alike
    ("ffn_gate", Category.FFN_GATE),
    ("ffn_down", Category.FFN_DOWN),
)
# the value-like attention tensors, counted together (fused QKV holds V)
_ATTN_V_LIKE = (Category.ATTN_V, Category.ATTN_QKV, Category.ATTN_KV_B)


def category(name: str) -> Category:
    """The role of tensor ``name``."""
    if name == "output.weight":
        return Category.OUTPUT
    if name in ("token_embd.weight", "per_layer_token_embd.weight"):
        return Category.TOKEN_EMBD
    for sub, cat in _CATEGORY_SUBSTRINGS:
        if sub in name:
            return cat
    return Category.OTHER


def ggml_dims(shape: tuple[int, ...]) -> tuple[int, ...]:
    """A NumPy-order shape without its leading extents of 1 (ggml's trailing
    ones), at least one dimension: the shape llama.cpp writes."""
    shape = tuple(int(d) for d in shape)
    i = 0
    while i < len(shape) - 1 and shape[i] == 1:
        i += 1
    return shape[i:]


def quantizable(name: str, shape: tuple[int, ...]) -> bool:
    """Whether llama.cpp's quantizer converts tensor ``name`` of NumPy-order
    ``shape`` at all (rule 1 of the module docstring); otherwise it keeps it."""
    if len(ggml_dims(shape)) < 2 or not name.endswith("weight") or "_norm.weight" in name:
        return False
    if name in _NEVER_QUANTIZED_NAMES:
        return False
    return not any(s in name for s in _NEVER_QUANTIZED)


def block_size(t: GGMLType) -> int:
    """Elements per block of ``t`` (1 for F32/F16)."""
    return type_info(t).block_size


def fallback_type(ncols: int, t: GGMLType) -> GGMLType:
    """``t`` for rows of ``ncols`` elements, or llama.cpp's fallback when its
    block does not divide them (rule 3)."""
    if ncols % block_size(t) == 0:
        return t
    fb = FALLBACK.get(t, t)
    return fb if ncols % block_size(fb) == 0 else GGMLType.F16


def use_more_bits(i: int, n: int) -> bool:
    """llama.cpp's choice of the layers that get more bits: the first and last
    eighth of ``n`` and every third one between."""
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


def _first(value: Any) -> int:
    """A per-layer key's first layer (scalar or array)."""
    try:
        return int(value)
    except TypeError:  # an array: one value per layer
        return int(list(value)[0])


@dataclass(frozen=True)
class ModelFacts:
    """What llama.cpp's mix rules read from the model's metadata."""

    arch: str
    n_layer: int
    n_expert: int = 0
    n_head: int = 0
    n_head_kv: int = 0

    @classmethod
    def from_metadata(cls, metadata: Mapping[str, Any]) -> ModelFacts:
        arch = str(metadata.get("general.architecture", ""))
        n_layer = metadata.get(f"{arch}.block_count")
        if n_layer is None:
            raise ValueError(
                f"{arch or 'the file'}: no {arch}.block_count; llama.cpp's K-quant mixes need the layer count "
                "(a uniform type such as Q8_0 or Q4_0 does not)"
            )
        n_head = _first(metadata.get(f"{arch}.attention.head_count", 0))
        n_head_kv = metadata.get(f"{arch}.attention.head_count_kv")
        return cls(
            arch=arch,
            n_layer=int(n_layer),
            n_expert=int(metadata.get(f"{arch}.expert_count", 0) or 0),
            n_head=n_head,
            n_head_kv=n_head if n_head_kv is None else _first(n_head_kv),
        )

    @property
    def n_gqa(self) -> int:
        """Query heads per KV head (0 without KV heads), as llama.cpp's ``n_gqa()``."""
        return self.n_head // self.n_head_kv if self.n_head_kv else 0

    @property
    def is_70b(self) -> bool:
        """Whether llama.cpp loads the model as ``LLM_TYPE_70B`` (its attn_v rule)."""
        if _70B_LAYERS.get(self.arch) != self.n_layer:
            return False
        if self.arch == "llama":  # 8 experts make it 8x7B-like; equal heads make it 65B
            return self.n_expert != 8 and self.n_head != self.n_head_kv
        return True


@dataclass(frozen=True)
class Choice:
    """A quantizable tensor's type: ``rule`` is what the mix's rules chose,
    ``type`` what is written (``rule`` or its row fallback)."""

    rule: GGMLType
    type: GGMLType

    @property
    def fell_back(self) -> bool:
        return self.type != self.rule


def _layer_of(name: str) -> int:
    m = _LAYER.match(name)
    return int(m.group(1)) if m else -1


def _rule_type(
    mix: GGMLType, cat: Category, facts: ModelFacts, ncols: int, tied: bool, wv: tuple[int, int], ffn: tuple[int, int]
) -> GGMLType:
    """Rule 2 of the module docstring for one tensor; ``wv`` is the (i, n) of
    the value-like attention tensors, ``ffn`` the (layer, n_layer) of a
    feed-forward tensor."""
    q2, q3, q4, q5 = (mix == t for t in (GGMLType.Q2_K, GGMLType.Q3_K, GGMLType.Q4_K, GGMLType.Q5_K))
    eight_experts = facts.n_expert == 8
    if cat == Category.OUTPUT or (cat == Category.TOKEN_EMBD and tied):
        # every mix here has a 256 block and is not Q8_0
        return GGMLType.Q8_0 if ncols % block_size(mix) else GGMLType.Q6_K
    if cat in _ATTN_V_LIKE:
        i, n = wv
        t = mix
        if q2:
            t = GGMLType.Q4_K if facts.n_gqa >= 4 else GGMLType.Q3_K
        elif q3:
            t = GGMLType.Q5_K if i < 2 else GGMLType.Q4_K
        elif (q4 or q5) and use_more_bits(i, n):
            t = GGMLType.Q6_K
        if facts.is_70b and t in (GGMLType.Q3_K, GGMLType.Q4_K):
            t = GGMLType.Q5_K  # its attn_v is 8x smaller than attn_q: the bits are cheap
        if eight_experts:
            t = GGMLType.Q8_0
        return t
    if cat == Category.ATTN_K:
        return GGMLType.Q8_0 if eight_experts else mix
    if cat == Category.FFN_DOWN:
        i, n = ffn
        if q2:
            return GGMLType.Q3_K
        if q3:
            return GGMLType.Q5_K if i < n // 16 else GGMLType.Q4_K
        if (q4 or q5) and use_more_bits(i, n):
            return GGMLType.Q6_K
        return mix
    if cat == Category.ATTN_OUTPUT:
        if eight_experts:
            return GGMLType.Q5_K if (q2 or q3 or q4) else mix
        if q2:
            return GGMLType.Q3_K
        if q3:
            return GGMLType.Q4_K
        return mix
    return mix


def plan(shapes: Mapping[str, tuple[int, ...]], metadata: Mapping[str, Any], target: GGMLType) -> dict[str, Choice]:
    """The type of every tensor llama.cpp's mix for ``target`` (a key of
    ``MIX_FTYPE``) quantizes, by name; ``shapes`` maps every tensor of the
    file to its NumPy-order shape. Tensors absent from the result are kept
    as they are (rule 1). ValueError for a target that is not a mix, a
    refused architecture, or a MoE tensor whose layer cannot be told."""
    if target not in MIX_FTYPE:
        raise ValueError(f"{target.name} is not one of llama.cpp's K-quant mixes toy writes")
    facts = ModelFacts.from_metadata(metadata)
    if facts.arch in _REFUSED_ARCHS:
        raise ValueError(
            f"{facts.arch}: llama.cpp's {MIX_NAME[target]} mix has rules of its own for this architecture, "
            "which toy does not implement"
        )
    tied = "output.weight" not in shapes
    moe = facts.n_expert > 1
    # llama.cpp's walk: by layer (other tensors first), then by name
    names = sorted(shapes, key=lambda n: (_layer_of(n), n))
    n_wv = sum(category(n) in _ATTN_V_LIKE for n in names)
    i_wv = i_down = 0
    out: dict[str, Choice] = {}
    for name in names:
        shape = shapes[name]
        if not quantizable(name, shape):
            continue
        cat = category(name)
        ffn = (0, facts.n_layer)
        if cat in (Category.FFN_DOWN, Category.FFN_GATE, Category.FFN_UP) and moe:
            m = _LAYER.match(name)
            if m is None or not 0 <= int(m.group(1)) < facts.n_layer:
                raise ValueError(f"cannot tell the layer (0..{facts.n_layer - 1}) of MoE tensor {name!r}")
            ffn = (int(m.group(1)), facts.n_layer)
        elif cat == Category.FFN_DOWN:
            ffn = (i_down, facts.n_layer)
        ncols = int(shape[-1])
        rule = _rule_type(target, cat, facts, ncols, tied, (i_wv, n_wv), ffn)
        if cat in _ATTN_V_LIKE:
            i_wv += 1
        if cat == Category.FFN_DOWN:
            i_down += 1
        out[name] = Choice(rule, fallback_type(ncols, rule))
    return out


__all__ = [
    "FALLBACK",
    "MIX_FTYPE",
    "MIX_NAME",
    "OTHER_K_MIXES",
    "Category",
    "Choice",
    "ModelFacts",
    "block_size",
    "category",
    "fallback_type",
    "ggml_dims",
    "plan",
    "quantizable",
    "use_more_bits",
]
