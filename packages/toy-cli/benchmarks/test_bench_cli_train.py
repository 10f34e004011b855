"""Training tokens/s of ``toy train from-scratch --preset tiny`` through the command line: the
whole tool (config, BPE training, data loading, the step loop, events), not the engine alone.

The command trains the ``tiny`` preset (vocabulary 1024 BPE trained on the corpus) on the bundled
Python-documentation corpus (``toy.train.demodata.write_python_docs``) for ``$TOY_BENCH_CLI_TRAIN_STEPS``
(60) steps of B=8, T=128 with 2 threads (``$TOY_BENCH_THREADS``), no evaluation, one checkpoint at the
end. The figure is B*T over the median step wall time (``wall_us`` of the run's ``step`` events,
the first 5 steps left out as warm-up), the best of ``$TOY_BENCH_CLI_TRAIN_REPS`` (3) runs; the record
also carries the command's wall time (BPE training and start-up included).

``$TOY_BENCH_BASELINE_TOY``: the ``toy`` executable of another install (e.g. a virtual environment
with an earlier release's wheels) to measure beside it: the runs alternate (this one, the baseline,
...), so both see the same machine noise, and the record's ``peer_value`` and ``ratio`` compare them.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.bench

STEPS = int(os.environ.get("TOY_BENCH_CLI_TRAIN_STEPS", "60"))
REPS = int(os.environ.get("TOY_BENCH_CLI_TRAIN_REPS", "3"))
THREADS = int(os.environ.get("TOY_BENCH_THREADS", "2"))
WARMUP = 5
B, T = 8, 128


def _run(cmd: list[str], corpus: Path, out: Path) -> dict:
    argv = cmd + ["train", "from-scratch", str(corpus), "--preset", "tiny", "--steps", str(STEPS)]
    argv += ["-b", str(B), "--context", str(T), "-t", str(THREADS), "--eval-every", "0", "--save-every", "0"]
    argv += ["--out", str(out), "--json", "-q"]
    t0 = time.perf_counter()
    p = subprocess.run(argv, capture_output=True, text=True, timeout=1200)
    wall = time.perf_counter() - t0
    assert p.returncode == 0, p.stderr
    run_dir = Path(json.loads(p.stdout.strip().splitlines()[-1])["run_dir"])
    steps = [e for e in map(json.loads, (run_dir / "events.jsonl").read_text().splitlines()) if e["kind"] == "step"]
    assert len(steps) == STEPS
    step_s = statistics.median(e["wall_us"] for e in steps[WARMUP:]) / 1e6
    return {"tokens_per_s": B * T / step_s, "step_ms": 1e3 * step_s, "wall_s": wall}


def test_cli_train_tiny_tokens_per_s(record, tmp_path):
    from toy.train.demodata import write_python_docs

    corpus = tmp_path / "corpus"
    write_python_docs(corpus)
    sides = {"toy": [sys.executable, "-m", "toy_cli"]}
    baseline = os.environ.get("TOY_BENCH_BASELINE_TOY", "").strip()
    if baseline:
        sides["baseline"] = [baseline]
    runs: dict[str, list[dict]] = {name: [] for name in sides}
    load_before = os.getloadavg()[0]
    for rep in range(REPS):
        for name, cmd in sides.items():
            runs[name].append(_run(cmd, corpus, tmp_path / f"runs-{name}-{rep}"))
    load_after = os.getloadavg()[0]
    best = {name: max(r["tokens_per_s"] for r in rs) for name, rs in runs.items()}
    extra = {}
    if baseline:
        extra = {"peer": f"the baseline install ({baseline})", "peer_value": best["baseline"]}
        extra["ratio"] = best["toy"] / best["baseline"]
        extra["baseline_runs"] = runs["baseline"]
    record(
        "cli-train",
        figure="toy train from-scratch --preset tiny: training tokens/s (B=8, T=128)",
        value=best["toy"],
        unit="tokens/s",
        better="higher",
        stat="best",
        threads=THREADS,
        steps=STEPS,
        warmup_steps_left_out=WARMUP,
        reps=REPS,
        runs=runs["toy"],
        loadavg_before=load_before,
        loadavg_after=load_after,
        **extra,
    )
