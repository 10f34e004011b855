"""Hardening of the HTTP API: telemetry failures, unauthenticated floods, refused
tool fields that cannot be honoured, malformed JSON bodies and unparsable requests (guard.py's and
schemas.py's module docstrings).

The apps run over a tiny generated model (``toy_test_models.write_tiny_model``,
a few KB) in process: httpx's ASGI transport with the app's lifespan
(``asgi``), which re-raises anything that escapes the app, the way uvicorn
logs "Exception in ASGI application". The unparsable-request tests run a real
uvicorn on a free port, since those requests never reach the app.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import json
import socket
import threading
import time
from pathlib import Path

import httpx
import pytest

KEY = "sk-test-hardening"
PROMPT = {"prompt": [1, 2, 3], "max_tokens": 2, "temperature": 0}
CHAT = {"messages": [{"role": "user", "content": "t1t2"}], "max_tokens": 2, "temperature": 0}


TOKENS = [chr(c) for c in range(33, 127)] + ["\u0120", "<|end|>"]  # printable ASCII, space (byte-level BPE)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny model whose vocabulary spells printable ASCII one character a token (no merges)."""
    import toy
    from toy.gguf.reader import GGUFFile
    from toy.gguf.writer import GGUFWriter, copy_metadata
    from toy_testsupport import toy_test_models

    d = tmp_path_factory.mktemp("tiny")
    src = toy_test_models.write_tiny_model(d / "src.gguf", extra_metadata={"tokenizer.ggml.merges": []})
    w = GGUFWriter(d / "tiny.gguf")
    with GGUFFile(src) as f:
        copy_metadata(f, w, override={"tokenizer.ggml.tokens": TOKENS})
        for ti in f.tensors if isinstance(f.tensors, list) else f.tensors.values():
            w.add_tensor(ti.name, f.tensor_to_float(ti.name))
        w.write()
    m = toy.load(d / "tiny.gguf", n_ctx=64, n_slot=2, threads=1, exact_batching=True)
    yield m
    m.close()


def make_app(tiny, tmp_path, **kw):
    from toy_serve import Settings, create_app

    return create_app(Settings(model=str(tiny.path), runs_dir=str(tmp_path), drain_timeout=5.0, **kw), tiny)


@contextlib.asynccontextmanager
async def asgi(app):
    """The app's lifespan around an httpx client on its ASGI interface (app exceptions re-raised)."""
    tiny = app.state.toy.model
    tiny.engine.cache.clear()
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://toy", timeout=60) as client:
            yield client


def events(app) -> list[dict]:
    raw = (app.state.toy.writer.dir / "events.jsonl").read_bytes()
    assert raw.endswith(b"\n")
    return [json.loads(line) for line in raw.splitlines()]


def metric(text: str, name: str, labels: dict | None = None) -> float | None:
    from prometheus_client.parser import text_string_to_metric_families

    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in (labels or {}).items()):
                return s.value
    return None


def error_of(r: httpx.Response) -> dict:
    body = r.json()
    assert set(body) == {"error"}, body
    assert set(body["error"]) == {"message", "type", "param", "code"}, body
    return body["error"]


class FullDisk:
    """Wraps the run bundle's events file: while ``full``, a write stores a few bytes, then raises ENOSPC."""

    def __init__(self, f):
        self.f, self.full = f, True

    def write(self, data):
        if self.full:
            self.f.write(data[:5])
            raise OSError(errno.ENOSPC, "No space left on device")
        return self.f.write(data)

    def __getattr__(self, name):
        return getattr(self.f, name)


# -- item 4: a full --runs-dir


