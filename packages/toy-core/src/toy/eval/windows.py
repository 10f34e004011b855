"""The scoring windows of perplexity-style evaluation, and the float64
log-softmax every figure of ``toy.eval`` is computed from.

A *window* is ``context`` consecutive tokens of the evaluated text, run as a
fresh sequence (empty KV cache); only some of its positions are *scored*
(their next-token negative log-likelihood counts). Two layouts, both the
ones llama.cpp's ``llama-perplexity`` uses, so figures are comparable:

- ``stride == 0`` (the default, llama-perplexity without ``--ppl-stride``):
  windows tile the text without overlap, ``n = len(ids) // context`` of them
  (a tail shorter than a window is not scored). The first token of each
  window is replaced by BOS when the model's tokenizer adds BOS. Positions
  ``context // 2 … context - 2`` are scored: each predicts the next token of
  the window, so every scored token has at least ``context // 2`` tokens of
  context: ``context - 1 - context // 2`` scored tokens per window.
- ``stride > 0`` (llama-perplexity's ``--ppl-stride``): windows start every
  ``stride`` tokens, ``ceil((len(ids) - context) / stride)`` of them; the
  last ``stride`` positions of each window that have a next token are
  scored (positions ``context - stride - 1 … context - 2``). No BOS is put
  in: llama-perplexity writes its BOS into the token list only after the
  window was evaluated, so its figures are those of the unmodified windows,
  and toy reproduces what it computes.

Invariants: ``Window.ids`` are the tokens run (BOS already substituted);
``Window.rows`` the window positions whose logits are scored, and
``Window.targets`` the token each of them must predict (taken from the
original text, never the substituted BOS).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np

from toy.errors import BadInputError


@dataclass(frozen=True)
class Window:
    index: int
    start: int  # offset of the window's first token in the text
    ids: np.ndarray  # (context,) int32, what the model runs
    rows: np.ndarray  # (k,) int64, scored positions inside the window
    targets: np.ndarray  # (k,) int64, the next token of each scored position


def count_windows(n_tokens: int, context: int, stride: int = 0) -> int:
    """How many windows a text of ``n_tokens`` gives (see the module docstring)."""
    if stride <= 0:
        return n_tokens // context
    if n_tokens <= context:
        return 0
    return (n_tokens - context + stride - 1) // stride


def tokens_needed(context: int, stride: int = 0, max_chunks: int | None = None) -> int | None:
    """The fewest tokens of text that give ``max_chunks`` windows (None: no bound, every window)."""
    if max_chunks is None or max_chunks < 1:
        return None
    if stride <= 0:
        return max_chunks * context
    return context + (max_chunks - 1) * stride + 1


def check_layout(n_tokens: int, context: int, stride: int = 0, max_chunks: int | None = None) -> int:
    """Validate the layout; returns the number of windows that will be scored."""
    if context < 4:
        raise BadInputError(f"context={context} must be at least 4 tokens")
    if stride < 0:
        raise BadInputError(f"stride={stride} must be >= 0 (0: llama-perplexity's non-overlapping windows)")
    if stride > 0 and stride >= context:
        raise BadInputError(f"stride={stride} must be smaller than the context ({context})")
    if max_chunks is not None and max_chunks < 1:
        raise BadInputError(f"max_chunks={max_chunks} must be >= 1")
    n = count_windows(n_tokens, context, stride)
    if n == 0:
        need = context if stride <= 0 else context + 1
        raise BadInputError(
            f"the text has {n_tokens} tokens; one window of context {context} needs at least {need}",
            hint="use a longer text or a smaller --context",
        )
    return min(n, max_chunks) if max_chunks is not None else n


def windows(
    ids: Sequence[int] | np.ndarray,
    context: int,
    *,
    stride: int = 0,
    bos_id: int | None = None,
    max_chunks: int | None = None,
) -> Iterator[Window]:
    """The scored windows of ``ids`` in order (``bos_id``: the BOS to put
    first in each non-overlapping window, None when the model adds none)."""
    ids = np.asarray(ids, dtype=np.int64).reshape(-1)
    n = check_layout(len(ids), context, stride, max_chunks)
    if stride <= 0:
        first = context // 2
        rows = np.arange(first, context - 1, dtype=np.int64)
    else:
        rows = np.arange(context - stride - 1, context - 1, dtype=np.int64)
    for i in range(n):
        start = i * (stride if stride > 0 else context)
        w = ids[start : start + context].astype(np.int32)
        targets = ids[start + rows + 1]
        if stride <= 0 and bos_id is not None:
            w = w.copy()
            w[0] = bos_id
        yield Window(i, start, w, rows, targets)


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """Row-wise log-softmax in float64 of float32 logits (..., V)."""
    x = np.asarray(logits, dtype=np.float64)
    m = x.max(axis=-1, keepdims=True)
    z = x - m
    out: np.ndarray = z - np.log(np.exp(z).sum(axis=-1, keepdims=True))
    return out


def target_nll(logits: np.ndarray, targets: np.ndarray) -> np.ndarray:
    """Negative log-likelihood (k,) float64 of ``targets`` (k,) under logits (k, V)."""
    lp = log_softmax(logits)
    nll: np.ndarray = -lp[np.arange(len(targets)), targets]
    return nll


@dataclass
class NLLStats:
    """Running sums for a mean NLL and its standard error, the way
    llama-perplexity reports ``PPL = exp(mean) +/- stderr``: the standard
    error of the mean NLL, ``sqrt(var / (count - 1))``, times the PPL."""

    total: float = 0.0
    total_sq: float = 0.0
    count: int = 0

    def add(self, nll: np.ndarray) -> None:
        nll = np.asarray(nll, dtype=np.float64)
        self.total += float(nll.sum())
        self.total_sq += float((nll * nll).sum())
        self.count += int(nll.size)

    @property
    def mean(self) -> float:
        return self.total / self.count if self.count else float("nan")

    @property
    def ppl(self) -> float:
        return float(np.exp(self.mean)) if self.count else float("nan")

    @property
    def mean_stderr(self) -> float:
        """Standard error of the mean NLL (nats)."""
        if self.count < 2:
            return float("nan")
        var = self.total_sq / self.count - self.mean**2
        return float(np.sqrt(var / (self.count - 1))) if var > 0 else 0.0

    @property
    def ppl_stderr(self) -> float:
        return self.mean_stderr * self.ppl


__all__ = [
    "NLLStats",
    "Window",
    "check_layout",
    "count_windows",
    "log_softmax",
    "target_nll",
    "tokens_needed",
    "windows",
]
