"""LoRA training (``toy.train.lora``) against an independent reference.

Reference for the gradients: ``torch_llama`` (PyTorch float64 autograd) on
the *effective* weights W + s·B·A, then the chain rule by hand:
dL/dA = s · Bᵀ · dL/dW_eff and dL/dB = s · dL/dW_eff · Aᵀ. So the reference
never runs toy's LoRA code path. Tolerances as test_train_engine.py.

Other properties: B = 0 at initialization makes the step-0 logits the base
model's (exactly); a LoRA step never writes into the (read-only, memory-
mapped) base; masked targets change nothing; dropout masks are seeded.
"""

from __future__ import annotations

import hashlib

import numpy as np
import pytest

from toy.errors import BadInputError
from toy.models.llama import LlamaConfig
from toy.train.lora import LoraSettings, LoraTrain, init_lora
from toy.train.model import ArchTrain
from toy.train.optim import OptimConfig
from toy.train.stepgraph import TrainEngine
from toy_testsupport import torch_llama
from toy_testsupport.reference.llama_np import load_weights
from toy_testsupport.tiny_llama import VARIANTS, write_tiny
from toy_testsupport.train_helpers import BoundModel as Base
from toy_testsupport.train_helpers import assert_grads_close, lora_reference, packed_batch


@pytest.fixture
def base(tmp_path, rt):
    b = Base(write_tiny(tmp_path / "base.gguf", **VARIANTS["gqa_untied"]), rt, LlamaConfig.from_gguf)
    yield b
    b.close()


def random_lora(model: LoraTrain, seed: int) -> dict[str, np.ndarray]:
    """A and B both non-zero (with B = 0 the gradient of A vanishes)."""
    rng = np.random.default_rng(seed)
    return {n: (rng.standard_normal(s) * 0.2).astype(np.float32) for n, s in model.shapes.items()}


def reference(base: Base, model: LoraTrain, lora, batch):
    n = float(batch.loss_mask.sum())

    def dense(eff):
        return torch_llama.loss_and_grads(
            eff, base.cfg, batch.tokens, batch.pos, batch.doc, batch.targets, batch.loss_mask, n
        )

    return lora_reference(model, lora, base.w, dense)


@pytest.mark.parametrize(
    "settings",
    [
        LoraSettings(),  # q, k, v, o
        LoraSettings(targets=["q", "v", "gate", "up", "down"], rank=3, alpha=5.0, rslora=True),
    ],
    ids=["qkvo", "mlp_rslora"],
)
def test_lora_gradients_match_torch(base, rt, settings):
    model = LoraTrain(base.cfg, base.bound.tensors, settings)
    lora = random_lora(model, 3)
    batch = packed_batch(np.random.default_rng(2), base.cfg.n_vocab, 2, 12)
    eng = TrainEngine(model, lora, rt, OptimConfig(), batch=2, context=12)
    try:
        loss, grads = eng.gradients([batch])
    finally:
        eng.close()
    ref_loss, ref = reference(base, model, lora, batch)
    assert loss == pytest.approx(ref_loss, rel=1e-5)
    assert_grads_close(grads, ref)
    assert len(grads) == 2 * len(model.settings.targets) * base.cfg.n_layer


