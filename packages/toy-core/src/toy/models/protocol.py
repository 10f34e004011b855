"""The plugin base types of the model registry (``toy.models``), as typed
Protocols, and the per-name traits an architecture declares.

``Architecture`` is what every ``ARCH`` provides, built in or added by
another distribution through the ``toy.architectures`` entry points
(toy-vit's ``vit``). ``LanguageModel`` adds what the LLM engine, training,
LoRA, the recipes and checkpoints call: every built-in family has it, and a
plugin that is not a language model (``language_model = False``) leaves it
out. Conformance is structural: toy's families are ``LMArchitecture``
instances (a frozen dataclass in ``toy.models``), toy-vit's ``ARCH`` is a
class of its own, and neither subclasses these Protocols. Both are
``runtime_checkable``, so ``isinstance(arch, Architecture)`` tells whether
the members are present (not whether their signatures match; mypy checks
those where a module asserts conformance).

Optional members
----------------
A Protocol cannot say "may be absent", so these are documented here and read
with ``getattr`` and a default (by the registry and ``toy.models.card``):

- ``language_model`` (bool, default True): False for an architecture the
  LLM engine cannot run (no vocabulary, no token forward);
- ``usage`` (str or None): how to run a non-LM model, the hint when
  ``toy.load`` refuses it;
- ``presets``, ``forward``, ``metadata``, ``config_from_gguf``: required of a
  ``LanguageModel``, optional otherwise (toy-vit has them);
- ``summary(metadata, tensors)``: the architecture's own facts as a
  JSON-able dict (``ModelSummary.extra``; an ``"mlp"`` key names the
  feed-forward instead); ``describe_rows(extra)``: ``(label, text)`` rows
  of those facts for ``toy describe``; ``card(summary)``: the algorithm
  card. Without ``card`` the model gets "no algorithm card";
- ``traits`` (``Mapping[str, Traits]``, default empty): per
  ``general.architecture`` name, what the file does not say and the
  generic summary needs (see ``Traits``).

Invariant: this module imports only the standard library, so the registry
and the CLI's help texts that read it stay light.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    from toy.models import LoraTarget, ParamInfo


@dataclass(frozen=True)
class Traits:
    """What one ``general.architecture`` fixes that its GGUF file does not
    say (llama.cpp decides these by the name). The family's config reads
    them, and ``toy.models.card`` reads them for the summary's defaults and
    the algorithm card. The defaults are what an unknown name gets: only
    what its file says."""

    norm: str | None = None  # "rms" or "layer": the norm when the file names no epsilon key
    rope: bool = False  # rotary positions even when the file has no rope key
    rope_pairs: str = "normal"  # llama.cpp's rope type: "normal" rotates pairs (2i, 2i+1), "neox" (i, i + n/2)
    qk_norm_full: bool = False  # QK-norm over the whole projection before the head split (olmoe), not per head
    expert_width_is_ff: bool = False  # feed_forward_length is the experts' width (olmoe), not a dense width
    expert_weights_norm: bool = False  # the k chosen experts' weights are renormalised to sum 1 (qwen3moe)


@runtime_checkable
class Architecture(Protocol):
    """What every registered ``ARCH`` provides (see the module docstring for
    the optional members). Data members are read-only properties here, so a
    frozen dataclass conforms."""

    @property
    def family(self) -> str:
        """The family name (``--arch``; one module each)."""
        ...

    @property
    def names(self) -> tuple[str, ...]:
        """The ``general.architecture`` values it reads."""
        ...

    def config_from_metadata(self, metadata: Mapping[str, Any], tensors: Mapping[str, Any]) -> Any:
        """The frozen config of a file from its metadata and tensor infos
        (``UnsupportedModelError`` naming what is missing); every config
        has ``architecture``."""
        ...

    def params(self, cfg: Any) -> Mapping[str, ParamInfo]:
        """The trainable tensors: GGUF name -> ``ParamInfo(shape, kind)``."""
        ...


@runtime_checkable
class LanguageModel(Architecture, Protocol):
    """An ``Architecture`` the LLM engine, training and LoRA run: every
    built-in family. The members are described in ``toy.models``' docstring;
    ``sliding_window``, ``attention_softcap`` and ``final_softcap`` are 0 for
    a model whose layers are all alike (``LMArchitecture``'s defaults)."""

    @property
    def presets(self) -> Mapping[str, Mapping[str, Any]]:
        """Preset name -> dimensions, for ``toy train from-scratch --preset``."""
        ...

    @property
    def lora_names(self) -> tuple[str, ...]:
        """Every LoRA target name any config of the family has."""
        ...

    @property
    def lora_default(self) -> tuple[str, ...]:
        """The targets a LoRA run adapts when the config names none."""
        ...

    def config_from_gguf(self, gf: Any) -> Any: ...

    def metadata(self, cfg: Any, name: str) -> dict[str, Any]: ...

    def train_config(self, dims: Mapping[str, Any], n_vocab: int, context: int) -> Any: ...

    def forward(
        self,
        ctx: Any,
        cfg: Any,
        weights: Any,
        tokens: Any,
        pos: Any,
        attend: Any,
        out_rows: Any = None,
        row_invariant: bool = False,
        head: bool = True,
        lora: Any = None,
        taps: list[Any] | None = None,
    ) -> Any: ...

    def final_norm(self, ctx: Any, cfg: Any, weights: Any, x: Any) -> Any: ...

    def lora_targets(self, cfg: Any) -> Mapping[str, LoraTarget]: ...

    def attention_scale(self, cfg: Any, layer: int) -> float: ...

    def output_weight(self, cfg: Any) -> str: ...

    def sliding_window(self, cfg: Any, layer: int) -> int: ...

    def attention_softcap(self, cfg: Any, layer: int) -> float: ...

    def final_softcap(self, cfg: Any) -> float: ...

    def windows(self, cfg: Any) -> tuple[int, ...]: ...


__all__ = ["Architecture", "LanguageModel", "Traits"]
