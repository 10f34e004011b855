"""Files the guides name and do not make themselves, for the docs test's ``setup:`` steps.

``python tests/docs/fixtures.py story-lora OUT`` writes the seeded random rank-8 adapter of
toy's llama.cpp LoRA parity test (``packages/toy-core/tests/fixtures/lora_llamacpp.json``'s
recipe) for SmolLM2; ``tiny OUT`` writes a tiny random llama GGUF (d_model 64, two layers).
Both come from the test-support package (``toy_testsupport``, installed in the docs test's venv).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TESTS = ROOT / "packages/toy-core/tests"


def main(kind: str, out: str) -> None:
    if kind == "story-lora":
        from toy.store import fetch_default
        from toy_testsupport.train_helpers import seeded_adapter

        recipe = json.loads((TESTS / "fixtures/lora_llamacpp.json").read_text())["adapter"]["recipe"]
        seeded_adapter(fetch_default(), out, base_name="SmolLM2-135M-Instruct.Q4_1.gguf", **recipe)
    elif kind == "tiny":
        from toy_testsupport.toy_test_models import write_tiny_model

        write_tiny_model(out, extra_metadata={"tokenizer.ggml.merges": []})
    else:
        raise SystemExit(f"unknown fixture {kind!r}")


if __name__ == "__main__":
    main(*sys.argv[1:])
