"""One token step, two drivers: ``toy.Model`` (the library's loop) and the server's ``EngineWorker`` fed the same
logits produce the same events.

The fake is the engine interface both drivers call (``prefill``, ``decode``, the cache's ``common_prefix`` /
``truncate``, ``slot_adapter``): its logits are a seeded NumPy function of the sequence so far, plus a bonus on a
scripted token at each generated position, so the same context gives the same row in any slot, batch or prefill
chunking. Under it sit a tiny SentencePiece vocabulary (pieces that split a stop string, the bytes of a
three-byte character, EOS) and the real ``Model`` and ``EngineWorker``.

Compared, event by event: the texts shown (the worker's "" events are steps whose text is held back, which the
library does not yield), token ids, logprobs, finish reasons, prompt/cached token counts. The documented
difference is asserted explicitly: the server reports a stop token as an event with empty text and its logprob,
and counts it in the usage (OpenAI-style); the library leaves it out of ``tokens`` and records it as ``stop``.
"""

from __future__ import annotations

import queue
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from toy.engine.generate import Model
from toy.engine.sampling import SamplingParams
from toy_serve.worker import EngineWorker, Job
from toy_testsupport.tiny_vocab import EOS, ID, N_VOCAB, tokenizer

PROMPT_LEN = 3  # every prompt here is BOS and two tokens (``prompt_of``)
SEED = 1234


class FakeCache:
    def __init__(self, n_slot: int):
        self.held: list[list[int]] = [[] for _ in range(n_slot)]

    def common_prefix(self, slot: int, ids) -> int:
        n = 0
        for a, b in zip(self.held[slot], ids):
            if a != b:
                break
            n += 1
        return n

    def truncate(self, slot: int, n: int) -> None:
        del self.held[slot][n:]

    def clear(self, slot: int | None = None) -> None:
        for s in range(len(self.held)) if slot is None else [slot]:
            self.held[s].clear()

    def length(self, slot: int) -> int:
        return len(self.held[slot])


class FakeEngine:
    """Logits of a context: seeded noise (from its length and last two tokens) plus a bonus on the scripted token
    of that generated position. ``plans`` maps a prompt (its first ``PROMPT_LEN`` tokens) to (script, bonus):
    position i after the prompt favours ``script[i]``."""

    def __init__(self, plans: dict[tuple[int, ...], tuple[list[int], float]], n_slot: int = 1, n_ctx: int = 64):
        self.plans = plans
        self.n_slot, self.n_ctx = n_slot, n_ctx
        self.cache = FakeCache(n_slot)
        self.adapters: list = []
        self.slot_adapter: list[int | None] = [None] * n_slot

    def row(self, context: list[int]) -> np.ndarray:
        rng = np.random.default_rng([SEED, len(context), *context[-2:]])
        x = rng.standard_normal(N_VOCAB).astype(np.float32)
        script, bonus = self.plans.get(tuple(context[:PROMPT_LEN]), ([], 0.0))
        i = len(context) - PROMPT_LEN
        if 0 <= i < len(script):
            x[script[i]] += bonus
        return x

    def prefill(self, slot: int, ids, all_logits: bool = False, hidden: bool = False) -> np.ndarray:
        assert not hidden
        held = self.cache.held[slot]
        rows = []
        for t in ids:
            held.append(int(t))
            rows.append(self.row(held))
        return np.stack(rows) if all_logits else rows[-1]

    def decode(self, slots, tokens) -> np.ndarray:
        rows = []
        for s, t in zip(slots, tokens):
            self.cache.held[s].append(int(t))
            rows.append(self.row(self.cache.held[s]))
        return np.stack(rows)


def fake_model(plans: dict, n_slot: int = 1) -> Model:
    cfg = SimpleNamespace(n_vocab=N_VOCAB, architecture="fake")
    return Model(Path("fake.gguf"), cfg, None, None, None, FakeEngine(plans, n_slot), tokenizer(), None)


def ids(*pieces: str) -> list[int]:
    return [ID[p] for p in pieces]


def greedy(**kw) -> SamplingParams:
    return SamplingParams.greedy(**kw)


def sampled(seed: int, **kw) -> SamplingParams:
    return SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=seed, **kw)


