"""One side of the load benchmark (``test_bench_load.py``): a fresh process
that imports its library, opens a model and runs one forward, then prints one
JSON line of timings and exits.

    python bench_load_side.py toy MODEL.gguf --n-ctx 4096 --threads 2
    python bench_load_side.py llama MODEL.gguf --n-ctx 4096 --threads 2

Standalone: the ``llama`` side needs only ``llama-cpp-python`` (toy need not
be importable there). Phases, each timed with ``time.perf_counter``:

- ``import_s``: the library import, up to the point where the load function
  can be called: toy: ``import toy`` and ``toy.load`` (which imports the
  engine, NumPy and toy_ggml); llama.cpp: ``import llama_cpp`` and
  ``llama_cpp.Llama``.
- ``load_s``: opening the model: toy: ``toy.load(MODEL, n_ctx=N,
  threads=T)`` (tokenizer, chat template, weights bound over the mmap, KV
  cache); llama.cpp: ``Llama(MODEL, n_ctx=N, n_batch=n_ubatch=512,
  n_threads=T, flash_attn=False, use_mmap=True)`` (vocabulary, chat template,
  weights over the mmap, KV cache, compute buffers).
- ``first_s``: the first forward, one token (the model's BOS id) on a fresh
  sequence, up to its logits in host memory: toy: ``model.logits([bos])``;
  llama.cpp: ``llm.eval([bos])`` and a NumPy view of the last logits.
- ``ready_s`` = ``load_s + first_s``: from the load call to the first logits;
  ``ready_cpu_s``: the process's CPU time over the same span (every thread).

Both sides use an F16 KV cache of N tokens and no flash attention; the
output carries the argmax of the first logits so the benchmark can check that
both computed the same model.
"""

from __future__ import annotations

import argparse
import json
import time


def toy_side(model: str, n_ctx: int, threads: int) -> dict:
    t0 = time.perf_counter()
    import toy

    load = toy.load
    t1, c1 = time.perf_counter(), time.process_time()
    m = load(model, n_ctx=n_ctx, threads=threads)
    t2 = time.perf_counter()
    bos = m.tokenizer.bos_id
    logits = m.logits([bos])[-1]
    t3, c3 = time.perf_counter(), time.process_time()
    return {
        "import_s": t1 - t0,
        "load_s": t2 - t1,
        "first_s": t3 - t2,
        "ready_cpu_s": c3 - c1,
        "bos": bos,
        "argmax": int(logits.argmax()),
    }


def llama_side(model: str, n_ctx: int, threads: int) -> dict:
    t0 = time.perf_counter()
    import llama_cpp
    import numpy as np

    llama = llama_cpp.Llama
    t1, c1 = time.perf_counter(), time.process_time()
    llm = llama(
        model_path=model,
        n_ctx=n_ctx,
        n_batch=512,
        n_ubatch=512,
        n_threads=threads,
        n_threads_batch=threads,
        logits_all=False,
        flash_attn=False,
        use_mmap=True,
        verbose=False,
    )
    t2 = time.perf_counter()
    bos = llm.token_bos()
    llm.eval([bos])
    ptr = llama_cpp.llama_get_logits_ith(llm.ctx, -1)
    logits = np.ctypeslib.as_array(ptr, shape=(llm.n_vocab(),))
    t3, c3 = time.perf_counter(), time.process_time()
    return {
        "import_s": t1 - t0,
        "load_s": t2 - t1,
        "first_s": t3 - t2,
        "ready_cpu_s": c3 - c1,
        "bos": bos,
        "argmax": int(logits.argmax()),
        "version": llama_cpp.__version__,
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("side", choices=("toy", "llama"))
    ap.add_argument("model")
    ap.add_argument("--n-ctx", type=int, required=True)
    ap.add_argument("--threads", type=int, required=True)
    a = ap.parse_args()
    res = (toy_side if a.side == "toy" else llama_side)(a.model, a.n_ctx, a.threads)
    res["ready_s"] = res["load_s"] + res["first_s"]
    res["side"] = a.side
    print(json.dumps(res), flush=True)


if __name__ == "__main__":
    main()
