"""PEFT LoRA adapters <-> toy's (= llama.cpp's) adapter GGUF files.

``import_peft(folder, base, out)`` reads a PEFT folder (``adapter_config.json``
and ``adapter_model.safetensors``) and writes a LoRA adapter GGUF for the base
model ``base`` (``toy.adapters.file``: what ``toy infer --lora``, ``toy merge``
and ``llama-cli --lora`` load). ``export_peft(adapter, out)`` writes the other
way, a folder that ``peft.PeftModel.from_pretrained(hf_model, out)`` loads.
Neither needs torch, transformers or PEFT: the safetensors file is read and
written here with NumPy (F32, F16 and BF16 sources; every offset checked).

The mapping (PEFT's module names -> GGUF weight names):

- llama, qwen2, qwen3, gemma2, gemma3, and the MoE routers:
  ``layers.N.self_attn.{q,k,v,o}_proj`` -> ``blk.N.attn_{q,k,v,output}``,
  ``layers.N.mlp.{gate,up,down}_proj`` -> ``blk.N.ffn_{gate,up,down}``,
  ``layers.N.mlp.gate`` (a router) -> ``blk.N.ffn_gate_inp``;
- gpt2: ``h.N.attn.c_attn`` (fused Q/K/V) -> ``blk.N.attn_qkv``,
  ``h.N.attn.c_proj`` -> ``blk.N.attn_output``, ``h.N.mlp.c_fc`` ->
  ``blk.N.ffn_up``, ``h.N.mlp.c_proj`` -> ``blk.N.ffn_down``.

PEFT's ``lora_A`` (r, in) and ``lora_B`` (out, r) are the file's ``lora_a`` and
``lora_b`` as they are (a GPT-2 ``Conv1D`` changes only how the base weight is
stored, not its adapter). For ``llama`` the converter reorders the rows of
``attn_q``/``attn_k`` (RoPE pairs, llama.cpp's ``permute``); the update
``B A`` has the same rows, so ``lora_b``'s rows take the same permutation
(``A`` is untouched) and the export undoes it.

Scale: PEFT multiplies ``B A x`` by ``lora_alpha / r`` (``lora_alpha /
sqrt(r)`` with ``use_rslora``); llama.cpp by ``adapter.lora.alpha / rank``.
The file's alpha is ``toy.adapters.lora_alpha_for_file`` of PEFT's; where
``rank_pattern`` / ``alpha_pattern`` give a module a scale that one file alpha
cannot express, the ratio is folded into that module's ``lora_b``.

Refused, each with an error naming what and saying what to do:
``modules_to_save`` (fully trained tensors, e.g. an embedding or a head: no
place in an adapter file), targets outside the blocks' projections
(``embed_tokens``, ``lm_head``: tied or not, llama.cpp adapts neither), MoE
experts, DoRA (``use_dora``: magnitude vectors llama.cpp does not apply),
LoRA biases (``bias`` other than "none"), non-LoRA PEFT types, and an
adapter whose modules or shapes do not match ``base`` (naming the tensor).

The export records toy's own keys (``general.name``, ``toy.lora.*``) in the
safetensors header's ``__metadata__`` (PEFT ignores it), so importing an
exported file for the same base gives back the same bytes.
"""

from __future__ import annotations

import json
import math
import os
import re
import struct
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from toy.adapters.file import Adapter, AdapterError, load_adapter, lora_alpha_for_file, save_adapter
from toy.errors import BadInputError

__all__ = ["PeftAdapterError", "export_peft", "gguf_name", "import_peft", "is_peft_folder", "peft_module"]

CONFIG = "adapter_config.json"
WEIGHTS = "adapter_model.safetensors"

# PEFT module (inside a block) -> GGUF stem, per naming family
_LLAMA_MODULES = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "mlp.gate": "ffn_gate_inp",
}
_GPT2_MODULES = {
    "attn.c_attn": "attn_qkv",
    "attn.c_proj": "attn_output",
    "mlp.c_fc": "ffn_up",
    "mlp.c_proj": "ffn_down",
}
_FAMILY = {"gpt2": ("transformer.h", _GPT2_MODULES)}
_DEFAULT_FAMILY = ("model.layers", _LLAMA_MODULES)
_PERMUTED = {"llama"}  # architectures whose converter permutes attn_q/attn_k rows