def test_a_full_runs_dir_never_fails_a_request(tiny, tmp_path, caplog):
    app = make_app(tiny, tmp_path)

    async def go():
        async with asgi(app) as c:
            writer = app.state.toy.writer
            writer._f = disk = FullDisk(writer._f)
            for _ in range(20):
                r = await c.post("/v1/completions", json=PROMPT)
                assert r.status_code == 200, r.text
            m = (await c.get("/metrics")).text
            assert metric(m, "toy_telemetry_errors_total") == 20
            assert metric(m, "toy_telemetry_ok") == 0
            assert metric(m, "toy_requests_total", {"endpoint": "/v1/completions", "status": "200"}) == 20
            disk.full = False  # space again: the next event goes in, after a note of what was lost
            assert (await c.post("/v1/completions", json=PROMPT)).status_code == 200
            m = (await c.get("/metrics")).text
            assert metric(m, "toy_telemetry_ok") == 1 and metric(m, "toy_telemetry_errors_total") == 20

    asyncio.run(go())
    recs = events(app)
    kinds = [e["kind"] for e in recs]
    assert kinds == ["run_start", "note", "request", "run_end"], kinds
    assert recs[1]["lost"] == 20
    assert recs[-1]["reason"] == "completed"
    warnings = [r for r in caplog.records if r.name == "toy.runs" and "cannot write" in r.getMessage()]
    assert len(warnings) == 1  # logged once, not once per request


def test_shutdown_with_a_full_runs_dir_is_quiet(tiny, tmp_path):
    app = make_app(tiny, tmp_path)

    async def go():
        async with asgi(app) as c:
            writer = app.state.toy.writer
            writer._f = FullDisk(writer._f)
            assert (await c.post("/v1/completions", json=PROMPT)).status_code == 200
        # the lifespan ended without raising: run_end was tried and lost

    asyncio.run(go())
    writer = app.state.toy.writer
    assert writer.ended and writer.errors == 2  # the request event and run_end
    assert [e["kind"] for e in events(app)] == ["run_start"]


# -- item 6: unauthenticated requests do not grow the run bundle


def test_unauthenticated_flood_leaves_the_bundle_small(tiny, tmp_path):
    app = make_app(tiny, tmp_path, api_key=KEY)
    n = 2000

    async def go():
        async with asgi(app) as c:
            path = app.state.toy.writer.dir / "events.jsonl"
            before = path.stat().st_size
            t0 = time.perf_counter()
            for i in range(n):
                headers = {"authorization": "Bearer wrong"} if i % 2 else {}
                r = await c.post("/v1/completions", json=PROMPT, headers=headers)
                assert r.status_code == 401
            took = time.perf_counter() - t0
            grown = path.stat().st_size - before
            print(f"\n{n} unauthenticated requests in {took:.2f} s: events.jsonl grew {grown} bytes")
            assert grown < 10_000, grown
            m = (await c.get("/metrics")).text
            assert metric(m, "toy_requests_total", {"endpoint": "/v1/completions", "status": "401"}) == n
            r = await c.post("/v1/completions", json=PROMPT, headers={"authorization": f"Bearer {KEY}"})
            assert r.status_code == 200

    asyncio.run(go())
    recs = events(app)
    notes = [e for e in recs if e["kind"] == "note"]
    assert len(notes) == 1 and notes[0]["unauthorized"] == 1  # the first one at once; then at most one a minute
    assert [e["status"] for e in recs if e["kind"] == "request"] == [200]
    assert recs[-1]["kind"] == "run_end" and recs[-1]["requests"] == 1


def test_refused_requests_note_is_rate_limited(tiny, tmp_path, monkeypatch):
    from toy_serve import guard

    app = make_app(tiny, tmp_path, api_key=KEY)
    clock = [1000.0]
    monkeypatch.setattr(guard.time, "monotonic", lambda: clock[0])

    async def go():
        async with asgi(app) as c:
            for step in (0, 1, 1, 30, 61, 62, 200):
                clock[0] = 1000.0 + step
                assert (await c.get("/v1/models")).status_code == 401

    asyncio.run(go())
    counts = [e["unauthorized"] for e in events(app) if e["kind"] == "note"]
    assert counts == [1, 4, 2]  # at 0 s, at 61 s (1, 1, 30, 61) and at 200 s (62, 200)


