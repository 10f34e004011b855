"""Fixtures for the live-server tests of toy-serve.

- ``serve_model``: the real SmolLM2 file loaded once per session the way
  the server loads it (``n_slot=4``, ``exact_batching=True``, ``n_ctx=512``).
  At most one app runs on it at a time (the engine serves one thread): the
  module that uses it starts one live server over it.
- ``ref_model``: the same file loaded a second time (``n_slot=1``), the
  library reference the HTTP answers are compared with (``Model.generate``,
  ``Model.logits``, ``Model.tokenize``): another engine, another code path
  (slot 0, no worker, no HTTP). It is never handed to an app while a test
  uses it as a reference.
- ``serving``: ``with serving(settings, model) as live:`` runs
  ``create_app(settings, model)`` under uvicorn in a background thread on a
  free port of 127.0.0.1, waits until /health answers 200, and stops the
  server (graceful shutdown, the worker drained) when the block ends.
  ``live.url``, ``live.client()`` (an ``openai.OpenAI`` that never retries),
  ``live.http`` (an ``httpx.Client`` on the root URL), ``live.srv`` (the
  app's ``_Server``: metrics, worker).
- ``serve_settings``: ``Settings`` for the SmolLM2 file with the run bundles
  in a temporary folder (keyword arguments override fields).

A generated model file (test_serve_conformance.py, test_serve_gpt2.py,
test_serve_gemma.py, test_serve_moe.py: the reference helpers' files) is served by
``file_*`` fixtures over the test module's own ``file_path`` fixture (which
may be parametrized over files), per module:

- ``file_served``: the file loaded the way the server loads one
  (``n_slot=file_slots``, 4 unless the module overrides ``file_slots``,
  ``exact_batching``, ``n_ctx=file_ctx``, 128, one thread); ``file_ref``:
  a second copy (``n_slot=1``), the library reference;
- ``file_live``: a live server over ``file_served`` (its run bundles in a
  temporary folder), ``file_client`` its ``openai`` client, ``file_alias``
  the model name it serves (the file's stem).

Their checks are in ``toy_testsupport.serve_helpers``; test_serve_conformance.py
runs them over every architecture's files.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

CTX = 512
FILE_CTX = 128  # the generated models' context (the tiny GPT-2's learned positions)


class LiveServer:
    """One app served by uvicorn on a background thread (see the module docstring)."""

    def __init__(self, app: Any):
        import uvicorn

        self.app = app
        config = uvicorn.Config(
            app,
            host="127.0.0.1",
            port=0,
            log_level="warning",
            lifespan="on",
            timeout_graceful_shutdown=10,
        )
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, name="uvicorn-test", daemon=True)
        self.url = ""
        self.http: httpx.Client | None = None

    @property
    def srv(self) -> Any:
        return self.app.state.toy

    def start(self, timeout: float = 60.0) -> LiveServer:
        self.thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self.thread.is_alive():
                raise RuntimeError("uvicorn stopped during startup")
            if time.monotonic() > deadline:
                raise TimeoutError("uvicorn did not start")
            time.sleep(0.02)
        port = self.server.servers[0].sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        self.http = httpx.Client(base_url=self.url, timeout=120)
        while True:
            try:
                if self.http.get("/health").status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError("/health did not answer 200")
            time.sleep(0.05)

    def client(self, **kw: Any) -> Any:
        import openai

        kw.setdefault("api_key", "unused")
        kw.setdefault("max_retries", 0)  # a 429 or 500 must reach the test, not be retried
        kw.setdefault("timeout", 120)
        return openai.OpenAI(base_url=self.url + "/v1", **kw)

    def async_client(self, **kw: Any) -> Any:
        import openai

        kw.setdefault("api_key", "unused")
        kw.setdefault("max_retries", 0)
        kw.setdefault("timeout", 120)
        return openai.AsyncOpenAI(base_url=self.url + "/v1", **kw)

    def metric(self, name: str, labels: dict[str, str] | None = None) -> float:
        """A sample's value from the live /metrics text (0 when the series does not exist yet)."""
        from prometheus_client.parser import text_string_to_metric_families

        want = labels or {}
        for fam in text_string_to_metric_families(self.http.get("/metrics").text):
            for s in fam.samples:
                if s.name == name and all(s.labels.get(k) == v for k, v in want.items()):
                    return s.value
        return 0.0

    def stop(self) -> None:
        if self.http is not None:
            self.http.close()
        self.server.should_exit = True
        self.thread.join(60)
        if self.thread.is_alive():
            raise RuntimeError("uvicorn did not stop within 60 s")


@pytest.fixture(scope="session")
def serve_model(smollm2_path):
    import toy

    m = toy.load(smollm2_path, n_ctx=CTX, n_slot=4, threads=2, exact_batching=True)
    yield m
    m.close()


@pytest.fixture(scope="session")
def ref_model(smollm2_path):
    import toy

    m = toy.load(smollm2_path, n_ctx=CTX, n_slot=1, threads=2, exact_batching=True)
    yield m
    m.close()


@pytest.fixture(scope="session")
def serve_settings(smollm2_path, tmp_path_factory):
    from toy_serve import Settings

    runs = tmp_path_factory.mktemp("serve-runs")

    def make(**kw: Any) -> Settings:
        kw.setdefault("runs_dir", str(runs))
        kw.setdefault("drain_timeout", 10.0)
        return Settings(model=str(smollm2_path), **kw)

    return make


@pytest.fixture(scope="session")
def serving():
    @contextlib.contextmanager
    def run(settings: Any, model: Any) -> Iterator[LiveServer]:
        from toy_serve import create_app

        model.engine.cache.clear()
        live = LiveServer(create_app(settings, model)).start()
        try:
            yield live
        finally:
            live.stop()

    return run


# ------------------------------------------------------------ a generated model file (``file_path``)


@pytest.fixture(scope="module")
def file_slots() -> int:
    return 4


@pytest.fixture(scope="module")
def file_ctx() -> int:
    return FILE_CTX


@pytest.fixture(scope="module")
def file_served(file_path, file_slots, file_ctx):
    import toy

    m = toy.load(file_path, n_ctx=file_ctx, n_slot=file_slots, threads=1, exact_batching=True)
    yield m
    m.close()


@pytest.fixture(scope="module")
def file_ref(file_path, file_ctx):
    import toy

    m = toy.load(file_path, n_ctx=file_ctx, n_slot=1, threads=1, exact_batching=True)
    yield m
    m.close()


@pytest.fixture(scope="module")
def file_live(file_served, file_path, serving, tmp_path_factory):
    from toy_serve import Settings

    runs = tmp_path_factory.mktemp(f"serve-{file_path.stem}-runs")
    with serving(Settings(model=str(file_path), runs_dir=str(runs), drain_timeout=10.0), file_served) as s:
        yield s


@pytest.fixture(scope="module")
def file_client(file_live):
    with file_live.client() as c:
        yield c


@pytest.fixture(scope="module")
def file_alias(file_live, file_path) -> str:
    assert file_live.srv.settings.alias == file_path.stem
    return file_live.srv.settings.alias