_KEY = re.compile(
    r"(?:base_model\.model\.)?(?P<path>.*?)(?:^|\.)(?:layers|h)\.(?P<layer>\d+)\.(?P<module>.+)"
    r"\.lora_(?P<half>[AB])(?:\.[A-Za-z0-9_]+)?\.weight"
)
_DTYPES: dict[str, np.dtype[Any]] = {"F32": np.dtype("<f4"), "F16": np.dtype("<f2"), "BF16": np.dtype("<u2")}


class PeftAdapterError(BadInputError):
    """A PEFT adapter folder toy cannot convert (or not for this base)."""


def is_peft_folder(folder: str | os.PathLike[str]) -> bool:
    """Whether ``folder`` holds a PEFT adapter (an ``adapter_config.json``)."""
    return (Path(folder) / CONFIG).is_file()


def peft_module(architecture: str, gguf: str) -> str:
    """The PEFT module name (``model.layers.N.self_attn.q_proj``) of a GGUF weight name."""
    m = re.fullmatch(r"blk\.(\d+)\.(\w+)\.weight", gguf)
    prefix, modules = _FAMILY.get(architecture, _DEFAULT_FAMILY)
    rev = {v: k for k, v in modules.items()}
    if not m or m.group(2) not in rev:
        raise AdapterError(
            f"{gguf}: no PEFT module for this {architecture} weight",
            hint="toy exports adapters of the attention and feed-forward projections",
        )
    return f"{prefix}.{m.group(1)}.{rev[m.group(2)]}"


def gguf_name(architecture: str, key: str) -> str | None:
    """The GGUF weight name a PEFT ``lora_A``/``lora_B`` key adapts, or None."""
    m = _KEY.fullmatch(key)
    if not m:
        return None
    stem = _FAMILY.get(architecture, _DEFAULT_FAMILY)[1].get(m.group("module"))
    return f"blk.{int(m.group('layer'))}.{stem}.weight" if stem else None


# ------------------------------------------------------------ safetensors (NumPy only)


def _read_safetensors(path: Path) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """Every tensor of a safetensors file as float32, and its ``__metadata__``."""
    try:
        data = path.read_bytes()
    except OSError as e:
        raise PeftAdapterError(f"{path}: cannot read ({e.strerror})", hint=f"a PEFT folder holds {WEIGHTS}") from e
    if len(data) < 8:
        raise PeftAdapterError(f"{path}: truncated (no safetensors header)")
    (n,) = struct.unpack("<Q", data[:8])
    if n > len(data) - 8:
        raise PeftAdapterError(f"{path}: the header says {n} bytes, the file has {len(data) - 8} after it (truncated?)")
    try:
        header = json.loads(data[8 : 8 + n])
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise PeftAdapterError(f"{path}: the safetensors header is not JSON ({e})") from e
    if not isinstance(header, dict):
        raise PeftAdapterError(f"{path}: the safetensors header is not a JSON object")
    meta = header.pop("__metadata__", None) or {}
    body = memoryview(data)[8 + n :]
    out: dict[str, np.ndarray] = {}
    spans: list[tuple[int, int, str]] = []
    for name, info in header.items():
        try:
            dtype, shape, (lo, hi) = info["dtype"], [int(s) for s in info["shape"]], info["data_offsets"]
        except (TypeError, KeyError, ValueError) as e:
            raise PeftAdapterError(f"{path}: tensor {name}: a malformed header entry {info!r}") from e
        if dtype not in _DTYPES:
            raise PeftAdapterError(
                f"{path}: tensor {name} is {dtype}", hint="toy reads F32, F16 and BF16 adapter tensors"
            )
        want = math.prod(shape) * _DTYPES[dtype].itemsize
        if not (isinstance(lo, int) and isinstance(hi, int) and 0 <= lo <= hi <= len(body) and hi - lo == want):
            raise PeftAdapterError(
                f"{path}: tensor {name}: data_offsets [{lo}, {hi}] do not hold a {dtype} {shape} tensor "
                f"inside the file's {len(body)} data bytes",
                hint="the file is truncated or its header is wrong: save the adapter again",
            )
        spans.append((lo, hi, name))
        a = np.frombuffer(body[lo:hi], _DTYPES[dtype]).reshape(shape)
        if dtype == "BF16":
            a = (a.astype(np.uint32) << 16).view(np.float32)
        out[name] = np.asarray(a, np.float32)
    end = 0
    for lo, hi, name in sorted(spans):
        if lo != end:  # the tensors must tile the data section, as the safetensors format requires
            raise PeftAdapterError(
                f"{path}: tensor {name}: data_offsets [{lo}, {hi}] "
                + ("overlap the previous tensor" if lo < end else f"leave a gap after byte {end}"),
                hint="the file's header is wrong: save the adapter again",
            )
        end = hi
    if end != len(body):
        raise PeftAdapterError(f"{path}: {len(body) - end} bytes after the last tensor", hint="save the adapter again")
    return out, {str(k): str(v) for k, v in meta.items()}


