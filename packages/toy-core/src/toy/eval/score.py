"""Per-token logprobs, perplexity and the comparison of two models.

Every function takes *scorables*: objects with ``engine`` (a
``toy.engine.llm.LLMEngine``) and ``tokenizer`` — what ``toy.load`` returns,
or ``toy.eval.lmc``'s interpolated model. Each window runs as a fresh
sequence in cache slot 0 (the slot is cleared before and after), through the
same prefill that generation uses: a window's logits are the ones
``toy infer`` would compute for that prompt, and on the same file they equal
llama.cpp's to float32 rounding (the perplexity test pins this).

Decisions:

- Text for ``perplexity`` and ``compare`` is tokenized the way
  llama-perplexity does: the file's BOS/EOS flags, control-token text such
  as ``<|im_start|>`` *not* parsed (it is scored as the text it is).
  ``logprobs`` tokenizes like a prompt (``Model.prompt_ids``: control tokens
  parsed), so its numbers equal what ``toy serve`` returns for
  ``echo=true, logprobs=k``.
- All figures are float64 from the float32 logits; NLLs are nats per token.
- ``compare`` measures KL(A ‖ B) = Σ p_A (log p_A − log p_B) at every scored
  position: how far B's next-token distribution strays from A's (A is the
  reference, e.g. the F32 model; B the quantization or merge). Computed on
  the full distributions (llama.cpp stores A's log-probabilities as 16-bit
  values first; toy does not). Top-1 agreement: both argmaxes equal.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from toy.errors import BadInputError
from toy.eval.windows import NLLStats, check_layout, log_softmax, target_nll, windows

if TYPE_CHECKING:
    from toy.engine.llm import LLMEngine
    from toy.tokenizer import Tokenizer

Progress = Callable[[int, int, float], None]  # (windows done, windows total, running ppl)


class HasTokenizer(Protocol):
    @property
    def tokenizer(self) -> Tokenizer: ...


class Scorable(HasTokenizer, Protocol):
    """What every function here scores (see the module doc)."""

    @property
    def engine(self) -> LLMEngine: ...


def window_logits(model: Scorable, ids: np.ndarray) -> np.ndarray:
    """Logits (T, V) float32 of ``ids`` run as a fresh sequence in slot 0."""
    engine = model.engine
    engine.cache.clear(0)
    try:
        return engine.prefill(0, ids, all_logits=True)
    finally:
        engine.cache.clear(0)


def text_ids(model: Scorable, text: str) -> list[int]:
    """``text`` as llama-perplexity tokenizes it (see the module docstring)."""
    return model.tokenizer.encode(text, add_special=None, special=False)


def _check_context(model: Scorable, context: int) -> None:
    if model.engine.n_ctx < context:
        raise BadInputError(
            f"context={context} exceeds the {model.engine.n_ctx} tokens the model was loaded with",
            hint=f"load it with n_ctx >= {context}",
        )


def _bos(model: Scorable, stride: int) -> int | None:
    tok = model.tokenizer
    return tok.bos_id if stride <= 0 and tok.add_bos and tok.bos_id is not None else None


# -- logprobs ------------------------------------------------------------------


@dataclass
class TokenScore:
    position: int
    id: int
    text: str
    logprob: float | None  # None for the first token: nothing predicts it
    rank: int | None  # 1 = the model's top choice
    top: list[tuple[int, str, float]] = field(default_factory=list)


@dataclass
class LogprobsResult:
    tokens: list[TokenScore]
    nll: float  # mean over the scored tokens (all but the first)
    ppl: float
    n_scored: int

    def to_dict(self) -> dict[str, Any]:
        return {
            "nll": self.nll,
            "ppl": self.ppl,
            "n_scored": self.n_scored,
            "tokens": [
                {**asdict(t), "top": [{"id": i, "text": s, "logprob": lp} for i, s, lp in t.top]} for t in self.tokens
            ],
        }


def logprobs(model: Scorable, prompt: str | Sequence[int], top_k: int = 5) -> LogprobsResult:
    """Per-token logprobs of ``prompt`` (text or token ids) in one window,
    each with its rank and the ``top_k`` most likely alternatives."""
    if top_k < 0:
        raise BadInputError(f"top_k={top_k} must be >= 0")
    ids = model.prompt_ids(prompt) if hasattr(model, "prompt_ids") else [int(i) for i in prompt]
    if len(ids) < 2:
        raise BadInputError(f"logprobs need at least 2 tokens, the text has {len(ids)}")
    if len(ids) > model.engine.n_ctx:
        raise BadInputError(
            f"{len(ids)} tokens exceed the model's {model.engine.n_ctx}-token context",
            hint="use `toy eval perplexity` for long texts",
        )
    lp = log_softmax(window_logits(model, np.asarray(ids, np.int32)))  # (T, V)
    tok = model.tokenizer
    out = [TokenScore(0, ids[0], tok.decode([ids[0]]), None, None)]
    k = min(top_k, lp.shape[1])
    for i in range(1, len(ids)):
        row = lp[i - 1]
        t = ids[i]
        rank = int((row > row[t]).sum()) + 1
        top = []
        if k:
            best = np.argpartition(-row, k - 1)[:k]
            best = best[np.argsort(-row[best], kind="stable")]
            top = [(int(j), tok.decode([int(j)]), float(row[j])) for j in best]
        out.append(TokenScore(i, t, tok.decode([t]), float(row[t]), rank, top))
    nll = -float(np.mean([s.logprob for s in out[1:]]))
    return LogprobsResult(out, nll, float(np.exp(nll)), len(ids) - 1)


# -- perplexity ----------------------------------------------------------------


@dataclass
class PerplexityResult:
    ppl: float
    ppl_stderr: float
    nll: float
    nll_stderr: float
    n_tokens: int  # tokens of the text
    n_scored: int
    n_windows: int
    context: int
    stride: int
    window_ppl: list[float]  # running PPL after each window (llama-perplexity's [i]x,… line)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def perplexity(
    model: Scorable,
    ids: Sequence[int] | np.ndarray,
    *,
    context: int = 512,
    stride: int = 0,
    max_chunks: int | None = None,
    progress: Progress | None = None,
) -> PerplexityResult:
    """Perplexity of token ids with llama-perplexity's windows (``toy.eval.windows``)."""
    _check_context(model, context)
    ids = np.asarray(ids, dtype=np.int64)
    stats, running = NLLStats(), []
    n = check_layout(len(ids), context, stride, max_chunks)  # windows are made one at a time, not all at once
    for w in windows(ids, context, stride=stride, bos_id=_bos(model, stride), max_chunks=max_chunks):
        logits = window_logits(model, w.ids)
        stats.add(target_nll(logits[w.rows], w.targets))
        running.append(stats.ppl)
        if progress is not None:
            progress(w.index + 1, n, stats.ppl)
    return PerplexityResult(
        stats.ppl,
        stats.ppl_stderr,
        stats.mean,
        stats.mean_stderr,
        len(ids),
        stats.count,
        n,
        context,
        stride,
        running,
    )


