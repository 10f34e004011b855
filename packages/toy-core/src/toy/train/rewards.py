"""Reward functions for GRPO (``toy.train.grpo``): the contract, the
built-ins, user functions, and how several rewards add up.

The contract. A reward is a Python callable

    reward(completion: str, example: dict, *, prompt: str) -> float | None

- ``completion``: the generated text (the stop token and a stop string are
  not part of it);
- ``example``: the prompts file's JSON object for this prompt, every key
  kept (``"answer"``, ``"schema"``, anything a reward wants to read);
- ``prompt``: the prompt as the model saw it (the chat template applied);
- the result: a number (``bool`` counts as 0/1), or ``None``: "this reward
  does not apply to this example".

``None`` (decision: TRL's semantics, so a reward ported from TRL behaves
the same): a function's None adds nothing to the completion's reward (the
weighted sum skips it). A completion for which EVERY reward returned None
is unscorable: it is left out of its group's mean and standard deviation
and its advantage is 0 (it neither pulls nor pushes the policy). Rollout
records show None as ``null``.

Errors (decision: a reward never crashes a run). A reward that raises, or
returns something that is not a finite number or None (a string, NaN), is
counted as 0.0 for that completion; the run writes a ``reward_error`` event
(the reward, the prompts file and line of the example, the error text) and
the completion's record in ``rollouts.jsonl`` carries the same text under
``errors``. Problems that are certain before training (an unknown built-in,
a ``module:function`` that does not import, a schema file that does not
parse, examples without the ``"answer"`` the exact-answer reward compares
with) are ``BadInputError``/``DataError`` before the first step.

Built-ins (a config names them as ``NAME`` or ``NAME=ARG``):

- ``exact_answer[=REGEX]``: 1.0 when the completion's final answer equals
  the example's ``"answer"``, else 0.0. The final answer: with ``REGEX``,
  its last match (group 1 when the pattern has a group, else the whole
  match); without, the text after the last ``####`` (GSM8K's mark) up to
  the end of its line when the completion has one, else the last number in
  it. The expected answer is ``example["answer"]`` (a string holding
  ``####`` gives the part after the last one, as GSM8K's solutions do).
  Equality: both parse as decimal numbers (commas between digits, a leading
  ``$`` and a trailing ``.`` ignored) and are equal as numbers (``3.0`` ==
  ``3``), else the texts are equal after trimming and collapsing spaces.
  No answer found: 0.0.
- ``regex=PATTERN``: 1.0 when ``re.search(PATTERN, completion)`` finds a
  match, else 0.0 (anchor with ``^``/``$`` or ``\\A``/``\\Z`` for a whole
  match; flags inline, e.g. ``(?s)``).
- ``json[=SCHEMA]``: 1.0 when the completion (trimmed; one fenced
  ```` ```json ```` block is unwrapped) parses as JSON and, given a schema,
  validates against it; else 0.0. ``SCHEMA``: a JSON file's path or inline
  JSON text; without it, an example's own ``"schema"`` key when it has one,
  else any JSON value. Validation uses the ``jsonschema`` package (an
  optional dependency: a schema without it installed is a
  ``BadInputError`` before training, saying what to install).
- ``length=N``: a length penalty, 0.0 for a completion of at most N
  characters, else ``-(len - N) / N`` (characters: the contract's
  completion is text).

User functions: ``module:function`` (``my_rewards:has_units``), imported by
name with the current folder first on ``sys.path`` (as ``python -m``
does), the function checked to accept ``(completion, example, prompt=...)``.

Several rewards: each completion's reward is ``sum_i w_i r_i`` over the
rewards that did not return None (``reward_weights``, default all 1: TRL's
``reward_weights`` with its default "sum then normalize"). The run reports
each reward's mean and standard deviation (over the completions it applied
to) and the sum's.
"""

from __future__ import annotations

import importlib
import inspect
import json
import math
import os
import re
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from decimal import Decimal, InvalidOperation
from pathlib import Path
from typing import Any

import numpy as np

from toy.errors import BadInputError, DataError

RewardFn = Callable[..., Any]

#: the built-in rewards' names
BUILTINS = ("exact_answer", "regex", "json", "length")

