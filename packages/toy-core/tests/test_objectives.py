"""The step engine's sequence objectives (``toy.train.objectives``: DPO, ORPO,
KTO, GRPO) against the same formulas written out in float64 PyTorch over the
independent llama reference (``torch_llama.objective_and_grads``: logits
from ``torch_llama``, ``log_softmax`` at the targets, torch autograd).

These pin the graph plumbing and the formulas as the papers and TRL state
them; ``test_pref_trl.py`` compares with TRL's own trainers.

Tolerances: toy computes in float32 and the reference in float64. Losses
within 1e-5 relative (+1e-7 absolute), gradients with ``assert_grads_close``
(|g - ref| <= 2e-4 max|ref| + 1e-6 per tensor), as the cross-entropy tests.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest

import toy_ggml
from toy.gguf import GGUFFile
from toy.models.llama import LlamaConfig
from toy.train.model import ArchTrain
from toy.train.objectives import DPOLoss, GRPOLoss, KTOLoss, ORPOLoss
from toy.train.optim import OptimConfig
from toy.train.stepgraph import TrainEngine
from toy_testsupport import torch_llama
from toy_testsupport.reference.llama_np import load_weights
from toy_testsupport.tiny_llama import VARIANTS, write_tiny
from toy_testsupport.train_helpers import assert_grads_close

T = 12


@dataclass
class Rows:
    tokens: np.ndarray
    targets: np.ndarray
    loss_mask: np.ndarray
    pos: np.ndarray
    doc: np.ndarray
    completion_mask: np.ndarray | None = None
    ref_logps: np.ndarray | None = None
    desirable: np.ndarray | None = None
    kl: float | None = None
    advantages: np.ndarray | None = None
    old_logps: np.ndarray | None = None


def _rows(rng, vocab: int, B: int, *, whole: bool = False) -> Rows:
    """B rows, one sequence each: a prompt of 2..4 tokens and a completion of
    2..(T - prompt) tokens, then padding (doc 1). The loss mask is on the
    completion's targets (``whole``: on every target of the sequence, the
    completion mask on the completion's)."""
    tokens, targets, pos, doc = (np.zeros((B, T), np.int32) for _ in range(4))
    mask, cmask = np.zeros((B, T), np.float32), np.zeros((B, T), np.float32)
    for r in range(B):
        p = int(rng.integers(2, 5))
        n = p + int(rng.integers(2, T + 1 - p))  # sequence length <= T + 1
        seq = rng.integers(0, vocab, size=n)
        m = n - 1
        tokens[r, :m], targets[r, :m] = seq[:-1], seq[1:]
        cmask[r, p - 1 : m] = 1.0
        mask[r, :m] = 1.0 if whole else cmask[r, :m]
        pos[r, :m], pos[r, m:] = np.arange(m), np.arange(T - m)
        doc[r, m:] = 1
    return Rows(tokens, targets, mask, pos, doc, completion_mask=cmask if whole else None)


@pytest.fixture
def tiny(tmp_path):
    path = write_tiny(tmp_path / "t.gguf", **VARIANTS["gqa_untied"])
    with GGUFFile(path) as gf:
        cfg = LlamaConfig.from_gguf(gf)
        w = {k: v.astype(np.float32) for k, v in load_weights(gf).items()}
    return cfg, w


def _engine(rt, cfg, w, objective, B: int, accum: int = 1) -> TrainEngine:
    return TrainEngine(ArchTrain(cfg), w, rt, OptimConfig(), batch=B, context=T, accum=accum, objective=objective)


def _ref(cfg, w, batches, fn, temperature: float = 1.0):
    """The torch loss and gradients of ``fn`` over the rows of every batch
    (stacked: the objective's normalisation is over the step)."""
    cat = {
        k: np.concatenate([getattr(b, k) for b in batches]) for k in ("tokens", "pos", "doc", "targets", "loss_mask")
    }
    return torch_llama.objective_and_grads(
        w, cfg, cat["tokens"], cat["pos"], cat["doc"], cat["targets"], cat["loss_mask"], fn, temperature=temperature
    )


def _torch():
    return torch_llama._load_torch()


def _check(loss, grads, ref_loss, ref):
    assert loss == pytest.approx(ref_loss, rel=1e-5, abs=1e-7)
    assert_grads_close(grads, ref)


