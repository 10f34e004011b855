"""Training objectives on sequence log-probabilities: preference losses
(DPO, ORPO, KTO) and GRPO's clipped policy gradient.

Supervised recipes train on next-token cross-entropy; these objectives
train on the log-probability a model gives to whole completions. Each is
built inside the step graph, after the model's logits, so ggml's autograd
gives the gradient of every trained parameter in the same single forward
and backward pass as cross-entropy (``toy.train.stepgraph.TrainEngine``
takes one as ``objective=``).

Per-token log-probabilities. For a micro-batch of B rows x T positions the
engine hands the objective ``lp`` (B, T): the log-probability of each
position's target token,

    lp[b, t] = log(sum_j softmax(logits[b, t])_j * onehot(target)_j + 1e-30) * keep[b, t]

(``keep`` is the batch's loss mask, so a position without a target gives 0
and no gradient). The 1e-30 keeps a probability that underflows float32
(a log-probability below about -69) finite: such a token then reads -69
and passes no gradient. Completions the model could have produced are far
above that floor; the floor is the reason the preference losses do not use
ggml's fused cross-entropy, which gives only a batch sum.

Batches (``toy.train.prefdata.PrefBatch``): ``toy.train.data.Batch`` with
one sequence per row, the loss mask on the completion's targets, and extra
arrays an objective reads (see each class): ``ref_logps`` (B,) the
reference model's sequence log-probabilities, ``completion_mask`` (B, T)
(ORPO: its loss mask covers the whole chosen sequence, the completion mask
only the completion), ``desirable`` and ``kl`` (KTO), ``advantages``,
``old_logps`` and ``ref_logps`` per token (GRPO). Pairs are laid out as
B = 2P rows: rows [0, P) the chosen completions, rows [P, 2P) the rejected
ones, row i and row i + P one pair.

Padding. A row without any loss token is padding (an evaluation's last
batch is filled up with such rows; a pair pads both its rows): it adds
nothing to the loss, to the count a loss is averaged over, or to a metric.

Normalisation. ``begin_step`` sees all micro-batches of an optimizer step
first, so a loss that TRL averages over a batch (pairs, rows, tokens) is
averaged over the whole step here: with one micro-batch per step the loss
is TRL's; with accumulation it is the mean over the step's units (where
TRL's trainer averages micro-batch means).

The formulas and their sources (each class's docstring says which TRL
variant it equals; ``packages/toy-core/tests/test_pref_trl.py`` checks the
loss and every gradient against TRL 1.16 on the same batch):

- ``DPOLoss``: DPO (Rafailov et al. 2023), loss types sigmoid, ipo, robust
  (label smoothing: Chowdhury et al.'s robust DPO) and hinge;
- ``ORPOLoss``: ORPO (Hong et al. 2024): the chosen sequences' NLL plus
  lambda times the odds-ratio term, no reference model;
- ``KTOLoss``: KTO (Ethayarajh et al. 2024) with the reference-point KL
  estimate of a mismatched batch (a constant of the step);
- ``GRPOLoss``: GRPO (Shao et al. 2024) clipped surrogate with TRL's
  token-level normalisations and an optional k3 KL penalty to a reference.

The scalar pieces are composed from ops that ggml differentiates:
``softplus(x) = log(1 + exp(x - o)) + o`` with ``o = relu(x - 30)`` (exp
never overflows; the one kink is at x = 30, where softplus' derivative is 1
to 1e-13: the textbook ``relu(x) + log(1 + exp(-|x|))`` has ggml's
derivative 0 at x = 0 (relu'(0) = 0 on both sides), exactly where every
DPO and KTO run starts, policy = reference, so the first step's gradient
would be 0 and a LoRA adapter, B = 0, would never move),
``log sigmoid(x) = -softplus(-x)``, ``sigmoid(x) = exp(-softplus(-x))``,
``min(a, b) = a - relu(a - b)`` (at a = b the gradient is a's; GRPO's
ratio at 1 lies inside the clip range, where both sides' are equal).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np

import toy_ggml
from toy.train.config import DPO_LOSSES, GRPO_LOSSES

F32 = toy_ggml.GGMLType.F32
#: added to a target's probability before the log (module docstring)
PROB_FLOOR = 1e-30


def target_logps(ops: toy_ggml.Context, logits, labels, keep, batch: int, context: int, scale: float = 1.0):
    """``lp`` (B, T): the log-probability of each row's target, 0 off the mask
    (module docstring). ``labels`` (N, V) one-hot rows (zero without a
    target), ``keep`` (N, 1); ``scale`` multiplies the logits first (1 /
    the sampling temperature: GRPO)."""
    p = ops.soft_max(logits, scale=scale)
    pt = ops.sum_rows(ops.mul(p, labels))  # (N, 1): the target's probability
    lp = ops.mul(ops.log(ops.scale(pt, 1.0, PROB_FLOOR)), keep)
    return ops.reshape(lp, (batch, context))


def target_logps_from_ids(ops: toy_ggml.Context, logits, rows, keep, batch: int, context: int, scale: float = 1.0):
    """``target_logps`` from the targets' ids: ``rows`` (N, 1) I32, each row's
    target (any valid id where ``keep`` is 0). The target's probability is
    gathered (``get_rows`` of the softmax viewed as N matrices of V one-value
    rows) instead of summed against a one-hot row: the same value, since that
    sum adds only the target's term to zeros."""
    n, v = logits.shape
    p = ops.soft_max(logits, scale=scale)
    pt = ops.reshape(ops.get_rows(ops.reshape(p, (n, v, 1)), rows), (n, 1))
    lp = ops.mul(ops.log(ops.scale(pt, 1.0, PROB_FLOOR)), keep)
    return ops.reshape(lp, (batch, context))


