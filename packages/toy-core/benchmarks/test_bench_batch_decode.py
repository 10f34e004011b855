"""Batched decoding: what decoding 1, 2, 4 and 8 sequences at once costs per
step on toy's engine (as ``toy serve`` runs it: ``exact_batching``) and on
llama.cpp's own batched decoding (its C API, through llama-cpp-python), same
GGUF (SmolLM2-135M-Instruct Q4_1), same threads (``$TOY_BENCH_THREADS``, 2),
same prompts, in the same run.

This is the engine-level half of the serving benchmark's throughput target
(``packages/toy-serve/benchmarks``): aggregate tokens/s at 8 sequences over
1 sequence. It tells whether a batch of sequences is cheaper per token than
one sequence on this machine, for toy and for llama.cpp, without the server's
HTTP, sampling and prefill interleaving.

Each side runs in its own process (``bench_batch_toy.py`` next to this file,
``tools/fixtures/bench_batch_peer.py`` with the Python named by
``$TOY_BENCH_LLAMA_PYTHON``, else this interpreter when it can import
``llama_cpp``; without one the records hold toy's figures only). Both do an
untimed warm-up of every level, then ``$TOY_BENCH_BATCH_REPS`` (3) rounds
alternating toy and llama.cpp with a 0.5 s pause before each, each round
running every level with ``$TOY_BENCH_BATCH_STEPS`` (24) decode steps after
prefilling 64-token prompts (8 different windows of one English text, the
same token ids on both sides). Figures are medians over the rounds of each
round's median step.

Records per level: step time and aggregate tokens/s (S / step time) on both
sides, their ratio; the 64-token prefill of one sequence; then each side's
scaling (aggregate tokens/s at 8 sequences over 1) against the issue's 2.5x,
and whether sequence 0's greedy tokens are the same alone and in every batch
(asserted for toy: its batched decoding is exact; reported for llama.cpp).
"""

from __future__ import annotations

import json
import os
import statistics
import sys
from pathlib import Path

import pytest

from toy_testsupport.bench_side import TEXT, Side, alternate, peer_python

pytestmark = pytest.mark.bench

HERE = Path(__file__).resolve().parent
TOY_SCRIPT = HERE / "bench_batch_toy.py"
PEER_SCRIPT = HERE.parents[2] / "tools" / "fixtures" / "bench_batch_peer.py"

LEVELS = (1, 2, 4, 8)
PROMPT = 64
N_CTX = 256  # per sequence: 64 prompt + the steps
THREADS = int(os.environ.get("TOY_BENCH_THREADS", "2"))
REPS = int(os.environ.get("TOY_BENCH_BATCH_REPS", "3"))
STEPS = int(os.environ.get("TOY_BENCH_BATCH_STEPS", "24"))
SETTLE_S = 0.5
SIDE_TIMEOUT_S = 1800
TARGET_SCALING = 2.5  # the serving issue's target: 8 streams >= 2.5x one stream


def prompts_file(model: str, folder: Path) -> Path:
    """8 prompts of exactly 64 tokens: consecutive windows of TEXT (repeated as needed)."""
    from toy.tokenizer import Tokenizer

    tok = Tokenizer.from_file(model)
    need, text = PROMPT * max(LEVELS), TEXT
    ids = tok.encode(text)
    while len(ids) < need:
        text += TEXT
        ids = tok.encode(text)
    path = folder / "ids.json"
    path.write_text(json.dumps({"prompts": [ids[i * PROMPT : (i + 1) * PROMPT] for i in range(max(LEVELS))]}))
    return path


def test_batch_decode(record, smollm2_path, tmp_path):
    run_batch(record, Path(smollm2_path), tmp_path)


def test_batch_decode_moe(record, tmp_path):
    """The same on the OLMoE-shaped ~1B Q4_K_M model of test_bench_infer.py
    (issue 17: toy's 8-sequence decode against llama.cpp's batched decoding)."""
    from toy_testsupport.bench_models import moe_bench_model

    run_batch(record, moe_bench_model(), tmp_path, tag="olmoe-1b Q4_K_M")


