"""RoPE scaling between a Hugging Face ``config.json`` and GGUF, both ways,
for the llama family (and any family whose converter uses llama.cpp's
generic ``TextModel`` rope keys).

Hugging Face describes a model's RoPE scaling in ``config["rope_scaling"]``
(``rope_parameters`` in newer configs; older ones spell ``rope_type`` as
``type``). llama.cpp's ``convert_hf_to_gguf.py`` turns it into GGUF in two
places, and an import must do the same to write the same file:

- ``linear`` and ``yarn`` become ``{arch}.rope.scaling.*`` keys, which the
  converter writes right after ``attention.head_count_kv`` and before
  ``rope.freq_base`` (``rope_metadata_from_hf``);
- ``llama3`` becomes a tensor, ``rope_freqs.weight``: one divisor per
  rotary frequency, computed from the config in float32 and written before
  every checkpoint tensor (``rope_extra_tensors``). Only llama's converter
  does this; the other families' converters drop the scaling silently, so
  toy refuses it there rather than import a different model.

What toy's runtime (``toy.models.llama``) cannot run the way transformers
runs it is refused with ``HFMappingError`` naming the ``rope_scaling`` field:
``dynamic`` and ``longrope`` scaling, YaRN's ``attention_factor`` /
``mscale`` / ``mscale_all_dim`` (transformers replaces the magnitude factor
``1 + 0.1 ln factor`` with them, ggml always applies that one) and
``attn_factor`` (the converter keeps it, transformers ignores it), YaRN with
``truncate`` false (ggml always rounds the correction range outwards) or an
``extrapolation_factor`` other than 1 (transformers has none).

Export (``rope_scaling_to_hf``) goes the other way from toy's config: linear
and YaRN from their keys; llama3 from ``rope_freqs.weight`` (helped by the
GGUF's ``rope.scaling.factor`` / ``original_context_length`` when it has
them), accepted only when the recovered parameters give back that tensor (so
transformers computes the same frequencies).

The llama3 divisors follow the converter's float32 arithmetic step by step
(its ``a / tensor`` is a reciprocal times ``a``, its scalars are rounded to
float32 first); the one step NumPy cannot reproduce bit for bit is torch's
float32 ``pow`` (SLEEF, not always correctly rounded), done here in float64
and rounded. Where torch's pow is off in its last bit, a divisor between 1
and ``factor`` may differ in its last bits (on the tests' grid of 1080
settings every 1 and factor is the converter's, and 15 of 5484 blended
divisors differ, by under 1e-6 relative; on Llama 3.1/3.2's settings none).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import numpy as np

from toy.models.hf import HFMappingError, MetaEntry

#: the family whose converter computes llama3's rope_freqs.weight (LlamaModel.generate_extra_tensors)
LLAMA3_ARCHITECTURES = ("llama",)
#: llama3's fields: transformers requires all four (llama.cpp's converter would fill in defaults)
_LLAMA3_FIELDS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
#: YaRN fields refused -> why
_YARN_REFUSED = {
    "attention_factor": "transformers uses it instead of YaRN's magnitude factor 1 + 0.1 ln(factor), which ggml "
    "always applies",
    "attn_factor": "llama.cpp's converter writes it as yarn_attn_factor while transformers ignores it, so the two "
    "would run different models",
    "mscale": "transformers derives the magnitude factor from mscale/mscale_all_dim (DeepSeek's YaRN); ggml "
    "applies 1 + 0.1 ln(factor)",
    "mscale_all_dim": "transformers derives the magnitude factor from mscale/mscale_all_dim (DeepSeek's YaRN); "
    "ggml applies 1 + 0.1 ln(factor)",
}
_F32 = np.float32


def _fail(message: str, field: str, hint: str) -> HFMappingError:
    return HFMappingError(message, hint=hint, field=field)


def rope_parameters(config: Mapping[str, Any]) -> dict[str, Any]:
    """The RoPE parameters as llama.cpp's converter sees them: ``rope_parameters``
    or ``rope_scaling`` (its ``full_attention`` entry when split per layer
    kind), with ``type`` read as ``rope_type`` and the top-level ``rope_theta``
    and ``original_max_position_embeddings`` mirrored in when absent."""
    raw = config.get("rope_parameters", config.get("rope_scaling")) or {}
    if not isinstance(raw, Mapping):
        raise _fail(f"config.json: rope_scaling = {raw!r} is not an object", "rope_scaling",
                    'write it as {"rope_type": ..., "factor": ...} or null')  # fmt: skip
    params = dict(raw)
    split = "full_attention" in params or "sliding_attention" in params
    if not split:
        if "rope_theta" not in params and config.get("rope_theta") is not None:
            params["rope_theta"] = config["rope_theta"]
        if "rope_type" not in params and params.get("type") is not None:
            params["rope_type"] = params["type"]
        omp = config.get("original_max_position_embeddings")
        if "original_max_position_embeddings" not in params and omp is not None:
            params["original_max_position_embeddings"] = omp
    full = params.get("full_attention", params)
    if not isinstance(full, Mapping):
        raise _fail("config.json: rope_scaling.full_attention is not an object", "rope_scaling.full_attention",
                    "write the full-attention layers' RoPE parameters as an object")  # fmt: skip
    return dict(full)


def _rope_type(params: Mapping[str, Any]) -> str | None:
    kind = params.get("rope_type")
    if kind is None:
        return None
    if not isinstance(kind, str):
        raise _fail(f"config.json: rope_scaling.rope_type = {kind!r} is not a string", "rope_scaling.rope_type",
                    'use "default", "linear", "yarn" or "llama3"')  # fmt: skip
    return "llama3" if kind.lower() == "llama3" else kind


def _number(params: Mapping[str, Any], key: str, *, positive: bool = True) -> float:
    v = params.get(key)
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or (positive and v <= 0):
        need = "a positive number" if positive else "a number"
        raise _fail(f"config.json: rope_scaling.{key} = {v!r} is not {need}", f"rope_scaling.{key}",
                    f"rope_scaling.{key} must be {need}")  # fmt: skip
    return v


def _count(params: Mapping[str, Any], key: str) -> int:
    v = params.get(key)
    if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
        raise _fail(f"config.json: rope_scaling.{key} = {v!r} is not a positive integer", f"rope_scaling.{key}",
                    f"rope_scaling.{key} must be the pre-scaling context length, an integer")  # fmt: skip
    return v


def rope_metadata_from_hf(arch: str, config: Mapping[str, Any]) -> list[MetaEntry]:
    """The ``{arch}.rope.scaling.*`` keys llama.cpp's converter writes for
    ``config`` (in its order and types; empty for no scaling and for llama3,
    which is a tensor: ``rope_extra_tensors``). Raises ``HFMappingError`` for a
    scaling toy does not run as transformers does (module docstring)."""
    params = rope_parameters(config)
    kind = _rope_type(params)
    key = f"{arch}.rope.scaling"
    if kind in (None, "default"):
        return []
    if kind == "linear":
        factor = _number(params, "factor")
        return [(f"{key}.type", "linear", "string"), (f"{key}.factor", float(factor), "float32")]
    if kind == "yarn":
        factor = _number(params, "factor")
        for name, why in _YARN_REFUSED.items():
            if params.get(name) is not None:
                raise _fail(f"config.json: rope_scaling.{name} = {params[name]!r} is not supported with YaRN",
                            f"rope_scaling.{name}", why)  # fmt: skip
        if params.get("truncate", True) is not True:
            raise _fail("config.json: rope_scaling.truncate = false is not supported", "rope_scaling.truncate",
                        "ggml rounds YaRN's correction range outwards (truncate true) and cannot do otherwise")  # fmt: skip
        if "original_max_position_embeddings" in params:
            orig = _count(params, "original_max_position_embeddings")
        else:  # transformers' fallback (the converter would stop here with a KeyError)
            orig = _count({"original_max_position_embeddings": config.get("max_position_embeddings")},
                          "original_max_position_embeddings")  # fmt: skip
        out: list[MetaEntry] = [
            (f"{key}.type", "yarn", "string"),
            (f"{key}.factor", float(factor), "float32"),
            (f"{key}.original_context_length", orig, "uint32"),
        ]
        if params.get("extrapolation_factor") is not None:
            ext = _number(params, "extrapolation_factor", positive=False)
            if ext != 1:
                raise _fail(f"config.json: rope_scaling.extrapolation_factor = {ext} is not supported",
                            "rope_scaling.extrapolation_factor",
                            "transformers has no extrapolation factor (it is always 1), so llama.cpp and "
                            "transformers would run different models")  # fmt: skip
            out.append((f"{key}.yarn_ext_factor", float(ext), "float32"))
        for name, gguf_name in (("beta_fast", "yarn_beta_fast"), ("beta_slow", "yarn_beta_slow")):
            if params.get(name) is not None:
                out.append((f"{key}.{gguf_name}", float(_number(params, name)), "float32"))
        return out
    if kind == "llama3":
        if arch not in LLAMA3_ARCHITECTURES:
            raise _fail(f"config.json: rope_scaling.rope_type = 'llama3' is not supported for {arch}",
                        "rope_scaling.rope_type",
                        "llama.cpp's converter computes llama3's rope_freqs.weight for llama only; for "
                        f"{arch} it would drop the scaling")  # fmt: skip
        _llama3_parameters(config, params)  # validated here, computed by rope_extra_tensors
        return []
    hint = {
        "dynamic": "dynamic NTK scaling changes the frequencies with the sequence length; toy runs fixed ones",
        "longrope": "LongRoPE's per-frequency short/long factors are not implemented by toy",
        "su": "LongRoPE's per-frequency short/long factors are not implemented by toy",
    }.get(kind, "toy runs default, linear, yarn and llama3 RoPE")
    raise _fail(f"config.json: rope_scaling.rope_type = {kind!r} is not supported", "rope_scaling.rope_type", hint)


def _llama3_parameters(
    config: Mapping[str, Any], params: Mapping[str, Any]
) -> tuple[float, int, float, float, float, float]:
    """(base, rotary dims, factor, low, high, original context) of a llama3 config, validated."""
    missing = [k for k in _LLAMA3_FIELDS if params.get(k) is None]
    if missing:
        raise _fail(f"config.json: llama3 rope_scaling lacks {missing[0]}", f"rope_scaling.{missing[0]}",
                    "llama3 RoPE needs factor, low_freq_factor, high_freq_factor and "
                    "original_max_position_embeddings (transformers requires all four)")  # fmt: skip
    factor = _number(params, "factor")
    low = _number(params, "low_freq_factor")
    high = _number(params, "high_freq_factor")
    orig = _count(params, "original_max_position_embeddings")
    if not high > low:
        raise _fail(f"config.json: rope_scaling.high_freq_factor = {high} is not above low_freq_factor = {low}",
                    "rope_scaling.high_freq_factor", "llama3 RoPE blends between the two; high must exceed low")  # fmt: skip
    base = params.get("rope_theta", 10000.0)
    if isinstance(base, bool) or not isinstance(base, (int, float)) or not base > 0:
        raise _fail(f"config.json: rope_theta = {base!r} is not a positive number", "rope_theta",
                    "rope_theta is RoPE's base frequency")  # fmt: skip
    dim = config.get("head_dim")
    if dim is None:  # the converter's fallback
        width: Any = config.get("hidden_size")
        heads: Any = config.get("num_attention_heads")
        ok = all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in (width, heads))
        dim = width // heads if ok else None
    if isinstance(dim, bool) or not isinstance(dim, int) or dim <= 0:
        raise _fail(f"config.json: head_dim = {dim!r} is not a positive integer", "head_dim",
                    "the rotary dimensions are head_dim (or hidden_size / num_attention_heads)")  # fmt: skip
    return float(base), dim, float(factor), float(low), float(high), float(orig)


def llama3_freq_factors(base: float, dims: int, factor: float, low: float, high: float, orig: float) -> np.ndarray:
    """llama3's per-frequency divisors (rope_freqs.weight), float32, computed
    as llama.cpp's converter computes them (module docstring)."""
    exps = np.arange(0, dims, 2, dtype=_F32) / _F32(dims)
    pows = (np.float64(base) ** exps.astype(np.float64)).astype(_F32)  # torch: float32 pow
    freqs = (_F32(1) / pows) * _F32(1)  # 1.0 / t = t.reciprocal() * 1.0
    wavelen = (_F32(1) / freqs) * _F32(2 * math.pi)  # 2 * pi / freq
    # the band limits are Python floats compared with float32 tensors: torch rounds them to float32 first
    high_wavelen, low_wavelen = _F32(orig / high), _F32(orig / low)
    smooth = (((_F32(1) / wavelen) * _F32(orig)) - _F32(low)) / _F32(high - low)
    with np.errstate(divide="ignore", over="ignore"):
        blended = _F32(1) / ((_F32(1) - smooth) / _F32(factor) + smooth)
    out = np.where(wavelen < high_wavelen, _F32(1), np.where(wavelen > low_wavelen, _F32(factor), blended))
    return np.ascontiguousarray(out, dtype=_F32)


