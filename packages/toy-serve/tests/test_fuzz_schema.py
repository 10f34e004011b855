"""Property-based fuzzing of the POST endpoints from the server's own OpenAPI schema (schemathesis).

For each POST operation of /openapi.json, schemathesis generates requests
that fit the schema (positive) and requests that break it (negative), and
sends them to a LIVE server. The properties, from app.py's invariants:

- no response is a 5xx (schemathesis' ``not_a_server_error`` check): the
  schema states the real constraints and anything else is the client's
  error (4xx);
- every error is in OpenAI's shape ``{"error": {"message", "type", "param",
  "code"}}`` and carries ``x-request-id``;
- a positive example is never refused as malformed: its status is 200, or
  400 only for the checks the schema cannot state (the context budget,
  token ids outside the vocabulary, the jobs-per-request bound, the
  unsupported options), each with its documented ``code``/``param``. A
  positive example's ``model`` is set to the served alias (a random name
  would only ever get ``model_not_found``).

``POST /v1/adapters`` is fuzzed like the others against a server whose only
``--adapter-dir`` is an empty temporary folder: no example can load a file
(a path outside the folder is a 403 never opened, one inside a 400 naming
``path``); ``GET /v1/adapters`` and ``DELETE /v1/adapters/{name}`` get
positive examples only (their one input is a path string), never a 5xx, and
nothing to delete (404).

Big values (``test_fuzz_big_values``, hypothesis without schemathesis): for
every field the request schema names (nested ones too: ``messages.0.content``,
``messages.0.content.0.text``, ``stream_options.include_usage``, ...), a
valid request with that one field replaced by a long string (up to 120,000
characters, and one size past ``max_body_bytes``), a large array (up to
100,000 items and 0.8 ``max_body_bytes`` of JSON: token ids, huge integers,
long or empty strings, nulls, objects, nested arrays) or a large object (up
to 20,000 keys). Values are built by repeating a small drawn piece
(hypothesis draws the piece, the size and the field), so examples stay cheap
to generate. Among the items are values json.dumps cannot write, spliced
into the body's text instead: an integer of 5,000 digits, a lone surrogate
(``"\\ud800"``) and 100 nested arrays. The properties:

- the answer is 200, or 400 or 413 (past the body limit only) in OpenAI's
  shape, never a 5xx or a dropped connection, and the server keeps serving;
- every 400 names the field (``param``) or carries a ``code``: never a bare
  "there was an error parsing the body";
- a body with a spliced value gets 400 ``invalid_json`` (the integer, the
  nesting) or ``invalid_value`` (the surrogate), or 413.

Deep and recursive constraints (``test_fuzz_deep_and_recursive_constraints``,
hypothesis without schemathesis: the OpenAPI schema says nothing of a
constraint's depth): grammars, regexes and JSON schemas with chains, cycles
and nesting on both sides of each constraint limit, in every field a
constraint can come in. Each answer is 200 or a 400 naming that field; the
server keeps serving.

Bounded work: the server runs over its own copy of the model with a 64-token
context and 2 slots, and ``max_batch=4``, so a request is at most 4 jobs of
64 tokens (the budget check refuses more before anything runs).
"""

from __future__ import annotations

import copy
import json
import os
import re
import time

import pytest

pytestmark = [pytest.mark.model, pytest.mark.slow]

