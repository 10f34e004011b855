"""Training on the device against the CPU: the recipes' loss curves, and two device runs identical.

Each recipe runs 8 steps of 2 rows x 32 tokens (``toy.train.lmrun.train``, the function behind
``toy train``; evaluation at steps 4 and 8, samples of 4 tokens, one checkpoint at the end) on the CPU
and twice on the device under test, from the same seed:

- ``from-scratch``: the tiny llama preset (4 blocks of width 128) with a 300-token BPE, on a corpus of
  random words;
- ``lora``: rank 4 on q, v and down, over an F32 base (a from-scratch checkpoint made here on the CPU),
  on prompt/completion JSONL;
- ``qlora``: the same over a Q4_1 copy of that base (the base stays quantized; LoRA on top);
- ``full``: every weight of the F32 base.

Asserted: the two device runs give the same loss at every step and the same checkpoint tensors, bit for
bit (run-to-run determinism on one device, which toy promises on the CPU and on CUDA); every step's loss
within ``RTOL`` (relative) of the CPU's. The bound comes from the spread between two CPU builds of the
same runs (toy's AVX2 kernels against its AVX-512 ones): at most 2e-7 relative on the F32 recipes and
1.6e-4 on QLoRA (quantized products quantize their activations, which amplifies rounding differences).
Allowed: 2e-3 for the F32 recipes (the device's reductions and cuBLAS products sum in another order
from the first step on, and eight AdamW steps carry that on) and 1e-2 for QLoRA; a wrong gradient or
update moves the loss by more than that within a step or two. The largest relative difference is
reported.

No CPU fallback: one step of the tiny preset's ``TrainEngine`` (forward, loss, backward, clipping and
AdamW in one graph) on the device runs in one scheduler split (``Runtime.n_splits()``); so does every
step graph of a QLoRA run (the Q4_1 base: the input gradient through the frozen quantized weight) and
of a MoE full fine-tune (qwen2moe-tiny: the experts' and the routing weights' gradients), whose standard
backward forms are toy patch 0025's (docs/reference/cuda-fallbacks.md).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

import toy_ggml
from toy.gguf import quantize_model
from toy.train.config import defaults, override
from toy.train.lmrun import train
from toy_testsupport.gpu import checkpoint_tensors, max_rel_diff
from toy_testsupport.train_helpers import RECIPE_WORDS as WORDS
from toy_testsupport.train_helpers import recipe_config, step_losses

pytestmark = pytest.mark.gpu

STEPS = 8
CONTEXT = 32
RTOL = {"from-scratch": 2e-3, "lora": 2e-3, "qlora": 1e-2, "full": 2e-3}
THREADS = 2


@pytest.fixture(scope="module")
def bases(tmp_path_factory):
    """A corpus of random words, a tiny F32 base trained from it on the CPU, its Q4_1 copy, and JSONL data."""
    d = tmp_path_factory.mktemp("gpu-train")
    rng = np.random.default_rng(0)
    (d / "corpus.txt").write_text("\n".join(" ".join(rng.choice(WORDS, size=12)) + "." for _ in range(400)))
    res = train(_scratch_config(d / "corpus.txt", d / "base-runs", "cpu"))
    q4 = d / "base-q4_1.gguf"
    quantize_model(res.checkpoint, q4, "q4_1")
    rows = []
    for _ in range(60):
        a, b = rng.choice(WORDS, size=2)
        rows.append({"prompt": f"say {a} twice:", "completion": f" {a} {a}."})
    (d / "data.jsonl").write_text("\n".join(json.dumps(x) for x in rows) + "\n")
    return {"corpus": d / "corpus.txt", "f32": res.checkpoint, "q4_1": q4, "data": d / "data.jsonl"}


def _scratch_config(corpus: Path, out: Path, device: str, steps: int = 4):
    return override(
        defaults(),
        **{"data.paths": [str(corpus)], "tokenizer.vocab_size": 300, "steps": steps, "batch_size": 2,
           "context": CONTEXT, "eval_every": 4, "eval_batches": 2, "save_every": 0, "sample_tokens": 4,
           "out": str(out), "threads": THREADS, "device": device},
    )  # fmt: skip


def _config(recipe: str, bases, out: Path, device: str):
    if recipe == "from-scratch":
        return _scratch_config(bases["corpus"], out, device, STEPS)
    kind, base = ("lora", bases["q4_1"]) if recipe == "qlora" else (recipe, bases["f32"])
    extra = {"lora.targets": ["q", "v", "down"], "lora.rank": 4} if kind == "lora" else {}
    return recipe_config(
        kind, base, bases["data"], out, STEPS, CONTEXT,
        eval_every=4, eval_batches=2, save_every=0, sample_tokens=4, threads=THREADS, device=device, **extra,
    )  # fmt: skip


@pytest.mark.parametrize("recipe", list(RTOL))
def test_training_curve_is_close_to_the_cpu_and_deterministic(bases, recipe, gpu_device, report, tmp_path):
    runs = {}
    for name, device in (("cpu", "cpu"), ("device", gpu_device.name), ("device-again", gpu_device.name)):
        res = train(_config(recipe, bases, tmp_path / name, device))
        assert res.final_step == STEPS
        runs[name] = (step_losses(res.run_dir), checkpoint_tensors(res.checkpoint))
    (want, _), (got, got_w), (again, again_w) = runs["cpu"], runs["device"], runs["device-again"]
    assert sorted(got) == list(range(1, STEPS + 1))
    assert got == again, f"{recipe}: two runs on {gpu_device.label} gave different losses: {got} / {again}"
    assert got_w.keys() == again_w.keys()
    for k in got_w:
        assert got_w[k].tobytes() == again_w[k].tobytes(), f"{recipe}: {k} differs between two device runs"
    rel = max_rel_diff(got, want)
    report(f"train {recipe}: max relative loss difference to the cpu", rel, "ratio", tolerance=RTOL[recipe],
           steps=STEPS, device_losses=[got[k] for k in sorted(got)], cpu_losses=[want[k] for k in sorted(want)])  # fmt: skip
    assert rel <= RTOL[recipe], f"{recipe}: device losses {got} against the cpu's {want}"
    if gpu_device.is_cpu:
        assert got == want
    assert got[STEPS] < got[1]  # it trains


def test_a_training_step_runs_in_one_split(gpu_device, report):
    from toy.train.config import ModelShape
    from toy.train.model import ArchTrain, init_params, model_config
    from toy.train.optim import OptimConfig
    from toy.train.stepgraph import TrainEngine
    from toy_testsupport.bench_models import RandomTokenBatch

    cfg = model_config(ModelShape(preset="tiny"), 512, CONTEXT)
    runtime = toy_ggml.Runtime(gpu_device.name, threads=THREADS)
    try:
        engine = TrainEngine(
            ArchTrain(cfg), init_params(cfg, 0), runtime, OptimConfig(lr=1e-3), batch=2, context=CONTEXT
        )
        try:
            engine.train_step([RandomTokenBatch(0, 512, 2, CONTEXT)], 1e-3)
            n = runtime.n_splits()
        finally:
            engine.close()
    finally:
        runtime.close()
    report("graph splits of a training step", n, "splits")
    assert n == 1, f"a training step on {gpu_device.label} ran in {n} splits: some nodes fell back to the CPU"


@pytest.mark.parametrize("recipe", ["qlora", "moe-full"])
def test_qlora_and_moe_steps_run_in_one_split(bases, recipe, gpu_device, report, tmp_path, monkeypatch):
    from toy_testsupport import moe_ref

    splits: list[int] = []
    base_runtime = toy_ggml.Runtime

    class _Splits(base_runtime):  # type: ignore[misc, valid-type]
        def compute(self, graph, profile=False):
            out = super().compute(graph, profile)
            if any(t.op.startswith("OPT_STEP_ADAMW") for t in graph.nodes):  # a step graph
                splits.append(self.n_splits())
            return out

    monkeypatch.setattr(toy_ggml, "Runtime", _Splits)
    if recipe == "qlora":
        cfg = _config("qlora", bases, tmp_path / "run", gpu_device.name)
    else:
        cfg = recipe_config(
            "full", moe_ref.gguf_path("qwen2moe-tiny", 0, "f32"), bases["data"], tmp_path / "run", 2, CONTEXT,
            eval_every=0, save_every=0, sample_tokens=0, threads=THREADS, device=gpu_device.name,
        )  # fmt: skip
    train(cfg)
    assert splits, "no step graph was computed"
    report(f"graph splits of a {recipe} step", max(splits), "splits", steps=len(splits))
    assert max(splits) == 1, f"{recipe} steps on {gpu_device.label} ran in {splits} splits: nodes fell back to the CPU"
