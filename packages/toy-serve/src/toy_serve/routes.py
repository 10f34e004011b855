"""The routes: /health, /v1/models, /metrics, /v1/completions,
/v1/chat/completions, /v1/embeddings, /tokenize, /detokenize, /tokenizer_info and
/server_info (a router's question which model this worker serves) (``add_routes``),
/slots/{id} (slot save, restore and erase: ``add_slot_routes``),
/v1/adapters (load, list and unload adapters: ``toy_serve.adapters``),
and the mapping of toy's exceptions to OpenAI-shaped errors (``toy_error``)."""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import time
from collections.abc import AsyncIterator, Iterator
from http import HTTPStatus
from pathlib import Path
from typing import Annotated, Any, Literal, cast

import numpy as np
from fastapi import FastAPI, Query, Request
from fastapi import Path as FPath
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from pydantic import BaseModel

from toy.engine import constrain
from toy.engine.constrain import Constraint
from toy.engine.llm import ContextOverflowError
from toy.engine.sampling import SamplingParams
from toy.errors import BadInputError, ToyError
from toy.tokenizer.chat import ChatTemplateError
from toy.tokenizer.vocab import TokenizerError
from toy_serve import schemas as S
from toy_serve import tools as T
from toy_serve.jobs import Batch, Choice, safe_stream, sse, stream
from toy_serve.metrics import CONTENT_TYPE
from toy_serve.schemas import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    EmbeddingRequest,
    TokenizeRequest,
)
from toy_serve.server import CHAT, COMPLETIONS, DEFAULT_PARAM, EMBEDDINGS, Server, internal, log
from toy_serve.worker import QueueFullError, SlotBusyError

# each POST route's request model: the fields an error's ``param`` can name
_REQUESTS: dict[str, type[BaseModel]] = {
    COMPLETIONS: CompletionRequest,
    CHAT: ChatCompletionRequest,
    EMBEDDINGS: EmbeddingRequest,
    "/tokenize": TokenizeRequest,
    "/detokenize": DetokenizeRequest,
}


def toy_error(srv: Server, request: Request, exc: ToyError) -> APIError:
    msg = str(exc) + (f" ({exc.hint})" if getattr(exc, "hint", None) else "")
    path = request.url.path
    if isinstance(exc, QueueFullError):
        if srv.status == "stopping" or exc.shutting_down:
            return APIError(503, str(exc), type="server_error", headers={"retry-after": "1"})
        return APIError(429, str(exc), type="rate_limit_error", code="queue_full", headers={"retry-after": "1"})
    if isinstance(exc, constrain.ConstraintBusyError):  # every compile place is taken: not the request's fault
        return APIError(503, msg, type="server_error", code="constraint_compilers_busy", headers={"retry-after": "1"})
    if isinstance(exc, (BadInputError, ChatTemplateError, TokenizerError)):
        # the error carries its field in toy's names (toy.errors); param_of says what the request calls it
        lp = "top_logprobs" if path == CHAT else "logprobs"
        param = S.param_of(getattr(exc, "field", None), _REQUESTS.get(path), DEFAULT_PARAM.get(path), lp)
        if isinstance(exc, ContextOverflowError):
            return APIError(400, msg, param=param, code="context_length_exceeded")
        return APIError(400, msg, param=param)
    rid = request.scope.get("toy.request_id")
    log.error("request %s: %s: %s", rid, type(exc).__name__, exc)
    return internal(msg, rid)


def _prompts(srv: Server, model: Any, prompt: Any, field: str, n: int) -> list[tuple[list[int], str]]:
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
            field="prompt",
        )
    return mt


def _limits(srv: Server) -> constrain.ConstraintLimits:
    return dataclasses.replace(constrain.LIMITS, compile_timeout=srv.settings.constraint_timeout)


def _precheck_tools(srv: Server, tools: list[dict], used: list[dict]) -> None:
    """400 naming ``tools.N.function.parameters`` for the first parameters schema ``used`` in a call grammar that
    is past the constraint limits (``toy.engine.constrain.precheck``, a non-recursive scan)."""
    limits = _limits(srv)
    for i, t in enumerate(tools):
        params = t["function"].get("parameters")
        if any(u is t for u in used) and isinstance(params, dict):
            where = f"tools.{i}.function.parameters"
            try:
                constrain.precheck(Constraint.json_schema(params), limits)
            except constrain.ConstraintError as e:
                raise APIError(400, f"{where}: {e}" + (f" ({e.hint})" if e.hint else ""), param=where) from None