def test_init_is_a_no_op_and_steps_leave_the_base_untouched(base, rt):
    before = hashlib.sha256(base.path.read_bytes()).hexdigest()
    batch = packed_batch(np.random.default_rng(4), base.cfg.n_vocab, 2, 12)
    # the full model's logits for the batch (no LoRA)
    full = TrainEngine(ArchTrain(base.cfg), base.w, rt, OptimConfig(), batch=2, context=12)
    want = full.eval_nll(batch)
    full.close()
    model = LoraTrain(base.cfg, base.bound.tensors, LoraSettings())
    init = init_lora(model.shapes, seed=0)
    assert all(not v.any() for n, v in init.items() if n.endswith(".lora_b"))
    assert all(np.abs(v).max() > 0 for n, v in init.items() if n.endswith(".lora_a"))
    eng = TrainEngine(model, init, rt, OptimConfig(lr=1e-2), batch=2, context=12)
    try:
        assert eng.eval_nll(batch) == want  # B = 0: the base model, bit for bit
        for _ in range(3):
            eng.train_step([batch], 1e-2)
        after = eng.eval_nll(batch)
        values = eng.param_values()
    finally:
        eng.close()
    assert after[0] < want[0]  # it learns
    assert any(np.abs(v).max() > 0 for n, v in values.items() if n.endswith(".lora_b"))
    assert hashlib.sha256(base.path.read_bytes()).hexdigest() == before
    np.testing.assert_array_equal(load_weights(base.gf)["blk.0.attn_q.weight"], base.w["blk.0.attn_q.weight"])


def test_masked_targets_change_nothing(base, rt):
    model = LoraTrain(base.cfg, base.bound.tensors, LoraSettings())
    lora = random_lora(model, 5)
    batch = packed_batch(np.random.default_rng(6), base.cfg.n_vocab, 2, 12)
    other = packed_batch(np.random.default_rng(6), base.cfg.n_vocab, 2, 12)
    masked = other.loss_mask == 0
    other.targets[masked] = (other.targets[masked] + 7) % base.cfg.n_vocab  # different labels where masked
    eng = TrainEngine(model, lora, rt, OptimConfig(), batch=2, context=12)
    try:
        l1, g1 = eng.gradients([batch])
        l2, g2 = eng.gradients([other])
        kept = np.argwhere(batch.loss_mask > 0)[0]
        changed = packed_batch(np.random.default_rng(6), base.cfg.n_vocab, 2, 12)
        changed.targets[tuple(kept)] = (changed.targets[tuple(kept)] + 1) % base.cfg.n_vocab
        l3, _ = eng.gradients([changed])
    finally:
        eng.close()
    assert l1 == l2 and all(np.array_equal(g1[k], g2[k]) for k in g1)
    assert l3 != l1


def test_dropout_masks_are_seeded_and_off_in_eval(base, rt):
    settings = LoraSettings(dropout=0.3)
    batch = packed_batch(np.random.default_rng(8), base.cfg.n_vocab, 2, 12)

    def run(seed):
        model = LoraTrain(base.cfg, base.bound.tensors, settings, runtime=rt, batch=2, context=12, seed=seed)
        lora = random_lora(model, 9)
        eng = TrainEngine(model, lora, rt, OptimConfig(), batch=2, context=12)
        try:
            g = eng.gradients([batch])
            e = eng.eval_nll(batch)
        finally:
            eng.close()
            model.close()
        return g, e

    (la, ga), ea = run(1)
    (lb, gb), eb = run(1)
    (lc, _), ec = run(2)
    assert la == lb and all(np.array_equal(ga[k], gb[k]) for k in ga)  # same seed, same masks
    assert la != lc  # another seed, other masks
    assert ea == eb == ec  # evaluation runs without dropout
    # without dropout the eval figure is the same model's
    model = LoraTrain(base.cfg, base.bound.tensors, LoraSettings())
    eng = TrainEngine(model, random_lora(model, 9), rt, OptimConfig(), batch=2, context=12)
    try:
        assert eng.eval_nll(batch) == ea
    finally:
        eng.close()


def test_bad_settings():
    for kw, frag in [
        ({"targets": ["q", "x"]}, "'x' is not"),
        ({"targets": []}, "none given"),
        ({"targets": ["q", "q"]}, "repeats"),
        ({"rank": 0}, "rank"),
        ({"alpha": 0.0}, "alpha"),
        ({"dropout": 1.0}, "dropout"),
    ]:
        with pytest.raises(BadInputError, match=frag):
            LoraSettings(**kw).validate()