POST_PATHS = ["/v1/completions", "/v1/chat/completions", "/v1/embeddings", "/tokenize", "/detokenize", "/v1/adapters"]
# POST /v1/adapters: the server's --adapter-dir is an empty temporary folder, so no example loads a file; a path
# outside it is a 403 (never opened), one inside a 400 naming ``path`` (no such file)
FORBIDDEN_OK = {"/v1/adapters"}
# A longer hunt: TOY_FUZZ_EXAMPLES=300 TOY_FUZZ_RANDOM=1 (new examples each run instead of the fixed ones).
MAX_EXAMPLES = int(os.environ.get("TOY_FUZZ_EXAMPLES", "25"))
# 400s a schema-valid request may still get, each named by its code or param (app.py, schemas.py)
ALLOWED_400 = {
    ("context_length_exceeded", None),
    (None, "n"),
    (None, "prompt"),
    (None, "input"),
    (None, "tokens"),
    (None, "logit_bias"),
    (None, "suffix"),
    (None, "best_of"),
    (None, "tools"),
    (None, "response_format"),
    (None, "json_schema"),
    (None, "grammar"),
    (None, "regex"),
    (None, "lora"),
    (None, "top_logprobs"),
    (None, "dimensions"),
    (None, "functions"),
    (None, "function_call"),
    (None, "tool_choice"),
    (None, "path"),
    (None, "id_slot"),  # POST /slots/{id_slot}: a slot past --parallel
    (None, "filename"),  # a slot file name with a path separator, '..', a leading dot, or no such file
}
# params of a positive example's 400 matched whole (a message's tool call fields: schemas.py refuses them)
ALLOWED_400_PARAMS = re.compile(r"messages\.\d+\.(tool_calls|function_call)")


@pytest.fixture(scope="module")
def fuzz_live(smollm2_path, serve_settings, serving, tmp_path_factory):
    import toy

    m = toy.load(smollm2_path, n_ctx=64, n_slot=2, threads=2, exact_batching=True)
    empty = str(tmp_path_factory.mktemp("fuzz-adapters"))  # POST /v1/adapters finds nothing to load here
    try:
        slots = str(tmp_path_factory.mktemp("fuzz-slots"))  # POST /slots/{id}?action=save writes here
        settings = serve_settings(max_batch=4, max_queue=16, adapter_dirs=(empty,), slot_save_path=slots)
        with serving(settings, m) as live:
            yield live
    finally:
        m.close()


@pytest.fixture(scope="module")
def schema(fuzz_live):
    import schemathesis

    return schemathesis.openapi.from_url(fuzz_live.url + "/openapi.json")


def _error(response) -> dict:
    body = json.loads(response.content)
    assert set(body) == {"error"}, body
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert isinstance(err["message"], str) and err["message"]
    return err