# ------------------------------------------------------------------ scalar pieces


#: where softplus switches from log(1 + exp(x)) to x (module docstring)
SOFTPLUS_KNEE = 30.0


def softplus(ops, x):
    """log(1 + exp(x)) for any x, differentiable at 0 (module docstring)."""
    over = ops.relu(ops.scale(x, 1.0, -SOFTPLUS_KNEE))
    return ops.add(ops.log(ops.scale(ops.exp(ops.sub(x, over)), 1.0, 1.0)), over)


def log_sigmoid(ops, x):
    return ops.neg(softplus(ops, ops.neg(x)))


def sigmoid(ops, x):
    return ops.exp(ops.neg(softplus(ops, ops.neg(x))))


def _min(ops, a, b):
    return ops.sub(a, ops.relu(ops.sub(a, b)))


def _rows(ops, t, start: int, n: int):
    """Rows [start, start + n) of a (B, 1) tensor."""
    return ops.view(t, (n, 1), offset=start * 4)


# ------------------------------------------------------------------ protocol


class Objective(Protocol):
    """What ``TrainEngine`` asks of an objective (the module docstring)."""

    name: str

    def make(self, ctx: toy_ggml.Context, batch: int, context: int) -> None:
        """Create the input tensors in ``ctx`` (allocated by the engine)."""
        ...

    def begin_step(self, micro_batches: Sequence[Any]) -> None:
        """Before an optimizer step (or a gradient probe, or an evaluation
        of one batch): see every micro-batch (step-level normalisers) and
        reset the step's metrics."""
        ...

    def upload(self, batch: Any) -> None:
        """Set the input tensors from one micro-batch."""
        ...

    def loss(self, ops: toy_ggml.Context, lp) -> tuple[Any, dict[str, Any]]:
        """(the scalar loss of the micro-batch, {name: tensor} outputs the
        metrics read) from ``lp`` (B, T)."""
        ...

    def collect(self, outputs: dict[str, np.ndarray], batch: Any) -> None:
        """Accumulate one micro-batch's outputs into the step's metrics."""
        ...

    def metrics(self) -> dict[str, float]:
        """The step's metrics (after every micro-batch was collected)."""
        ...

    def describe(self) -> dict[str, Any]:
        """The objective and its hyper-parameters (for run_start)."""
        ...


