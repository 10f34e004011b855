"""Token sampling: turn one step's logits into the next token id.

``SamplingParams`` holds the user's knobs; ``Sampler`` applies them step by
step with its own seeded generator. The building blocks (``apply_penalties``,
``top_k_filter``, ``top_p_filter``, ``min_p_filter``, ``log_softmax``,
``top_logprobs``) are pure vectorized functions on a 1-D logits vector (V,).

Invariants:

- The pure functions never mutate their input and never loop in Python over
  the vocabulary; a filtered-out entry is ``-inf`` in the returned copy, and
  every filter keeps at least one token (the most likely one).
- A sampled token always has a finite logit after every filter: the draw
  runs over the finite entries only, so a ``-inf`` entry has no interval in
  the CDF.
- Same params, same seed, same logits and history -> same tokens: a step
  with temperature > 0 consumes exactly one ``rng.random()``, a greedy step
  consumes none.

Decisions:

- Order of a step, as llama.cpp's default chain: logit bias -> constraint
  mask -> penalties -> top_k -> top_p -> min_p -> temperature (divide) ->
  draw. With temperature 0: logit bias, constraint mask, penalties, then
  argmax (the lowest id wins an exact tie, as ``np.argmax``); the filters
  cannot change an argmax, so they are skipped.
- ``constraint`` (a ``toy.engine.constrain.Constraint``: JSON, JSON schema,
  grammar or regex) masks the tokens that cannot continue a match; the
  ``Sampler`` then needs the model's tokenizer, and ``Sampler.done`` turns
  true once nothing can follow (see ``toy.engine.constrain``).
- ``logit_bias`` (OpenAI's): token id -> a bias in [-100, 100] added to that
  token's logit, as given (no scaling). -100 makes a token practically
  unreachable and +100 practically certain, without being absolute: a logit
  is a log-probability only up to a constant, and the bias moves it by that
  much. Ids outside the vocabulary raise (when the ``Sampler`` is made).
- Defaults follow llama.cpp (temperature 0.8, top_k 40, top_p 0.95, min_p
  0.05, penalties off, window 64).
- Ties are broken by the lower id everywhere (top_k at its boundary, top_p's
  ordering, ``top_logprobs``), so results do not depend on sort internals.
- top_p and min_p compare probabilities with a slack of 1e-6: probabilities
  computed from float32 logits carry ~1e-7 relative error, and without slack
  ``top_p=0.8`` on probabilities [0.5, 0.3, ...] would keep a third token or
  not depending on rounding.
- A history id outside [0, V) raises ``ToyError``: ignoring it would hide a
  tokenizer/model vocabulary mismatch.
- Logprobs are reported from the model's own distribution, the log_softmax
  of the RAW logits (before penalties, filters and temperature), which is
  what OpenAI's API and evaluation harnesses expect.
- ``SamplingParams()`` does not validate on construction (so a caller can
  build, inspect, then ``validate()``); ``replace``, ``greedy`` and
  ``Sampler`` always validate.
"""

from __future__ import annotations

import dataclasses
import math
import secrets
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from numbers import Integral, Real

import numpy as np

from toy.engine.constrain import Constraint, Matcher
from toy.errors import BadInputError


class SamplingError(BadInputError):
    """A sampling option out of range, or logits/history that cannot be
    sampled (bad input: the CLI exits 2, the server answers 400)."""


