"""Speculative decoding in toy serve (``speculative`` request field, ``--speculative``, ``--draft-model``).

References: the library's plain generation on another copy of the model (``ref_model``: slot 0, no worker, no
speculation), compared token for token; for sampling, the same request without speculation, seed by seed (the
acceptance rule feeds the request's own seeded sampler the very rows plain decoding gives, so every seed's
output is identical: see toy.engine.speculative). The worker tests drive ``EngineWorker`` directly on
``serve_model`` (no HTTP); one live server checks the request field, the response's counters and /metrics.
"""

from __future__ import annotations

import queue

import pytest

import toy
from toy.engine import speculative as spec
from toy.engine.sampling import SamplingParams
from toy.errors import BadInputError
from toy_serve.worker import EngineWorker, Job

pytestmark = pytest.mark.model

COPY = (
    "def area(width, height):\n    return width * height\n\n"
    "def perimeter(width, height):\n    return 2 * (width + height)\n"
)
PROMPTS = [
    f"File a.py:\n{COPY}\nFile b.py, a copy of a.py:\n",
    "one two three four five one two three four five one two",
    "The capital of France is",
    "Once upon a time",
]


@pytest.fixture(scope="module")
def draft(smollm2_path, serve_model):
    with toy.load(smollm2_path, n_ctx=serve_model.n_ctx, n_slot=serve_model.engine.n_slot, threads=2) as d:
        yield d


def _job(model, name, prompt, params, **kw):
    q: queue.Queue = queue.Queue()
    return Job(name, model.tokenize(prompt), params, q.put, **kw), q


def _drain(q, timeout=120):
    toks, done = [], None
    while done is None:
        ev = q.get(timeout=timeout)
        if ev["type"] == "token" and ev["token"] is not None:
            toks.append(ev["token"])
        if ev["type"] == "error":
            raise AssertionError(ev)
        if ev["type"] == "done":
            done = ev
    return toks, done


def _run(worker, model, requests):
    """Submit every (prompt, params, speculative) at once; their tokens and done events, in order."""
    jobs = [_job(model, f"r{i}", p, params, speculative=sp) for i, (p, params, sp) in enumerate(requests)]
    for j, _ in jobs:
        worker.submit(j)
    return [_drain(q) for _, q in jobs]


@pytest.fixture
def worker(serve_model, draft):
    serve_model.engine.cache.clear()
    w = EngineWorker(serve_model, max_queue=16, prefill_chunk=64, draft=draft)
    w.start()
    yield w
    w.stop()


def _plain(ref_model, prompt, params):
    return ref_model.generate(ref_model.tokenize(prompt), params).tokens


def test_greedy_mixed_batch_equals_library(worker, serve_model, ref_model):
    """Speculating and plain requests decode through one verify (no budget: every step mixes draft rows with
    the others' single rows); each request's tokens equal the library's plain greedy output."""
    worker.spec_slowdown = None
    params = SamplingParams.greedy(max_tokens=24, ignore_eos=True)
    kinds = [{"type": "ngram", "k": 6}, None, {"type": "draft", "k": 3}, {"type": "ngram", "n": 2}]
    out = _run(worker, serve_model, [(p, params, sp) for p, sp in zip(PROMPTS, kinds)])
    for p, (toks, done) in zip(PROMPTS, out):
        assert toks == _plain(ref_model, p, params)
        assert done["finish_reason"] == "length"
    t = [done["timings"] for _, done in out]
    assert "draft_tokens" not in t[1]
    assert all(t[i]["draft_tokens"] > 0 for i in (0, 2, 3))
    assert 0 < t[0]["draft_accepted"] <= t[0]["draft_tokens"]


def test_seeded_sampling_equals_plain_per_seed(worker, serve_model):
    worker.spec_slowdown = None
    for seed in range(3):
        params = SamplingParams(temperature=0.9, top_k=50, seed=seed, max_tokens=24, ignore_eos=True)
        reqs = [(PROMPTS[1], params, None), (PROMPTS[1], params, {"type": "ngram", "k": 5})]
        (plain, _), (specd, done) = _run(worker, serve_model, reqs)
        assert specd == plain
        assert done["timings"]["draft_tokens"] > 0


