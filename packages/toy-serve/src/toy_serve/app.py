"""The HTTP app: ``create_app(settings, model=None)`` -> an OpenAI-compatible FastAPI app.

Routes: GET /health, /v1/models, /metrics; POST /v1/completions,
/v1/chat/completions, /v1/embeddings, /tokenize, /detokenize. Generation and
embeddings run on one ``EngineWorker`` thread (continuous batching); each
request turns into jobs whose events the worker hands to the event loop
(``loop.call_soon_threadsafe`` into the request's own ``asyncio.Queue``).

Invariants:

- No module-level state: everything lives on ``app.state.toy`` (a
  ``_Server``), so apps (tests) never share a model, worker or metrics.
- Every response carries ``x-request-id``; every error is in OpenAI's shape
  ``{"error": {"message", "type", "param", "code"}}``; every request is
  counted in ``toy_requests_total{endpoint,status}``; the model endpoints
  each log one ``request`` event in the run bundle, whatever the outcome.
- A request's budget (prompt + max_tokens <= the context of one sequence)
  and its size (jobs <= ``Settings.jobs_per_request``) are checked before
  anything is queued; a request either queues all its jobs or none.
- A client that goes away cancels its jobs: a stream notices through
  Starlette's disconnect listener (the generator is cancelled), a
  non-stream request through a watcher polling ``is_disconnected``.
- An unexpected exception answers 500 (``server_error``/``internal_error``,
  the request id in the message), is logged, and the server keeps serving.

Decisions:

- The guard middleware (pure ASGI, outermost inside Starlette's error
  middleware) buffers the body (<= ``max_body_bytes``, else 413, checking
  Content-Length first), checks the API key (Bearer, constant-time compare)
  on every path except /health, /metrics and /openapi.json (probes and
  scrapers carry no key; they expose no text), and turns escaped exceptions
  into 500s.
- When the app loads the model itself it does so in the background after
  startup, so /health answers 503 {"status": "loading"} meanwhile and every
  model route answers 503 ``model_loading``. A model passed in (tests) must
  have been loaded with ``exact_batching`` and is never closed by the app;
  ``settings.ctx``/``parallel``/``device``/``threads`` then do not apply.
- Validation errors answer 400 (not FastAPI's 422; /openapi.json documents
  the 400 and the other error statuses instead); ``QueueFullError`` 429
  with ``Retry-After: 1`` (503 while shutting down); an over-long request
  400 ``context_length_exceeded``; an unknown ``model`` 400
  ``model_not_found`` (a missing or empty ``model`` means the served one);
  a job that fails in the engine 500 (or, once a stream has started, an
  ``{"error": ...}`` chunk before ``data: [DONE]``).
- Embeddings are the mean of the final hidden states over every input token
  (the worker never reuses a cached prefix for them); the vector is
  L2-normalized unless ``normalize`` is false.
- LoRA adapters (``Settings.lora``) are applied by ``toy.load`` at
  inference; ``/v1/models`` lists them as ``lora: [{"name", "scale"}]``
  (file names, not paths) and the run_start event's ``model`` as
  ``lora: [{"path", "scale"}]``.
- /tokenize and /detokenize sit at the root (llama.cpp's and vLLM's paths);
  tokenization and chat rendering run in threads, off the event loop.
"""

from __future__ import annotations

import asyncio
import base64
import hmac
import json
import logging
import secrets
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from http import HTTPStatus
from pathlib import Path
from typing import Any

import numpy as np
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException

from toy.engine.llm import ContextOverflowError
from toy.engine.sampling import SamplingParams
from toy.errors import BadInputError, ToyError
from toy.tokenizer.chat import ChatTemplateError
from toy.tokenizer.vocab import TokenizerError
from toy_serve import schemas as S
from toy_serve.metrics import CONTENT_TYPE, Metrics
from toy_serve.schemas import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    EmbeddingRequest,
    TokenizeRequest,
)
from toy_serve.settings import Settings
from toy_serve.worker import EngineWorker, Job, QueueFullError

