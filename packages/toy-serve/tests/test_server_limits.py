"""Admission control, request size and authentication of a LIVE server (each test starts its own).

The apps here run over a one-slot copy of SmolLM2 (``n_slot=1``,
``exact_batching``, ``n_ctx=256``), loaded once for the module; each test
starts and stops its own server with the settings it needs.

References for the expectations: settings.py's docstring and app.py's (the app's invariants and decisions):
``QueueFullError`` answers 429 ``rate_limit_error``/``queue_full`` with
``Retry-After: 1``; a request creating more jobs than ``min(max_batch,
max_queue)`` answers 400 naming ``n`` or the list field; with ``api_key``
set every route but /health, /metrics and /openapi.json needs ``Authorization:
Bearer <key>`` (401 ``invalid_api_key`` and ``WWW-Authenticate: Bearer``
otherwise). Every error is in OpenAI's error shape and the server answers
the next request.
"""

from __future__ import annotations

import asyncio
import time

import httpx
import openai
import pytest

pytestmark = pytest.mark.model

PROMPT = "Once upon a time"


@pytest.fixture(scope="module")
def one_slot_model(smollm2_path):
    import toy

    m = toy.load(smollm2_path, n_ctx=256, n_slot=1, threads=2, exact_batching=True)
    yield m
    m.close()


def wait_until(pred, timeout=15.0, what="condition"):
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


def error_of(r: httpx.Response) -> dict:
    body = r.json()
    assert set(body) == {"error"}, body
    assert set(body["error"]) == {"message", "type", "param", "code"}
    return body["error"]


def test_queue_full_is_429(one_slot_model, serve_settings, serving):
    with serving(serve_settings(max_queue=1, parallel=1), one_slot_model) as live, live.client() as client:
        alias = live.srv.settings.alias
        long = dict(model=alias, prompt=PROMPT, max_tokens=200, temperature=0, stream=True)
        long["extra_body"] = {"ignore_eos": True}
        running = client.completions.create(**long)
        it = iter(running)
        next(it)  # the first request holds the only slot
        waiting = client.completions.create(**long)  # headers come back once it is queued
        wait_until(lambda: live.srv.worker.queue_depth == 1, what="the queued request")
        with pytest.raises(openai.RateLimitError) as e:
            client.completions.create(model=alias, prompt=PROMPT, max_tokens=4)
        err = e.value
        assert err.status_code == 429
        assert err.response.headers["retry-after"] == "1"
        assert err.type == "rate_limit_error" and err.code == "queue_full"
        assert set(err.body) == {"message", "type", "param", "code"}
        # embeddings are admitted the same way
        with pytest.raises(openai.RateLimitError):
            client.embeddings.create(model=alias, input="hello")
        running.close()
        waiting.close()
        wait_until(lambda: live.srv.worker.busy() == 0, what="the cancelled requests to leave")
        r = client.completions.create(model=alias, prompt=PROMPT, max_tokens=4, temperature=0)
        assert r.choices[0].finish_reason == "length"
        assert live.metric("toy_requests_total", {"endpoint": "/v1/completions", "status": "429"}) == 1
        assert live.metric("toy_requests_total", {"endpoint": "/v1/embeddings", "status": "429"}) == 1


def test_flood_gets_429_and_the_rest_complete(one_slot_model, serve_settings, serving):
    with serving(serve_settings(max_queue=1, parallel=1), one_slot_model) as live:
        alias = live.srv.settings.alias

        async def one(c, i):
            try:
                r = await c.completions.create(
                    model=alias, prompt=f"{PROMPT} {i}", max_tokens=16, temperature=0, extra_body={"ignore_eos": True}
                )
                return r.choices[0].finish_reason
            except openai.RateLimitError as e:
                assert e.response.headers["retry-after"] == "1" and e.code == "queue_full"
                return 429

        async def main():
            async with live.async_client() as c:
                return await asyncio.gather(*(one(c, i) for i in range(8)))

        results = asyncio.run(main())
        assert set(results) <= {"length", 429}, results  # nothing else: no 5xx, no 503
        assert results.count(429) >= 1 and results.count("length") >= 1, results
        with live.client() as client:
            assert client.completions.create(model=alias, prompt=PROMPT, max_tokens=2).usage.completion_tokens == 2


def test_too_many_jobs_per_request(one_slot_model, serve_settings, serving):
    with serving(serve_settings(max_batch=2), one_slot_model) as live, live.client() as client:
        alias = live.srv.settings.alias
        assert live.srv.settings.jobs_per_request == 2
        r = client.completions.create(model=alias, prompt=["a", "b"], max_tokens=2)  # exactly the bound
        assert len(r.choices) == 2
        with pytest.raises(openai.BadRequestError) as e:
            client.completions.create(model=alias, prompt=["a", "b", "c"], max_tokens=2)
        assert e.value.param == "prompt"
        with pytest.raises(openai.BadRequestError) as e:
            client.completions.create(model=alias, prompt="a", n=3, max_tokens=2)
        assert e.value.param == "n"
        with pytest.raises(openai.BadRequestError) as e:
            client.completions.create(model=alias, prompt=["a", "b"], n=2, max_tokens=2)
        assert e.value.param == "n"
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model=alias, messages=[{"role": "user", "content": "a"}], n=3, max_tokens=2)
        assert e.value.param == "n"
        with pytest.raises(openai.BadRequestError) as e:
            client.embeddings.create(model=alias, input=["a", "b", "c"])
        assert e.value.param == "input"
        assert live.srv.worker.busy() == 0  # nothing was queued: a request queues all its jobs or none
        assert client.completions.create(model=alias, prompt="a", max_tokens=2).usage.completion_tokens == 2


