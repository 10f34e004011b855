"""The engine worker: one thread owns the model and runs continuous batching.

Requests (``Job``) are queued by ``submit`` from any thread; the worker
loop, between steps:

1. admits queued jobs into free cache slots (the slot whose cached tokens
   share the longest prefix with the prompt wins: that prefix is not
   prefilled again);
2. runs ONE prefill chunk (at most ``prefill_chunk`` tokens) of one job in
   prefill, round-robin, so a long prompt never stalls the others for more
   than a chunk;
3. runs ONE decode step for every job that is generating (one graph).

Exactness: the engine runs with ``exact_batching`` (every product
row-invariant, per-sequence attention), so a token's K/V and logits depend
only on its own context. A job that names a selectable LoRA adapter
(``Job.adapter``) sets its slot's adapter (``engine.slot_adapter``); a
cached prefix is reused only from a slot whose cache was computed with the
same adapter. A request's greedy output is therefore identical
whatever else is in the batch, however its prompt was chunked, and whether
its prefix came from the cache.

Each job reports through ``emit(event)`` (called on the worker thread; the
app forwards to asyncio). Events: ``{"type": "prompt_logprobs", "items"}``,
``{"type": "token", "token", "text", "logprob"}`` (``text`` may be ""
while UTF-8 or a possible stop string is held back; a stop token is
reported with ``"stop": True`` and empty text, and counted in the usage), ``{"type":
"embedding", "vector"}``, ``{"type": "done", "finish_reason", "usage",
"timings"}`` and ``{"type": "error", "message", "shutting_down"}``
(``shutting_down``: the job was ended by the server stopping, a 503, not by a
failure). ``done`` or ``error`` is always the last event. A cancelled job
(client gone) frees its slot at the next step and ends with finish_reason
"cancelled".

The token step is the library's: a generate job carries a
``toy.engine.decoding.DecodeState`` (sampler, stop tokens and strings,
UTF-8 decoder, history, logprobs, token limit, one order of operations) and
slots are picked with its ``reuse_prefix``; this module only adds what a
server does around it (batching, the stop token as an event counted in the
usage, prompt logprobs, cancellation). See docs/concepts/architecture.md.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from toy.engine.decoding import DecodeState, reuse_prefix
from toy.engine.sampling import SamplingParams, log_softmax, top_logprobs
from toy.errors import BadInputError, ToyError

log = logging.getLogger("toy_serve")


class QueueFullError(ToyError):
    """No place for the request: the queue is full (429 with Retry-After) or, with ``shutting_down``, the
    server is stopping (503)."""

    def __init__(self, message: str, hint: str | None = None, *, shutting_down: bool = False):
        super().__init__(message, hint)
        self.shutting_down = shutting_down


@dataclass
class Job:
    """One request sequence: what it asks for, then the worker's state of it (every field it carries)."""

    id: str
    ids: list[int]
    params: SamplingParams
    emit: Callable[[dict], object]  # called with each event; what it returns is ignored
    kind: str = "generate"  # "generate" | "embed"
    prompt_logprobs: int | None = None  # echo scoring: top-n alternatives per prompt token
    adapter: int | None = None  # the selectable LoRA adapter (engine index) this job uses; None: the base
    cancelled: threading.Event = field(default_factory=threading.Event)
    # worker state
    decoding: DecodeState | None = field(default=None, repr=False)  # a "generate" job's token step (by submit)
    slot: int = -1
    pos: int = 0  # prompt tokens already in the cache
    cached: int = 0  # of them, reused from the slot's cache
    phase: str = "queued"  # queued -> prefill | embed -> decode -> done
    pending: int | None = None  # the last sampled token, fed to the next decode step
    hidden: list[np.ndarray] = field(default_factory=list)  # an "embed" job's hidden states, chunk by chunk
    prompt_lp: list[dict | None] = field(default_factory=list)  # prompt logprobs so far
    t_submit: float = field(default_factory=time.perf_counter)
    t_start: float = 0.0  # placed in a slot
    t_first: float = 0.0  # first token sampled
    t_last: float = 0.0  # last token sampled

    @property
    def out(self) -> list[int]:
        """The tokens generated so far, a stop token included (the usage counts it)."""
        return self.decoding.tokens if self.decoding is not None else []

    def cancel(self) -> None:
        self.cancelled.set()


