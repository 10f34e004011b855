"""PEFT LoRA adapters <-> toy's (= llama.cpp's) adapter GGUF files.

``import_peft(folder, base, out)`` reads a PEFT folder (``adapter_config.json``
and ``adapter_model.safetensors``) and writes a LoRA adapter GGUF for the base
model ``base`` (``toy.adapters.file``: what ``toy infer --lora``, ``toy merge``
and ``llama-cli --lora`` load). ``export_peft(adapter, out)`` writes the other
way, a folder that ``peft.PeftModel.from_pretrained(hf_model, out)`` loads.
Neither needs torch, transformers or PEFT: the safetensors file is read and
written with NumPy by ``toy.convert.safetensors_io`` (F32, F16 and BF16
sources; every offset checked).

The mapping (PEFT's module names -> GGUF weight names) is the base family's
Hugging Face data (``toy.models.hf_family(architecture)``, a
``toy.models.hf.HFFamily``; the tables of ``docs/reference/hf-mapping.md``
are generated from it): ``peft_prefix`` names the blocks' container
(``model.layers``; a key may carry another path before its last part, as a
bare ``LlamaModel`` or a multimodal wrapper writes it), ``peft_modules`` maps
a module inside block N to the GGUF stem of ``blk.N.STEM.weight``. Nothing
here knows an architecture by name.

PEFT's ``lora_A`` (r, in) and ``lora_B`` (out, r) are the file's ``lora_a`` and
``lora_b`` as they are (a ``Conv1D`` changes only how the base weight is
stored, not its adapter; the family's ``tensors`` rows with op ``transpose``
on a target make an export say ``fan_in_fan_out``). Where the family's
``tensors`` rows give a weight the op ``rope_pairs`` (llama's Q/K, whose rows
the converter reorders into RoPE pairs), the update ``B A`` has the same
rows, so ``lora_b``'s rows take the same permutation for the row's ``heads``
(``A`` is untouched) and the export undoes it (the import's and export's
own ``permute_rows`` / ``unpermute_rows``).

Scale: PEFT multiplies ``B A x`` by ``lora_alpha / r`` (``lora_alpha /
sqrt(r)`` with ``use_rslora``); llama.cpp by ``adapter.lora.alpha / rank``.
The file's alpha is ``toy.adapters.lora_alpha_for_file`` of PEFT's; where
``rank_pattern`` / ``alpha_pattern`` give a module a scale that one file alpha
cannot express, the ratio is folded into that module's ``lora_b``.

Refused, each with an error naming what and saying what to do:
``modules_to_save`` (fully trained tensors, e.g. an embedding or a head: no
place in an adapter file), targets outside the blocks' projections
(``embed_tokens``, ``lm_head``: tied or not, llama.cpp adapts neither), an
adapter of some experts of a module but not all (see below), DoRA
(``use_dora``: magnitude vectors llama.cpp does not apply), LoRA biases
(``bias`` other than "none"), non-LoRA PEFT types, and an adapter whose
modules or shapes do not match ``base`` (naming the tensor).

Mixture-of-experts experts (the family's tensor rows with ``expert=J``:
PEFT's ``model.layers.N.mlp.experts.J.down_proj`` is expert J of
``blk.N.ffn_down_exps.weight``): the import stacks every expert's pair into
llama.cpp's 3-D pair (``lora_a`` (E, r, in), ``lora_b`` (E, out, r), what
its ``convert_lora_to_gguf.py`` writes; applied by ``toy.models.moe.ffn``),
each expert's ``alpha_pattern`` ratio folded into its own ``lora_b``; every
expert must be there with one rank, else the error names the first missing
one. The export writes one PEFT module per expert.

The export records toy's own keys (``general.name``, ``toy.lora.*``) in the
safetensors header's ``__metadata__`` (PEFT ignores it), so importing an
exported file for the same base gives back the same bytes.
"""

from __future__ import annotations