def rope_extra_tensors(arch: str, config: Mapping[str, Any]) -> list[tuple[str, np.ndarray]]:
    """The GGUF tensors llama.cpp's converter computes from ``config``:
    ``rope_freqs.weight`` (float32, one value per rotary pair) for llama3
    RoPE on llama, nothing otherwise."""
    params = rope_parameters(config)
    if arch not in LLAMA3_ARCHITECTURES or _rope_type(params) != "llama3":
        return []
    return [("rope_freqs.weight", llama3_freq_factors(*_llama3_parameters(config, params)))]


def _decimal(x: float) -> float:
    """A float32 value as the shortest decimal that reads back as it (GGUF keeps 3.3 as 3.2999999523...; a
    config.json says 3.3)."""
    return float(str(_F32(x))) if math.isfinite(x) else x


def _meta_number(metadata: Mapping[str, Any], key: str) -> float | None:
    v = metadata.get(key)
    return float(v) if isinstance(v, (int, float, np.integer, np.floating)) and not isinstance(v, bool) else None


def rope_scaling_to_hf(
    arch: str, cfg: Any, metadata: Mapping[str, Any] | None = None, rope_freqs: Any = None
) -> dict[str, Any] | None:
    """config.json's ``rope_scaling`` for toy's config ``cfg`` (a
    ``LlamaConfig``) of a GGUF with ``metadata`` and ``rope_freqs`` (its
    ``rope_freqs.weight``, needed for llama3): None for no scaling. Raises
    ``HFMappingError`` naming the GGUF key that Hugging Face cannot express."""
    metadata = metadata or {}
    key = f"{arch}.rope.scaling"
    kind = getattr(cfg, "rope_scaling", None)
    attn = float(getattr(cfg, "rope_attn_factor", 1.0))
    if attn != 1.0:
        raise _fail(f"{key}.attn_factor = {attn} has no Hugging Face equivalent", f"{key}.attn_factor",
                    "transformers' RoPE has no extra magnitude factor (YaRN's own 1 + 0.1 ln(factor) is implied)")  # fmt: skip
    if kind is None:
        return None
    factor = _decimal(_meta_number(metadata, f"{key}.factor") or 1.0 / float(cfg.rope_freq_scale))
    if kind == "linear":
        return {"rope_type": "linear", "factor": factor}
    if kind == "yarn":
        if float(cfg.yarn_ext_factor) != 1.0:
            raise _fail(f"{key}.yarn_ext_factor = {cfg.yarn_ext_factor} has no Hugging Face equivalent",
                        f"{key}.yarn_ext_factor", "transformers' YaRN always extrapolates fully (factor 1)")  # fmt: skip
        out: dict[str, Any] = {"rope_type": "yarn", "factor": factor}
        if cfg.rope_orig_ctx:
            out["original_max_position_embeddings"] = int(cfg.rope_orig_ctx)
        out["beta_fast"] = _decimal(float(cfg.yarn_beta_fast))
        out["beta_slow"] = _decimal(float(cfg.yarn_beta_slow))
        return out
    if kind == "llama3":
        if arch not in LLAMA3_ARCHITECTURES:
            raise _fail(f"{arch} with rope_freqs.weight cannot be exported", "rope_freqs.weight",
                        "Hugging Face's llama3 RoPE is exported for llama only")  # fmt: skip
        if rope_freqs is None:
            raise _fail("the llama3 RoPE model has no rope_freqs.weight to export", "rope_freqs.weight",
                        "pass the GGUF's rope_freqs.weight (the per-frequency divisors)")  # fmt: skip
        return _llama3_to_hf(arch, cfg, metadata, np.asarray(rope_freqs, dtype=_F32).reshape(-1))
    raise _fail(f"{key}.type = {kind!r} cannot be exported", f"{key}.type",
                "Hugging Face export supports none, linear, yarn and llama3 RoPE")  # fmt: skip


