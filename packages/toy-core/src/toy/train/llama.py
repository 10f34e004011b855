"""The llama family as a training model: parameters, initialization, logits.

The graph is ``toy.models.llama.forward_batch`` (the same ``forward`` the
inference engine runs, with 4-D batched attention), so a checkpoint trained
here is the model ``toy infer`` and llama.cpp run.

Initialization (seeded, ``np.random.default_rng(seed)``, tensors drawn in
``param_shapes`` order): matrices and the embedding from N(0, 0.02²), the
two projections that write into the residual stream (``attn_output``,
``ffn_down``) from N(0, (0.02 / sqrt(2 * n_layer))²) as GPT-2 does, norm
gains 1, biases 0.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import numpy as np

import toy_ggml
from toy.models.llama import LlamaConfig, forward_batch, param_shapes
from toy.train.engine import BatchInputs, ParamSpec


def _kind(name: str, shape: tuple[int, ...]) -> str:
    if name == "token_embd.weight":
        return "embedding"
    if name.endswith(".bias"):
        return "bias"
    return "matrix" if len(shape) == 2 else "norm"


class LlamaTrain:
    """``TrainModel`` for a ``LlamaConfig`` (RoPE scaling is not trained).
    ``frozen`` (name -> bound ggml tensor, optional): weights used as they
    are and not trained (a full fine-tune with frozen embeddings); every
    other weight of ``param_shapes`` is a parameter."""

    def __init__(self, cfg: LlamaConfig, frozen: Mapping[str, toy_ggml.Tensor] | None = None):
        self.cfg = cfg
        self.n_vocab = cfg.n_vocab
        self.frozen = dict(frozen or {})

    def param_specs(self) -> list[ParamSpec]:
        return [ParamSpec(n, s, _kind(n, s)) for n, s in param_shapes(self.cfg).items() if n not in self.frozen]

    def logits(
        self, ctx, params: Mapping[str, toy_ggml.Tensor], inputs: BatchInputs, training: bool = True
    ) -> toy_ggml.Tensor:
        weights = {**self.frozen, **params} if self.frozen else params
        return forward_batch(
            ctx, self.cfg, weights, inputs.tokens, inputs.pos, inputs.mask, inputs.batch, keep=inputs.keep
        )


def model_config(shape, n_vocab: int, context: int) -> LlamaConfig:
    """The LlamaConfig a from-scratch run trains: ``shape`` a
    ``toy.train.config.ModelShape`` (preset and/or dimensions), RoPE over the
    whole head in llama's "normal" pairing (what llama.cpp runs for
    ``general.architecture = llama``), the context length = the training
    context."""
    from toy.train.config import resolve_shape

    d = resolve_shape(shape)
    return LlamaConfig(
        n_vocab=n_vocab,
        d_model=d["d_model"],
        n_layer=d["n_layer"],
        n_head=d["n_head"],
        n_head_kv=d["n_head_kv"],
        head_dim=d["head_dim"],
        d_ff=d["d_ff"],
        rms_eps=d["norm_eps"],
        rope_base=d["rope_base"],
        rope_dims=d["head_dim"],
        rope_mode="normal",
        tied_output=d["tied_output"],
        context_length=context,
    )


def init_params(cfg: LlamaConfig, seed: int, std: float = 0.02) -> dict[str, np.ndarray]:
    """Seeded random starting values (see the module docstring)."""
    rng = np.random.default_rng(seed)
    out_std = std / math.sqrt(2 * cfg.n_layer)
    out: dict[str, np.ndarray] = {}
    for name, shape in param_shapes(cfg).items():
        kind = _kind(name, shape)
        if kind == "norm":
            out[name] = np.ones(shape, np.float32)
        elif kind == "bias":
            out[name] = np.zeros(shape, np.float32)
        else:
            s = out_std if name.endswith(("attn_output.weight", "ffn_down.weight")) else std
            out[name] = (rng.standard_normal(shape) * s).astype(np.float32)
    return out


__all__ = ["LlamaTrain", "init_params", "model_config"]
