"""The training step engine against an independent PyTorch float64 reference.

Reference: ``torch_llama`` (toy_testsupport/torch_llama.py), written from the math
with torch autograd, ``torch.optim.AdamW`` and ``clip_grad_norm_``. Inputs
are tiny random llama-family models (``tiny_llama`` variants) and hand-made
batches with packed documents (block-causal attention, positions restarting
at each document) and masked targets.

Tolerances: toy computes in float32, the reference in float64. Gradients are
compared per tensor with ``|g - ref| <= 2e-4 * max|ref| + 1e-6`` (float32
rounding through a few layers: measured errors are ~1e-6 relative); AdamW
steps compare parameters after the update within 5e-5 absolute: the update
itself is ~lr = 1e-2, so a wrong bias correction, decay group or clip factor
is off by ~1e-3 or more, while Adam's division by sqrt(v) makes an element
with a tiny gradient sensitive to its float32 rounding (measured up to
~1.1e-5 when clipping scales the gradients by ~1/50).
"""

from __future__ import annotations

import numpy as np
import pytest

from toy.gguf import GGUFFile
from toy.models.llama import LlamaConfig
from toy.train.model import ArchTrain, init_params
from toy.train.optim import OptimConfig
from toy.train.stepgraph import TrainEngine, profile_summary
from toy_testsupport import torch_llama
from toy_testsupport.reference.llama_np import load_weights
from toy_testsupport.tiny_llama import VARIANTS, write_tiny
from toy_testsupport.train_helpers import Batch, assert_grads_close, packed_batch

GRAD_VARIANTS = ["gqa_untied", "mha_tied", "gqa_4to1", "qwen2_bias_neox", "qwen3_qknorm_neox", "partial_rope_normal"]


def load_tiny(tmp_path, variant: str):
    path = write_tiny(tmp_path / f"{variant}.gguf", **VARIANTS[variant])
    with GGUFFile(path) as gf:
        cfg = LlamaConfig.from_gguf(gf)
        w = {k: v.astype(np.float32) for k, v in load_weights(gf).items()}
    # the engine trains exactly the tensors of param_shapes
    return cfg, w


@pytest.mark.parametrize("variant", GRAD_VARIANTS)
def test_gradients_match_torch_with_packing(tmp_path, rt, variant):
    cfg, w = load_tiny(tmp_path, variant)
    rng = np.random.default_rng(1)
    b = packed_batch(rng, cfg.n_vocab, 2, 12)
    eng = TrainEngine(ArchTrain(cfg), w, rt, OptimConfig(), batch=2, context=12)
    loss, grads = eng.gradients([b])
    n = float(b.loss_mask.sum())
    ref_loss, ref = torch_llama.loss_and_grads(w, cfg, b.tokens, b.pos, b.doc, b.targets, b.loss_mask, n)
    assert loss == pytest.approx(ref_loss, rel=1e-5)
    assert_grads_close(grads, ref)
    # every parameter of the model is trained
    assert set(grads) == {s.name for s in eng.specs}
    eng.close()


def test_gradients_with_accumulation_equal_one_big_batch(tmp_path, rt):
    """Two micro-batches normalized by their total target count give the
    gradient of the 4-row batch (the mean over all targets, not a mean of
    micro-batch means: the two halves have different target counts)."""
    cfg, w = load_tiny(tmp_path, "gqa_untied")
    rng = np.random.default_rng(2)
    b1 = packed_batch(rng, cfg.n_vocab, 2, 10)
    b2 = packed_batch(rng, cfg.n_vocab, 2, 10)
    b2.loss_mask[:, :4] = 0.0  # fewer targets in the second half
    eng = TrainEngine(ArchTrain(cfg), w, rt, OptimConfig(), batch=2, context=10, accum=2)
    loss, grads = eng.gradients([b1, b2])
    cat = Batch(
        *(np.concatenate([getattr(b1, f), getattr(b2, f)]) for f in ("tokens", "targets", "loss_mask", "pos", "doc"))
    )
    n = float(cat.loss_mask.sum())
    ref_loss, ref = torch_llama.loss_and_grads(w, cfg, cat.tokens, cat.pos, cat.doc, cat.targets, cat.loss_mask, n)
    assert loss == pytest.approx(ref_loss, rel=1e-5)
    assert_grads_close(grads, ref)
    eng.close()


