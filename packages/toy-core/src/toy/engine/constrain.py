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
  with the first line of llguidance's message (its verbose errors, which
  quote parser state and the grammar, are off), before any compute. A
  constraint that fails later, at a step (a parser limit reached in the
  middle of an output), raises ``ConstraintError`` from that sequence's
  ``Sampler`` only; its ``field`` is the constraint's ``origin``.
- Compiling is guarded (``prepare``), because llguidance recurses once per
  rule or ``$ref`` link while it compiles: a chain of 3,000 Lark rules, or a
  schema whose ``$defs`` form a 5,000-link ``$ref`` chain, overflowed an
  8 MB thread stack and killed the process with SIGSEGV. Three guards, in
  order: (1) ``precheck``, toy's own non-recursive scan of the grammar text,
  regex or schema against ``ConstraintLimits`` (rules, bracket nesting,
  subschemas, object/array nesting, the longest ``$ref`` chain,
  ``patternProperties``), before llguidance or any recursive Python code sees
  the constraint; (2) the compile runs in a thread of its own with a
  ``STACK_BYTES`` (256 MB, reserved, not committed) stack: the deepest
  recursion the limits allow (99 ``$ref`` links, each through 59 levels of
  ``items``) was measured to need between 8 and 32 MB, and a 30,000-rule
  Lark chain (15 times the limit) compiles in it;
  (3) a deadline (``ConstraintLimits.compile_timeout``): a compile past it
  is answered with ``ConstraintError`` at once (a thread cannot be stopped,
  so the compile ends in the background, bounded by the limits above). At
  most ``MAX_COMPILING`` (4) compiles run at once, overdue ones included: a
  fifth waits up to its own deadline for a place, then fails with
  ``ConstraintBusyError`` (the server's 503 with Retry-After), so overdue
  compiles cannot pile up without bound.
  Compiling in a child process instead was the other option: it survives
  any crash, but the compiled matcher cannot cross a process boundary, so
  every constraint would be compiled twice, and the child needs the
  tokenizer (0.3 s to build per child, and a respawn after each crash).
  llguidance's own ``ParserLimits`` stay at their defaults (they bound the
  work of a step, not the recursion of a compile).
