"""Any registered architecture as a training model: parameters,
initialization, logits.

The graph is ``toy.models.common.forward_batch`` (the architecture's own
``forward`` with batched attention, the same forward the inference engine
runs), so a checkpoint trained here is the model ``toy infer`` and llama.cpp
run. Nothing here knows an architecture: names, shapes and kinds come from
``arch.params(cfg)``.

Initialization (seeded, ``np.random.default_rng(seed)``, tensors drawn in
``params`` order), by kind: ``matrix`` and ``embedding`` from N(0, 0.02²);
``residual`` (the projections that write into the residual stream) from
N(0, (0.02 / sqrt(2 * n_layer))²) as GPT-2 does; ``position`` (learned
absolute positions) from N(0, 0.01²) as GPT-2 does; norm gains 1; norm
shifts and biases 0.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import numpy as np

import toy_ggml
from toy import models
from toy.models.common import forward_batch
from toy.train.config import resolve_shape
from toy.train.stepgraph import BatchInputs, ParamSpec, TokenFeed


class ArchTrain:
    """``TrainModel`` for a config of any registered architecture (RoPE
    scaling is not trained). ``frozen`` (name -> bound ggml tensor,
    optional): weights used as they are and not trained (a full fine-tune
    with frozen embeddings); every other tensor of ``arch.params`` is a
    parameter."""

    def __init__(self, cfg, frozen: Mapping[str, toy_ggml.Tensor] | None = None):
        self.cfg = cfg
        self.arch = models.of(cfg)
        self.n_vocab = cfg.n_vocab
        self.frozen = dict(frozen or {})
        self.feed = TokenFeed.for_config(cfg)
        self.gemm = True  # F32 products on toy's CPU GEMM where the runtime computes on the CPU (TrainModel.gemm)

    def param_specs(self) -> list[ParamSpec]:
        return [ParamSpec(n, p.shape, p.kind) for n, p in self.arch.params(self.cfg).items() if n not in self.frozen]

    def logits(
        self, ctx, params: Mapping[str, toy_ggml.Tensor], inputs: BatchInputs, training: bool = True, taps=None
    ) -> toy_ggml.Tensor:
        """``taps`` (optional list): receives the residual stream after each
        block, (N, d) (the diagnostics' activation statistics)."""
        weights = {**self.frozen, **params} if self.frozen else params
        return forward_batch(
            ctx, self.cfg, weights, inputs.tokens, inputs.pos, inputs.masks, inputs.batch, keep=inputs.keep, taps=taps
        )


def model_config(shape, n_vocab: int, context: int) -> Any:
    """The config a from-scratch run trains: ``shape`` a
    ``toy.train.config.ModelShape`` (its ``arch``, preset and/or dimensions),
    the context length = the training context."""
    return models.get_language_model(shape.arch).train_config(resolve_shape(shape), n_vocab, context)


def init_params(cfg, seed: int, std: float = 0.02) -> dict[str, np.ndarray]:
    """Seeded random starting values (see the module docstring)."""
    rng = np.random.default_rng(seed)
    stds = {"matrix": std, "embedding": std, "residual": std / math.sqrt(2 * cfg.n_layer), "position": 0.01}
    out: dict[str, np.ndarray] = {}
    for name, p in models.of(cfg).params(cfg).items():
        if p.kind == "norm":
            out[name] = np.ones(p.shape, np.float32)
        elif p.kind in ("bias", "norm_bias"):
            out[name] = np.zeros(p.shape, np.float32)
        else:
            out[name] = (rng.standard_normal(p.shape) * stds[p.kind]).astype(np.float32)
    return out


__all__ = ["ArchTrain", "init_params", "model_config"]