log = logging.getLogger("toy_serve")

COMPLETIONS, CHAT, EMBEDDINGS = "/v1/completions", "/v1/chat/completions", "/v1/embeddings"
ENDPOINTS = {"/health", "/v1/models", "/metrics", COMPLETIONS, CHAT, EMBEDDINGS, "/tokenize", "/detokenize"}
OPEN_PATHS = {"/health", "/metrics", "/openapi.json"}
LOGGED = {COMPLETIONS, CHAT, EMBEDDINGS}
DEFAULT_PARAM = {
    COMPLETIONS: "prompt",
    CHAT: "messages",
    EMBEDDINGS: "input",
    "/tokenize": "content",
    "/detokenize": "tokens",
}
POLL_S = 0.25


class _Server:
    """Everything one app owns: settings, model, worker, metrics, run bundle."""

    def __init__(self, settings: Settings, model: Any | None):
        self.settings, self.model, self.owns_model = settings, model, model is None
        self.metrics = Metrics()
        self.worker: EngineWorker | None = None
        self.writer: Any = None
        self.status, self.error = "loading", None
        self.created = int(time.time())
        self.names = settings.model_names()
        self.on_fatal: Any = None  # set by the CLI: called with the exception when loading fails
        self.n_requests = 0

    def _load(self) -> Any:
        import toy

        s = self.settings
        return toy.load(
            s.model,
            device=s.device,
            n_ctx=s.ctx,
            threads=s.threads,
            n_slot=s.parallel,
            exact_batching=True,
            lora=list(s.lora) or None,
        )

    def adapters(self) -> list[tuple[str | None, float]]:
        """The LoRA adapters applied: the loaded model's, else (still loading) the settings'."""
        if self.model is not None:
            return list(getattr(self.model, "adapters", []))
        return list(self.settings.lora)

    def _begin(self) -> None:
        from toy.runs.writer import RunWriter

        m, s = self.model, self.settings
        info = {"path": str(m.path), "alias": s.alias, "n_ctx": m.engine.n_ctx, "n_slot": m.engine.n_slot}
        info.update(n_vocab=m.cfg.n_vocab, d_model=m.cfg.d_model, n_layer=m.cfg.n_layer)
        info["lora"] = [{"path": p, "scale": sc} for p, sc in self.adapters()]
        self.writer = RunWriter("serve", s.config(), root=s.runs_dir, model=info)
        try:
            self.worker = EngineWorker(m, max_queue=s.max_queue, prefill_chunk=s.prefill_chunk, metrics=self.metrics)
            self.worker.start()
        except BaseException:
            self.writer.end("errored")
            raise
        self.status = "ok"

    async def start(self) -> None:
        try:
            if self.model is None:
                self.model = await asyncio.to_thread(self._load)
            self._begin()
        except Exception as e:  # noqa: BLE001 - reported on /health and to the CLI
            self.status, self.error = "error", f"{type(e).__name__}: {e}"
            log.error("the server could not start: %s", self.error)
            if self.on_fatal:
                self.on_fatal(e)

    async def stop(self, loading: asyncio.Task | None) -> None:
        self.status = "stopping"
        if loading is not None:
            await loading  # a model being loaded is waited for (a thread cannot be cancelled), then closed
            self.status = "stopping"
        left = 0
        if self.worker is not None:
            deadline = time.monotonic() + self.settings.drain_timeout
            while self.worker.busy() and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            left = self.worker.busy()
            await asyncio.to_thread(self.worker.stop)
        if self.writer is not None:
            self.writer.end("completed", requests=self.n_requests, abandoned=left)
        if self.owns_model and self.model is not None:
            await asyncio.to_thread(self.model.close)

    def ready(self) -> Any:
        if self.status != "ok":
            what = {"loading": "the model is still loading", "stopping": "the server is shutting down"}
            msg = what.get(self.status, f"the model failed to load: {self.error}")
            raise APIError(503, msg, type="server_error", code="model_loading" if self.status == "loading" else None)
        return self.model

    def check_model(self, name: str | None) -> None:
        if name and name not in self.names:
            msg = f"model {name!r} is not served here (this server serves {self.settings.alias!r})"
            raise APIError(400, msg, param="model", code="model_not_found")

    def log_request(self, rid: str, endpoint: str, status: int, stats: dict, duration: float) -> None:
        self.n_requests += 1
        if self.writer is None:
            return
        ttft, done = stats.get("ttft_s"), stats.get("completion_tokens")
        tok_s = done / (duration - ttft) if ttft is not None and done and duration > ttft else None
        fields = {"prompt_tokens": stats.get("prompt_tokens"), "completion_tokens": done, "ttft_s": ttft}
        fields.update(duration_s=duration, tok_s=tok_s, finish_reason=stats.get("finish_reason"))
        try:
            self.writer.event("request", request_id=rid, endpoint=endpoint, status=status, **fields)
        except RuntimeError:  # the run has ended (shutdown raced a late request)
            pass


