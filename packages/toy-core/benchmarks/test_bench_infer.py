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

GPT-2 (``test_inference_gpt2``): the same machinery and figures on
GPT-2-small's shape (124M parameters, 12 layers, d 768, vocabulary 50257,
tied head) with seeded random weights, as F32 and Q8_0 files made by
llama.cpp's own converter (``convert_hf_to_gguf.py`` from a Hugging Face
``GPT2LMHeadModel``: ``tests/gpt2_ref.py``'s ``gguf_path("small124m", 0,
...)``, cached under ``$TOY_TEST_GPT2_CACHE`` or ``~/.cache/toy-test-gpt2``;
the first run builds them, minutes). The prompts are the same text
tokenized by toy's tokenizer from the GPT-2 file, cut to 128 and 512 tokens
(16 for the decode prompt); decode is ``GPT2_NEW_TOKENS`` (64) greedy tokens
(63 forward steps). Figure names end in ``gpt2-124m <dtype>``, and the
tokens/s records carry the issue's target toy / llama.cpp >= 1.0 and
``met``. With random weights the greedy tokens are arbitrary but
deterministic: ``same_greedy_tokens`` still tells whether both sides
compute the same model.
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
# GPT-2-small (124M) as converted by llama.cpp from a seeded random HF model (tests/gpt2_ref.py)
GPT2_SHAPE = "small124m"
GPT2_DTYPES = {"F32": "f32", "Q8_0": "q8_0"}  # figure label -> the converter's --outtype
GPT2_NEW_TOKENS = 64
GPT2_TAG = "gpt2-124m"
GPT2_TARGET = 1.0  # the target: toy / llama.cpp >= 1.0 in tokens/s


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
    return write_prompt_ids(smollm2_path, tmp_path_factory.mktemp("bench_infer_prompts"))


def write_prompt_ids(model: Path, folder: Path) -> Path:
    """TEXT (repeated as needed) tokenized by toy's tokenizer of ``model``, cut
    to the prompt lengths, written as ``folder/ids.json``."""
    from toy.tokenizer import Tokenizer

    tok = Tokenizer.from_file(model)
    need = max(PROMPT_LENGTHS)
    text = TEXT
    ids = tok.encode(text)
    while len(ids) < need:
        text += TEXT
        ids = tok.encode(text)
    spec = {"prompts": {str(n): ids[:n] for n in PROMPT_LENGTHS}, "short": ids[:SHORT_PROMPT]}
    path = folder / "ids.json"
    path.write_text(json.dumps(spec))
    return path


def _gpt2_ref():
    """tests/gpt2_ref.py as a module (the root conftest.py does not register it)."""
    import importlib.util

    name = "gpt2_ref"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, HERE.parent / "tests" / "gpt2_ref.py")
        mod = importlib.util.module_from_spec(spec)
        sys.modules[name] = mod
        spec.loader.exec_module(mod)
    return sys.modules[name]


@pytest.fixture(scope="module")
def gpt2_models() -> dict[str, Path]:
    """GPT-2-small (124M, seed 0) as F32 and Q8_0 GGUF files made by llama.cpp's converter."""
    ref = _gpt2_ref()
    return {dtype: Path(ref.gguf_path(GPT2_SHAPE, 0, outtype)) for dtype, outtype in GPT2_DTYPES.items()}


@pytest.fixture(scope="module")
def gpt2_prompt_ids(gpt2_models, tmp_path_factory) -> Path:
    """The prompts as token ids of toy's tokenizer from the GPT-2 file."""
    return write_prompt_ids(gpt2_models["F32"], tmp_path_factory.mktemp("bench_infer_gpt2_prompts"))


def run_sides(model: Path, ids: Path, peer: str | None, logdir: Path, new_tokens: int = NEW_TOKENS) -> dict:
    """Start toy (then llama.cpp), wait for both to warm up, alternate the reps."""
    args = ["--model", str(model), "--ids", str(ids), "--threads", str(THREADS), "--n-ctx", str(N_CTX)]
    args += ["--new-tokens", str(new_tokens)]
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
    report(record, bench_models[dtype], prompt_ids, tmp_path, dtype)


