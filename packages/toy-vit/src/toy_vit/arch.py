"""The ViT classifier as an architecture in toy's registry (entry point
``toy.architectures``: ``vit = "toy_vit.arch"``), so ``toy describe``, the
algorithm card and ``toy.models.get("vit")`` / ``models.of(cfg)`` know it
without toy importing toy_vit.

A ViT is not a language model (``language_model = False``): it gives the
registry only what a non-LM architecture provides (see ``toy.models``):
``family``, ``names``, ``presets``, ``config_from_metadata``/``config_from_gguf``,
``params`` (``toy.train.model.init_params`` reads the kinds), ``forward``
(``toy_vit.model.forward``: patches in, logits out), ``metadata``, and for
describe ``summary`` (JSON-able facts: ``ModelSummary.extra``),
``describe_rows`` and ``card``; ``usage`` (the hint when ``toy.load``
refuses the file). No ``n_vocab``, token forward, LoRA targets
or ``train_config``: the LLM engine and ``toy train`` never see it. It
conforms to the registry's ``Architecture`` Protocol (``toy.models.protocol``)
structurally, without subclassing it: mypy checks the match below, and toy's
registry tests check ``isinstance(ARCH, Architecture)``.

Everything here reads metadata only, never tensor data, and imports no
ggml (``toy describe`` stays fast).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from toy_vit.config import PRESETS

if TYPE_CHECKING:
    from toy.models import Architecture


def summary(metadata: Mapping[str, Any], tensors: Mapping[str, Any]) -> dict[str, Any]:
    """The ViT's own facts for ``toy describe`` (``ModelSummary.extra``); a
    file that does not read as a ViT gives ``{"problem": message}``."""
    from toy_vit.gguf_io import ViTFileError, config_from_metadata
    from toy_vit.model import n_params

    try:
        cfg = config_from_metadata(metadata, tensors)
    except ViTFileError as e:
        return {"task": "image classification", "problem": str(e)}
    return {
        "task": "image classification",
        "image_size": cfg.image_size,
        "patch_size": cfg.patch_size,
        "n_channels": cfg.n_channels,
        "grid": cfg.grid,
        "n_patches": cfg.n_patches,
        "n_tokens": cfg.n_tokens,
        "n_classes": cfg.n_classes,
        "labels": list(cfg.labels[:8]),  # a preview
        "image_mean": list(cfg.image_mean),
        "image_std": list(cfg.image_std),
        "model_params": n_params(cfg),
    }


def _nums(v) -> str:
    return "(" + ", ".join(f"{x:g}" for x in v) + ")"


def describe_rows(extra: Mapping[str, Any]) -> list[tuple[str, str]]:
    """``toy describe``'s rows for the facts of ``summary``."""
    if "problem" in extra:
        return [("task", str(extra["task"])), ("problem", str(extra["problem"]))]
    S, p, g, C = extra["image_size"], extra["patch_size"], extra["grid"], extra["n_channels"]
    n, labels = extra["n_classes"], extra["labels"]
    more = f", … (+{n - len(labels)} more)" if n > len(labels) else ""
    return [
        ("task", "image classification (ViT, class-token head)"),
        ("image", f"{S}×{S} px, {C} channel{'s' if C > 1 else ''}"),
        ("normalise", f"mean {_nums(extra['image_mean'])}, std {_nums(extra['image_std'])}"),
        ("patches", f"{p}×{p} px: {g}×{g} = {extra['n_patches']} patches + class token = {extra['n_tokens']} tokens"),
        ("classes", f"{n}: " + ", ".join(labels) + more),
    ]


