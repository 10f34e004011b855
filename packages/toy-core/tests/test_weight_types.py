"""Every weight type the issue names runs in place through the engine.

A tiny seeded llama model (row lengths multiples of 256, so K-quants apply
to every matrix) is converted with ``toy quantize``'s ``quantize_model`` to
each type; the engine's logits are compared with the NumPy float64
reference run on the file's own dequantized weights (``tensor_to_float``,
an independent decode of the blocks). The remaining error is ggml's
activation rounding inside the products (src1 is converted to F16, BF16 or
an 8-bit type per row, depending on the weight type), so the tolerance is a
relative L2 error, stated per family below. Also checked: the bound weights
keep the file's type (nothing is dequantized) and, on the CPU, are views of
the read-only file mapping.
"""

from __future__ import annotations

import numpy as np
import pytest

from toy.engine.llm import LLMEngine
from toy.gguf import GGUFFile
from toy.gguf.convert import parse_target, quantize_model
from toy_testsupport import toy_test_models as mp
from toy_testsupport.reference import llama_np
from toy_testsupport.reference.full import FullModel

# relative L2 error of the logits against the float64 reference on the
# dequantized weights: F32 is float rounding only; F16/BF16 products round
# activations to 16 bits (BF16 keeps 8 mantissa bits); the quantized types
# round activations to 8-bit blocks (Q8_0/Q8_1, 32 values per scale; Q8_K
# for K-quants, 256 per scale). Measured on this model: 2.9e-2 .. 3.5e-2 for
# the 32-blocks, 3.8e-2 .. 4.7e-2 for K-quants, the same for Q8_0 and Q4_0
# weights (the activation rounding dominates, not the weight type); a wrong
# block decode or layout gives errors of order 1 (reversing one 256-value
# block of one matrix in the reference: 1.14).
Q = 6e-2
TOLERANCE = {
    "F32": 1e-5,
    "F16": 2e-3,
    "BF16": 2e-2,
    "Q8_0": Q,
    "Q4_0": Q,
    "Q4_1": Q,
    "Q5_0": Q,
    "Q5_1": Q,
    "Q4_K": Q,
    "Q5_K": Q,
    "Q6_K": Q,
}


@pytest.fixture(scope="module")
def tiny_f32(tmp_path_factory):
    path = tmp_path_factory.mktemp("wt") / "tiny-f32.gguf"
    return mp.write_tiny_model(path, n_layer=2, d=256, n_head=4, n_head_kv=2, d_ff=512, vocab=96, tied=False, seed=7)


def rel_l2(a, b):
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


@pytest.mark.parametrize("type_name", list(TOLERANCE))
def test_weight_type_runs_in_place(tmp_path, rt, tiny_f32, type_name):
    path = tiny_f32
    if type_name != "F32":
        path = tmp_path / f"tiny-{type_name}.gguf"
        quantize_model(tiny_f32, path, parse_target(type_name))
    ids = np.random.default_rng(3).integers(0, 96, size=12)
    with FullModel.load(path, rt) as model, GGUFFile(path) as gf:
        want = parse_target(type_name)
        w = model.weights["blk.0.ffn_down.weight"]
        assert w.dtype == want, f"bound as {w.dtype.name}, file has {type_name}"
        assert w.readonly, "CPU weights are views of the read-only file mapping"
        ref = llama_np.forward_logits(model.cfg, llama_np.load_weights(gf), ids)
        eng = LLMEngine(model.cfg, model.weights, rt, n_ctx=32, kv_type="f32")
        try:
            got = np.concatenate([eng.prefill(0, ids[:5], all_logits=True), eng.decode([0], [ids[5]])])
            for t in ids[6:]:
                got = np.concatenate([got, eng.decode([0], [t])])
        finally:
            eng.close()
    err = rel_l2(got, ref)
    assert err < TOLERANCE[type_name], f"{type_name}: relative L2 error {err:.2e}"
