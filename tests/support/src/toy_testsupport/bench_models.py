"""Models the benchmarks build once and cache (test-only): the reference
helpers (``gpt2_ref``, ``gemma_ref``, ``moe_ref``) by name, the
mixture-of-experts benchmark model that test_bench_infer.py and
test_bench_batch_decode.py share, and the seeded random token batches of
the training-step benchmarks (``RandomTokenBatch``)."""

from __future__ import annotations

import importlib
import json
import os
from pathlib import Path


class RandomTokenBatch:
    """A (batch, context) training batch of random token ids drawn from
    ``default_rng([0, step])``: every position a target, one document per
    row (the fields ``TrainEngine.train_step`` reads)."""

    def __init__(self, step: int, vocab: int, batch: int, context: int):
        import numpy as np

        rng = np.random.default_rng([0, step])
        ids = rng.integers(0, vocab, (batch, context + 1), dtype=np.int64)
        self.tokens = np.ascontiguousarray(ids[:, :-1], dtype=np.int32)
        self.targets = np.ascontiguousarray(ids[:, 1:], dtype=np.int32)
        self.loss_mask = np.ones((batch, context), np.float32)
        self.pos = np.tile(np.arange(context, dtype=np.int32), (batch, 1))
        self.doc = np.zeros((batch, context), np.int32)


def ref_module(name: str):
    """The reference helper ``toy_testsupport.<name>`` (gpt2_ref, gemma_ref, moe_ref)."""
    return importlib.import_module(f"toy_testsupport.{name}")


# an OLMoE-shaped model of about 1B parameters (moe_ref.py fields), seeded random weights
MOE_SHAPE = {
    "arch": "olmoe",
    "hidden_size": 1024,
    "num_hidden_layers": 16,
    "num_attention_heads": 16,
    "num_key_value_heads": 16,
    "intermediate_size": 256,  # the expert width
    "num_experts": 64,
    "num_experts_per_tok": 8,
    "max_position_embeddings": 4096,
}


def moe_bench_model() -> Path:
    """The OLMoE-shaped ~1B model (16 layers, d 1024, 64 experts of width 256,
    top-8: about 1B parameters) as a Q4_K_M GGUF: a seeded random HF model
    (moe_ref's scheme), llama.cpp's converter to F16, toy's quantizer; built
    once (minutes) and cached under $TOY_BENCH_MODEL_DIR or
    ~/.cache/toy-bench-moe."""
    import hashlib

    ref = ref_module("moe_ref")
    fields = {**ref.SHAPES["olmoe-k"], **MOE_SHAPE}
    key = hashlib.sha256(json.dumps([fields, ref.recipe("olmoe-k", 0, "f32")]).encode()).hexdigest()[:12]
    root = Path(os.environ.get("TOY_BENCH_MODEL_DIR") or Path.home() / ".cache" / "toy-bench-moe")
    folder = root / f"olmoe-1b-{key}"
    out = folder / f"olmoe-1b-q4_k_m-{ref._toy_quant_digest()}.gguf"  # rebuilt when toy's quantizer changes
    if out.is_file():
        return out
    hf = folder / "hf"
    if not (hf / "model.safetensors.index.json").is_file() and not (hf / "model.safetensors").is_file():
        stage = folder / ".hf-stage"
        ref.make_hf_moe(stage, seed=0, **fields)
        stage.rename(hf)
    f16 = folder / "olmoe-1b-f16.gguf"
    if not f16.is_file():
        tmp = f16.with_name(f".tmp-{f16.name}")
        ref.gpt2_ref.convert_to_gguf(hf, tmp, "f16", model_name="toy-bench-olmoe-1b")
        tmp.rename(f16)
    from toy.gguf import quantize_model

    tmp = out.with_name(f".tmp-{out.name}")
    quantize_model(f16, tmp, "Q4_K_M")
    tmp.rename(out)
    return out