# (name, script, params, expected (text, finish_reason, stop) where the script makes it certain, or None)
CASES = [
    (
        "stop string across tokens",
        ids(" Hello", " wor", "ld", "ST", "OP", "!"),
        greedy(max_tokens=10, stop=["STOP"]),
        ("Hello world", "stop", "STOP"),
    ),
    (
        "held back, then released",
        ids(" Hello", "ST", "ld", "!", "</s>"),
        greedy(max_tokens=10, stop=["STOP"], logprobs=2),
        ("HelloSTld!", "stop", EOS),
    ),
    ("stop token", ids(" Hello", " wor", "ld", "</s>", "!"), greedy(max_tokens=10), ("Hello world", "stop", EOS)),
    (
        "stop token with logprobs",
        ids(" Hello", "!", "</s>"),
        greedy(max_tokens=10, logprobs=3),
        ("Hello!", "stop", EOS),
    ),
    (
        "extra stop token",
        ids(" Hello", "!", "."),
        greedy(max_tokens=10, stop_tokens=[ID["!"]]),
        ("Hello", "stop", ID["!"]),
    ),
    ("length", ids(" Hello", " wor", "ld", "!"), greedy(max_tokens=3, logprobs=1), ("Hello world", "length", None)),
    # the limit is reached on a stop token: the stop token is checked first
    ("stop token at the limit", ids(" Hello", " wor", "</s>"), greedy(max_tokens=3), ("Hello wor", "stop", EOS)),
    ("stop string at the limit", ids("ld", "ST", "OP"), greedy(max_tokens=3, stop=["STOP"]), ("ld", "stop", "STOP")),
    # a character held back by the decoder at the limit comes out (U+FFFD) when the state is finished
    ("held-back bytes at the limit", ids("!", "<0xE2>", "<0x82>"), greedy(max_tokens=3), ("!\ufffd", "length", None)),
    ("a whole character", ids("<0xE2>", "<0x82>", "<0xAC>", "</s>"), greedy(max_tokens=9), ("\u20ac", "stop", EOS)),
    # the released tail completes a stop string: "length" becomes "stop"
    (
        "stop string in the tail",
        ids("!", "a", "<0xE2>"),
        greedy(max_tokens=3, stop=["a\ufffd"]),
        ("!", "stop", "a\ufffd"),
    ),
    ("max_tokens=0", ids("!"), greedy(max_tokens=0), ("", "length", None)),
    ("ignore_eos", ids(" Hello", "</s>", "!"), greedy(max_tokens=3, ignore_eos=True), ("Hello</s>!", "length", None)),
    *[
        (
            f"sampled, seed {s}",
            ids(" Hello", " wor", "ld", "ST", "OP", "!"),
            sampled(s, max_tokens=12, stop=["STOP"]),
            None,
        )
        for s in range(4)
    ],
    *[
        (f"sampled with logprobs, seed {s}", ids(" Hello", "!", "</s>"), sampled(s, max_tokens=8, logprobs=2), None)
        for s in range(4)
    ],
]
GREEDY_BONUS, SAMPLED_BONUS = 8.0, 2.0  # sampled cases: the script only tilts the draw, the path wanders off it


