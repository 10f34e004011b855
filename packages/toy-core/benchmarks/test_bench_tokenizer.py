"""Tokenizer throughput: toy's GGUF-built tokenizer encoding ~1 MB of text,
side by side with llama.cpp's tokenizer on the same text in the same run.

The text is every pydoc topic of the running Python, sorted, repeated and cut
to 1 000 000 characters (``bench_text``; the peer script
``tools/fixtures/bench_tokenizer_peer.py`` builds the identical text and both
report its SHA-256). llama.cpp is measured by running that script with a Python
that has ``llama-cpp-python``: ``$TOY_BENCH_LLAMA_PYTHON`` if set, else this
interpreter when it can import ``llama_cpp``; otherwise a record says the peer is
unavailable.

Figures: toy ``encode`` (one call, special tokens parsed, no BOS) in tokens/s
with the llama.cpp ratio, and toy ``encode_batch`` over the text's paragraphs
(parallel inside ``tokenizers``).
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import time
from pathlib import Path

import pytest

from toy.tokenizer import Tokenizer
from toy_testsupport.bench_side import peer_python

pytestmark = pytest.mark.bench

TEXT_CHARS = 1_000_000
PEER_SCRIPT = Path(__file__).resolve().parents[3] / "tools" / "fixtures" / "bench_tokenizer_peer.py"


def bench_text() -> str:
    """Kept identical to ``bench_text`` in the peer script (checked by SHA-256)."""
    from pydoc_data.topics import topics

    base = "\n\n".join(topics[k] for k in sorted(topics))
    return (base * (TEXT_CHARS // len(base) + 1))[:TEXT_CHARS]


def best_of(fn, repeat: int = 5) -> tuple[float, object]:
    out = fn()  # warm-up (builds the plain-text copy, fills caches)
    best = None
    for _ in range(repeat):
        t0 = time.perf_counter()
        out = fn()
        dt = time.perf_counter() - t0
        best = dt if best is None else min(best, dt)
    return best, out


def run_peer(python: str, model: Path) -> dict:
    out = subprocess.run([python, str(PEER_SCRIPT), "--model", str(model)], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    return json.loads(next(line for line in out.stdout.splitlines() if line.startswith("{")))


def test_encode_throughput(record, smollm2_path):
    tok = Tokenizer.from_file(smollm2_path)
    text = bench_text()
    sha = hashlib.sha256(text.encode("utf-8")).hexdigest()
    dt, ids = best_of(lambda: tok.encode(text))
    toy_tps = len(ids) / dt

    python = peer_python()
    context = {"text_chars": len(text), "text_sha256": sha, "tokens": len(ids), "tokenizer": "SmolLM2 (gpt2/smollm)"}
    if python is None:
        record(
            "tokenizer",
            figure="toy encode, 1 MB text",
            value=toy_tps,
            unit="tokens/s",
            **context,
            peer="llama.cpp",
            peer_value=None,
            ratio=None,
        )
        record(
            "tokenizer",
            figure="llama.cpp peer",
            value=None,
            unit="tokens/s",
            peer_available=False,
            note="llama_cpp is not importable here; set TOY_BENCH_LLAMA_PYTHON to a Python with llama-cpp-python",
        )
    else:
        peer = run_peer(python, smollm2_path)
        assert peer["text_sha256"] == sha, "the peer tokenized a different text"
        assert peer["tokens"] == len(ids), "toy and llama.cpp disagree on the token count"
        record(
            "tokenizer",
            figure="toy encode, 1 MB text",
            value=toy_tps,
            unit="tokens/s",
            **context,
            peer=peer["peer"],
            peer_value=peer["tokens_per_s"],
            ratio=toy_tps / peer["tokens_per_s"],
        )

    paragraphs = text.split("\n\n")
    dt_b, batches = best_of(lambda: tok.encode_batch(paragraphs))
    n_b = sum(map(len, batches))
    record(
        "tokenizer",
        figure="toy encode_batch, 1 MB text in paragraphs",
        value=n_b / dt_b,
        unit="tokens/s",
        paragraphs=len(paragraphs),
        tokens=n_b,
        threads=os.cpu_count(),
        ratio_to_single_call=(n_b / dt_b) / toy_tps,
    )