def _pair_ref(batches, ref_logps, ratio_fn):
    """The per-pair margins of stacked pair batches (each batch's rows:
    chosen then rejected) as torch tensors, for ``ratio_fn(seq)``."""
    torch = _torch()

    def margins(lp):
        out = []
        o = 0
        for b in batches:
            B = b.tokens.shape[0]
            P = B // 2
            cm = torch.from_numpy(np.asarray(b.loss_mask if b.completion_mask is None else b.completion_mask, float))
            seq = (lp[o : o + B] * cm).sum(1)
            r = ratio_fn(seq - torch.from_numpy(ref_logps[o : o + B].astype(float)), cm)
            out.append(r[:P] - r[P:])
            o += B
        return torch.cat(out)

    return margins


@pytest.mark.parametrize("loss_type", ["sigmoid", "ipo", "robust", "hinge"])
def test_dpo_matches_torch(tiny, rt, loss_type):
    torch = _torch()
    F = torch.nn.functional
    cfg, w = tiny
    rng = np.random.default_rng(3)
    beta, e = 0.5, (0.2 if loss_type == "robust" else 0.0)
    batches = [_rows(rng, cfg.n_vocab, 4), _rows(rng, cfg.n_vocab, 4)]
    refs = rng.normal(-20.0, 3.0, size=8)
    for i, b in enumerate(batches):
        b.ref_logps = refs[4 * i : 4 * i + 4].astype(np.float32)
    eng = _engine(rt, cfg, w, DPOLoss(beta, loss_type, e), 4, accum=2)
    loss, grads = eng.gradients(batches)
    ipo = loss_type == "ipo"
    margins = _pair_ref(batches, refs.astype(np.float32), lambda r, cm: r / cm.sum(1) if ipo else r)

    def fn(lp):
        h = margins(lp)
        if loss_type == "sigmoid":
            per = -F.logsigmoid(beta * h)
        elif loss_type == "ipo":
            per = (h - 1 / (2 * beta)) ** 2
        elif loss_type == "robust":
            per = (-(1 - e) * F.logsigmoid(beta * h) + e * F.logsigmoid(-beta * h)) / (1 - 2 * e)
        else:
            per = torch.relu(1 - beta * h)
        return per.mean()

    _check(loss, grads, *_ref(cfg, w, batches, fn))
    eng.close()


def test_dpo_metrics_and_step(tiny, rt):
    cfg, w = tiny
    rng = np.random.default_rng(4)
    b = _rows(rng, cfg.n_vocab, 4)
    eng = _engine(rt, cfg, w, DPOLoss(0.1), 4)
    seq = eng.sequence_logps(b)
    # the per-target log-probs equal log_softmax of the reference logits at the targets
    z = torch_llama.logits(w, cfg, b.tokens, b.pos, b.doc)
    lsm = z - np.log(np.exp(z - z.max(-1, keepdims=True)).sum(-1, keepdims=True)) - z.max(-1, keepdims=True)
    want = (np.take_along_axis(lsm, b.targets[..., None].astype(int), -1)[..., 0] * b.loss_mask).sum(1)
    np.testing.assert_allclose(seq, want, rtol=1e-5, atol=1e-5)
    # at the start the policy is the reference: every reward is 0, the loss log 2
    b.ref_logps = seq.astype(np.float32)
    loss, m = eng.evaluate_objective(b)
    assert loss == pytest.approx(np.log(2.0), abs=1e-5)
    assert m["rewards_chosen"] == pytest.approx(0.0, abs=1e-5) and m["margin"] == pytest.approx(0.0, abs=1e-5)
    before = eng.param_values()
    res = eng.train_step([b], lr=1e-2)
    assert res.loss == pytest.approx(loss, abs=1e-6)
    assert set(res.metrics) >= {"rewards_chosen", "rewards_rejected", "margin", "accuracy"}
    # a few steps raise the chosen completions' log-probs over the rejected ones
    for _ in range(5):
        res = eng.train_step([b], lr=1e-2)
    _, m = eng.evaluate_objective(b)
    assert m["margin"] > 0.1 and m["accuracy"] == 1.0
    # swapped: the reference parameters inside, the trained ones after, bit for bit
    trained = eng.param_values()
    with eng.swapped(before):
        np.testing.assert_allclose(eng.sequence_logps(b), seq, rtol=0, atol=0)
    after = eng.param_values()
    assert all(np.array_equal(after[k], trained[k]) for k in trained)
    eng.close()