def prompt_of(i: int) -> list[int]:
    """Case i's own prompt (BOS and two ordinary tokens), so that one engine can hold every case's plan."""
    return [1, 3 + i % 12, 3 + i // 12]


PLANS = {
    tuple(prompt_of(i)): (script, SAMPLED_BONUS if name.startswith("sampled") else GREEDY_BONUS)
    for i, (name, script, _, _) in enumerate(CASES)
}


def library(model: Model, params: SamplingParams, prompt, cache_prompt: bool = False):
    stream = model.stream(list(prompt), params, cache_prompt=cache_prompt)
    chunks = list(stream)
    return chunks, stream.result


def drain(q: queue.Queue) -> list[dict]:
    events = []
    while True:
        ev = q.get(timeout=30)
        events.append(ev)
        if ev["type"] in ("done", "error"):
            return events


@pytest.fixture
def start_worker():
    workers = []

    def start(model: Model, prefill_chunk: int = 2) -> EngineWorker:
        w = EngineWorker(model, max_queue=64, prefill_chunk=prefill_chunk)
        w.start()
        workers.append(w)
        return w

    yield start
    for w in workers:
        w.stop()


def serve(worker: EngineWorker, params: SamplingParams, prompt, name: str = "job") -> queue.Queue:
    q: queue.Queue = queue.Queue()
    worker.submit(Job(name, list(prompt), params, q.put))
    return q


def assert_same(chunks: list[str], gen, events: list[dict]) -> None:
    """The worker's events against the library's chunks and Generation, field by field."""
    done = events[-1]
    assert done["type"] == "done", events
    tokens = [e for e in events if e["type"] == "token"]
    assert [e["text"] for e in tokens if e["text"]] == chunks
    assert "".join(chunks) == gen.text
    sampled_ = [e for e in tokens if e["token"] is not None]
    assert tokens[: len(sampled_)] == sampled_  # the released tail (token None) comes last, if any
    stops = [e for e in sampled_ if e.get("stop")]
    generated = [e for e in sampled_ if not e.get("stop")]
    assert [e["token"] for e in generated] == gen.tokens
    assert done["finish_reason"] == gen.finish_reason
    if gen.logprobs is None:
        assert all(e["logprob"] is None for e in sampled_)
    else:
        assert [e["logprob"] for e in generated] == gen.logprobs  # TokenLogprob: bit-for-bit floats
    assert done["usage"]["prompt_tokens"] == gen.prompt_tokens
    # the documented difference: the stop token is an event (empty text, its logprob) counted in the usage
    if isinstance(gen.stop, int):
        assert len(stops) == 1 and sampled_[-1] is stops[0]
        assert stops[0]["token"] == gen.stop and stops[0]["text"] == ""
        assert done["usage"]["completion_tokens"] == len(gen.tokens) + 1
        if gen.logprobs is not None:
            assert stops[0]["logprob"].token == gen.stop
    else:
        assert stops == []
        assert done["usage"]["completion_tokens"] == len(gen.tokens)


@pytest.mark.parametrize("i", range(len(CASES)), ids=[c[0] for c in CASES])
def test_both_drivers_emit_the_same_steps(start_worker, i):
    name, _, params, expected = CASES[i]
    chunks, gen = library(fake_model(PLANS), params, prompt_of(i))
    events = drain(serve(start_worker(fake_model(PLANS, n_slot=2)), params, prompt_of(i)))
    assert_same(chunks, gen, events)
    if expected is not None:
        assert (gen.text, gen.finish_reason, gen.stop) == expected


def test_the_sampled_cases_leave_the_script():
    """The sampled cases exercise the seeded draw: some of their tokens are not the scripted (greedy) ones."""
    model, off = fake_model(PLANS), 0
    for i, (name, script, params, _) in enumerate(CASES):
        if name.startswith("sampled"):
            _, gen = library(model, params, prompt_of(i))
            off += sum(t != s for t, s in zip(gen.tokens, script))
    assert off > 0


def test_a_busy_chunked_batch_gives_each_job_the_library_steps(start_worker):
    """Every case twice, all submitted at once to a 3-slot worker that prefills one token per step: batching,
    slot choice, prefix reuse between the twins and chunking change no event."""
    w = start_worker(fake_model(PLANS, n_slot=3), prefill_chunk=1)
    queues = [(i, [serve(w, CASES[i][2], prompt_of(i), name=f"{i}-{k}") for k in range(2)]) for i in range(len(CASES))]
    model = fake_model(PLANS)
    for i, qs in queues:
        chunks, gen = library(model, CASES[i][2], prompt_of(i))
        for q in qs:
            assert_same(chunks, gen, drain(q))


def test_prefix_reuse_agrees(start_worker):
    """A second request that extends the first one's prompt and output: both drivers keep the same prefix."""
    i = next(i for i, c in enumerate(CASES) if c[0] == "length")
    params = greedy(max_tokens=3)
    model = fake_model(PLANS)
    _, first = library(model, params, prompt_of(i), cache_prompt=True)
    second_prompt = prompt_of(i) + first.tokens[:2] + ids("b")
    _, second = library(model, params, second_prompt, cache_prompt=True)

    w = start_worker(fake_model(PLANS, n_slot=2))
    done1 = drain(serve(w, params, prompt_of(i)))[-1]
    events2 = drain(serve(w, params, second_prompt))
    assert done1["usage"]["cached_tokens"] == first.timings["prompt_cached"] == 0
    assert events2[-1]["usage"]["cached_tokens"] == second.timings["prompt_cached"] == PROMPT_LEN + 2
    _, fresh = library(fake_model(PLANS), params, second_prompt)  # nothing cached: the same tokens
    assert second.tokens == fresh.tokens
    assert [e["token"] for e in events2 if e["type"] == "token" and e["token"] is not None] == second.tokens