# -- tool fields that cannot be honoured answer 400 naming the field (tool calls themselves: test_tool_calls.py)

F = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
TOOL_FIELDS = [
    ({"functions": [{"name": "f", "parameters": {}}]}, "functions", "legacy"),
    ({"function_call": "auto"}, "function_call", "legacy"),
    ({"function_call": {"name": "f"}}, "function_call", "legacy"),
    ({"tool_choice": "required"}, "tool_choice", "no tools"),
    ({"tool_choice": {"type": "function", "function": {"name": "f"}}}, "tool_choice", "no tools"),
    ({"tools": [F], "tool_choice": {"type": "function", "function": {"name": "g"}}}, "tool_choice", "not one of"),
    ({"tools": [F, F]}, "tools", "twice"),
    ({"tools": [F], "tool_choice": "required", "regex": "a"}, "tool_choice", "cannot be combined"),
    ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools.0.function.name", "pattern"),
    ({"tool_choice": "always"}, "tool_choice", ""),
    (
        {
            "messages": [
                {"role": "user", "content": "t1"},
                {"role": "assistant", "content": None, "tool_calls": [{"id": "c", "type": "function"}]},
                {"role": "user", "content": "t2"},
            ]
        },
        "messages.1.tool_calls.0.function",
        "",
    ),
    (
        {"messages": [{"role": "assistant", "content": "t1", "function_call": {"name": "f", "arguments": "{}"}}]},
        "messages.0.function_call",
        "legacy",
    ),
]


def test_tool_fields_that_cannot_be_honoured_are_refused(tiny, tmp_path):
    app = make_app(tiny, tmp_path)

    async def go():
        async with asgi(app) as c:
            for extra, param, words in TOOL_FIELDS:
                r = await c.post("/v1/chat/completions", json={**CHAT, **extra})
                assert r.status_code == 400, (extra, r.text)
                err = error_of(r)
                assert err["param"] == param and words in err["message"], err
            # what asks for no tool call is accepted
            ok = {"tool_choice": "none", "function_call": "none", "functions": [], "tools": []}
            msg = {"role": "assistant", "content": "t3", "tool_calls": [], "function_call": None}
            body = {**CHAT, **ok, "messages": [*CHAT["messages"], msg], "parallel_tool_calls": False}
            r = await c.post("/v1/chat/completions", json=body)
            assert r.status_code == 200, r.text

    asyncio.run(go())


# -- a toy error's field becomes the error's param (toy.errors: the field is data, the message is never parsed)

# (path, the error's field, the param answered): toy's names become the API's, and a name the request has no
# field for (the engine's "ids", "prompt" on chat) is the endpoint's input field
FIELD_PARAMS = [
    ("/v1/completions", "repeat_penalty", "repetition_penalty"),
    ("/v1/completions", "stop_tokens", "stop"),
    ("/v1/completions", "stop.1", "stop.1"),
    ("/v1/completions", "logprobs", "logprobs"),
    ("/v1/chat/completions", "logprobs", "top_logprobs"),
    ("/v1/chat/completions", "presence_penalty", "presence_penalty"),
    ("/v1/completions", "prompt", "prompt"),
    ("/v1/chat/completions", "prompt", "messages"),
    ("/v1/chat/completions", "messages.0.content", "messages.0.content"),
    ("/v1/completions", "ids", "prompt"),
    ("/v1/completions", None, "prompt"),
]


