"""Time to a ready model: ``toy.load`` of SmolLM2-135M-Instruct Q4_1 beside
llama.cpp's load of the same file, in the same run (target: toy's ready time
at most 1.5x llama.cpp's).

"Ready" means loaded and through the first forward: the time from the load
call to the logits of one token (the model's BOS id) on a fresh sequence,
in host memory. The library imports before the load call are timed apart
(``import_s``) and not part of it. Each side is one fresh process running
``bench_load_side.py`` (next to this file; its docstring lists each side's
calls): toy with this interpreter; llama.cpp with a Python that has
``llama-cpp-python`` (``$TOY_BENCH_LLAMA_PYTHON``, else this interpreter when
it can import ``llama_cpp``; without one the record carries toy's figures and
a note). Both open the model over an mmap with a 4096-token F16 KV cache (toy's
default context for this model), 512-token batches, no flash attention and
2 threads (``$TOY_BENCH_THREADS``).

The sides alternate (toy, llama.cpp, toy, ...) for ``$TOY_BENCH_LOAD_REPS``
(5) rounds after one untimed round that warms the page cache; each figure is
the best round (the median and every round are in the record). Both sides
must give the same argmax for the first logits.

Both sides run as installed packages do: with their bytecode caches. The
children's environment drops ``PYTHONDONTWRITEBYTECODE`` (set on some
machines), so the untimed round writes the ``.pyc`` files of an editable
checkout; otherwise every round would compile toy's modules from source
(~50 ms), a cost a user's pip-installed wheel never has (pip compiles at
install). The record also carries the medians' ratio and each side's import
plus ready time (what a user waits for in a fresh ``python -c``).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

from toy_testsupport.bench_side import peer_python

pytestmark = pytest.mark.bench

SIDE = Path(__file__).resolve().parent / "bench_load_side.py"
N_CTX = 4096
THREADS = int(os.environ.get("TOY_BENCH_THREADS", "2"))
REPS = int(os.environ.get("TOY_BENCH_LOAD_REPS", "5"))
TARGET = 1.5  # toy's ready time / llama.cpp's, at most


ENV = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}


def side(python: str, name: str, model: Path) -> dict:
    cmd = [python, str(SIDE), name, str(model), "--n-ctx", str(N_CTX), "--threads", str(THREADS)]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=ENV)
    assert p.returncode == 0, f"the {name} side failed:\n{p.stderr[-4000:]}"
    return json.loads(next(ln for ln in p.stdout.splitlines() if ln.startswith("{")))


def test_load_to_ready(record, smollm2_path):
    peer = peer_python()
    pythons = {"toy": sys.executable}
    if peer is not None:
        pythons["llama"] = peer
    for name, py in pythons.items():  # untimed: page cache, bytecode caches
        side(py, name, smollm2_path)
    runs: dict[str, list[dict]] = {name: [] for name in pythons}
    load_before = os.getloadavg()[0]
    for _ in range(REPS):
        for name, py in pythons.items():
            runs[name].append(side(py, name, smollm2_path))
    load_after = os.getloadavg()[0]

    def best(name: str, key: str) -> float:
        return min(r[key] for r in runs[name])

    context = {
        "model": "SmolLM2-135M-Instruct Q4_1",
        "n_ctx": N_CTX,
        "threads": THREADS,
        "reps": REPS,
        "stat": "best",
        "loadavg_before": load_before,
        "loadavg_after": load_after,
        "toy_median": statistics.median(r["ready_s"] for r in runs["toy"]),
        "toy_load_s": best("toy", "load_s"),
        "toy_first_s": best("toy", "first_s"),
        "toy_import_s": best("toy", "import_s"),
        "toy_rounds": [round(r["ready_s"], 4) for r in runs["toy"]],
        "toy_import_ready_s": min(r["import_s"] + r["ready_s"] for r in runs["toy"]),
    }
    figure = "toy.load to ready (load + first one-token forward, fresh process)"
    toy_ready = best("toy", "ready_s")
    if "llama" not in runs:
        record(
            "load",
            figure=figure,
            value=toy_ready,
            unit="s",
            peer="llama.cpp",
            note="llama-cpp-python not available: set TOY_BENCH_LLAMA_PYTHON to a Python that has it",
            **context,
        )
        return
    lc = runs["llama"]
    assert {r["argmax"] for r in runs["toy"]} == {r["argmax"] for r in lc}, (runs["toy"][0], lc[0])
    peer_ready = best("llama", "ready_s")
    ratio = toy_ready / peer_ready
    record(
        "load",
        figure=figure,
        value=toy_ready,
        unit="s",
        peer=f"llama.cpp (llama-cpp-python {lc[0].get('version')})",
        peer_value=peer_ready,
        ratio=ratio,
        better="lower",
        target=TARGET,
        met=ratio <= TARGET,
        peer_median=statistics.median(r["ready_s"] for r in lc),
        peer_load_s=best("llama", "load_s"),
        peer_first_s=best("llama", "first_s"),
        peer_import_s=best("llama", "import_s"),
        peer_rounds=[round(r["ready_s"], 4) for r in lc],
        ratio_median=context["toy_median"] / statistics.median(r["ready_s"] for r in lc),
        peer_import_ready_s=min(r["import_s"] + r["ready_s"] for r in lc),
        **context,
    )
