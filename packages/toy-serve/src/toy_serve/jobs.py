"""A request's jobs on the engine worker (``Batch``, one ``Choice`` per job)
and the server-sent-event stream that carries their output."""

from __future__ import annotations

import asyncio
import json
import secrets
from collections.abc import AsyncIterator
from typing import Any

import numpy as np
from fastapi import Request
from fastapi.responses import StreamingResponse

from toy.engine.sampling import SamplingParams
from toy_serve import schemas as S
from toy_serve.schemas import APIError
from toy_serve.server import Server, internal, log
from toy_serve.worker import Job

POLL_S = 0.25  # how often a non-stream request checks whether its client is still there


class Choice:
    """One job of a request and what it has produced so far."""

    def __init__(self, index: int, ids: list[int], first: bool):
        self.index, self.ids, self.first = index, ids, first
        self.job: Job | None = None
        self.text: list[str] = []
        self.finish: str | None = None
        self.usage: dict = {}
        self.timings: dict = {}
        self.error: str | None = None
        self.shutting_down = False  # the error is the server stopping (503), not a failure (500)
        self.bad_input: tuple[str | None, str | None] | None = None  # (param, hint): the error is a 400
        self.vector: np.ndarray | None = None
        self.lp: Any = None  # LegacyLogprobs (completions) or a list (chat), when logprobs were asked for
        self.echo = ""
        self.tools: Any = None  # a toy_serve.tools.ToolParser when the request has tools
        self.sent_calls = 0  # tool calls streamed so far
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
            self.error, self.shutting_down = ev["message"], bool(ev.get("shutting_down"))
            if ev.get("bad_input"):  # this job's own sampler or constraint failed (toy_serve.worker)
                self.bad_input = (ev.get("param"), ev.get("hint"))


class Batch:
    """The jobs of one request and the queue their events arrive on."""

    def __init__(self, srv: Server, request: Request):
        self.srv, self.request = srv, request
        self.rid: str = request.scope.get("toy.request_id", secrets.token_hex(12))
        self.stats: dict = request.scope.get("toy.stats", {})
        self.loop = asyncio.get_running_loop()
        self.q: asyncio.Queue = asyncio.Queue()
        self.choices: list[Choice] = []
        self.params: dict[str | None, str] = {}  # toy's field names -> the request's (a constraint's origin)
        request.scope.setdefault("toy.cleanup", []).append(self.cancel)

    def add(self, ids: list[int], params: SamplingParams, first: bool = True, **job: Any) -> Choice:
        c = Choice(len(self.choices), ids, first)
        i, put = c.index, self.q.put_nowait
        emit = lambda ev: self.loop.call_soon_threadsafe(put, (i, ev))  # noqa: E731 - runs on the worker thread
        c.job = Job(f"{self.rid}-{i}", ids, params, emit, **job)
        self.choices.append(c)
        return c

    def submit(self) -> None:
        worker = self.srv.worker
        assert worker is not None  # requests reach here once the server started (status "ok")
        try:
            for c in self.choices:
                assert c.job is not None  # add() gives every choice its job
                worker.submit(c.job)
        except BaseException:
            self.cancel()
            raise

    def cancel(self) -> None:
        for c in self.choices:
            assert c.job is not None  # add() gives every choice its job
            c.job.cancel()

    async def _watch(self) -> None:
        while not await self.request.is_disconnected():
            await asyncio.sleep(POLL_S)
        self.cancel()

    async def events(self, watch: bool) -> AsyncIterator[tuple[Choice, dict]]:
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
        if any(c.shutting_down for c in self.choices if c.error):
            return APIError(503, errors[0], type="server_error", headers={"retry-after": "1"})
        bad = next((c for c in self.choices if c.error and c.bad_input is not None), None)
        if bad is not None and bad.bad_input is not None:
            param, hint = bad.bad_input
            message = bad.error or ""
            return APIError(400, message + (f" ({hint})" if hint else ""), param=self.params.get(param, param))
        return internal(errors[0], self.rid)

    def usage(self) -> dict:
        prompt = sum(len(c.ids) for c in self.choices if c.first)
        done = sum(c.usage.get("completion_tokens", c.n_out) for c in self.choices)
        cached = sum(c.usage.get("cached_tokens", 0) for c in self.choices if c.first)
        u = S.usage(prompt, done, cached)
        drafted = sum(c.timings.get("draft_tokens", 0) for c in self.choices)
        if drafted:  # speculative decoding, in the names of OpenAI's predicted outputs
            accepted = sum(c.timings.get("draft_accepted", 0) for c in self.choices)
            u["completion_tokens_details"] = {
                "accepted_prediction_tokens": accepted,
                "rejected_prediction_tokens": drafted - accepted,
            }
        return u

    def timings(self) -> dict:
        """``{"timings": {"draft_n", "draft_n_accepted"}}`` (llama-server's names) when a choice speculated."""
        spec = [c.timings for c in self.choices if "draft_tokens" in c.timings]
        if not spec:
            return {}
        n = sum(t["draft_tokens"] for t in spec)
        return {"timings": {"draft_n": n, "draft_n_accepted": sum(t["draft_accepted"] for t in spec)}}

    def summarize(self) -> None:
        u = self.usage()
        ttfts = [c.timings["ttft_s"] for c in self.choices if c.timings.get("ttft_s") is not None]
        reasons = sorted({c.finish or ("error" if c.error else "cancelled") for c in self.choices})
        self.stats.update(prompt_tokens=u["prompt_tokens"], completion_tokens=u["completion_tokens"])
        self.stats.update(
            ttft_s=min(ttfts) if ttfts else None, finish_reason=reasons[0] if len(reasons) == 1 else reasons
        )


def sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"


def stream(chunks: AsyncIterator[str]) -> StreamingResponse:
    headers = {"cache-control": "no-cache", "x-accel-buffering": "no"}
    return StreamingResponse(chunks, media_type="text/event-stream", headers=headers)


async def safe_stream(batch: Batch, gen: AsyncIterator[str]) -> AsyncIterator[str]:
    """``gen``'s chunks, then ``data: [DONE]``; a failure mid-stream becomes an error chunk (headers are sent)."""
    try:
        async for chunk in gen:
            yield chunk
        err = batch.failed()
        if err is not None:
            yield sse(err.body())
    except Exception:
        log.exception("stream %s failed", batch.rid)
        yield sse(internal("internal server error", batch.rid).body())
    finally:
        batch.cancel()
    yield "data: [DONE]\n\n"