async def _constraint(srv: Server, model: Any, body: Any, jobs: int, tool_grammar: Constraint | None = None):
    """The request's constraint compiled once, off the event loop, after checking that its ``jobs`` fit the
    queue (a full queue is a 429 before any compile): ``tool_grammar`` (a forced or strict tool call, 400 naming
    ``tools``), else the request's own (``S.constraint``, 400 naming its field). Each choice's sampler copies
    the compiled matcher."""
    assert srv.worker is not None  # ready() says the worker runs
    srv.worker.ensure_room(jobs)
    limits = _limits(srv)
    if tool_grammar is None:
        return await asyncio.to_thread(S.constraint, body, model.tokenizer, limits)
    try:
        c = dataclasses.replace(tool_grammar, origin="tools")
        return await asyncio.to_thread(constrain.prepare, c, model.tokenizer, limits)
    except constrain.ConstraintError as e:
        raise APIError(400, f"tools: {e}" + (f" ({e.hint})" if e.hint else ""), param="tools") from None


async def _tool_constraint(srv: Server, model: Any, body: Any, tools: list[dict], used: list[dict], grammar):
    """A forced or strict tool call's constraint (``_constraint``). When it does not compile, the 400 names
    ``tools.N.function.parameters`` of the first function of ``used`` whose parameters do not compile on
    their own (``T.blame``; further compiles start only within one more compile deadline), in terms of the
    client's schema, not toy's call grammar; the original 400 when none is to blame."""
    try:
        return await _constraint(srv, model, body, body.n, grammar)
    except APIError as e:
        if e.status != 400 or e.param != "tools":
            raise
        first = e
    limits = _limits(srv)
    deadline = time.monotonic() + limits.compile_timeout

    def compile_schema(schema: dict) -> None:
        if time.monotonic() > deadline:
            raise TimeoutError
        constrain.prepare(Constraint.json_schema(schema), model.tokenizer, limits)

    try:
        found = await asyncio.to_thread(T.blame, tools, used, compile_schema)
    except TimeoutError:
        found = None
    if found is None:
        raise first
    raise APIError(400, found[1], param=found[0])


def _completion_event(c: Choice, ev: dict) -> tuple[str, dict | None]:
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
_SSE: dict[int | str, dict[str, Any]] = {
    200: {"content": {"text/event-stream": {"schema": {"type": "string"}}}, "description": "OK (stream)"}
}


