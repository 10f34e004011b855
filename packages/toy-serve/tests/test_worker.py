"""The engine worker (continuous batching) on the real SmolLM2 file.

Independent references: a request's greedy tokens alone (one request at a
time through the same worker) are the reference for the same request in a
busy batch; prompt logprobs are checked against ``log_softmax`` of
``Model.logits`` (a separate prefill path) and the embedding against the
mean of the hidden states from one plain prefill.
"""

from __future__ import annotations

import queue
import threading

import numpy as np
import pytest

import toy
from toy.engine.llm import ContextOverflowError
from toy.engine.sampling import SamplingParams, log_softmax
from toy_serve.worker import EngineWorker, Job, QueueFullError

pytestmark = pytest.mark.model

PROMPTS = [
    "The capital of France is",
    "1, 2, 3,",
    "Once upon a time",
    "def fibonacci(n):",
    "The three primary colors are",
]


@pytest.fixture(scope="module")
def model(smollm2_path):
    m = toy.load(smollm2_path, n_ctx=256, n_slot=4, threads=2, exact_batching=True)
    yield m
    m.close()


@pytest.fixture
def worker(model):
    model.engine.cache.clear()
    w = EngineWorker(model, max_queue=16, prefill_chunk=5)  # small chunks: prompts span several
    w.start()
    yield w
    w.stop()


def job(model, name, text, **kw):
    q: queue.Queue = queue.Queue()
    params = SamplingParams.greedy(max_tokens=kw.pop("max_tokens", 12), **kw)
    return Job(name, model.tokenize(text), params, q.put), q


def drain(q, timeout=120):
    toks, text, events = [], [], []
    while True:
        ev = q.get(timeout=timeout)
        events.append(ev)
        if ev["type"] == "token":
            if ev["token"] is not None:
                toks.append(ev["token"])
            text.append(ev["text"])
        if ev["type"] in ("done", "error"):
            return toks, "".join(text), events


def test_batched_output_equals_alone(model, worker):
    alone = []
    for i, p in enumerate(PROMPTS):
        j, q = job(model, f"a{i}", p)
        worker.submit(j)
        alone.append(drain(q)[0])
    model.engine.cache.clear()  # no prefix reuse for the batched round
    pairs = [job(model, f"b{i}", p) for i, p in enumerate(PROMPTS)]  # 5 requests, 4 slots: one waits
    for j, _ in pairs:
        worker.submit(j)
    together = [drain(q) for _, q in pairs]
    for i, (toks, text, events) in enumerate(together):
        assert toks == alone[i], PROMPTS[i]
        done = events[-1]
        assert done["type"] == "done" and done["finish_reason"] == "length"
        assert done["usage"]["completion_tokens"] == 12
        assert text == model.detokenize(toks)


def test_prefix_reuse_changes_nothing(model, worker):
    j, q = job(model, "first", "You are a helpful assistant. " + PROMPTS[0])
    worker.submit(j)
    first = drain(q)
    j, q = job(model, "again", "You are a helpful assistant. " + PROMPTS[0])
    worker.submit(j)
    again = drain(q)
    assert again[2][-1]["usage"]["cached_tokens"] > 5  # the shared prefix came from the cache
    assert again[0] == first[0]


def test_stop_string_and_eos(model, worker):
    j, q = job(model, "stop", "1, 2, 3,", stop=[" 6"], max_tokens=20)
    worker.submit(j)
    toks, text, events = drain(q)
    assert events[-1]["finish_reason"] == "stop"
    assert text == " 4, 5,"


def test_prompt_logprobs_match_model_logits(model, worker):
    text = "The quick brown fox jumps over the lazy dog."
    j, q = job(model, "score", text, max_tokens=0)
    j.prompt_logprobs = 3
    worker.submit(j)
    _, _, events = drain(q)
    items = next(e for e in events if e["type"] == "prompt_logprobs")["items"]
    assert events[-1]["finish_reason"] == "length" and events[-1]["usage"]["completion_tokens"] == 0
    ids = j.ids
    assert items[0] is None and len(items) == len(ids)
    lp = np.array([log_softmax(row) for row in model.logits(ids)])
    for i in range(1, len(ids)):
        assert items[i]["token"] == ids[i]
        assert items[i]["logprob"] == pytest.approx(lp[i - 1, ids[i]], abs=1e-4)
        assert len(items[i]["top"]) == 3 and items[i]["top"][0][1] >= items[i]["top"][-1][1]


