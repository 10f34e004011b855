"""Load-time checks of what a model file declares, shared by every
architecture (the built-in families and plugins such as toy-vit).

A GGUF file's metadata declares the sizes that shape everything built from
it: ``block_count`` sizes the per-layer lists of expected tensors, head
counts and widths size the graph, the vocabulary sizes the logits, the
context the KV cache. A file is outside input: its numbers may be 0, -1,
2**63 or merely off by one. So every architecture's config reader
(``config_from_metadata``) goes through three steps, in this order:

1. ``whole`` reads each count key as a whole number within sane bounds
   (``LIMITS``), before any value is used to size a loop or an allocation;
2. ``check_blocks`` compares the declared block count with the block
   tensors (``blk.N.*``) actually present, before any per-layer list is
   built: a file cannot make toy build a list longer than its own tensor
   table;
3. ``check_shapes``, once the config exists, compares every tensor the
   config expects (the architecture's ``params(cfg)``) with the shape the
   file has, and names the tensor, both shapes and the metadata key whose
   value disagrees (``sources``: key -> value, the dimensions a shape is
   made of).

Each failure is an ``UnsupportedModelError`` (a ``BadInputError``: the CLI
prints ``error:``/``hint:`` and exits 2) or the class a caller passes (toy-vit's
``ViTFileError``), whose message names the key and its value, or the tensor.
The bounds are far above any real model (``LIMITS``); they exist so that a
hostile number is refused in microseconds instead of after gigabytes.

This module imports neither numpy nor ggml (the registry must load without
them).
"""

from __future__ import annotations

import math
import numbers
import re
from collections.abc import Iterable, Mapping
from typing import Any

from toy.models import UnsupportedModelError

#: upper bounds of declared sizes (inclusive): far above any released model, below what would overflow ggml's
#: ``int`` arguments or exhaust memory before a shape check could refuse the file
LIMITS: dict[str, int] = {
    "layers": 4096,  # block_count
    "heads": 4096,  # attention.head_count, attention.head_count_kv
    "width": 1 << 20,  # embedding_length, feed_forward_length, key/value length, expert widths
    "vocab": 1 << 24,  # vocab_size
    "experts": 4096,  # expert_count, expert_used_count
    "context": (1 << 31) - 1,  # context_length, sliding_window, rope original context (ggml takes an int)
}

_BLOCK = re.compile(r"blk\.(\d+)\.")
_DAMAGED = "the file's metadata is damaged or not for this architecture"


def show(v: Any, limit: int = 60) -> str:
    """A metadata value for a message: its repr, cut at ``limit`` characters."""
    text = repr(v)
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _scalar_int(v: Any) -> int | None:
    """v as an int when it is a whole number (an integral, finite float
    counts), else None."""
    if isinstance(v, bool):
        return None
    if isinstance(v, numbers.Integral):
        return int(v)
    if isinstance(v, numbers.Real) and math.isfinite(x := float(v)) and x.is_integer():
        return int(x)
    return None


def whole(
    metadata: Mapping[str, Any],
    key: str,
    lo: int,
    hi: int,
    *,
    per_layer: bool = False,
    error: type[UnsupportedModelError] = UnsupportedModelError,
) -> int | None:
    """The value of the count key ``key`` (None when the file has none),
    checked: a whole number in ``lo..hi``; with ``per_layer`` an array of
    them is accepted too (its first value is returned; a caller that runs
    only uniform layers refuses the others). ``error`` naming the key and
    its value otherwise."""
    v = metadata.get(key)
    if v is None:
        return None
    if isinstance(v, (str, bytes)):
        raise error(f"{key} = {show(v)} is not a whole number")
    if not isinstance(v, numbers.Real) and hasattr(v, "__len__"):  # an array
        if not per_layer:
            raise error(f"{key} = {show(v)}: one whole number is expected, not an array")
        items = list(v)
        if not items:
            raise error(f"{key} is an empty array: one whole number per layer is expected")
    else:
        items = [v]
    first = None
    for x in items:
        n = _scalar_int(x)
        if n is None:
            raise error(f"{key} = {show(x)} is not a whole number", hint=_DAMAGED)
        if not lo <= n <= hi:
            raise error(
                f"{key} = {n} is out of range: expected {lo}..{hi}",
                hint=_DAMAGED,
            )
        first = n if first is None else first
    return first