_NUMBER = re.compile(r"-?\$?\d[\d,]*(?:\.\d+)?|-?\$?\.\d+")
_FENCE = re.compile(r"\A```(?:json)?[ \t]*\n(.*?)\n?```\Z", re.S)


# -- answers ----------------------------------------------------------------------


def extract_answer(text: str, pattern: re.Pattern | None = None) -> str | None:
    """The final answer in ``text`` (see ``exact_answer`` in the module
    docstring), or None when there is none."""
    if pattern is not None:
        matches = list(pattern.finditer(text))
        if not matches:
            return None
        last = matches[-1]
        if pattern.groups:
            return next((g for g in last.groups() if g is not None), None)
        return last.group(0)
    if "####" in text:
        return text.rsplit("####", 1)[1].split("\n", 1)[0].strip()
    numbers = _NUMBER.findall(text)
    return numbers[-1] if numbers else None


def expected_answer(value: Any) -> str:
    """The example's ``"answer"`` as the text to compare with (after GSM8K's
    ``####`` when it has one)."""
    if isinstance(value, bool):
        return str(value).lower()
    text = value if isinstance(value, str) else json.dumps(value) if isinstance(value, (list, dict)) else str(value)
    if "####" in text:
        text = text.rsplit("####", 1)[1].split("\n", 1)[0]
    return text.strip()


def _as_number(text: str) -> Decimal | None:
    t = text.strip().rstrip(".").strip()
    if t.startswith("-$"):
        t = "-" + t[2:]
    t = t.removeprefix("$")
    t = re.sub(r"(?<=\d),(?=\d)", "", t)
    if not re.fullmatch(r"[-+]?(\d+(\.\d*)?|\.\d+)([eE][-+]?\d+)?", t):
        return None
    try:
        return Decimal(t)
    except InvalidOperation:
        return None


def answers_equal(got: str, want: str) -> bool:
    """Equal as numbers when both are numbers, else equal as trimmed text."""
    a, b = _as_number(got), _as_number(want)
    if a is not None and b is not None:
        return a == b
    return " ".join(got.split()) == " ".join(want.split())


# -- built-ins --------------------------------------------------------------------


class _Builtin:
    """A built-in reward: a callable with the contract's signature and the
    example keys it needs (checked before training)."""

    needs: tuple[str, ...] = ()

    def __call__(self, completion: str, example: dict, *, prompt: str) -> float | None:
        raise NotImplementedError


class ExactAnswer(_Builtin):
    needs = ("answer",)

    def __init__(self, pattern: str | None = None):
        try:
            self.pattern = re.compile(pattern) if pattern else None
        except re.error as e:
            raise BadInputError(f"reward exact_answer={pattern}: not a regular expression: {e}") from None

    def __call__(self, completion: str, example: dict, *, prompt: str) -> float | None:
        got = extract_answer(completion, self.pattern)
        if got is None:
            return 0.0
        return 1.0 if answers_equal(got, expected_answer(example["answer"])) else 0.0


class RegexMatch(_Builtin):
    def __init__(self, pattern: str | None):
        if not pattern:
            raise BadInputError(
                "reward regex needs a pattern", hint="regex=PATTERN, e.g. regex='^<answer>.*</answer>$'"
            )
        try:
            self.pattern = re.compile(pattern)
        except re.error as e:
            raise BadInputError(f"reward regex={pattern}: not a regular expression: {e}") from None

    def __call__(self, completion: str, example: dict, *, prompt: str) -> float | None:
        return 1.0 if self.pattern.search(completion) else 0.0


def _validator(schema: Any, where: str):
    """A jsonschema validator of ``schema`` (BadInputError: jsonschema missing, or the schema invalid)."""
    try:
        import jsonschema  # type: ignore[import-untyped]  # optional: no stubs installed
    except ImportError:
        raise BadInputError(
            f"{where}: validating JSON against a schema needs the jsonschema package",
            hint="pip install jsonschema (or use the json reward without a schema)",
        ) from None
    cls = jsonschema.validators.validator_for(schema)
    try:
        cls.check_schema(schema)
    except jsonschema.exceptions.SchemaError as e:
        raise BadInputError(f"{where}: not a valid JSON schema: {e.message}") from None
    return cls(schema)