# -- compare -------------------------------------------------------------------


@dataclass
class CompareResult:
    n_scored: int
    n_windows: int
    context: int
    kl_mean: float
    kl_stderr: float
    kl_percentiles: dict[str, float]  # p50, p90, p95, p99, max
    top1_agreement: float  # fraction of scored positions whose argmax agree
    ppl_a: float
    ppl_b: float
    nll_a: float
    nll_b: float

    @property
    def ppl_ratio(self) -> float:
        return self.ppl_b / self.ppl_a

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "ppl_ratio": self.ppl_ratio}


def same_vocabulary(a: HasTokenizer, b: HasTokenizer) -> None:
    """Raise unless the two models' tokenizers have the same tokens."""
    ta, tb = a.tokenizer.vocab.tokens, b.tokenizer.vocab.tokens
    if len(ta) != len(tb):
        raise BadInputError(f"the models' vocabularies differ in size ({len(ta)} vs {len(tb)} tokens)")
    for i, (x, y) in enumerate(zip(ta, tb)):
        if x != y:
            raise BadInputError(f"the models' vocabularies differ at token {i} ({x!r} vs {y!r})")


def compare(
    model_a: Scorable,
    model_b: Scorable,
    ids: Sequence[int] | np.ndarray,
    *,
    context: int = 512,
    stride: int = 0,
    max_chunks: int | None = None,
    progress: Progress | None = None,
) -> CompareResult:
    """KL(A ‖ B), top-1 agreement and both perplexities over the windows of ``ids``."""
    same_vocabulary(model_a, model_b)
    _check_context(model_a, context)
    _check_context(model_b, context)
    ids = np.asarray(ids, dtype=np.int64)
    sa, sb = NLLStats(), NLLStats()
    kls: list[np.ndarray] = []
    same = 0
    n = check_layout(len(ids), context, stride, max_chunks)
    for w in windows(ids, context, stride=stride, bos_id=_bos(model_a, stride), max_chunks=max_chunks):
        la = log_softmax(window_logits(model_a, w.ids)[w.rows])
        lb = log_softmax(window_logits(model_b, w.ids)[w.rows])
        r = np.arange(len(w.rows))
        sa.add(-la[r, w.targets])
        sb.add(-lb[r, w.targets])
        kls.append(np.maximum((np.exp(la) * (la - lb)).sum(axis=1), 0.0))  # >= 0 up to rounding
        same += int((la.argmax(axis=1) == lb.argmax(axis=1)).sum())
        if progress is not None:
            progress(w.index + 1, n, sb.ppl)
    kl = np.concatenate(kls)
    kl_stderr = float(kl.std(ddof=1) / np.sqrt(len(kl))) if len(kl) > 1 else float("nan")
    pct = {f"p{q}": float(np.percentile(kl, q)) for q in (50, 90, 95, 99)}
    pct["max"] = float(kl.max())
    return CompareResult(
        len(kl), n, context, float(kl.mean()), kl_stderr, pct, same / len(kl), sa.ppl, sb.ppl, sa.mean, sb.mean
    )


__all__ = [
    "CompareResult",
    "LogprobsResult",
    "PerplexityResult",
    "TokenScore",
    "compare",
    "logprobs",
    "perplexity",
    "same_vocabulary",
    "text_ids",
    "window_logits",
]
