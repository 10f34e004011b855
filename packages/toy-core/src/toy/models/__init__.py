"""Model architectures as data: one module per family and a registry keyed
by GGUF ``general.architecture``.

The rest of toy (the inference engine, ``toy.load``, training, recipes,
checkpoints, adapters, merge, eval and the server) reaches a model only
through this registry; no module outside ``toy/models/`` imports an
architecture module (a test walks the import graph). Adding an architecture
is one new module plus its tests, and one line in ``_MODULES``.

The protocol
------------
An architecture module defines ``ARCH``. What every ``ARCH`` provides is the
typed Protocol ``Architecture``, and what a language model adds is
``LanguageModel`` (both in ``toy.models.protocol``, which also lists the
optional members); the built-in families are ``LMArchitecture`` instances,
which conform to ``LanguageModel``:

- ``family`` (str) and ``names`` (tuple of ``general.architecture`` values it
  runs); ``presets`` (name -> dimensions for ``toy train from-scratch``);
- ``config_from_gguf(gf)`` / ``config_from_metadata(metadata, tensors)``: the
  frozen config dataclass of a file (``UnsupportedModelError`` naming what is
  missing or unsupported). Every config has at least ``architecture``,
  ``n_vocab``, ``d_model``, ``n_layer``, ``n_head``, ``n_head_kv``,
  ``head_dim``, ``d_ff``, ``context_length`` and ``tied_output`` — the fields
  the engine, the KV cache and the recipes read;
- ``metadata(cfg, name)``: the GGUF metadata llama.cpp expects for a model of
  this config with F32 weights (key -> value or ``(value, TypeInfo)``);
- ``train_config(dims, n_vocab, context)``: the config a from-scratch run
  trains, from ``toy.train.config.resolve_shape``'s dimensions;
- ``forward(ctx, cfg, weights, tokens, pos, attend, out_rows=None,
  row_invariant=False, head=True, lora=None, taps=None)``: the forward graph of T tokens
  with a pluggable attention. ``attend(layer, q, k, v)`` gets Q (T, H, D), K
  and V (T, H_kv, D) (positions already applied where the architecture
  rotates them) and returns (T, H * D): the KV-cache attention of
  ``toy.engine.llm`` and the batched attention of ``common.forward_batch``
  are its two callers. ``lora`` maps a weight's GGUF name to
  ``(a, b, scale, drop)`` terms; ``head=False`` returns the final normed
  hidden states, which ``output_weight(cfg)`` turns into logits; ``taps``
  (a list) receives the residual stream after each block, before the
  final norm (the logit lens, CKA and activation diagnostics read them);
- ``final_norm(ctx, cfg, weights, x)``: the norm before the head, for a
  residual stream ``x`` (a tap: the logit lens);
- ``params(cfg)``: the trainable tensors, GGUF name -> ``ParamInfo(shape,
  kind)`` in llama.cpp's converter order, ``kind`` one of ``KINDS``
  (initialisation and weight decay read it);
- ``lora_targets(cfg)``: short target name (``q``, ``qkv``, ``up`` …) ->
  ``LoraTarget(stem, site, d_in, d_out)``: the adapted weight is
  ``blk.N.<stem>.weight``; ``site`` names the activation its product reads
  (targets on one site share a dropout mask); ``lora_names``, every name
  any config of the family has, known without a config (a mixture-of-experts
  config has ``router`` and no dense ``gate``/``up``/``down``);
  ``lora_default``, the targets a LoRA run adapts when the config names
  none (every config has them);
- ``attention_scale(cfg, layer)``: the factor of Q·K before the softmax;
- ``output_weight(cfg)``: the name of the head's weight (the embedding when
  tied).

Optional members (defaults: none of it), for architectures whose layers are
not all alike (Gemma):

- ``sliding_window(cfg, layer)``: 0 for full causal attention, or W: the
  layer's queries see only the W most recent positions, themselves included
  (a key at distance ``q_pos - k_pos >= W`` is masked, llama.cpp's
  ``LLAMA_SWA_TYPE_STANDARD``). Every attention caller (the KV-cache engine,
  ``common.forward_logits`` and ``forward_batch``) builds one mask per
  distinct window (``windows(cfg)``) and hands each layer its own;
- ``attention_softcap(cfg, layer)``: 0, or c: the scaled scores s become
  ``c · tanh(s / c)`` before the mask and the softmax;
- ``final_softcap(cfg)``: 0, or c: the logits become ``c · tanh(z / c)``
  (``forward`` applies it to its head; ``forward_batch``, which runs the
  head itself, asks for it);
- ``summary``, ``describe_rows``, ``card``: ``toy describe``'s hooks, as
  for plugins below: the llama and gpt2 families use the decoder card of
  ``toy.models.card`` (``decoder_card``), Gemma writes its own summary,
  rows and card;
- ``traits``: ``general.architecture`` -> ``Traits``, what each name fixes
  that its file does not say (the norm and positions a silent file has,
  llama.cpp's RoPE pairing, olmoe's and qwen3moe's MoE choices); the
  family's config and ``toy.models.card`` read it, so the card keeps no
  table of families.

Shared graph pieces (masks, KV padding, the attention core, batched training
attention) live once in ``toy.models.common``; the load-time checks of what a
file declares (counts within bounds, the block count against the blocks
present, every dimension against the tensors), which every
``config_from_metadata`` runs, in ``toy.models.validate``.

Architectures from other distributions
--------------------------------------
toy never imports a distribution built on it (``toy_vit`` depends on
``toy``, not the reverse). A distribution adds an architecture through the
entry-point group ``toy.architectures`` (name -> module, e.g. ``vit =
"toy_vit.arch"`` in its pyproject), whose module defines ``ARCH``. ``get``
consults the group only for a name that is not built in (so resolving a
built-in name never reads package metadata); ``registered`` and
``families`` list the built-in language models only, which is what
``--arch`` and the LM protocol test mean.

A plugin that is not a language model (``language_model = False``: no
``n_vocab``, no token forward, nothing for the LLM engine, LoRA targets or
``toy train``'s recipes) gives an ``ARCH`` with at least ``family``,
``names``, ``language_model``, ``config_from_metadata(metadata, tensors)``
and ``params(cfg)`` (``toy.train.model.init_params`` reads it), and for
``toy describe`` optionally ``summary(metadata, tensors)`` (architecture
facts as a JSON-able dict, ``ModelSummary.extra``), ``describe_rows(extra)``
(``(label, text)`` rows) and ``card(summary)`` (its algorithm card); see
``toy.models.card``; ``usage`` (a line on how to run it: the hint when
``toy.load`` refuses it): the ``Architecture`` Protocol and its optional
members (``toy.models.protocol``). ``language_model(name)`` tells the two
kinds apart; ``require_language_model(name)`` refuses a non-LM;
``get_language_model(name)`` / ``language_model_of(cfg)`` are ``get`` /
``of`` typed ``LanguageModel`` for the callers that run one (the engine,
training, LoRA, checkpoints), refusing a non-LM the same way.

Invariant: importing this module, and resolving a built-in name, imports
neither numpy nor ggml (the CLI's help texts list the families from here).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, cast

from toy.errors import BadInputError
from toy.models.protocol import Architecture, LanguageModel, Traits

#: kinds of trainable tensor: init and weight decay (``toy.train.model``)
KINDS = ("embedding", "position", "matrix", "residual", "norm", "norm_bias", "bias")

# general.architecture -> module (imported on first use, so this module stays light)
_MODULES = {
    "llama": "toy.models.llama",
    "qwen2": "toy.models.llama",
    "qwen3": "toy.models.llama",
    "gpt2": "toy.models.gpt2",
    "gemma2": "toy.models.gemma",
    "gemma3": "toy.models.gemma",
    "olmoe": "toy.models.llama",
    "qwen2moe": "toy.models.llama",
    "qwen3moe": "toy.models.llama",
}

# family names that are no general.architecture value toy runs (``get`` takes both)
_FAMILIES = {"gemma": "toy.models.gemma"}

# architectures of llama.cpp's that toy knows it does not run: name -> what is missing
_REFUSED = {
    "gemma3n": "Gemma 3n needs per-layer embeddings, AltUp, LAuReL and activation sparsity, which toy does not implement",
    "gemma-embedding": "EmbeddingGemma (bidirectional attention, mean pooling) is not implemented",
    "clip": "this is a vision tower (an mmproj file), not a language model: toy runs the text model only",
}


class UnsupportedModelError(BadInputError):
    """The file is not a model toy can run (architecture, missing tensor,
    unsupported variant); the message says which."""


@dataclass(frozen=True)
class ParamInfo:
    shape: tuple[int, ...]  # NumPy order; a linear weight is (d_out, d_in)
    kind: str  # one of KINDS


@dataclass(frozen=True)
class LoraTarget:
    stem: str  # blk.N.<stem>.weight
    site: str  # the activation the product reads (dropout masks are per site)
    d_in: int
    d_out: int


@dataclass(frozen=True)
class LMArchitecture:
    """The ``ARCH`` of a built-in family (a language-model plugin may use it
    too): a frozen dataclass that conforms to the ``LanguageModel``
    Protocol, with the optional per-layer members defaulting to "all layers
    alike" and the ``toy describe`` hooks to none. The members are described
    in this module's docstring."""

    family: str
    names: tuple[str, ...]
    presets: Mapping[str, Mapping[str, Any]]
    lora_names: tuple[str, ...]
    lora_default: tuple[str, ...]
    config_from_metadata: Callable[..., Any]
    forward: Callable[..., Any]
    params: Callable[[Any], dict[str, ParamInfo]]
    lora_targets: Callable[[Any], dict[str, LoraTarget]]
    attention_scale: Callable[[Any, int], float]
    output_weight: Callable[[Any], str]
    final_norm: Callable[..., Any]
    metadata: Callable[[Any, str], dict[str, Any]]
    train_config: Callable[..., Any]
    sliding_window: Callable[[Any, int], int] = lambda cfg, layer: 0
    attention_softcap: Callable[[Any, int], float] = lambda cfg, layer: 0.0
    final_softcap: Callable[[Any], float] = lambda cfg: 0.0
    summary: Callable[..., Any] | None = None
    describe_rows: Callable[..., Any] | None = None
    card: Callable[..., Any] | None = None
    traits: Mapping[str, Traits] = field(default_factory=dict)
    hf: str | None = None  # the module whose ``HF`` is the family's ``toy.models.hf.HFFamily``

    def config_from_gguf(self, gf) -> Any:
        return self.config_from_metadata(gf.metadata, gf.tensors)

    def windows(self, cfg) -> tuple[int, ...]:
        """The distinct attention windows of a config's layers, 0 (full
        causal) first when some layer has it: one mask each."""
        return tuple(sorted({int(self.sliding_window(cfg, i)) for i in range(cfg.n_layer)}))


