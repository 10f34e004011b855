"""AdamW settings and learning-rate schedules.

The optimizer itself runs inside the training graph (ggml's
``opt_step_adamw``, see ``toy.train.stepgraph``); this module holds its
settings and computes the per-step values the graph reads: the learning rate
from the schedule and AdamW's bias corrections.

Schedules (``lr_at(step)``, ``step`` counted from 0, the optimizer step about
to be taken):

- ``constant``: ``lr`` after a linear warmup;
- ``linear``: warmup, then linear decay from ``lr`` towards ``min_lr`` (reached
  one step after the last, so the last step still learns);
- ``cosine``: warmup, then half a cosine from ``lr`` towards ``min_lr`` (likewise);
- ``wsd`` (warmup-stable-decay): warmup, ``lr`` held, then a linear decay to
  ``min_lr`` over the last ``decay_fraction`` of the steps.

Warmup is linear from ``lr / warmup`` at step 0 to ``lr`` at step
``warmup - 1`` (no step runs at learning rate 0). AdamW is PyTorch's
decoupled form: ``w <- w * (1 - lr * wd) - lr * m_hat / (sqrt(v_hat) + eps)``;
weight decay applies to matrices only (norm gains, biases and, unless asked,
embeddings are not decayed: ``decay_embeddings``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from toy.errors import BadInputError

SCHEDULES = ("constant", "linear", "cosine", "wsd")


@dataclass(frozen=True)
class OptimConfig:
    lr: float = 1e-3
    min_lr: float = 0.0
    schedule: str = "cosine"
    warmup: int = 0
    decay_fraction: float = 0.2  # wsd: share of the steps spent decaying
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    weight_decay: float = 0.1
    decay_embeddings: bool = False
    grad_clip: float = 1.0  # global L2 norm; 0 turns clipping off

    def validate(self) -> OptimConfig:
        bad = None
        if self.schedule not in SCHEDULES:
            bad = f"schedule {self.schedule!r} is not one of {', '.join(SCHEDULES)}"
        elif not (self.lr > 0 and math.isfinite(self.lr)):
            bad = f"lr={self.lr} must be a positive number"
        elif not 0 <= self.min_lr <= self.lr:
            bad = f"min_lr={self.min_lr} must be in [0, lr={self.lr}]"
        elif self.warmup < 0:
            bad = f"warmup={self.warmup} must be >= 0"
        elif not 0 < self.decay_fraction <= 1:
            bad = f"decay_fraction={self.decay_fraction} must be in (0, 1]"
        elif not (0 <= self.beta1 < 1 and 0 <= self.beta2 < 1):
            bad = f"betas ({self.beta1}, {self.beta2}) must be in [0, 1)"
        elif not self.eps > 0:
            bad = f"eps={self.eps} must be > 0"
        elif not self.weight_decay >= 0:
            bad = f"weight_decay={self.weight_decay} must be >= 0"
        elif not self.grad_clip >= 0:
            bad = f"grad_clip={self.grad_clip} must be >= 0 (0 turns clipping off)"
        if bad:
            raise BadInputError(bad)
        return self


def lr_at(cfg: OptimConfig, step: int, total_steps: int) -> float:
    """The learning rate of optimizer step ``step`` (0-based) of ``total_steps``."""
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    if cfg.schedule == "constant":
        return cfg.lr
    if cfg.schedule == "wsd":
        n_decay = max(1, round(cfg.decay_fraction * total_steps))
        start = max(cfg.warmup, total_steps - n_decay)
        if step < start:
            return cfg.lr
        frac = min(1.0, (step - start + 1) / (total_steps - start + 1))
        return cfg.lr + (cfg.min_lr - cfg.lr) * frac
    # the fraction of the decay done before this step: 0 at the first step
    # after warmup, (n-1)/n at the last (the schedule would reach min_lr at
    # step total_steps, which is never taken: no step is wasted at min_lr 0)
    done = min(1.0, (step - cfg.warmup) / max(1, total_steps - cfg.warmup))
    if cfg.schedule == "linear":
        return cfg.lr + (cfg.min_lr - cfg.lr) * done
    return cfg.min_lr + 0.5 * (cfg.lr - cfg.min_lr) * (1.0 + math.cos(math.pi * done))  # cosine


def adamw_hparams(cfg: OptimConfig, lr: float, step: int, decay: bool) -> list[float]:
    """The 7 values ggml's opt_step_adamw reads for optimizer step ``step``
    (0-based): lr, beta1, beta2, eps, weight decay, and the bias corrections
    1/(1 - beta1^t), 1/(1 - beta2^t) with t = step + 1."""
    t = step + 1
    return [
        lr,
        cfg.beta1,
        cfg.beta2,
        cfg.eps,
        cfg.weight_decay if decay else 0.0,
        1.0 / (1.0 - cfg.beta1**t),
        1.0 / (1.0 - cfg.beta2**t),
    ]


__all__ = ["SCHEDULES", "OptimConfig", "adamw_hparams", "lr_at"]
