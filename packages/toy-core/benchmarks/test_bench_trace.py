"""The cost of a step trace (``toy train --trace``, ``toy.trace``) on the
``small`` preset's training step (vocabulary 8192, B=8, T=128, threads 2 or
``$TOY_BENCH_THREADS``), in one process: a ``TrainEngine`` as the training
benchmark builds it (``test_bench_train.llama_config``), ``WARMUP`` untimed
steps, then ``ROUNDS`` rounds that alternate ``K`` plain steps
(``engine.train_step``) and one traced step (``toy.trace.trace_train_step``:
every node computed alone and timed), with a 0.5 s pause before each, so
both see the same machine noise.

Figures: the traced step's time divided by the median plain step's (ratio;
the step a trace slows down, nothing else), the traced step's summed node
time over its wall time (how much of the traced step the trace accounts for),
the time writing the trace file takes, and the graph's node count. A figure
is the median over the rounds. ``TOY_BENCH_QUICK=1``: fewer rounds.
"""

from __future__ import annotations

import os
import statistics
import time

import pytest

pytestmark = pytest.mark.bench

THREADS = int(os.environ.get("TOY_BENCH_THREADS", "2"))
QUICK = os.environ.get("TOY_BENCH_QUICK", "") not in ("", "0")
PRESET, VOCAB, BATCH, CONTEXT = "small", 8192, 8, 128
WARMUP = 2
ROUNDS = 2 if QUICK else 4
K = 2 if QUICK else 4  # plain steps per round
LR = 1e-3
SETTLE_S = 0.5


def Batch(step: int):
    """The seeded random batch of ``step`` (``toy_testsupport.bench_models``)."""
    from toy_testsupport.bench_models import RandomTokenBatch

    return RandomTokenBatch(step, VOCAB, BATCH, CONTEXT)


def test_trace_cost_small(record, tmp_path):
    import toy_ggml
    from toy import trace
    from toy.train.config import ModelShape
    from toy.train.model import ArchTrain, init_params, model_config
    from toy.train.optim import OptimConfig
    from toy.train.stepgraph import TrainEngine

    cfg = model_config(ModelShape(preset=PRESET), VOCAB, CONTEXT)
    rt = toy_ggml.Runtime("cpu", threads=THREADS)
    eng = TrainEngine(ArchTrain(cfg), init_params(cfg, 0), rt, OptimConfig(lr=LR), batch=BATCH, context=CONTEXT)
    step = 0
    try:
        for _ in range(WARMUP):
            eng.train_step([Batch(step)], LR)
            step += 1
        plain, traced, covered, write = [], [], [], []
        n_nodes = 0
        for _ in range(ROUNDS):
            time.sleep(SETTLE_S)
            for _ in range(K):
                b = Batch(step)
                t0 = time.perf_counter()
                eng.train_step([b], LR)
                plain.append(time.perf_counter() - t0)
                step += 1
            time.sleep(SETTLE_S)
            b = Batch(step)
            t0 = time.perf_counter()
            _, tr = trace.trace_train_step(eng, [b], LR)
            dt = time.perf_counter() - t0
            step += 1
            traced.append(dt)
            covered.append(tr.seconds / dt)
            n_nodes = tr.n_nodes
            t0 = time.perf_counter()
            tr.write(tmp_path / "step.json")
            write.append(time.perf_counter() - t0)
    finally:
        eng.close()
        rt.close()
    plain_ms = 1e3 * statistics.median(plain)
    traced_ms = 1e3 * statistics.median(traced)
    context = {
        "preset": PRESET,
        "vocab": VOCAB,
        "batch": BATCH,
        "context": CONTEXT,
        "threads": THREADS,
        "rounds": ROUNDS,
        "plain_steps": len(plain),
        "quick": QUICK,
        "cpus": os.cpu_count(),
        "loadavg_1m": os.getloadavg()[0],
    }
    record(
        "trace",
        figure="traced / plain train step time, small",
        value=traced_ms / plain_ms,
        unit="ratio",
        **context,
        traced_ms=traced_ms,
        plain_ms=plain_ms,
        traced_runs_ms=[1e3 * t for t in traced],
        plain_runs_ms=[1e3 * t for t in plain],
        better="lower",
    )
    record(
        "trace",
        figure="traced step's node time / its wall time, small",
        value=statistics.median(covered),
        unit="ratio",
        **context,
        graph_nodes=n_nodes,
    )
    record("trace", figure="trace file write, small", value=1e3 * statistics.median(write), unit="ms", **context)
