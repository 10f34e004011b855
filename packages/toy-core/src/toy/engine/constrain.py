"""Constrained decoding: output that follows a JSON schema, a grammar or a regex.

``Constraint`` says what the output must match; ``SamplingParams.constraint``
carries it; the ``Sampler`` of each sequence keeps a ``Matcher`` that, at every
step, masks the tokens that cannot continue a match (their logits become
``-inf``) and advances over the token drawn. Sequences of a batch each have
their own matcher, so a constrained request and a free one decode together,
and a greedy constrained output does not depend on its neighbours.

Decisions:

- The token masks come from llguidance (the Rust core of Microsoft's
  Guidance, also inside llama.cpp and vLLM). Measured here on SmolLM2's
  49,152-token vocabulary against outlines-core 0.2.14 and xgrammar 0.2.8
  (five schemas: bounds, arrays with min/max items, enums, ``anyOf``,
  nested objects): llguidance compiled each schema in about 1 ms and
  computed a mask in 14-87 µs; outlines-core took 49-232 ms to compile,
  up to 2.7 ms per mask, and ignored ``minimum``/``exclusiveMinimum``
  (it produced ``"price": -311`` for ``exclusiveMinimum: 0``); xgrammar
  requires PyTorch, transformers and Triton (5.7 GB installed). llguidance
  also reads Lark and llama.cpp's GBNF grammars and regexes, and has no
  Python dependencies.
- Kinds: ``json`` (any JSON object: OpenAI's ``json_object`` mode), ``json_schema``
  (a JSON schema), ``grammar`` (Lark, or GBNF as llama.cpp's ``grammar``
  field takes it; llguidance tells them apart) and ``regex``.
- JSON is written compactly (no free whitespace between tokens; llguidance's
  ``whitespace_flexible`` off): a small model that may emit whitespace
  anywhere tends to emit only that. A schema's own ``x-guidance`` options win.
- Numbers are bounded in length, as llama.cpp's schema grammars bound them
  (16 digits each side of the point there): a small model that starts
  ``0.99999`` may never stop. toy adds, where a schema leaves them open, at
  most 16 integer digits (``minimum``/``maximum`` of +-(10**16 - 1)) and at
  most 9 decimals (``multipleOf: 1e-9``; llguidance then writes no exponent)
  to every ``number``/``integer`` subschema without ``enum``/``const``.
  Every output still validates against the schema as given; a schema whose
  own ``multipleOf`` or bounds are set keeps them. JSON mode (``json``) is a
  schema of any object whose numbers are bounded the same way.
- The mask is applied right after ``logit_bias`` and before the penalties and
  filters (which then choose among allowed tokens only). Reported logprobs
  stay the model's own, as for the other samplers.
- The end: when the grammar accepts, the model's end-of-generation tokens
  are allowed; when nothing can follow, only they are, and the ``Sampler``
  reports ``done`` after the last token so generation stops there without
  another forward. A constraint ends generation at the grammar's end even
  with ``ignore_eos``. ``max_tokens`` can still cut an output short
  (finish_reason "length"), as everywhere.
- Errors: a schema or grammar llguidance cannot compile raises
  ``ConstraintError`` (bad input: the CLI exits 2, the server answers 400)
  with llguidance's message, when the ``Sampler`` is made, before any compute.
- The llguidance tokenizer (the vocabulary's bytes, control tokens marked)
  is built once per ``toy.tokenizer.Tokenizer`` (about 0.3 s for 49k tokens)
  and cached on it.
"""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass
from typing import Any

import numpy as np

from toy.errors import BadInputError

KINDS = ("json", "json_schema", "grammar", "regex")
MAX_CONSTRAINT_CHARS = 1_000_000
_JSON_DEFAULTS = {"whitespace_flexible": False}
MAX_INT_DIGITS = 16
MAX_DECIMALS = 9
_DATA_KEYS = frozenset({"enum", "const", "default", "examples", "required", "description", "title", "pattern"})


def bounded_numbers(schema: Any) -> Any:
    """A copy of ``schema`` whose number and integer subschemas have digit limits (see the module
    docstring); everything else as given."""
    if isinstance(schema, list):
        return [bounded_numbers(v) for v in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: (v if k in _DATA_KEYS else bounded_numbers(v)) for k, v in schema.items()}
    types = out.get("type")
    types = [types] if isinstance(types, str) else types if isinstance(types, list) else []
    numeric = [t for t in types if t in ("number", "integer")]
    if numeric and "enum" not in out and "const" not in out:
        top = 10**MAX_INT_DIGITS - 1
        if "maximum" not in out and "exclusiveMaximum" not in out:
            out["maximum"] = top
        if "minimum" not in out and "exclusiveMinimum" not in out:
            out["minimum"] = -top
        if "number" in numeric and "multipleOf" not in out:
            out["multipleOf"] = 10.0**-MAX_DECIMALS
    return out


