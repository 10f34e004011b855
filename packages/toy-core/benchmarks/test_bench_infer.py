"""Inference speed and memory: toy's engine side by side with llama.cpp in the
same run, on SmolLM2-135M-Instruct as Q4_1 (the original file), Q8_0 and F32
(made from it with ``toy.gguf.quantize_model``, into a temporary folder, or
into ``$TOY_BENCH_MODEL_DIR`` where they are kept and reused as
``smollm2-Q8_0.gguf`` / ``smollm2-F32.gguf``).

Each side runs in a process of its own: toy in ``bench_infer_toy.py`` (next
to this file), llama.cpp in ``tools/fixtures/bench_infer_peer.py`` with a
Python that has ``llama-cpp-python``: ``$TOY_BENCH_LLAMA_PYTHON`` if set, else
this interpreter when it can import ``llama_cpp``; otherwise the records carry
toy's figures only and one record per model says the peer is unavailable.
Both load the model with 2 threads (``$TOY_BENCH_THREADS``), a 1024-token
context, 512-token batches, an F16 KV cache and no flash attention, do one
untimed warm-up of every step, then run ``$TOY_BENCH_INFER_REPS`` (3) timed
reps alternately (toy, llama.cpp, toy, llama.cpp, ...) so both see the same
machine noise, with a 0.5 s pause before each rep (a ggml thread pool that
polls keeps a core busy after its last compute; toy's Runtime no longer
polls, llama.cpp's pool may); each figure is the median of its reps (all
reps are in the record, as is the 1-minute load average before and after).

Both sides compute the same token ids: a fixed English text tokenized once
by toy and cut to exactly 128 and 512 tokens (and 16 for the decode prompt);
tokenization is never timed. The figures, per model file:

- prefill tokens/s for 128 and 512 prompt tokens (toy: ``generate(ids,
  max_tokens=1)`` and its ``prefill_s``; llama.cpp: ``reset(); eval(ids)``);
- time to first token for the 128-token prompt (prefill + reading the last
  logits + greedy pick);
- decode tokens/s: 128 greedy new tokens after a 16-token prompt, EOS
  ignored, counting the 127 forward steps only (toy: ``engine.decode`` calls as
  timed by generate: feed uploads, graph compute, logits copied out;
  llama.cpp: ``eval([tok])`` calls: batch fill + ``llama_decode``, logits left
  in llama.cpp's buffer), and the whole loop per token (toy adds greedy
  sampling through its Sampler, incremental detokenizing and stop matching;
  llama.cpp adds a zero-copy NumPy view of the logits and argmax), whether
  both sides produced the same greedy tokens;
- where toy's decode step goes, per token: ggml compute (``Runtime.compute``
  alone), the engine's Python around it, and the generate loop's own work;
  toy_ggml offers no per-op timing, so there is no per-op split;
- peak RSS (``VmHWM`` of each side's process) against the target
  RSS <= file size + KV cache bytes + 100 MB (toy's ``engine.cache.nbytes``;
  llama.cpp's F16 cache of the same context has the same size).

Ratios are toy / llama.cpp: above 1 is toy faster for tokens/s, slower for
seconds and bigger for bytes (each record says which way is better).
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from pathlib import Path

import pytest
from bench_side import TEXT, Side, peer_python

pytestmark = pytest.mark.bench

HERE = Path(__file__).resolve().parent
TOY_SCRIPT = HERE / "bench_infer_toy.py"
PEER_SCRIPT = HERE.parents[2] / "tools" / "fixtures" / "bench_infer_peer.py"

DTYPES = ("Q4_1", "Q8_0", "F32")
PROMPT_LENGTHS = (128, 512)
SHORT_PROMPT = 16
NEW_TOKENS = 128
N_CTX = 1024
THREADS = int(os.environ.get("TOY_BENCH_THREADS", "2"))
REPS = int(os.environ.get("TOY_BENCH_INFER_REPS", "3"))
RSS_SLACK = 100_000_000  # the target: peak RSS <= file + KV cache + 100 MB
# toy's ggml thread pool keeps one core busy polling for ~0.2 s after its last compute (the
# ggml default poll); on a 2-core machine the next side would share the cores with it
SETTLE_S = 0.5
SIDE_TIMEOUT_S = 1800  # a side still running after this is killed (the test then fails)


# ---------------------------------------------------------------- setup


@pytest.fixture(scope="module")
def bench_models(smollm2_path, tmp_path_factory) -> dict[str, Path]:
    """The three model files: the Q4_1 original and Q8_0 / F32 made from it."""
    from toy.gguf import quantize_model

    keep = os.environ.get("TOY_BENCH_MODEL_DIR")
    folder = Path(keep) if keep else tmp_path_factory.mktemp("bench_infer_models")
    models = {"Q4_1": Path(smollm2_path)}
    for dtype in DTYPES[1:]:
        p = folder / f"smollm2-{dtype}.gguf"
        if not p.is_file():
            quantize_model(smollm2_path, p, dtype)
        models[dtype] = p
    return models


@pytest.fixture(scope="module")
def prompt_ids(smollm2_path, tmp_path_factory) -> Path:
    """A JSON file with the prompts as toy's token ids, exactly 16, 128 and 512 long."""
    from toy.tokenizer import Tokenizer

    tok = Tokenizer.from_file(smollm2_path)
    need = max(PROMPT_LENGTHS)
    text = TEXT
    ids = tok.encode(text)
    while len(ids) < need:
        text += TEXT
        ids = tok.encode(text)
    spec = {"prompts": {str(n): ids[:n] for n in PROMPT_LENGTHS}, "short": ids[:SHORT_PROMPT]}
    path = tmp_path_factory.mktemp("bench_infer_prompts") / "ids.json"
    path.write_text(json.dumps(spec))
    return path


