"""Hardening of the HTTP API: telemetry failures and unauthenticated floods
(guard.py's and toy.runs.writer's module docstrings).

The apps run over a tiny generated model (``toy_test_models.write_tiny_model``,
a few KB) in process: httpx's ASGI transport with the app's lifespan
(``asgi``), which re-raises anything that escapes the app, the way uvicorn
logs "Exception in ASGI application".
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import json
import time

import httpx
import pytest

KEY = "sk-test-hardening"
PROMPT = {"prompt": [1, 2, 3], "max_tokens": 2, "temperature": 0}
CHAT = {"messages": [{"role": "user", "content": "t1t2"}], "max_tokens": 2, "temperature": 0}


TOKENS = [chr(c) for c in range(33, 127)] + ["\u0120", "<|end|>"]  # printable ASCII, space (byte-level BPE)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny model whose vocabulary spells printable ASCII one character a token (no merges)."""
    import toy_test_models

    import toy
    from toy.gguf.reader import GGUFFile
    from toy.gguf.writer import GGUFWriter, copy_metadata

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
