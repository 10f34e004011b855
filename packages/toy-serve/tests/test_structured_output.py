"""Structured output through toy serve, driven by the official openai client.

Thirty JSON schemas (nested objects, arrays with min/max items, enums, numbers
with bounds, required and optional properties, ``anyOf``, patterns, formats):
every response parses and validates with ``jsonschema`` (an implementation
independent of llguidance), greedy and sampled, streamed and not, alone and
eight at a time; greedy and seeded outputs are the same alone and together.
Then llama.cpp's ``grammar``/``json_schema`` fields, ``regex``, JSON mode, and
a constrained request batched with a free one.

The model is the real SmolLM2-135M-Instruct, on a server with eight slots.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import threading
import time

import pytest

jsonschema = pytest.importorskip("jsonschema")

pytestmark = pytest.mark.model

NAME = {"type": "string", "minLength": 1, "maxLength": 16}
WORD = {"type": "string", "maxLength": 12}
SCHEMAS = [
    {"type": "object", "properties": {"name": NAME, "age": {"type": "integer", "minimum": 0, "maximum": 120}},
     "required": ["name", "age"], "additionalProperties": False},
    {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"], "additionalProperties": False},
    {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}}, "required": ["color"],
     "additionalProperties": False},
    {"type": "object", "properties": {"tags": {"type": "array", "items": WORD, "minItems": 1, "maxItems": 3}},
     "required": ["tags"], "additionalProperties": False},
    {"type": "object", "properties": {"x": {"type": "number", "minimum": -1, "maximum": 1}},
     "required": ["x"], "additionalProperties": False},
    {"type": "object", "properties": {"p": {"type": "number", "exclusiveMinimum": 0, "exclusiveMaximum": 100}},
     "required": ["p"], "additionalProperties": False},
    {"type": "object", "properties": {"city": NAME, "country": NAME, "population": {"type": "integer", "minimum": 0}},
     "required": ["city", "country"], "additionalProperties": False},
    {"type": "object", "properties": {"a": {"anyOf": [{"type": "integer"}, {"type": "string", "maxLength": 8}]}},
     "required": ["a"], "additionalProperties": False},
    {"type": "object", "properties": {"user": {"type": "object", "properties": {"id": {"type": "integer"},
     "name": NAME}, "required": ["id", "name"], "additionalProperties": False}}, "required": ["user"],
     "additionalProperties": False},
    {"type": "object", "properties": {"points": {"type": "array", "items": {"type": "object", "properties": {
     "x": {"type": "integer", "minimum": -9, "maximum": 9}, "y": {"type": "integer", "minimum": -9, "maximum": 9}},
     "required": ["x", "y"], "additionalProperties": False}, "minItems": 2, "maxItems": 4}}, "required": ["points"],
     "additionalProperties": False},
    {"type": "object", "properties": {"answer": {"enum": ["yes", "no", "maybe"]}, "confidence": {"type": "number",
     "minimum": 0, "maximum": 1}}, "required": ["answer", "confidence"], "additionalProperties": False},
    {"type": "object", "properties": {"code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{3}$"}},
     "required": ["code"], "additionalProperties": False},
    {"type": "object", "properties": {"date": {"type": "string", "pattern": "^20[0-9]{2}-[01][0-9]-[0-3][0-9]$"}},
     "required": ["date"], "additionalProperties": False},
    {"type": "array", "items": {"type": "integer", "minimum": 1, "maximum": 99}, "minItems": 3, "maxItems": 5},
    {"type": "array", "items": {"enum": ["a", "b", "c"]}, "minItems": 1, "maxItems": 4},
    {"type": "object", "properties": {"title": NAME, "year": {"type": "integer", "minimum": 1900, "maximum": 2030},
     "genres": {"type": "array", "items": {"enum": ["drama", "comedy", "action"]}, "maxItems": 2}},
     "required": ["title", "year", "genres"], "additionalProperties": False},
    {"type": "object", "properties": {"value": {"anyOf": [{"type": "boolean"}, {"type": "null"},
     {"type": "integer", "minimum": 0, "maximum": 9}]}}, "required": ["value"], "additionalProperties": False},
    {"type": "object", "properties": {"first": NAME, "middle": NAME, "last": NAME}, "required": ["first", "last"],
     "additionalProperties": False},
    {"type": "object", "properties": {"matrix": {"type": "array", "items": {"type": "array", "items": {
     "type": "integer", "minimum": 0, "maximum": 9}, "minItems": 2, "maxItems": 2}, "minItems": 2, "maxItems": 2}},
     "required": ["matrix"], "additionalProperties": False},
    {"type": "object", "properties": {"status": {"const": "done"}, "count": {"type": "integer", "minimum": 0,
     "maximum": 1000}}, "required": ["status", "count"], "additionalProperties": False},
    {"type": "object", "properties": {"price": {"type": "number", "minimum": 0, "maximum": 1000},
     "currency": {"enum": ["EUR", "USD", "GBP"]}}, "required": ["price", "currency"], "additionalProperties": False},
    {"type": "object", "properties": {"item": {"anyOf": [
     {"type": "object", "properties": {"kind": {"const": "book"}, "pages": {"type": "integer", "minimum": 1,
      "maximum": 2000}}, "required": ["kind", "pages"], "additionalProperties": False},
     {"type": "object", "properties": {"kind": {"const": "film"}, "minutes": {"type": "integer", "minimum": 1,
      "maximum": 300}}, "required": ["kind", "minutes"], "additionalProperties": False}]}},
     "required": ["item"], "additionalProperties": False},
    {"type": "object", "properties": {"email": {"type": "string", "pattern": "^[a-z]{1,8}@[a-z]{1,8}\\.com$"}},
     "required": ["email"], "additionalProperties": False},
    {"type": "object", "properties": {"steps": {"type": "array", "items": {"type": "object", "properties": {
     "n": {"type": "integer", "minimum": 1, "maximum": 9}, "text": WORD}, "required": ["n", "text"],
     "additionalProperties": False}, "minItems": 1, "maxItems": 3}}, "required": ["steps"],
     "additionalProperties": False},
    {"type": "object", "properties": {"lat": {"type": "number", "minimum": -90, "maximum": 90, "multipleOf": 0.001},
     "lon": {"type": "number", "minimum": -180, "maximum": 180, "multipleOf": 0.001}}, "required": ["lat", "lon"],
     "additionalProperties": False},
    {"type": "object", "properties": {"flags": {"type": "object", "properties": {"a": {"type": "boolean"},
     "b": {"type": "boolean"}, "c": {"type": "boolean"}}, "required": ["a", "b", "c"], "additionalProperties": False}},
     "required": ["flags"], "additionalProperties": False},
    {"type": "object", "properties": {"level": {"type": "integer", "enum": [1, 2, 3]}, "label": WORD},
     "required": ["level"], "additionalProperties": False},
    {"type": "object", "properties": {"pair": {"type": "array", "prefixItems": [NAME, {"type": "integer",
     "minimum": 0, "maximum": 99}], "items": False, "minItems": 2}}, "required": ["pair"],
     "additionalProperties": False},
    {"type": "object", "properties": {"id": {"type": "string", "pattern": "^[0-9a-f]{8}$"}, "parent": {"anyOf": [
     {"type": "string", "pattern": "^[0-9a-f]{8}$"}, {"type": "null"}]}}, "required": ["id", "parent"],
     "additionalProperties": False},
    {"$defs": {"node": {"type": "object", "properties": {"v": {"type": "integer", "minimum": 0, "maximum": 9}},
     "required": ["v"], "additionalProperties": False}}, "type": "object", "properties": {"left": {"$ref":
     "#/$defs/node"}, "right": {"$ref": "#/$defs/node"}}, "required": ["left", "right"],
     "additionalProperties": False},
]  # fmt: skip
MAX_TOKENS = 200


def messages(i: int) -> list[dict]:
    schema = json.dumps(SCHEMAS[i])
    return [{"role": "user", "content": f"Reply with JSON that follows this schema: {schema}"}]


def fmt(i: int) -> dict:
    return {"type": "json_schema", "json_schema": {"name": f"s{i}", "schema": SCHEMAS[i], "strict": True}}


def check(i: int, text: str, finish: str) -> None:
    assert finish == "stop", (i, text)
    jsonschema.validate(json.loads(text), SCHEMAS[i])


@pytest.fixture(scope="module")
def live8(smollm2_path, serve_settings, serving):
    import toy

    with toy.load(smollm2_path, n_ctx=1024, n_slot=8, threads=2, exact_batching=True) as m:
        with serving(serve_settings(), m) as s:
            yield s


@pytest.fixture(scope="module")
def client8(live8):
    with live8.client() as c:
        yield c


async def _chat(c, i: int, kw: dict, stream: bool) -> tuple[str, str]:
    if not stream:
        r = await c.chat.completions.create(messages=messages(i), response_format=fmt(i), **kw)
        return r.choices[0].message.content, r.choices[0].finish_reason
    parts, finish = [], None
    s = await c.chat.completions.create(messages=messages(i), response_format=fmt(i), stream=True, **kw)
    async for chunk in s:
        for ch in chunk.choices:
            parts.append(ch.delta.content or "")
            finish = ch.finish_reason or finish
    return "".join(parts), finish


def together(live, kw: dict, stream: bool, width: int = 8) -> list[tuple[str, str]]:
    """All schemas at once, at most ``width`` requests in flight."""

    async def run():
        gate = asyncio.Semaphore(width)
        async with live.async_client() as c:

            async def one(i):
                async with gate:
                    return await _chat(c, i, kw, stream)

            return await asyncio.gather(*(one(i) for i in range(len(SCHEMAS))))

    return asyncio.run(run())


@contextlib.contextmanager
def widest_batch(live):
    """Poll the server's active-sequence gauge while the block runs; yields the list of readings."""
    seen, done = [0], threading.Event()

    def poll():
        while not done.is_set():
            seen.append(live.metric("toy_active_sequences") or 0)
            time.sleep(0.01)

    t = threading.Thread(target=poll, daemon=True)
    t.start()
    try:
        yield seen
    finally:
        done.set()
        t.join()