def test_default_budget_keeps_others_at_plain_cost(worker, serve_model, ref_model):
    """With the 5 % budget a request decoding beside a plain one gets no draft rows on this model (a verify row
    costs far more than 5 % of a 2-row step); alone it speculates. Outputs equal the library's either way."""
    params = SamplingParams.greedy(max_tokens=16, ignore_eos=True)
    both = _run(worker, serve_model, [(PROMPTS[1], params, "ngram"), (PROMPTS[2], params, None)])
    assert [t for t, _ in both] == [_plain(ref_model, p, params) for p in PROMPTS[1:3]]
    alone = _run(worker, serve_model, [(PROMPTS[1], params, "ngram")])
    assert alone[0][0] == both[0][0] and alone[0][1]["timings"]["draft_tokens"] > 0


def test_extra_rows_rule():
    w = EngineWorker.__new__(EngineWorker)
    w.spec_slowdown, w.costs = 0.05, spec.StepCosts()
    ngram = spec.Controller(8, w.costs, spec.NgramProposer())
    jobs = [type("J", (), {"ctrl": ngram})() for _ in range(4)]
    for n in range(1, 9):  # 0.1 s per step plus 1 ms per row: each extra row is ~1 % of a 4-row step
        w.costs.record(n, 0.1 + 0.001 * n)
    assert w._extra_rows(4, jobs, [8, 0, 0, 0]) == 5  # 5 rows: +4.8 %; 6 rows: +5.8 %
    w.costs = spec.StepCosts()
    for n in range(1, 9):  # the measured CPU shape: a row costs ~45 % of a one-row step
        w.costs.record(n, 0.02 * (1 + 0.45 * (n - 1)))
    assert w._extra_rows(2, jobs[:2], [8, 0]) == 0


def test_draft_without_draft_model_is_refused(serve_model):
    w = EngineWorker(serve_model)
    j, _ = _job(serve_model, "x", "Hi", SamplingParams.greedy(max_tokens=2), speculative={"type": "draft"})
    with pytest.raises(BadInputError, match="draft model") as e:
        w.submit(j)
    assert e.value.field == "speculative"


@pytest.fixture(scope="module")
def live(serve_model, serve_settings, serving):
    with serving(serve_settings(speculative="ngram", draft_max=6), serve_model) as srv:
        yield srv


def test_http_request_field_default_and_metrics(live, ref_model):
    client = live.client()
    params = SamplingParams.greedy(max_tokens=20, ignore_eos=True)
    want = ref_model.generate(PROMPTS[0], params).text
    r = live.http.post(
        "/v1/completions", json={"prompt": PROMPTS[0], "max_tokens": 20, "temperature": 0, "ignore_eos": True}
    )
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["choices"][0]["text"] == want
    t = body["timings"]  # the server default (ngram) speculated
    details = body["usage"]["completion_tokens_details"]
    assert t["draft_n"] > 0 and details["accepted_prediction_tokens"] == t["draft_n_accepted"]
    assert details["rejected_prediction_tokens"] == t["draft_n"] - t["draft_n_accepted"]
    assert live.metric("toy_speculative_draft_tokens_total", {"proposer": "ngram"}) >= t["draft_n"]
    assert live.metric("toy_speculative_accepted_tokens_total", {"proposer": "ngram"}) >= t["draft_n_accepted"]
    off = client.completions.create(
        model=body["model"],
        prompt=PROMPTS[0],
        max_tokens=20,
        temperature=0,
        extra_body={"ignore_eos": True, "speculative": {"type": "none"}},
    )
    assert off.choices[0].text == body["choices"][0]["text"]
    assert "timings" not in off.model_dump()
    chat = live.http.post(
        "/v1/chat/completions",
        json={
            "messages": [{"role": "user", "content": "Repeat: red green blue red green blue"}],
            "max_tokens": 12,
            "temperature": 0,
            "speculative": {"type": "ngram", "n": 2, "k": 4},
        },
    )
    assert chat.status_code == 200, chat.text
    messages = [{"role": "user", "content": "Repeat: red green blue red green blue"}]
    ref = ref_model.generate(messages, max_tokens=12, temperature=0)
    assert chat.json()["choices"][0]["message"]["content"] == ref.text


@pytest.mark.parametrize(
    "field, match",
    [({"type": "draft"}, "draft model"), ({"type": "ngram", "k": 0}, "k"), ({"type": "eagle"}, "type")],
)
def test_http_bad_speculative_is_400(live, field, match):
    r = live.http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2, "speculative": field})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert match in err["message"] and "speculative" in (err.get("param") or "")
