"""LoRA (and QLoRA) as a training model: a frozen GGUF base plus trainable
low-rank updates on chosen projections.

For every adapted weight W (NumPy (out, in)) of every block the model adds
A (r, in) and B (out, r): the product becomes ``W x + s · B (A (x ⊙ m))``
(the architecture forward's ``lora`` terms), with ``s = alpha / r``, or
``alpha / sqrt(r)`` with rank-stabilized scaling (rsLoRA), and ``m`` the
dropout mask (training steps only).

Invariants and decisions:

- The base is never copied: its tensors are the GGUF file's, bound by
  ``bind_tensors`` (zero-copy on the CPU, read-only), quantized types stay
  quantized — that is QLoRA. ggml computes the gradient that flows *through*
  a frozen quantized product (OUT_PROD on the quantized weight); no gradient
  of the base weights is ever formed (they are not ggml parameters), so a
  LoRA step leaves the base bit-identical.
- Initialization as PEFT's default: A uniform in ±1/sqrt(in) (Kaiming-uniform
  with a = √5), B = 0, so the step-0 model *is* the base model.
- Parameter names are the adapter file's tensor names (``<W>.lora_a``,
  ``<W>.lora_b``), so a checkpoint is an adapter llama.cpp loads; they decay
  with AdamW's weight decay like any matrix.
- Which weights can be adapted, and their widths, is the architecture's
  (``arch.lora_targets``: q/k/v/o/gate/up/down on the llama family,
  qkv/o/up/down on GPT-2).
- Dropout (``dropout > 0``) multiplies the input of A by a Bernoulli mask
  scaled by 1/(1-p), drawn per step from ``(seed, step, micro-batch)``;
  one mask per input site and layer (the target's ``site``), so the adapted
  products that read the same activation (q, k and v; gate and up) share it (PEFT draws one per
  module; the expectation is the same). Evaluation and samples run without
  dropout.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import numpy as np

import toy_ggml
from toy import models
from toy.errors import BadInputError
from toy.models.common import forward_batch
from toy.train.config import LoraConfig as LoraSettings  # the [lora] table of a run's config
from toy.train.stepgraph import BatchInputs, ParamSpec, TokenFeed

F32 = toy_ggml.GGMLType.F32


def targets_of(cfg) -> Mapping[str, models.LoraTarget]:
    """The architecture's LoRA targets: name -> ``LoraTarget``."""
    return models.language_model_of(cfg).lora_targets(cfg)


def adapted_weights(cfg, targets: list[str]) -> list[str]:
    """GGUF names of the adapted weights, block by block, in target order
    (targets already checked: ``LoraSettings.resolved``)."""
    known = targets_of(cfg)
    return [f"blk.{i}.{known[t].stem}.weight" for i in range(cfg.n_layer) for t in targets]


def lora_shapes(base_shapes: Mapping[str, tuple[int, ...]], cfg, s: LoraSettings) -> dict[str, tuple[int, int]]:
    """Parameter name -> shape: ``<W>.lora_a`` (r, in), ``<W>.lora_b`` (out, r)."""
    out = {}
    targets = s.resolved(cfg).targets
    assert targets is not None  # resolved() names them
    for w in adapted_weights(cfg, targets):
        if w not in base_shapes:
            raise BadInputError(f"the base model has no {w} to adapt")
        o, i = base_shapes[w]
        out[f"{w}.lora_a"] = (s.rank, int(i))
        out[f"{w}.lora_b"] = (int(o), s.rank)
    return out


def init_lora(shapes: Mapping[str, tuple[int, int]], seed: int) -> dict[str, np.ndarray]:
    """A ~ U(±1/sqrt(in)), B = 0, drawn in ``shapes`` order from ``default_rng(seed)``."""
    rng = np.random.default_rng(seed)
    out = {}
    for name, shape in shapes.items():
        if name.endswith(".lora_a"):
            bound = 1.0 / math.sqrt(shape[1])
            out[name] = rng.uniform(-bound, bound, size=shape).astype(np.float32)
        else:
            out[name] = np.zeros(shape, np.float32)
    return out