class JsonValid(_Builtin):
    def __init__(self, schema: str | None = None):
        self.validator = None
        self._by_schema: dict[str, Any] = {}
        if schema:
            text = schema
            if not schema.lstrip().startswith(("{", "[")) and schema.strip() not in ("true", "false"):
                p = Path(schema).expanduser()
                try:
                    text = p.read_text(encoding="utf-8")
                except OSError as e:
                    raise BadInputError(
                        f"reward json={schema}: cannot read the schema file: {e.strerror or e}"
                    ) from None
            try:
                parsed = json.loads(text)
            except json.JSONDecodeError as e:
                raise BadInputError(f"reward json={schema}: the schema is not JSON: {e}") from None
            self.validator = _validator(parsed, f"reward json={schema}")

    def check_example(self, example: Mapping[str, Any], where: str) -> None:
        if self.validator is None and "schema" in example:
            self._for(example["schema"], where)

    def _for(self, schema: Any, where: str):
        key = json.dumps(schema, sort_keys=True)
        if key not in self._by_schema:
            self._by_schema[key] = _validator(schema, where)
        return self._by_schema[key]

    def __call__(self, completion: str, example: dict, *, prompt: str) -> float | None:
        text = completion.strip()
        fenced = _FENCE.match(text)
        if fenced:
            text = fenced.group(1).strip()
        try:
            value = json.loads(text)
        except (json.JSONDecodeError, RecursionError):
            return 0.0
        validator = self.validator
        if validator is None and "schema" in example:
            validator = self._for(example["schema"], "the example's schema")
        if validator is None:
            return 1.0
        return 1.0 if validator.is_valid(value) else 0.0


class LengthPenalty(_Builtin):
    def __init__(self, limit: str | None):
        try:
            self.limit = int(limit) if limit is not None else 0
        except ValueError:
            self.limit = 0
        if self.limit < 1:
            raise BadInputError(f"reward length={limit}: N must be a whole number >= 1", hint="length=200")

    def __call__(self, completion: str, example: dict, *, prompt: str) -> float | None:
        over = len(completion) - self.limit
        return 0.0 if over <= 0 else -over / self.limit


_MAKERS: dict[str, Callable[[str | None], _Builtin]] = {
    "exact_answer": ExactAnswer,
    "regex": RegexMatch,
    "json": JsonValid,
    "length": LengthPenalty,
}


# -- user functions ---------------------------------------------------------------


def import_function(spec: str) -> RewardFn:
    """``module:function`` imported (the current folder first on the path),
    checked to be callable with the contract's arguments."""
    mod_name, _, fn_name = spec.partition(":")
    if not mod_name or not fn_name:
        raise BadInputError(f"reward {spec!r}: a user function is named module:function")
    cwd = os.getcwd()
    if cwd not in sys.path:
        sys.path.insert(0, cwd)
    try:
        module = importlib.import_module(mod_name)
    except Exception as e:  # noqa: BLE001 - any error while importing the user's module is the user's
        raise BadInputError(
            f"reward {spec}: cannot import module {mod_name!r}: {type(e).__name__}: {e}",
            hint="the module must be importable from the current folder or sys.path",
        ) from None
    fn: Any = module
    for part in fn_name.split("."):
        fn = getattr(fn, part, None)
        if fn is None:
            raise BadInputError(f"reward {spec}: module {mod_name!r} has no {fn_name!r}")
    if not callable(fn):
        raise BadInputError(f"reward {spec}: {fn_name!r} is not callable")
    try:
        inspect.signature(fn).bind("completion", {}, prompt="prompt")
    except TypeError as e:
        raise BadInputError(
            f"reward {spec}: cannot be called as f(completion, example, prompt=...): {e}",
            hint="def reward(completion: str, example: dict, *, prompt: str) -> float | None",
        ) from None
    except ValueError:
        pass  # no signature to inspect (a builtin or C function): tried at the first call
    return fn


# -- a set of rewards -------------------------------------------------------------