- Compile once, copy per sequence: ``prepare`` compiles a constraint for a
  tokenizer, computes its first mask, and advances a copy by one allowed
  token (most constraints that cannot be followed fail there: an empty
  language, ``{"$ref": "#"}``, a repetition or an alternation past the
  parser's limits); the ``Constraint`` it returns carries the compiled
  matcher, and each ``Matcher`` made from it starts from a copy (about
  20 µs) instead of compiling again. A ``Constraint`` that was not prepared
  is prepared when its ``Matcher`` is made.
- The llguidance tokenizer (the vocabulary's bytes, control tokens marked)
  is built once per ``toy.tokenizer.Tokenizer`` (about 0.3 s for 49k tokens)
  and cached on it.
"""

from __future__ import annotations

import json
import re
import threading
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from toy.errors import BadInputError, ToyError

KINDS = ("json", "json_schema", "grammar", "regex")
MAX_CONSTRAINT_CHARS = 1_000_000
_JSON_DEFAULTS = {"whitespace_flexible": False}
MAX_INT_DIGITS = 16
MAX_DECIMALS = 9
_DATA_KEYS = frozenset({"enum", "const", "default", "examples", "required", "description", "title", "pattern"})
STACK_BYTES = 256 << 20  # the compile thread's stack (see the module docstring)


@dataclass(frozen=True)
class ConstraintLimits:
    """What ``precheck`` allows, and how long ``prepare`` waits for a compile (see the module docstring)."""

    max_rules: int = 2_000  # rule definitions in a Lark or GBNF grammar
    max_nesting: int = 64  # brackets in a grammar or regex; objects and arrays in a JSON schema
    max_schema_nodes: int = 10_000  # objects and arrays in a JSON schema
    max_ref_depth: int = 100  # the longest chain of $ref a JSON schema makes the compiler follow
    max_pattern_properties: int = 100  # patterns in one patternProperties (compile time grows as count**4)
    compile_timeout: float = 10.0  # seconds

    def validate(self) -> ConstraintLimits:
        for name in ("max_rules", "max_nesting", "max_schema_nodes", "max_ref_depth", "max_pattern_properties"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise BadInputError(f"{name}={v!r} must be an integer >= 1", field=name)
        t = self.compile_timeout
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not 0 < t <= 3600:
            raise BadInputError(
                f"compile_timeout={t!r} must be a number of seconds in (0, 3600]", field="compile_timeout"
            )
        return self


LIMITS = ConstraintLimits()


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
    # the input the constraint came from, named in the errors of its sequences (a server's request field)
    origin: str = field(default=_FIELD, compare=False, repr=False)
    # what ``prepare`` compiled (a ``_Compiled``), or None
    compiled: Any = field(default=None, compare=False, repr=False)

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
            except RecursionError:
                raise ConstraintError("the JSON schema is nested too deeply", field=_FIELD) from None
        if not isinstance(schema, (dict, bool)):
            raise ConstraintError(f"a JSON schema is an object, not {type(schema).__name__}", field=_FIELD)
        if isinstance(schema, dict):
            _check_schema(schema, LIMITS, nesting=_DUMPS_NESTING)  # before json.dumps, which recurses
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
        raise ConstraintError(f"the {c.describe()} cannot be compiled: {_reason(str(e))}", field=_FIELD) from None


# -- precheck: toy's own non-recursive scan (see the module docstring)

_DUMPS_NESTING = 500  # json.dumps and bounded_numbers recurse once a level (Python's limit is 1000)
_RULE = re.compile(r"^[ \t]*[?!]?[A-Za-z_][A-Za-z0-9_.-]*[ \t]*(?:\.-?[0-9]+[ \t]*)?(?:::=|:)", re.M)
_GRAMMAR_MARKS = re.compile(r'\\.|["()\[\]{}]', re.S)
_REGEX_MARKS = re.compile(r"\\.|[()\[\]]", re.S)


def _too_many(what: str, n: int, limit: int, name: str, hint: str | None = None) -> ConstraintError:
    return ConstraintError(
        f"{what}: {n}; at most {limit} are allowed",
        hint=hint or f"simplify the constraint (the limit is ConstraintLimits.{name})",
        field=_FIELD,
    )


def _nesting(text: str, marks: re.Pattern, quotes: bool) -> int:
    """The deepest bracket nesting of ``text`` (escapes skipped; with ``quotes``, "..." literals skipped; a
    regex character class counts as one level)."""
    depth = top = 0
    in_quote = in_class = False
    for m in marks.finditer(text):
        ch = m.group()
        if len(ch) == 2:  # an escaped character
            continue
        if in_quote:
            in_quote = ch != '"'
            continue
        if ch == '"':
            in_quote = quotes
        elif in_class:
            if ch == "]":
                in_class = False
                depth -= 1
        elif ch in "([{":
            depth += 1
            top = max(top, depth)
            in_class = ch == "[" and not quotes  # inside a regex class, brackets are characters
        elif ch in ")]}":
            depth = max(depth - 1, 0)
    return top


def _check_regex(pattern: str, limits: ConstraintLimits, where: str) -> None:
    n = _nesting(pattern, _REGEX_MARKS, quotes=False)
    if n > limits.max_nesting:
        raise _too_many(f"{where} nests groups too deeply", n, limits.max_nesting, "max_nesting")


def _check_grammar(text: str, limits: ConstraintLimits) -> None:
    # a Lark rule starts a line; a GBNF rule has its "::=" (GBNF also ends a line at a lone "\r")
    rules = max(sum(1 for _ in _RULE.finditer(text.replace("\r", "\n"))), text.count("::="))
    if rules > limits.max_rules:
        raise _too_many("the grammar has too many rules", rules, limits.max_rules, "max_rules")
    n = _nesting(text, _GRAMMAR_MARKS, quotes=True)
    if n > limits.max_nesting:
        raise _too_many("the grammar nests brackets too deeply", n, limits.max_nesting, "max_nesting")


def _pointer_key(key: str) -> str:
    return key.replace("~", "~0").replace("/", "~1")


def _check_schema(schema: Any, limits: ConstraintLimits, nesting: int | None = None) -> None:
    """Walk ``schema`` without recursion: objects and arrays, their nesting, regexes, patternProperties,
    and (unless only ``nesting`` is asked for) the longest ``$ref`` chain."""
    max_nesting = nesting if nesting is not None else limits.max_nesting
    nodes = 0
    # (value, depth, its JSON pointer; None when pointers are not needed)
    stack: list[tuple[Any, int, str | None]] = [(schema, 1, "#")]
    refs: list[tuple[str, str]] = []  # (pointer of the node holding the $ref, the $ref)
    while stack:
        value, depth, ptr = stack.pop()
        if not isinstance(value, (dict, list)):
            continue
        nodes += 1
        if depth > max_nesting:
            raise _too_many("the JSON schema nests objects and arrays too deeply", depth, max_nesting, "max_nesting")
        if nesting is not None:
            items = value.values() if isinstance(value, dict) else value
            stack.extend((v, depth + 1, None) for v in items)
            continue
        if nodes > limits.max_schema_nodes:
            msg = "the JSON schema has too many objects and arrays"
            raise _too_many(msg, nodes, limits.max_schema_nodes, "max_schema_nodes")
        if isinstance(value, list):
            stack.extend((v, depth + 1, f"{ptr}/{i}") for i, v in enumerate(value))
            continue
        ref = value.get("$ref")
        if isinstance(ref, str):
            refs.append((ptr or "#", ref))
        pattern = value.get("pattern")
        if isinstance(pattern, str):
            _check_regex(pattern, limits, f"the pattern at {ptr}")
        pp = value.get("patternProperties")
        if isinstance(pp, dict):
            if len(pp) > limits.max_pattern_properties:
                msg = f"patternProperties at {ptr} has too many patterns"
                raise _too_many(msg, len(pp), limits.max_pattern_properties, "max_pattern_properties")
            for key in pp:
                _check_regex(key, limits, f"a patternProperties key at {ptr}")
        for k, v in value.items():
            if isinstance(v, (dict, list)):
                stack.append((v, depth + 1, f"{ptr}/{_pointer_key(str(k))}"))
    if nesting is None and refs:
        depth = _ref_depth(refs)
        if depth > limits.max_ref_depth:
            raise _too_many("the JSON schema chains $ref too deeply", depth, limits.max_ref_depth, "max_ref_depth")


def _ref_depth(refs: list[tuple[str, str]]) -> int:
    """The longest chain of $ref links (cycles cut where they close): the graph's nodes are the $ref targets
    and the root; a $ref inside target A (the innermost target that contains it) to target B is an edge A -> B,
    and so is a target nested inside another."""
    targets = {"#"}
    for _, ref in refs:
        targets.add(ref.rstrip("/") or "#")

    def owner(ptr: str) -> str:  # the innermost target that contains ``ptr`` (itself excluded)
        while ptr != "#":
            ptr = ptr.rsplit("/", 1)[0] or "#"
            if ptr in targets:
                return ptr
        return "#"

    edges: dict[str, set[str]] = {t: set() for t in targets}
    for ptr, ref in refs:
        src = ptr if ptr in targets else owner(ptr)
        edges[src].add(ref.rstrip("/") or "#")
    for t in targets:
        if t != "#":
            edges[owner(t)].add(t)
    longest: dict[str, int] = {}
    on_path: set[str] = set()
    stack: list[tuple[str, bool]] = [("#", False)]
    while stack:
        node, done = stack.pop()
        if done:
            on_path.discard(node)
            longest[node] = 1 + max((longest.get(n, 0) for n in edges[node] if n not in on_path), default=0)
            continue
        if node in longest or node in on_path:
            continue
        on_path.add(node)
        stack.append((node, True))
        stack.extend((n, False) for n in edges[node] if n not in longest and n not in on_path)
    return longest.get("#", 1) - 1


def precheck(c: Constraint, limits: ConstraintLimits = LIMITS) -> None:
    """``ConstraintError`` when ``c`` is past ``limits`` (rules, nesting, subschemas, $ref chains,
    patternProperties); a non-recursive scan, cheap next to a compile."""
    c.validate()
    if c.kind == "json_schema":
        try:
            schema = json.loads(c.text)
        except RecursionError:
            raise ConstraintError("the JSON schema is nested too deeply", field=_FIELD) from None
        except ValueError as e:
            raise ConstraintError(f"the JSON schema is not valid JSON: {e}", field=_FIELD) from None
        _check_schema(schema, limits)
    elif c.kind == "grammar":
        _check_grammar(c.text, limits)
    elif c.kind == "regex":
        _check_regex(c.text, limits, "the regex")


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


def _reason(err: str) -> str:
    """llguidance's message without internal detail: its first line and its ``error:`` lines (a regex's),
    at most 300 characters."""
    lines = [ln.strip() for ln in str(err).splitlines() if ln.strip() and not ln.strip().startswith("<")]
    kept = lines[:1] + [ln for ln in lines[1:] if ln.startswith("error:")]
    line = " ".join(kept).removeprefix("Warning: ")
    if line == "NoExtensionBias":  # llguidance's name for "no token is allowed here"
        line = "no token can continue it"
    return line if len(line) <= 300 else line[:299] + "…"


class _Compiled:
    """A constraint compiled for one llguidance tokenizer: a matcher at its start (never advanced), copied for
    each sequence."""

    def __init__(self, lt, text: str, base):
        self.lt, self.text, self._base = lt, text, base

    def matcher(self):
        return self._base.deep_copy()


_STACK_LOCK = threading.Lock()
MAX_COMPILING = 4  # compile threads alive at once; a compile past its deadline keeps its place until it ends
_COMPILING = threading.BoundedSemaphore(MAX_COMPILING)


class ConstraintBusyError(ToyError):
    """Every compile place is held by a compile still running (one past its deadline cannot be stopped and ends
    in the background), so no new constraint can be compiled now: not the request's fault; the server answers
    503 with Retry-After."""


def _in_big_stack(fn, timeout: float, what: str):
    """``fn()`` on a thread with a ``STACK_BYTES`` stack; ``ConstraintError`` when it takes longer than
    ``timeout`` seconds (the thread then finishes in the background)."""
    box: dict[str, Any] = {}

    if not _COMPILING.acquire(timeout=timeout):
        raise ConstraintBusyError(
            f"{MAX_COMPILING} constraints are still compiling (those past their deadline end in the background)",
            hint="try again shortly",
        )

    def run() -> None:
        try:
            box["value"] = fn()
        except BaseException as e:  # noqa: BLE001 - handed to the caller
            box["error"] = e
        finally:
            _COMPILING.release()  # the place is held until the compile really ends, deadline or not

    try:
        with _STACK_LOCK:  # the stack size is a process-wide setting for new threads: set, start, restore
            old = threading.stack_size(STACK_BYTES)
            try:
                t = threading.Thread(target=run, name="toy-constraint-compile", daemon=True)
                t.start()
            finally:
                threading.stack_size(old)
    except BaseException:
        _COMPILING.release()  # the thread never started
        raise
    t.join(timeout)
    if t.is_alive():
        raise ConstraintError(
            f"the {what} took longer than {timeout:g} s to compile",
            hint="simplify it (fewer patterns, rules or alternatives)",
            field=_FIELD,
        )
    if "error" in box:
        raise box["error"]
    return box["value"]


def _compile(c: Constraint, lt) -> _Compiled:
    """Compile ``c`` (on the big-stack thread), compute its first mask and advance a copy by one allowed token."""
    llg = _llg()
    text = grammar_text(c)
    m = llg.LLMatcher(lt, text, log_level=0, limits=llg.LLParserLimits(verbose_errors=False))
    if m.is_error():
        raise ConstraintError(f"the {c.describe()} cannot be compiled: {_reason(m.get_error())}", field=_FIELD)
    mask = np.frombuffer(m.compute_bitmask(), np.uint8)
    if not m.is_error():
        allowed = np.flatnonzero(np.unpackbits(mask, bitorder="little")[: lt.vocab_size])
        ends = set(lt.eos_tokens)
        first = next((int(t) for t in allowed if int(t) not in ends), None)
        if first is not None:
            probe = m.deep_copy()
            if not probe.consume_token(first) or probe.is_error():
                m = probe
    if m.is_error():
        msg = f"the {c.describe()} cannot be followed: {_reason(m.get_error())}"
        hint = "no text matches it, or it needs more work per token than the compiler's limits allow"
        raise ConstraintError(msg, hint=hint, field=_FIELD)
    return _Compiled(lt, text, m)


def prepare(c: Constraint, tokenizer, limits: ConstraintLimits | None = None) -> Constraint:
    """``c`` compiled for ``tokenizer``: the same constraint carrying its compiled matcher, which each
    ``Matcher`` made from it copies. Runs ``precheck``, then the compile on a big-stack thread under the
    deadline (see the module docstring); ``ConstraintError`` names the problem."""
    limits = (limits or LIMITS).validate()
    lt = ll_tokenizer(tokenizer)
    if c.compiled is not None and c.compiled.lt is lt:
        return c
    precheck(c, limits)
    compiled = _in_big_stack(lambda: _compile(c, lt), limits.compile_timeout, c.describe())
    return replace(c, compiled=compiled)


def check(c: Constraint, tokenizer) -> str:
    """Compile ``c`` for ``tokenizer`` (``prepare``) and return its grammar; ``ConstraintError`` naming the
    problem."""
    return prepare(c, tokenizer).compiled.text


class Matcher:
    """One sequence's position in a constraint: ``mask(logits)`` sets disallowed tokens to ``-inf``
    (in place), ``advance(token)`` moves past a sampled token, ``done`` says nothing can follow.
    A constraint that was not prepared for ``tokenizer`` is prepared here."""

    def __init__(self, c: Constraint, tokenizer, n_vocab: int):
        self.constraint = c
        self.n_vocab = n_vocab
        lt = ll_tokenizer(tokenizer)
        compiled = c.compiled if c.compiled is not None and c.compiled.lt is lt else prepare(c, tokenizer).compiled
        self._m = compiled.matcher()
        self._n_tok = min(lt.vocab_size, n_vocab)  # rows past the tokenizer's vocabulary (padding) stay masked
        self._words = np.zeros((lt.vocab_size + 31) // 32, np.uint32)
        self._allowed = np.zeros(n_vocab, bool)
        self._steps = 0
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
        self._steps += 1
        self.done = self._m.is_stopped()

    def _raise_on_error(self) -> None:
        if self._m.is_error():
            c = self.constraint
            msg = f"the {c.describe()} could not be followed after {self._steps} tokens: {_reason(self._m.get_error())}"
            hint = "it needs more work per token than the compiler's limits allow; simplify it"
            raise ConstraintError(msg, hint=hint, field=c.origin)


__all__ = [
    "KINDS",
    "LIMITS",
    "Constraint",
    "ConstraintBusyError",
    "ConstraintError",
    "ConstraintLimits",
    "Matcher",
    "check",
    "grammar_text",
    "ll_tokenizer",
    "precheck",
    "prepare",
]