@pytest.mark.parametrize("dtype", list(GPT2_DTYPES))
def test_inference_gpt2(record, gpt2_models, gpt2_prompt_ids, tmp_path, dtype):
    report(
        record,
        gpt2_models[dtype],
        gpt2_prompt_ids,
        tmp_path,
        dtype,
        tag=f"{GPT2_TAG} {dtype}",
        new_tokens=GPT2_NEW_TOKENS,
        target=GPT2_TARGET,
        arch="gpt2",
        shape=f"{GPT2_SHAPE} (GPT-2-small: 12 layers, d 768, 12 heads, vocabulary 50257, tied head)",
        weights="seeded random (tests/gpt2_ref.py, seed 0), converted by llama.cpp's convert_hf_to_gguf.py",
    )


def report(
    record,
    model: Path,
    ids: Path,
    tmp_path: Path,
    dtype: str,
    *,
    tag: str | None = None,
    new_tokens: int = NEW_TOKENS,
    target: float | None = None,
    **model_context,
) -> None:
    """Run both sides on ``model`` and print the records; figure names end in
    ``tag`` (default: the dtype). ``target``: a toy / llama.cpp tokens/s
    target the prefill and decode records carry with ``met``."""
    tag = tag or dtype
    python = peer_python()
    res = run_sides(model, ids, python, tmp_path, new_tokens)
    toy_ready, toy_done = res["toy_ready"], res["toy_done"]
    tf = figures(res["reps"]["toy"])
    pf = figures(res["reps"]["peer"]) if python is not None else None
    peer_name = res["peer_ready"]["peer"] if python is not None else "llama.cpp"
    assert toy_done["graph_builds_in_reps"] == 0, "toy built graphs during the timed reps (warm-up missed a shape)"

    context = {
        "model": model.name,
        **model_context,
        "dtype": dtype,
        "threads": THREADS,
        "n_ctx": N_CTX,
        "reps": REPS,
        "loadavg_1m": [res["loadavg_before"], res["loadavg_after"]],
        "cpus": os.cpu_count(),
    }

    def pair(figure: str, key: str, unit: str, better: str, *, targeted: bool = False, **extra):
        toy_v = med(tf[key])
        peer_v = med(pf[key]) if pf is not None else None
        if targeted and target is not None:
            extra["target"] = f"toy / llama.cpp >= {target}"
            extra["met"] = toy_v / peer_v >= target if peer_v else None
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
        pair(f"prefill {n} tokens, {tag}", f"prefill_{n}", "tokens/s", "higher", targeted=True, prompt_tokens=n)
    pair(
        f"time to first token, 128-token prompt, {tag}",
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
        f"decode tokens/s, forward steps only, {tag}",
        "decode",
        "tokens/s",
        "higher",
        targeted=True,
        prompt_tokens=SHORT_PROMPT,
        new_tokens=new_tokens,
        steps=new_tokens - 1,
        same_greedy_tokens=same,
    )
    pair(
        f"decode tokens/s, whole generate loop, {tag}",
        "decode_loop",
        "tokens/s",
        "higher",
        prompt_tokens=SHORT_PROMPT,
        new_tokens=new_tokens,
    )

    # where toy's decode step goes (toy only: the peer has no equivalent split)
    compute, engine, loop = med(tf["compute_ms"]), med(tf["engine_extra_ms"]), med(tf["loop_extra_ms"])
    total = compute + engine + loop
    record(
        "infer",
        figure=f"toy decode time per token, split, {tag}",
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
        figure=f"peak RSS, {tag}",
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
            figure=f"llama.cpp peer, {tag}",
            value=None,
            unit="",
            peer_available=False,
            note="llama_cpp is not importable here; set TOY_BENCH_LLAMA_PYTHON to a Python with llama-cpp-python",
        )