def run_sides(model: Path, ids: Path, peer: str | None, logdir: Path) -> dict:
    """Start toy (then llama.cpp), wait for both to warm up, alternate the reps."""
    args = ["--model", str(model), "--ids", str(ids), "--threads", str(THREADS), "--n-ctx", str(N_CTX)]
    args += ["--new-tokens", str(NEW_TOKENS)]
    sides: dict[str, Side] = {}
    out: dict = {"reps": {"toy": [], "peer": []}}
    try:
        sides["toy"] = Side("toy", [sys.executable, str(TOY_SCRIPT), *args], logdir, timeout_s=SIDE_TIMEOUT_S)
        out["toy_ready"] = sides["toy"].read()
        if peer is not None:
            sides["peer"] = Side("peer", [peer, str(PEER_SCRIPT), *args], logdir, timeout_s=SIDE_TIMEOUT_S)
            out["peer_ready"] = sides["peer"].read()
        out["loadavg_before"] = os.getloadavg()[0]
        t0 = time.perf_counter()
        for _ in range(REPS):
            for key, side in sides.items():
                time.sleep(SETTLE_S)
                out["reps"][key].append(side.ask("rep"))
        out["reps_wall_s"] = time.perf_counter() - t0
        out["loadavg_after"] = os.getloadavg()[0]
        for key, side in sides.items():
            out[f"{key}_done"] = side.ask("done")
    finally:
        for side in sides.values():
            side.close()
    return out


# ---------------------------------------------------------------- figures


def med(values: list[float]) -> float:
    return statistics.median(values)


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def figures(reps: list[dict]) -> dict[str, list[float]]:
    """Per-rep figures of one side (name -> one value per rep)."""
    f: dict[str, list[float]] = {}
    for r in reps:
        for n, p in r["prefill"].items():
            f.setdefault(f"prefill_{n}", []).append(p["tokens"] / p["prefill_s"])
            f.setdefault(f"ttft_{n}", []).append(p["ttft_s"])
        d = r["decode"]
        steps = d["decode_steps"]
        f.setdefault("decode", []).append(steps / d["decode_s"])
        f.setdefault("decode_loop", []).append(steps / d["loop_s"])
        f.setdefault("step_ms", []).append(1e3 * d["decode_s"] / steps)
        f.setdefault("loop_extra_ms", []).append(1e3 * (d["loop_s"] - d["decode_s"]) / steps)
        if "compute_s" in d:
            f.setdefault("compute_ms", []).append(1e3 * d["compute_s"] / steps)
            f.setdefault("engine_extra_ms", []).append(1e3 * (d["decode_s"] - d["compute_s"]) / steps)
    return f