import json
import math
import os
import re
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from toy.adapters.file import Adapter, AdapterError, load_adapter, lora_alpha_for_file, save_adapter
from toy.convert.hf_export import unpermute_rows
from toy.convert.hf_import import permute_rows
from toy.convert.safetensors_io import SafetensorsError, read_header, read_metadata, read_ref, write_safetensors
from toy.errors import BadInputError
from toy.models.hf import HFFamily, HFTensor

__all__ = ["PeftAdapterError", "export_peft", "gguf_name", "import_peft", "is_peft_folder", "peft_module"]

CONFIG = "adapter_config.json"
WEIGHTS = "adapter_model.safetensors"

# a PEFT key: [base_model.model.][PATH.]CONTAINER.N.MODULE.lora_(A|B)[.ADAPTER].weight, where CONTAINER is
# the last part of the family's peft_prefix (ADAPTER: an adapter name some PEFT versions keep in the key)
_KEY = (
    r"(?:base_model\.model\.)?(?:.*?\.)?{container}\.(?P<layer>\d+)\.(?P<module>.+?)"
    r"\.lora_(?P<half>[AB])(?:\.\w+)?\.weight"
)


class PeftAdapterError(BadInputError):
    """A PEFT adapter folder toy cannot convert (or not for this base)."""


def is_peft_folder(folder: str | os.PathLike[str]) -> bool:
    """Whether ``folder`` holds a PEFT adapter (an ``adapter_config.json``)."""
    return (Path(folder) / CONFIG).is_file()


def _family(architecture: str) -> HFFamily:
    """The ``HFFamily`` of a base model's architecture (``UnsupportedModelError`` without one)."""
    from toy import models

    family: HFFamily = models.hf_family(architecture)
    return family


def _key_pattern(family: HFFamily) -> re.Pattern[str]:
    return re.compile(_KEY.format(container=re.escape(family.peft_prefix.rsplit(".", 1)[-1])))


def peft_module(architecture: str, gguf: str) -> str:
    """The PEFT module name (``model.layers.N.self_attn.q_proj``) of a GGUF weight name."""
    family = _family(architecture)
    m = re.fullmatch(r"blk\.(\d+)\.(\w+)\.weight", gguf)
    rev = {stem: module for module, stem in family.peft_modules.items()}
    if not m or m.group(2) not in rev:
        raise AdapterError(
            f"{gguf}: no PEFT module for this {architecture} weight",
            hint="toy exports adapters of the attention and feed-forward projections",
        )
    return f"{family.peft_prefix}.{m.group(1)}.{rev[m.group(2)]}"


def gguf_name(architecture: str, key: str) -> str | None:
    """The GGUF weight name a PEFT ``lora_A``/``lora_B`` key adapts, or None."""
    family = _family(architecture)
    m = _key_pattern(family).fullmatch(key)
    stem = family.peft_modules.get(m.group("module")) if m else None
    return f"blk.{int(m.group('layer'))}.{stem}.weight" if m and stem else None


def _block_rows(family: HFFamily, architecture: str, cfg: Any) -> dict[str, HFTensor]:
    """The family's tensor rows (``HFTensor``) of a model with toy config ``cfg``
    inside the blocks, by their name after the container (``N.mlp.experts.J.down_proj.weight``)."""
    prefix = family.peft_prefix + "."
    return {t.hf[len(prefix) :]: t for t in family.tensors(architecture, cfg) if t.hf.startswith(prefix)}


def _rope_heads(rows: Mapping[str, HFTensor]) -> dict[str, int]:
    """GGUF weight -> the heads of its RoPE-pair row order, for the weights the converter reorders."""
    return {
        t.gguf: t.heads
        for t in rows.values()
        if t.op == "rope_pairs" and t.gguf and t.gguf.endswith(".weight") and t.expert is None
    }


# ------------------------------------------------------------ safetensors