MAX_LOGPROBS = 20
MAX_LOGIT_BIAS = 1024  # entries; OpenAI's own limit is lower
LOGIT_BIAS_RANGE = 100.0
MAX_STOP_STRINGS = 16
_SEED_LIMIT = 2**63
_PROB_SLACK = 1e-6  # see the module docstring: float32 logits cannot resolve probabilities finer than this


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens, and when to stop. See the module docstring for the order of the samplers."""

    temperature: float = 0.8  # 0 -> greedy
    top_k: int = 40  # 0 -> off
    top_p: float = 0.95  # 1.0 -> off
    min_p: float = 0.05  # 0 -> off
    repeat_penalty: float = 1.0  # 1.0 -> off; llama.cpp style (divide positive logits, multiply negative ones)
    frequency_penalty: float = 0.0  # OpenAI style: logit -= count * frequency_penalty
    presence_penalty: float = 0.0  # logit -= presence_penalty if count > 0
    penalty_last_n: int = 64  # window the penalties look at; 0 -> penalties off; -1 -> whole context
    seed: int | None = None  # None -> a fresh seed, recorded by the Sampler in .seed
    max_tokens: int = 256
    stop: tuple[str, ...] = ()  # stop strings, not included in the output
    stop_tokens: tuple[int, ...] = ()  # extra stop ids; the engine adds the model's end-of-generation ids
    ignore_eos: bool = False  # keep generating past end-of-generation tokens
    logprobs: int | None = None  # None -> none; n -> the chosen token's logprob plus n top alternatives
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias in [-100, 100]); a dict is accepted
    constraint: Constraint | None = None  # JSON / JSON schema / grammar / regex the output must match

    def __post_init__(self) -> None:
        # Lists (JSON, CLI) and a bare string are accepted for convenience; the frozen dataclass keeps tuples
        # so params stay hashable. Anything else is left as is for validate() to reject with a clear message.
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        elif isinstance(self.stop, list):
            object.__setattr__(self, "stop", tuple(self.stop))
        if isinstance(self.stop_tokens, (list, np.ndarray)):
            object.__setattr__(self, "stop_tokens", tuple(self.stop_tokens))
        if isinstance(self.stop_tokens, tuple):
            # NumPy integers become plain ints so equality, hashing and JSON behave.
            tokens = tuple(
                int(t) if isinstance(t, Integral) and not isinstance(t, bool) else t for t in self.stop_tokens
            )
            object.__setattr__(self, "stop_tokens", tokens)
        bias = self.logit_bias
        if isinstance(bias, dict):
            bias = list(bias.items())
        if isinstance(bias, (list, tuple)) and all(isinstance(e, (list, tuple)) and len(e) == 2 for e in bias):
            # NumPy numbers and decimal strings (JSON keys) become plain ints and floats; ids sorted, so equal
            # biases give equal (hashable) params. Anything else is left for validate() to name.
            def tid(t):
                if isinstance(t, str) and t.isascii() and t.isdigit():
                    return int(t)
                return int(t) if isinstance(t, Integral) and not isinstance(t, bool) else t

            pairs = [(tid(t), float(b) if isinstance(b, Real) and not isinstance(b, bool) else b) for t, b in bias]
            if all(isinstance(t, int) for t, _ in pairs):
                pairs.sort(key=lambda e: e[0])
            object.__setattr__(self, "logit_bias", tuple(pairs))

    def validate(self) -> SamplingParams:
        """Raise ``SamplingError`` naming the first out-of-range field (in its message and as its
        ``field``, the parameter's name here); return ``self`` so calls chain."""
        _check_real("temperature", self.temperature, lambda v: v >= 0, ">= 0")
        _check_int("top_k", self.top_k, lambda v: v >= 0, ">= 0")
        _check_real("top_p", self.top_p, lambda v: 0 < v <= 1, "in (0, 1]")
        _check_real("min_p", self.min_p, lambda v: 0 <= v <= 1, "in [0, 1]")
        _check_real("repeat_penalty", self.repeat_penalty, lambda v: v > 0, "> 0")
        _check_real("frequency_penalty", self.frequency_penalty, lambda v: -2 <= v <= 2, "in [-2, 2]")
        _check_real("presence_penalty", self.presence_penalty, lambda v: -2 <= v <= 2, "in [-2, 2]")
        _check_int("penalty_last_n", self.penalty_last_n, lambda v: v >= -1, ">= -1 (-1 means the whole context)")
        if self.seed is not None:
            _check_int("seed", self.seed, lambda v: 0 <= v < _SEED_LIMIT, "None or in [0, 2**63)")
        _check_int("max_tokens", self.max_tokens, lambda v: v >= 0, ">= 0")
        if self.logprobs is not None:
            _check_int("logprobs", self.logprobs, lambda v: 0 <= v <= MAX_LOGPROBS, f"None or in [0, {MAX_LOGPROBS}]")
        if not isinstance(self.stop, tuple) or not all(isinstance(s, str) for s in self.stop):
            raise SamplingError(f"stop={self.stop!r} must be a string or a list of strings", field="stop")
        if len(self.stop) > MAX_STOP_STRINGS:
            msg = f"stop has {len(self.stop)} strings; at most {MAX_STOP_STRINGS} are allowed"
            raise SamplingError(msg, field="stop")
        if any(s == "" for s in self.stop):
            msg = f"stop={self.stop!r} contains an empty string"
            raise SamplingError(msg, hint="an empty stop would end at once", field="stop")
        if not isinstance(self.stop_tokens, tuple) or not all(
            isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in self.stop_tokens
        ):
            msg = f"stop_tokens={self.stop_tokens!r} must be a list of token ids >= 0"
            raise SamplingError(msg, field="stop_tokens")
        if not isinstance(self.ignore_eos, bool):
            raise SamplingError(f"ignore_eos={self.ignore_eos!r} must be true or false", field="ignore_eos")
        self._check_logit_bias()
        if self.constraint is not None:
            if not isinstance(self.constraint, Constraint):
                msg = f"constraint={self.constraint!r} must be a toy.engine.constrain.Constraint"
                raise SamplingError(msg, field="constraint")
            self.constraint.validate()
        return self

    def _check_logit_bias(self) -> None:
        bias = self.logit_bias
        if not isinstance(bias, tuple) or not all(isinstance(e, tuple) and len(e) == 2 for e in bias):
            raise SamplingError(f"logit_bias={bias!r} must map token ids to numbers", field="logit_bias")
        if len(bias) > MAX_LOGIT_BIAS:
            msg = f"logit_bias has {len(bias)} entries; at most {MAX_LOGIT_BIAS} are allowed"
            raise SamplingError(msg, field="logit_bias")
        for t, b in bias:
            if isinstance(t, bool) or not isinstance(t, int) or t < 0:
                raise SamplingError(f"logit_bias has token id {t!r}; ids are integers >= 0", field="logit_bias")
            if isinstance(b, bool) or not isinstance(b, float) or not -LOGIT_BIAS_RANGE <= b <= LOGIT_BIAS_RANGE:
                raise SamplingError(
                    f"logit_bias has bias {b!r} for token {t}; a bias is a number in "
                    f"[-{LOGIT_BIAS_RANGE:g}, {LOGIT_BIAS_RANGE:g}]",
                    field="logit_bias",
                )
        ids = [t for t, _ in bias]
        if len(set(ids)) != len(ids):
            raise SamplingError("logit_bias has a token id twice", field="logit_bias")

    @classmethod
    def greedy(cls, **kw) -> SamplingParams:
        """Deterministic decoding: temperature 0 and the filters off; other fields from ``kw``."""
        if "temperature" in kw:
            msg = f"greedy() sets temperature=0; got temperature={kw['temperature']!r}"
            raise SamplingError(msg, field="temperature")
        _check_fields(kw)
        base = {"temperature": 0.0, "top_k": 0, "top_p": 1.0, "min_p": 0.0}
        return cls(**{**base, **kw}).validate()

    def replace(self, **kw) -> SamplingParams:
        """A copy with ``kw`` changed, validated."""
        _check_fields(kw)
        return dataclasses.replace(self, **kw).validate()

    def stop_token_ids(self, eog_ids: Iterable[int]) -> frozenset[int]:
        """The ids that end generation: ``stop_tokens`` plus the model's end-of-generation ids, unless
        ``ignore_eos`` (then those are ordinary tokens and only ``stop_tokens`` stop) without a constraint."""
        ids = set(self.stop_tokens)
        if not self.ignore_eos or self.constraint is not None:  # a constraint ends at the grammar's end
            ids.update(int(t) for t in eog_ids)
        return frozenset(ids)


@dataclass(frozen=True)
class TokenLogprob:
    """A chosen token's log-probability and the ``top`` most likely (id, logprob) pairs of its step."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...]


def _check_fields(kw: dict) -> None:
    known = {f.name for f in dataclasses.fields(SamplingParams)}
    unknown = sorted(set(kw) - known)
    if unknown:
        hint = f"known: {', '.join(sorted(known))}"
        raise SamplingError(f"unknown sampling parameter {unknown[0]!r}", hint=hint, field=unknown[0])


def _check_real(name: str, value: object, ok, rule: str) -> None:
    # `ok` states the allowed range positively, so NaN (every comparison false) fails it.
    if isinstance(value, bool) or not isinstance(value, Real):
        raise SamplingError(f"{name}={value!r} must be a number", field=name)
    if not math.isfinite(value):
        raise SamplingError(f"{name}={value!r} must be finite and {rule}", field=name)
    if not ok(value):
        raise SamplingError(f"{name}={value!r} must be {rule}", field=name)


def _check_int(name: str, value: object, ok, rule: str) -> None:
    if isinstance(value, bool) or not isinstance(value, Integral):
        raise SamplingError(f"{name}={value!r} must be an integer", field=name)
    if not ok(value):
        raise SamplingError(f"{name}={value!r} must be {rule}", field=name)


def _as_logits(logits) -> np.ndarray:
    """A float copy of ``logits`` (float dtypes kept, anything else float32), checked to be 1-D and non-empty."""
    a = np.asarray(logits)
    if a.ndim != 1 or a.size == 0:
        raise SamplingError(f"logits shape {a.shape} must be 1-D and non-empty")
    return a.astype(a.dtype if a.dtype.kind == "f" else np.float32, copy=True)


def _top_indices(values: np.ndarray, n: int) -> np.ndarray:
    """Ids of the ``n`` largest ``values``, descending, ties by lower id. O(V) plus a sort of the few candidates."""
    n = min(n, values.size)
    if n <= 0:
        return np.empty(0, dtype=np.int64)
    threshold = np.partition(values, values.size - n)[values.size - n]
    candidates = np.flatnonzero(values >= threshold)  # ascending ids, so a stable sort breaks ties by lower id
    order = np.argsort(-values[candidates], kind="stable")
    return candidates[order[:n]].astype(np.int64)


def apply_penalties(
    logits,
    history,
    repeat_penalty: float,
    frequency_penalty: float,
    presence_penalty: float,
    last_n: int,
) -> np.ndarray:
    """Penalize tokens seen in the last ``last_n`` ids of ``history`` (0 -> none, -1 -> all).

    For a token seen ``count`` > 0 times: repeat (llama.cpp) ``logit/p`` if logit > 0 else ``logit*p``, then
    ``- count*frequency_penalty - presence_penalty``. ``-inf`` stays ``-inf``. Ids outside [0, V) raise.
    """
    x = _as_logits(logits)
    off = repeat_penalty == 1.0 and frequency_penalty == 0.0 and presence_penalty == 0.0
    if last_n == 0 or off:
        return x
    if last_n > 0:
        history = history[-last_n:]  # slice before converting: the context may be long, the window is not
    window = np.asarray(history, dtype=np.int64).reshape(-1)
    if window.size == 0:
        return x
    lo, hi = int(window.min()), int(window.max())
    if lo < 0 or hi >= x.size:
        bad = lo if lo < 0 else hi
        raise SamplingError(
            f"history token id {bad} is outside the vocabulary [0, {x.size})",
            hint="tokenizer and model vocabularies differ?",
            field="history",
        )
    counts = np.bincount(window, minlength=x.size)
    # Work on the seen ids only (at most last_n of them), not on all V logits: this runs every step.
    ids = np.flatnonzero(counts)
    v = x[ids].astype(np.float64)
    if repeat_penalty != 1.0:
        v = np.where(v > 0, v / repeat_penalty, v * repeat_penalty)
    v -= counts[ids] * frequency_penalty + presence_penalty
    # an extreme penalty (say 1e-300) must not push a logit to +-inf: inf - inf is NaN downstream
    lim = float(np.finfo(np.float32).max) / 4
    x[ids] = np.where(np.isneginf(x[ids]), -np.inf, np.clip(v, -lim, lim))  # a filtered (-inf) entry stays out
    return x


def top_k_filter(logits, k: int) -> np.ndarray:
    """Keep exactly the ``k`` highest logits (ties at the boundary: lower ids); ``k <= 0`` or ``k >= V`` -> off."""
    x = _as_logits(logits)
    if k <= 0 or k >= x.size:
        return x
    keep = _top_indices(x, k)
    out = np.full_like(x, -np.inf)
    out[keep] = x[keep]
    return out


def top_p_filter(logits, p: float) -> np.ndarray:
    """Keep the smallest set of most likely tokens whose probability sums to >= ``p`` (at least one); ``p >= 1`` -> off."""
    x = _as_logits(logits)
    if p >= 1.0:
        return x
    candidates = np.flatnonzero(x > -np.inf)  # after top_k this is k ids
    if candidates.size == 0:
        return x
    lx = x[candidates].astype(np.float64)
    probs = np.exp(lx - lx.max())
    probs /= probs.sum()
    # Sorting a whole vocabulary (top_k off) costs milliseconds, and the kept set is usually small: sort only
    # the m most likely candidates, growing m until their mass reaches p.
    m = 64
    while True:
        order = _top_indices(lx, m)  # descending, ties by lower id
        cumulative = np.cumsum(probs[order])
        if cumulative[-1] >= p - _PROB_SLACK or order.size == candidates.size:
            break
        m *= 8
    n_keep = min(int(np.searchsorted(cumulative, p - _PROB_SLACK, side="left")) + 1, order.size)
    keep = candidates[order[:n_keep]]
    out = np.full_like(x, -np.inf)
    out[keep] = x[keep]
    return out


def min_p_filter(logits, p: float) -> np.ndarray:
    """Keep tokens whose probability is >= ``p`` times the top probability; ``p <= 0`` -> off."""
    x = _as_logits(logits)
    if p <= 0.0:
        return x
    top = x.max()
    if not np.isfinite(top):
        return x
    # prob / top prob = exp(logit - max) >= p, compared in logit space (no exp over the vocabulary) and on
    # the finite entries only: after top_k that is k ids instead of V.
    floor = p - _PROB_SLACK
    if floor <= 0.0:
        return x
    candidates = np.flatnonzero(x > -np.inf)
    lx = x[candidates].astype(np.float64)
    drop = (lx - float(top) < math.log(floor)) & (lx != top)  # the top always survives, even for p > 1
    x[candidates[drop]] = -np.inf
    return x


def log_softmax(logits) -> np.ndarray:
    """Stable float64 log-probabilities; ``-inf`` entries get ``-inf``. Raises unless the max logit is finite."""
    x = np.asarray(logits, dtype=np.float64)
    if x.ndim != 1 or x.size == 0:
        raise SamplingError(f"logits shape {x.shape} must be 1-D and non-empty")
    top = x.max()  # NaN anywhere makes this NaN, +inf makes it +inf: one check covers both
    if not np.isfinite(top):
        raise SamplingError(
            f"logits max={top} must be finite", hint="the model produced NaN/inf, or every token is masked"
        )
    shifted = x - top
    return shifted - np.log(np.sum(np.exp(shifted)))


def _top_of(logprobs: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray]:
    ids = _top_indices(logprobs, n)
    return ids, logprobs[ids]


def top_logprobs(logits, n: int) -> tuple[np.ndarray, np.ndarray]:
    """The ``n`` most likely ids (descending, ties by lower id; at most V) and their log_softmax values."""
    if n < 0:
        raise SamplingError(f"n={n} must be >= 0", field="n")
    return _top_of(log_softmax(logits), n)


class Sampler:
    """Applies ``params`` to one sequence's logits, step after step, with a generator seeded from
    ``params.seed`` (or a fresh seed, kept in ``.seed`` so the run can be repeated). ``tokenizer``
    (the model's ``toy.tokenizer.Tokenizer``) is needed for ``params.constraint`` only."""

    # n_vocab: int | Integral, as mypy does not know int is a numbers.Integral (the check below would be unreachable)
    def __init__(self, params: SamplingParams, n_vocab: int | Integral, tokenizer=None):
        self.params = params.validate()
        if isinstance(n_vocab, bool) or not isinstance(n_vocab, Integral) or n_vocab <= 0:
            raise SamplingError(f"n_vocab={n_vocab!r} must be a positive integer", field="n_vocab")
        self.n_vocab = int(n_vocab)
        too_big = [t for t in params.stop_tokens if t >= self.n_vocab]
        if too_big:
            msg = f"stop_tokens id {too_big[0]} is outside the vocabulary [0, {self.n_vocab})"
            raise SamplingError(msg, field="stop_tokens")
        outside = [t for t, _ in params.logit_bias if t >= self.n_vocab]
        if outside:
            msg = f"logit_bias has token id {outside[0]}, outside the vocabulary [0, {self.n_vocab})"
            raise SamplingError(msg, field="logit_bias")
        self._bias_ids = np.array([t for t, _ in params.logit_bias], np.int64)
        self._bias = np.array([b for _, b in params.logit_bias], np.float64)
        self.matcher: Matcher | None = None
        if params.constraint is not None:
            if tokenizer is None:
                msg = "a constraint needs the model's tokenizer (Sampler(..., tokenizer=...))"
                raise SamplingError(msg, field="tokenizer")
            self.matcher = Matcher(params.constraint, tokenizer, self.n_vocab)
        # 63 bits so the recorded seed is itself a valid SamplingParams.seed.
        self.seed = int(params.seed) if params.seed is not None else secrets.randbits(63)
        self.rng = np.random.default_rng(self.seed)

    def _check(self, logits) -> np.ndarray:
        x = _as_logits(logits)
        if x.size != self.n_vocab:
            raise SamplingError(f"logits size {x.size} does not match n_vocab={self.n_vocab}")
        if not (x < np.inf).all():  # one pass: NaN fails the comparison too
            raise SamplingError("logits contain NaN or +inf", hint="the model's forward pass overflowed")
        return x

    def biased(self, logits) -> np.ndarray:
        """A checked copy of ``logits`` with ``params.logit_bias`` added (the first step of ``sample``)."""
        x = self._check(logits)
        if self._bias_ids.size:
            # added in float64 and stored back in the logits' dtype; -inf stays -inf
            x[self._bias_ids] = (x[self._bias_ids].astype(np.float64) + self._bias).astype(x.dtype)
        return x

    @property
    def done(self) -> bool:
        """True once the constraint is complete and nothing can follow (always False without one)."""
        return self.matcher is not None and self.matcher.done

    def sample(self, logits, history: Sequence[int] | np.ndarray) -> int:
        """The next token id. ``history`` is every token id of the context so far (prompt + generated).
        Under a constraint the token also advances the matcher."""
        p = self.params
        x = self.biased(logits)
        if self.matcher is not None:
            self.matcher.mask(x)
        x = apply_penalties(x, history, p.repeat_penalty, p.frequency_penalty, p.presence_penalty, p.penalty_last_n)
        if not x.max() > -np.inf:
            raise SamplingError("every token has logit -inf; nothing can be sampled")
        if p.temperature == 0:
            tok = int(np.argmax(x))
        else:
            x = top_k_filter(x, p.top_k)
            x = top_p_filter(x, p.top_p)
            x = min_p_filter(x, p.min_p)
            tok = self._draw(x, p.temperature)
        if self.matcher is not None:
            self.matcher.advance(tok)
        return tok

    def _draw(self, x: np.ndarray, temperature: float) -> int:
        # Only finite entries take part, so a filtered token cannot be drawn. Subtracting the max before
        # dividing keeps every scaled logit <= 0: a tiny temperature gives -inf (probability 0), never inf - inf.
        candidates = np.flatnonzero(x > -np.inf)
        scaled = (x[candidates].astype(np.float64) - float(x[candidates].max())) / temperature
        probs = np.exp(scaled)
        probs /= probs.sum()
        cdf = np.cumsum(probs)
        u = self.rng.random()
        # side="right": the first entry whose cdf exceeds u, so a zero-probability entry (flat cdf) is skipped.
        i = int(np.searchsorted(cdf, u, side="right"))
        if i >= candidates.size:  # cdf[-1] rounded below u: the last token with any probability
            i = int(np.flatnonzero(probs > 0)[-1])
        return int(candidates[i])

    def token_logprobs(self, logits, token: int) -> TokenLogprob | None:
        """``token``'s logprob and the top ``params.logprobs`` alternatives under the RAW logits, or None."""
        n = self.params.logprobs
        if n is None:
            return None
        if not 0 <= token < self.n_vocab:
            raise SamplingError(f"token={token} is outside the vocabulary [0, {self.n_vocab})", field="token")
        lp = log_softmax(self._check(logits))
        ids, values = _top_of(lp, n)
        top = tuple((int(i), float(v)) for i, v in zip(ids, values))
        return TokenLogprob(token=int(token), logprob=float(lp[token]), top=top)
