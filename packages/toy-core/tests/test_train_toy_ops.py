"""A training step built without toy's own ops (``Runtime.toy_ops`` False, as on a GPU: the step's gradient norm
and AdamW are the standard ops ``sum(sqr(g))`` and ``opt_step_adamw(mul(g, factor))`` instead of patch 0017's
SUM_SQR and OPT_STEP_ADAMW_SCALED) gives the run of the toy ops bit for bit on the CPU: the same step losses and
gradient norms, the same checkpoint. Reference: the same run with the toy ops, in this process (patch 0017 defines
its ops as those standard ops computed in one pass; toy-ggml's test_toy_ops_switch.py checks both against NumPy).

The backward is standard too (patch 0025; toy-ggml's test_standard_backward.py checks each form against NumPy):
a MoE full fine-tune without OUT_PROD_ID and the 3-D GET_ROWS_BACK gives the same bits (the standard forms add
exact zeros to the same terms in the same order); a QLoRA run on a Q8_0 MoE file (frozen quantized attention and
experts) without patch 0018's transposed quantized product gives the same losses within float32 rounding (its
input gradient may sum the same products in another order; on this file they came out equal).
"""

from __future__ import annotations

import numpy as np

import toy_ggml
from toy.gguf import GGUFFile
from toy.train.config import defaults, override
from toy.train.lmrun import train
from toy_testsupport import moe_ref
from toy_testsupport import train_helpers as th
from toy_testsupport.train_helpers import TINY_SCRATCH, events

WORDS = ("alpha", "beta", "gamma", "delta", "river", "stone", "cloud", "maple")


class _NoToyOps(toy_ggml.Runtime):
    """A CPU runtime that answers toy_ops as a GPU's does."""

    @property
    def toy_ops(self) -> bool:
        return False


def _run(tmp_path, name: str):
    rng = np.random.default_rng(0)
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n".join(" ".join(rng.choice(WORDS, size=10)) + "." for _ in range(200)))
    values = {**TINY_SCRATCH, "data.paths": [str(corpus)], "steps": 3, "optim.grad_clip": 0.5}
    res = train(override(defaults(), **values, out=str(tmp_path / name)))
    steps = [(e["step"], e["loss"], e.get("grad_norm")) for e in events(res.run_dir) if e["kind"] == "step"]
    gf = GGUFFile(res.checkpoint)
    return steps, {name: bytes(gf.tensor_bytes(name)) for name in gf.tensors}


def test_a_step_without_toy_ops_gives_the_same_bits(tmp_path, monkeypatch):
    want_steps, want = _run(tmp_path, "toy")
    monkeypatch.setattr(toy_ggml, "Runtime", _NoToyOps)
    got_steps, got = _run(tmp_path, "std")
    assert len(want_steps) == 3 and all(s[2] is not None for s in want_steps)
    assert got_steps == want_steps
    assert got.keys() == want.keys()
    for k in want:
        assert got[k] == want[k], k


def test_the_step_graph_has_no_toy_ops_when_the_runtime_lacks_them(tmp_path, monkeypatch):
    seen: set[str] = set()

    class _Watch(_NoToyOps):
        def compute(self, graph, profile=False):
            seen.update(t.op for t in graph.nodes)
            return super().compute(graph, profile)

    monkeypatch.setattr(toy_ggml, "Runtime", _Watch)
    _run(tmp_path, "watch")
    assert "OPT_STEP_ADAMW" in seen and "SUM" in seen
    assert not seen & {"SUM_SQR", "OPT_STEP_ADAMW_SCALED"}


def _recipe(tmp_path, name: str, recipe: str, base, **kw):
    """Three steps of ``recipe`` on ``base``: (step records, checkpoint tensors' bytes, the ops computed)."""
    data = tmp_path / "data.jsonl"
    if not data.exists():
        th.write_examples(data, 16, ("text", "prompt_completion"))
    seen: set[tuple] = set()
    runtime = toy_ggml.Runtime

    class _Watch(runtime):  # type: ignore[misc, valid-type]
        def compute(self, graph, profile=False):
            for t in graph.nodes:
                src = t.sources[0] if t.sources else None
                seen.add(
                    (
                        t.op,
                        src.dtype.name if src is not None else None,
                        src.is_contiguous if src is not None else None,
                        tuple(t.ne),
                    )
                )
            return super().compute(graph, profile)

    toy_ggml.Runtime = _Watch
    try:
        res = train(th.recipe_config(recipe, base, data, tmp_path / name, 3, 32, eval_every=0, sample_tokens=0, **kw))
    finally:
        toy_ggml.Runtime = runtime
    steps = [(e["step"], e["loss"], e.get("grad_norm")) for e in events(res.run_dir) if e["kind"] == "step"]
    gf = GGUFFile(res.checkpoint)
    return steps, {n: bytes(gf.tensor_bytes(n)) for n in gf.tensors}, seen


def test_a_moe_full_fine_tune_without_toy_ops_gives_the_same_bits(tmp_path, monkeypatch):
    base = moe_ref.gguf_path("qwen2moe-tiny", 0, "f32")  # 8 experts, top 2
    want_steps, want, toy_seen = _recipe(tmp_path, "toy", "full", base)
    monkeypatch.setattr(toy_ggml, "Runtime", _NoToyOps)
    got_steps, got, std_seen = _recipe(tmp_path, "std", "full", base)

    def moe_grads(seen):  # the expert and the routing weights' gradients of patch 0016 (3-D GET_ROWS_BACK)
        return {op for op, _, _, ne in seen if op == "OUT_PROD_ID" or (op == "GET_ROWS_BACK" and ne[2] > 1)}

    assert moe_grads(toy_seen) == {"OUT_PROD_ID", "GET_ROWS_BACK"}
    assert not moe_grads(std_seen)
    assert not {x[0] for x in std_seen} & {"SUM_SQR", "OPT_STEP_ADAMW_SCALED"}
    assert len(want_steps) == 3
    assert got_steps == want_steps
    assert got.keys() == want.keys()
    for k in want:
        assert got[k] == want[k], k


def test_a_qlora_run_without_toy_ops_gives_the_same_losses_within_rounding(tmp_path, monkeypatch):
    base = moe_ref.gguf_path("qwen3moe-tiny", 0, "q8_0")  # attention and experts Q8_0, frozen
    kw = {"lora.targets": ["q", "k", "v", "o"], "lora.rank": 4, "optim.lr": 1e-2}
    want_steps, want, toy_seen = _recipe(tmp_path, "toy", "lora", base, **kw)
    monkeypatch.setattr(toy_ggml, "Runtime", _NoToyOps)
    got_steps, got, std_seen = _recipe(tmp_path, "std", "lora", base, **kw)

    def quant_t(seen):  # products reading a quantized operand transposed (toy's GEMM only)
        return {x for x in seen if x[0] in ("MUL_MAT", "OUT_PROD") and x[1] == "Q8_0" and x[2] is False}

    assert quant_t(toy_seen) and not quant_t(std_seen)
    assert [s[0] for s in got_steps] == [s[0] for s in want_steps] == [1, 2, 3]
    for (_, gl, gn), (_, wl, wn) in zip(got_steps, want_steps):
        assert abs(gl - wl) <= 1e-5 * abs(wl), (gl, wl)
        assert abs(gn - wn) <= 1e-4 * abs(wn), (gn, wn)
    assert got.keys() == want.keys()
    for k in want:
        a = np.frombuffer(got[k], np.float32)
        b = np.frombuffer(want[k], np.float32)
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-4 * float(np.abs(b).max()), err_msg=k)