def add_routes(app: FastAPI, srv: Server) -> None:
    alias = srv.settings.alias
    srv.metrics.watch_telemetry(lambda: srv.writer)  # toy_telemetry_ok / _errors_total, read at each scrape
    add_slot_routes(app, srv)
    from toy_serve.adapters import add_adapter_routes

    add_adapter_routes(app, srv)

    @app.get("/health", responses={503: {"description": "loading, draining or failed to load"}})
    async def health() -> Response:
        if srv.status == "ok":
            return JSONResponse({"status": "ok"})
        # "stopping" is said "draining" here, the word routers and load balancers use for it
        status = "draining" if srv.status == "stopping" else srv.status
        return JSONResponse({"status": status, **({"message": srv.error} if srv.error else {})}, 503)

    @app.get("/v1/models", responses=_errors(401, 500))
    async def models() -> Response:
        card = {"id": alias, "object": "model", "created": srv.created, "owned_by": "toy"}
        if srv.status == "ok":
            card["max_model_len"] = srv.ready().engine.n_ctx  # the model, as the status is "ok"
        adapters = srv.adapters()
        if adapters:  # file names only: a client has no business with the server's paths
            card["lora"] = [{"name": Path(p).name if p else None, "scale": sc} for p, sc in adapters]
        cards = [card]
        for j, item in enumerate(srv.adapter_slots()):  # each selectable adapter is a model too
            if item is None:  # an index an unloaded adapter left
                continue
            name, p, sc = item
            extra = {"max_model_len": card["max_model_len"]} if "max_model_len" in card else {}
            cards.append({
                "id": f"{alias}:{name}", "object": "model", "created": srv.created, "owned_by": "toy",
                "parent": alias, **extra, "adapter": {"id": j, "name": name, "file": Path(p).name if p else None, "scale": sc},
            })  # fmt: skip
        return JSONResponse({"object": "list", "data": cards})

    @app.get("/metrics", response_class=PlainTextResponse)
    async def metrics() -> Response:
        return Response(srv.metrics.render(), media_type=CONTENT_TYPE)

    @app.post(COMPLETIONS, responses={**_API, **_SSE})
    async def completions(body: CompletionRequest, request: Request) -> Response:
        model = srv.ready()
        adapter = srv.hold_adapter(S.adapter_of(body, srv.check_model(body.model), srv.adapter_slots()), request)
        S.refuse_unsupported(body)
        prompts = await asyncio.to_thread(_prompts, srv, model, body.prompt, "prompt", body.n)
        cons = await _constraint(srv, model, body, len(prompts) * body.n)
        k, batch = body.logprobs, Batch(srv, request)
        for ids, text in prompts:
            budget = _budget(model, ids, body.max_tokens)
            for i in range(body.n):
                params = S.sampling_params(body, max_tokens=budget, logprobs=k, index=i, constraint=cons)
                c = batch.add(
                    ids,
                    params,
                    i == 0,
                    prompt_logprobs=k if body.echo and k is not None else None,
                    adapter=adapter,
                    speculative=S.speculative_of(body),
                )
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
            return JSONResponse({**head, "choices": choices, "usage": batch.usage(), **batch.timings()})
        extra = {"usage": None} if body.include_usage else {}

        def chunk(c: Choice, text: str, logprobs: dict | None, finish: str | None) -> str:
            choice = {"index": c.index, "text": text, "logprobs": logprobs, "finish_reason": finish}
            return sse({**head, "choices": [choice], **extra})

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
                yield sse({**head, "choices": [], "usage": batch.usage()})

        return stream(safe_stream(batch, gen()))

    @app.post(CHAT, responses={**_API, **_SSE})
    async def chat(body: ChatCompletionRequest, request: Request) -> Response:
        model = srv.ready()
        adapter = srv.hold_adapter(S.adapter_of(body, srv.check_model(body.model), srv.adapter_slots()), request)
        S.refuse_unsupported(body)
        if body.n > srv.settings.jobs_per_request:
            raise APIError(400, f"n={body.n} is more than {srv.settings.jobs_per_request} sequences", param="n")
        mode = body.tool_mode
        tools = [t.model_dump(exclude_none=True) for t in body.tools or []] if mode != "none" else []
        messages, chat_vars = [m.plain() for m in body.messages], {}
        if tools or any(m.get("tool_calls") or m["role"] == "tool" for m in messages):
            native = T.template_knows_tools(model.chat_template)
            messages = T.render_messages(messages, tools, native)
            if native and tools:
                chat_vars = {"tools": tools}
        ids = await asyncio.to_thread(model.prompt_ids, messages, False, chat_vars)
        cons: Constraint | None
        if mode in ("required", "named"):
            chosen = (
                tools
                if mode == "required"
                else [
                    t for t in tools if t["function"]["name"] == cast(S.NamedToolChoice, body.tool_choice).function.name
                ]
            )
            _precheck_tools(srv, tools, chosen)
            forced = T.forced_call(chosen, parallel=body.parallel_tool_calls)
            cons = await _tool_constraint(srv, model, body, tools, chosen, forced)
        elif mode == "auto" and (strict := T.strict_auto(tools, parallel=body.parallel_tool_calls)):
            used = [t for t in tools if t["function"].get("strict")]
            _precheck_tools(srv, tools, used)
            cons = await _tool_constraint(srv, model, body, tools, used, strict)
        else:
            cons = await _constraint(srv, model, body, body.n)
        names = {t["function"]["name"] for t in tools}
        budget = _budget(model, ids, body.budget)
        k, batch, tok = (body.top_logprobs or 0) if body.logprobs else None, Batch(srv, request), model.tokenizer
        for i in range(body.n):
            params = S.sampling_params(body, max_tokens=budget, logprobs=k, index=i, constraint=cons)
            c = batch.add(ids, params, i == 0, adapter=adapter, speculative=S.speculative_of(body))
            c.lp = [] if k is not None else None
            c.tools = T.ToolParser(names) if tools else None
        batch.submit()

        def entry(c: Choice, ev: dict) -> list | None:
            if c.lp is None or ev["type"] != "token" or ev["token"] is None or ev["logprob"] is None:
                return None
            c.lp.append(S.chat_logprob(tok, ev["token"], ev["logprob"].logprob, ev["logprob"].top))
            return c.lp[-1:]

        def tool_calls(calls: list[dict]) -> list[dict]:
            return [{"id": T.new_call_id(), "type": "function", "function": call} for call in calls]

        head = {"id": f"chatcmpl-{batch.rid}", "created": int(time.time()), "model": alias}
        if not body.stream:
            async for c, ev in batch.events(watch=True):
                entry(c, ev)
            if err := batch.failed():
                raise err
            choices = []
            for c in batch.choices:
                message: dict[str, Any] = {"role": "assistant", "content": "".join(c.text)}
                finish = c.finish
                if c.tools is not None:
                    c.tools.feed(message["content"])
                    c.tools.finish()
                    message["content"] = c.tools.message_content()
                    if c.tools.calls:
                        message["tool_calls"] = tool_calls(c.tools.calls)
                        finish = "tool_calls" if finish != "cancelled" else finish
                lps = {"content": c.lp} if c.lp is not None else None
                choices.append({"index": c.index, "message": message, "logprobs": lps, "finish_reason": finish})
            body_ = {**head, "object": "chat.completion", "choices": choices, "usage": batch.usage()}
            return JSONResponse({**body_, **batch.timings()})
        head = {**head, "object": "chat.completion.chunk", **({"usage": None} if body.include_usage else {})}

        def chunk(c: Choice, delta: dict, logprobs: list | None, finish: str | None) -> str:
            lps = {"content": logprobs} if logprobs is not None else None
            return sse(
                {**head, "choices": [{"index": c.index, "delta": delta, "logprobs": lps, "finish_reason": finish}]}
            )

        def tool_chunks(c: Choice, deltas: list, lps: list | None) -> Iterator[str]:
            for kind, value in deltas:
                if kind == "content":
                    yield chunk(c, {"content": value}, lps, None)
                else:
                    n, c.sent_calls = c.sent_calls, c.sent_calls + 1
                    first = {"index": n, "id": T.new_call_id(), "type": "function"}
                    first["function"] = {"name": value["name"], "arguments": ""}
                    yield chunk(c, {"tool_calls": [first]}, lps, None)
                    rest = {"index": n, "function": {"arguments": value["arguments"]}}
                    yield chunk(c, {"tool_calls": [rest]}, None, None)
                lps = None

        async def gen() -> AsyncIterator[str]:
            for c in batch.choices:
                yield chunk(c, {"role": "assistant", "content": ""}, None, None)
            async for c, ev in batch.events(watch=False):
                lps = entry(c, ev)
                if ev["type"] == "done":
                    finish = c.finish
                    if c.tools is not None:
                        for line in tool_chunks(c, c.tools.finish(), None):
                            yield line
                        if c.tools.calls and finish != "cancelled":
                            finish = "tool_calls"
                    yield chunk(c, {}, None, finish)
                elif ev["type"] == "token" and c.tools is not None:
                    lines = list(tool_chunks(c, c.tools.feed(ev["text"]), lps))
                    if not lines and lps:
                        lines = [chunk(c, {"content": ""}, lps, None)]
                    for line in lines:
                        yield line
                elif ev["type"] == "token" and (ev["text"] or lps):
                    yield chunk(c, {"content": ev["text"]}, lps, None)
            if body.include_usage:
                yield sse({**head, "choices": [], "usage": batch.usage()})

        return stream(safe_stream(batch, gen()))

    @app.post(EMBEDDINGS, responses=_API)
    async def embeddings(body: EmbeddingRequest, request: Request) -> Response:
        model = srv.ready()
        adapter = srv.hold_adapter(srv.check_model(body.model), request)
        d = model.cfg.d_model
        if body.dimensions is not None and body.dimensions != d:
            msg = f"dimensions={body.dimensions}: this model's embeddings have {d} dimensions (no truncation)"
            raise APIError(400, msg, param="dimensions")
        inputs = await asyncio.to_thread(_prompts, srv, model, body.input, "input", 1)
        batch = Batch(srv, request)
        for ids, _ in inputs:
            _budget(model, ids, 0)
            batch.add(ids, SamplingParams(max_tokens=0), kind="embed", adapter=adapter)
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
        text = await asyncio.to_thread(model.detokenize, body.tokens)
        return JSONResponse({"content": text, "prompt": text})  # llama.cpp's key, and vLLM's

    @app.get("/tokenizer_info", responses=_errors(401, 503))
    async def tokenizer_info() -> Response:
        """The tokenizer's special tokens, flags and chat template (vLLM's endpoint, which
        lm-evaluation-harness asks for to tokenize through /tokenize with no local tokenizer)."""
        from toy.tokenizer.export import tokenizer_info as info

        model = srv.ready()
        return JSONResponse(info(model.tokenizer, model.chat_template, model.engine.n_ctx))

    @app.get("/server_info", include_in_schema=False)
    async def server_info() -> Response:
        """SGLang's worker route, for routers that ask each worker which model it serves: sglang-router
        (sending its ``--api-key``) names its workers' model after ``served_model_name``, in its own
        /v1/models too, where it says "unknown" without this. The alias only, never a path on this
        machine; the API key applies. Left out of the OpenAPI document: a compatibility shim for
        routers, not part of toy's API."""
        card = {"model_path": alias, "served_model_name": alias, "is_generation": True}
        if srv.status == "ok":
            card["max_context_length"] = srv.ready().engine.n_ctx
        return JSONResponse(card)