def test_masked_targets_change_nothing(tmp_path, rt):
    """A target whose loss_mask is 0 does not enter the loss or any gradient."""
    cfg, w = load_tiny(tmp_path, "mha_tied")
    rng = np.random.default_rng(3)
    b = packed_batch(rng, cfg.n_vocab, 2, 12)
    eng = TrainEngine(ArchTrain(cfg), w, rt, OptimConfig(), batch=2, context=12)
    loss1, g1 = eng.gradients([b])
    b.targets = np.where(b.loss_mask > 0, b.targets, (b.targets + 7) % cfg.n_vocab).astype(np.int32)
    loss2, g2 = eng.gradients([b])
    assert loss1 == loss2
    for k in g1:
        np.testing.assert_array_equal(g1[k], g2[k])
    # while changing a counted target does change them
    i = np.argwhere(b.loss_mask > 0)[0]
    b.targets[tuple(i)] = (b.targets[tuple(i)] + 1) % cfg.n_vocab
    loss3, _ = eng.gradients([b])
    assert loss3 != loss1
    eng.close()


@pytest.mark.parametrize("clip", [0.0, 0.05])
def test_adamw_steps_match_torch(tmp_path, rt, clip):
    """Three optimizer steps (decayed matrices, undecayed norms/embedding,
    a changing learning rate, with and without clipping) equal
    torch.optim.AdamW + clip_grad_norm_ on the same gradients."""
    cfg, w = load_tiny(tmp_path, "qwen2_bias_neox")
    rng = np.random.default_rng(4)
    opt = OptimConfig(lr=1e-2, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1, grad_clip=clip)
    eng = TrainEngine(ArchTrain(cfg), w, rt, opt, batch=2, context=8)
    no_decay = {s.name for s in eng.specs if not s.decays(opt)}
    assert "token_embd.weight" in no_decay and "output_norm.weight" in no_decay
    assert any(n.endswith(".bias") for n in no_decay)
    ref_params = {k: v.astype(np.float64) for k, v in w.items()}
    state = None
    for step, lr in enumerate([1e-2, 5e-3, 2e-3]):
        b = packed_batch(rng, cfg.n_vocab, 2, 8)
        n = float(b.loss_mask.sum())
        # the reference gradient at the reference's current parameters
        ref_loss, ref_g = torch_llama.loss_and_grads(
            {k: v.astype(np.float32) for k, v in eng.param_values().items()},
            cfg,
            b.tokens,
            b.pos,
            b.doc,
            b.targets,
            b.loss_mask,
            n,
        )
        r = eng.train_step([b], lr)
        ref_params, state, ref_norm = torch_llama.adamw_step(
            {k: v.astype(np.float64) for k, v in ref_params.items()} if step == 0 else ref_params,
            ref_g,
            state,
            lr=lr,
            beta1=0.9,
            beta2=0.95,
            eps=1e-8,
            weight_decay=0.1,
            no_decay=no_decay,
            max_grad_norm=clip or None,
        )
        assert r.loss == pytest.approx(ref_loss, rel=1e-5)
        assert r.grad_norm == pytest.approx(ref_norm, rel=1e-4)
        got = eng.param_values()
        for k in ref_params:
            err = float(np.abs(got[k] - ref_params[k]).max())
            assert err < 5e-5, f"step {step} {k}: {err}"
        # the reference continues from toy's parameters (float32), so
        # differences do not compound over the steps
        ref_params = {k: v.astype(np.float64) for k, v in got.items()}
    if clip:
        assert ref_norm > clip  # clipping was active
    eng.close()


def test_accumulated_step_matches_torch(tmp_path, rt):
    cfg, w = load_tiny(tmp_path, "gqa_untied")
    rng = np.random.default_rng(5)
    opt = OptimConfig(lr=1e-2, weight_decay=0.1, grad_clip=1.0)
    eng = TrainEngine(ArchTrain(cfg), w, rt, opt, batch=1, context=8, accum=3)
    bs = [packed_batch(rng, cfg.n_vocab, 1, 8) for _ in range(3)]
    cat = Batch(
        *(np.concatenate([getattr(b, f) for b in bs]) for f in ("tokens", "targets", "loss_mask", "pos", "doc"))
    )
    n = float(cat.loss_mask.sum())
    ref_loss, ref_g = torch_llama.loss_and_grads(w, cfg, cat.tokens, cat.pos, cat.doc, cat.targets, cat.loss_mask, n)
    no_decay = {s.name for s in eng.specs if not s.decays(opt)}
    for _ in range(2):  # the second step checks the accumulators start from zero again
        r = eng.train_step(bs, 1e-2)
    ref_p, state, ref_norm = torch_llama.adamw_step(
        {k: v.astype(np.float64) for k, v in w.items()},
        ref_g,
        None,
        lr=1e-2,
        beta1=opt.beta1,
        beta2=opt.beta2,
        eps=opt.eps,
        weight_decay=0.1,
        no_decay=no_decay,
        max_grad_norm=1.0,
    )
    # compare the first step: rebuild an engine and take one step
    eng2 = TrainEngine(ArchTrain(cfg), w, rt, opt, batch=1, context=8, accum=3)
    r1 = eng2.train_step(bs, 1e-2)
    assert r1.loss == pytest.approx(ref_loss, rel=1e-5)
    assert r1.grad_norm == pytest.approx(ref_norm, rel=1e-4)
    got = eng2.param_values()
    for k in ref_p:
        assert float(np.abs(got[k] - ref_p[k]).max()) < 5e-5, k
    # the second step of the first engine saw the same batches from updated weights: loss went down
    assert r.loss < r1.loss
    eng.close()
    eng2.close()