def _internal(message: str, rid: str | None) -> APIError:
    return APIError(500, f"{message} (request id {rid})", type="server_error", code="internal_error")


def _error_response(err: APIError) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status, headers=err.headers)


class _Guard:
    """Request id, auth, body limit, 500s, metrics and the run-bundle request event (see the module doc)."""

    def __init__(self, app: Any, server: _Server):
        self.app, self.srv = app, server

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        t0, rid, srv = time.perf_counter(), secrets.token_hex(12), self.srv
        path = scope["path"]
        endpoint = path if path in ENDPOINTS else "other"
        scope["toy.request_id"], scope["toy.stats"], scope["toy.cleanup"] = rid, (stats := {}), (cleanup := [])
        status = [0]

        async def send_(msg: dict) -> None:
            if msg["type"] == "http.response.start":
                status[0] = msg["status"]
                msg = {**msg, "headers": [*msg.get("headers", []), (b"x-request-id", rid.encode())]}
            await send(msg)

        try:
            early = self._auth(scope)
            if early is None:
                body, early = await self._body(scope, receive)
            if early is not None:
                await _error_response(early)(scope, receive, send_)
            else:
                await self.app(scope, _replay(body, receive), send_)
        except Exception:
            log.exception("request %s %s failed", rid, path)
            if not status[0]:
                await _error_response(_internal("internal server error", rid))(scope, receive, send_)
        finally:
            for cancel in cleanup:  # jobs of a stream that never started (client gone at once) stop here
                cancel()
            duration = time.perf_counter() - t0
            srv.metrics.request(endpoint, status[0] or 500, duration)
            if path in LOGGED:
                srv.log_request(rid, endpoint, status[0] or 500, stats, duration)

    def _auth(self, scope: dict) -> APIError | None:
        key = self.srv.settings.api_key
        if key is None or scope["path"] in OPEN_PATHS:
            return None
        given = dict(scope["headers"]).get(b"authorization", b"")
        scheme, _, token = given.partition(b" ")
        if scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), key.encode()):
            return None
        msg = "invalid or missing API key (send 'Authorization: Bearer <key>')"
        return APIError(401, msg, code="invalid_api_key", headers={"www-authenticate": "Bearer"})

    async def _body(self, scope: dict, receive: Any) -> tuple[bytes, APIError | None]:
        limit = self.srv.settings.max_body_bytes
        too_big = APIError(413, f"the request body is larger than {limit} bytes", code="request_too_large")
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None:
            if not length.isdigit():
                return b"", APIError(400, "invalid Content-Length header")
            if int(length) > limit:
                return b"", too_big
        chunks, size = [], 0
        while True:
            msg = await receive()
            if msg["type"] != "http.request":
                break  # the client left: the app sees the disconnect on its next receive
            chunks.append(msg.get("body", b""))
            size += len(chunks[-1])
            if size > limit:
                return b"", too_big
            if not msg.get("more_body"):
                break
        return b"".join(chunks), None