def _need(batch: Any, name: str, what: str) -> np.ndarray:
    v = getattr(batch, name, None)
    if v is None:
        raise ValueError(f"{what}: the batch has no {name!r}")
    return np.asarray(v)


def _pairs(batch: Any, what: str) -> int:
    B = np.asarray(batch.tokens).shape[0]
    if B % 2:
        raise ValueError(f"{what}: a pair batch has an even number of rows (chosen, then rejected), got {B}")
    return B // 2


def _real_rows(batch: Any) -> np.ndarray:
    """1.0 for a row that has a loss token, 0.0 for a padding row (an
    evaluation's last batch is padded with rows without any)."""
    return (np.asarray(batch.loss_mask).reshape(np.asarray(batch.tokens).shape).sum(axis=1) > 0).astype(np.float32)


def _real_pairs(batch: Any) -> np.ndarray:
    """1.0 for a pair whose rows have loss tokens, 0.0 for a padding pair
    (both rows empty); a pair with one empty row is malformed."""
    r = _real_rows(batch)
    P = r.size // 2
    if (r[:P] != r[P:]).any():
        raise ValueError("a pair batch has a pair with one empty row (chosen and rejected both carry loss or neither)")
    return r[:P]


def _completion_mask(batch: Any) -> np.ndarray:
    cm = getattr(batch, "completion_mask", None)
    return np.asarray(batch.loss_mask if cm is None else cm, np.float32)


class _Base:
    name = ""

    def __init__(self) -> None:
        self._t: dict[str, Any] = {}
        self._shape = (0, 0)
        self._acc: dict[str, list[float]] = {}

    def _input(self, ctx, key: str, shape: tuple[int, ...]) -> None:
        self._t[key] = ctx.tensor(F32, shape, name=f"objective.{key}")

    def _set(self, key: str, value) -> None:
        self._t[key].set(np.asarray(value, np.float32).reshape(self._t[key].shape))

    def _add(self, **values: float) -> None:
        for k, v in values.items():
            self._acc.setdefault(k, []).append(float(v))

    def metrics(self) -> dict[str, float]:
        return {k: float(np.mean(v)) for k, v in self._acc.items() if v}


# ------------------------------------------------------------------ DPO