@dataclass
class Reward:
    """One configured reward: ``label`` (its name in metrics and records),
    the ``spec`` it was made from, its ``weight`` and the callable."""

    label: str
    spec: str
    weight: float
    fn: RewardFn


def parse(spec: str) -> tuple[str, RewardFn]:
    """(name, callable) of one reward spec: ``NAME``, ``NAME=ARG`` or ``module:function``."""
    text = str(spec).strip()
    name, eq, arg = text.partition("=")
    name = name.strip()
    if name in _MAKERS:
        return name, _MAKERS[name](arg if eq else None)
    if ":" in name and not eq:
        return name, import_function(name)
    raise BadInputError(
        f"reward {text!r}: not a built-in reward ({', '.join(BUILTINS)}) nor module:function",
        hint="--reward exact_answer, --reward regex=PATTERN, --reward json[=SCHEMA], --reward length=N, "
        "--reward my_module:my_function",
    )


@dataclass
class Scores:
    """The rewards of a batch of completions: ``per_reward`` (B, K) float64
    (NaN where a reward returned None), ``total`` (B,) float64 (the weighted
    sum over the non-None ones; NaN when every reward returned None), and
    ``errors``: one list per completion of {"reward", "error"}."""

    per_reward: np.ndarray
    total: np.ndarray
    errors: list[list[dict[str, str]]] = field(default_factory=list)


class RewardSet:
    """The configured rewards, in order, with their weights."""

    def __init__(self, specs: Sequence[str], weights: Sequence[float] | None = None):
        if not specs:
            raise BadInputError("GRPO needs at least one reward", hint="--reward exact_answer (or grpo.rewards)")
        if weights is not None and len(weights) != len(specs):
            raise BadInputError(f"{len(weights)} reward weights for {len(specs)} rewards", field="grpo.reward_weights")
        ws = [1.0] * len(specs) if weights is None else [float(w) for w in weights]
        if not all(math.isfinite(w) for w in ws):
            raise BadInputError("reward weights must be finite numbers", field="grpo.reward_weights")
        self.rewards: list[Reward] = []
        seen: dict[str, int] = {}
        for spec, w in zip(specs, ws, strict=True):
            name, fn = parse(spec)
            seen[name] = seen.get(name, 0) + 1
            label = name if seen[name] == 1 else f"{name}#{seen[name]}"
            self.rewards.append(Reward(label, str(spec), w, fn))

    @property
    def labels(self) -> list[str]:
        return [r.label for r in self.rewards]

    @property
    def weights(self) -> np.ndarray:
        return np.array([r.weight for r in self.rewards], np.float64)

    def check_examples(self, examples: Sequence[Mapping[str, Any]], where: Sequence[str]) -> None:
        """DataError (naming the file:line) for an example a built-in cannot
        score: a missing key it needs, a schema that does not compile."""
        for r in self.rewards:
            needs = getattr(r.fn, "needs", ())
            check = getattr(r.fn, "check_example", None)
            for ex, w in zip(examples, where, strict=True):
                missing = [k for k in needs if k not in ex]
                if missing:
                    raise DataError(
                        f"{w}: the {r.label} reward needs the example's {missing[0]!r}, which this line lacks",
                        hint=f'give every prompt line an "{missing[0]}" key (or drop the {r.label} reward)',
                    )
                if check is not None:
                    try:
                        check(ex, w)
                    except BadInputError as e:
                        raise DataError(f"{w}: {e}", hint=e.hint) from None

    def score(
        self, completions: Sequence[str], examples: Sequence[Mapping[str, Any]], prompts: Sequence[str]
    ) -> Scores:
        """Every reward of every completion (``examples[i]``/``prompts[i]``
        belong to ``completions[i]``); never raises for a reward's error."""
        B, K = len(completions), len(self.rewards)
        per = np.full((B, K), np.nan, np.float64)
        errors: list[list[dict[str, str]]] = [[] for _ in range(B)]
        for i in range(B):
            for k, r in enumerate(self.rewards):
                try:
                    v = r.fn(completions[i], dict(examples[i]), prompt=prompts[i])
                    if v is None:
                        continue
                    if isinstance(v, (bool, np.bool_)):
                        v = float(v)
                    if not isinstance(v, (int, float, np.integer, np.floating)) or not math.isfinite(float(v)):
                        raise TypeError(f"returned {v!r}, not a finite number or None")
                    per[i, k] = float(v)
                except Exception as e:  # noqa: BLE001 - a reward's error is reported, never a crashed run
                    per[i, k] = 0.0
                    errors[i].append({"reward": r.label, "error": f"{type(e).__name__}: {e}"})
        weighted = per * self.weights[None, :]
        total = np.where(np.isnan(per).all(axis=1), np.nan, np.nansum(weighted, axis=1)) if K else np.zeros(B)
        return Scores(per, total, errors)