#: entry-point group of architectures other distributions add (see the module docstring)
ENTRY_POINT_GROUP = "toy.architectures"


def _entry_points() -> dict[str, str]:
    """name -> module of the installed ``toy.architectures`` entry points."""
    from importlib.metadata import entry_points  # lazy: ~0.05 s; built-in names never need it

    return {ep.name: ep.value for ep in entry_points(group=ENTRY_POINT_GROUP)}


def plugins() -> tuple[str, ...]:
    """The architecture names installed distributions add (entry points)."""
    return tuple(n for n in _entry_points() if n not in _MODULES)


def registered() -> tuple[str, ...]:
    """The ``general.architecture`` values toy runs."""
    return tuple(_MODULES)


def language_models() -> tuple[LanguageModel, ...]:
    """The built-in families' ``ARCH`` objects, one each, in registry order
    (llama, gpt2, gemma): what ``--arch``, ``--preset`` and ``--targets``
    offer (the CLI's help texts list them from here)."""
    out: dict[str, LanguageModel] = {}
    for name in _MODULES:
        arch = get_language_model(name)
        out.setdefault(arch.family, arch)
    return tuple(out.values())


def families() -> tuple[str, ...]:
    """The architecture families (one module each), e.g. for ``--arch``."""
    return tuple(arch.family for arch in language_models())