def _any_object() -> dict[str, Any]:
    """JSON mode's schema: any object, its numbers bounded."""
    value = {"anyOf": [
        {"type": "null"}, {"type": "boolean"}, {"type": "integer"}, {"type": "number"}, {"type": "string"},
        {"type": "array", "items": {"$ref": "#/$defs/value"}},
        {"type": "object", "additionalProperties": {"$ref": "#/$defs/value"}},
    ]}  # fmt: skip
    return bounded_numbers(
        {"$defs": {"value": value}, "type": "object", "additionalProperties": {"$ref": "#/$defs/value"}}
    )


class ConstraintError(BadInputError):
    """A constraint that cannot be compiled (a bad schema, grammar or regex). Its ``field`` is
    ``constraint`` (``SamplingParams``' name for it) when the constraint is at fault; a front end that
    took the constraint from one of its own inputs names that input instead."""


_FIELD = "constraint"


@dataclass(frozen=True)
class Constraint:
    """What the output must match: ``kind`` (see ``KINDS``) and its ``text`` (the schema as JSON,
    the grammar or the regex; "" for ``json``). Make one with ``json_object``, ``json_schema``,
    ``grammar`` or ``regex``."""

    kind: str
    text: str = ""

    @classmethod
    def json_object(cls) -> Constraint:
        """Any JSON object (OpenAI's ``response_format: {"type": "json_object"}``)."""
        return cls("json")

    @classmethod
    def json_schema(cls, schema: dict[str, Any] | str | bool) -> Constraint:
        """JSON that validates against ``schema`` (a dict, or its JSON text)."""
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except ValueError as e:
                raise ConstraintError(f"the JSON schema is not valid JSON: {e}", field=_FIELD) from None
        if not isinstance(schema, (dict, bool)):
            raise ConstraintError(f"a JSON schema is an object, not {type(schema).__name__}", field=_FIELD)
        return cls("json_schema", json.dumps(schema, ensure_ascii=False))  # key order kept: it is the output's

    @classmethod
    def grammar(cls, text: str) -> Constraint:
        """A Lark grammar, or a GBNF grammar as llama.cpp takes it (``root ::= ...``)."""
        return cls("grammar", text)

    @classmethod
    def regex(cls, pattern: str) -> Constraint:
        """Text that matches ``pattern`` in full (Rust regex syntax)."""
        return cls("regex", pattern)

    def validate(self) -> Constraint:
        if self.kind not in KINDS:
            raise ConstraintError(f"constraint kind {self.kind!r} is not one of {', '.join(KINDS)}", field=_FIELD)
        if not isinstance(self.text, str):
            msg = f"the {self.kind} constraint must be text, not {type(self.text).__name__}"
            raise ConstraintError(msg, field=_FIELD)
        if len(self.text) > MAX_CONSTRAINT_CHARS:
            raise ConstraintError(
                f"the {self.kind} constraint has {len(self.text)} characters; at most "
                f"{MAX_CONSTRAINT_CHARS} are allowed",
                field=_FIELD,
            )
        if self.kind in ("grammar", "regex") and not self.text.strip():
            raise ConstraintError(f"the {self.kind} constraint is empty", field=_FIELD)
        return self

    def describe(self) -> str:
        return {"json": "JSON object", "json_schema": "JSON schema"}.get(self.kind, self.kind)


def _llg():
    import llguidance  # lazy: ~0.15 s that only a constrained generation needs

    return llguidance


def grammar_text(c: Constraint) -> str:
    """The llguidance grammar for ``c``; ``ConstraintError`` when it cannot be made."""
    llg = _llg()
    c.validate()
    try:
        if c.kind == "json":
            return llg.LLMatcher.grammar_from_json_schema(_any_object(), defaults=_JSON_DEFAULTS)
        if c.kind == "json_schema":
            schema = bounded_numbers(json.loads(c.text))
            return llg.LLMatcher.grammar_from_json_schema(schema, defaults=_JSON_DEFAULTS)
        if c.kind == "regex":
            return llg.LLMatcher.grammar_from_regex(c.text)
        return llg.grammar_from("grammar", c.text)
    except ValueError as e:
        raise ConstraintError(f"the {c.describe()} cannot be compiled: {e}", field=_FIELD) from None


