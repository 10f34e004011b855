"""The HTTP app: ``create_app(settings, model=None)`` -> an OpenAI-compatible FastAPI app.

Routes: GET /health, /v1/models, /metrics, /tokenizer_info, /server_info (for routers); POST /v1/completions,
/v1/chat/completions, /v1/embeddings, /tokenize, /detokenize; GET/POST /v1/adapters and
DELETE /v1/adapters/{name} (``toy_serve.adapters``). Generation and
embeddings run on one ``EngineWorker`` thread (continuous batching); each
request turns into jobs whose events the worker hands to the event loop
(``loop.call_soon_threadsafe`` into the request's own ``asyncio.Queue``).

Invariants:

- No module-level state: everything lives on ``app.state.toy`` (a
  ``toy_serve.server.Server``), so apps (tests) never share a model, worker or metrics.
- Every response carries ``x-request-id``; every error is in OpenAI's shape
  ``{"error": {"message", "type", "param", "code"}}``; every request is
  counted in ``toy_requests_total{endpoint,status}``; the model endpoints
  each log one ``request`` event in the run bundle, whatever the outcome,
  except a request refused for its API key (401): those are counted in
  /metrics and summed up in a rate-limited ``note`` (see ``toy_serve.guard``),
  so key-less clients cannot grow the bundle.
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
  ``model_not_found`` (a missing or empty ``model`` means the served one),
  404 ``model_not_found`` for ``<model>:<adapter>`` when that adapter is not
  loaded (``toy_serve.adapters``: adapters loaded and unloaded while serving);
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
  /tokenizer_info (vLLM's) describes the tokenizer (special tokens, flags,
  chat template), and /tokenize also takes vLLM's ``add_special_tokens``
  and /detokenize answers vLLM's ``prompt`` beside ``content``: with these
  lm-evaluation-harness's ``local-completions`` tokenizes through the server
  and needs no tokenizer of its own (no hub download).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from toy.errors import BadInputError, ToyError
from toy_serve import schemas as S
from toy_serve.guard import Guard, error_response
from toy_serve.routes import add_routes, toy_error
from toy_serve.schemas import APIError
from toy_serve.server import Server
from toy_serve.settings import Settings


def create_app(settings: Settings, model: Any | None = None) -> FastAPI:
    """An app serving ``model`` (loaded in the background from ``settings.model`` when None)."""
    if model is not None and (not getattr(model.engine, "exact_batching", False) or model.engine.n_slot < 1):
        raise BadInputError("a model passed to create_app must be loaded with exact_batching=True and n_slot >= 1")
    srv = Server(settings, model)

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
    app.add_middleware(Guard, server=srv)

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        return error_response(S.validation_error(list(exc.errors())))

    @app.exception_handler(HTTPException)
    async def _http(request: Request, exc: HTTPException) -> JSONResponse:
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        msg = f"no route {request.method} {request.url.path}" if code else str(exc.detail)
        return error_response(APIError(exc.status_code, msg, code=code, headers=dict(exc.headers or {})))

    @app.exception_handler(ToyError)
    async def _toy(request: Request, exc: ToyError) -> JSONResponse:
        return error_response(toy_error(srv, request, exc))

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
        assert app.openapi_schema is not None  # FastAPI.openapi() stores what it builds there
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]  # FastAPI's documented way to change the schema
    return app


__all__ = ["create_app"]