def _write_safetensors(path: Path, tensors: Mapping[str, np.ndarray], meta: Mapping[str, str]) -> None:
    header: dict[str, object] = {"__metadata__": dict(meta)}
    blobs, off = [], 0
    for name, a in tensors.items():
        b = np.ascontiguousarray(a, "<f4").tobytes()
        header[name] = {"dtype": "F32", "shape": list(a.shape), "data_offsets": [off, off + len(b)]}
        blobs.append(b)
        off += len(b)
    h = json.dumps(header, separators=(",", ":")).encode()
    h += b" " * (-len(h) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)))
        f.write(h)
        for b in blobs:
            f.write(b)


# ------------------------------------------------------------ import


def _permute_rows(b: np.ndarray, n_head: int, inverse: bool = False) -> np.ndarray:
    """llama.cpp's converter permutation of Q/K rows (pairs (2i, 2i+1) <- (i, i + D/2)), on B's rows."""
    out, r = b.shape
    if inverse:
        return np.asarray(b.reshape(n_head, out // n_head // 2, 2, r).swapaxes(1, 2).reshape(out, r))
    return np.asarray(b.reshape(n_head, 2, out // n_head // 2, r).swapaxes(1, 2).reshape(out, r))


def _config(folder: Path) -> dict[str, Any]:
    p = folder / CONFIG
    try:
        cfg = json.loads(p.read_text(encoding="utf-8"))
    except FileNotFoundError as e:
        raise PeftAdapterError(f"{folder}: no {CONFIG}", hint="a PEFT adapter folder (save_pretrained)") from e
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise PeftAdapterError(f"{p}: not a JSON file ({e})") from e
    if not isinstance(cfg, dict):
        raise PeftAdapterError(f"{p}: not a JSON object")
    return cfg


def _number(cfg: dict[str, Any], key: str, p: Path, default: float | None = None, integer: bool = False) -> float:
    v = cfg.get(key, default)
    if isinstance(v, bool) or not isinstance(v, int if integer else (int, float)) or not math.isfinite(v) or v <= 0:
        raise PeftAdapterError(f"{p}: {key} is {v!r}, expected a positive number", hint=f"fix {key} in {CONFIG}")
    return float(v)


def _check_config(cfg: dict[str, Any], p: Path) -> None:
    ptype = cfg.get("peft_type", "LORA")
    if ptype != "LORA":
        raise PeftAdapterError(f"{p}: peft_type is {ptype!r}", hint="toy converts LoRA adapters (peft_type LORA)")
    if cfg.get("use_dora"):
        raise PeftAdapterError(
            f"{p}: use_dora is true: a DoRA adapter (magnitude vectors) has no form llama.cpp applies",
            hint="merge it into the base with PEFT (merge_and_unload) and convert the merged model, or train plain LoRA",
        )
    if cfg.get("modules_to_save"):
        raise PeftAdapterError(
            f"{p}: modules_to_save {cfg['modules_to_save']!r}: fully trained tensors have no place in a LoRA adapter file",
            hint="merge the adapter into the base with PEFT (merge_and_unload), save it and `toy convert` the merged "
            "folder, or train the adapter without modules_to_save",
        )
    if cfg.get("bias", "none") != "none":
        raise PeftAdapterError(
            f"{p}: bias is {cfg['bias']!r}: llama.cpp's adapter format has no bias terms",
            hint='train with bias="none", or merge the adapter and convert the merged model',
        )
    for key in ("use_qalora", "lora_bias"):
        if cfg.get(key):
            raise PeftAdapterError(f"{p}: {key} is set; toy converts plain LoRA only", hint=f"train without {key}")


def _not_a_block_target(key: str, p: Path) -> PeftAdapterError:
    mod = key.removeprefix("base_model.model.").split(".lora_")[0]
    return PeftAdapterError(
        f"{p}: {key} adapts {mod}: llama.cpp's adapter format (and toy) adapt only the attention and "
        "feed-forward projections inside the blocks, not embeddings or the output head (tied or not)",
        hint="train without that target, or merge the adapter into the base with PEFT and convert the merged model",
    )


def import_peft(folder: str | os.PathLike[str], base: str | os.PathLike[str], out: str | os.PathLike[str]) -> Path:
    """Convert the PEFT LoRA adapter in ``folder`` for the GGUF model ``base``
    into an adapter GGUF at ``out`` (atomically); returns its path."""
    from toy import models
    from toy.adapters.apply import check_lora
    from toy.gguf import GGUFFile

    folder, out = Path(folder), Path(out)
    p = folder / CONFIG
    cfg = _config(folder)
    _check_config(cfg, p)
    r0 = int(_number(cfg, "r", p, integer=True))
    alpha0 = float(_number(cfg, "lora_alpha", p, default=8))
    rslora = cfg.get("use_rslora", False)
    if not isinstance(rslora, bool):
        raise PeftAdapterError(f"{p}: use_rslora is {rslora!r}, expected true or false")
    patterns: dict[str, dict[str, Any]] = {}
    for key in ("rank_pattern", "alpha_pattern"):
        v = cfg.get(key) or {}
        if not isinstance(v, dict):
            raise PeftAdapterError(f"{p}: {key} is {v!r}, expected an object")
        patterns[key] = v
    dropout = cfg.get("lora_dropout", 0.0)
    dropout = float(dropout) if isinstance(dropout, (int, float)) and not isinstance(dropout, bool) else 0.0

    tensors, meta = _read_safetensors(folder / WEIGHTS)
    with GGUFFile(base) as gf:
        arch = gf.architecture
        if not isinstance(arch, str):
            raise PeftAdapterError(f"{base}: no general.architecture", hint="--base is a GGUF model file")
        shapes = {n: tuple(i.shape) for n, i in gf.tensors.items()}
        mcfg = models.config_from_gguf(gf)
        targets = models.language_model_of(mcfg).lora_targets(mcfg)
        halves: dict[str, dict[str, np.ndarray]] = {}
        keys: dict[str, str] = {}
        for key, a in tensors.items():
            if "lora_magnitude_vector" in key:
                raise PeftAdapterError(f"{folder / WEIGHTS}: {key} is a DoRA magnitude vector", hint="DoRA is refused")
            if ".lora_embedding_" in key or not re.search(r"\.lora_[AB]\.", key):
                raise _not_a_block_target(key, p)
            m = _KEY.fullmatch(key)
            if not m:
                raise _not_a_block_target(key, p)
            name = gguf_name(arch, key)
            if name is None:
                raise PeftAdapterError(
                    f"{folder / WEIGHTS}: {key}: module {m.group('module')!r} is not a {arch} projection toy adapts",
                    hint="MoE experts and modules outside attention/feed-forward take no adapter; an adapter for "
                    "another architecture than --base?",
                )
            if a.ndim != 2:
                raise PeftAdapterError(f"{folder / WEIGHTS}: {key} has shape {a.shape}, expected 2-D")
            halves.setdefault(name, {})[m.group("half")] = a
            keys[name] = key.split(".lora_")[0].removeprefix("base_model.model.")
        order = {t.stem: j for j, t in enumerate(targets.values())}

        def sort_key(n: str) -> tuple[int, int]:
            parts = n.split(".")
            return int(parts[1]), order.get(parts[2], len(order))

        pairs: dict[str, tuple[np.ndarray, np.ndarray]] = {}
        file_alpha = lora_alpha_for_file(alpha0, r0, rslora)
        for name in sorted(halves, key=sort_key):
            h = halves[name]
            if set(h) != {"A", "B"}:
                raise PeftAdapterError(f"{folder / WEIGHTS}: {keys[name]} has lora_{next(iter(h))} only")
            a, b = h["A"], h["B"]
            if a.shape[0] != b.shape[1]:
                raise PeftAdapterError(
                    f"{folder / WEIGHTS}: {keys[name]}: lora_A {a.shape} and lora_B {b.shape} differ in rank"
                )
            if name not in shapes:
                raise PeftAdapterError(
                    f"{keys[name]} -> {name}: the base model {base} has no such tensor",
                    hint="convert the adapter with the model it was trained on as --base",
                )
            if (b.shape[0], a.shape[1]) != shapes[name]:
                raise PeftAdapterError(
                    f"{keys[name]} -> {name}: lora_B {b.shape} x lora_A {a.shape} does not make the base's {shapes[name]}",
                    hint="the adapter was trained on another model: convert it with that model as --base",
                )
            r = a.shape[0]
            mod = keys[name]
            alpha = _pattern(patterns["alpha_pattern"], mod, alpha0, f"{p}: alpha_pattern")
            want = alpha / (math.sqrt(r) if rslora else r)
            have = file_alpha / r
            if not math.isclose(want, have, rel_tol=1e-6):
                b = b * np.float32(want / have)
            if arch in _PERMUTED and name.split(".")[2] in ("attn_q", "attn_k"):
                b = _permute_rows(b, mcfg.n_head if name.split(".")[2] == "attn_q" else mcfg.n_head_kv)
            pairs[name] = (np.ascontiguousarray(a, np.float32), np.ascontiguousarray(b, np.float32))
        if not pairs:
            raise PeftAdapterError(f"{folder / WEIGHTS}: no lora_A/lora_B tensors")
        check_lora(Adapter(arch, file_alpha, pairs), gf)
    stems = {n.split(".")[2] for n in pairs}
    tnames = [k for k, t in targets.items() if t.stem in stems]
    # toy's own keys, when the folder was written by export_peft (else derived)
    try:
        saved = json.loads(meta.get("toy.lora.targets", "null"))
        saved_targets = saved if isinstance(saved, list) and all(isinstance(t, str) for t in saved) else None
        dropout = float(meta.get("toy.lora.dropout", dropout))
    except ValueError:  # a header not written by toy: ignore its keys
        saved_targets = None
    return _save_atomic(
        out,
        architecture=arch,
        pairs=pairs,
        alpha=alpha0,
        rank=r0,
        rslora=rslora,
        targets=saved_targets or tnames,
        dropout=dropout,
        base=meta.get("toy.lora.base", Path(base).name),
        name=meta.get("general.name") or f"{folder.name} (PEFT)",
    )


def _pattern(pattern: dict[str, Any], module: str, default: float, where: str) -> float:
    """PEFT's rank/alpha pattern lookup: the first key that ends the module name."""
    for k, v in pattern.items():
        if re.fullmatch(rf"(.*\.)?{k}", module):
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
                raise PeftAdapterError(f"{where}: {k!r} is {v!r}, expected a positive number")
            return float(v)
    return default


def _save_atomic(out: Path, **kw: Any) -> Path:
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent)
    os.close(fd)
    try:
        save_adapter(tmp, **kw)
        os.replace(tmp, out)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return out


# ------------------------------------------------------------ export


def export_peft(
    adapter: str | os.PathLike[str] | Adapter,
    out: str | os.PathLike[str],
    *,
    base: str | os.PathLike[str] | None = None,
    base_model: str | None = None,
) -> Path:
    """Write the adapter GGUF ``adapter`` as a PEFT folder ``out``
    (``adapter_config.json``, ``adapter_model.safetensors``). ``base`` (the
    GGUF base model) is checked against and, for llama's attn_q/attn_k, gives
    the head counts of the Q/K row order (required there); ``base_model`` is
    recorded as ``base_model_name_or_path``. The folder is built next to
    ``out`` and renamed into place; ``out`` must not exist or be empty."""
    ad = adapter if isinstance(adapter, Adapter) else load_adapter(adapter)
    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise BadInputError(f"{out} exists and is not an empty folder", hint="choose a new output folder")
    arch = ad.architecture
    meta = ad.meta
    ranks = {n: int(a.shape[0]) for n, (a, _) in ad.pairs.items()}
    r0 = int(meta.get("toy.lora.rank", ad.rank))
    rslora = bool(meta.get("toy.lora.rslora", False))
    alpha = float(meta.get("toy.lora.alpha", ad.alpha))
    if not ad.alpha or not math.isclose(lora_alpha_for_file(alpha, r0, rslora), ad.alpha, rel_tol=1e-6):
        rslora, alpha = False, float(ad.alpha) if ad.alpha else float(r0)
    peft_alpha = alpha
    n_head, n_head_kv = _heads(ad, base) if arch in _PERMUTED else (1, 1)
    if base is not None and arch not in _PERMUTED:
        from toy.adapters.apply import check_lora
        from toy.gguf import GGUFFile

        with GGUFFile(base) as gf:
            check_lora(ad, gf)
    tensors: dict[str, np.ndarray] = {}
    modules: list[str] = []
    rank_pattern: dict[str, int] = {}
    alpha_pattern: dict[str, float] = {}
    for name, (a, b) in ad.pairs.items():
        mod = peft_module(arch, name)
        stem = name.split(".")[2]
        if arch in _PERMUTED and stem in ("attn_q", "attn_k"):
            b = _permute_rows(b, n_head if stem == "attn_q" else n_head_kv, inverse=True)
        r = ranks[name]
        # the module's PEFT scale must be llama.cpp's (file alpha / its rank): where the config's
        # alpha does not give it (another rank, or no file alpha: scale 1), an alpha_pattern entry does
        root = math.sqrt(r) if rslora else r
        if not math.isclose(peft_alpha / root, ad.scale(name), rel_tol=1e-6):
            alpha_pattern[mod] = ad.scale(name) * root
        if r != r0:
            rank_pattern[mod] = r
        tensors[f"base_model.model.{mod}.lora_A.weight"] = a
        tensors[f"base_model.model.{mod}.lora_B.weight"] = b
        short = mod.rsplit(".", 1)[1]
        if short not in modules:
            modules.append(short)
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model,
        "r": r0,
        "lora_alpha": alpha,
        "use_rslora": rslora,
        "lora_dropout": float(meta.get("toy.lora.dropout", 0.0)),
        "target_modules": modules,
        "bias": "none",
        "fan_in_fan_out": arch == "gpt2",
        "inference_mode": True,
        "modules_to_save": None,
        "use_dora": False,
        "rank_pattern": rank_pattern,
        "alpha_pattern": alpha_pattern,
        "init_lora_weights": True,
    }
    st_meta = {"format": "pt", "toy.architecture": arch}
    for k in ("general.name", "toy.lora.base", "toy.lora.dropout"):
        if k in meta:
            st_meta[k] = str(meta[k])
    if "toy.lora.targets" in meta:
        st_meta["toy.lora.targets"] = json.dumps(list(meta["toy.lora.targets"]))
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        (tmp / CONFIG).write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
        _write_safetensors(tmp / WEIGHTS, tensors, st_meta)
        if out.exists():
            out.rmdir()
        os.replace(tmp, out)
    except BaseException:
        for f in tmp.glob("*"):
            f.unlink()
        tmp.rmdir()
        raise
    return out


def _heads(ad: Adapter, base: str | os.PathLike[str] | None) -> tuple[int, int]:
    """The (query, key/value) head counts that llama.cpp's Q/K row order of a
    llama adapter depends on: from the base model's metadata."""
    if not any(n.split(".")[2] in ("attn_q", "attn_k") for n in ad.pairs):
        return 1, 1
    if base is None:
        raise AdapterError(
            "a llama adapter of attn_q/attn_k needs its base model to undo llama.cpp's Q/K row order",
            hint="pass the base model: `toy export peft ADAPTER.gguf --base MODEL.gguf -o FOLDER`",
        )
    from toy import models
    from toy.adapters.apply import check_lora
    from toy.gguf import GGUFFile

    with GGUFFile(base) as gf:
        check_lora(ad, gf)
        cfg = models.config_from_gguf(gf)
        return int(cfg.n_head), int(cfg.n_head_kv)