_TOKENIZERS_LOCK = threading.Lock()


class _Wrapper:
    """What ``llguidance.LLTokenizer`` reads: each token's bytes (control tokens prefixed with 0xFF,
    llguidance's mark for special tokens) and a way to tokenize text."""

    def __init__(self, tokenizer, eog: list[int]):
        self._tok = tokenizer
        n = tokenizer.vocab_size
        control = [i for i in range(n) if tokenizer.is_control(i)]
        marked = set(control)
        self.tokens = [(b"\xff" if i in marked else b"") + tokenizer.token_to_piece(i) for i in range(n)]
        self.special_token_ids = control
        self.eos_token_id = eog[0]
        self.bos_token_id = tokenizer.bos_id
        self.is_tokenizer_wrapper = True

    def __call__(self, text: str | bytes) -> list[int]:
        if isinstance(text, bytes):
            text = text.decode("utf-8", errors="replace")
        return self._tok.encode(text, add_special=False, special=False)


def ll_tokenizer(tokenizer):
    """The llguidance tokenizer of a toy ``Tokenizer`` (built once, cached on it)."""
    cached = getattr(tokenizer, "_llg_tokenizer", None)
    if cached is not None:
        return cached
    with _TOKENIZERS_LOCK:
        cached = getattr(tokenizer, "_llg_tokenizer", None)
        if cached is None:
            llg = _llg()
            eog = sorted(tokenizer.eog_ids) or ([tokenizer.eos_id] if tokenizer.eos_id is not None else [])
            if not eog:
                raise ConstraintError(
                    "this model has no end-of-generation token, so a constrained output could not end"
                )
            cached = llg.LLTokenizer(_Wrapper(tokenizer, eog), n_vocab=tokenizer.vocab_size, eos_token=eog)
            tokenizer._llg_tokenizer = cached
    return cached


def check(c: Constraint, tokenizer) -> str:
    """Compile ``c`` for ``tokenizer`` and return its grammar; ``ConstraintError`` naming the problem."""
    text = grammar_text(c)
    err = _llg().LLMatcher.validate_grammar(text, ll_tokenizer(tokenizer))
    if err:
        raise ConstraintError(f"the {c.describe()} cannot be compiled: {err}", field=_FIELD)
    return text


class Matcher:
    """One sequence's position in a constraint: ``mask(logits)`` sets disallowed tokens to ``-inf``
    (in place), ``advance(token)`` moves past a sampled token, ``done`` says nothing can follow."""

    def __init__(self, c: Constraint, tokenizer, n_vocab: int):
        llg = _llg()
        self.constraint = c
        self.n_vocab = n_vocab
        lt = ll_tokenizer(tokenizer)
        self._m = llg.LLMatcher(lt, check(c, tokenizer))
        if self._m.is_error():
            msg = f"the {c.describe()} cannot be compiled: {self._m.get_error()}"
            raise ConstraintError(msg, field=_FIELD)
        self._n_tok = min(lt.vocab_size, n_vocab)  # rows past the tokenizer's vocabulary (padding) stay masked
        self._words = np.zeros((lt.vocab_size + 31) // 32, np.uint32)
        self._allowed = np.zeros(n_vocab, bool)
        self.done = False

    def allowed(self) -> np.ndarray:
        """A boolean (n_vocab,) array: the tokens that can come next (a view the next call overwrites)."""
        w = self._words
        self._m.unsafe_compute_mask_ptr(w.ctypes.data, w.nbytes)
        self._raise_on_error()
        self._allowed[: self._n_tok] = np.unpackbits(w.view(np.uint8), count=self._n_tok, bitorder="little")
        return self._allowed

    def mask(self, x: np.ndarray) -> np.ndarray:
        allowed = self.allowed()
        x[~allowed] = -np.inf
        return x

    def advance(self, token: int) -> None:
        if not self._m.consume_token(int(token)):
            self._raise_on_error()
            msg = f"token {token} does not continue the {self.constraint.describe()}"
            raise ConstraintError(msg, field="token")
        self.done = self._m.is_stopped()

    def _raise_on_error(self) -> None:
        if self._m.is_error():
            msg = f"the {self.constraint.describe()} failed: {self._m.get_error()}"
            raise ConstraintError(msg, field=_FIELD)


__all__ = ["KINDS", "Constraint", "ConstraintError", "Matcher", "check", "grammar_text", "ll_tokenizer"]