def _same_divisors(a: np.ndarray, b: np.ndarray) -> bool:
    """``a`` and ``b`` equal as the converter's divisors can be: the same 1s and factors, the blended ones
    within 1e-6 relative (module docstring)."""
    plain = (b == 1) | (b == b.max())
    if not np.array_equal(a[plain], b[plain]):
        return False
    return bool(np.all(np.abs(a[~plain].astype(np.float64) - b[~plain]) <= 1e-6 * b[~plain]))


def _llama3_to_hf(arch: str, cfg: Any, metadata: Mapping[str, Any], freqs: np.ndarray) -> dict[str, Any]:
    """Recover llama3's four parameters from ``rope_freqs.weight`` (and the
    GGUF's ``rope.scaling.factor`` / ``original_context_length`` when present).

    The divisors depend on (factor, original context / low, original
    context / high) only: the wavelengths where the blend starts and ends.
    Candidates are tried in order (the GGUF's keys; Llama 3's low 1 / high 4
    with the original context that fits; the band limits solved from two
    blended divisors) and the first whose divisors equal ``freqs`` is taken.
    Equal means ``_same_divisors``: the converter's torch pow is not always
    correctly rounded (module docstring)."""
    base, dims = float(cfg.rope_base), int(cfg.rope_dims)
    key = f"{arch}.rope.scaling"
    if freqs.size != dims // 2:
        raise _fail(f"rope_freqs.weight has {freqs.size} values, the model rotates {dims // 2} pairs",
                    "rope_freqs.weight", "the file is inconsistent; it cannot be exported")  # fmt: skip
    if np.all(freqs == 1):
        return {"rope_type": "default"}  # divisors of 1: RoPE unscaled, exactly
    factor = _meta_number(metadata, f"{key}.factor") or float(np.max(freqs))
    if not factor > 1:
        raise _fail("rope_freqs.weight is not a llama3 RoPE (no divisor above 1 to take as the factor)",
                    "rope_freqs.weight", "only llama3's divisors (1 .. factor) can be exported")  # fmt: skip
    exps = np.arange(0, dims, 2, dtype=np.float64) / dims
    wavelen = 2 * math.pi * base**exps
    candidates: list[tuple[float, float, float]] = []  # (low, high, orig)
    orig_meta = _meta_number(metadata, f"{key}.original_context_length")
    origs = [orig_meta] if orig_meta else []
    # Llama 3.x: low 1, high 4; the original context is then the low band's limit, between two wavelengths
    ones = wavelen[freqs == 1]
    top = wavelen[freqs == _F32(factor)]
    for orig in origs + [float(2**k) for k in range(4, 21)]:
        candidates.append((1.0, 4.0, orig))
    # the blend's limits solved from two blended divisors: s = (orig / wavelen - low) / (high - low)
    mid = (freqs != 1) & (freqs != _F32(factor))
    if np.count_nonzero(mid) >= 2:
        s = (1 / freqs[mid].astype(np.float64) - 1 / factor) / (1 - 1 / factor)
        u = 1 / wavelen[mid]  # s = (u - p) / (q - p) with p = low / orig, q = high / orig
        slope, icpt = np.polyfit(u, s, 1)
        q_minus_p = 1 / slope
        p = -icpt * q_minus_p
        powers = [float(2**k) for k in range(4, 21)]
        for orig in origs + ([float(round(1 / p))] if p > 0 else []) + powers:
            low = round(p * orig, 6)
            high = round((p + q_minus_p) * orig, 6)
            candidates.append((low, high, orig))
    elif np.count_nonzero(mid) == 0 and ones.size and top.size and float(ones.max()) < float(top.min()):
        # no blended divisor: any band limits in the gap between the last 1 and the first factor give the
        # same divisors; put them at its thirds
        lo_gap, hi_gap = float(ones.max()), float(top.min())
        for orig in origs or [float(2 ** round(math.log2(hi_gap)))]:
            candidates.append(
                (orig / (lo_gap + 2 * (hi_gap - lo_gap) / 3), orig / (lo_gap + (hi_gap - lo_gap) / 3), orig)
            )
    for low, high, orig in candidates:
        if not (0 < low < high) or orig != int(orig):
            continue
        got = llama3_freq_factors(base, dims, factor, low, high, orig)
        if _same_divisors(got, freqs):
            return {
                "rope_type": "llama3",
                "factor": _decimal(factor),
                "low_freq_factor": low,
                "high_freq_factor": high,
                "original_max_position_embeddings": int(orig),
            }
    raise _fail(
        "cannot recover llama3 RoPE's low_freq_factor, high_freq_factor and original_max_position_embeddings "
        "exactly from rope_freqs.weight",
        "rope_freqs.weight",
        f"the GGUF has no {key}.* keys for them and no tried parameters reproduce the divisors; "
        "export from a file that records them",
    )


__all__ = [
    "LLAMA3_ARCHITECTURES",
    "llama3_freq_factors",
    "rope_extra_tensors",
    "rope_metadata_from_hf",
    "rope_parameters",
    "rope_scaling_to_hf",
]