class LoraTrain:
    """``TrainModel``: frozen ``base`` weights (name -> bound ggml tensor) +
    the LoRA parameters of ``settings``. ``batch`` x ``context`` is the
    micro-batch shape (dropout masks are allocated for it on ``runtime``)."""

    def __init__(
        self,
        cfg,
        base: Mapping[str, toy_ggml.Tensor],
        settings: LoraSettings,
        *,
        runtime: toy_ggml.Runtime | None = None,
        batch: int = 1,
        context: int = 1,
        seed: int = 0,
    ):
        self.cfg, self.base, self.settings = cfg, base, settings.resolved(cfg)
        self.n_vocab = cfg.n_vocab
        self.feed = TokenFeed.for_config(cfg)
        self.gemm = True  # F32 products on toy's CPU GEMM where the runtime computes on the CPU (TrainModel.gemm)
        self.shapes = lora_shapes({n: tuple(t.shape) for n, t in base.items()}, cfg, self.settings)
        self.seed = int(seed)
        self._masks: dict[tuple[int, str], toy_ggml.Tensor] = {}
        self._mask_ctx = None
        if settings.dropout > 0:
            if runtime is None:
                raise ValueError("dropout needs the runtime to hold its masks")
            n = batch * context
            known = targets_of(cfg)
            assert self.settings.targets is not None  # resolved() names them
            width = {known[t].site: known[t].d_in for t in self.settings.targets}
            self._mask_ctx = toy_ggml.Context(max_tensors=len(width) * cfg.n_layer + 4)
            for i in range(cfg.n_layer):
                for site in sorted(width):
                    self._masks[(i, site)] = self._mask_ctx.tensor(F32, (n, width[site]), name=f"drop.{i}.{site}")
            self._mask_ctx.allocate(runtime)

    def param_specs(self) -> list[ParamSpec]:
        return [ParamSpec(n, s, "matrix") for n, s in self.shapes.items()]

    def logits(self, ctx, params: Mapping[str, toy_ggml.Tensor], inputs: BatchInputs, training: bool = True, taps=None):
        s = self.settings
        known = targets_of(self.cfg)
        lora: dict[str, list] = {}
        assert s.targets is not None  # resolved() names them
        for i in range(self.cfg.n_layer):
            for t in s.targets:
                w = f"blk.{i}.{known[t].stem}.weight"
                drop = self._masks.get((i, known[t].site)) if training else None
                lora[w] = [(params[f"{w}.lora_a"], params[f"{w}.lora_b"], s.scale, drop)]
        return forward_batch(
            ctx,
            self.cfg,
            self.base,
            inputs.tokens,
            inputs.pos,
            inputs.masks,
            inputs.batch,
            keep=inputs.keep,
            lora=lora,
            taps=taps,
        )

    def before_compute(self, step: int, micro: int) -> None:
        """Draw this micro-batch's dropout masks (seeded by seed, step, micro)."""
        if not self._masks:
            return
        p = self.settings.dropout
        rng = np.random.default_rng([self.seed, 7919, step, micro])
        keep = np.float32(1.0 / (1.0 - p))
        for key in sorted(self._masks):
            t = self._masks[key]
            t.set(np.where(rng.random(t.shape) >= p, keep, np.float32(0.0)).astype(np.float32))

    def adapter_pairs(self, values: Mapping[str, np.ndarray]) -> dict[str, tuple[np.ndarray, np.ndarray]]:
        """Parameter values -> {weight name: (A, B)} for ``save_adapter``."""
        assert self.settings.targets is not None  # resolved() names them
        return {
            w: (values[f"{w}.lora_a"], values[f"{w}.lora_b"]) for w in adapted_weights(self.cfg, self.settings.targets)
        }

    def close(self) -> None:
        if self._mask_ctx is not None:
            self._mask_ctx.close()
            self._mask_ctx = None


__all__ = ["LoraSettings", "LoraTrain", "adapted_weights", "init_lora", "lora_shapes", "targets_of"]
