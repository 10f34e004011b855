"""The preference and RL objectives (``toy.train.objectives``) against TRL 1.16.0.

Reference: TRL's own trainers (``toy_testsupport.trl_ref``: ``DPOTrainer``,
``trl.experimental.orpo.ORPOTrainer``, ``KTOTrainer``, ``GRPOTrainer``, their
``compute_loss`` on the same token ids, then autograd) on the Hugging Face
model that llama.cpp's converter turned into the GGUF toy trains, in float64
(TRL's fused LM head works in float32 at the log-sum-exp: trl_ref's
docstring). Toy's side is the run's: batches from ``toy.train.prefdata``
(ORPO's masks from ``toy.train.prefrun.orpo_batch``), reference log-probs from
the engine's own forward on the reference parameters (``swapped``), KTO's KL
estimate from ``UnpairedData.kl_batch``, then ``TrainEngine.gradients`` with
the objective. Compared: the loss, the gradient of every trained parameter,
the metrics TRL logs.

Two parameter sets each: full fine-tune (every tensor of the GGUF; the policy
is the base with seeded noise, the reference the base) and LoRA (q, v and
down adapters with A and B both non-zero, the reference the base = the
adapters with B = 0, as at the start of a run; TRL gets the same values in
PEFT's lora_A / lora_B and its reference is the base with the adapters
disabled). DPO and KTO also at a run's first step, where the policy is the
reference (full: the base; LoRA: B = 0) and every margin or log-ratio is
exactly 0 (a kink of the loss's pieces at 0 would zero the gradient there).

GRPO: TRL's ``loss_type`` "dapo" (its default: the step's token sum over its
completion token count) and "grpo" (per-completion token means, averaged),
also "bnpo" and "dr_grpo" (one case each);
token-level importance sampling, the KL term with TRL's default
``use_bias_correction_kl`` (the k3 estimator times the ratio), temperature 1.
On-policy cases give toy the current per-token log-probs as ``old_logps`` and
TRL none (its detached copy); off-policy cases give both the same old
log-probs, shifted from the current ones by up to ±0.5 so that the clip range
(epsilon 0.2) is crossed on both sides. The reference per-token log-probs of
toy (its engine on the base) are checked against TRL's.

Tolerances (float32 toy vs TRL; the largest errors measured over these
cases in brackets): loss 1e-5 relative [1.7e-6]; gradients
``assert_grads_close``, 2e-4 of each tensor's largest gradient as in the
other training parity tests [1.9e-5]; metrics 1e-4 relative + 1e-5 absolute
[2.2e-5 relative: a reward is beta times the difference of two ~-50 sums of
log-probs, each float32 on both sides]; GRPO's reference per-token log-probs
2e-5 absolute.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from toy import models
from toy.train.lora import LoraSettings, LoraTrain
from toy.train.model import ArchTrain
from toy.train.objectives import DPOLoss, GRPOLoss, KTOLoss, ORPOLoss
from toy.train.optim import OptimConfig
from toy.train.prefdata import PairData, PrefExample, UnpairedData, sequence_batch
from toy.train.prefrun import orpo_batch
from toy.train.stepgraph import TrainEngine
from toy_testsupport import trl_ref
from toy_testsupport.train_helpers import BoundModel, assert_grads_close, hf_masked_loss_backward
from toy_testsupport.trl_ref import Example, Lora

pytestmark = pytest.mark.slow  # a TRL trainer and a toy engine per case: a few seconds each

T = 24  # positions per row
LOSS_RTOL = 1e-5
LORA = dict(targets=["q", "v", "down"], rank=4, alpha=8.0)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, rt):
    hf, gguf = trl_ref.make_model(tmp_path_factory.mktemp("trl"))
    b = BoundModel(gguf, rt, models.config_from_gguf)
    b.hf = hf
    yield b
    b.close()


@dataclasses.dataclass
class Setup:
    """What toy trains (``model``, its starting ``params``, ``reference``: the values swapped in for the
    reference log-probs) and what TRL gets: ``policy`` and ``ref_weights``, full weight sets (LoRA: both the
    base), and ``lora``, the adapters on ``policy``."""

    model: object
    params: dict
    reference: dict
    policy: dict
    ref_weights: dict
    lora: Lora | None


def setup(tiny, kind: str, seed: int = 0, start: bool = False) -> Setup:
    """``start``: the policy is the reference, as at a run's first step (full: the base; LoRA: B = 0)."""
    rng = np.random.default_rng(seed)
    if kind == "full":
        model = ArchTrain(tiny.cfg)
        names = [s.name for s in model.param_specs()]
        assert set(names) == set(tiny.w)  # every tensor trained
        noise = 0.0 if start else 0.15
        policy = {n: (v + noise * v.std() * rng.standard_normal(v.shape)).astype(np.float32) for n, v in tiny.w.items()}
        return Setup(model, policy, dict(tiny.w), policy, tiny.w, None)
    model = LoraTrain(tiny.cfg, tiny.bound.tensors, LoraSettings(**LORA))
    values = {n: (rng.standard_normal(s) * 0.2).astype(np.float32) for n, s in model.shapes.items()}
    zero_b = {n: np.zeros_like(v) for n, v in values.items() if n.endswith(".lora_b")}
    if start:
        values.update(zero_b)
    return Setup(model, values, zero_b, tiny.w, tiny.w, Lora(values, alpha=LORA["alpha"]))