def get(name: str | None) -> Architecture:
    """The architecture object (``ARCH``) for a ``general.architecture``
    value or a family name; ``UnsupportedModelError`` listing the registered
    ones for anything else. A built-in's is a ``LanguageModel``; a plugin's
    may be an ``Architecture`` only (``language_model(name)`` tells)."""
    module = (_MODULES.get(name) or _FAMILIES.get(name)) if isinstance(name, str) else None
    if module is None and isinstance(name, str):
        module = _entry_points().get(name)  # an architecture another distribution adds
    if module is None and name in _REFUSED:
        raise UnsupportedModelError(f"architecture {name!r} is not supported: {_REFUSED[name]}")
    if module is None:
        extra = plugins()
        raise UnsupportedModelError(
            f"architecture {name!r} is not supported",
            hint=f"supported architectures: {', '.join(_MODULES)}"
            + (f"; installed plugins: {', '.join(extra)}" if extra else ""),
        )
    try:
        arch: Architecture = importlib.import_module(module).ARCH
    except (ImportError, AttributeError) as e:
        raise UnsupportedModelError(
            f"architecture {name!r}: its module {module!r} does not load ({e})",
            hint="reinstall the distribution that provides it",
        ) from None
    return arch


def language_model(name: str | None) -> bool:
    """Whether a ``general.architecture`` value is a language model the LLM
    engine runs (built-ins are; a plugin says with ``language_model``)."""
    return bool(getattr(get(name), "language_model", True))


