"""Linear mode connectivity: the loss along the straight line between two
checkpoints, θ(α) = (1 − α) θ_A + α θ_B.

Two checkpoints of one architecture and shape (two seeds of a run, a model
before and after fine-tuning) are *linearly connected* when the loss stays
low all along that line; a bump in the middle (the *barrier*) says they sit
in different basins. ``lmc`` evaluates the perplexity-window loss of
``toy.eval.score.perplexity`` at each α.

Invariants and decisions:

- The files must agree on the architecture (every field of the architecture's config)
  and on every tensor's name and shape; the first mismatch is named in the
  error. Their vocabularies must be the same tokens.
- Both checkpoints are read into float32 (quantized tensors dequantized
  through ggml), and θ(α) is computed in float32 as ``(1-α)·a + α·b``. At
  α = 0 and α = 1 that is exactly θ_A and θ_B, so for F32 checkpoints (what
  ``toy train`` writes) the end points reproduce each model's own
  ``toy eval perplexity`` to the last bit. For a quantized checkpoint the end
  point is its F32 dequantization, which is close but not identical.
- The interpolated weights live in one ggml buffer that is overwritten per
  α; the engine and its graphs are built once. Memory: two F32 copies on the
  host plus one on the device.
- ``barrier``: the largest excess of L(α) over the straight line between
  L(0) and L(1), over the α in (0, 1) that were evaluated (None unless both
  0 and 1 were).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

import toy_ggml
from toy import models
from toy.engine.llm import LLMEngine
from toy.errors import BadInputError
from toy.eval.score import PerplexityResult, perplexity, same_vocabulary, text_ids
from toy.gguf import GGUFFile
from toy.tokenizer import Tokenizer

DEFAULT_ALPHAS = (0.0, 0.25, 0.5, 0.75, 1.0)


@dataclass
class LMCPoint:
    alpha: float
    nll: float
    ppl: float
    nll_stderr: float


@dataclass
class LMCResult:
    points: list[LMCPoint]
    context: int
    n_scored: int
    barrier: float | None

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self)}


def parse_alphas(text: str) -> list[float]:
    """``"0,0.25,0.5"`` -> [0.0, 0.25, 0.5] (finite, distinct, at least one)."""
    out = []
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        try:
            a = float(part)
        except ValueError:
            raise BadInputError(f"alpha {part!r} is not a number") from None
        if not np.isfinite(a):
            raise BadInputError(f"alpha {part!r} is not finite")
        out.append(a)
    if not out:
        raise BadInputError("no alphas given (e.g. --alphas 0,0.5,1)")
    if len(set(out)) != len(out):
        raise BadInputError(f"alphas repeat: {text}")
    return out


class _Endpoint:
    def __init__(self, path: Path):
        self.path = path
        with GGUFFile(path) as gf:
            self.cfg = models.config_from_gguf(gf)
            self.tokenizer = Tokenizer.from_gguf(gf.metadata)
            self.shapes = {name: tuple(t.shape) for name, t in gf.tensors.items()}
            self.order = list(gf.tensors)
            self.values = {name: gf.tensor_to_float(name) for name in self.order}


def check_compatible(a: _Endpoint, b: _Endpoint) -> None:
    """Raise naming the first difference between two checkpoints."""
    for f in a.cfg.__dataclass_fields__:
        va, vb = getattr(a.cfg, f), getattr(b.cfg, f)
        if va != vb:
            raise BadInputError(f"the checkpoints differ in {f}: {va!r} in {a.path.name}, {vb!r} in {b.path.name}")
    for name in a.order:
        if name not in b.shapes:
            raise BadInputError(f"tensor {name} of {a.path.name} is missing from {b.path.name}")
        if a.shapes[name] != b.shapes[name]:
            raise BadInputError(
                f"tensor {name} has shape {a.shapes[name]} in {a.path.name} and {b.shapes[name]} in {b.path.name}"
            )
    extra = [n for n in b.order if n not in a.shapes]
    if extra:
        raise BadInputError(f"tensor {extra[0]} of {b.path.name} is missing from {a.path.name}")
    same_vocabulary(a, b)


class InterpolatedModel:
    """A scorable (``engine`` + ``tokenizer``) whose weights are θ(α)."""

    def __init__(self, a: _Endpoint, b: _Endpoint, n_ctx: int, device: str | None = None, threads: int | None = None):
        self.a, self.b, self.tokenizer, self.cfg = a, b, a.tokenizer, a.cfg
        n_threads, adaptive = toy_ggml.runtime_threads(threads or None)
        self.runtime = toy_ggml.Runtime(toy_ggml.resolve_device(device), threads=n_threads, adaptive=adaptive)
        self._ctx = toy_ggml.Context(max_tensors=len(a.order) + 4)
        self.weights = {n: self._ctx.tensor(toy_ggml.GGMLType.F32, a.shapes[n], name=n) for n in a.order}
        self._ctx.allocate(self.runtime)
        self.engine = LLMEngine(a.cfg, self.weights, self.runtime, n_ctx)
        self.alpha: float | None = None

    def set_alpha(self, alpha: float) -> None:
        wa, wb = np.float32(1.0 - alpha), np.float32(alpha)
        for n in self.a.order:
            self.weights[n].set(wa * self.a.values[n] + wb * self.b.values[n])
        self.alpha = alpha

    def close(self) -> None:
        self.engine.close()
        self._ctx.close()
        self.runtime.close()


def lmc(
    path_a: str | os.PathLike[str],
    path_b: str | os.PathLike[str],
    text_or_ids: str | Sequence[int],
    alphas: Sequence[float] = DEFAULT_ALPHAS,
    *,
    context: int = 512,
    stride: int = 0,
    max_chunks: int | None = None,
    device: str | None = None,
    threads: int | None = None,
    progress: Callable[[int, int, float], None] | None = None,
) -> LMCResult:
    """The loss of θ(α) for each α on a text (tokenized as llama-perplexity
    does, with A's tokenizer) or token ids. ``progress(done, total, ppl)``
    counts windows over all alphas."""
    if not alphas:
        raise BadInputError("no alphas given")
    a, b = _Endpoint(Path(path_a)), _Endpoint(Path(path_b))
    check_compatible(a, b)
    if a.cfg.context_length and context > a.cfg.context_length:
        raise BadInputError(f"context={context} exceeds the checkpoints' context length {a.cfg.context_length}")
    model = InterpolatedModel(a, b, context, device, threads)
    try:
        ids = text_ids(model, text_or_ids) if isinstance(text_or_ids, str) else list(text_or_ids)
        points: list[LMCPoint] = []
        res: PerplexityResult | None = None
        for k, alpha in enumerate(alphas):
            model.set_alpha(float(alpha))

            def step(done: int, total: int, ppl: float, k: int = k) -> None:
                if progress is not None:
                    progress(k * total + done, len(alphas) * total, ppl)

            res = perplexity(model, ids, context=context, stride=stride, max_chunks=max_chunks, progress=step)
            points.append(LMCPoint(float(alpha), res.nll, res.ppl, res.nll_stderr))
    finally:
        model.close()
    return LMCResult(points, context, res.n_scored if res else 0, barrier(points))


def barrier(points: Sequence[LMCPoint]) -> float | None:
    ends = {p.alpha: p.nll for p in points}
    if 0.0 not in ends or 1.0 not in ends:
        return None
    inner = [p.nll - ((1 - p.alpha) * ends[0.0] + p.alpha * ends[1.0]) for p in points if 0.0 < p.alpha < 1.0]
    return max(inner) if inner else None


__all__ = [
    "DEFAULT_ALPHAS",
    "InterpolatedModel",
    "LMCPoint",
    "LMCResult",
    "barrier",
    "check_compatible",
    "lmc",
    "parse_alphas",
]
