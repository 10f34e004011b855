"""Constrained decoding (toy.engine.constrain) against independent references.

- The token mask llguidance computes for a regex equals, token for token over
  the whole 49,152-token vocabulary, the set a second regex engine accepts:
  the ``regex`` module's partial full-match of the text so far plus the
  token's bytes (and the end tokens exactly when the text matches in full).
- A greedy constrained generation equals a step-by-step argmax over the
  model's logits (full prefills, exact-batching kernels) masked by that
  reference, so the engine applies the mask where it should and nowhere else.
- ``bounded_numbers`` (the digit limits) is checked on hand-written schemas
  against the rule its docstring states.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from toy.engine.constrain import (
    MAX_DECIMALS,
    MAX_INT_DIGITS,
    Constraint,
    ConstraintError,
    bounded_numbers,
    check,
)
from toy.engine.sampling import Sampler, SamplingError, SamplingParams

regex = pytest.importorskip("regex")


@pytest.fixture(scope="module")
def model(smollm2_path):
    import toy

    with toy.load(smollm2_path, n_ctx=256, threads=2, exact_batching=True) as m:
        yield m


@pytest.fixture(scope="module")
def pieces(model):
    tok = model.tokenizer
    return [None if tok.is_control(i) else tok.token_to_piece(i) for i in range(tok.vocab_size)]


def reference_allowed(pattern: str, text: bytes, pieces, eog) -> set[int]:
    """Tokens whose bytes keep ``text`` a prefix of a full match of ``pattern`` (``regex`` module), plus the
    end-of-generation ids when ``text`` already matches in full."""
    rx = regex.compile(pattern)
    out = set()
    for i, p in enumerate(pieces):
        if not p:
            continue
        try:
            s = (text + p).decode("utf-8")
        except UnicodeDecodeError:
            continue  # the patterns here are ASCII: a partial UTF-8 sequence cannot be part of a match
        if rx.fullmatch(s, partial=True):
            out.add(i)
    if rx.fullmatch(text.decode("utf-8")):
        out |= set(eog)
    return out


PATTERN = r"[0-9]{2}-(ab|cd)[xyz]{0,3}"


@pytest.mark.model
@pytest.mark.parametrize("text", ["", "4", "42", "42-", "42-c", "42-ab", "42-abxy", "42-abxyz"])
def test_regex_mask_equals_a_second_regex_engine(model, pieces, text):
    params = SamplingParams.greedy(constraint=Constraint.regex(PATTERN))
    s = Sampler(params, model.cfg.n_vocab, model.tokenizer)
    for t in model.tokenize(text, add_special=False) if text else []:
        s.matcher.advance(t)
    got = set(np.flatnonzero(s.matcher.allowed()).tolist())
    want = reference_allowed(PATTERN, text.encode(), pieces, model.tokenizer.eog_ids)
    assert got == want
    assert len(want) > 0


@pytest.mark.model
def test_greedy_constrained_generation_equals_masked_argmax(model, pieces):
    prompt = "Order number:"
    g = model.generate(prompt, temperature=0, max_tokens=12, constraint=Constraint.regex(PATTERN))
    assert regex.fullmatch(PATTERN, g.text) and g.finish_reason == "stop"
    ids, text, want = model.tokenize(prompt), b"", []
    eog = model.tokenizer.eog_ids
    for _ in range(12):
        logits = model.logits(ids)[-1].astype(np.float64)
        allowed = reference_allowed(PATTERN, text, pieces, eog)
        masked = np.full_like(logits, -np.inf)
        idx = np.array(sorted(allowed))
        masked[idx] = logits[idx]
        t = int(np.argmax(masked))
        if t in eog:
            break
        want.append(t)
        ids.append(t)
        text += pieces[t]
        if not any(i not in eog for i in reference_allowed(PATTERN, text, pieces, eog)):
            break  # complete: nothing may follow
    assert g.tokens == want


@pytest.mark.model
def test_constraint_ends_generation_even_with_ignore_eos(model):
    c = Constraint.grammar('root ::= "yes" | "no"')
    g = model.generate("Is the sky blue? Answer:", temperature=0, max_tokens=20, ignore_eos=True, constraint=c)
    assert g.text in ("yes", "no") and g.finish_reason == "stop"


@pytest.mark.model
def test_sampled_outputs_follow_a_schema(model):
    jsonschema = pytest.importorskip("jsonschema")
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 3, "maximum": 7},
              "w": {"enum": ["up", "down"]}}, "required": ["n", "w"], "additionalProperties": False}  # fmt: skip
    c = Constraint.json_schema(schema)
    for seed in range(6):
        g = model.generate([{"role": "user", "content": "JSON please"}], temperature=1.2, seed=seed, max_tokens=40,
                           constraint=c)  # fmt: skip
        assert g.finish_reason == "stop"
        jsonschema.validate(json.loads(g.text), schema)


@pytest.mark.model
@pytest.mark.parametrize(
    ("c", "words"),
    [
        (Constraint.json_schema({"type": "nope"}), "Invalid type"),
        (Constraint.json_schema({"$ref": "#/missing"}), "missing"),
        (Constraint.grammar('root ::= "a" rest'), "rest"),
        (Constraint.regex("(a"), "unclosed"),
    ],
)
def test_a_constraint_that_cannot_compile_is_bad_input(model, c, words):
    with pytest.raises(ConstraintError, match=words):
        check(c, model.tokenizer)
    with pytest.raises(ConstraintError):  # before any compute: Model.stream checks it
        model.stream("Hi", temperature=0, max_tokens=2, constraint=c)


def test_constraint_validation_and_tokenizer_requirement():
    with pytest.raises(ConstraintError, match="kind") as e:
        SamplingParams(constraint=Constraint("xml", "x")).validate()
    assert e.value.field == "constraint"  # SamplingParams' name for it (a front end names its own input)
    with pytest.raises(ConstraintError, match="empty") as e:
        Constraint.regex("  ").validate()
    assert e.value.field == "constraint"
    with pytest.raises(ConstraintError, match="not valid JSON"):
        Constraint.json_schema("{nope")
    with pytest.raises(SamplingError, match="tokenizer"):
        Sampler(SamplingParams.greedy(constraint=Constraint.json_object()), 10)
    with pytest.raises(SamplingError, match="Constraint"):
        SamplingParams(constraint="json").validate()
    # key order is kept (it is the order of the output's properties)
    assert Constraint.json_schema({"b": 1, "a": 2}).text == '{"b": 1, "a": 2}'


TOP = 10**MAX_INT_DIGITS - 1
STEP = 10.0**-MAX_DECIMALS


def test_bounded_numbers_adds_limits_where_the_schema_leaves_them_open():
    assert bounded_numbers({"type": "integer"}) == {"type": "integer", "minimum": -TOP, "maximum": TOP}
    assert bounded_numbers({"type": "number"}) == {"type": "number", "minimum": -TOP, "maximum": TOP,
                                                   "multipleOf": STEP}  # fmt: skip
    # the schema's own bounds and step are kept; an exclusive bound counts as a bound
    assert bounded_numbers({"type": "number", "exclusiveMinimum": 0, "maximum": 5, "multipleOf": 0.5}) == {
        "type": "number", "exclusiveMinimum": 0, "maximum": 5, "multipleOf": 0.5}  # fmt: skip
    # enum and const are left alone (a step could exclude their values); so are non-numeric types
    for s in ({"type": "number", "enum": [0.123456789012]}, {"type": "integer", "const": 10**20},
              {"type": "string"}, {"type": "boolean"}):  # fmt: skip
        assert bounded_numbers(s) == s
    # nested: properties, items, anyOf, $defs, type lists; a property named "type" or "minimum" is a name
    nested = {"type": "object", "properties": {"type": {"type": ["integer", "null"]}, "minimum": {"type": "string"}},
              "$defs": {"x": {"anyOf": [{"type": "number", "maximum": 1}]}},
              "items": [{"type": "integer", "minimum": 0}], "required": ["type"]}  # fmt: skip
    got = bounded_numbers(nested)
    assert got["properties"]["type"] == {"type": ["integer", "null"], "minimum": -TOP, "maximum": TOP}
    assert got["properties"]["minimum"] == {"type": "string"}
    assert got["$defs"]["x"]["anyOf"][0] == {"type": "number", "maximum": 1, "minimum": -TOP, "multipleOf": STEP}
    assert got["items"][0] == {"type": "integer", "minimum": 0, "maximum": TOP}
    assert got["required"] == ["type"] and "maximum" not in got
    assert nested["properties"]["type"] == {"type": ["integer", "null"]}  # the input is not changed