def _replay(body: bytes, receive: Any) -> Any:
    sent = False

    async def recv() -> dict:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return recv


class _Choice:
    """One job of a request and what it has produced so far."""

    def __init__(self, index: int, ids: list[int], first: bool):
        self.index, self.ids, self.first = index, ids, first
        self.job: Job | None = None
        self.text: list[str] = []
        self.finish: str | None = None
        self.usage: dict = {}
        self.timings: dict = {}
        self.error: str | None = None
        self.vector: np.ndarray | None = None
        self.lp: Any = None  # LegacyLogprobs (completions) or a list (chat), when logprobs were asked for
        self.echo = ""
        self.n_out = 0  # tokens seen so far (usage comes with "done"; this counts a request cut short too)

    def apply(self, ev: dict) -> None:
        t = ev["type"]
        if t == "token":
            self.text.append(ev["text"])
            self.n_out += ev["token"] is not None
        elif t == "embedding":
            self.vector = ev["vector"]
        elif t == "done":
            self.finish, self.usage, self.timings = ev["finish_reason"], ev.get("usage", {}), ev.get("timings", {})
        elif t == "error":
            self.error = ev["message"]


class _Batch:
    """The jobs of one request and the queue their events arrive on."""

    def __init__(self, srv: _Server, request: Request):
        self.srv, self.request = srv, request
        self.rid: str = request.scope.get("toy.request_id", secrets.token_hex(12))
        self.stats: dict = request.scope.get("toy.stats", {})
        self.loop = asyncio.get_running_loop()
        self.q: asyncio.Queue = asyncio.Queue()
        self.choices: list[_Choice] = []
        request.scope.setdefault("toy.cleanup", []).append(self.cancel)

    def add(self, ids: list[int], params: SamplingParams, first: bool = True, **job: Any) -> _Choice:
        c = _Choice(len(self.choices), ids, first)
        i, put = c.index, self.q.put_nowait
        emit = lambda ev: self.loop.call_soon_threadsafe(put, (i, ev))  # noqa: E731 - runs on the worker thread
        c.job = Job(f"{self.rid}-{i}", ids, params, emit, **job)
        self.choices.append(c)
        return c

    def submit(self) -> None:
        worker = self.srv.worker
        try:
            for c in self.choices:
                worker.submit(c.job)
        except BaseException:
            self.cancel()
            raise

    def cancel(self) -> None:
        for c in self.choices:
            c.job.cancel()

    async def _watch(self) -> None:
        while not await self.request.is_disconnected():
            await asyncio.sleep(POLL_S)
        self.cancel()

    async def events(self, watch: bool) -> AsyncIterator[tuple[_Choice, dict]]:
        """Every event of every job until all have ended; ``watch``: cancel them if the client leaves."""
        watcher = asyncio.create_task(self._watch()) if watch else None
        try:
            left = len(self.choices)
            while left:
                i, ev = await self.q.get()
                c = self.choices[i]
                c.apply(ev)
                if ev["type"] in ("done", "error"):
                    left -= 1
                yield c, ev
        finally:
            if watcher is not None:
                watcher.cancel()
            self.cancel()  # a no-op for ended jobs; stops the rest when the consumer is cancelled
            self.summarize()

    def failed(self) -> APIError | None:
        errors = [c.error for c in self.choices if c.error]
        if not errors:
            return None
        if any("shutting down" in e for e in errors):
            return APIError(503, errors[0], type="server_error", headers={"retry-after": "1"})
        return _internal(errors[0], self.rid)

    def usage(self) -> dict:
        prompt = sum(len(c.ids) for c in self.choices if c.first)
        done = sum(c.usage.get("completion_tokens", c.n_out) for c in self.choices)
        cached = sum(c.usage.get("cached_tokens", 0) for c in self.choices if c.first)
        return S.usage(prompt, done, cached)

    def summarize(self) -> None:
        u = self.usage()
        ttfts = [c.timings["ttft_s"] for c in self.choices if c.timings.get("ttft_s") is not None]
        reasons = sorted({c.finish or ("error" if c.error else "cancelled") for c in self.choices})
        self.stats.update(prompt_tokens=u["prompt_tokens"], completion_tokens=u["completion_tokens"])
        self.stats.update(
            ttft_s=min(ttfts) if ttfts else None, finish_reason=reasons[0] if len(reasons) == 1 else reasons
        )