def alone(live, kw: dict, stream: bool) -> list[tuple[str, str]]:
    async def run():
        async with live.async_client() as c:
            return [await _chat(c, i, kw, stream) for i in range(len(SCHEMAS))]

    return asyncio.run(run())


@pytest.mark.parametrize(
    "kw",
    [{"temperature": 0}, {"temperature": 0.8, "seed": 11}],
    ids=["greedy", "sampled"],
)
def test_thirty_schemas_validate_alone_and_eight_at_a_time(live8, kw):
    """Each schema's response validates, streamed alone and plain eight at a time, and the two are the same
    text (greedy and seeded outputs do not depend on the batch)."""
    kw = {"model": live8.srv.settings.alias, "max_tokens": MAX_TOKENS, **kw}
    solo = alone(live8, kw, stream=True)
    for i, (text, finish) in enumerate(solo):
        check(i, text, finish)
    with widest_batch(live8) as seen:
        batched = together(live8, kw, stream=False)
    for i, (text, finish) in enumerate(batched):
        check(i, text, finish)
    assert batched == solo
    assert max(seen) == 8  # eight sequences really held slots at once


def test_streamed_eight_at_a_time_equal_plain_alone(live8, client8):
    """The other two corners: plain alone and streamed together, greedy, on the first eight schemas."""
    kw = {"model": live8.srv.settings.alias, "max_tokens": MAX_TOKENS, "temperature": 0}
    plain = []
    for i in range(8):
        r = client8.chat.completions.create(messages=messages(i), response_format=fmt(i), **kw)
        plain.append((r.choices[0].message.content, r.choices[0].finish_reason))
        check(i, *plain[-1])

    async def run():
        async with live8.async_client() as c:
            return await asyncio.gather(*(_chat(c, i, kw, True) for i in range(8)))

    assert asyncio.run(run()) == plain