def blocks_present(tensors: Iterable[str], prefix: str = "") -> list[int]:
    """The sorted block indices N of the tensors named ``{prefix}blk.N.*``."""
    out = set()
    for name in tensors:
        if prefix and not name.startswith(prefix):
            continue
        m = _BLOCK.match(name, len(prefix))
        if m:
            out.add(int(m.group(1)))
    return sorted(out)


def require(
    arch: str,
    names: Iterable[str],
    tensors: Mapping[str, Any],
    error: type[UnsupportedModelError] = UnsupportedModelError,
) -> None:
    """Every tensor of ``names`` is present; ``error`` naming the first
    missing one (and how many more) otherwise."""
    missing = [n for n in names if n not in tensors]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise error(f"the {arch} model lacks tensor {missing[0]!r}{more}")


def check_blocks(
    key: str,
    n_layer: Any,
    tensors: Iterable[str],
    prefix: str = "",
    error: type[UnsupportedModelError] = UnsupportedModelError,
) -> int:
    """``n_layer`` (the value of ``key``) checked against the block tensors
    present (``{prefix}blk.N.*``): a whole number >= 1, at most
    ``LIMITS["layers"]``, and exactly the number of blocks the file holds,
    numbered 0..n-1. Returns it as an int."""
    n = _scalar_int(n_layer)
    if n is None:
        raise error(f"{key} = {show(n_layer)} is not a whole number")
    present = blocks_present(tensors, prefix)
    blk = f"{prefix}blk"
    if not present:
        have = f"no block tensors ({blk}.N.*)"
    elif present == list(range(len(present))):
        have = f"tensors for {len(present)} block{'s' if len(present) > 1 else ''} ({blk}.0 … {blk}.{present[-1]})"
    else:
        gap = next(i for i in range(len(present) + 1) if i not in present)
        have = f"block tensors numbered {present[0]} … {present[-1]} with {blk}.{gap} missing"
    if n < 1:
        raise error(f"{key} = {n}: a model needs at least one block; the file has {have}", hint=_DAMAGED)
    if n > LIMITS["layers"] or present != list(range(n)):
        raise error(
            f"{key} = {n}, but the file has {have}",
            hint="the block count and the tensors disagree: the file is damaged or was written inconsistently",
        )
    return n


#: ``ParamInfo.kind`` of the tensors the graphs use in element-wise ops, which take F32 only
F32_KINDS = ("norm", "norm_bias", "bias")


