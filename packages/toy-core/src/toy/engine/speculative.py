"""Speculative decoding: propose a few tokens cheaply, check them with one target forward, keep the agreed ones.

One speculative step of a request whose last sampled token ``t`` is not in the cache yet:

1. a proposer drafts ``d_1 .. d_k`` (``NgramProposer``: prompt lookup; ``DraftProposer``: a second, smaller
   GGUF with the same vocabulary, greedy);
2. the target appends ``t, d_1 .. d_k`` to the request's slot in ONE forward (``LLMEngine.verify``) and returns
   k + 1 rows of logits: row i predicts the token after ``d_i`` (row 0 the one after ``t``);
3. ``accept`` feeds the rows one by one to the request's own ``DecodeState.advance`` (the one token step every
   driver uses: sampler with its seeded generator, penalties, constraint, stop tokens and strings, detokenizer)
   while the sampled token equals the draft: after row i samples ``s_i``, row i + 1 is used only if
   ``s_i == d_{i+1}``. The first mismatch's sampled token is the correction; when every draft matched, the last row
   gives one more token. The caller then truncates the slot to the tokens that were actually sampled
   (``cache.truncate``): the rejected drafts' cells lie past the length, masked, never read.

Why the output is exactly plain decoding's (not only its distribution). ``verify`` computes every row with
row-invariant products and per-sequence attention, so row i is bit for bit the logits ``decode`` gives after
the same prefix (tests/test_speculative.py checks it with ``np.array_equal``). A row is used only when its prefix
is the one plain decoding has at that point (every earlier draft equalled the token sampled there). The sampler
draws from its own seeded generator once per token, exactly as in plain decoding, and never sees the drafts. So
step by step the same logits meet the same sampler state: the tokens, logprobs, texts and finish are identical,
greedy or sampled, for every seed. In the usual terms: a proposal that is a point mass on ``d`` (prompt lookup and
a greedy draft are deterministic) accepts ``d`` with probability ``min(1, p(d) / q(d)) = p(d)`` and on rejection
samples from ``p`` with ``d`` removed, renormalised; "sample ``s`` from ``p``, accept iff ``s == d``, else keep
``s``" has exactly that law (P(accept) = p(d); given a rejection, ``s`` is distributed as ``p`` without ``d``),
and it consumes the generator the way plain sampling does, which is what makes it per-seed identical.

Cost, and when speculation turns itself off. On a CPU a verify row is not free: with row-invariant products each
row is summed as its own one-row product. Measured on the 2-core development machine (SmolLM2-135M Q4_1, 300
cached tokens), a verify of n rows costs about ``1 + 0.45 (n - 1)`` decode steps (``DEFAULT_ROW_COST``; n = 9:
about 4.2). A step that drafts k tokens and yields ``a + 1`` tokens (a accepted) beats plain decoding when
``a + 1 > c(1 + k) / c(1) + k · q`` (``q``: a draft token's cost in target steps, 0 for prompt lookup). The
``Controller`` of each request measures exactly that: over a window of ``WINDOW`` (8) verify steps that carried
drafts it sums the tokens produced and the predicted cost (``StepCosts``: the measured seconds of verify steps by
row count, a linear model where a count was not measured yet), and when the tokens fall short of the cost it
turns speculation off for the next ``COOLDOWN`` (64) tokens, then tries again with one draft token. The draft
length adapts too: after a step whose drafts were all accepted it doubles (up to ``k``), after a rejection it
becomes the accepted count + 1.

Limits: with flash attention on an engine without ``exact_batching``, ``decode`` uses the kernel ggml picks by
shape and ``verify`` the one-row kernel, which differ in the last bits, so ``check_engine`` refuses speculation
there (the server always runs ``exact_batching``). A draft model must have the target's vocabulary (the same
token strings, in order, and the same ``n_vocab``); its own slots are kept in sync with the request by prefix
(``cache.common_prefix``), so a rejected draft costs it nothing but the wasted steps.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from toy.engine.decoding import DecodeState, Step
from toy.errors import BadInputError

#: a verify row's cost in decode steps beyond the first (see the module docstring)
DEFAULT_ROW_COST = 0.45
#: verify steps (with drafts) per acceptance window
WINDOW = 8
#: tokens decoded plainly after a window that did not pay off, before speculation is tried again
COOLDOWN = 64
KINDS = ("none", "ngram", "draft")


@dataclass(frozen=True)
class SpecConfig:
    """What a request asks for: ``type`` none | ngram | draft, ``k`` the most draft tokens per step, ``n`` and
    ``n_min`` the longest and shortest n-gram prompt lookup matches (ngram only)."""

    type: str = "none"
    k: int = 8
    n: int = 3
    n_min: int = 1

    @property
    def on(self) -> bool:
        return self.type != "none"


DEFAULT_K = {"ngram": 8, "draft": 4, "none": 0}


def parse_speculative(value: Any, *, default_k: int | None = None) -> SpecConfig:
    """A ``SpecConfig`` from None, a kind name ("none", "ngram", "draft"), a mapping ``{"type", "k", "n",
    "n_min"}`` or a SpecConfig. ``default_k`` replaces the kind's default draft length. BadInputError
    (``field="speculative"``) for anything else."""
    if isinstance(value, SpecConfig):
        return value
    if value is None:
        return SpecConfig()
    if isinstance(value, str):
        value = {"type": value}
    if not isinstance(value, Mapping):
        raise BadInputError(
            f"speculative must be a kind name or a mapping, not {type(value).__name__}",
            hint='e.g. {"type": "ngram", "n": 3, "k": 8}',
            field="speculative",
        )
    extra = set(value) - {"type", "k", "n", "n_min", "model"}
    if extra:
        raise BadInputError(f"speculative: unknown field(s) {', '.join(sorted(extra))}", field="speculative")
    kind = value.get("type", "ngram")
    if kind not in KINDS:
        raise BadInputError(
            f"speculative type {kind!r} is not one of {', '.join(KINDS)}",
            hint="none, ngram or draft",
            field="speculative",
        )
    k = value.get("k")
    k = (default_k or DEFAULT_K[kind]) if k is None else k
    n, n_min = value.get("n", 3), value.get("n_min", 1)
    for name, v, lo, hi in (("k", k, 1, 64), ("n", n, 1, 16), ("n_min", n_min, 1, 16)):
        if kind == "none":
            break
        if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
            raise BadInputError(f"speculative {name}={v!r} must be an integer in {lo}..{hi}", field="speculative")
    if kind != "none" and n_min > n:
        raise BadInputError(f"speculative n_min={n_min} must be <= n={n}", field="speculative")
    return SpecConfig(kind, int(k) if kind != "none" else 0, int(n), int(n_min))


def check_engine(engine) -> None:
    """Refuse speculation where ``verify`` cannot match ``decode`` bit for bit (see the module docstring)."""
    if engine.flash_attn and not engine.exact_batching:
        raise BadInputError(
            "speculative decoding with flash attention needs exact batching",
            hint="load with exact_batching=True (the server always does), or without flash attention",
            field="speculative",
        )


def check_vocab(draft, target) -> None:
    """BadInputError naming the difference when ``draft`` (a ``toy.Model``) cannot draft for ``target``."""
    dv, tv = draft.tokenizer.vocab, target.tokenizer.vocab
    if draft.cfg.n_vocab != target.cfg.n_vocab or dv.tokens != tv.tokens:
        diff = next((i for i, (a, b) in enumerate(zip(dv.tokens, tv.tokens)) if a != b), None)
        where = f"token {diff} is {dv.tokens[diff]!r} vs {tv.tokens[diff]!r}" if diff is not None else "sizes differ"
        raise BadInputError(
            f"the draft model {draft.path.name} has another vocabulary than {target.path.name} "
            f"({draft.cfg.n_vocab} vs {target.cfg.n_vocab} tokens; {where})",
            hint="use a draft model of the same family (the same tokenizer), e.g. a quantized copy",
            field="draft_model",
        )


class NgramProposer:
    """Prompt lookup: the most recent earlier occurrence of the history's last n tokens (longest n first, from
    ``n`` down to ``n_min``), proposing the tokens that followed it, at most k."""

    kind = "ngram"
    cost = 0.0  # a draft token's cost in target decode steps

    def __init__(self, n: int = 3, n_min: int = 1):
        self.n, self.n_min = n, n_min

    def propose(self, history: Sequence[int], k: int) -> list[int]:
        h = np.asarray(history, np.int64)
        L = len(h)
        for n in range(min(self.n, L - 1), self.n_min - 1, -1):
            tail, m = h[L - n :], L - n  # windows starting at 0 .. m - 1: earlier, with a token after them
            hit = np.ones(m, bool)
            for j in range(n):
                hit &= h[j : j + m] == tail[j]
            idx = np.flatnonzero(hit)
            if len(idx):
                start = int(idx[-1]) + n
                return [int(t) for t in h[start : start + k]]
        return []

    def release(self) -> None:
        pass


class DraftProposer:
    """Greedy drafts of a second model (a ``toy.Model`` with the target's vocabulary) on its engine's ``slot``.
    The slot follows the request by prefix: each proposal keeps what the slot shares with the history, prefills
    the rest and decodes k - 1 more tokens. ``cost``: the measured seconds per draft token (an EMA)."""

    kind = "draft"

    def __init__(self, model, slot: int = 0):
        self.model, self.engine, self.slot = model, model.engine, slot
        self.seconds = 0.0  # EMA of the seconds per draft token
        self.cost = 0.0  # filled in by the controller: seconds relative to a target step

    def propose(self, history: Sequence[int], k: int) -> list[int]:
        t0 = time.perf_counter()
        eng, s = self.engine, self.slot
        keep = min(eng.cache.common_prefix(s, history), len(history) - 1)
        if keep + k > eng.n_ctx:
            return []
        eng.cache.truncate(s, keep)
        if eng.adapters:
            eng.slot_adapter[s] = None
        row = eng.prefill(s, list(history[keep:]))
        out = [int(np.argmax(row))]
        while len(out) < k:
            out.append(int(np.argmax(eng.decode([s], [out[-1]])[0])))
        dt = (time.perf_counter() - t0) / max(1, len(out))
        self.seconds = dt if not self.seconds else 0.8 * self.seconds + 0.2 * dt
        return out

    def release(self) -> None:
        self.engine.cache.truncate(self.slot, 0)


class StepCosts:
    """Measured seconds of forward steps by their row count (an EMA per count). ``predict(n)``: the measured
    value, else a line through the measured ones, else ``DEFAULT_ROW_COST`` relative to one row."""

    def __init__(self, alpha: float = 0.2):
        self.alpha = alpha
        self.ema: dict[int, float] = {}

    def record(self, rows: int, seconds: float) -> None:
        old = self.ema.get(rows)
        self.ema[rows] = seconds if old is None else (1 - self.alpha) * old + self.alpha * seconds

    def predict(self, rows: int) -> float | None:
        if rows in self.ema:
            return self.ema[rows]
        if not self.ema:
            return None
        xs = np.array(sorted(self.ema), float)
        ys = np.array([self.ema[int(x)] for x in xs])
        if len(xs) >= 2:
            b, a = np.polyfit(xs, ys, 1)
            if b > 0:
                return float(a + b * rows)
        x0, y0 = xs[0], ys[0]  # one count measured: scale by the default model
        return float(y0 * (1 + DEFAULT_ROW_COST * (rows - 1)) / (1 + DEFAULT_ROW_COST * (x0 - 1)))

    def ratio(self, rows: int, base: int = 1) -> float:
        """c(rows) / c(base), from the measurements or the default model."""
        a, b = self.predict(rows), self.predict(base)
        if a is None or b is None or b <= 0:
            return (1 + DEFAULT_ROW_COST * (rows - 1)) / (1 + DEFAULT_ROW_COST * (base - 1))
        return a / b


class Controller:
    """Per request: how many draft tokens to ask for now (``want``), and whether speculation pays off
    (``record`` after each verify step; see the module docstring for the rule)."""

    def __init__(self, k: int, costs: StepCosts, proposer):
        self.k_max, self.k = k, k
        self.costs, self.proposer = costs, proposer
        self.cooldown = 0
        self.win_steps = 0
        self.win_tokens = 0.0
        self.win_cost = 0.0
        self.drafted = 0  # totals for the timings
        self.accepted = 0
        self.off_windows = 0

    def want(self) -> int:
        return 0 if self.cooldown > 0 else self.k

    def record(self, drafted: int, produced: int) -> None:
        """One step: ``drafted`` tokens proposed (0: a plain step), ``produced`` tokens sampled."""
        if drafted == 0:
            self.cooldown = max(0, self.cooldown - produced)
            return
        accepted = min(produced, drafted + 1) - 1
        self.drafted += drafted
        self.accepted += accepted
        self.k = min(self.k_max, 2 * self.k) if accepted == drafted else max(1, accepted + 1)
        q = 0.0
        if self.proposer.kind == "draft":
            base = self.costs.predict(1)
            q = self.proposer.seconds / base if base else 1.0
        self.win_steps += 1
        self.win_tokens += produced
        self.win_cost += self.costs.ratio(1 + drafted) + drafted * q
        if self.win_steps >= WINDOW:
            if self.win_tokens < self.win_cost:
                self.cooldown, self.k = COOLDOWN, 1
                self.off_windows += 1
            self.win_steps, self.win_tokens, self.win_cost = 0, 0.0, 0.0


def make_proposer(cfg: SpecConfig, draft_model=None, slot: int = 0):
    if cfg.type == "ngram":
        return NgramProposer(cfg.n, cfg.n_min)
    if cfg.type == "draft":
        if draft_model is None:
            raise BadInputError(
                "speculative type 'draft' needs a draft model",
                hint="pass one (Model.generate(speculative={'type': 'draft', 'model': ...}), "
                "toy infer --draft-model, toy serve --draft-model)",
                field="speculative",
            )
        return DraftProposer(draft_model, slot)
    return None


def accept(state: DecodeState, rows: np.ndarray, draft: Sequence[int]) -> list[Step]:
    """Feed ``rows`` (len(draft) + 1 verify rows) to ``state`` while the sampled tokens equal the draft (see the
    module docstring). Returns the steps taken: every one but the last sampled its draft token; the cache keeps
    ``len(steps)`` of the verified tokens (the fed token and the accepted drafts)."""
    steps: list[Step] = []
    for i in range(len(draft) + 1):
        step = state.advance(rows[i])
        steps.append(step)
        if step.finish_reason is not None or step.token is None:
            break
        if i == len(draft) or step.token != draft[i]:
            break
    return steps


__all__ = [
    "COOLDOWN",
    "DEFAULT_ROW_COST",
    "WINDOW",
    "Controller",
    "DraftProposer",
    "NgramProposer",
    "SpecConfig",
    "StepCosts",
    "accept",
    "check_engine",
    "check_vocab",
    "make_proposer",
    "parse_speculative",
]