def test_a_toy_errors_field_is_the_param(tiny, tmp_path, monkeypatch):
    from toy.engine.llm import ContextOverflowError
    from toy.errors import BadInputError
    from toy_serve import schemas

    app = make_app(tiny, tmp_path)
    raised: list[BaseException] = []

    def refuse(*args, **kw):
        raise raised[-1]

    monkeypatch.setattr(schemas, "sampling_params", refuse)

    async def go():
        async with asgi(app) as c:
            for path, field, param in FIELD_PARAMS:
                # a message that starts like "temperature=..." but a field that says otherwise: param follows the field
                raised.append(BadInputError("temperature=2 is what the message says", hint="h", field=field))
                r = await c.post(path, json=CHAT if "chat" in path else PROMPT)
                err = error_of(r)
                assert r.status_code == 400 and (err["param"], err["code"]) == (param, None), (path, field, err)
                assert err["message"] == "temperature=2 is what the message says (h)"
            raised.append(ContextOverflowError("too long", field="prompt"))
            r = await c.post("/v1/chat/completions", json=CHAT)
            err = error_of(r)
            assert r.status_code == 400 and (err["param"], err["code"]) == ("messages", "context_length_exceeded")

    asyncio.run(go())


@pytest.mark.parametrize(
    ("kw", "field"),
    [({"parallel": 0}, "parallel"), ({"kv_type": "q4"}, "kv_type"), ({"api_key": "a b"}, "api_key")],
)
def test_a_settings_error_carries_the_field(kw, field):
    from toy.errors import BadInputError
    from toy_serve import Settings

    with pytest.raises(BadInputError, match=field) as e:
        Settings(model="m", **kw)
    assert e.value.field == field


# -- item 12: bodies that are not well-formed JSON, lone surrogates


def raw(s: str) -> bytes:
    return s.encode("utf-8")


INVALID_JSON = [
    (b'{"prompt": "\xff\xfe"}', "not-utf8"),
    (b'{"prompt": "\xed\xa0\x80"}', "utf8-encoded-surrogate"),
    ('{"prompt": "x"}'.encode("utf-16"), "utf-16"),
    (raw('{"prompt": [1], "user": ' + "[" * 100_000 + "]" * 100_000 + "}"), "nested-100000"),
    (raw('{"prompt": [1], "user": ' + "[" * 100 + "]" * 100 + "}"), "nested-100"),
    (raw('{"prompt": [1], "max_tokens": 1' + "0" * 5000 + "}"), "huge-int"),
    (raw('{"prompt": [1' + "0" * 5000 + "]}"), "huge-token-id"),
    (b'{"prompt": "a\x00b"}', "nul-in-string"),
    (b"{bad json", "garbage"),
]


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/embeddings", "/tokenize"])
def test_malformed_json_is_invalid_json(tiny, tmp_path, path):
    app = make_app(tiny, tmp_path)

    async def go():
        async with asgi(app) as c:
            wrong = []
            for body, what in INVALID_JSON:
                r = await c.post(path, content=body, headers={"content-type": "application/json"})
                err = error_of(r) if r.status_code >= 400 else {}
                if r.status_code != 400 or err["code"] != "invalid_json" or err["param"] is not None:
                    wrong.append((what, r.status_code, err))
            assert not wrong, wrong
            # still serving; nesting within the limit is fine
            body = raw('{"prompt": [1, 2], "max_tokens": 1, "user": "u", "metadata": ' + "[" * 30 + "]" * 30 + "}")
            r = await c.post("/v1/completions", content=body, headers={"content-type": "application/json"})
            assert r.status_code == 200, r.text

    asyncio.run(go())


LONE = [
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "a\\ud800b"}]}', "messages.0.content"),
    (
        "/v1/chat/completions",
        '{"messages": [{"role": "user", "content": [{"type": "text", "text": "\\udfff"}]}]}',
        "messages.0.content.0.text",
    ),
    ("/v1/chat/completions", '{"messages": [{"role": "\\udc00", "content": "t1"}]}', "messages.0.role"),
    ("/v1/completions", '{"prompt": ["t1", "t2\\uDBFF"], "max_tokens": 1}', "prompt.1"),
    ("/v1/completions", '{"prompt": "t1", "stop": ["\\ud83d"], "max_tokens": 1}', "stop.0"),
    ("/v1/embeddings", '{"input": "\\ud800\\ud800"}', "input"),
    ("/tokenize", '{"content": "x\\udc80"}', "content"),
]