def test_eval_nll_matches_torch_and_changes_nothing(tmp_path, rt):
    cfg, w = load_tiny(tmp_path, "qwen3_qknorm_neox")
    rng = np.random.default_rng(6)
    b = packed_batch(rng, cfg.n_vocab, 2, 12)
    eng = TrainEngine(ArchTrain(cfg), w, rt, OptimConfig(), batch=2, context=12)
    s, n = eng.eval_nll(b)
    ref, _ = torch_llama.loss_and_grads(w, cfg, b.tokens, b.pos, b.doc, b.targets, b.loss_mask, 1.0)
    assert n == int(b.loss_mask.sum())
    assert s == pytest.approx(ref, rel=1e-5)
    for k, v in eng.param_values().items():
        np.testing.assert_array_equal(v, w[k])
    eng.close()


def test_loss_curve_is_deterministic(rt):
    """Same seed, same threads: byte-identical losses and weights twice."""
    cfg = LlamaConfig(
        n_vocab=61,
        d_model=32,
        n_layer=2,
        n_head=4,
        n_head_kv=2,
        head_dim=8,
        d_ff=48,
        rms_eps=1e-5,
        rope_base=10000.0,
        rope_dims=8,
        rope_mode="normal",
        tied_output=True,
    )

    def run():
        rng = np.random.default_rng(7)
        eng = TrainEngine(ArchTrain(cfg), init_params(cfg, 3), rt, OptimConfig(lr=3e-3), batch=2, context=16, accum=2)
        losses = [eng.train_step([packed_batch(rng, 61, 2, 16) for _ in range(2)], 3e-3).loss for _ in range(5)]
        p = eng.param_values()
        eng.close()
        return losses, p

    (l1, p1), (l2, p2) = run(), run()
    assert l1 == l2
    for k in p1:
        assert p1[k].tobytes() == p2[k].tobytes()


def test_profile_step_takes_the_same_step_and_times_every_node(rt):
    """profile_step is train_step with each node timed: byte-identical losses
    and weights to an unprofiled engine, a record for every node of the step
    graph, and profile_summary ranking the ops by time."""
    cfg = LlamaConfig(
        n_vocab=61, d_model=32, n_layer=2, n_head=4, n_head_kv=2, head_dim=8, d_ff=48,
        rms_eps=1e-5, rope_base=10000.0, rope_dims=8, rope_mode="normal", tied_output=True,
    )  # fmt: skip
    engines = [TrainEngine(ArchTrain(cfg), init_params(cfg, 3), rt, OptimConfig(lr=3e-3), batch=2, context=16)]
    engines.append(TrainEngine(ArchTrain(cfg), init_params(cfg, 3), rt, OptimConfig(lr=3e-3), batch=2, context=16))
    try:
        rng = np.random.default_rng(5)
        batches = [packed_batch(rng, 61, 2, 16) for _ in range(3)]
        plain = [engines[0].train_step([b], 3e-3) for b in batches]
        profiled = [engines[1].profile_step([b], 3e-3) for b in batches]
        assert [r.loss for r in plain] == [r.loss for r, _ in profiled]
        assert [r.grad_norm for r in plain] == [r.grad_norm for r, _ in profiled]
        p0, p1 = engines[0].param_values(), engines[1].param_values()
        assert all(p0[k].tobytes() == p1[k].tobytes() for k in p0)

        nodes = profiled[-1][1]
        graph = engines[1]._graphs["single"].graph
        assert len(nodes) == graph.n_nodes
        assert [op for op, _, _ in nodes] == [n.op.split(":")[-1] for n in graph.nodes]
        summary = profile_summary(nodes, top=5)
        assert len(summary) == 5
        assert [r["ms"] for r in summary] == sorted((r["ms"] for r in summary), reverse=True)
        assert 0 < sum(r["share"] for r in summary) <= 1.0 + 1e-6
        ops = {op for op, _, _ in nodes}
        assert {"MUL_MAT", "SUM_SQR", "OPT_STEP_ADAMW_SCALED"} <= ops  # clipping on: the fused step (patch 0017)
        assert sum(r["nodes"] for r in profile_summary(nodes, top=len(ops))) == len(nodes)
        engines[1].train_step([batches[0]], 3e-3)  # profiling is off again after profile_step
        assert engines[1]._profile is None
    finally:
        for e in engines:
            e.close()


