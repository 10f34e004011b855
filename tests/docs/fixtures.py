"""Files the guides name and do not make themselves, for the docs test's ``setup:`` steps.

``python tests/docs/fixtures.py story-lora OUT`` writes the seeded random rank-8 adapter of
toy's llama.cpp LoRA parity test (``packages/toy-core/tests/fixtures/lora_llamacpp.json``'s
recipe) for SmolLM2; ``tiny OUT`` writes a tiny random llama GGUF (d_model 64, two layers).
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TESTS = ROOT / "packages/toy-core/tests"


def _load(name: str, rel: str):
    spec = importlib.util.spec_from_file_location(name, TESTS / rel)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


def main(kind: str, out: str) -> None:
    if kind == "story-lora":
        from toy.store import fetch_default

        recipe = json.loads((TESTS / "fixtures/lora_llamacpp.json").read_text())["adapter"]["recipe"]
        helpers = _load("train_helpers", "train_helpers.py")
        helpers.seeded_adapter(fetch_default(), out, base_name="SmolLM2-135M-Instruct.Q4_1.gguf", **recipe)
    elif kind == "tiny":
        _load("toy_test_models", "model_path.py").write_tiny_model(out, extra_metadata={"tokenizer.ggml.merges": []})
    else:
        raise SystemExit(f"unknown fixture {kind!r}")


if __name__ == "__main__":
    main(*sys.argv[1:])
