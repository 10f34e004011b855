"""Gemma fine-tuning gradients against PyTorch autograd.

Reference: the Hugging Face model itself (``Gemma2ForCausalLM`` /
``Gemma3ForCausalLM`` of ``gemma_ref``, float64, eager attention, so Gemma
2's attention soft-cap is on), loaded with the GGUF's weights mapped back to
Hugging Face's names (the norm gains the converter stores as ``1 + w`` go
back as ``w``), and ``cross_entropy`` over the kept targets: toy's training
graph (``toy.train.model.ArchTrain`` through ``forward_batch``: the batched
attention with one mask per window, the soft-caps through toy-ggml patch
0012's TANH backward, GELU in its exact tanh form) is checked against code
that shares nothing with it. Rows are one document each (positions 0..T-1,
T = 20 > the window of 8), with some targets masked.

LoRA: the reference runs on the effective weights W + s·B·A and the chain
rule gives dA = s·Bᵀ·dW and dB = s·dW·Aᵀ (as test_lora_train.py).

Tolerances as test_train_engine.py (``assert_grads_close``: 2e-4 of each
tensor's largest gradient; measured ~1e-6 relative).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from toy import models
from toy.train.lora import LoraSettings, LoraTrain
from toy.train.model import ArchTrain
from toy.train.optim import OptimConfig
from toy.train.stepgraph import TrainEngine
from toy_testsupport import gemma_ref
from toy_testsupport.train_helpers import Batch, BoundModel, assert_grads_close, hf_masked_loss_backward, lora_reference

SHAPES = ("gemma2-tiny", "gemma3-tiny", "gemma3-tiny-untied")
B, T = 2, 20


def exact_gelu_config(gf):
    """The file's config with GELU in its exact tanh form (HF's)."""
    return dataclasses.replace(models.config_from_gguf(gf), gelu="exact")


@pytest.fixture(scope="module", params=SHAPES)
def base(request, rt):
    b = BoundModel(gemma_ref.gguf_path(request.param, 0, "f32"), rt, exact_gelu_config)
    b.shape = request.param
    yield b
    b.close()


def batch(seed: int, vocab: int) -> Batch:
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, vocab, (B, T)).astype(np.int32)
    targets = rng.integers(0, vocab, (B, T)).astype(np.int32)
    mask = (rng.random((B, T)) >= 0.2).astype(np.float32)
    pos = np.tile(np.arange(T, dtype=np.int32), (B, 1))
    return Batch(tokens, targets, mask, pos, np.zeros((B, T), np.int32))


def hf_loss_and_grads(shape: str, weights: dict[str, np.ndarray], b: Batch):
    """(mean NLL over the kept targets, d/d(every GGUF tensor)) by PyTorch
    float64 autograd through the Hugging Face model carrying ``weights``."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    hf_dir = gemma_ref.hf_dir(shape, 0)
    cfg = AutoConfig.from_pretrained(str(hf_dir), local_files_only=True)
    cfg._attn_implementation = "eager"
    model = AutoModelForCausalLM.from_config(cfg, torch_dtype=torch.float64, attn_implementation="eager")
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, p in params.items():
            v = np.asarray(weights[gemma_ref.gguf_name(name)], np.float64)
            if name.endswith("norm.weight"):
                v = v - 1.0  # the file holds Gemma's 1 + w
            p.copy_(torch.from_numpy(v))
    loss = hf_masked_loss_backward(model, b)
    grads = {gemma_ref.gguf_name(n): p.grad.numpy().copy() for n, p in params.items()}
    return loss, grads


def test_full_gradients_equal_hf_autograd(base, rt):
    b = batch(1, base.cfg.n_vocab)
    model = ArchTrain(base.cfg)
    eng = TrainEngine(
        model, {s.name: base.w[s.name] for s in model.param_specs()}, rt, OptimConfig(), batch=B, context=T
    )
    try:
        loss, grads = eng.gradients([b])
    finally:
        eng.close()
    ref_loss, ref = hf_loss_and_grads(base.shape, base.w, b)
    assert loss == pytest.approx(ref_loss, rel=1e-5)
    assert_grads_close(grads, ref)


@pytest.mark.parametrize(
    "settings",
    [LoraSettings(), LoraSettings(targets=["q", "v", "gate", "up", "down"], rank=3, alpha=5.0)],
    ids=["qkvo", "mlp"],
)
def test_lora_gradients_equal_hf_autograd(base, rt, settings):
    model = LoraTrain(base.cfg, base.bound.tensors, settings)
    rng = np.random.default_rng(3)
    lora = {n: (rng.standard_normal(s) * 0.2).astype(np.float32) for n, s in model.shapes.items()}
    b = batch(2, base.cfg.n_vocab)
    eng = TrainEngine(model, lora, rt, OptimConfig(), batch=B, context=T)
    try:
        loss, grads = eng.gradients([b])
    finally:
        eng.close()
    ref_loss, ref = lora_reference(model, lora, base.w, lambda eff: hf_loss_and_grads(base.shape, eff, b))
    assert loss == pytest.approx(ref_loss, rel=1e-5)
    assert_grads_close(grads, ref)
    assert len(grads) == 2 * len(model.settings.targets) * base.cfg.n_layer