# ------------------------------------------------------------------ slot save / restore (llama-server's API)


def slot_file(srv: Server, body: S.SlotRequest | None) -> Path:
    """The slot file a request names: a bare file name inside ``--slot-save-path`` (400 for anything else,
    501 when the option is not set)."""
    folder = srv.settings.slot_save_path
    if folder is None:
        raise APIError(
            501,
            "slot save/restore is off on this server (start it with --slot-save-path DIR)",
            type="server_error",
            code="not_implemented",
        )
    name = body.filename if body is not None else None
    if not name:
        raise APIError(400, "filename is required for save and restore", param="filename")
    bad = "/" in name or "\\" in name or "\0" in name or ".." in name or name.startswith(".")
    if bad or Path(name).name != name:
        msg = f"filename {name!r} must be a bare file name (no path separators, no '..', not hidden)"
        raise APIError(400, msg, param="filename")
    return Path(folder) / name


def add_slot_routes(app: FastAPI, srv: Server) -> None:
    @app.post("/slots/{id_slot}", responses=_errors(400, 401, 409, 500, 501, 503))
    async def slots(
        id_slot: Annotated[int, FPath(ge=0, description="The slot (0 to --parallel - 1).")],
        action: Annotated[Literal["save", "restore", "erase"], Query(description="What to do with the slot.")],
        body: S.SlotRequest | None = None,
    ) -> Response:
        """Save a slot's cache to a file, restore one into a slot, or erase a slot (llama-server's
        ``/slots/{id}?action=save|restore|erase``); files live in ``--slot-save-path`` only. A slot that is
        processing a request answers 409. Runs on the engine's thread between two steps."""
        srv.ready()
        worker = srv.worker
        assert worker is not None  # ready() says the worker runs
        path = slot_file(srv, body) if action != "erase" else None
        if action == "restore" and path is not None and not path.is_file():
            raise APIError(400, f"no slot file {path.name!r} in the slot save folder", param="filename")
        t0 = time.perf_counter()

        def run() -> dict[str, Any]:
            if path is None:
                return {"id_slot": id_slot, "n_erased": worker.erase_slot(id_slot)}
            if action == "save":
                path.parent.mkdir(parents=True, exist_ok=True)
                n, size = worker.save_slot(id_slot, path, srv.fingerprint)
                ms = (time.perf_counter() - t0) * 1000
                return {
                    "id_slot": id_slot,
                    "filename": path.name,
                    "n_saved": n,
                    "n_written": size,
                    "timings": {"save_ms": ms},
                }
            n, size = worker.restore_slot(id_slot, path, srv.fingerprint)
            ms = (time.perf_counter() - t0) * 1000
            return {
                "id_slot": id_slot,
                "filename": path.name,
                "n_restored": n,
                "n_read": size,
                "timings": {"restore_ms": ms},
            }

        try:
            out = await asyncio.wrap_future(worker.call(run))
        except SlotBusyError as e:
            raise APIError(409, f"{e} ({e.hint})" if e.hint else str(e), param="id_slot", code="slot_busy") from e
        except BadInputError as e:
            msg = str(e) + (f" ({e.hint})" if e.hint else "")
            raise APIError(400, msg, param=getattr(e, "field", None)) from e
        return JSONResponse(out)