class DPOLoss(_Base):
    """DPO on pair batches. With h = (lp_c - ref_c) - (lp_r - ref_r), the
    sequence log-ratio margin (sums over each completion's tokens):

    - ``sigmoid``: -log sigmoid(beta h) (the DPO paper; TRL's "sigmoid");
    - ``ipo``: (h' - 1 / (2 beta))^2 with h' the margin of per-token
      averages (each log-ratio divided by its completion's token count, as
      TRL's "ipo");
    - ``robust``: (-(1 - e) log sigmoid(beta h) + e log sigmoid(-beta h)) /
      (1 - 2e), e = ``label_smoothing`` in [0, 0.5) (TRL's "robust");
    - ``hinge``: relu(1 - beta h) (TRL's "hinge").

    The loss is the mean over the step's pairs. Metrics (means over the
    step's pairs, TRL's names without the "rewards/" prefix):
    rewards_chosen = beta (lp_c - ref_c), rewards_rejected, margin (their
    difference), accuracy (share of pairs with rewards_chosen >
    rewards_rejected)."""

    name = "dpo"

    def __init__(self, beta: float = 0.1, loss_type: str = "sigmoid", label_smoothing: float = 0.0):
        super().__init__()
        if loss_type not in DPO_LOSSES:
            raise ValueError(f"DPO loss type {loss_type!r} is not one of {', '.join(DPO_LOSSES)}")
        if not beta > 0:
            raise ValueError(f"DPO beta={beta} must be > 0")
        if loss_type == "robust" and not 0.0 <= label_smoothing < 0.5:
            raise ValueError(f"label_smoothing={label_smoothing} must be in [0, 0.5) for the robust loss")
        if loss_type != "robust" and label_smoothing != 0.0:
            raise ValueError(f"label_smoothing applies to the robust loss only (loss type {loss_type!r})")
        self.beta, self.loss_type, self.label_smoothing = float(beta), loss_type, float(label_smoothing)

    def describe(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "beta": self.beta,
            "loss_type": self.loss_type,
            "label_smoothing": self.label_smoothing,
        }

    def make(self, ctx, batch: int, context: int) -> None:
        if batch % 2:
            raise ValueError(f"DPO: a pair batch has an even number of rows (chosen, then rejected), got {batch}")
        self._shape = (batch, context)
        self._input(ctx, "ref", (batch, 1))
        self._input(ctx, "cmask", (batch, context))
        self._input(ctx, "inv_len", (batch, 1))
        self._input(ctx, "weight", (batch // 2, 1))  # 1 / the step's pairs; 0 for a padding pair

    def begin_step(self, micro_batches) -> None:
        self._n = sum(float(_real_pairs(b).sum()) for b in micro_batches if _pairs(b, "DPO"))
        if self._n == 0:
            raise ValueError("DPO: the step has no pair with loss tokens")
        self._acc = {}

    def upload(self, batch) -> None:
        _pairs(batch, "DPO")
        real = _real_pairs(batch)
        ref = _need(batch, "ref_logps", "DPO")
        cm = _completion_mask(batch)
        self._set("ref", np.where(np.concatenate([real, real]) > 0, ref, 0.0))
        self._set("cmask", cm)
        self._set("inv_len", 1.0 / np.maximum(cm.sum(axis=1), 1.0))
        self._set("weight", real / self._n)

    def loss(self, ops, lp):
        B, _ = self._shape
        P = B // 2
        t = self._t
        seq = ops.sum_rows(ops.mul(lp, t["cmask"]))  # (B, 1)
        ratio = ops.sub(seq, t["ref"])
        if self.loss_type == "ipo":
            ratio = ops.mul(ratio, t["inv_len"])
        h = ops.sub(_rows(ops, ratio, 0, P), _rows(ops, ratio, P, P))
        b = self.beta
        if self.loss_type == "sigmoid":
            per = softplus(ops, ops.scale(h, -b))
        elif self.loss_type == "ipo":
            per = ops.sqr(ops.scale(h, 1.0, -1.0 / (2.0 * b)))
        elif self.loss_type == "robust":
            e = self.label_smoothing
            clean = ops.scale(softplus(ops, ops.scale(h, -b)), (1.0 - e) / (1.0 - 2.0 * e))
            flip = ops.scale(softplus(ops, ops.scale(h, b)), e / (1.0 - 2.0 * e))
            per = ops.sub(clean, flip)
        else:  # hinge
            per = ops.relu(ops.scale(h, -b, 1.0))
        return ops.sum(ops.mul(per, t["weight"])), {"seq_logps": seq}

    def collect(self, outputs, batch) -> None:
        seq = outputs["seq_logps"].reshape(-1).astype(np.float64)
        ref = np.asarray(batch.ref_logps, np.float64).reshape(-1)
        P = seq.size // 2
        r = self.beta * (seq - ref)
        rc, rr = r[:P], r[P:]
        real = _real_pairs(batch)
        for i in range(P):
            if not real[i]:
                continue
            self._add(rewards_chosen=rc[i], rewards_rejected=rr[i], margin=rc[i] - rr[i], accuracy=rc[i] > rr[i])
            self._add(logps_chosen=seq[i], logps_rejected=seq[P + i])


# ------------------------------------------------------------------ ORPO


class ORPOLoss(_Base):
    """ORPO on pair batches (TRL's ORPOTrainer, ``trl.experimental.orpo``):

        loss = NLL(chosen) - lambda * mean log sigmoid(log_odds)
        log_odds = (a_c - a_r) - (log(1 - exp(a_c)) - log(1 - exp(a_r)))

    a_c, a_r: the average log-probability per completion token (completion
    mask). The NLL is the mean over every target of the chosen rows' loss
    mask — TRL takes the whole chosen sequence, prompt included, so the
    batch's loss mask covers the chosen rows' prompt and completion and its
    ``completion_mask`` the completions. No reference model. ``lam`` is
    TRL's ``beta``. Metrics: nll, log_odds_ratio (mean log sigmoid),
    log_odds_chosen, rewards_chosen = lambda a_c, rewards_rejected,
    margin, accuracy."""

    name = "orpo"

    def __init__(self, lam: float = 0.1):
        super().__init__()
        if not lam >= 0:
            raise ValueError(f"ORPO lambda={lam} must be >= 0")
        self.lam = float(lam)

    def describe(self) -> dict[str, Any]:
        return {"name": self.name, "lambda": self.lam}

    def make(self, ctx, batch: int, context: int) -> None:
        if batch % 2:
            raise ValueError(f"ORPO: a pair batch has an even number of rows (chosen, then rejected), got {batch}")
        self._shape = (batch, context)
        self._input(ctx, "cmask", (batch, context))
        self._input(ctx, "inv_len", (batch, 1))
        self._input(ctx, "pad", (batch, 1))
        self._input(ctx, "nll_mask", (batch, context))  # the chosen rows' loss mask scaled by -1 / n_nll_step
        self._input(ctx, "weight", (batch // 2, 1))  # lambda / the step's pairs; 0 for a padding pair

    def begin_step(self, micro_batches) -> None:
        self._n = sum(float(_real_pairs(b).sum()) for b in micro_batches if _pairs(b, "ORPO"))
        if self._n == 0:
            raise ValueError("ORPO: the step has no pair with loss tokens")
        self._n_nll = 0.0
        for b in micro_batches:
            P = _pairs(b, "ORPO")
            self._n_nll += float(np.count_nonzero(np.asarray(b.loss_mask)[:P]))
        if self._n_nll == 0:
            raise ValueError("ORPO: the chosen sequences have no target token")
        self._acc = {}

    def upload(self, batch) -> None:
        P = _pairs(batch, "ORPO")
        real = _real_pairs(batch)
        cm = _completion_mask(batch)
        n = cm.sum(axis=1)
        rows = np.concatenate([real, real]) > 0
        if (n[rows] == 0).any():
            raise ValueError("ORPO: a row has an empty completion")
        nll = np.zeros_like(cm)
        nll[:P] = (np.asarray(batch.loss_mask)[:P] > 0) * (-1.0 / self._n_nll)
        self._set("cmask", cm)
        # a padding row: average 0 (its completion mask is empty), so log(1 - exp(0)) would be -inf; -1 keeps it finite
        self._set("inv_len", np.where(rows, 1.0 / np.maximum(n, 1.0), 0.0))
        self._set("nll_mask", nll)
        self._set("pad", (~rows).astype(np.float32))
        self._set("weight", real * (self.lam / self._n))

    def loss(self, ops, lp):
        B, _ = self._shape
        P = B // 2
        t = self._t
        avg = ops.mul(ops.sum_rows(ops.mul(lp, t["cmask"])), t["inv_len"])  # (B, 1), < 0 (0: a padding row)
        avg = ops.sub(avg, t["pad"])  # -1 on a padding row (finite odds; its weight is 0)
        log1mexp = ops.log(ops.scale(ops.exp(avg), -1.0, 1.0))
        odds = ops.sub(avg, log1mexp)
        log_odds = ops.sub(_rows(ops, odds, 0, P), _rows(ops, odds, P, P))
        ratio = log_sigmoid(ops, log_odds)
        nll = ops.sum(ops.mul(lp, t["nll_mask"]))
        loss = ops.sub(nll, ops.sum(ops.mul(ratio, t["weight"])))
        return loss, {"avg_logps": avg, "nll": nll}

    def collect(self, outputs, batch) -> None:
        avg = outputs["avg_logps"].reshape(-1).astype(np.float64)
        P = avg.size // 2
        ac, ar = avg[:P], avg[P:]
        lo = (ac - ar) - (np.log1p(-np.exp(ac)) - np.log1p(-np.exp(ar)))
        ls = -np.logaddexp(0.0, -lo)
        self._add(nll=float(outputs["nll"].reshape(-1)[0]))
        real = _real_pairs(batch)
        for i in range(P):
            if not real[i]:
                continue
            rc, rr = self.lam * ac[i], self.lam * ar[i]
            self._add(rewards_chosen=rc, rewards_rejected=rr, margin=rc - rr, accuracy=rc > rr)
            self._add(log_odds_ratio=ls[i], log_odds_chosen=lo[i])

    def metrics(self) -> dict[str, float]:
        m = super().metrics()
        if "nll" in m:  # a sum of micro-batch parts, not a mean
            m["nll"] = float(np.sum(self._acc["nll"]))
        return m


# ------------------------------------------------------------------ KTO


class KTOLoss(_Base):
    """KTO on unpaired batches (TRL's KTOTrainer, loss type "kto"): with
    r_i = lp_i - ref_i (sequence log-ratios) and z0 the batch's KL estimate
    (``batch.kl``: max(0, mean over a mismatched batch of policy minus
    reference sequence log-probs), a constant of the step as TRL detaches
    it), a desirable row loses w_d (1 - sigmoid(beta (r_i - z0))), an
    undesirable one w_u (1 - sigmoid(beta (z0 - r_i))); the loss is the
    mean over the step's rows. Metrics: rewards_chosen / rewards_rejected
    (beta r over desirable / undesirable rows), kl, and margin."""

    name = "kto"

    def __init__(self, beta: float = 0.1, desirable_weight: float = 1.0, undesirable_weight: float = 1.0):
        super().__init__()
        if not beta > 0:
            raise ValueError(f"KTO beta={beta} must be > 0")
        if desirable_weight < 0 or undesirable_weight < 0:
            raise ValueError("KTO weights must be >= 0")
        self.beta, self.wd, self.wu = float(beta), float(desirable_weight), float(undesirable_weight)

    def describe(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "beta": self.beta,
            "desirable_weight": self.wd,
            "undesirable_weight": self.wu,
        }

    def make(self, ctx, batch: int, context: int) -> None:
        self._shape = (batch, context)
        self._input(ctx, "ref", (batch, 1))
        self._input(ctx, "cmask", (batch, context))
        self._input(ctx, "kl", (batch, 1))
        self._input(ctx, "sign", (batch, 1))  # -beta for a desirable row, +beta for an undesirable one
        self._input(ctx, "weight", (batch, 1))  # w / n_rows_step

    def begin_step(self, micro_batches) -> None:
        self._n = sum(float(_real_rows(b).sum()) for b in micro_batches)
        if self._n == 0:
            raise ValueError("KTO: the step has no example with loss tokens")
        self._acc = {}

    def upload(self, batch) -> None:
        B = self._shape[0]
        real = _real_rows(batch)
        d = _need(batch, "desirable", "KTO").astype(bool).reshape(-1)
        kl = getattr(batch, "kl", None)
        if kl is None:
            raise ValueError("KTO: the batch has no 'kl' (the run sets it before each step)")
        self._set("ref", np.where(real > 0, _need(batch, "ref_logps", "KTO").reshape(-1), 0.0))
        self._set("cmask", _completion_mask(batch))
        self._set("kl", np.full(B, float(kl)))
        self._set("sign", np.where(d, -self.beta, self.beta))
        self._set("weight", real * np.where(d, self.wd, self.wu) / self._n)

    def loss(self, ops, lp):
        t = self._t
        seq = ops.sum_rows(ops.mul(lp, t["cmask"]))
        x = ops.mul(ops.sub(ops.sub(seq, t["ref"]), t["kl"]), t["sign"])  # -beta (r - z0) or beta (r - z0)
        per = sigmoid(ops, x)  # 1 - sigmoid(-x)
        return ops.sum(ops.mul(per, t["weight"])), {"seq_logps": seq}

    def collect(self, outputs, batch) -> None:
        seq = outputs["seq_logps"].reshape(-1).astype(np.float64)
        r = self.beta * (seq - np.asarray(batch.ref_logps, np.float64).reshape(-1))
        d = np.asarray(batch.desirable).astype(bool).reshape(-1)
        real = _real_rows(batch)
        self._add(kl=float(batch.kl))
        for i in range(seq.size):
            if real[i]:
                self._add(**{"rewards_chosen" if d[i] else "rewards_rejected": r[i]})

    def metrics(self) -> dict[str, float]:
        m = super().metrics()
        if "rewards_chosen" in m and "rewards_rejected" in m:
            m["margin"] = m["rewards_chosen"] - m["rewards_rejected"]
        return m


# ------------------------------------------------------------------ GRPO


class GRPOLoss(_Base):
    """GRPO's clipped surrogate on rollout batches (TRL's GRPOTrainer with
    importance sampling at token level). Per completion token, with
    ratio = exp(lp - old) and A the row's advantage:

        l = -min(ratio A, clamp(ratio, 1 - epsilon, 1 + epsilon_high) A)
            + beta (exp(ref - lp) - (ref - lp) - 1)

    (the KL term, TRL's k3 estimator, only when beta > 0). Normalisation
    (``loss_type``, TRL's names): ``dapo`` (TRL's default) sums over the
    step's completion tokens and divides by their count; ``grpo`` averages
    each completion over its tokens, then over the step's completions;
    ``bnpo`` divides each micro-batch's sum by its own token count and the
    number of micro-batches; ``dr_grpo`` by rows x ``max_completion_length``
    and the number of micro-batches. ``old_logps`` (B, T) is required:
    the policy's per-token log-probs when the rollouts were made (for the
    first optimizer step on a rollout batch they equal the current ones, so
    the ratio is 1, as TRL's detached copy). ``bias_correction_kl`` (TRL's
    ``use_bias_correction_kl``, on by default there and here) multiplies
    the KL term by the ratio (differentiable: it changes the gradient even
    where the ratio is 1). ``temperature``: the log-probs are those of the
    logits divided by it, the distribution the rollouts were sampled from
    (TRL's GRPOConfig.temperature). Metrics: clip_ratio (share of
    completion tokens where the clipped term was taken), kl (mean k3 when
    beta > 0)."""

    name = "grpo"

    def __init__(
        self,
        beta: float = 0.0,
        epsilon: float = 0.2,
        epsilon_high: float | None = None,
        loss_type: str = "dapo",
        max_completion_length: int | None = None,
        *,
        bias_correction_kl: bool = True,
        temperature: float = 1.0,
    ):
        super().__init__()
        if not temperature > 0:
            raise ValueError(f"GRPO temperature={temperature} must be > 0")
        self.bias_correction_kl, self.temperature = bool(bias_correction_kl), float(temperature)
        self.logit_scale = 1.0 / self.temperature
        if loss_type not in GRPO_LOSSES:
            raise ValueError(f"GRPO loss type {loss_type!r} is not one of {', '.join(GRPO_LOSSES)}")
        if beta < 0:
            raise ValueError(f"GRPO beta={beta} must be >= 0")
        if not 0 < epsilon < 1:
            raise ValueError(f"GRPO epsilon={epsilon} must be in (0, 1)")
        if loss_type == "dr_grpo" and not max_completion_length:
            raise ValueError("GRPO loss type dr_grpo needs max_completion_length")
        self.beta, self.epsilon = float(beta), float(epsilon)
        self.epsilon_high = float(epsilon if epsilon_high is None else epsilon_high)
        self.loss_type, self.max_completion_length = loss_type, max_completion_length

    def describe(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "beta": self.beta,
            "epsilon": self.epsilon,
            "epsilon_high": self.epsilon_high,
            "loss_type": self.loss_type,
            "bias_correction_kl": self.bias_correction_kl,
            "temperature": self.temperature,
        }

    def make(self, ctx, batch: int, context: int) -> None:
        self._shape = (batch, context)
        self._input(ctx, "old", (batch, context))
        self._input(ctx, "adv", (batch, 1))
        self._input(ctx, "wmask", (batch, context))  # completion mask x the row's normalising weight
        if self.beta > 0:
            self._input(ctx, "ref", (batch, context))

    def begin_step(self, micro_batches) -> None:
        self._k = len(micro_batches)
        self._rows = sum(float(_real_rows(b).sum()) for b in micro_batches)
        self._tokens = sum(float(_completion_mask(b).sum()) for b in micro_batches)
        if self._tokens == 0:
            raise ValueError("GRPO: the step has no completion token")
        self._acc = {}

    def upload(self, batch) -> None:
        cm = _completion_mask(batch)
        n = cm.sum(axis=1, keepdims=True)
        if self.loss_type == "dapo":
            w = np.full_like(n, 1.0 / self._tokens)
        elif self.loss_type == "grpo":
            w = 1.0 / (np.maximum(n, 1.0) * max(self._rows, 1.0))
        elif self.loss_type == "bnpo":
            w = np.full_like(n, 1.0 / (max(float(cm.sum()), 1.0) * self._k))
        else:  # dr_grpo
            assert self.max_completion_length
            w = np.full_like(n, 1.0 / (cm.shape[0] * self.max_completion_length * self._k))
        self._set("old", _need(batch, "old_logps", "GRPO") * (cm > 0))
        self._set("adv", _need(batch, "advantages", "GRPO"))
        self._set("wmask", cm * w)
        if self.beta > 0:
            self._set("ref", _need(batch, "ref_logps", "GRPO") * (cm > 0))

    def loss(self, ops, lp):
        t = self._t
        ratio = ops.exp(ops.sub(lp, t["old"]))
        clipped = ops.clamp(ratio, 1.0 - self.epsilon, 1.0 + self.epsilon_high)
        a = ops.mul(ratio, t["adv"])
        b = ops.mul(clipped, t["adv"])
        per = ops.neg(_min(ops, a, b))
        if self.beta > 0:
            d = ops.sub(t["ref"], lp)
            kl = ops.sub(ops.exp(d), ops.scale(d, 1.0, 1.0))
            if self.bias_correction_kl:
                kl = ops.mul(kl, ratio)
            per = ops.add(per, ops.scale(kl, self.beta))
        return ops.sum(ops.mul(per, t["wmask"])), {"token_logps": lp}

    def collect(self, outputs, batch) -> None:
        lp = outputs["token_logps"].astype(np.float64)
        cm = _completion_mask(batch) > 0
        old = np.asarray(batch.old_logps, np.float64)
        adv = np.asarray(batch.advantages, np.float64).reshape(-1, 1)
        ratio = np.exp(lp - old)
        lo, hi = 1.0 - self.epsilon, 1.0 + self.epsilon_high
        clipped = ((ratio < lo) & (adv < 0)) | ((ratio > hi) & (adv > 0))
        n = int(cm.sum())
        if n:
            self._add(clip_ratio=float(clipped[cm].sum()) / n)
            if self.beta > 0:
                d = np.asarray(batch.ref_logps, np.float64) - lp
                k3 = np.exp(d) - d - 1.0
                if self.bias_correction_kl:  # TRL's "kl" metric is of the term the loss uses
                    k3 = k3 * ratio
                self._add(kl=float(k3[cm].mean()))


__all__ = [
    "PROB_FLOOR",
    "SOFTPLUS_KNEE",
    "DPOLoss",
    "GRPOLoss",
    "KTOLoss",
    "ORPOLoss",
    "Objective",
    "log_sigmoid",
    "sigmoid",
    "softplus",
    "target_logps",
    "target_logps_from_ids",
]