def test_orpo_matches_torch(tiny, rt):
    torch = _torch()
    F = torch.nn.functional
    cfg, w = tiny
    rng = np.random.default_rng(5)
    b = _rows(rng, cfg.n_vocab, 6, whole=True)
    lam = 0.3
    eng = _engine(rt, cfg, w, ORPOLoss(lam), 6)
    loss, grads = eng.gradients([b])
    cm = torch.from_numpy(b.completion_mask.astype(float))
    lm = torch.from_numpy(b.loss_mask.astype(float))

    def fn(lp):
        avg = (lp * cm).sum(1) / cm.sum(1)
        ac, ar = avg[:3], avg[3:]
        lo = (ac - ar) - (torch.log1p(-torch.exp(ac)) - torch.log1p(-torch.exp(ar)))
        nll = -(lp[:3] * lm[:3]).sum() / lm[:3].sum()
        return nll - (lam * F.logsigmoid(lo)).mean()

    _check(loss, grads, *_ref(cfg, w, [b], fn))
    eng.close()


def test_kto_matches_torch(tiny, rt):
    torch = _torch()
    cfg, w = tiny
    rng = np.random.default_rng(6)
    b = _rows(rng, cfg.n_vocab, 5)
    b.desirable = np.array([1, 0, 1, 1, 0], np.float32)
    b.ref_logps = rng.normal(-15.0, 3.0, size=5).astype(np.float32)
    b.kl = 0.7
    beta, wd, wu = 0.4, 1.0, 1.5
    eng = _engine(rt, cfg, w, KTOLoss(beta, wd, wu), 5)
    loss, grads = eng.gradients([b])
    d = torch.from_numpy(b.desirable.astype(bool))
    ref = torch.from_numpy(b.ref_logps.astype(float))

    def fn(lp):
        r = lp.sum(1) - ref
        good = wd * (1 - torch.sigmoid(beta * (r - b.kl)))
        bad = wu * (1 - torch.sigmoid(beta * (b.kl - r)))
        return torch.where(d, good, bad).mean()

    _check(loss, grads, *_ref(cfg, w, [b], fn))
    eng.close()


@pytest.mark.parametrize(
    ("loss_type", "beta", "corrected", "temp"),
    [("dapo", 0.0, True, 1.0), ("grpo", 0.04, True, 0.7), ("bnpo", 0.0, True, 1.0), ("dr_grpo", 0.04, False, 1.0)],
)
def test_grpo_matches_torch(tiny, rt, loss_type, beta, corrected, temp):
    torch = _torch()
    cfg, w = tiny
    rng = np.random.default_rng(7)
    batches = [_rows(rng, cfg.n_vocab, 4), _rows(rng, cfg.n_vocab, 4)]
    objective = GRPOLoss(
        beta, 0.2, 0.28, loss_type, max_completion_length=T, bias_correction_kl=corrected, temperature=temp
    )
    eng = _engine(rt, cfg, w, objective, 4, accum=2)
    for b in batches:
        lp = eng.token_logps(b)
        # old log-probs off the current ones, so some ratios leave [1 - eps, 1 + eps_high]
        b.old_logps = (lp + rng.normal(0.0, 0.3, size=lp.shape) * b.loss_mask).astype(np.float32)
        b.ref_logps = (lp + rng.normal(0.0, 0.5, size=lp.shape) * b.loss_mask).astype(np.float32)
        b.advantages = rng.normal(0.0, 1.0, size=4).astype(np.float32)
    loss, grads = eng.gradients(batches)
    n_tok = sum(float(b.loss_mask.sum()) for b in batches)

    def fn(lp):
        total = 0.0
        for i, b in enumerate(batches):
            x = lp[4 * i : 4 * i + 4]
            m = torch.from_numpy(b.loss_mask.astype(float))
            old = torch.from_numpy(b.old_logps.astype(float)) * m
            a = torch.from_numpy(b.advantages.astype(float))[:, None]
            ratio = torch.exp(x - old)
            per = -torch.min(ratio * a, torch.clamp(ratio, 0.8, 1.28) * a)
            if beta:
                dlt = torch.from_numpy(b.ref_logps.astype(float)) * m - x
                kl = torch.exp(dlt) - dlt - 1
                per = per + beta * (kl * ratio if corrected else kl)
            per = per * m
            if loss_type == "dapo":
                total = total + per.sum() / n_tok
            elif loss_type == "grpo":
                total = total + (per.sum(1) / m.sum(1)).sum() / 8
            elif loss_type == "bnpo":
                total = total + per.sum() / m.sum() / 2
            else:
                total = total + per.sum() / (4 * T) / 2
        return total

    ref_loss, ref = _ref(cfg, w, batches, fn, temperature=temp)
    _check(loss, grads, ref_loss, ref)
    clipped = eng.objective.metrics()["clip_ratio"]
    assert 0.0 < clipped < 1.0
    eng.close()