def _squeezed(shape: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(x for x in shape if x != 1)


def check_shapes(
    arch: str,
    expected: Mapping[str, Any],
    tensors: Mapping[str, Any],
    sources: Mapping[str, tuple[str, int | None]],
    axes: Mapping[str, tuple[str, ...]] = {},
    error: type[UnsupportedModelError] = UnsupportedModelError,
) -> None:
    """Every tensor of ``expected`` (name -> ``ParamInfo`` or a shape, NumPy
    order: an architecture's ``params(cfg)``) is present with that shape.

    On a mismatch the message names the tensor, its shape, the shape the
    metadata implies, and the metadata behind the dimension that differs:
    ``sources`` maps a symbol to ``(label, value)`` (``"ff":
    ("llama.feed_forward_length", 1536)``), ``axes`` a tensor name's suffix
    (``"ffn_up.weight"``) to the symbol of each axis (``("ff", "d")``). A
    tensor without an entry cites the sources whose value is the dimension
    that differs."""
    for name, p in expected.items():
        want = tuple(int(x) for x in getattr(p, "shape", p))
        if name not in tensors:
            raise error(f"the {arch} model lacks tensor {name!r}")
        t = tensors[name]
        if not hasattr(t, "shape"):  # a caller that lists names only (tests of the config readers)
            continue
        kind = getattr(p, "kind", None)
        if kind in F32_KINDS and getattr(t.dtype, "name", "F32") != "F32":
            raise error(
                f"tensor {name!r} is {t.dtype.name}: a {kind.replace('_', ' ')} tensor must be F32",
                hint="converters store 1-D tensors (norm gains, biases) as F32",
            )
        got = tuple(int(x) for x in t.shape)
        if got == want or _squeezed(got) == _squeezed(want):  # llama.cpp takes (d,) for (1, d)
            continue
        if len(got) != len(want):
            raise error(f"tensor {name!r} has {len(got)} dimensions {got}; the {arch} model needs {len(want)}: {want}")
        syms = next((v for k, v in axes.items() if name == k or name.endswith("." + k)), ())
        cited: list[str] = []
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            if g == w:
                continue
            own = sources.get(syms[i]) if i < len(syms) else None
            for label, v in [own] if own and own[1] == w else sources.values():
                if v == w and f"{label} = {v}" not in cited:
                    cited.append(f"{label} = {v}")
        hint = "the metadata and the tensors disagree: the file is damaged or was written inconsistently"
        by = " and ".join(cited) if cited else "the metadata"
        raise error(f"tensor {name!r} has shape {got}, but {by} implies {want}", hint=hint)


def check_vocab(
    arch: str, metadata: Mapping[str, Any], n_vocab: int, error: type[UnsupportedModelError] = UnsupportedModelError
) -> None:
    """The token list (``tokenizer.ggml.tokens``), when the file has one,
    has one token per row of the embedding (``n_vocab``, which
    ``check_shapes`` has compared with ``token_embd.weight``), as llama.cpp
    requires: a token beyond the rows would index past the embedding."""
    tokens = metadata.get("tokenizer.ggml.tokens")
    if tokens is None or isinstance(tokens, (str, bytes)) or not hasattr(tokens, "__len__"):
        return
    if len(tokens) != n_vocab:
        raise error(
            f"tokenizer.ggml.tokens has {len(tokens)} tokens, but the {arch} model's vocabulary "
            f"(token_embd.weight) has {n_vocab} rows",
            hint="the tokenizer and the weights disagree: the file is damaged or was written inconsistently",
        )


#: llama.cpp's count keys (suffixes of ``{arch}.``) the language-model families read: (lo, hi, per-layer arrays)
COUNT_KEYS: dict[str, tuple[int, int, bool]] = {
    "block_count": (-(1 << 64), 1 << 64, False),  # a whole number here; check_blocks bounds it, naming the blocks
    "embedding_length": (1, LIMITS["width"], False),
    "feed_forward_length": (1, LIMITS["width"], True),
    "attention.head_count": (1, LIMITS["heads"], True),
    "attention.head_count_kv": (1, LIMITS["heads"], True),
    "attention.key_length": (1, LIMITS["width"], False),
    "attention.value_length": (1, LIMITS["width"], False),
    "vocab_size": (1, LIMITS["vocab"], False),
    "context_length": (1, LIMITS["context"], False),
    "rope.dimension_count": (1, LIMITS["width"], False),
    "rope.scaling.original_context_length": (0, LIMITS["context"], False),
    "attention.sliding_window": (0, LIMITS["context"], False),
    "expert_count": (0, LIMITS["experts"], False),
    "expert_used_count": (0, LIMITS["experts"], False),
    "expert_feed_forward_length": (0, LIMITS["width"], False),
    "expert_shared_feed_forward_length": (0, LIMITS["width"], False),
}


#: llama.cpp's real-valued keys (suffixes of ``{arch}.``) the families hand to ggml: the least value (None:
#: any) and whether the least value itself is allowed; every one must be finite
FLOAT_KEYS: dict[str, tuple[float | None, bool]] = {
    "attention.layer_norm_rms_epsilon": (0.0, True),
    "attention.layer_norm_epsilon": (0.0, True),
    "rope.freq_base": (0.0, False),
    "rope.freq_base_swa": (0.0, False),
    "rope.scaling.factor": (0.0, False),
    "rope.scaling.attn_factor": (None, True),
    "rope.scaling.yarn_ext_factor": (None, True),
    "rope.scaling.yarn_beta_fast": (None, True),
    "rope.scaling.yarn_beta_slow": (None, True),
    "rope.scaling.yarn_log_multiplier": (None, True),
    "rope.scale_linear": (0.0, False),
    "attn_logit_softcapping": (0.0, True),
    "final_logit_softcapping": (0.0, True),
    "expert_weights_scale": (None, True),
}


def check_counts(
    arch: str, metadata: Mapping[str, Any], error: type[UnsupportedModelError] = UnsupportedModelError
) -> None:
    """Every count key of ``COUNT_KEYS`` the file has for ``arch`` is a
    whole number within its bounds (``whole``), and every real-valued key
    of ``FLOAT_KEYS`` a finite number within its own."""
    for suffix, (lo, hi, per_layer) in COUNT_KEYS.items():
        whole(metadata, f"{arch}.{suffix}", lo, hi, per_layer=per_layer, error=error)
    for suffix, (least, inclusive) in FLOAT_KEYS.items():
        key = f"{arch}.{suffix}"
        v = metadata.get(key)
        if v is None:
            continue
        if isinstance(v, bool) or not isinstance(v, numbers.Real):
            raise error(f"{key} = {show(v)} is not a number")
        x = float(v)
        if not math.isfinite(x) or least is not None and (x < least or x == least and not inclusive):
            bound = "" if least is None else f" {'>=' if inclusive else '>'} {least:g}"
            raise error(f"{key} = {show(x)}: expected a finite number{bound}")


#: tensor name suffix -> the symbol of each axis (``lm_sources``), for the language-model families' tensors
LM_AXES: dict[str, tuple[str, ...]] = {
    "token_embd.weight": ("vocab", "d"),
    "output.weight": ("vocab", "d"),
    "position_embd.weight": ("ctx", "d"),
    "attn_q.weight": ("q", "d"),
    "attn_k.weight": ("kv", "d"),
    "attn_v.weight": ("kv", "d"),
    "attn_q.bias": ("q",),
    "attn_k.bias": ("kv",),
    "attn_v.bias": ("kv",),
    "attn_qkv.weight": ("qkv", "d"),
    "attn_qkv.bias": ("qkv",),
    "attn_output.weight": ("d", "q"),
    "ffn_gate.weight": ("ff", "d"),
    "ffn_up.weight": ("ff", "d"),
    "ffn_up.bias": ("ff",),
    "ffn_down.weight": ("d", "ff"),
    "ffn_gate_inp.weight": ("experts", "d"),
    "ffn_gate_exps.weight": ("experts", "ff_expert", "d"),
    "ffn_up_exps.weight": ("experts", "ff_expert", "d"),
    "ffn_down_exps.weight": ("experts", "d", "ff_expert"),
    "ffn_gate_shexp.weight": ("ff_shared", "d"),
    "ffn_up_shexp.weight": ("ff_shared", "d"),
    "ffn_down_shexp.weight": ("d", "ff_shared"),
    "ffn_gate_inp_shexp.weight": ("one", "d"),
}


def lm_sources(arch: str, metadata: Mapping[str, Any], cfg: Any) -> dict[str, tuple[str, int | None]]:
    """The metadata a language model's tensor shapes are made of, read from
    its config: symbol (``LM_AXES``) -> (the key or keys, the dimension
    they declare), for ``check_shapes``' messages."""
    a = arch
    g = lambda name: getattr(cfg, name, None)  # noqa: E731
    H, Hkv, D, d = g("n_head"), g("n_head_kv"), g("head_dim"), g("d_model")
    head = f"{a}.attention.key_length"
    if head not in metadata:
        head = "head size (embedding_length / head_count)"
    vocab = f"{a}.vocab_size" if f"{a}.vocab_size" in metadata else "the vocabulary (tokenizer.ggml.tokens)"
    return {
        "d": (f"{a}.embedding_length", d),
        "ff": (f"{a}.feed_forward_length", g("d_ff")),
        "vocab": (vocab, g("n_vocab")),
        "q": (f"{a}.attention.head_count ({H}) × {head} ({D})", H * D if H and D else None),
        "kv": (f"{a}.attention.head_count_kv ({Hkv}) × {head} ({D})", Hkv * D if Hkv and D else None),
        "qkv": (f"3 × {a}.embedding_length ({d})", 3 * d if d else None),
        "head": (head, D),
        "ctx": (f"{a}.context_length", g("n_ctx_train")),
        "experts": (f"{a}.expert_count", g("n_expert") or None),
        "ff_expert": (f"{a}.expert_feed_forward_length", g("d_ff_expert") or None),
        "ff_shared": (f"{a}.expert_shared_feed_forward_length", g("d_ff_shared") or None),
    }


__all__ = [
    "COUNT_KEYS",
    "F32_KINDS",
    "FLOAT_KEYS",
    "LIMITS",
    "LM_AXES",
    "blocks_present",
    "check_blocks",
    "check_counts",
    "check_shapes",
    "check_vocab",
    "lm_sources",
    "require",
    "show",
    "whole",
]