def card(s) -> str:
    """The forward pass as numbered pseudocode with the model's shapes
    (``toy.models.card``'s style: rows X ∈ ℝ^{T×d}, a linear map X·W)."""
    from toy.models.card import Lines

    e = s.extra
    if "n_tokens" not in e or s.n_layer is None or s.d_model is None or s.n_head is None:
        return f"(no algorithm card: {e.get('problem', 'the vit metadata is incomplete')})"
    L, d, H, dh, f = s.n_layer, s.d_model, s.n_head, s.head_dim, s.d_ff
    S, p, C, N, T, n = e["image_size"], e["patch_size"], e["n_channels"], e["n_patches"], e["n_tokens"], e["n_classes"]
    K = C * p * p
    eps = f", ε = {s.norm_eps:g}" if s.norm_eps is not None else ""
    title = f" — {s.name}" if s.name else ""
    head = [
        f"Algorithm: P ← vit(x | θ), the forward pass of a Vision Transformer classifier{title}",
        f"Input:  x ∈ ℝ^{{{C}×{S}×{S}}}, an image normalised per channel",
        f"Output: P ∈ (0,1)^{n}, class probabilities",
        f"Hyperparameters: L = {L} layers, d = {d}, d_ff = {f}, patch p = {p}, N = {N} patches, T = N + 1 = {T}",
        f"Attention: H = {H} heads, d_h = {dh}",
    ]
    ln = Lines()
    ln.add("P_x ← patches(x)", f"P_x ∈ ℝ^{{{N}×{K}}}: {p}×{p} patches, row-major, each flattened (C, p, p)")
    ln.add("X_p ← P_x·W_p + b_p", f"W_p ∈ ℝ^{{{K}×{d}}}: the {p}×{p} convolution of stride {p}")
    ln.add("X ← [e_cls; X_p] + W_pos", f"X ∈ ℝ^{{{T}×{d}}}; class token first; learned positions W_pos ∈ ℝ^{{{T}×{d}}}")
    ln.add(f"for l = 1, …, {L} do")
    ln.add(f"  Y ← LayerNorm(X | γ_1[l], β_1[l]){eps}")
    ln.add("  Q ← Y·W_q[l] + b_q[l];  K ← Y·W_k[l] + b_k[l];  V ← Y·W_v[l] + b_v[l]", f"Q, K, V ∈ ℝ^{{{T}×{H}×{dh}}}")
    ln.add(f"  for h = 1, …, {H}: A_h ← softmax(Q_h·K_hᵀ / √{dh})·V_h", "no mask: every token attends to every token")
    ln.add(f"  X ← X + [A_1, …, A_{H}]·W_o[l] + b_o[l]", f"W_o ∈ ℝ^{{{d}×{d}}}; residual")
    ln.add(f"  Y ← LayerNorm(X | γ_2[l], β_2[l]){eps}")
    ln.add("  X ← X + GELU(Y·W_up[l] + b_up[l])·W_down[l] + b_down[l]", f"W_up ∈ ℝ^{{{d}×{f}}}, W_down ∈ ℝ^{{{f}×{d}}}")
    ln.add("end for")
    ln.add(f"y ← LayerNorm(X[0, :] | γ_f, β_f){eps}", "the class token's row")
    ln.add("z ← y·W_c + b_c", f"z ∈ ℝ^{n}, W_c ∈ ℝ^{{{d}×{n}}}")
    ln.add("return P = softmax(z)")
    defs = "where LayerNorm(x | γ, β) = γ ⊙ (x − mean(x)) / √(var(x) + ε) + β; GELU(z) = ½z(1 + erf(z/√2))."
    return "\n".join(head + ln.render() + [defs])


@dataclass(frozen=True)
class NonLMArchitecture:
    """A registry entry for an architecture that is not a language model:
    an ``Architecture`` with the optional members ``toy.models.protocol``
    documents for plugins."""

    family: str
    names: tuple[str, ...]
    presets: Mapping[str, Mapping[str, Any]]
    config_from_metadata: Callable[..., Any]
    params: Callable[[Any], dict]
    forward: Callable[..., Any]
    metadata: Callable[..., dict]
    summary: Callable[..., dict] | None = None
    describe_rows: Callable[..., list] | None = None
    card: Callable[..., str] | None = None
    usage: str | None = None  # how to run it (the hint when toy.load refuses it)
    language_model: bool = False

    def config_from_gguf(self, gf) -> Any:
        return self.config_from_metadata(gf.metadata, gf.tensors)


def _config_from_metadata(metadata, tensors):
    from toy_vit.gguf_io import config_from_metadata

    return config_from_metadata(metadata, tensors)


def _params(cfg):
    from toy_vit.model import params

    return params(cfg)


def _forward(*args, **kwargs):
    from toy_vit.model import forward

    return forward(*args, **kwargs)


def _metadata(cfg, name: str = "vit"):
    from toy_vit.gguf_io import metadata

    return metadata(cfg, name)


ARCH = NonLMArchitecture(
    family="vit",
    names=("vit",),
    presets=PRESETS,
    config_from_metadata=_config_from_metadata,
    params=_params,
    forward=_forward,
    metadata=_metadata,
    summary=summary,
    describe_rows=describe_rows,
    card=card,
    usage="a ViT classifies images: toy_vit.load(path).classify(images) in Python, or the `toy vit` commands",
)

if TYPE_CHECKING:
    _conforms: Architecture = ARCH  # the structural check, for mypy

__all__ = ["ARCH", "NonLMArchitecture", "card", "describe_rows", "summary"]