def test_objective_errors(tiny, rt):
    cfg, w = tiny
    rng = np.random.default_rng(8)
    with pytest.raises(ValueError, match="even number"):
        _engine(rt, cfg, w, DPOLoss(), 3)
    with pytest.raises(ValueError, match="loss type"):
        DPOLoss(0.1, "nope")
    with pytest.raises(ValueError, match="robust"):
        DPOLoss(0.1, "sigmoid", 0.1)
    eng = _engine(rt, cfg, w, DPOLoss(), 4)
    with pytest.raises(ValueError, match="ref_logps"):
        eng.gradients([_rows(rng, cfg.n_vocab, 4)])
    eng.close()
    eng = _engine(rt, cfg, w, KTOLoss(), 4)
    b = _rows(rng, cfg.n_vocab, 4)
    b.desirable, b.ref_logps = np.ones(4, np.float32), np.zeros(4, np.float32)
    with pytest.raises(ValueError, match="'kl'"):
        eng.gradients([b])
    eng.close()


def _pad_pairs(b: Rows, k: int) -> Rows:
    """The pair batch with its last ``k`` pairs made padding (no loss token)."""
    B = b.tokens.shape[0]
    P = B // 2
    out = Rows(**{f: (None if getattr(b, f) is None else np.array(getattr(b, f))) for f in b.__dataclass_fields__})
    for r in [*range(P - k, P), *range(B - k, B)]:
        out.loss_mask[r] = 0.0
        if out.completion_mask is not None:
            out.completion_mask[r] = 0.0
        if out.ref_logps is not None:
            out.ref_logps[r] = 0.0
    return out


@pytest.mark.parametrize("make", [lambda: DPOLoss(0.3), lambda: ORPOLoss(0.2)], ids=["dpo", "orpo"])
def test_padding_pairs_count_for_nothing(tiny, rt, make):
    """Pairs without loss tokens (an evaluation's padding) change neither
    the loss nor a metric: 2 real pairs + 2 padding pairs give the loss and
    metrics of the 2 real pairs alone."""
    cfg, w = tiny
    rng = np.random.default_rng(9)
    whole = make().name == "orpo"
    small = _rows(rng, cfg.n_vocab, 4, whole=whole)
    small.ref_logps = rng.normal(-20.0, 3.0, size=4).astype(np.float32)
    # the same two pairs in a 4-pair batch: rows [c0, c1, pad, pad, r0, r1, pad, pad]
    filler = _rows(rng, cfg.n_vocab, 4, whole=whole)
    filler.ref_logps = np.zeros(4, np.float32)
    big = Rows(
        **{
            f: None
            if getattr(small, f) is None
            else np.concatenate(
                [getattr(small, f)[:2], getattr(filler, f)[:2], getattr(small, f)[2:], getattr(filler, f)[2:]]
            )
            for f in ("tokens", "targets", "loss_mask", "pos", "doc", "completion_mask", "ref_logps")
        }
    )
    big = _pad_pairs(big, 2)
    e1, e2 = _engine(rt, cfg, w, make(), 4), _engine(rt, cfg, w, make(), 8)
    l1, m1 = e1.evaluate_objective(small)
    l2, m2 = e2.evaluate_objective(big)
    assert l2 == pytest.approx(l1, rel=1e-5, abs=1e-7)
    assert m2.keys() == m1.keys()
    for k in m1:
        assert m2[k] == pytest.approx(m1[k], rel=1e-5, abs=1e-6), k
    e1.close()
    e2.close()


