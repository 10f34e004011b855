"""Loading a LoRA adapter while serving (issue 34): how long a load takes, and
how long it stalls the streams that are decoding meanwhile.

The adapter: rank 16 on every attention and feed-forward projection of every
layer of SmolLM2-135M-Instruct Q4_1 (q, k, v, o, gate, up, down; seeded
values, ``train_helpers.seeded_adapter``), about 20 MB of F32. The server's
engine worker (continuous batching, exact-batching kernels, 8 slots,
``$TOY_BENCH_THREADS`` threads) runs 8 greedy streams of ``NEW`` tokens on
the base model; once every stream has produced ``WARM`` tokens the adapter
is loaded the way ``POST /v1/adapters`` loads it: ``Model.prepare_adapter``
(read, sha256, check against the model, F32 tensors on the CPU) on a thread
of its own, then ``Model.attach_adapter`` through ``EngineWorker.call``
between two steps (the engine's graphs are rebuilt at the next step). Every
token's time is taken on the worker thread as it is sampled.

Figures: the load's wall time (prepare, attach, total) with the 8 streams
running and on an idle worker; the decode stall: the largest gap between two
tokens of any stream from the start of the load to ``SETTLE`` steps after
it, against the median gap of the steps before the load and of the steps
after it (the target, issue 34: at most one step's worth of extra wait, i.e.
a ratio <= 2 to the larger of the two); the median gap after the load
(every loaded adapter's products run over every row, so one more adapter
costs each step something even for base-model streams);
and the unload's time on the worker. Figures from one run; on a shared 2-core
machine they swing by 20-40 %; the 1-minute load average is recorded.
"""

from __future__ import annotations

import os
import statistics
import threading
import time

import pytest

pytestmark = [pytest.mark.bench, pytest.mark.model]

THREADS = int(os.environ.get("TOY_BENCH_THREADS", "2"))
NEW = int(os.environ.get("TOY_BENCH_ADAPTER_TOKENS", "160"))
WARM = 24  # tokens every stream has made before the load starts
SETTLE = 3  # steps after the attach that still count as the load's
RECIPE = {"seed": 7, "rank": 16, "alpha": 16.0, "targets": ("q", "k", "v", "o", "gate", "up", "down"), "std": 0.02}
WORDS = ["Rivers", "Mountains", "Cities", "Forests", "Oceans", "Deserts", "Islands", "Valleys"]


def start_streams(worker, model, n: int, tag: str):
    """n greedy jobs of NEW tokens on the base; returns (jobs, token times per job, all-done event)."""
    from toy.engine.sampling import SamplingParams
    from toy_serve.worker import Job

    times: list[list[float]] = [[] for _ in range(n)]
    done, ended = threading.Event(), []

    def sink(i):
        def emit(ev):  # on the worker thread: never block it
            if ev["type"] == "token" and ev["token"] is not None:
                times[i].append(time.perf_counter())
            elif ev["type"] in ("done", "error"):
                ended.append(ev)
                if len(ended) == n:
                    done.set()

        return emit

    jobs = []
    for i in range(n):
        ids = model.tokenize(f"{WORDS[i]} {tag}: a short essay about {WORDS[i].lower()} and why they matter.")
        jobs.append(
            Job(id=f"{tag}{i}", ids=ids, params=SamplingParams.greedy(max_tokens=NEW, ignore_eos=True), emit=sink(i))
        )
    for j in jobs:
        worker.submit(j)
    return jobs, times, done, ended


def load(worker, model, name: str, path) -> dict:
    """Load the adapter as the server does: prepare off the worker, attach through worker.call."""
    t0 = time.perf_counter()
    prepared = model.prepare_adapter(name, path)
    t1 = time.perf_counter()
    worker.call(lambda: model.attach_adapter(prepared)).result(timeout=120)
    t2 = time.perf_counter()
    return {"t0": t0, "t1": t1, "t2": t2, "prepare_s": t1 - t0, "attach_s": t2 - t1, "total_s": t2 - t0}


def test_bench_adapter_load_and_stall(smollm2_path, record, bench_line, tmp_path):
    import toy
    from toy_serve.worker import EngineWorker
    from toy_testsupport.train_helpers import seeded_adapter

    path = seeded_adapter(smollm2_path, tmp_path / "r16.gguf", base_name=smollm2_path.name, **RECIPE)
    size = path.stat().st_size
    with toy.load(smollm2_path, n_ctx=512, n_slot=8, threads=THREADS, exact_batching=True) as m:
        worker = EngineWorker(m)
        worker.start()
        try:
            # warm-up: the graphs of every batch size, and the file in the page cache
            _, _, done, _ = start_streams(worker, m, 8, "warm")
            assert done.wait(600)
            idle = load(worker, m, "idle", path)
            worker.call(lambda: m.unload_adapter("idle")).result(timeout=60)

            jobs, times, done, ended = start_streams(worker, m, 8, "run")
            deadline = time.monotonic() + 600
            while min(len(t) for t in times) < WARM and time.monotonic() < deadline:
                time.sleep(0.01)
            load_avg = os.getloadavg()[0]
            busy = load(worker, m, "r16", path)
            assert done.wait(900) and all(e["type"] == "done" for e in ended), ended
            assert all(len(j.out) == NEW for j in jobs)
            t_unload = time.perf_counter()
            worker.call(lambda: m.unload_adapter("r16")).result(timeout=60)
            unload_s = time.perf_counter() - t_unload
        finally:
            worker.stop()

    # the gaps between consecutive tokens of every stream, by the time the later token came
    gaps = [(b, b - a) for ts in times for a, b in zip(ts, ts[1:])]
    before = [g for t, g in gaps if t < busy["t0"]]
    steps_after = sorted({t for t, _ in gaps if t > busy["t2"]})
    window_end = steps_after[min(SETTLE, len(steps_after) - 1)] if steps_after else busy["t2"]
    during = [g for t, g in gaps if busy["t0"] <= t <= window_end]
    after = [g for t, g in gaps if t > window_end]
    median_before = statistics.median(before[-8 * 8 :])  # the last 8 steps before the load
    stall = max(during)
    common = {"threads": THREADS, "rank": RECIPE["rank"], "file_bytes": size, "streams": 8, "load_avg": load_avg}
    record("serve_adapters", figure="load_s_idle", value=idle["total_s"], unit="s", prepare_s=idle["prepare_s"],
           attach_s=idle["attach_s"], **common)  # fmt: skip
    record("serve_adapters", figure="load_s_8_streams", value=busy["total_s"], unit="s",
           prepare_s=busy["prepare_s"], attach_s=busy["attach_s"], **common)  # fmt: skip
    med_after = statistics.median(after) if after else median_before
    # the step after the attach is the first with the adapter's products (and rebuilds its graphs): compared with
    # the steps before the load, the stall holds that new per-step cost too; compared with the steps after, it
    # is the load's own wait
    record("serve_adapters", figure="decode_stall_ratio", value=stall / median_before, unit="x",
           max_gap_ms=stall * 1e3, median_gap_before_ms=median_before * 1e3, median_gap_after_ms=med_after * 1e3,
           ratio_to_after=stall / med_after, target_max=2.0, met=stall / max(median_before, med_after) <= 2.0,
           **common)  # fmt: skip
    record("serve_adapters", figure="step_ms_with_one_adapter_loaded", value=med_after * 1e3, unit="ms",
           without_ms=median_before * 1e3, ratio=med_after / median_before, **common)  # fmt: skip
    record("serve_adapters", figure="unload_s", value=unload_s, unit="s", **common)
