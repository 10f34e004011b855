"""Constraints that must not take the process down (issue 42, items 8-10; toy.engine.constrain's docstring).

- Long chains of grammar rules or ``$ref`` links made llguidance's compiler recurse once per link until the
  thread's stack overflowed (SIGSEGV). They are compiled in a child process here, under a memory limit, so the
  old code fails this test with a signal instead of killing pytest: every case must end as a
  ``ConstraintError`` that names the limit, and the child must exit normally.
- Constraints that compiled but could not be followed (an empty language, ``{"$ref": "#"}``, a ``$ref`` loop,
  a repetition or an alternation past the parser's limits) are refused when prepared (the first mask and one
  step are computed), with one line of llguidance's message and no parser state.
- One that fails only later, in the middle of an output, fails its own sampler with an error naming the
  constraint's origin.
- A constraint is compiled once: the matcher of each sequence is a copy; a compile past the deadline is refused.
- ``toy infer --grammar`` with a chain of rules exits 2 with an ``error:`` line instead of a signal.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest

from toy.engine import constrain
from toy.engine.constrain import Constraint, ConstraintError, ConstraintLimits
from toy.errors import BadInputError
from toy_testsupport.hostile import gbnf_chain, lark_chain, ref_chain

pytestmark = pytest.mark.model

MEMORY_LIMIT = 4 << 30  # address space of the child (the 256 MB compile stack is reserved inside it)


# (name, kind, payload, words the error must contain)
CRASHERS = [
    ("lark-chain-3000", "grammar", lark_chain(3000), "rules"),
    ("gbnf-chain-5000", "grammar", gbnf_chain(5000), "rules"),
    ("ref-chain-5000", "json_schema", ref_chain(5000), "$ref"),
    ("ref-chain-items-2000", "json_schema", ref_chain(2000, "items"), "$ref"),
    ("ref-chain-anyof-2000", "json_schema", ref_chain(2000, "anyOf"), "$ref"),
]
UNFOLLOWABLE = [
    ("empty-language", "regex", r"[^\s\S]", "cannot be followed"),
    ("self-ref", "json_schema", {"$ref": "#"}, "cannot be followed"),
    ("ref-loop", "json_schema", {"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}, "cannot be followed"),
    ("repeat-100000", "grammar", 'root ::= "a"{100000}', "cannot be followed"),
    ("alternatives-20000", "grammar", "root ::= " + " | ".join(f'"w{i}"' for i in range(20000)), "cannot be followed"),
    (
        "anyof-3000",
        "json_schema",
        {"anyOf": [{"type": "object", "properties": {f"k{i}": {"type": "integer"}}, "required": [f"k{i}"]} for i in range(3000)]},
        "too many",
    ),
]  # fmt: skip

CHILD = textwrap.dedent(
    """
    import json, resource, sys
    resource.setrlimit(resource.RLIMIT_AS, ({limit}, {limit}))
    from toy.engine.constrain import Constraint, ConstraintError, check
    from toy.tokenizer.tokenizer import Tokenizer
    tok = Tokenizer.from_file(sys.argv[1])
    for name, kind, payload, _ in json.load(open(sys.argv[2])):
        print(json.dumps({{"case": name, "started": True}}), flush=True)
        c = getattr(Constraint, kind)(payload)
        try:
            check(c, tok)
            out = {{"case": name, "error": None}}
        except ConstraintError as e:
            out = {{"case": name, "error": str(e), "hint": e.hint, "field": e.field}}
        print(json.dumps(out), flush=True)
    """
)


def test_hostile_constraints_are_refused_not_fatal(smollm2_path, tmp_path):
    """Every case ends as a ConstraintError in a child that exits 0 (the old code: SIGSEGV on the first)."""
    cases = tmp_path / "cases.json"
    cases.write_text(json.dumps(CRASHERS + UNFOLLOWABLE))
    script = CHILD.format(limit=MEMORY_LIMIT)
    t0 = time.monotonic()
    p = subprocess.run(
        [sys.executable, "-c", script, str(smollm2_path), str(cases)], capture_output=True, text=True, timeout=300
    )
    took = time.monotonic() - t0
    lines = [json.loads(line) for line in p.stdout.splitlines() if line.startswith("{")]
    last = next((x["case"] for x in reversed(lines) if x.get("started")), None)
    assert p.returncode == 0, f"the child died (rc {p.returncode}) during {last!r}: {p.stderr[-2000:]}"
    results = {x["case"]: x for x in lines if "error" in x}
    for name, _, _, words in CRASHERS + UNFOLLOWABLE:
        got = results[name]
        assert got["error"] is not None, f"{name} was accepted"
        msg = got["error"]
        assert words in msg, (name, msg)
        assert "\n" not in msg and "non-verbose" not in msg and len(msg) < 400, (name, msg)
        assert got["field"] == "constraint"
    assert p.stderr == "" or "Warning" not in p.stderr, p.stderr[-2000:]  # llguidance's log is off
    assert took < 120, took


@pytest.fixture(scope="module")
def tok(smollm2_path):
    from toy.tokenizer.tokenizer import Tokenizer

    return Tokenizer.from_file(smollm2_path)


@pytest.mark.parametrize(
    ("c", "words"),
    [
        (Constraint.grammar("start: " + "(" * 70 + '"a"' + ")" * 70), "nests brackets"),
        (Constraint.regex("(" * 70 + "a" + ")" * 70), "nests groups"),
        (Constraint.json_schema({"type": "object", "patternProperties": {f"^p{i}$": {} for i in range(101)}}), "patternProperties"),
        (Constraint.json_schema({"type": "object", "properties": {"a": {"type": "string", "pattern": "(" * 70 + ")" * 70}}}), "pattern"),
        (Constraint.json_schema(ref_chain(101)), "$ref"),
        (Constraint.grammar(lark_chain(2000)), "rules"),
        (Constraint.grammar(gbnf_chain(2500).replace("\n", "\r")), "rules"),  # GBNF ends a line at a lone CR too
    ],
)  # fmt: skip
def test_precheck_limits_name_what_is_past_them(tok, c, words):
    with pytest.raises(ConstraintError, match="at most") as e:
        constrain.prepare(c, tok)
    assert words in str(e.value) and "ConstraintLimits." in (e.value.hint or "")


def test_the_limits_allow_what_is_at_them(tok):
    """Just under each limit compiles (and the compile thread's stack holds it)."""
    for c in [
        Constraint.grammar(lark_chain(1990)),
        Constraint.json_schema(ref_chain(99)),
        Constraint.json_schema(ref_chain(99, "items")),
        Constraint.regex("(" * 60 + "a" + ")" * 60),
    ]:
        assert constrain.prepare(c, tok).compiled is not None


def test_deep_nesting_is_refused_before_anything_recursive(tok):
    deep: dict = {"type": "integer"}
    for _ in range(2000):
        deep = {"type": "array", "items": deep}
    with pytest.raises(ConstraintError, match="nest"):
        Constraint.json_schema(deep)
    with pytest.raises(ConstraintError, match="nest"):
        Constraint.json_schema('{"items": ' * 2000 + "{}" + "}" * 2000)  # json.loads' own recursion limit
    mid: dict = {"type": "integer"}
    for _ in range(100):
        mid = {"type": "array", "items": mid}
    with pytest.raises(ConstraintError, match="at most 64"):
        constrain.prepare(Constraint.json_schema(mid), tok)


def test_a_constraint_failing_mid_output_fails_its_sampler_with_its_origin(tok):
    """Accepted when prepared (nothing is wrong until a space), then the parser's limit at the third token."""
    import dataclasses

    c = dataclasses.replace(Constraint.grammar('root ::= [a-z]+ " " "a"{100000}'), origin="grammar")
    c = constrain.prepare(c, tok)
    m = constrain.Matcher(c, tok, tok.vocab_size)
    word, space = tok.encode("abc", add_special=False)[0], tok.encode(" ", add_special=False)[0]
    with pytest.raises(ConstraintError) as e:
        for t in [word, space, None, None]:
            allowed = m.allowed()
            t = int(np.flatnonzero(allowed)[-1]) if t is None else t
            assert allowed[t]
            m.advance(t)
    assert e.value.field == "grammar"
    assert "after 2 tokens" in str(e.value) and "\n" not in str(e.value)


def test_compiled_once_and_copied_per_sequence(tok, monkeypatch):
    from toy.engine.sampling import Sampler, SamplingParams

    calls = []
    real = constrain._compile
    monkeypatch.setattr(constrain, "_compile", lambda c, lt: calls.append(c) or real(c, lt))
    c = constrain.prepare(Constraint.json_schema({"type": "object", "properties": {"a": {"type": "integer"}}}), tok)
    assert len(calls) == 1
    assert constrain.prepare(c, tok) is c  # prepared already: nothing to do
    samplers = [Sampler(SamplingParams.greedy(constraint=c), tok.vocab_size, tok) for _ in range(4)]
    assert len(calls) == 1
    # each copy is its own position: advancing one leaves the others at the start
    brace = tok.encode("{", add_special=False)[0]
    samplers[0].matcher.advance(brace)
    assert samplers[1].matcher.allowed()[brace]
    assert not samplers[0].matcher.allowed()[brace]
    # an unprepared constraint is prepared by its Matcher (once per Matcher)
    Sampler(SamplingParams.greedy(constraint=Constraint.regex("[0-9]+")), tok.vocab_size, tok)
    assert len(calls) == 2


def test_a_compile_past_the_deadline_is_refused(tok):
    slow = Constraint.json_schema(
        {"type": "object", "patternProperties": {f"^p{i}[a-z]*$": {"type": "integer"} for i in range(100)}}
    )
    t0 = time.monotonic()
    with pytest.raises(ConstraintError, match="took longer than 0.02 s"):
        constrain.prepare(slow, tok, ConstraintLimits(compile_timeout=0.02))
    assert time.monotonic() - t0 < 0.5
    with pytest.raises(BadInputError, match="compile_timeout"):
        ConstraintLimits(compile_timeout=0).validate()


def test_overdue_compiles_hold_their_places_until_they_end(tok, monkeypatch):
    """A compile past its deadline keeps running (a thread cannot be stopped); at most MAX_COMPILING run at once,
    so hostile constraints cannot pile up threads: the next one is ConstraintBusyError once its deadline passes."""
    import threading

    gate = threading.Event()
    real = constrain._compile

    def stuck(c, lt):  # a compile that ends only when the test says so
        gate.wait(30)
        return real(c, lt)

    # compiles that earlier tests left past their deadline finish in the background and hold their places
    # until then (on a loaded machine, for seconds): wait until every place is free, so the count below is ours
    for _ in range(constrain.MAX_COMPILING):
        assert constrain._COMPILING.acquire(timeout=120), "an earlier test's compile never ended"
    for _ in range(constrain.MAX_COMPILING):
        constrain._COMPILING.release()
    monkeypatch.setattr(constrain, "_compile", stuck)
    fast = ConstraintLimits(compile_timeout=0.05)
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    try:
        for _ in range(constrain.MAX_COMPILING):
            with pytest.raises(ConstraintError, match="took longer than 0.05 s"):
                constrain.prepare(Constraint.json_schema(schema), tok, fast)
        alive = [t for t in threading.enumerate() if t.name == "toy-constraint-compile"]
        assert len(alive) == constrain.MAX_COMPILING
        t0 = time.monotonic()
        with pytest.raises(constrain.ConstraintBusyError, match="still compiling"):
            constrain.prepare(Constraint.json_schema(schema), tok, fast)
        assert 0.04 < time.monotonic() - t0 < 1.0  # waited its own deadline for a place, no longer
        assert not isinstance(constrain.ConstraintBusyError("x"), BadInputError)  # not the request's fault
    finally:
        gate.set()
    for t in alive:
        t.join(30)
    # every place is free again: a normal compile goes through
    monkeypatch.setattr(constrain, "_compile", real)
    assert constrain.prepare(Constraint.json_schema(schema), tok).compiled is not None


def test_toy_infer_refuses_a_chain_of_rules(smollm2_path, tmp_path):
    g = tmp_path / "chain.lark"
    g.write_text(lark_chain(3000))
    exe = Path(sys.executable).parent / "toy"
    env = {**os.environ, "NO_COLOR": "1"}
    p = subprocess.run(
        [str(exe), "infer", str(smollm2_path), "-p", "Hi", "-n", "4", "--grammar", str(g), "--threads", "1"],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert p.returncode == 2, (p.returncode, p.stderr[-2000:])
    assert "error:" in p.stderr and "rules" in p.stderr and "hint:" in p.stderr, p.stderr