def run_batch(record, model: Path, tmp_path: Path, tag: str | None = None) -> None:
    """Both sides on one model (the records' names end in ``tag`` when given)."""
    sfx = f", {tag}" if tag else ""
    ids = prompts_file(model, tmp_path)
    args = ["--model", str(model), "--ids", str(ids), "--threads", str(THREADS), "--n-ctx", str(N_CTX)]
    args += ["--levels", ",".join(map(str, LEVELS))]
    python = peer_python()
    sides: dict[str, Side] = {}
    out: dict = {}
    try:
        sides["toy"] = Side("toy", [sys.executable, str(TOY_SCRIPT), *args], tmp_path, timeout_s=SIDE_TIMEOUT_S)
        ready = {"toy": sides["toy"].read()}
        if python is not None:
            sides["peer"] = Side("peer", [python, str(PEER_SCRIPT), *args], tmp_path, timeout_s=SIDE_TIMEOUT_S)
            ready["peer"] = sides["peer"].read()
        alternate(sides, [STEPS] * REPS, SETTLE_S, out)
    finally:
        for side in sides.values():
            side.close()

    def med(side: str, S: int, key: str) -> float:
        return statistics.median(run[str(S)][key] for run in out["runs"][side])

    peer_name = ready["peer"]["side"] if python is not None else None
    context = {
        "model": Path(model).name,
        "threads": THREADS,
        "prompt_tokens": PROMPT,
        "steps": STEPS,
        "reps": REPS,
        "cpus": os.cpu_count(),
        "loadavg_1m": [out["loadavg_before"], out["loadavg_after"]],
        "peer": peer_name or "llama.cpp (unavailable)",
    }
    agg = {side: {S: S / med(side, S, "step_ms") * 1e3 for S in LEVELS} for side in sides}
    for S in LEVELS:
        toy_ms = med("toy", S, "step_ms")
        peer_ms = med("peer", S, "step_ms") if python is not None else None
        record(
            "batch_decode",
            figure=f"decode step, {S} sequences{sfx}",
            value=toy_ms,
            unit="ms",
            sequences=S,
            **context,
            peer_value=peer_ms,
            ratio=toy_ms / peer_ms if peer_ms else None,
            better="lower",
            toy_agg_tok_s=agg["toy"][S],
            peer_agg_tok_s=agg["peer"][S] if python is not None else None,
            toy_runs=[run[str(S)]["step_ms"] for run in out["runs"]["toy"]],
            peer_runs=[run[str(S)]["step_ms"] for run in out["runs"]["peer"]] if python is not None else None,
        )
    toy_pre = med("toy", 1, "prefill_ms")
    peer_pre = med("peer", 1, "prefill_ms") if python is not None else None
    record(
        "batch_decode",
        figure=f"prefill of one {PROMPT}-token prompt{sfx}",
        value=toy_pre,
        unit="ms",
        **context,
        peer_value=peer_pre,
        ratio=toy_pre / peer_pre if peer_pre else None,
        better="lower",
    )

    def same_alone(side: str) -> dict[int, bool]:
        runs = out["runs"][side]
        return {S: all(run[str(S)]["seq0_tokens"] == run["1"]["seq0_tokens"] for run in runs) for S in LEVELS}

    exact = {side: same_alone(side) for side in sides}
    for side in sides:
        scaling = agg[side][max(LEVELS)] / agg[side][1]
        record(
            "batch_decode",
            figure=f"{side} scaling: aggregate tokens/s at {max(LEVELS)} sequences / 1{sfx}",
            value=scaling,
            unit="x",
            **context,
            side=ready[side]["side"],
            target=f">= {TARGET_SCALING}",
            met=scaling >= TARGET_SCALING,
            agg_tok_s={str(S): agg[side][S] for S in LEVELS},
            seq0_same_alone_and_batched={str(S): v for S, v in exact[side].items()},
        )
    assert all(exact["toy"].values()), f"toy's batched decoding changed sequence 0's tokens: {exact['toy']}"