def test_small_body_limit(one_slot_model, serve_settings, serving):
    with serving(serve_settings(max_body_bytes=2048), one_slot_model) as live, live.client() as client:
        alias = live.srv.settings.alias
        ok = client.completions.create(model=alias, prompt="x" * 100, max_tokens=1)
        assert ok.usage.completion_tokens == 1
        with pytest.raises(openai.APIStatusError) as e:
            client.completions.create(model=alias, prompt="x" * 3000, max_tokens=1)
        assert e.value.status_code == 413 and e.value.code == "request_too_large"
        r = live.http.post("/v1/embeddings", content=b'{"input": "' + b"y" * 4000 + b'"}')
        assert r.status_code == 413 and error_of(r)["code"] == "request_too_large"
        assert client.completions.create(model=alias, prompt="x", max_tokens=1).usage.completion_tokens == 1


KEY = "test-key-0123456789"


def test_api_key(one_slot_model, serve_settings, serving):
    with serving(serve_settings(api_key=KEY), one_slot_model) as live:
        alias = live.srv.settings.alias
        h = live.http
        # open paths: probes and scrapers carry no key
        assert h.get("/health").status_code == 200
        assert h.get("/metrics").status_code == 200
        assert h.get("/openapi.json").status_code == 200
        # no key
        for method, path, body in [
            ("GET", "/v1/models", None),
            ("POST", "/v1/completions", {"prompt": "hi", "max_tokens": 1}),
            ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}),
            ("POST", "/v1/embeddings", {"input": "hi"}),
            ("POST", "/tokenize", {"content": "hi"}),
            ("POST", "/detokenize", {"tokens": [1]}),
        ]:
            r = h.request(method, path, json=body)
            assert r.status_code == 401, path
            assert error_of(r)["code"] == "invalid_api_key"
            assert r.headers["www-authenticate"] == "Bearer"
        # a wrong key, a key with another scheme
        with live.client(api_key="wrong") as bad, pytest.raises(openai.AuthenticationError) as e:
            bad.completions.create(model=alias, prompt="hi", max_tokens=1)
        assert e.value.status_code == 401 and e.value.code == "invalid_api_key"
        assert h.get("/v1/models", headers={"authorization": f"Basic {KEY}"}).status_code == 401
        assert h.get("/v1/models", headers={"authorization": KEY}).status_code == 401
        assert h.get("/v1/models", headers={"authorization": f"Bearer {KEY}x"}).status_code == 401
        # the right key
        with live.client(api_key=KEY) as good:
            assert [m.id for m in good.models.list().data] == [alias]
            r = good.completions.create(model=alias, prompt="hi", max_tokens=2, temperature=0)
            assert r.usage.completion_tokens == 2
            assert good.embeddings.create(model=alias, input="hi").data[0].embedding
        assert h.get("/v1/models", headers={"authorization": f"bearer {KEY}"}).status_code == 200  # scheme: any case
        r = h.post("/tokenize", json={"content": "hi"}, headers={"authorization": f"Bearer {KEY}"})
        assert r.status_code == 200 and r.json()["tokens"] == one_slot_model.tokenize("hi")
        assert live.metric("toy_requests_total", {"endpoint": "/v1/completions", "status": "401"}) == 2


def test_model_alias(one_slot_model, serve_settings, serving, smollm2_path):
    with serving(serve_settings(model_alias="my-model"), one_slot_model) as live, live.client() as client:
        assert [m.id for m in client.models.list().data] == ["my-model"]
        for name in ("my-model", smollm2_path.name, smollm2_path.stem, str(smollm2_path)):
            r = client.completions.create(model=name, prompt="hi", max_tokens=1)
            assert r.model == "my-model"
        r = client.chat.completions.create(model="my-model", messages=[{"role": "user", "content": "hi"}], max_tokens=1)
        assert r.model == "my-model"
        assert client.embeddings.create(model="my-model", input="hi").model == "my-model"
        with pytest.raises(openai.BadRequestError) as e:
            client.completions.create(model="SmolLM2", prompt="hi", max_tokens=1)
        assert e.value.code == "model_not_found" and "my-model" in e.value.message


def test_constraint_compilers_busy_is_503_with_retry_after(serve_model, serve_settings, serving, monkeypatch):
    """Every compile place held by compiles past their deadline (they cannot be stopped): the next constrained
    request is a 503 with Retry-After, not a 400 (the request is fine) and not another thread."""
    import threading

    from toy.engine import constrain

    gate = threading.Event()
    real = constrain._compile
    monkeypatch.setattr(constrain, "_compile", lambda c, lt: gate.wait(30) and real(c, lt))
    with serving(serve_settings(constraint_timeout=0.2), serve_model) as live:
        alias = live.srv.settings.alias
        body = {"model": alias, "prompt": PROMPT, "max_tokens": 2, "regex": "[0-9]+"}
        try:
            for _ in range(constrain.MAX_COMPILING):  # each one overdue: a 400 naming the deadline
                r = live.http.post("/v1/completions", json=body)
                assert r.status_code == 400 and "took longer than 0.2 s" in error_of(r)["message"], r.text
            r = live.http.post("/v1/completions", json=body)
            assert r.status_code == 503, r.text
            assert r.headers["retry-after"] == "1"
            err = error_of(r)
            assert err["code"] == "constraint_compilers_busy" and err["type"] == "server_error"
            assert live.http.get("/health").status_code == 200
        finally:
            gate.set()
        monkeypatch.setattr(constrain, "_compile", real)
        wait_until(lambda: not any(t.name == "toy-constraint-compile" for t in threading.enumerate()), what="compiles")
        r = live.http.post("/v1/completions", json=body)
        assert r.status_code == 200, r.text
