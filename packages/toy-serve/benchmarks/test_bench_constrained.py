"""What a JSON schema costs the decode: tokens/s of the server's engine worker
(continuous batching, exact-batching kernels, SmolLM2-135M-Instruct Q4_1,
``$TOY_BENCH_THREADS`` threads) with every sequence constrained by a JSON
schema against the same sequences unconstrained, at 1 and 8 sequences, in one
run, alternating (free, constrained, free, constrained) and keeping each
side's best of ``$TOY_BENCH_CONSTRAINED_ROUNDS`` (5) rounds; the median of the
rounds' paired ratios is recorded too (on a 2-core VM one round swings by 20 %).

Both sides generate exactly 64 tokens per sequence: the schema (an array of
60 to 80 small integers) cannot be complete before 64 tokens, and the free
side ignores end-of-generation; prompts are distinct (no shared cached
prefix). Decode tokens/s: the tokens after each sequence's first over the
time from the first sequence's first token to the last sequence's end.

Also recorded: the mask's own cost per token (llguidance's mask plus toy's
unpacking and masking of the 49,152 logits), over the same schema. The target
(issue 20): constrained decoding at most 10 % slower.
"""

from __future__ import annotations

import os
import threading
import time

import numpy as np
import pytest

pytestmark = [pytest.mark.bench, pytest.mark.model]

THREADS = int(os.environ.get("TOY_BENCH_THREADS", "2"))
ROUNDS = int(os.environ.get("TOY_BENCH_CONSTRAINED_ROUNDS", "5"))
NEW = 64
SCHEMA = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 99}, "minItems": 60, "maxItems": 80}
WORDS = ["Numbers", "Counts", "Values", "Scores", "Items", "Points", "Digits", "Marks"]


def run_batch(worker, model, n: int, constrained: bool, round_: int) -> tuple[float, int]:
    from toy.engine.constrain import Constraint
    from toy.engine.sampling import SamplingParams
    from toy_serve.worker import Job

    c = Constraint.json_schema(SCHEMA) if constrained else None
    finished, ends, errors = threading.Event(), [], []

    def sink(ev):  # on the worker thread: never block it
        if ev["type"] in ("done", "error"):
            ends.append(time.perf_counter())
            if ev["type"] == "error":
                errors.append(ev["message"])
            if len(ends) == n:
                finished.set()

    jobs = []
    for i in range(n):
        prompt = f"{WORDS[i]} {round_} {'c' if constrained else 'f'}: a JSON list of numbers from 0 to 99:"
        p = SamplingParams.greedy(max_tokens=NEW, ignore_eos=True, constraint=c)
        jobs.append(Job(id=f"{i}", ids=model.tokenize(prompt), params=p, emit=sink))
    for j in jobs:
        worker.submit(j)
    assert finished.wait(300) and not errors, errors
    t0 = min(j.t_first for j in jobs)
    tokens = sum(len(j.out) - 1 for j in jobs)
    assert all(len(j.out) == NEW for j in jobs), [len(j.out) for j in jobs]
    return tokens / (max(ends) - t0), tokens


def test_bench_constrained_decode(smollm2_path, record):
    import toy
    from toy.engine.constrain import Constraint, Matcher
    from toy_serve.worker import EngineWorker

    with toy.load(smollm2_path, n_ctx=512, n_slot=8, threads=THREADS, exact_batching=True) as m:
        worker = EngineWorker(m)
        worker.start()
        try:
            run_batch(worker, m, 8, True, -1)  # warm-up: graphs of every batch size, the token table
            run_batch(worker, m, 8, False, -1)
            for n in (1, 8):
                best, paired = {False: 0.0, True: 0.0}, []
                for r in range(ROUNDS):
                    rates = {}
                    for constrained in (False, True):
                        rates[constrained], _ = run_batch(worker, m, n, constrained, r)
                        best[constrained] = max(best[constrained], rates[constrained])
                    paired.append(rates[True] / rates[False])
                ratio = best[True] / best[False]
                record(
                    "serve_constrained",
                    figure=f"decode_tok_s_{n}seq",
                    value=best[True],
                    unit="tok/s",
                    free_tok_s=best[False],
                    ratio_constrained_to_free=ratio,
                    slower_pct=100 * (1 - ratio),
                    median_paired_ratio=float(np.median(paired)),
                    target_slower_pct_max=10,
                    met=ratio >= 0.9,
                    threads=THREADS,
                    load_avg=os.getloadavg()[0],
                )
        finally:
            worker.stop()
        # the mask alone, along a valid path
        matcher = Matcher(Constraint.json_schema(SCHEMA), m.tokenizer, m.cfg.n_vocab)
        x = np.zeros(m.cfg.n_vocab, np.float32)
        path = m.tokenize("[" + ",".join(str(i % 100) for i in range(70)) + "]", add_special=False)
        t = time.perf_counter()
        for tok in path:
            matcher.mask(x.copy())
            matcher.advance(tok)
        per = (time.perf_counter() - t) / len(path)
        record("serve_constrained", figure="mask_us_per_token", value=per * 1e6, unit="us", tokens=len(path))