def _sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"


def _stream(chunks: AsyncIterator[str]) -> StreamingResponse:
    headers = {"cache-control": "no-cache", "x-accel-buffering": "no"}
    return StreamingResponse(chunks, media_type="text/event-stream", headers=headers)


async def _safe_stream(batch: _Batch, gen: AsyncIterator[str]) -> AsyncIterator[str]:
    """``gen``'s chunks, then ``data: [DONE]``; a failure mid-stream becomes an error chunk (headers are sent)."""
    try:
        async for chunk in gen:
            yield chunk
        err = batch.failed()
        if err is not None:
            yield _sse(err.body())
    except Exception:
        log.exception("stream %s failed", batch.rid)
        yield _sse(_internal("internal server error", batch.rid).body())
    finally:
        batch.cancel()
    yield "data: [DONE]\n\n"


def create_app(settings: Settings, model: Any | None = None) -> FastAPI:
    """An app serving ``model`` (loaded in the background from ``settings.model`` when None)."""
    if model is not None and (not getattr(model.engine, "exact_batching", False) or model.engine.n_slot < 1):
        raise BadInputError("a model passed to create_app must be loaded with exact_batching=True and n_slot >= 1")
    srv = _Server(settings, model)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        loading = None
        if srv.model is None:
            loading = asyncio.create_task(srv.start())
        else:
            srv._begin()
        try:
            yield
        finally:
            await srv.stop(loading)

    # strict_content_type=False: a JSON body without a Content-Type header is still read as JSON
    app = FastAPI(title="toy-serve", lifespan=lifespan, docs_url=None, redoc_url=None, strict_content_type=False)
    app.state.toy = srv
    app.add_middleware(_Guard, server=srv)

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return _error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        return _error_response(S.validation_error(list(exc.errors())))

    @app.exception_handler(HTTPException)
    async def _http(request: Request, exc: HTTPException) -> JSONResponse:
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        msg = f"no route {request.method} {request.url.path}" if code else str(exc.detail)
        return _error_response(APIError(exc.status_code, msg, code=code, headers=dict(exc.headers or {})))

    @app.exception_handler(ToyError)
    async def _toy(request: Request, exc: ToyError) -> JSONResponse:
        return _error_response(_toy_error(srv, request, exc))

    add_routes(app, srv)

    def openapi() -> dict[str, Any]:
        # FastAPI documents 422 for validation errors; this app answers 400 (documented per route) instead.
        if app.openapi_schema is None:
            schema = FastAPI.openapi(app)
            for item in schema.get("paths", {}).values():
                for op in item.values():
                    op.get("responses", {}).pop("422", None)
            for name in ("HTTPValidationError", "ValidationError"):
                schema.get("components", {}).get("schemas", {}).pop(name, None)
        return app.openapi_schema

    app.openapi = openapi
    return app


def _toy_error(srv: _Server, request: Request, exc: ToyError) -> APIError:
    msg = str(exc) + (f" ({exc.hint})" if getattr(exc, "hint", None) else "")
    path = request.url.path
    if isinstance(exc, QueueFullError):
        if srv.status == "stopping" or "shutting down" in str(exc):
            return APIError(503, str(exc), type="server_error", headers={"retry-after": "1"})
        return APIError(429, str(exc), type="rate_limit_error", code="queue_full", headers={"retry-after": "1"})
    if isinstance(exc, ContextOverflowError):
        return APIError(400, msg, param=DEFAULT_PARAM.get(path), code="context_length_exceeded")
    if isinstance(exc, (BadInputError, ChatTemplateError, TokenizerError)):
        lp = "top_logprobs" if path == CHAT else "logprobs"
        return APIError(400, msg, param=S.param_of(str(exc), DEFAULT_PARAM.get(path), lp))
    rid = request.scope.get("toy.request_id")
    log.error("request %s: %s: %s", rid, type(exc).__name__, exc)
    return _internal(msg, rid)