def test_lone_surrogates_name_the_field(tiny, tmp_path):
    app = make_app(tiny, tmp_path)

    async def go():
        async with asgi(app) as c:
            wrong = []
            for path, body, param in LONE:
                r = await c.post(path, content=body.encode(), headers={"content-type": "application/json"})
                err = error_of(r) if r.status_code >= 400 else {}
                if r.status_code != 400 or (err["param"], err["code"]) != (param, "invalid_value"):
                    wrong.append((body, r.status_code, err))
                elif "surrogate" not in err["message"]:
                    wrong.append((body, r.status_code, err))
            assert not wrong, wrong
            # a valid pair (an emoji, escaped) is text
            body = b'{"content": "t1\\ud83d\\ude00"}'
            r = await c.post("/tokenize", content=body, headers={"content-type": "application/json"})
            assert r.status_code == 200, r.text

    asyncio.run(go())


# -- item 12: requests uvicorn cannot parse (malformed Content-Length): a real uvicorn


class Uvicorn:
    def __init__(self, app, http):
        import uvicorn

        config = uvicorn.Config(app, host="127.0.0.1", port=0, log_level="error", lifespan="off", http=http)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self):
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert self.thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
            time.sleep(0.02)
        self.port = self.server.servers[0].sockets[0].getsockname()[1]
        return self

    def __exit__(self, *exc):
        self.server.should_exit = True
        self.thread.join(30)

    def send(self, data: bytes) -> bytes:
        with socket.create_connection(("127.0.0.1", self.port), timeout=10) as s:
            s.sendall(data)
            out = b""
            while chunk := s.recv(65536):
                out += chunk
        return out


BAD_LENGTHS = [b"abc", b"-1", b"1e3", b"5, 6", b"99999999999999999999999", b" "]


def protocols():
    from uvicorn.protocols.http.h11_impl import H11Protocol

    out = [H11Protocol]
    with contextlib.suppress(ImportError):
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

        out.append(HttpToolsProtocol)
    return out


@pytest.mark.parametrize("base", protocols(), ids=lambda c: c.__name__)
def test_malformed_content_length_gets_an_openai_error(tiny, tmp_path, base):
    from toy_serve.guard import http_protocol

    app = make_app(tiny, tmp_path)
    with Uvicorn(app, http_protocol(base)) as live:
        for value in BAD_LENGTHS:
            req = b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
            resp = live.send(req + b"content-length: " + value + b"\r\n\r\n{}")
            head, _, body = resp.partition(b"\r\n\r\n")
            assert head.startswith(b"HTTP/1.1 400"), (value, resp)
            assert b"content-type: application/json" in head.lower(), head
            assert b"x-request-id: " in head.lower()
            err = json.loads(body)["error"]
            assert err["code"] == "invalid_http_request" and err["type"] == "invalid_request_error", err
        # a well-formed request on the same server is answered as usual
        ok = live.send(b"GET /health HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
        assert ok.startswith(b"HTTP/1.1 "), ok


def test_plain_uvicorn_answers_malformed_content_length_in_plain_text(tiny, tmp_path):
    """What the mixin fixes: uvicorn's own protocol answers before the app, in plain text."""
    from uvicorn.protocols.http.h11_impl import H11Protocol

    with Uvicorn(make_app(tiny, tmp_path), H11Protocol) as live:
        resp = live.send(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-length: abc\r\n\r\n{}")
    assert resp.startswith(b"HTTP/1.1 400") and b"text/plain" in resp.lower()


def test_serve_uses_the_openai_error_protocol():
    """``toy serve``'s protocol class (conn.protocol_class) includes the mixin."""
    from toy_serve import Settings
    from toy_serve.conn import protocol_class
    from toy_serve.guard import OpenAIErrors

    cls = protocol_class(Settings(model=str(Path("m.gguf"))))
    assert issubclass(cls, OpenAIErrors), cls.__mro__