@pytest.mark.parametrize("dtype", DTYPES)
def test_inference(record, bench_models, prompt_ids, tmp_path, dtype):
    model = bench_models[dtype]
    python = peer_python()
    res = run_sides(model, prompt_ids, python, tmp_path)
    toy_ready, toy_done = res["toy_ready"], res["toy_done"]
    tf = figures(res["reps"]["toy"])
    pf = figures(res["reps"]["peer"]) if python is not None else None
    peer_name = res["peer_ready"]["peer"] if python is not None else "llama.cpp"
    assert toy_done["graph_builds_in_reps"] == 0, "toy built graphs during the timed reps (warm-up missed a shape)"

    context = {
        "model": model.name,
        "dtype": dtype,
        "threads": THREADS,
        "n_ctx": N_CTX,
        "reps": REPS,
        "loadavg_1m": [res["loadavg_before"], res["loadavg_after"]],
        "cpus": os.cpu_count(),
    }

    def pair(figure: str, key: str, unit: str, better: str, **extra):
        toy_v = med(tf[key])
        peer_v = med(pf[key]) if pf is not None else None
        record(
            "infer",
            figure=figure,
            value=toy_v,
            unit=unit,
            **context,
            **extra,
            peer=peer_name,
            peer_value=peer_v,
            ratio=toy_v / peer_v if peer_v else None,
            better=better,
            toy_runs=tf[key],
            peer_runs=pf[key] if pf is not None else None,
        )

    for n in PROMPT_LENGTHS:
        pair(f"prefill {n} tokens, {dtype}", f"prefill_{n}", "tokens/s", "higher", prompt_tokens=n)
    pair(
        f"time to first token, 128-token prompt, {dtype}",
        "ttft_128",
        "s",
        "lower",
        prompt_tokens=128,
        toy_ttft_512_s=med(tf["ttft_512"]),
        peer_ttft_512_s=med(pf["ttft_512"]) if pf is not None else None,
    )
    same = None
    if pf is not None:
        same = common_prefix(res["reps"]["toy"][0]["decode"]["tokens"], res["reps"]["peer"][0]["decode"]["tokens"])
    pair(
        f"decode tokens/s, forward steps only, {dtype}",
        "decode",
        "tokens/s",
        "higher",
        prompt_tokens=SHORT_PROMPT,
        new_tokens=NEW_TOKENS,
        steps=NEW_TOKENS - 1,
        same_greedy_tokens=same,
    )
    pair(
        f"decode tokens/s, whole generate loop, {dtype}",
        "decode_loop",
        "tokens/s",
        "higher",
        prompt_tokens=SHORT_PROMPT,
        new_tokens=NEW_TOKENS,
    )

    # where toy's decode step goes (toy only: the peer has no equivalent split)
    compute, engine, loop = med(tf["compute_ms"]), med(tf["engine_extra_ms"]), med(tf["loop_extra_ms"])
    total = compute + engine + loop
    record(
        "infer",
        figure=f"toy decode time per token, split, {dtype}",
        value=total,
        unit="ms/token",
        **context,
        ggml_compute_ms=compute,
        engine_python_ms=engine,
        generate_loop_ms=loop,
        ggml_compute_share=compute / total,
        python_share=(engine + loop) / total,
        peer_eval_ms=med(pf["step_ms"]) if pf is not None else None,
        peer_loop_extra_ms=med(pf["loop_extra_ms"]) if pf is not None else None,
        note="engine_python = engine.decode minus Runtime.compute (feeds, masks, logits copy); "
        "generate_loop = sampling, detokenize, stop matching; no per-op timing in toy_ggml",
    )

    file_bytes = model.stat().st_size
    kv_bytes = toy_ready["kv_bytes"]
    target = file_bytes + kv_bytes + RSS_SLACK
    toy_rss = toy_done["vm_hwm_bytes"]
    peer_rss = res["peer_done"]["vm_hwm_bytes"] if python is not None else None
    record(
        "infer",
        figure=f"peak RSS, {dtype}",
        value=toy_rss,
        unit="bytes",
        **context,
        peer=peer_name,
        peer_value=peer_rss,
        ratio=toy_rss / peer_rss if peer_rss else None,
        better="lower",
        file_bytes=file_bytes,
        kv_bytes=kv_bytes,
        target_bytes=target,
        target="peak RSS <= file + KV cache + 100 MB",
        met=toy_rss <= target if toy_rss is not None else None,
        peer_met=peer_rss <= target if peer_rss is not None else None,
        toy_load_s=toy_ready["load_s"],
        peer_load_s=res["peer_ready"]["load_s"] if python is not None else None,
    )
    if python is None:
        record(
            "infer",
            figure=f"llama.cpp peer, {dtype}",
            value=None,
            unit="",
            peer_available=False,
            note="llama_cpp is not importable here; set TOY_BENCH_LLAMA_PYTHON to a Python with llama-cpp-python",
        )