# -- advantages -------------------------------------------------------------------


def _moments(x: np.ndarray, axis: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(mean, std) over ``axis`` ignoring NaN; std with Bessel's correction
    (TRL's ``nanstd``). NaN where there is no value (mean) or fewer than 2 (std)."""
    valid = ~np.isnan(x)
    n = valid.sum(axis=axis, keepdims=True)
    with np.errstate(invalid="ignore", divide="ignore"):
        mean = np.where(valid, x, 0.0).sum(axis=axis, keepdims=True) / n
        var = (np.where(valid, x - mean, 0.0) ** 2).sum(axis=axis, keepdims=True) / (n - 1)
    std = np.where(n > 1, np.sqrt(np.maximum(var, 0.0)), np.nan)
    return mean, std


def advantages(total: np.ndarray, group: int, scale: str = "group") -> np.ndarray:
    """Group-relative advantages of rewards ``total`` (B,) (rows in groups of
    ``group`` consecutive completions of one prompt; NaN = unscorable), as
    TRL's GRPO with ``scale_rewards``:

    - ``group``: ``(r - mean_g) / (std_g + 1e-4)``, mean and std over the
      row's group;
    - ``batch``: ``(r - mean_g) / (std + 1e-4)``, std over the whole batch;
    - ``none``: ``r - mean_g``.

    std is Bessel-corrected (PyTorch's default, TRL's ``nanstd``); NaN
    rewards are left out of means and stds, and a NaN advantage becomes 0.
    Computed in float64, returned float32 (B,)."""
    r = np.asarray(total, np.float64).reshape(-1)
    if group < 1 or len(r) % group:
        raise ValueError(f"{len(r)} rewards do not make groups of {group}")
    mean_g, std_g = _moments(r.reshape(-1, group), axis=1)
    mean = np.repeat(mean_g[:, 0], group)
    if scale == "group":
        std = np.repeat(std_g[:, 0], group) if group > 1 else np.zeros_like(r)
    elif scale == "batch":
        std = np.broadcast_to(_moments(r)[1], r.shape) if len(r) > 1 else np.zeros_like(r)
    elif scale == "none":
        std = None
    else:
        raise ValueError(f"scale_rewards {scale!r} is not group, batch or none")
    adv = r - mean
    if std is not None:
        adv = adv / (std + 1e-4)
    return np.nan_to_num(adv, nan=0.0).astype(np.float32)


def reward_stats(scores: Scores, labels: Sequence[str]) -> dict[str, float | None]:
    """Mean and std (Bessel-corrected, None where undefined) of each reward
    over the completions it applied to, and of the total: the step event's
    ``reward/<label>/mean`` ... and ``reward_mean``, ``reward_std``."""

    def stat(x: np.ndarray) -> tuple[float | None, float | None]:
        x = x[~np.isnan(x)]
        if not len(x):
            return None, None
        return float(x.mean()), (float(x.std(ddof=1)) if len(x) > 1 else None)

    out: dict[str, float | None] = {}
    for k, label in enumerate(labels):
        out[f"reward/{label}/mean"], out[f"reward/{label}/std"] = stat(scores.per_reward[:, k])
    out["reward_mean"], out["reward_std"] = stat(scores.total)
    return out


__all__ = [
    "BUILTINS",
    "ExactAnswer",
    "JsonValid",
    "LengthPenalty",
    "RegexMatch",
    "Reward",
    "RewardSet",
    "Scores",
    "advantages",
    "answers_equal",
    "expected_answer",
    "extract_answer",
    "import_function",
    "parse",
    "reward_stats",
]