def _prompts(srv: _Server, model: Any, prompt: Any, field: str, n: int) -> list[tuple[list[int], str]]:
    """(token ids, text) of each prompt of a request (runs in a thread: tokenizing can take a while)."""
    items = [prompt] if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)) else list(prompt)
    if not items:
        raise APIError(400, f"{field} is empty", param=field)
    limit = srv.settings.jobs_per_request
    if len(items) * n > limit:
        msg = f"this request would run {len(items) * n} sequences ({len(items)} x n={n}); at most {limit} are allowed"
        raise APIError(400, msg, param=field if n == 1 else "n")
    out, vocab, single = [], model.cfg.n_vocab, items[0] is prompt  # one prompt, not a list of them
    for j, p in enumerate(items):
        where = field if single else f"{field}.{j}"
        if isinstance(p, str):
            ids, text = model.tokenize(p), p
        else:
            bad = next((t for t in p if not 0 <= t < vocab), None)
            if bad is not None:
                raise APIError(400, f"{where}: token id {bad} is outside the vocabulary (0..{vocab - 1})", param=where)
            ids = list(p)
            text = model.detokenize(ids)
        if not ids:
            raise APIError(400, f"{where} is empty (no tokens)", param=where)
        out.append((ids, text))
    return out


def _budget(model: Any, ids: list[int], max_tokens: int | None) -> int:
    """max_tokens for a prompt (None: the rest of the context); raises when prompt + max_tokens do not fit."""
    n_ctx = model.engine.n_ctx
    mt = max(n_ctx - len(ids), 0) if max_tokens is None else max_tokens
    if len(ids) + mt > n_ctx:
        raise ContextOverflowError(
            f"this server's context is {n_ctx} tokens per request, but {len(ids) + mt} were requested "
            f"({len(ids)} in the prompt, {mt} for the completion)",
            hint="shorten the prompt or lower max_tokens",
        )
    return mt


def _completion_event(c: _Choice, ev: dict) -> tuple[str, dict | None]:
    """What a completions event adds to choice ``c``: (text, logprobs entries) for a stream chunk."""
    lp, text, t = c.lp, "", ev["type"]
    n0 = len(lp.tokens) if lp is not None else 0
    if t == "prompt_logprobs":
        for pos, item in enumerate(ev["items"]):
            if item is None:
                lp.add(c.ids[pos], None, None)
            else:
                lp.add(item["token"], item["logprob"], item.get("top"))
        text = c.echo
    elif t == "token":
        text = ev["text"]
        if lp is not None and ev["token"] is not None and ev["logprob"] is not None:
            lp.add(ev["token"], ev["logprob"].logprob, ev["logprob"].top)
    return text, (lp.take(n0) if lp is not None and len(lp.tokens) > n0 else None)


def _errors(*codes: int) -> dict[int | str, dict]:
    """OpenAPI ``responses`` for these error statuses (all in OpenAI's error shape)."""
    return {c: {"model": S.ErrorResponse, "description": HTTPStatus(c).phrase} for c in codes}


_API = _errors(400, 401, 413, 429, 500, 503)
_SSE = {200: {"content": {"text/event-stream": {"schema": {"type": "string"}}}, "description": "OK (stream)"}}