def engine(rt, s: Setup, rows: int, objective=None) -> TrainEngine:
    return TrainEngine(s.model, s.params, rt, OptimConfig(), batch=rows, context=T, objective=objective)


def ids(rng, n: int) -> list[int]:
    return [int(x) for x in rng.integers(1, 5000, size=n)]


def assert_close_loss(got: float, want: float) -> None:
    assert got == pytest.approx(want, rel=LOSS_RTOL), (got, want)


def assert_metrics(got: dict, want: dict, names: dict[str, str]) -> None:
    """``names``: toy's metric -> TRL's."""
    for mine, theirs in names.items():
        assert got[mine] == pytest.approx(want[theirs], rel=1e-4, abs=1e-5), (mine, got[mine], want[theirs])


def pair_examples(seed: int, n: int) -> list[PrefExample]:
    """``n`` pairs of random token ids: prompts of 3..6 tokens, completions of 2..9."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        p = ids(rng, int(rng.integers(3, 7)))
        c, r = (ids(rng, int(rng.integers(2, 10))) for _ in range(2))
        out.append(PrefExample(p, (c, r), "test", i + 1, "pairs", "standard"))
    return out


def as_trl(exs: list[PrefExample], side: int) -> list[Example]:
    return [Example([int(x) for x in e.prompt], [int(x) for x in e.completions[side]]) for e in exs]


# ------------------------------------------------------------------ the reference model is toy's model


def test_reference_model_is_the_converted_gguf(tiny, rt):
    """The name map and RoPE row order of trl_ref (the GGUF's tensors loaded into the HF model) give toy's
    plain cross-entropy loss and gradients, so a mismatch below is the objective's."""
    rng = np.random.default_rng(1)
    seqs = [np.asarray(ids(rng, n)) for n in (T + 1, 17)]
    b = sequence_batch([(s, np.arange(len(s)) >= 2) for s in seqs], T)
    s = setup(tiny, "full", seed=2)
    eng = engine(rt, s, 2)
    try:
        loss, grads = eng.gradients([b])
    finally:
        eng.close()
    model = trl_ref.hf_model(tiny.hf, s.policy)
    want_loss = hf_masked_loss_backward(model, b)
    params = dict(model.named_parameters())
    want = {n: trl_ref.to_gguf_rows(params[trl_ref.hf_name(n)].grad.numpy(), n) for n in s.policy}
    assert loss == pytest.approx(want_loss, rel=LOSS_RTOL)
    assert_grads_close(grads, want)


# ------------------------------------------------------------------ DPO


DPO_METRICS = {
    "rewards_chosen": "rewards/chosen",
    "rewards_rejected": "rewards/rejected",
    "margin": "rewards/margins",
    "accuracy": "rewards/accuracies",
    "logps_chosen": "logps/chosen",
    "logps_rejected": "logps/rejected",
}


@pytest.mark.parametrize(
    ("kind", "loss_type", "smoothing", "start"),
    [
        ("full", "sigmoid", 0.0, False),
        ("full", "ipo", 0.0, False),
        ("full", "robust", 0.1, False),
        ("full", "hinge", 0.0, False),
        ("lora", "sigmoid", 0.0, False),
        ("lora", "robust", 0.1, False),
        # a run's first step: policy = reference, every margin exactly 0
        ("full", "sigmoid", 0.0, True),
        ("lora", "sigmoid", 0.0, True),
    ],
)
def test_dpo_equals_trl(tiny, rt, kind, loss_type, smoothing, start):
    beta = 0.1 if loss_type != "hinge" else 0.5  # hinge: some pairs on each side of the kink
    exs = pair_examples(10, 3)
    s = setup(tiny, kind, seed=3, start=start)
    b = PairData(exs, T, val_fraction=0).batch(range(3))
    eng = engine(rt, s, 6, DPOLoss(beta=beta, loss_type=loss_type, label_smoothing=smoothing))
    try:
        with eng.swapped(s.reference):
            b.ref_logps = eng.sequence_logps(b).astype(np.float32)
        loss, grads = eng.gradients([b])
        metrics = eng.objective.metrics()
    finally:
        eng.close()
    ref = trl_ref.dpo(
        tiny.hf,
        s.policy,
        s.ref_weights,
        as_trl(exs, 0),
        as_trl(exs, 1),
        beta=beta,
        loss_type=loss_type,
        label_smoothing=smoothing,
        lora=s.lora,
    )
    assert_close_loss(loss, ref.loss)
    assert_grads_close(grads, ref.grads)
    assert_metrics(metrics, ref.metrics, DPO_METRICS)


# ------------------------------------------------------------------ ORPO


ORPO_METRICS = {
    "nll": "nll_loss",
    "log_odds_ratio": "log_odds_ratio",
    "log_odds_chosen": "log_odds_chosen",
    "rewards_chosen": "rewards/chosen",
    "rewards_rejected": "rewards/rejected",
    "margin": "rewards/margins",
    "accuracy": "rewards/accuracies",
}


@pytest.mark.parametrize("kind", ["full", "lora"])
def test_orpo_equals_trl(tiny, rt, kind):
    lam = 0.1
    exs = pair_examples(20, 3)
    s = setup(tiny, kind, seed=4)
    b = orpo_batch(PairData(exs, T, val_fraction=0).batch(range(3)))
    eng = engine(rt, s, 6, ORPOLoss(lam=lam))
    try:
        loss, grads = eng.gradients([b])
        metrics = eng.objective.metrics()
    finally:
        eng.close()
    ref = trl_ref.orpo(tiny.hf, s.policy, as_trl(exs, 0), as_trl(exs, 1), lam=lam, lora=s.lora)
    assert_close_loss(loss, ref.loss)
    assert_grads_close(grads, ref.grads)
    assert_metrics(metrics, ref.metrics, ORPO_METRICS)


# ------------------------------------------------------------------ KTO


KTO_METRICS = {
    "kl": "kl",
    "rewards_chosen": "rewards/chosen",
    "rewards_rejected": "rewards/rejected",
    "margin": "rewards/margins",
}


@pytest.mark.parametrize(
    ("kind", "weights", "start"),
    [("full", (1.0, 1.5), False), ("lora", (1.0, 1.0), False), ("lora", (1.0, 1.0), True)],
)
def test_kto_equals_trl(tiny, rt, kind, weights, start):
    """``start``: the policy is the reference (a run's first step): every log-ratio and the KL estimate 0."""
    beta, n = 0.1, 4
    rng = np.random.default_rng(30)
    labels = [True, False, False, True]
    exs = []
    for i, label in enumerate(labels):
        p, c = ids(rng, int(rng.integers(3, 7))), ids(rng, int(rng.integers(2, 10)))
        exs.append(PrefExample(p, (c,), "test", i + 1, "unpaired", "standard", label=label))
    s = setup(tiny, kind, seed=5, start=start)
    data = UnpairedData(exs, T, val_fraction=0, kl_group=n)  # TRL pairs the KL rows within a batch of n
    b, kl_b = data.batch(range(n)), data.kl_batch(range(n))
    eng = engine(rt, s, n, KTOLoss(beta=beta, desirable_weight=weights[0], undesirable_weight=weights[1]))
    try:
        with eng.swapped(s.reference):
            b.ref_logps = eng.sequence_logps(b).astype(np.float32)
            ref_kl = eng.sequence_logps(kl_b)
        b.kl = float(max(0.0, np.mean(eng.sequence_logps(kl_b) - ref_kl)))  # as the run's kl_estimate
        loss, grads = eng.gradients([b])
        metrics = eng.objective.metrics()
    finally:
        eng.close()
    trl_exs = [Example([int(x) for x in e.prompt], [int(x) for x in e.completions[0]]) for e in exs]
    ref = trl_ref.kto(
        tiny.hf,
        s.policy,
        s.ref_weights,
        trl_exs,
        labels,
        beta=beta,
        desirable_weight=weights[0],
        undesirable_weight=weights[1],
        lora=s.lora,
    )
    assert (ref.metrics["kl"] > 0) != start  # the KL term is exercised (not clamped to 0) away from the start
    assert_close_loss(loss, ref.loss)
    assert_grads_close(grads, ref.grads)
    assert_metrics(metrics, ref.metrics, KTO_METRICS)


# ------------------------------------------------------------------ GRPO


GRPO_CASES = [
    # kind, loss_type, beta, off-policy
    ("full", "dapo", 0.0, False),
    ("full", "dapo", 0.04, True),
    ("full", "grpo", 0.0, True),
    ("full", "grpo", 0.04, False),
    ("lora", "dapo", 0.04, True),
    ("lora", "grpo", 0.04, False),
    # toy's other two normalisations
    ("full", "bnpo", 0.04, True),
    ("full", "dr_grpo", 0.0, True),
]
MAX_COMPLETION = 16  # dr_grpo's normaliser (TRL's max_completion_length)


@pytest.mark.parametrize(("kind", "loss_type", "beta", "off_policy"), GRPO_CASES)
def test_grpo_equals_trl(tiny, rt, kind, loss_type, beta, off_policy):
    rng = np.random.default_rng(40)
    P, G = 5, 3  # prompt length (one for all, as TRL's left-padded prompts without padding), group size
    prompts = [ids(rng, P) for _ in range(2)]
    rows = [p for p in prompts for _ in range(G)]
    completions = [ids(rng, int(rng.integers(2, 12))) for _ in rows]
    rewards = rng.standard_normal(len(rows))
    groups = rewards.reshape(-1, G)
    adv = ((groups - groups.mean(1, keepdims=True)) / (groups.std(1, ddof=1, keepdims=True) + 1e-4)).reshape(-1)
    B = len(rows)
    b = sequence_batch(
        [(np.asarray(p + c), np.arange(P + len(c)) >= P) for p, c in zip(rows, completions, strict=True)], T
    )
    b.advantages = adv.astype(np.float32)
    s = setup(tiny, kind, seed=6)
    eng = engine(rt, s, B, GRPOLoss(beta=beta, loss_type=loss_type, max_completion_length=MAX_COMPLETION))
    try:
        now = eng.token_logps(b)
        old = now
        if off_policy:
            old = (now + rng.uniform(-0.5, 0.5, now.shape) * (b.loss_mask > 0)).astype(np.float32)
        b.old_logps = old
        if beta:
            with eng.swapped(s.reference):
                b.ref_logps = eng.token_logps(b)
        loss, grads = eng.gradients([b])
        metrics = eng.objective.metrics()
    finally:
        eng.close()
    width = max(len(c) for c in completions)
    cols = slice(P - 1, P - 1 + width)  # toy's position of completion token k is P - 1 + k
    trl_old = np.pad(old, ((0, 0), (0, width)))[:, cols] if off_policy else None
    ref = trl_ref.grpo(
        tiny.hf,
        s.policy,
        s.ref_weights,
        rows,
        completions,
        adv,
        beta=beta,
        loss_type=loss_type,
        old_logps=trl_old,
        max_completion_length=MAX_COMPLETION,
        lora=s.lora,
    )
    if beta:
        np.testing.assert_allclose(
            np.pad(b.ref_logps, ((0, 0), (0, width)))[:, cols], ref.extra["ref_logps"], atol=2e-5
        )
    if off_policy:  # the clip range is crossed
        assert ref.metrics["clip_ratio/region_mean"] > 0
    assert_close_loss(loss, ref.loss)
    assert_grads_close(grads, ref.grads)
    names = {"clip_ratio": "clip_ratio/region_mean"} | ({"kl": "kl"} if beta else {})
    assert_metrics(metrics, ref.metrics, names)