def test_bad_batches_are_refused(tmp_path, rt):
    cfg, w = load_tiny(tmp_path, "gqa_untied")
    eng = TrainEngine(ArchTrain(cfg), w, rt, OptimConfig(), batch=2, context=8)
    rng = np.random.default_rng(8)
    b = packed_batch(rng, cfg.n_vocab, 2, 8)
    with pytest.raises(ValueError, match="micro-batches"):
        eng.train_step([b, b], 1e-3)
    bad = packed_batch(rng, cfg.n_vocab, 1, 8)
    with pytest.raises(ValueError, match="shape"):
        eng.train_step([bad], 1e-3)
    b.targets[0, 0] = cfg.n_vocab
    b.loss_mask[0, 0] = 1.0
    with pytest.raises(ValueError, match="vocabulary"):
        eng.train_step([b], 1e-3)
    b.loss_mask[:] = 0
    with pytest.raises(ValueError, match="no target"):
        eng.train_step([b], 1e-3)
    with pytest.raises(ValueError, match="no starting value"):
        TrainEngine(ArchTrain(cfg), {}, rt, OptimConfig(), batch=2, context=8)
    eng.close()


def test_label_smoothing_matches_torch(tmp_path, rt):
    """``label_smoothing`` gives PyTorch's smoothed cross-entropy and its
    gradient; the validation NLL stays the plain NLL (and an unsmoothed
    upload after a smoothed one leaves no smoothing behind)."""
    cfg, w = load_tiny(tmp_path, "gqa_untied")
    rng = np.random.default_rng(11)
    b = packed_batch(rng, cfg.n_vocab, 2, 12)
    eng = TrainEngine(ArchTrain(cfg), w, rt, OptimConfig(), batch=2, context=12, label_smoothing=0.1)
    loss, grads = eng.gradients([b])
    n = float(b.loss_mask.sum())
    args = (w, cfg, b.tokens, b.pos, b.doc, b.targets, b.loss_mask, n)
    ref_loss, ref = torch_llama.loss_and_grads(*args, label_smoothing=0.1)
    plain_loss, _ = torch_llama.loss_and_grads(*args)
    assert abs(ref_loss - plain_loss) > 1e-3  # the smoothing term is visible at this tolerance
    assert loss == pytest.approx(ref_loss, rel=1e-5)
    assert_grads_close(grads, ref)
    nll, count = eng.eval_nll(b)
    assert count == int(n)
    assert nll / n == pytest.approx(plain_loss, rel=1e-5)
    with pytest.raises(ValueError, match="label_smoothing"):
        TrainEngine(ArchTrain(cfg), w, rt, OptimConfig(), batch=2, context=12, label_smoothing=1.0)
    eng.close()


@pytest.mark.parametrize("variant", ["gqa_untied", "qwen3_qknorm_neox"])
def test_sample_logits_do_not_depend_on_the_padding(tmp_path, rt, variant):
    """next_token_logits pads the row to a power of two (at least 16), not to the context: the
    logits equal those of the whole padded context bit for bit, and torch's float64 forward."""
    cfg, w = load_tiny(tmp_path, variant)
    eng = TrainEngine(ArchTrain(cfg), w, rt, OptimConfig(), batch=1, context=40)
    rng = np.random.default_rng(5)
    ids = rng.integers(0, cfg.n_vocab, size=40).tolist()
    ref = torch_llama.logits(w, cfg, np.array([ids]), np.arange(40)[None], np.zeros((1, 40), np.int64))[0]
    for n in (1, 5, 16, 17, 33, 40):
        got = eng.next_token_logits(ids[:n])
        assert got.tobytes() == eng.next_token_logits(ids[:n], window=40).tobytes(), n
        np.testing.assert_allclose(got, ref[n - 1], rtol=1e-4, atol=1e-4 * np.abs(ref[n - 1]).max())
    assert sorted(eng._row) == [16, 32, 40]  # one graph per padded length
    with pytest.raises(ValueError, match="window"):
        eng.next_token_logits(ids[:20], window=16)
    eng.close()