def _read_safetensors(path: Path) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """Every tensor of the adapter file as float32, and its ``__metadata__``
    (``safetensors_io``: the header checked first, every offset included)."""
    if not path.is_file():
        raise PeftAdapterError(f"{path}: no such file", hint=f"a PEFT adapter folder holds {WEIGHTS}", field=WEIGHTS)
    try:
        refs = read_header(path)
        meta = read_metadata(path)
        return {r.name: np.asarray(read_ref(r), np.float32) for r in refs}, meta
    except SafetensorsError as e:
        raise PeftAdapterError(str(e), hint=e.hint, field=e.field) from None


# ------------------------------------------------------------ import


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


def _not_a_block_target(key: str, p: Path, arch: str) -> PeftAdapterError:
    mod = key.removeprefix("base_model.model.").split(".lora_")[0]
    if re.search(r"\.\d+\.", mod):  # inside numbered blocks, but not this family's
        return PeftAdapterError(
            f"{p}: {key} adapts {mod}, which is not a module of a {arch} model",
            hint="an adapter for another architecture than --base? convert it with the model it was trained on",
            field=key,
        )
    return PeftAdapterError(
        f"{p}: {key} adapts {mod}: llama.cpp's adapter format (and toy) adapt only the attention and "
        "feed-forward projections inside the blocks, not embeddings or the output head (tied or not)",
        hint="train without that target, or merge the adapter into the base with PEFT and convert the merged model",
        field=key,
    )


def _not_a_target(
    key: str, rel: str, rows: Mapping[str, HFTensor], targets: Mapping[str, Any], family: HFFamily
) -> PeftAdapterError:
    """The error for a PEFT key inside a block whose module is no LoRA target
    of toy's (``rel``: its parameter's name after the blocks' container),
    told apart by the family's tensor rows: an expert, another tensor of the
    model, or a module the base model does not have."""
    stems = {t.stem for t in targets.values()}
    usable = sorted(m.rsplit(".", 1)[-1] for m, stem in family.peft_modules.items() if stem in stems)
    mod = key.removeprefix("base_model.model.").split(".lora_")[0]
    row = rows.get(rel)
    if row is not None and row.expert is not None:
        return PeftAdapterError(
            f"{key} adapts {mod}, expert {row.expert} of the stacked {row.gguf}, which toy's LoRA does not "
            "adapt on this model (toy refuses rather than drop it)",
            hint=f"train the adapter on the attention projections and the router only (target_modules from "
            f"{usable}), or merge it into the base with PEFT (merge_and_unload) and `toy convert` the merged folder",
            field=key,
        )
    if row is not None:
        return PeftAdapterError(
            f"{key} adapts {mod} ({row.gguf}), which toy's LoRA does not adapt",
            hint=f"toy adapts the modules {usable} of this model: train without that target, or merge the adapter "
            "with PEFT (merge_and_unload) and `toy convert` the merged folder",
            field=key,
        )
    return PeftAdapterError(
        f"{key}: module {mod!r} is not a module of the --base model",
        hint="an adapter for another architecture or model than --base? convert it with the model it was trained on",
        field=key,
    )