@pytest.mark.parametrize("mode", ["positive", "negative"])
@pytest.mark.parametrize("path", [*POST_PATHS, "/slots/{id_slot}"])  # slot save/restore: no JSON body to grow
def test_fuzz_no_server_errors(fuzz_live, schema, path, mode):
    from hypothesis import HealthCheck, Phase, given, settings
    from schemathesis import GenerationMode
    from schemathesis.checks import not_a_server_error

    op = schema[path]["POST"]
    alias = fuzz_live.srv.settings.alias
    generation = GenerationMode.POSITIVE if mode == "positive" else GenerationMode.NEGATIVE
    seen: dict[int, int] = {}

    @settings(
        max_examples=MAX_EXAMPLES,
        deadline=None,
        database=None,
        derandomize=os.environ.get("TOY_FUZZ_RANDOM") != "1",  # CI: the same examples every run
        phases=[Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    @given(case=op.as_strategy(generation_mode=generation))
    def run(case):
        if mode == "positive" and isinstance(case.body, dict) and "model" in case.body:
            case.body["model"] = alias  # a random name is refused first (model_not_found): go further
        response = case.call(base_url=fuzz_live.url, timeout=120)
        seen[response.status_code] = seen.get(response.status_code, 0) + 1
        case.validate_response(response, checks=[not_a_server_error])
        assert response.headers.get("x-request-id"), response.headers
        if response.status_code >= 400:
            err = _error(response)
            if mode == "positive" and response.status_code == 400:
                param = (err["param"] or "").split(".")[0] or None
                allowed = (err["code"], None) in ALLOWED_400 or (None, param) in ALLOWED_400
                assert allowed or ALLOWED_400_PARAMS.fullmatch(err["param"] or ""), (case.body, err)
            if mode == "positive":
                forbidden = path in FORBIDDEN_OK and response.status_code == 403 and err["code"] == "path_not_allowed"
                # a random ``lora`` name: no such adapter is loaded (404 model_not_found, as after its DELETE)
                unloaded = response.status_code == 404 and err["param"] == "lora" and err["code"] == "model_not_found"
                assert response.status_code in (400, 413) or forbidden or unloaded, (case.body, err)

    run()
    assert sum(seen.values()) >= 1
    # the server is still up and answering afterwards
    assert fuzz_live.http.get("/health").status_code == 200
    # nothing is left in the worker: a request that ended early (an error after its jobs were queued) has its jobs
    # cancelled, and the worker ends them at its next step, which may come just after the response
    deadline = time.monotonic() + 10
    while fuzz_live.srv.worker.busy() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert fuzz_live.srv.worker.busy() == 0


# -- long strings, large arrays and objects on every field

BIG_EXAMPLES = int(os.environ.get("TOY_FUZZ_BIG_EXAMPLES", "30"))
# placeholders replaced in the body's JSON text (json.dumps cannot write these), and the code each must get
SPLICE = {
    "@huge-int@": ("1" + "0" * 5000, "invalid_json"),
    "@lone-surrogate@": ('"a\\ud800"', "invalid_value"),
    "@deep@": ("[" * 100 + "]" * 100, "invalid_json"),
}
BASE = {
    "/v1/completions": {"prompt": "Hi", "max_tokens": 1},
    "/v1/chat/completions": {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1},
    "/v1/embeddings": {"input": "Hi"},
    "/tokenize": {"content": "Hi"},
    "/detokenize": {"tokens": [1]},
    "/v1/adapters": {"name": "a", "path": "missing.gguf"},
}


def splice(text: str) -> str:
    """``text`` with each ``SPLICE`` placeholder (a JSON string) replaced by its raw JSON."""
    for mark, (raw, _) in SPLICE.items():
        text = text.replace(f'"{mark}"', raw)
    return text


def field_paths(spec: dict, path: str) -> list[tuple]:
    """Every field of ``path``'s request body schema, as key paths (a list's items at index 0)."""
    schemas = spec["components"]["schemas"]
    body = spec["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]
    out: list[tuple] = []

    def walk(node: dict, at: tuple, depth: int) -> None:
        while "$ref" in node:
            node = schemas[node["$ref"].rsplit("/", 1)[1]]
        if depth > 4:
            return
        for member in node.get("anyOf", []) + node.get("oneOf", []) + node.get("allOf", []):
            walk(member, at, depth)
        if node.get("type") == "array" and isinstance(node.get("items"), dict):
            walk(node["items"], (*at, 0), depth + 1)
        for name, sub in node.get("properties", {}).items():
            if (*at, name) not in out:
                out.append((*at, name))
            walk(sub, (*at, name), depth + 1)

    walk(body, (), 0)
    return out


def put(body: dict, at: tuple, value) -> dict:
    """``body`` with the field at key path ``at`` set to ``value`` (containers created on the way)."""
    body = copy.deepcopy(body)
    node = body
    for key, nxt in zip(at, at[1:]):
        empty = [] if isinstance(nxt, int) else {}
        if isinstance(key, int):
            if not isinstance(node, list):
                return body  # the path crosses a value that is not a list here: leave the body as it is
            while len(node) <= key:
                node.append(empty)
            if not isinstance(node[key], type(empty)):
                node[key] = empty
        else:
            if not isinstance(node, dict):
                return body
            if not isinstance(node.get(key), type(empty)):
                node[key] = empty
        node = node[key]
    if isinstance(at[-1], int):
        if isinstance(node, list):
            node[:1] = [value]
    elif isinstance(node, dict):
        node[at[-1]] = value
    return body


def big_values(limit: int):
    """Long strings, large arrays and large objects, built by repeating a small drawn piece. An array or
    object holds at most about 0.8 ``limit`` bytes of JSON; one value in eight goes past ``limit`` (413)."""
    from hypothesis import strategies as st

    def times(x, n: int) -> int:
        return max(1, min(n, int(0.8 * limit) // (len(splice(json.dumps(x))) + 2)))

    piece = st.text(min_size=1, max_size=6)
    sizes = st.sampled_from([1_000, 20_000, 120_000])
    string = st.builds(lambda p, n: (p * n)[:n], piece, sizes)
    past_limit = st.builds(lambda p: (p * (limit + 1))[: limit + 1], piece)  # 413
    item = st.one_of(
        st.sampled_from(sorted(SPLICE)),
        st.integers(0, 100),
        st.integers(2**63, 2**200),
        st.just(""),
        st.just(None),
        piece,
        st.builds(lambda p: p * 500, piece),
        st.builds(lambda p: {"type": "text", "text": p}, piece),
        st.builds(lambda p: [p, 1], piece),
    )
    array = st.builds(lambda x, n: [x] * times(x, n), item, st.sampled_from([1_000, 10_000, 100_000]))
    obj = st.builds(lambda x, n: {f"k{i}": x for i in range(times(x, n))}, item, st.sampled_from([100, 20_000]))
    return st.one_of(string, array, obj, string, array, obj, array, past_limit)


@pytest.mark.parametrize("path", POST_PATHS)
def test_fuzz_big_values(fuzz_live, path):
    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis import strategies as st

    spec = fuzz_live.http.get("/openapi.json").json()
    fields = field_paths(spec, path)
    assert len(fields) >= 2, fields
    limit = fuzz_live.srv.settings.max_body_bytes
    seen: dict[int, int] = {}

    @settings(
        max_examples=BIG_EXAMPLES,
        deadline=None,
        database=None,
        derandomize=os.environ.get("TOY_FUZZ_RANDOM") != "1",
        phases=[Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    @given(at=st.sampled_from(fields), value=big_values(limit))
    def run(at, value):
        body = put(BASE[path], at, value)
        text = json.dumps(body)
        spliced = {code for mark, (_, code) in SPLICE.items() if f'"{mark}"' in text}
        data = splice(text).encode()
        r = fuzz_live.http.post(path, content=data, headers={"content-type": "application/json"})
        seen[r.status_code] = seen.get(r.status_code, 0) + 1
        where = ".".join(map(str, at))
        assert r.status_code < 500, (where, len(data), r.text[:500])
        if spliced and r.status_code != 413:
            assert r.status_code == 400, (where, spliced, r.text[:500])
        assert r.headers.get("x-request-id"), r.headers
        if r.status_code >= 400:
            forbidden = path in FORBIDDEN_OK and r.status_code == 403  # a long path that is absolute
            err = _error(r)
            # ``lora`` names a selectable adapter: one that is not loaded is a 404 model_not_found, as after its DELETE
            unloaded = where == "lora" and r.status_code == 404 and err["code"] == "model_not_found"
            assert r.status_code in (400, 413) or forbidden or unloaded, (where, r.status_code, r.text[:500])
            assert err["param"] is not None or err["code"] is not None, (where, err)
            if spliced and r.status_code == 400:
                assert err["code"] in spliced, (where, spliced, err)
            if r.status_code == 413:
                assert len(data) > limit, (where, len(data))

    run()
    assert sum(seen.values()) >= BIG_EXAMPLES // 2, seen
    assert fuzz_live.http.get("/health").status_code == 200
    assert fuzz_live.srv.worker.busy() == 0


@pytest.mark.parametrize(("path", "method"), [("/v1/adapters", "GET"), ("/v1/adapters/{name}", "DELETE")])
def test_fuzz_adapter_admin_routes(fuzz_live, schema, path, method):
    """The adapter list and DELETE: never a 5xx, errors in OpenAI's shape; nothing is loaded, so a DELETE of any
    name is a 404 (or 404 ``not_found`` for a name the route cannot hold, such as one with a '/')."""
    from hypothesis import HealthCheck, Phase, given, settings
    from schemathesis import GenerationMode
    from schemathesis.checks import not_a_server_error

    op = schema[path][method]
    seen: dict[int, int] = {}

    @settings(
        max_examples=MAX_EXAMPLES,
        deadline=None,
        database=None,
        derandomize=os.environ.get("TOY_FUZZ_RANDOM") != "1",
        phases=[Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    @given(case=op.as_strategy(generation_mode=GenerationMode.POSITIVE))  # a path's only input is a string
    def run(case):
        response = case.call(base_url=fuzz_live.url, timeout=60)
        seen[response.status_code] = seen.get(response.status_code, 0) + 1
        case.validate_response(response, checks=[not_a_server_error])
        assert response.headers.get("x-request-id"), response.headers
        if response.status_code >= 400:
            _error(response)
        assert response.status_code == (200 if method == "GET" else 404), response.text

    run()
    assert sum(seen.values()) >= 1
    assert fuzz_live.http.get("/v1/adapters").json()["data"] == []


# -- deep and recursive constraints (issue 42, items 8-10: test_hardening_constraints.py has the named cases)

CONSTRAINT_EXAMPLES = int(os.environ.get("TOY_FUZZ_CONSTRAINT_EXAMPLES", "30"))
CONSTRAINT_PARAMS = re.compile(
    r"grammar|regex|json_schema|response_format\.json_schema\.schema|tools(\.0\.function\.parameters)?"
)


def constraint_bodies():
    """Request bodies whose constraint is deep or recursive: chains of Lark or GBNF rules, nested brackets,
    repetitions and alternations, nested regex groups, ``$ref`` chains (bare, in ``items``, ``anyOf`` or
    ``properties``), ``$ref`` cycles with and without a way out, nested arrays and many ``patternProperties``;
    sizes on both sides of each limit (``toy.engine.constrain.ConstraintLimits``). The schema goes in as
    ``json_schema``, ``response_format`` or a forced tool call's parameters."""
    from hypothesis import strategies as st

    def lark_chain(n, alt):
        body = [f"r{i}: r{i + 1}" + (' | "x"' if alt else "") for i in range(n)]
        return "start: r0\n" + "\n".join(body) + f'\nr{n}: "a"\n'

    def gbnf_chain(n, alt):
        body = [f"r{i} ::= r{i + 1}" + (' | "x"' if alt else "") for i in range(n)]
        return "root ::= r0\n" + "\n".join(body) + f'\nr{n} ::= "a"\n'

    def ref_chain(n, wrap):
        defs = {}
        for i in range(n):
            ref = {"$ref": f"#/$defs/d{i + 1}"}
            defs[f"d{i}"] = {
                None: ref,
                "items": {"type": "array", "items": ref, "maxItems": 2},
                "anyOf": {"anyOf": [ref, {"type": "null"}]},
                "properties": {"type": "object", "properties": {"a": ref}},
            }[wrap]
        defs[f"d{n}"] = {"type": "integer"}
        return {"$defs": defs, "$ref": "#/$defs/d0"}

    def cycle(n, way_out):
        defs = {f"d{i}": {"$ref": f"#/$defs/d{(i + 1) % n}"} for i in range(n)}
        if way_out:  # a tree: each node an object with an optional child
            defs = {f"d{i}": {"type": "object", "properties": {"v": {"type": "integer"}, "c": {"$ref": f"#/$defs/d{(i + 1) % n}"}}, "required": ["v"]} for i in range(n)}  # fmt: skip
        return {"$defs": defs, "$ref": "#/$defs/d0"}

    def nested(depth):
        s = {"type": "integer"}
        for _ in range(depth):
            s = {"type": "array", "items": s, "maxItems": 1}
        return s

    def patterns(n):
        return {"type": "object", "patternProperties": {f"^p{i}[a-z]*$": {"type": "integer"} for i in range(n)}}

    sizes = st.sampled_from([1, 8, 99, 101, 1999, 2001, 3000, 5000])
    grammar = st.one_of(
        st.builds(lark_chain, sizes, st.booleans()),
        st.builds(gbnf_chain, sizes, st.booleans()),
        st.builds(lambda d: "start: " + "(" * d + '"a"' + ")" * d, st.sampled_from([3, 30, 63, 65, 500])),
        st.builds(lambda n: f'root ::= "a"{{{n}}}', st.sampled_from([1, 100, 100_000])),
        st.builds(
            lambda n: "root ::= " + " | ".join(f'"w{i}"' for i in range(n)), st.sampled_from([2, 300, 2001, 20_000])
        ),
    )
    regex = st.one_of(
        st.builds(lambda d: "(" * d + "a" + ")" * d, st.sampled_from([3, 63, 65, 1000])),
        st.sampled_from([r"[^\s\S]", "a{0}", "(a|b)*c"]),
    )
    schema = st.one_of(
        st.builds(ref_chain, sizes, st.sampled_from([None, "items", "anyOf", "properties"])),
        st.builds(cycle, st.sampled_from([1, 2, 50]), st.booleans()),
        st.just({"$ref": "#"}),
        st.builds(nested, st.sampled_from([3, 63, 65, 127, 300])),
        st.builds(patterns, st.sampled_from([1, 20, 101])),
    )
    chat = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    completion = {"prompt": "Hi", "max_tokens": 2}

    def tool(s):
        return {
            **chat,
            "tools": [{"type": "function", "function": {"name": "f", "parameters": s}}],
            "tool_choice": "required",
        }

    def rf(s):
        return {**chat, "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": s}}}

    return st.one_of(
        st.builds(lambda g: ("/v1/completions", {**completion, "grammar": g}), grammar),
        st.builds(lambda r: ("/v1/completions", {**completion, "regex": r}), regex),
        st.builds(lambda s: ("/v1/completions", {**completion, "json_schema": s}), schema),
        st.builds(lambda s: ("/v1/chat/completions", rf(s)), schema),
        st.builds(lambda s: ("/v1/chat/completions", tool(s)), schema),
    )


def test_fuzz_deep_and_recursive_constraints(fuzz_live):
    """Each answer is 200, or a 400 naming the constraint's field; never a 5xx or a dropped connection; the
    server keeps serving and nothing is left in the worker."""
    from hypothesis import HealthCheck, Phase, given, settings

    seen: dict[int, int] = {}

    @settings(
        max_examples=CONSTRAINT_EXAMPLES,
        deadline=None,
        database=None,
        derandomize=os.environ.get("TOY_FUZZ_RANDOM") != "1",
        phases=[Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    @given(case=constraint_bodies())
    def run(case):
        path, body = case
        r = fuzz_live.http.post(path, json={**body, "temperature": 0})
        seen[r.status_code] = seen.get(r.status_code, 0) + 1
        assert r.status_code in (200, 400), (path, r.status_code, r.text[:1000])
        assert r.headers.get("x-request-id"), r.headers
        if r.status_code == 400:
            err = _error(r)
            # a tool's schema is in the prompt too: past the 64-token context once the constraint compiled; a body
            # nested deeper than the server reads JSON (64 levels) is refused before any field is looked at
            codes = ("context_length_exceeded", "invalid_json")
            assert CONSTRAINT_PARAMS.fullmatch(err["param"] or "") or err["code"] in codes, err
            assert "\n" not in err["message"] and len(err["message"]) < 1000, err

    run()
    assert seen.get(400, 0) >= 1 and sum(seen.values()) >= CONSTRAINT_EXAMPLES // 2, seen
    assert fuzz_live.http.get("/health").status_code == 200
    deadline = time.monotonic() + 10
    while fuzz_live.srv.worker.busy() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert fuzz_live.srv.worker.busy() == 0