def test_embedding_is_mean_hidden_state(model, worker):
    ids = model.tokenize("embed this sentence")
    q: queue.Queue = queue.Queue()
    j = Job("emb", ids, SamplingParams.greedy(max_tokens=0), q.put, kind="embed")
    worker.submit(j)
    _, _, events = drain(q)
    vec = next(e for e in events if e["type"] == "embedding")["vector"]
    eng = model.engine
    eng.cache.clear(3)
    want = eng.prefill(3, ids, all_logits=True, hidden=True).astype(np.float64).mean(axis=0)
    eng.cache.clear(3)
    assert vec.shape == (model.cfg.d_model,)
    np.testing.assert_allclose(vec, want, rtol=1e-6, atol=1e-6)
    # the same text again: its tokens are cached now, and must all still be in the mean
    q2: queue.Queue = queue.Queue()
    worker.submit(Job("emb2", ids, SamplingParams.greedy(max_tokens=0), q2.put, kind="embed"))
    _, _, events2 = drain(q2)
    np.testing.assert_array_equal(next(e for e in events2 if e["type"] == "embedding")["vector"], vec)


def test_budget_queue_and_cancel(model):
    model.engine.cache.clear()
    w = EngineWorker(model, max_queue=1, prefill_chunk=64)
    with pytest.raises(ContextOverflowError, match="more than the context of 256"):
        w.submit(job(model, "big", "hi", max_tokens=300)[0])
    with pytest.raises(Exception, match="empty"):
        w.submit(Job("empty", [], SamplingParams.greedy(), lambda e: None))
    # not started: the queue fills
    w.submit(job(model, "q1", "hi")[0])
    with pytest.raises(QueueFullError):
        w.submit(job(model, "q2", "hi")[0])
    w.start()
    try:
        j, q = job(model, "cancel-me", PROMPTS[2], max_tokens=200)
        got = threading.Event()

        def emit(ev, _put=q.put):
            _put(ev)
            if ev["type"] == "token":
                got.set()

        j.emit = emit
        w._queue.clear()
        w.submit(j)
        assert got.wait(60)
        j.cancel()
        _, _, events = drain(q)
        assert events[-1]["finish_reason"] == "cancelled"
        assert events[-1]["usage"]["completion_tokens"] < 200
        # the worker keeps serving
        j2, q2 = job(model, "next", PROMPTS[0], max_tokens=3)
        w.submit(j2)
        assert drain(q2)[2][-1]["finish_reason"] == "length"
    finally:
        w.stop()


def test_call_runs_between_steps_on_the_worker_thread(model):
    """``EngineWorker.call``: ``fn`` runs on the engine thread while no step is in flight (the worker counts a
    step only once it is whole, so two reads of the counter inside ``fn`` agree, and a job decoding meanwhile
    keeps its tokens); its exception reaches the caller; after ``stop`` a call is refused as shutting down."""
    model.engine.cache.clear()
    w = EngineWorker(model, max_queue=4, prefill_chunk=5)
    w.start()
    try:
        j, q = job(model, "busy", PROMPTS[2], max_tokens=10)
        w.submit(j)
        seen = []

        def probe():
            before = w.steps
            seen.append((threading.current_thread().name, before, j.phase))
            return w.steps - before

        futs = [w.call(probe) for _ in range(3)]
        assert [f.result(60) for f in futs] == [0, 0, 0]
        assert all(name == "toy-engine" for name, _, _ in seen)
        assert [s for _, s, _ in seen] == sorted(s for _, s, _ in seen)  # in order
        bad = w.call(lambda: 1 / 0)
        with pytest.raises(ZeroDivisionError):
            bad.result(60)
        toks, _, events = drain(q)  # the worker went on: the job runs to its end
        assert events[-1]["finish_reason"] == "length" and len(toks) == 10
        assert w.call(lambda: "still here").result(60) == "still here"
    finally:
        w.stop()
    with pytest.raises(QueueFullError) as e:
        w.call(lambda: None)
    assert e.value.shutting_down