def import_peft(folder: str | os.PathLike[str], base: str | os.PathLike[str], out: str | os.PathLike[str]) -> Path:
    """Convert the PEFT LoRA adapter in ``folder`` for the GGUF model ``base``
    into an adapter GGUF at ``out`` (atomically); returns its path."""
    from toy import models
    from toy.adapters.apply import check_lora, expert_stems, inference_stems
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
        family = _family(arch)
        pattern = _key_pattern(family)
        rows = _block_rows(family, arch, mcfg)
        rope_heads = _rope_heads(rows)
        xstems = expert_stems(mcfg)
        halves: dict[str, dict[str, np.ndarray]] = {}
        keys: dict[str, str] = {}
        # experts: GGUF name of the stacked tensor -> expert -> half -> matrix (and the PEFT module of each)
        xhalves: dict[str, dict[int, dict[str, np.ndarray]]] = {}
        xkeys: dict[tuple[str, int], str] = {}
        for key, a in tensors.items():
            if "lora_magnitude_vector" in key:
                raise PeftAdapterError(
                    f"{folder / WEIGHTS}: {key} is a DoRA magnitude vector", hint="DoRA is refused", field=key
                )
            if ".lora_embedding_" in key or not re.search(r"\.lora_[AB]\.", key):
                raise _not_a_block_target(key, p, arch)
            m = pattern.fullmatch(key)
            if not m:
                raise _not_a_block_target(key, p, arch)
            name = gguf_name(arch, key)
            if a.ndim != 2:
                raise PeftAdapterError(f"{folder / WEIGHTS}: {key} has shape {a.shape}, expected 2-D")
            if name is None:
                row = rows.get(f"{int(m.group('layer'))}.{m.group('module')}.weight")
                if row is not None and row.expert is not None and row.gguf and row.gguf.split(".")[2] in xstems:
                    xhalves.setdefault(row.gguf, {}).setdefault(row.expert, {})[m.group("half")] = a
                    xkeys[(row.gguf, row.expert)] = key.split(".lora_")[0].removeprefix("base_model.model.")
                    continue
                raise _not_a_target(key, f"{int(m.group('layer'))}.{m.group('module')}.weight", rows, targets, family)
            halves.setdefault(name, {})[m.group("half")] = a
            keys[name] = key.split(".lora_")[0].removeprefix("base_model.model.")
        order = {t.stem: j for j, t in enumerate(targets.values())}
        order.update({stem: len(order) + j for j, stem in enumerate(inference_stems(mcfg))})

        def sort_key(n: str) -> tuple[int, int]:
            parts = n.split(".")
            return int(parts[1]), order.get(parts[2], len(order))

        pairs: dict[str, tuple[np.ndarray, np.ndarray]] = {}
        file_alpha = lora_alpha_for_file(alpha0, r0, rslora)

        def pair(h: dict[str, np.ndarray], key: str) -> tuple[np.ndarray, np.ndarray]:
            if set(h) != {"A", "B"}:
                raise PeftAdapterError(f"{folder / WEIGHTS}: {key} has lora_{next(iter(h))} only")
            a, b = h["A"], h["B"]
            if a.shape[0] != b.shape[1]:
                raise PeftAdapterError(
                    f"{folder / WEIGHTS}: {key}: lora_A {a.shape} and lora_B {b.shape} differ in rank"
                )
            return a, b

        def folded(a: np.ndarray, b: np.ndarray, mod: str) -> np.ndarray:
            """b with the module's PEFT scale / the file's (alpha_pattern, another rank) folded in."""
            r = a.shape[0]
            alpha = _pattern(patterns["alpha_pattern"], mod, alpha0, f"{p}: alpha_pattern")
            want = alpha / (math.sqrt(r) if rslora else r)
            have = file_alpha / r
            return b * np.float32(want / have) if not math.isclose(want, have, rel_tol=1e-6) else b

        for name, per in xhalves.items():  # the experts' pairs stacked into llama.cpp's 3-D pairs
            n_exp = shapes[name][0] if name in shapes and len(shapes[name]) == 3 else max(per) + 1
            missing = [j for j in range(n_exp) if j not in per]
            if missing:
                rel = next(r for r, t in rows.items() if t.gguf == name and t.expert == missing[0])
                mod = f"{family.peft_prefix}.{rel.removesuffix('.weight')}"
                raise PeftAdapterError(
                    f"{folder / WEIGHTS}: {name} is adapted for experts {sorted(per)} but not for expert "
                    f"{missing[0]} ({mod}: no lora_A/lora_B){' and others' if len(missing) > 1 else ''}: llama.cpp's "
                    "format stacks one pair per expert, for every expert of the tensor",
                    hint="train the adapter with every expert of a targeted module (PEFT target_modules matching "
                    "them all), or merge it into the base with PEFT (merge_and_unload) and convert the merged model",
                    field=mod,
                )
            stack_a: list[np.ndarray] = []
            stack_b: list[np.ndarray] = []
            for j in range(n_exp):
                a, b = pair(per[j], xkeys[(name, j)])
                if stack_a and a.shape != stack_a[0].shape:
                    raise PeftAdapterError(
                        f"{folder / WEIGHTS}: {xkeys[(name, j)]}: lora_A {a.shape} differs from expert 0's "
                        f"{stack_a[0].shape}: the experts of one tensor need one rank",
                        hint="train without rank_pattern entries for single experts",
                    )
                stack_a.append(a)
                stack_b.append(folded(a, b, xkeys[(name, j)]))
            halves[name] = {"A": np.stack(stack_a), "B": np.stack(stack_b)}
            keys[name] = xkeys[(name, 0)]
        for name in sorted(halves, key=sort_key):
            h = halves[name]
            if name in xhalves:
                a, b = h["A"], h["B"]
                if name not in shapes or tuple(shapes[name]) != (b.shape[0], b.shape[1], a.shape[2]):
                    raise PeftAdapterError(
                        f"{keys[name]} -> {name}: the experts' lora_B x lora_A {(b.shape[0], b.shape[1], a.shape[2])} "
                        f"do not make the base's {shapes.get(name)}",
                        hint="the adapter was trained on another model: convert it with that model as --base",
                    )
                pairs[name] = (np.ascontiguousarray(a, np.float32), np.ascontiguousarray(b, np.float32))
                continue
            a, b = pair(h, keys[name])
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
            b = folded(a, b, keys[name])
            if name in rope_heads:
                b = permute_rows(b, rope_heads[name])
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
    GGUF base model) is checked against and gives the head counts of the
    weights whose rows the converter reorders (llama's attn_q/attn_k;
    required for an adapter of those); ``base_model`` is
    recorded as ``base_model_name_or_path``. The folder is built next to
    ``out`` and renamed into place; ``out`` must not exist or be empty."""
    ad = adapter if isinstance(adapter, Adapter) else load_adapter(adapter)
    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise BadInputError(f"{out} exists and is not an empty folder", hint="choose a new output folder")
    arch = ad.architecture
    meta = ad.meta
    ranks = {n: int(a.shape[-2]) for n, (a, _) in ad.pairs.items()}
    r0 = int(meta.get("toy.lora.rank", ad.rank))
    rslora = bool(meta.get("toy.lora.rslora", False))
    alpha = float(meta.get("toy.lora.alpha", ad.alpha))
    if not ad.alpha or not math.isclose(lora_alpha_for_file(alpha, r0, rslora), ad.alpha, rel_tol=1e-6):
        rslora, alpha = False, float(ad.alpha) if ad.alpha else float(r0)
    peft_alpha = alpha
    family = _family(arch)
    rows, rope_heads = _export_rows(ad, family, base)
    stems = {n.split(".")[2] for n in ad.pairs}
    # GPT-2's Conv1D: the base weight is transposed by the converter; PEFT must know (its A/B stay Linear-shaped)
    transposed = {t.gguf.split(".")[2] for t in rows.values() if t.op == "transpose" and t.gguf}
    fan_in_fan_out = bool(transposed & stems)
    tensors: dict[str, np.ndarray] = {}
    modules: list[str] = []
    rank_pattern: dict[str, int] = {}
    alpha_pattern: dict[str, float] = {}
    experts = _expert_modules(rows, family)
    for name, (a2, b2) in ad.pairs.items():
        if a2.ndim == 3:  # a mixture of experts' stacked pair: one PEFT module per expert
            m = re.fullmatch(r"blk\.(\d+)\.(\w+)\.weight", name)
            assert m is not None  # check_lora / _export_rows: an adapted block weight
            per = []
            for j in range(a2.shape[0]):
                rel = experts.get((m.group(2), j))
                if rel is None:
                    raise AdapterError(
                        f"{name}: no PEFT module for expert {j} of this {arch} weight",
                        hint="pass the base model: `toy export peft ADAPTER.gguf --base MODEL.gguf -o FOLDER`",
                    )
                per.append((f"{family.peft_prefix}.{m.group(1)}.{rel}", a2[j], b2[j]))
        else:
            per = [(peft_module(arch, name), a2, b2)]
        for mod, a, b in per:
            if name in rope_heads:
                b = unpermute_rows(b, rope_heads[name])
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
        "fan_in_fan_out": fan_in_fan_out,
        "inference_mode": True,
        "modules_to_save": None,
        "use_dora": False,
        "rank_pattern": rank_pattern,
        "alpha_pattern": alpha_pattern,
        "init_lora_weights": True,
    }
    st_meta = {"toy.architecture": arch}  # after safetensors_io's "format": "pt"
    for k in ("general.name", "toy.lora.base", "toy.lora.dropout"):
        if k in meta:
            st_meta[k] = str(meta[k])
    if "toy.lora.targets" in meta:
        st_meta["toy.lora.targets"] = json.dumps(list(meta["toy.lora.targets"]))
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        (tmp / CONFIG).write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
        arrays = {k: np.ascontiguousarray(v, "<f4") for k, v in tensors.items()}
        items = [(k, "F32", tuple(v.shape), v.nbytes) for k, v in arrays.items()]
        write_safetensors(tmp / WEIGHTS, items, arrays.values(), st_meta)
        if out.exists():
            out.rmdir()
        os.replace(tmp, out)
    except BaseException:
        for f in tmp.glob("*"):
            f.unlink()
        tmp.rmdir()
        raise
    return out


def _expert_modules(rows: Mapping[str, HFTensor], family: HFFamily) -> dict[tuple[str, int], str]:
    """(GGUF stem, expert) -> the expert's module inside a block (``mlp.experts.J.down_proj``), from the
    family's rows (``expert=J``) of any layer."""
    out: dict[tuple[str, int], str] = {}
    for rel, t in rows.items():
        if t.expert is not None and t.gguf and rel.endswith(".weight"):
            out.setdefault((t.gguf.split(".")[2], t.expert), rel.split(".", 1)[1].removesuffix(".weight"))
    return out


