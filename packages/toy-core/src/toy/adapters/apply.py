"""Applying LoRA adapters to a model: which adapters, at what scale, whether
they fit the base, and their A/B tensors on the model's runtime.

``toy.load(..., lora=..., adapters=...)`` (``toy.engine.generate``), ``toy
merge`` (``toy.merge``) and the server's ``--lora`` go through here:

- ``parse_lora_arg``: one ``ADAPTER[:SCALE]`` command-line value;
- ``lora_items``: what a caller passes (a path, an ``Adapter``, a (path,
  scale) pair, or a list of them) as [(source, scale)];
- ``check_lora``: the adapter fits an open base model (architecture, every
  adapted weight present with the pair's shape, and only weights the
  architecture's forward adapts: its ``lora_targets``, and on a mixture of
  experts the stacked ``ffn_*_exps`` as 3-D pairs);
- ``read_adapters``: the adapters read and checked against a base;
- ``load_lora``: their A/B tensors in one allocated F32 context on a runtime,
  as the term map every engine graph adds ``scale · B (A x)`` from (see
  ``toy.engine.llm``);
- selectable (named) adapters, one per engine index, each in its own
  context so it can be unloaded alone: ``named_items`` (what a caller
  passes), ``read_selectable`` (read, hash and check: no runtime touched, so
  a server does it off its engine thread), ``SelectableAdapter.allocate``.
  Its ``identity`` (sha256 of the file's bytes, or of an in-memory
  Adapter's values, and the scale) is what K/V computed with it depend on.

Invariants: the base weights are never changed here; a term's scale is the
file's ``alpha / rank`` (``Adapter.scale``) times the user's; a context this
module allocates is closed again if anything after its creation fails.
"""

from __future__ import annotations

import hashlib
import math
import numbers
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

import toy_ggml
from toy import models
from toy.adapters.file import Adapter, AdapterError, load_adapter
from toy.errors import BadInputError

_BLOCK_WEIGHT = re.compile(r"blk\.\d+\.(\w+)\.weight")
_SCALE_RE = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?")
_ADAPTER_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")


def parse_lora_arg(text: str) -> tuple[str, float]:
    """``ADAPTER[:SCALE]`` as ``--lora`` takes it -> (path, scale), scale 1 by
    default. The text after the last ``:`` is the scale unless the whole text
    names an existing file or that part holds a path separator (a Windows
    drive). BadInputError for a scale that is not a finite number."""
    text = str(text).strip()
    if not text:
        raise BadInputError("an empty --lora value", hint="--lora ADAPTER.gguf[:SCALE], e.g. --lora a.gguf:0.5")
    head, sep, tail = text.rpartition(":")
    if not sep or not head or os.path.isfile(text) or "/" in tail or "\\" in tail:
        return text, 1.0
    if not _SCALE_RE.fullmatch(tail.strip()):
        raise BadInputError(
            f"--lora {text}: the scale {tail!r} is not a number", hint="--lora ADAPTER.gguf[:SCALE], e.g. a.gguf:0.5"
        )
    scale = float(tail)
    if not math.isfinite(scale):
        raise BadInputError(f"--lora {text}: the scale {tail!r} is not finite")
    return head, scale


def check_lora(adapter: Adapter, gf) -> None:
    """Raise ``AdapterError`` unless ``adapter`` fits the open base model
    ``gf``: same architecture, every adapted weight present with the pair's
    shape (``Adapter.check_base``), and only weights the architecture's
    forward adapts (its ``lora_targets``)."""
    adapter.check_base({name: tuple(info.shape) for name, info in gf.tensors.items()}, gf.architecture)
    cfg = models.config_from_gguf(gf)
    stems = [t.stem for t in models.language_model_of(cfg).lora_targets(cfg).values()] + inference_stems(cfg)
    bad = next((n for n in adapter.pairs if not ((m := _BLOCK_WEIGHT.fullmatch(n)) and m.group(1) in stems)), None)
    if bad is not None:
        where = f"{adapter.path}: " if adapter.path else ""
        raise AdapterError(
            f"{where}adapts {bad}; toy applies LoRA to the attention and feed-forward projections only",
            hint=f"adapted weights are blk.N.{'/'.join(stems)}.weight",
        )


