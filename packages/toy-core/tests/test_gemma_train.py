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

import gemma_ref
import numpy as np
import pytest
from train_helpers import Batch, assert_grads_close

import toy_ggml
from toy import models
from toy.gguf import GGUFFile, bind_tensors
from toy.reference.llama_np import load_weights
from toy.train.engine import TrainEngine
from toy.train.lora import LoraSettings, LoraTrain
from toy.train.model import ArchTrain
from toy.train.optim import OptimConfig

SHAPES = ("gemma2-tiny", "gemma3-tiny", "gemma3-tiny-untied")
B, T = 2, 20

_LAYER_NAMES = {
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "post_attention_layernorm": "post_attention_norm",
    "pre_feedforward_layernorm": "ffn_norm",
    "post_feedforward_layernorm": "post_ffw_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def gguf_name(hf_name: str) -> str:
    """The GGUF tensor of a Hugging Face Gemma parameter."""
    top = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight"}
    if hf_name in top:
        return top[hf_name]
    if hf_name == "lm_head.weight":
        return "output.weight"
    _, _, n, rest = hf_name.split(".", 3)  # model.layers.N.<module>.weight
    module = rest.rsplit(".", 1)[0]
    return f"blk.{n}.{_LAYER_NAMES[module]}.weight"


@pytest.fixture(scope="module")
def rt():
    r = toy_ggml.Runtime("cpu", threads=2)
    yield r
    r.close()


class Base:
    def __init__(self, shape, rt):
        self.shape = shape
        self.gf = GGUFFile(gemma_ref.gguf_path(shape, 0, "f32"))
        self.cfg = dataclasses.replace(models.config_from_gguf(self.gf), gelu="exact")
        self.bound = bind_tensors(self.gf, rt)
        self.w = {k: v.astype(np.float32) for k, v in load_weights(self.gf).items()}

    def close(self):
        self.bound.close()
        self.gf.close()


@pytest.fixture(scope="module", params=SHAPES)
def base(request, rt):
    b = Base(request.param, rt)
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
            v = np.asarray(weights[gguf_name(name)], np.float64)
            if name.endswith("norm.weight"):
                v = v - 1.0  # the file holds Gemma's 1 + w
            p.copy_(torch.from_numpy(v))
    model.eval()  # no dropout; gradients still flow
    logits = model(torch.tensor(b.tokens, dtype=torch.long), use_cache=False).logits
    nll = torch.nn.functional.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), torch.tensor(b.targets.reshape(-1), dtype=torch.long), reduction="none"
    )
    keep = torch.tensor(b.loss_mask.reshape(-1), dtype=torch.float64)
    loss = (nll * keep).sum() / keep.sum()
    loss.backward()
    grads = {gguf_name(n): p.grad.numpy().copy() for n, p in params.items()}
    return float(loss.detach()), grads


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
    s = model.settings.scale
    pairs = model.adapter_pairs(lora)
    eff = dict(base.w)
    for w, (a, bb) in pairs.items():
        eff[w] = base.w[w].astype(np.float64) + s * bb.astype(np.float64) @ a.astype(np.float64)
    ref_loss, g = hf_loss_and_grads(base.shape, eff, b)
    ref = {}
    for w, (a, bb) in pairs.items():
        ref[f"{w}.lora_a"] = s * bb.astype(np.float64).T @ g[w]
        ref[f"{w}.lora_b"] = s * g[w] @ a.astype(np.float64).T
    assert loss == pytest.approx(ref_loss, rel=1e-5)
    assert_grads_close(grads, ref)
    assert len(grads) == 2 * len(model.settings.targets) * base.cfg.n_layer