def require_language_model(name: str | None) -> None:
    """``UnsupportedModelError`` unless ``name`` is a language model (the
    check ``toy.load`` makes before reading a tokenizer); a plugin's
    ``usage`` (optional) becomes the hint."""
    if name in _MODULES:
        return
    get_language_model(name)


def get_language_model(name: str | None) -> LanguageModel:
    """``get(name)`` for the callers that run a language model (the engine,
    training, LoRA, checkpoints): the same object, typed ``LanguageModel``;
    ``UnsupportedModelError`` for an architecture that is not one (a
    plugin's ``usage``, optional, is the hint)."""
    arch = get(name)
    if not getattr(arch, "language_model", True):
        raise UnsupportedModelError(
            f"architecture {name!r} is not a language model: it cannot generate text",
            hint=getattr(arch, "usage", None),
        )
    # what language_model (default True) promises; test_registry_protocol checks it for the built-ins
    return cast(LanguageModel, arch)


def hf_family(name: str | None) -> Any:
    """The ``toy.models.hf.HFFamily`` of a ``general.architecture`` value or
    family name (its module imported now); ``UnsupportedModelError`` for an
    architecture without a Hugging Face mapping."""
    module = getattr(get(name), "hf", None)
    if module is None:
        raise UnsupportedModelError(
            f"architecture {name!r} has no Hugging Face mapping",
            hint="toy converts " + ", ".join(n for n in _MODULES if getattr(get(n), "hf", None)),
        )
    return importlib.import_module(module).HF


def hf_families() -> tuple[Any, ...]:
    """Every built-in family's ``HFFamily``, in registry order."""
    return tuple(hf_family(arch.family) for arch in language_models() if getattr(arch, "hf", None))


def lora_target_names() -> tuple[str, ...]:
    """Every LoRA target name of any architecture (``lora_names``), in
    registry order: what a config may name before a model is known."""
    return tuple(dict.fromkeys(t for arch in language_models() for t in arch.lora_names))


def of(cfg: Any) -> Architecture:
    """The architecture of a config."""
    return get(cfg.architecture)


def language_model_of(cfg: Any) -> LanguageModel:
    """The architecture of a language model's config (``get_language_model``)."""
    return get_language_model(cfg.architecture)


def config_from_metadata(metadata: Mapping[str, Any], tensors: Mapping[str, Any]) -> Any:
    """The config of a model from its metadata and tensor infos."""
    return get(metadata.get("general.architecture")).config_from_metadata(metadata, tensors)


def config_from_gguf(gf: Any) -> Any:
    """The config of an open ``GGUFFile``."""
    return config_from_metadata(gf.metadata, gf.tensors)


__all__ = [
    "KINDS",
    "Architecture",
    "LMArchitecture",
    "LanguageModel",
    "LoraTarget",
    "ParamInfo",
    "Traits",
    "ENTRY_POINT_GROUP",
    "UnsupportedModelError",
    "config_from_gguf",
    "config_from_metadata",
    "families",
    "get",
    "get_language_model",
    "hf_families",
    "hf_family",
    "language_model",
    "language_model_of",
    "language_models",
    "lora_target_names",
    "of",
    "plugins",
    "registered",
    "require_language_model",
]
