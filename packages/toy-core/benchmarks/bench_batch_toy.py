"""toy's half of ``test_bench_batch_decode.py``: decode steps over 1, 2, 4 and
8 sequences at once on toy's engine, as ``toy serve`` runs them.

Run by the benchmark with this package's Python::

    python bench_batch_toy.py --model M.gguf --ids ids.json --threads 2

``ids.json`` holds one prompt per sequence as token ids (``{"prompts":
[[...], ...]}``), so both sides compute the same tokens. The model is loaded
as the server loads it: ``n_slot`` = the largest level, ``exact_batching``
(every product row-invariant), F16 KV cache, no flash attention.

Per level S (each a fresh cache): sequences 0..S-1 are prefilled one by one
(``engine.prefill``; sequence 0's prefill time is recorded), each takes the
argmax of its last logits, then N decode steps run all S sequences
in one ``engine.decode`` call (feed uploads, graph compute, logits copied
out) followed by a greedy pick per sequence. ``step_ms`` is the median step.
Sequence 0's tokens are returned so the benchmark can check that a sequence
decodes the same alone and in a batch.

Protocol (stdin/stdout, one JSON object per stdout line): after loading and
one untimed warm-up of every level (it builds the graphs) the script prints
``{"ready": true, ...}``; each ``steps N`` line runs every level once with
N decode steps and prints their figures; ``done`` prints the peak RSS (``VmHWM``) and exits.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import numpy as np

import toy
from toy_testsupport.bench_side import vm_hwm_bytes


def level(engine, prompts: list[list[int]], S: int, steps: int) -> dict:
    engine.cache.clear()
    tok, prefill_s = [], None
    for s in range(S):
        t0 = time.perf_counter()
        logits = np.asarray(engine.prefill(s, prompts[s])).reshape(-1)
        if s == 0:
            prefill_s = time.perf_counter() - t0
        tok.append(int(logits.argmax()))
    seq0, times = [tok[0]], []
    slots = list(range(S))
    for _ in range(steps):
        t0 = time.perf_counter()
        rows = engine.decode(slots, tok)
        times.append(time.perf_counter() - t0)
        tok = [int(r.argmax()) for r in rows]
        seq0.append(tok[0])
    return {"step_ms": statistics.median(times) * 1e3, "prefill_ms": prefill_s * 1e3, "seq0_tokens": seq0}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--ids", required=True)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--n-ctx", type=int, default=256)
    ap.add_argument("--steps", type=int, default=8, help="decode steps of the warm-up")
    ap.add_argument("--levels", default="1,2,4,8")
    args = ap.parse_args()
    levels = [int(v) for v in args.levels.split(",")]
    with open(args.ids) as f:
        prompts = json.load(f)["prompts"]

    t0 = time.perf_counter()
    model = toy.load(args.model, n_ctx=args.n_ctx, n_slot=max(levels), exact_batching=True, threads=args.threads)
    load_s = time.perf_counter() - t0
    engine = model.engine
    for S in levels:  # warm-up: every graph shape of the timed reps is built here
        level(engine, prompts, S, args.steps)
    ready = {"ready": True, "side": "toy", "load_s": load_s, "threads": args.threads, "n_slot": engine.n_slot}
    print(json.dumps(ready), flush=True)
    for line in sys.stdin:
        cmd = line.strip()
        if cmd.startswith("steps "):
            n = int(cmd.split()[1])
            print(json.dumps({str(S): level(engine, prompts, S, n) for S in levels}), flush=True)
        elif cmd == "done":
            print(json.dumps({"vm_hwm_bytes": vm_hwm_bytes()}), flush=True)
            break
    model.close()


if __name__ == "__main__":
    main()
