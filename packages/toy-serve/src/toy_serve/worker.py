"""The engine worker: one thread owns the model and runs continuous batching.

Requests (``Job``) are queued by ``submit`` from any thread; the worker
loop, between steps:

1. admits queued jobs into free cache slots (the slot whose cached tokens
   share the longest prefix with the prompt wins: that prefix is not
   prefilled again); with a prefix cache (``toy.engine.prefix``), blocks
   it holds beyond that prefix are copied into the slot too (any earlier
   request's, same adapter), and a job's full blocks are stored when its
   prompt is prefilled and when it ends;
2. runs ONE prefill chunk (at most ``prefill_chunk`` tokens) of one job in
   prefill, round-robin, so a long prompt never stalls the others for more
   than a chunk;
3. runs ONE decode step for every job that is generating (one graph).

Exactness: the engine runs with ``exact_batching`` (every product
row-invariant, per-sequence attention), so a token's K/V and logits depend
only on its own context. A job that names a selectable LoRA adapter
(``Job.adapter``) sets its slot's adapter (``engine.slot_adapter``); a
cached prefix is reused only from a slot whose cache was computed with the
same adapter. Adapters loaded and unloaded while serving
(``toy_serve.adapters``) change the engine between two steps (``call``); an
adapter is unloaded only when no request holds it (``drop_adapter`` ends
what cancelled jobs are left). A request's greedy output is therefore identical
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
failure; ``bad_input``, ``param``, ``hint``: the job's own bad input, a 400).
``done`` or ``error`` is always the last event. A failure of one job's token
step (its sampler or constraint: a constraint that reaches a parser limit in
the middle of its output) ends that job alone, with an error naming its
field; only a failure of the forward pass itself ends every job in flight,
with a message that carries no detail of the exception. A cancelled job
(client gone) frees its slot at the next step and ends with finish_reason
"cancelled".

The token step is the library's: a generate job carries a
``toy.engine.decoding.DecodeState`` (sampler, stop tokens and strings,
UTF-8 decoder, history, logprobs, token limit, one order of operations) and
slots are picked with its ``reuse_prefix``; this module only adds what a
server does around it (batching, the stop token as an event counted in the
usage, prompt logprobs, cancellation). See docs/concepts/architecture.md.

Speculation (``toy.engine.speculative``): a generate job with ``spec`` (its
request's ``speculative`` field, else the server's default) gets a proposer
(prompt lookup, or the draft model on the draft engine's slot of the same
number) and a controller at its first decode step. In a decode step the
speculating jobs propose drafts and every decoding job goes through ONE
``engine.verify`` (its pending token, plus its drafts), or ``engine.decode``
when nobody drafts; each job then runs ``speculative.accept`` over its rows
(the same ``DecodeState.advance``, one token at a time) and its slot is cut
back to the tokens sampled. Budget: when some job in the step does not draft
(plain, cooling down, or prefilling in this step), the drafts may add at most
the rows whose predicted extra time (``costs``: measured seconds of these
forwards by row count, plus a draft model's measured seconds per token) stays
within ``spec_slowdown`` (5 %) of the plain step's; with every job drafting
there is no limit. Outputs are unchanged either way: a row is bit-identical to
a ``decode`` row whatever the batch (``LLMEngine.verify``).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from toy.engine import speculative as spec
from toy.engine.decoding import DecodeState, reuse_prefix
from toy.engine.prefix import BLOCK
from toy.engine.sampling import SamplingParams, log_softmax, top_logprobs
from toy.engine.split import RemoteDeviceError
from toy.errors import BadInputError, ToyError

log = logging.getLogger("toy_serve")


class QueueFullError(ToyError):
    """No place for the request: the queue is full (429 with Retry-After) or, with ``shutting_down``, the
    server is stopping (503)."""

    def __init__(self, message: str, hint: str | None = None, *, shutting_down: bool = False):
        super().__init__(message, hint)
        self.shutting_down = shutting_down


class SlotBusyError(ToyError):
    """A slot operation (save, restore, erase) on a slot that is processing a request (409)."""


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
    speculative: Any = None  # speculative decoding asked for (parse_speculative's input); None: the server's default
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
    spec: Any = field(default=None, repr=False)  # the SpecConfig when speculating (by submit)
    ctrl: Any = field(default=None, repr=False)  # its speculative.Controller (proposer inside), from the first decode

    @property
    def out_history(self) -> list[int]:
        """The prompt and the tokens generated so far (the token step's history: what a proposer looks at)."""
        return self.decoding.history if self.decoding is not None else list(self.ids)

    @property
    def out(self) -> list[int]:
        """The tokens generated so far, a stop token included (the usage counts it)."""
        return self.decoding.tokens if self.decoding is not None else []

    def cancel(self) -> None:
        self.cancelled.set()


class EngineWorker:
    """Continuous batching over ``model`` (a ``toy.Model`` loaded with
    ``n_slot`` slots and ``exact_batching``). ``metrics`` (optional) gets
    observations (see ``toy_serve.metrics.Metrics``). ``prefix_cache`` (optional): a
    ``toy.engine.prefix.PrefixCache`` over this model, which the worker alone uses (its thread)."""

    def __init__(
        self,
        model,
        max_queue: int = 64,
        prefill_chunk: int = 128,
        metrics=None,
        prefix_cache=None,
        draft=None,
        speculative: str = "none",
        draft_max: int | None = None,
    ):
        self.model, self.engine = model, model.engine
        # called (on this thread) when a remote device of a split model fails (Server.remote_failed)
        self.on_remote_failure: Callable[[BaseException], None] | None = None
        self.n_slot = self.engine.n_slot
        self.max_queue, self.prefill_chunk = max_queue, prefill_chunk
        self.metrics = metrics
        self.prefix = prefix_cache
        self._queue: deque[Job] = deque()
        self._slots: list[Job | None] = [None] * self.n_slot
        self._cv = threading.Condition()
        self._stop = False
        self._rr = 0
        self._thread = threading.Thread(target=self._run, name="toy-engine", daemon=True)
        self._calls: deque[tuple[Callable[[], Any], Future]] = deque()
        self.steps = 0
        # speculative decoding (see "Speculation" in the module docstring)
        self.draft = draft  # a toy.Model with this one's vocabulary and slots, drafting for "draft"
        self.draft_max = draft_max
        self.default_spec = spec.parse_speculative(speculative, default_k=draft_max)
        self.costs = spec.StepCosts()  # measured seconds of decode/verify forwards by row count
        #: how much draft rows may slow the requests that do not draft in a step (None: no limit)
        self.spec_slowdown: float | None = 0.05

    # -- control (any thread)

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        """Stop after the current step; jobs still queued or running end with an error event."""
        with self._cv:
            self._stop = True
            self._cv.notify_all()
        self._thread.join(timeout)

    def call(self, fn: Callable[[], Any]) -> Future:
        """Run ``fn()`` on the worker thread between two steps (the engine is the worker's alone: cache slots,
        adapters); returns a ``concurrent.futures.Future`` of its result or exception. Calls run in order, before
        the next step's admission. After ``stop`` a call fails with QueueFullError(shutting_down)."""
        fut: Future = Future()
        with self._cv:
            if self._stop:
                raise QueueFullError("the server is shutting down", shutting_down=True)
            self._calls.append((fn, fut))
            self._cv.notify_all()
        return fut

    def _run_calls(self) -> None:
        while True:
            with self._cv:
                if not self._calls:
                    return
                fn, fut = self._calls.popleft()
            if fut.set_running_or_notify_cancel():
                try:
                    fut.set_result(fn())
                except BaseException as e:  # the caller gets it; the worker goes on
                    fut.set_exception(e)

    def drop_adapter(self, index: int) -> int:
        """On the worker thread (through ``call``), before engine adapter ``index`` is unloaded: end the jobs
        still naming it, as cancelled, and return how many. Only cancelled jobs can be left (the server unloads
        an adapter once no request holds it: ``toy_serve.adapters``); none of them runs another step."""
        with self._cv:
            queued = [j for j in self._queue if j.adapter == index]
            for j in queued:
                self._queue.remove(j)
        for j in queued:
            self._finish_queued(j)
        running = [j for j in self._slots if j is not None and j.adapter == index]
        for j in running:
            self._finish(j, "cancelled")
        return len(queued) + len(running)

    def busy(self) -> int:
        with self._cv:
            return len(self._queue) + sum(j is not None for j in self._slots)

    @property
    def queue_depth(self) -> int:
        return len(self._queue)

    @property
    def active(self) -> int:
        return sum(j is not None for j in self._slots)

    def ensure_room(self, n: int) -> None:
        """QueueFullError when ``n`` more jobs would not fit the queue now (a request checks this before its
        expensive preparation, such as compiling a constraint; ``submit`` checks again)."""
        with self._cv:
            if self._stop:
                raise QueueFullError("the server is shutting down", shutting_down=True)
            free = self._slots.count(None)
            waiting = sum(not j.cancelled.is_set() for j in self._queue)
            if waiting + n - free > self.max_queue:
                raise QueueFullError(f"the queue is full ({self.max_queue} requests waiting)")

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
            job.spec = self._spec_of(job)
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
                while not self._stop and not self._queue and not self._calls and not any(self._slots):
                    self._cv.wait(0.5)
                if self._stop:
                    break
            self._run_calls()
            if not self._queue and not any(self._slots):
                continue
            try:
                self._step()
            except Exception as e:  # an engine failure must not kill the worker: fail the jobs in flight
                log.exception("engine step failed")
                if isinstance(e, RemoteDeviceError):  # a split model's remote host: name it, and say so on /health
                    why = f"{e} ({e.hint})" if e.hint else str(e)
                    if self.on_remote_failure is not None:
                        self.on_remote_failure(e)
                else:
                    why = f"internal error: the engine step failed ({type(e).__name__}; see the server log)"
                for i, j in enumerate(self._slots):
                    if j is not None:
                        self._fail(j, why)
                        self._slots[i] = None
                        self.engine.cache.clear(i)
        with self._cv:
            left = list(self._queue) + [j for j in self._slots if j is not None]
            self._queue.clear()
            self._slots = [None] * self.n_slot
            calls = list(self._calls)
            self._calls.clear()
        for _, fut in calls:
            if fut.set_running_or_notify_cancel():
                fut.set_exception(QueueFullError("the server is shutting down", shutting_down=True))
        for j in left:
            self._fail(j, "the server is shutting down", shutting_down=True)
        if self.prefix is not None:  # its RAM blocks go to its disk folder (if any): a restart finds them
            self.prefix.close()

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
            self._decode(dec, prefilling=bool(pre))
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
                    if isinstance(e, BadInputError):
                        self._fail(job, str(e), param=getattr(e, "field", None), hint=e.hint)
                    else:
                        self._fail(job, f"internal error: this request could not start ({type(e).__name__})")

    def _place(self, job: Job) -> None:
        """Put a queued job into the free slot that shares the longest prefix (``reuse_prefix``, the library's rule)."""
        free = [i for i, j in enumerate(self._slots) if j is None]
        eng = self.engine
        reuse = job.prompt_logprobs is None and job.kind == "generate"
        if reuse:
            best, keep = reuse_prefix(eng.cache, free, job.ids, eng.slot_adapter, job.adapter)
        else:  # scoring and embeddings need every prompt position computed: nothing reused
            best, keep = free[0], 0
        eng.cache.truncate(best, keep)
        eng.slot_adapter[best] = job.adapter
        if reuse and self.prefix is not None:
            keep = self._from_prefix_cache(job, best, keep)
        job.slot, job.pos, job.cached = best, keep, keep
        job.phase = "embed" if job.kind == "embed" else "prefill"
        job.t_start = time.perf_counter()
        self._slots[best] = job
        if self.metrics:
            self.metrics.queue_wait(job.t_start - job.t_submit)

    def _adapter_id(self, adapter: int | None) -> str:
        """The identity prefix-cache blocks computed with engine adapter ``adapter`` are keyed by."""
        ident = getattr(self.model, "adapter_identity", None)
        if ident is not None:
            return str(ident(adapter))
        return "" if adapter is None else f"adapter{adapter}"

    # -- slot files (on the worker thread: ``call(lambda: worker.save_slot(...))``)

    def _idle_slot(self, slot: int) -> None:
        if not 0 <= slot < self.n_slot:
            raise BadInputError(
                f"slot {slot} does not exist (this server has slots 0..{self.n_slot - 1})", field="id_slot"
            )
        if self._slots[slot] is not None:
            raise SlotBusyError(f"slot {slot} is processing a request", hint="try again when it is idle")

    def save_slot(self, slot: int, path, fp) -> tuple[int, int]:
        """Write an idle slot's tokens and K/V to ``path`` (``toy.engine.prefix.save_slot``): (tokens, bytes)."""
        from toy.engine.prefix import save_slot

        self._idle_slot(slot)
        return save_slot(self.engine.cache, slot, path, fp, self._adapter_id(self.engine.slot_adapter[slot]))

    def restore_slot(self, slot: int, path, fp) -> tuple[int, int]:
        """Read a slot file into an idle slot (its adapter must be loaded): (tokens, bytes). A later request
        whose prompt starts with those tokens reuses them like any slot's cached prefix."""
        from toy.engine.prefix import SlotFileError, load_slot

        self._idle_slot(slot)
        cache = self.engine.cache
        ids, ident, size = load_slot(cache, slot, path, fp)
        for index in [None, *range(len(self.engine.adapters))]:
            try:
                if self._adapter_id(index) == ident:
                    self.engine.slot_adapter[slot] = index
                    return len(ids), size
            except BadInputError:  # an unloaded adapter's place
                continue
        cache.clear(slot)
        raise SlotFileError(f"{path.name} was saved with an adapter that is not loaded here", field="filename")

    def erase_slot(self, slot: int) -> int:
        """Clear an idle slot's cache; returns how many tokens it held."""
        self._idle_slot(slot)
        n = self.engine.cache.length(slot)
        self.engine.cache.clear(slot)
        return n

    def _from_prefix_cache(self, job: Job, slot: int, keep: int) -> int:
        """Extend the slot's kept prefix with the prefix cache's longest match (at least the last prompt token
        is left to compute); returns the tokens now kept. A cache failure (a disk error) only costs the reuse."""
        assert self.prefix is not None
        if keep >= (len(job.ids) - 1) // BLOCK * BLOCK:  # whole blocks cannot reach further than the slot does
            return keep
        try:
            ident = self._adapter_id(job.adapter)
            n = min(self.prefix.lookup(job.ids, ident), len(job.ids) - 1)
            self.prefix.restore(self.engine.cache, slot, job.ids, ident, keep, n - keep)  # n <= keep: nothing
            return max(n, keep)
        except Exception:  # noqa: BLE001 - the request goes on without the cached blocks
            log.warning("prefix cache: lookup for %s failed", job.id, exc_info=True)
            self.engine.cache.truncate(slot, keep)
        return keep

    def _to_prefix_cache(self, j: Job) -> None:
        """Store the full blocks of ``j``'s slot (its prompt, then what it generated) in the prefix cache."""
        if self.prefix is None or j.kind != "generate" or not 0 <= j.slot < self.n_slot:
            return
        try:
            self.prefix.insert(self.engine.cache, j.slot, self._adapter_id(self.engine.slot_adapter[j.slot]))
        except Exception:  # noqa: BLE001 - caching is an optimization: the request is not affected
            log.warning("prefix cache: storing the blocks of %s failed", j.id, exc_info=True)

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
            self._to_prefix_cache(j)
            j.phase = "decode"
            self._token_steps(j, logits)

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

    def _token_steps(self, j: Job, logits: np.ndarray, draft: Sequence[int] = (), base: int = 0) -> None:
        """``_after_forward``, where a failure is this job's alone (its sampler or constraint: bad input, such as
        a constraint that reaches a parser limit mid-output): the job ends with an error naming its field, its
        slot is freed, and the other jobs of the step go on."""
        try:
            self._after_forward(j, logits, draft, base)
        except Exception as e:  # noqa: BLE001 - one sequence's failure
            if j.phase == "done":  # it had ended (its last event sent): only the log hears of it
                log.exception("%s failed after it ended", j.id)
            elif isinstance(e, BadInputError):
                log.info("%s failed: %s", j.id, e)
                self._fail(j, str(e), param=getattr(e, "field", None), hint=e.hint)
            else:
                log.exception("%s failed", j.id)
                self._fail(j, "internal error: this request's token step failed")
            if 0 <= j.slot < self.n_slot and self._slots[j.slot] is j:
                self._slots[j.slot] = None
                self.engine.cache.clear(j.slot)

    def _after_forward(self, j: Job, logits: np.ndarray, draft: Sequence[int] = (), base: int = 0) -> None:
        """The token steps over ``logits``: one row (``DecodeState.advance``), or a verify's rows for ``draft``
        (``speculative.accept``; the slot, ``base`` tokens before the verify, keeps the fed token and the accepted
        drafts). Report each token, then go on or finish."""
        assert j.decoding is not None  # submit() gives a "generate" job its DecodeState
        steps = spec.accept(j.decoding, logits.reshape(-1, logits.shape[-1]), draft)
        if draft:
            self.engine.cache.truncate(j.slot, base + len(steps))
            if self.metrics:
                self.metrics.speculated(j.ctrl.proposer.kind, len(draft), min(len(steps), len(draft) + 1) - 1)
        if j.ctrl is not None:
            j.ctrl.record(len(draft), len(steps))
        for step in steps:
            if step.token is None:  # max_tokens=0: nothing sampled
                assert step.finish_reason is not None  # a step without a token ends generation
                self._finish(j, step.finish_reason)
                return
            now = time.perf_counter()
            if not j.t_first:
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
                return
        j.pending = steps[-1].token

    # -- speculation

    def _spec_of(self, job: Job):
        """The job's SpecConfig (its field, else the server's default), checked; None for plain decoding."""
        cfg = (
            self.default_spec
            if job.speculative is None
            else spec.parse_speculative(job.speculative, default_k=self.draft_max)
        )
        if not cfg.on:
            return None
        spec.check_engine(self.engine)
        if cfg.type == "draft" and self.draft is None:
            raise BadInputError(
                "speculative type 'draft' needs a draft model, and this server has none",
                hint="start toy serve with --draft-model PATH, or ask for ngram",
                field="speculative",
            )
        return cfg

    def _decode(self, dec: list[Job], prefilling: bool) -> None:
        """One decode step for ``dec``: the speculating jobs' drafts (within the budget) and everyone's pending
        token in one forward (``verify``; ``decode`` when nobody drafts), then each job's token steps."""
        eng = self.engine
        want = []
        for j in dec:
            k = 0
            if j.spec is not None:
                if j.ctrl is None:
                    j.ctrl = spec.Controller(j.spec.k, self.costs, spec.make_proposer(j.spec, self.draft, j.slot))
                left = j.params.max_tokens - len(j.out) - 1
                k = max(0, min(j.ctrl.want(), left, eng.n_ctx - eng.cache.length(j.slot) - 1))
            want.append(k)
        budget = sum(want)
        if budget and self.spec_slowdown is not None and (prefilling or 0 in want):
            budget = self._extra_rows(len(dec), dec, want)
        drafts: list[list[int]] = []
        for j, k in zip(dec, want):
            d = j.ctrl.proposer.propose(j.out_history, min(k, budget)) if k and budget > 0 else []
            budget -= len(d)
            drafts.append(d)
        bases = [eng.cache.length(j.slot) for j in dec]
        t0 = time.perf_counter()
        if any(drafts):
            out = eng.verify([j.slot for j in dec], [[j.pending, *d] for j, d in zip(dec, drafts)])
        else:
            out = list(eng.decode([j.slot for j in dec], [j.pending for j in dec])[:, None])
        self.costs.record(len(dec) + sum(len(d) for d in drafts), time.perf_counter() - t0)
        for j, d, rows, base in zip(dec, drafts, out, bases):
            self._token_steps(j, rows, d, base)

    def _extra_rows(self, n: int, dec: list[Job], want: list[int]) -> int:
        """Draft rows a step of ``n`` jobs may add while some of them do not draft: the most whose predicted
        extra time (the verify's rows by ``costs``, and a draft model's own steps) stays within
        ``spec_slowdown`` of the plain step's."""
        limit = self.spec_slowdown or 0.0
        drafting = [j for j, k in zip(dec, want) if k]
        per_token = max((j.ctrl.proposer.seconds for j in drafting if j.ctrl.proposer.kind == "draft"), default=0.0)
        plain = self.costs.predict(n)
        rows = 0
        while rows < sum(want):
            extra = self.costs.ratio(n + rows + 1, n) - 1
            if plain is not None:
                extra += (rows + 1) * per_token / plain
            elif per_token:
                break
            if extra > limit:
                break
            rows += 1
        return rows

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
        if j.ctrl is not None:  # speculative decoding: draft tokens verified, and accepted
            timings.update(draft_tokens=j.ctrl.drafted, draft_accepted=j.ctrl.accepted)
        self._emit(j, {"type": "done", "finish_reason": reason, "usage": self._usage(j), "timings": timings})
        if 0 <= j.slot < self.n_slot and self._slots[j.slot] is j:
            if j.phase == "decode":  # prompt + generated tokens: the next chat turn often starts with them
                self._to_prefix_cache(j)
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

    def _fail(
        self, j: Job, message: str, shutting_down: bool = False, param: str | None = None, hint: str | None = None
    ) -> None:
        event: dict[str, Any] = {"type": "error", "message": message, "shutting_down": shutting_down}
        if param is not None or hint is not None:  # bad input of this job's own (a 400 for its request)
            event.update(bad_input=True, param=param, hint=hint)
        self._emit(j, event)
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


__all__ = ["EngineWorker", "Job", "QueueFullError", "SlotBusyError"]