#: the stacked expert weights whose 3-D pairs a mixture of experts' forward applies (``toy.models.moe``)
EXPERT_STEMS = ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")
#: a shared expert's projections (qwen2moe), 2-D, through the forward's LoRA projection
SHARED_EXPERT_STEMS = ("ffn_gate_inp_shexp", "ffn_gate_shexp", "ffn_up_shexp", "ffn_down_shexp")


def expert_stems(cfg) -> list[str]:
    """The stacked expert stems an adapter of a model with config ``cfg`` may adapt (3-D pairs)."""
    return list(EXPERT_STEMS) if getattr(cfg, "n_expert", 0) else []


def inference_stems(cfg) -> list[str]:
    """The weights beyond the architecture's ``lora_targets`` an adapter may
    adapt (imported adapters, applied at inference; training's targets stay
    the ``lora_targets``): a mixture of experts' stacked experts (3-D pairs)
    and its shared expert's projections."""
    shared = list(SHARED_EXPERT_STEMS) if getattr(cfg, "n_expert", 0) and getattr(cfg, "d_ff_shared", 0) else []
    return expert_stems(cfg) + shared


def lora_items(lora) -> list[tuple[Any, float]]:
    """``lora`` as a list of (path or Adapter, user scale)."""
    if lora is None:
        return []
    if isinstance(lora, (str, os.PathLike, Adapter)):
        lora = [lora]
    out: list[tuple[Any, float]] = []
    for item in lora:
        if isinstance(item, (str, os.PathLike, Adapter)):
            src, scale = item, 1.0
        elif isinstance(item, Sequence) and len(item) == 2:
            src, scale = item
        else:
            raise BadInputError(f"lora: {item!r} is not a path, an Adapter or a (path, scale) pair")
        if not isinstance(src, (str, os.PathLike, Adapter)):
            raise BadInputError(f"lora: {src!r} is not a path or an Adapter")
        if isinstance(scale, bool) or not isinstance(scale, numbers.Real) or not math.isfinite(scale):
            raise BadInputError(f"lora: the scale {scale!r} of {src} is not a finite number")
        out.append((src, float(scale)))
    return out


def read_adapters(items, gf) -> list[tuple[Adapter, float]]:
    """(Adapter, user scale) of each item (a path, an Adapter, or a pair:
    ``lora_items``), read and checked against the open base ``gf``."""
    out: list[tuple[Adapter, float]] = []
    for src, scale in lora_items(items):
        ad = src if isinstance(src, Adapter) else load_adapter(src)
        check_lora(ad, gf)
        out.append((ad, scale))
    return out


def load_lora(items, gf, runtime: toy_ggml.Runtime):
    """Read and check the adapters; their A/B tensors in one allocated F32
    context. Returns (context or None, {weight name: [(a, b, scale, None)]},
    [(path, scale)])."""
    if not items:
        return None, None, []
    adapters = read_adapters(items, gf)
    ctx, terms = lora_context(adapters, runtime)
    return ctx, terms, [(str(ad.path) if ad.path is not None else None, scale) for ad, scale in adapters]


def lora_context(adapters: Sequence[tuple[Adapter, float]], runtime: toy_ggml.Runtime):
    """The A/B tensors of (Adapter, user scale) pairs in one allocated F32
    context on ``runtime``: (context, {weight name: [(a, b, scale, None)]})."""
    F32 = toy_ggml.GGMLType.F32
    ctx = toy_ggml.Context(max_tensors=2 * sum(len(ad.pairs) for ad, _ in adapters) + 8)
    try:
        made = []
        for j, (ad, scale) in enumerate(adapters):
            for name, (a, b) in ad.pairs.items():
                ta = ctx.tensor(F32, a.shape, name=f"lora{j}.{name}.a")
                tb = ctx.tensor(F32, b.shape, name=f"lora{j}.{name}.b")
                made.append((name, ta, a, tb, b, ad.scale(name) * scale))
        ctx.allocate(runtime)
        terms: dict[str, list] = {}
        for name, ta, a, tb, b, s in made:
            ta.set(np.ascontiguousarray(a, np.float32))
            tb.set(np.ascontiguousarray(b, np.float32))
            terms.setdefault(name, []).append((ta, tb, s, None))
    except BaseException:
        ctx.close()
        raise
    return ctx, terms