@pytest.mark.parametrize("fn", ["softplus", "log_sigmoid", "sigmoid"])
def test_scalar_pieces_and_their_gradients(rt, fn):
    """The composed softplus / log sigmoid / sigmoid against NumPy, values
    and derivatives, at 0 (where every DPO and KTO run starts: a kink there
    would make the first gradient 0), around the knee and far out."""
    import toy_ggml
    from toy.train import objectives as O

    x0 = np.array([0.0, 1e-3, -1e-3, 2.5, -2.5, 29.0, 31.0, 45.0, -45.0, 120.0, -120.0], np.float32)
    st = toy_ggml.Context(max_tensors=4)
    x = st.tensor(toy_ggml.GGMLType.F32, x0.shape, name="x").set_param()
    st.allocate(rt)
    x.set(x0)
    ops = toy_ggml.Context(max_tensors=1024, graph_size=1024)
    y = getattr(O, fn)(ops, x).set_output()
    loss = ops.sum(y).set_loss().set_output()
    g = toy_ggml.Graph(ops, size=1024, grads=True)
    g.build_forward(loss)
    g.build_backward()
    seed = g.grad(loss)
    seed.set_input()
    grad = g.grad(x).set_output()
    g.build_forward(grad)
    rt.allocate(g)
    seed.set(np.ones(seed.shape, np.float32))
    rt.compute(g)
    xd = x0.astype(np.float64)
    sp = np.logaddexp(0.0, xd)
    sig = 1.0 / (1.0 + np.exp(-xd))
    want, dwant = {
        "softplus": (sp, sig),
        "log_sigmoid": (-np.logaddexp(0.0, -xd), 1.0 - sig),
        "sigmoid": (sig, sig * (1.0 - sig)),
    }[fn]
    np.testing.assert_allclose(y.numpy(), want, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(grad.numpy(), dwant, rtol=1e-5, atol=1e-7)
    ops.close()
    st.close()


def test_dpo_gradient_at_the_reference_point(tiny, rt):
    """policy == reference (every run's first step): the margin is exactly 0
    in the graph, the loss log 2, and the gradient is TRL's/the formula's
    (-beta/2 times the margin's gradient), not 0."""
    torch = _torch()
    F = torch.nn.functional
    cfg, w = tiny
    rng = np.random.default_rng(11)
    b = _rows(rng, cfg.n_vocab, 4)
    eng = _engine(rt, cfg, w, DPOLoss(0.5), 4)
    b.ref_logps = np.zeros(4, np.float32)
    eng.evaluate_objective(b)
    # the graph's own float32 sequence log-probs: the reference the run computes with this very graph
    b.ref_logps = eng._graphs["objective_eval"].outputs["seq_logps"].numpy().reshape(-1).copy()
    loss, grads = eng.gradients([b])
    assert loss == pytest.approx(np.log(2.0), abs=1e-7)
    margins = _pair_ref([b], b.ref_logps, lambda r, cm: r)
    ref_loss, ref = _ref(cfg, w, [b], lambda lp: (-F.logsigmoid(0.5 * margins(lp))).mean())
    _check(loss, grads, ref_loss, ref)
    assert max(float(np.abs(g).max()) for g in grads.values()) > 1e-3
    eng.close()


def test_an_engine_without_objective_takes_target_ids_and_gives_the_same_logps(tiny, rt):
    # Without an objective (and without label smoothing) the engine's labels on a CPU are the
    # targets' ids (toy-ggml patch 0030: no (N, V) one-hot matrix); its per-target log-probs
    # gather the softmax at the ids instead of summing it against one-hot rows. Both must be
    # the one-hot engine's bits: an objective's engine keeps one-hot rows.
    cfg, w = tiny
    rng = np.random.default_rng(11)
    b = _rows(rng, cfg.n_vocab, 4)
    plain = _engine(rt, cfg, w, None, 4)
    dense = _engine(rt, cfg, w, DPOLoss(0.1), 4)
    smooth = TrainEngine(ArchTrain(cfg), w, rt, OptimConfig(), batch=4, context=T, label_smoothing=0.1)
    try:
        assert plain._labels.dtype == toy_ggml.GGMLType.I32 and plain._labels.shape == (4 * T,)
        assert dense._labels.shape == (4 * T, cfg.n_vocab) and smooth._labels.shape == (4 * T, cfg.n_vocab)
        got, want = plain.token_logps(b), dense.token_logps(b)
        assert np.array_equal(got.view(np.uint32), want.view(np.uint32))
        assert np.all(got[b.loss_mask == 0] == 0.0) and np.all(got[b.loss_mask > 0] < 0.0)
    finally:
        for e in (plain, dense, smooth):
            e.close()