class EngineWorker:
    """Continuous batching over ``model`` (a ``toy.Model`` loaded with
    ``n_slot`` slots and ``exact_batching``). ``metrics`` (optional) gets
    observations (see ``toy_serve.metrics.Metrics``)."""

    def __init__(self, model, max_queue: int = 64, prefill_chunk: int = 128, metrics=None):
        self.model, self.engine = model, model.engine
        self.n_slot = self.engine.n_slot
        self.max_queue, self.prefill_chunk = max_queue, prefill_chunk
        self.metrics = metrics
        self._queue: deque[Job] = deque()
        self._slots: list[Job | None] = [None] * self.n_slot
        self._cv = threading.Condition()
        self._stop = False
        self._rr = 0
        self._thread = threading.Thread(target=self._run, name="toy-engine", daemon=True)
        self.steps = 0

    # -- control (any thread)

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        """Stop after the current step; jobs still queued or running end with an error event."""
        with self._cv:
            self._stop = True
            self._cv.notify_all()
        self._thread.join(timeout)

    def busy(self) -> int:
        with self._cv:
            return len(self._queue) + sum(j is not None for j in self._slots)

    @property
    def queue_depth(self) -> int:
        return len(self._queue)

    @property
    def active(self) -> int:
        return sum(j is not None for j in self._slots)

    def submit(self, job: Job) -> Job:
        """Queue a job; raises BadInputError (prompt/budget) or QueueFullError."""
        if not job.ids:
            raise BadInputError("the prompt is empty (no tokens)", field="prompt")
        budget = len(job.ids) + (job.params.max_tokens if job.kind == "generate" else 0)
        if budget > self.engine.n_ctx:
            from toy.engine.llm import ContextOverflowError

            raise ContextOverflowError(
                f"this request needs {budget} tokens (prompt {len(job.ids)}"
                + (f" + max_tokens {job.params.max_tokens}" if job.kind == "generate" else "")
                + f"), more than the context of {self.engine.n_ctx} tokens per sequence",
                hint="shorten the prompt or lower max_tokens",
                field="prompt",
            )
        if job.kind == "generate":
            # Per-request preparation happens here, on the caller's thread, never under the worker's lock.
            # OpenAI-style accounting: the stop token is reported and counted in the usage.
            model = self.model
            job.decoding = DecodeState(job.params, model.tokenizer, model.cfg.n_vocab, job.ids, count_stop_token=True)
        with self._cv:
            if self._stop:
                raise QueueFullError("the server is shutting down", shutting_down=True)
            gone = [j for j in self._queue if j.cancelled.is_set()]  # clients that left do not hold places
            for j in gone:
                self._queue.remove(j)
                self._finish_queued(j)
            if len(self._queue) >= self.max_queue:
                raise QueueFullError(f"the queue is full ({self.max_queue} requests waiting)")
            self._queue.append(job)
            self._cv.notify_all()
        self._gauges()
        return job

    # -- the loop (worker thread)

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._stop and not self._queue and not any(self._slots):
                    self._cv.wait(0.5)
                if self._stop:
                    break
            try:
                self._step()
            except Exception as e:  # an engine failure must not kill the worker: fail the jobs in flight
                log.exception("engine step failed")
                for i, j in enumerate(self._slots):
                    if j is not None:
                        self._fail(j, f"internal error: {type(e).__name__}: {e}")
                        self._slots[i] = None
                        self.engine.cache.clear(i)
        with self._cv:
            left = list(self._queue) + [j for j in self._slots if j is not None]
            self._queue.clear()
            self._slots = [None] * self.n_slot
        for j in left:
            self._fail(j, "the server is shutting down", shutting_down=True)

    def _step(self) -> None:
        self._admit()
        for j in list(self._slots):
            if j is not None and j.cancelled.is_set():
                self._finish(j, "cancelled")
        jobs = [j for j in self._slots if j is not None]
        pre = [j for j in jobs if j.phase in ("prefill", "embed")]
        if pre:
            self._rr = (self._rr + 1) % len(pre)
            self._prefill_chunk(pre[self._rr])
        dec = [j for j in self._slots if j is not None and j.phase == "decode"]
        if dec:
            out = self.engine.decode([j.slot for j in dec], [j.pending for j in dec])
            for j, row in zip(dec, out):
                self._after_forward(j, row)
        self.steps += 1
        self._gauges()

    def _admit(self) -> None:
        with self._cv:
            while self._queue and None in self._slots:
                job = self._queue.popleft()
                if job.cancelled.is_set():
                    self._finish_queued(job)
                    continue
                try:
                    self._place(job)
                except Exception as e:  # e.g. params the Sampler refuses: this job fails, the others go on
                    log.exception("could not start %s", job.id)
                    if 0 <= job.slot < self.n_slot and self._slots[job.slot] is job:
                        self._slots[job.slot] = None
                    self._fail(job, f"{type(e).__name__}: {e}")

    def _place(self, job: Job) -> None:
        """Put a queued job into the free slot that shares the longest prefix (``reuse_prefix``, the library's rule)."""
        free = [i for i, j in enumerate(self._slots) if j is None]
        eng = self.engine
        if job.prompt_logprobs is None and job.kind == "generate":
            best, keep = reuse_prefix(eng.cache, free, job.ids, eng.slot_adapter, job.adapter)
        else:  # scoring and embeddings need every prompt position computed: nothing reused
            best, keep = free[0], 0
        eng.cache.truncate(best, keep)
        eng.slot_adapter[best] = job.adapter
        job.slot, job.pos, job.cached = best, keep, keep
        job.phase = "embed" if job.kind == "embed" else "prefill"
        job.t_start = time.perf_counter()
        self._slots[best] = job
        if self.metrics:
            self.metrics.queue_wait(job.t_start - job.t_submit)

    def _prefill_chunk(self, j: Job) -> None:
        a = j.pos
        chunk = j.ids[a : a + self.prefill_chunk]
        last = a + len(chunk) == len(j.ids)
        if j.phase == "embed":
            j.hidden.append(self.engine.prefill(j.slot, chunk, all_logits=True, hidden=True))
            j.pos += len(chunk)
            if last:
                h = np.concatenate(j.hidden).astype(np.float64).mean(axis=0)
                self._emit(j, {"type": "embedding", "vector": h})
                self._finish(j, "stop")
            return
        if j.prompt_logprobs is not None:
            rows = self.engine.prefill(j.slot, chunk, all_logits=True)
            self._score(j, rows, a)
            logits = rows[-1]
        else:
            logits = self.engine.prefill(j.slot, chunk)
        j.pos += len(chunk)
        if last:
            if j.prompt_logprobs is not None:
                self._emit(j, {"type": "prompt_logprobs", "items": j.prompt_lp})
            j.phase = "decode"
            self._after_forward(j, logits)

    def _score(self, j: Job, rows: np.ndarray, start: int) -> None:
        """Logprob of each prompt token given its prefix (row i predicts token i+1)."""
        if start == 0:
            j.prompt_lp.append(None)  # the first token has no prefix
        n = j.prompt_logprobs or 0
        for r in range(len(rows)):
            nxt = start + r + 1
            if nxt >= len(j.ids):
                break
            lp = log_softmax(rows[r])
            tok = j.ids[nxt]
            item: dict[str, Any] = {"token": tok, "logprob": float(lp[tok])}
            if n:
                ids, vals = top_logprobs(rows[r], n)
                item["top"] = [(int(i), float(v)) for i, v in zip(ids, vals)]
            j.prompt_lp.append(item)

    def _after_forward(self, j: Job, logits: np.ndarray) -> None:
        """One token step over ``logits`` (``DecodeState.advance``): report the token, then go on or finish."""
        first = not j.out
        assert j.decoding is not None  # submit() gives a "generate" job its DecodeState
        step = j.decoding.advance(logits)
        if step.token is None:  # max_tokens=0: nothing sampled
            assert step.finish_reason is not None  # a step without a token ends generation
            self._finish(j, step.finish_reason)
            return
        now = time.perf_counter()
        if first:
            j.t_first = now
            if self.metrics:
                self.metrics.ttft(now - j.t_submit)
        elif self.metrics:
            self.metrics.itl(now - j.t_last)
        j.t_last = now
        event = {"type": "token", "token": step.token, "text": step.text, "logprob": step.logprob}
        if step.stop_token:
            # reported (empty text) and counted, as OpenAI-style servers do: a scorer that sends
            # echo + logprobs + max_tokens=1 drops the last logprob entry as "the generated token"
            event["stop"] = True
        self._emit(j, event)
        if step.finish_reason is not None:
            self._finish(j, step.finish_reason)
        else:
            j.pending = step.token

    # -- endings

    def _usage(self, j: Job) -> dict[str, int]:
        return {"prompt_tokens": len(j.ids), "completion_tokens": len(j.out), "cached_tokens": j.cached}

    def _finish(self, j: Job, reason: str) -> None:
        if j.decoding is not None and j.phase != "queued":
            # the held-back text goes out, also when cancelled (nothing after a stop string); released text that
            # completes a stop string makes it a "stop"
            tail = j.decoding.finish()
            if reason != "cancelled":
                reason = j.decoding.finish_reason or reason
            if tail:
                self._emit(j, {"type": "token", "token": None, "text": tail, "logprob": None})
        now = time.perf_counter()
        timings = {
            "queue_s": (j.t_start or now) - j.t_submit,
            "ttft_s": (j.t_first - j.t_submit) if j.t_first else None,
            "total_s": now - j.t_submit,
        }
        if j.t_first and len(j.out) > 1:
            timings["decode_tok_s"] = (len(j.out) - 1) / max(now - j.t_first, 1e-9)
        self._emit(j, {"type": "done", "finish_reason": reason, "usage": self._usage(j), "timings": timings})
        if 0 <= j.slot < self.n_slot and self._slots[j.slot] is j:
            self._slots[j.slot] = None
        j.phase = "done"
        if self.metrics:
            self.metrics.finished(j, reason, now - j.t_submit)

    def _finish_queued(self, j: Job) -> None:
        """A job cancelled before it got a slot."""
        now = time.perf_counter()
        timings = {"queue_s": now - j.t_submit, "ttft_s": None, "total_s": now - j.t_submit}
        self._emit(j, {"type": "done", "finish_reason": "cancelled", "usage": self._usage(j), "timings": timings})
        j.phase = "done"
        if self.metrics:
            self.metrics.finished(j, "cancelled", now - j.t_submit)

    def _fail(self, j: Job, message: str, shutting_down: bool = False) -> None:
        self._emit(j, {"type": "error", "message": message, "shutting_down": shutting_down})
        j.phase = "done"
        if self.metrics:
            self.metrics.finished(j, "error", time.perf_counter() - j.t_submit)

    def _emit(self, j: Job, event: dict[str, Any]) -> None:
        try:
            j.emit(event)
        except Exception:  # a sink that fails (loop closed) must not stop the worker
            log.debug("dropping an event for %s", j.id, exc_info=True)
            j.cancelled.set()

    def _gauges(self) -> None:
        if self.metrics:
            cache = self.engine.cache
            self.metrics.gauges(
                queue=len(self._queue),
                active=self.active,
                kv_cells=sum(cache.length(s) for s in range(self.n_slot)),
            )


__all__ = ["EngineWorker", "Job", "QueueFullError"]