def named_items(adapters) -> list[tuple[str, Any, float]]:
    """``adapters`` ({name: path, Adapter or (path, scale)}) as [(name, source, scale)]."""
    if not adapters:
        return []
    if not isinstance(adapters, Mapping):
        raise BadInputError("adapters must map names to adapter files (or (file, scale) pairs)")
    out: list[tuple[str, Any, float]] = []
    for name, item in adapters.items():
        check_adapter_name(name)
        ((src, scale),) = lora_items([item])
        out.append((name, src, scale))
    return out


def split_terms(terms: dict, n: int) -> list[dict]:
    """``load_lora``'s terms of n adapters (one context, names lora{j}.*) as one term map per adapter."""
    per: list[dict] = [{} for _ in range(n)]
    for name, ts in (terms or {}).items():
        for t in ts:
            j = int(t[0].name.split(".", 1)[0].removeprefix("lora"))
            per[j].setdefault(name, []).append(t)
    return per


class AdapterNameError(BadInputError):
    """A selectable adapter's name is already taken (or is not a valid name)."""


def check_adapter_name(name) -> str:
    """``name`` if it is a valid selectable adapter name (1-64 letters, digits, '_', '-' or '.'), else BadInputError."""
    if not isinstance(name, str) or not _ADAPTER_NAME.fullmatch(name):
        raise BadInputError(f"adapter name {name!r}: use 1-64 letters, digits, '_', '-' or '.'", field="name")
    return name


def adapter_digest(src) -> str:
    """The hex sha256 of what an adapter's tensors are made from: a file's
    bytes (the same file gives the same digest in every process), or, for an
    in-memory ``Adapter``, its architecture, alpha and every pair's name,
    shapes and F32 values."""
    h = hashlib.sha256()
    if isinstance(src, Adapter):
        h.update(f"adapter:{src.architecture}:{float(src.alpha)!r}".encode())
        for name in sorted(src.pairs):
            for m in src.pairs[name]:
                m = np.ascontiguousarray(m, np.float32)
                h.update(f"|{name}:{m.shape}|".encode())
                h.update(m.tobytes())
        return h.hexdigest()
    with open(src, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


@dataclass
class SelectableAdapter:
    """One selectable adapter read and checked against a base, with its own
    F32 context (None until ``allocate``): what ``toy.Model`` keeps per
    engine index. ``identity`` is what the K/V it computes depends on: the
    sha256 of its source (``adapter_digest``) and the user scale."""

    name: str
    path: str | None
    scale: float
    digest: str
    adapter: Adapter | None
    nbytes: int = 0  # of its A/B tensors (F32)
    context: toy_ggml.Context | None = None
    terms: dict | None = None

    @property
    def identity(self) -> str:
        return f"{self.digest}:{self.scale!r}"

    def allocate(self, runtime: toy_ggml.Runtime) -> None:
        """Its A/B tensors on ``runtime`` (once)."""
        if self.context is None:
            assert self.adapter is not None
            self.context, self.terms = lora_context([(self.adapter, self.scale)], runtime)
            self.adapter = None  # the values now live in the context

    def close(self) -> None:
        if self.context is not None:
            self.context.close()
            self.context = None
        self.terms = None


def read_selectable(name, src, scale, gf) -> SelectableAdapter:
    """A selectable adapter read from ``src`` (a path or an ``Adapter``) and
    checked against the open base ``gf`` (``check_lora``): the slow part of
    loading one, which touches no runtime. AdapterError when it is not an
    adapter or not for this base."""
    check_adapter_name(name)
    ((src, scale),) = lora_items([(src, scale)])
    digest = adapter_digest(src)
    ad = src if isinstance(src, Adapter) else load_adapter(src)
    check_lora(ad, gf)
    path = str(ad.path) if ad.path is not None else None
    nbytes = 4 * sum(a.size + b.size for a, b in ad.pairs.values())
    return SelectableAdapter(name, path, scale, digest, ad, nbytes)


__all__ = [
    "AdapterNameError",
    "SelectableAdapter",
    "adapter_digest",
    "check_adapter_name",
    "check_lora",
    "expert_stems",
    "inference_stems",
    "load_lora",
    "lora_context",
    "lora_items",
    "named_items",
    "parse_lora_arg",
    "read_adapters",
    "read_selectable",
    "split_terms",
]