def add_routes(app: FastAPI, srv: _Server) -> None:
    alias = srv.settings.alias

    @app.get("/health", responses={503: {"description": "loading, stopping or failed to load"}})
    async def health() -> Response:
        if srv.status == "ok":
            return JSONResponse({"status": "ok"})
        return JSONResponse({"status": srv.status, **({"message": srv.error} if srv.error else {})}, 503)

    @app.get("/v1/models", responses=_errors(401, 500))
    async def models() -> Response:
        card = {"id": alias, "object": "model", "created": srv.created, "owned_by": "toy"}
        if srv.status == "ok":
            card["max_model_len"] = srv.model.engine.n_ctx
        adapters = srv.adapters()
        if adapters:  # file names only: a client has no business with the server's paths
            card["lora"] = [{"name": Path(p).name if p else None, "scale": sc} for p, sc in adapters]
        return JSONResponse({"object": "list", "data": [card]})

    @app.get("/metrics", response_class=PlainTextResponse)
    async def metrics() -> Response:
        return Response(srv.metrics.render(), media_type=CONTENT_TYPE)

    @app.post(COMPLETIONS, responses={**_API, **_SSE})
    async def completions(body: CompletionRequest, request: Request) -> Response:
        model = srv.ready()
        srv.check_model(body.model)
        S.refuse_unsupported(body)
        prompts = await asyncio.to_thread(_prompts, srv, model, body.prompt, "prompt", body.n)
        k, batch = body.logprobs, _Batch(srv, request)
        for ids, text in prompts:
            budget = _budget(model, ids, body.max_tokens)
            for i in range(body.n):
                params = S.sampling_params(body, max_tokens=budget, logprobs=k, index=i)
                c = batch.add(ids, params, i == 0, prompt_logprobs=k if body.echo and k is not None else None)
                c.echo = text if body.echo else ""
                c.lp = S.LegacyLogprobs(model.tokenizer) if k is not None else None
        batch.submit()
        head = {"id": f"cmpl-{batch.rid}", "object": "text_completion", "created": int(time.time()), "model": alias}
        if not body.stream:
            async for c, ev in batch.events(watch=True):
                _completion_event(c, ev)
            if err := batch.failed():
                raise err
            choices = []
            for c in batch.choices:
                lps = c.lp.take() if c.lp is not None else None
                choices.append(
                    {"index": c.index, "text": c.echo + "".join(c.text), "logprobs": lps, "finish_reason": c.finish}
                )
            return JSONResponse({**head, "choices": choices, "usage": batch.usage()})
        extra = {"usage": None} if body.include_usage else {}

        def chunk(c: _Choice, text: str, logprobs: dict | None, finish: str | None) -> str:
            choice = {"index": c.index, "text": text, "logprobs": logprobs, "finish_reason": finish}
            return _sse({**head, "choices": [choice], **extra})

        async def gen() -> AsyncIterator[str]:
            for c in batch.choices:
                if c.echo and c.lp is None:
                    yield chunk(c, c.echo, None, None)
            async for c, ev in batch.events(watch=False):
                text, lps = _completion_event(c, ev)
                if ev["type"] == "done":
                    yield chunk(c, "", None, c.finish)
                elif text or lps:
                    yield chunk(c, text, lps, None)
            if body.include_usage:
                yield _sse({**head, "choices": [], "usage": batch.usage()})

        return _stream(_safe_stream(batch, gen()))

    @app.post(CHAT, responses={**_API, **_SSE})
    async def chat(body: ChatCompletionRequest, request: Request) -> Response:
        model = srv.ready()
        srv.check_model(body.model)
        S.refuse_unsupported(body)
        if body.n > srv.settings.jobs_per_request:
            raise APIError(400, f"n={body.n} is more than {srv.settings.jobs_per_request} sequences", param="n")
        ids = await asyncio.to_thread(model.prompt_ids, [m.plain() for m in body.messages])
        budget = _budget(model, ids, body.budget)
        k, batch, tok = (body.top_logprobs or 0) if body.logprobs else None, _Batch(srv, request), model.tokenizer
        for i in range(body.n):
            c = batch.add(ids, S.sampling_params(body, max_tokens=budget, logprobs=k, index=i), i == 0)
            c.lp = [] if k is not None else None
        batch.submit()

        def entry(c: _Choice, ev: dict) -> list | None:
            if c.lp is None or ev["type"] != "token" or ev["token"] is None or ev["logprob"] is None:
                return None
            c.lp.append(S.chat_logprob(tok, ev["token"], ev["logprob"].logprob, ev["logprob"].top))
            return c.lp[-1:]

        head = {"id": f"chatcmpl-{batch.rid}", "created": int(time.time()), "model": alias}
        if not body.stream:
            async for c, ev in batch.events(watch=True):
                entry(c, ev)
            if err := batch.failed():
                raise err
            choices = []
            for c in batch.choices:
                message = {"role": "assistant", "content": "".join(c.text)}
                lps = {"content": c.lp} if c.lp is not None else None
                choices.append({"index": c.index, "message": message, "logprobs": lps, "finish_reason": c.finish})
            return JSONResponse({**head, "object": "chat.completion", "choices": choices, "usage": batch.usage()})
        head = {**head, "object": "chat.completion.chunk", **({"usage": None} if body.include_usage else {})}

        def chunk(c: _Choice, delta: dict, logprobs: list | None, finish: str | None) -> str:
            lps = {"content": logprobs} if logprobs is not None else None
            return _sse(
                {**head, "choices": [{"index": c.index, "delta": delta, "logprobs": lps, "finish_reason": finish}]}
            )

        async def gen() -> AsyncIterator[str]:
            for c in batch.choices:
                yield chunk(c, {"role": "assistant", "content": ""}, None, None)
            async for c, ev in batch.events(watch=False):
                lps = entry(c, ev)
                if ev["type"] == "done":
                    yield chunk(c, {}, None, c.finish)
                elif ev["type"] == "token" and (ev["text"] or lps):
                    yield chunk(c, {"content": ev["text"]}, lps, None)
            if body.include_usage:
                yield _sse({**head, "choices": [], "usage": batch.usage()})

        return _stream(_safe_stream(batch, gen()))

    @app.post(EMBEDDINGS, responses=_API)
    async def embeddings(body: EmbeddingRequest, request: Request) -> Response:
        model = srv.ready()
        srv.check_model(body.model)
        d = model.cfg.d_model
        if body.dimensions is not None and body.dimensions != d:
            msg = f"dimensions={body.dimensions}: this model's embeddings have {d} dimensions (no truncation)"
            raise APIError(400, msg, param="dimensions")
        inputs = await asyncio.to_thread(_prompts, srv, model, body.input, "input", 1)
        batch = _Batch(srv, request)
        for ids, _ in inputs:
            _budget(model, ids, 0)
            batch.add(ids, SamplingParams(max_tokens=0), kind="embed")
        batch.submit()
        async for _ in batch.events(watch=True):
            pass
        if err := batch.failed():
            raise err
        data = []
        for c in batch.choices:
            v = np.asarray(c.vector if c.vector is not None else np.zeros(d), dtype=np.float64)
            norm = float(np.linalg.norm(v))
            v = (v / norm if body.normalize and norm > 0 else v).astype("<f4")
            emb = base64.b64encode(v.tobytes()).decode("ascii") if body.encoding_format == "base64" else v.tolist()
            data.append({"object": "embedding", "index": c.index, "embedding": emb})
        n = batch.usage()["prompt_tokens"]
        usage = {"prompt_tokens": n, "total_tokens": n}
        return JSONResponse({"object": "list", "data": data, "model": alias, "usage": usage})

    @app.post("/tokenize", responses=_API)
    async def tokenize(body: TokenizeRequest) -> Response:
        model = srv.ready()
        srv.check_model(body.model)
        return JSONResponse({"tokens": await asyncio.to_thread(model.tokenize, body.content, body.add_special)})

    @app.post("/detokenize", responses=_API)
    async def detokenize(body: DetokenizeRequest) -> Response:
        model = srv.ready()
        srv.check_model(body.model)
        n = model.tokenizer.vocab_size
        bad = next((t for t in body.tokens if not 0 <= t < n), None)
        if bad is not None:
            raise APIError(400, f"token id {bad} is outside the vocabulary (0..{n - 1})", param="tokens")
        return JSONResponse({"content": await asyncio.to_thread(model.detokenize, body.tokens)})


__all__ = ["create_app"]