def _export_rows(
    ad: Adapter, family: HFFamily, base: str | os.PathLike[str] | None
) -> tuple[dict[str, HFTensor], dict[str, int]]:
    """The family's block rows for an export and the RoPE-pair heads of the
    adapted weights: from ``base`` (checked against the adapter) when given;
    else from the family's example config, which tells the ops but not the
    head counts, so an adapter of a reordered weight needs ``base``."""
    from toy import models

    arch = ad.architecture
    if base is not None:
        from toy.adapters.apply import check_lora
        from toy.gguf import GGUFFile

        with GGUFFile(base) as gf:
            check_lora(ad, gf)
            cfg = models.config_from_gguf(gf)
        rows = _block_rows(family, arch, cfg)
        heads = _rope_heads(rows)
        return rows, {n: h for n, h in heads.items() if n in ad.pairs}
    example = family.example_config(arch) if family.example_config is not None else None
    rows = _block_rows(family, arch, example) if example is not None else {}
    if example is not None:
        reordered = {n.split(".")[2] for n in _rope_heads(rows)}
    else:  # no example: every weight of an architecture with reordered rows may be one
        reordered = {n.split(".")[2] for n in ad.pairs} if arch in family.rope_pairs else set()
    hit = sorted(n for n in ad.pairs if n.split(".")[2] in reordered)
    if hit:
        raise AdapterError(
            f"{hit[0]}: llama.cpp's converter reorders this {arch} weight's rows per head (RoPE pairs); undoing it "
            "in lora_b needs the base model's head counts",
            hint="pass the base model: `toy export peft ADAPTER.gguf --base MODEL.gguf -o FOLDER`",
        )
    return rows, {}