def test_constrained_and_free_decode_together(live8, client8, ref_model):
    """A constrained request and free ones in flight at once: the free ones equal the library's greedy
    output (the mask of one sequence does not leak into another), the constrained one validates."""
    alias = live8.srv.settings.alias
    prompts = ["Once upon a time", "The capital of France is", "def add(a, b):"]

    async def run():
        async with live8.async_client() as c:
            free = [c.completions.create(model=alias, prompt=p, max_tokens=24, temperature=0) for p in prompts]
            constrained = _chat(c, 0, {"model": alias, "max_tokens": MAX_TOKENS, "temperature": 0}, True)
            return await asyncio.gather(constrained, *free)

    (text, finish), *free = asyncio.run(run())
    check(0, text, finish)
    for p, r in zip(prompts, free):
        assert r.choices[0].text == ref_model.generate(p, temperature=0, max_tokens=24).text


def test_json_object_mode(client8, live8):
    for stream in (False, True):
        kw = {"model": live8.srv.settings.alias, "max_tokens": MAX_TOKENS, "temperature": 0}
        msgs = [{"role": "user", "content": "Return a JSON object with the keys city and country for Paris."}]
        if stream:
            chunks = client8.chat.completions.create(
                messages=msgs, response_format={"type": "json_object"}, stream=True, **kw
            )
            body = [ch.choices[0] for ch in chunks if ch.choices]
            text, finish = "".join(c.delta.content or "" for c in body), body[-1].finish_reason
        else:
            r = client8.chat.completions.create(messages=msgs, response_format={"type": "json_object"}, **kw)
            text, finish = r.choices[0].message.content, r.choices[0].finish_reason
        assert finish == "stop" and isinstance(json.loads(text), dict), text


def test_llama_cpp_fields_on_completions(live8):
    """llama.cpp's ``json_schema`` and ``grammar`` (GBNF) fields and toy's ``regex``, on /v1/completions."""
    http, alias = live8.http, live8.srv.settings.alias
    base = {"model": alias, "prompt": "Question: is the sky blue? Answer:", "max_tokens": 40, "temperature": 0}
    r = http.post("/v1/completions", json={**base, "grammar": 'root ::= " yes" | " no"'}).json()
    assert r["choices"][0]["text"] in (" yes", " no") and r["choices"][0]["finish_reason"] == "stop"
    r = http.post("/v1/completions", json={**base, "json_schema": SCHEMAS[10]}).json()
    check(10, r["choices"][0]["text"], r["choices"][0]["finish_reason"])
    rx = r" [0-9]{1,3}(, [0-9]{1,3}){2}\."
    r = http.post("/v1/completions", json={**base, "prompt": "Three numbers:", "regex": rx}).json()
    assert re.fullmatch(rx, r["choices"][0]["text"]), r
    # Lark works in the grammar field too
    r = http.post("/v1/completions", json={**base, "grammar": 'start: " " ("red" | "blue")'}).json()
    assert r["choices"][0]["text"] in (" red", " blue")
    # sampled, several choices: each matches
    r = http.post("/v1/completions", json={**base, "regex": rx, "temperature": 1.0, "n": 4, "seed": 3}).json()
    assert all(re.fullmatch(rx, c["text"]) for c in r["choices"]), r
