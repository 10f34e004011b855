"""Mixture-of-experts inference (olmoe, qwen2moe, qwen3moe through
``toy.models.llama`` with ``toy.models.moe``) against Hugging Face, against
itself, and its training gradients against PyTorch autograd.

The models are ``moe_ref``'s: seeded random ``OlmoeForCausalLM``,
``Qwen2MoeForCausalLM`` (a shared expert) and ``Qwen3MoeForCausalLM``
(renormalised expert weights) with 8 experts, top-2, converted by llama.cpp's
own converter.

- Whole-sequence logits of the F32 files equal transformers' float32 eager
  forward within ``HF_ATOL`` (measured <= 5e-7 on the 64-wide shapes);
- the experts toy routes each token to are HF's (from the router logits
  toy's graph computes: the same top-2 per layer and token);
- step-by-step decode through the KV cache equals the whole forward
  (F32 cache, measured <= 2e-7);
- batched decode is bit-identical to solo for F32, Q8_0 and K-quant experts
  (toy-ggml patch 0015 keeps K-quant expert products row-invariant);
- full gradients (attention, router, every expert) and LoRA gradients on the
  router equal HF's float64 autograd (``assert_grads_close``).
"""

from __future__ import annotations

import numpy as np
import pytest

import toy_ggml as tg
from toy import models
from toy.engine.llm import LLMEngine
from toy.gguf import GGUFFile, bind_tensors
from toy.gguf.bind import REPACK_TYPES
from toy.train.lora import LoraSettings, LoraTrain
from toy.train.model import ArchTrain
from toy.train.optim import OptimConfig
from toy.train.stepgraph import TrainEngine
from toy_testsupport import moe_ref
from toy_testsupport.reference.full import FullModel
from toy_testsupport.reference.llama_np import load_weights
from toy_testsupport.train_helpers import Batch, assert_grads_close, hf_masked_loss_backward, lora_reference

SHAPES = ("olmoe-tiny", "qwen2moe-tiny", "qwen3moe-tiny")
HF_ATOL = 1e-4
STEP_ATOL = 1e-4


@pytest.mark.parametrize("shape", SHAPES)
def test_logits_equal_transformers(rt, shape):
    ids = moe_ref.sample_ids(24, seed=1)
    ref = moe_ref.hf_logits(moe_ref.hf_dir(shape, 0), ids)
    fm = FullModel.load(moe_ref.gguf_path(shape, 0, "f32"), rt, kv_type=None)
    try:
        got = fm.logits(ids)
    finally:
        fm.close()
    assert np.abs(got - ref).max() <= HF_ATOL, np.abs(got - ref).max()


@pytest.mark.parametrize("shape", SHAPES)
def test_the_config_reads_the_expert_layout(shape):
    with GGUFFile(moe_ref.gguf_path(shape, 0, "f32")) as gf:
        cfg = models.config_from_gguf(gf)
    hf = moe_ref.SHAPES[shape]
    assert cfg.architecture == hf["arch"]
    assert (cfg.n_expert, cfg.n_expert_used) == (8, 2)
    assert cfg.d_ff_expert == hf.get("moe_intermediate_size", hf.get("intermediate_size"))
    assert cfg.d_ff_shared == hf.get("shared_expert_intermediate_size", 0)
    assert cfg.expert_weights_norm == (shape == "qwen3moe-tiny")
    assert cfg.qk_norm_full == (shape == "olmoe-tiny")
    assert set(models.of(cfg).lora_targets(cfg)) == {"q", "k", "v", "o", "router"}


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("flash", [False, True], ids=["plain", "flash"])
def test_decode_equals_the_full_forward(rt, shape, flash):
    ids = moe_ref.sample_ids(30, seed=2)
    fm = FullModel.load(moe_ref.gguf_path(shape, 0, "f32"), rt, kv_type=None)
    eng = LLMEngine(fm.cfg, fm.weights, rt, n_ctx=64, n_slot=1, kv_type="f32", flash_attn=flash)
    try:
        full = fm.logits(ids)
        rows = [eng.prefill(0, ids[:6], all_logits=True)] + [eng.decode([0], [t]) for t in ids[6:]]
    finally:
        eng.close()
        fm.close()
    assert np.abs(np.concatenate(rows) - full).max() <= STEP_ATOL


@pytest.mark.parametrize(
    "shape,outtype,repack",
    [
        ("qwen2moe-tiny", "f32", False),
        ("qwen3moe-tiny", "q8_0", False),
        ("olmoe-k", "q4_k_m", False),
        ("qwen2moe-k", "q4_k_m", False),
        ("olmoe-k", "q4_k_m", "all"),  # the Q4_K weights in ggml's repacked layout (toy.load(repack="all"))
        ("qwen2moe-k", "q4_k_m", "all"),
    ],
)
def test_batched_decode_is_bit_identical_to_solo(rt, shape, outtype, repack):
    a, b = moe_ref.sample_ids(40, seed=3), moe_ref.sample_ids(40, seed=4)
    fm = FullModel.load(moe_ref.gguf_path(shape, 0, outtype), rt, repack=repack)
    if repack and not any(n.endswith("_exps.weight") for n in fm.weights.repacked):
        fm.close()
        pytest.skip(f"no repacked Q4_K layout on this CPU ({tg.cpu_variant().tag})")
    eng = LLMEngine(fm.cfg, fm.weights, rt, n_ctx=64, n_slot=9)
    try:
        eng.prefill(0, a[:4])
        solo = [eng.decode([0], [t]) for t in a[4:24]]
        # slot 1 decodes with 7 others, most of whose tokens pick the same experts as it
        eng.prefill(1, a[:4])  # the same sequence as slot 0's
        for s in range(2, 9):
            eng.prefill(s, b[: 4 + s])
        crowd = []
        for j, t in enumerate(a[4:24]):
            toks = [t] + [b[4 + s + j] for s in range(2, 9)]
            crowd.append(eng.decode(list(range(1, 9)), toks)[0:1])
    finally:
        eng.close()
        fm.close()
    for s, c in zip(solo, crowd):
        np.testing.assert_array_equal(c, s)


def _router_choices(rt, path, ids):
    """The experts toy's graph routes each token to, per layer: (L, T, k), read from the
    router's softmax (a copy of the forward up to the router of every layer)."""
    from toy.models import moe

    fm = FullModel.load(path, rt, kv_type=None)
    cfg = fm.cfg
    picks = []
    orig = moe.ffn

    def spy(ctx, c, weights, lin, p, u, row_invariant=False, lora=None):
        probs = ctx.soft_max(lin(f"{p}.ffn_gate_inp.weight", u)).set_output()
        picks.append(probs)
        out = orig(ctx, c, weights, lin, p, u, row_invariant, lora)
        return ctx.add(out, ctx.scale(ctx.sum(probs), 0.0))  # + exactly 0: keeps probs in the graph

    moe.ffn = spy
    try:
        fm.logits(ids)
        probs = np.stack([p.numpy().copy() for p in picks])  # (L, T, E)
    finally:
        moe.ffn = orig
        fm.close()
    return moe_ref.llamacpp_topk(probs, cfg.n_expert_used), probs


def test_k_quants_are_repacked_only_when_asked(rt):
    """The default repacks the types that are not slower repacked for prefill (``REPACK_TYPES``: of a
    Q4_K_M file's, the Q8_0 weights where the CPU has toy's layout), so its Q4_K weights stay as they are;
    ``repack="all"`` moves those too (2-D and experts); anything else is a clear error from toy.load."""
    import toy
    from toy.errors import BadInputError

    path = moe_ref.gguf_path("olmoe-k", 0, "q4_k_m")
    with GGUFFile(path) as gf:
        got = {}
        for repack in (True, "all"):
            bound = bind_tensors(gf, rt, repack=repack)
            got[repack] = {gf.tensors[n].dtype for n in bound.repacked}
            bound.close()
    if not rt.repack_layout(tg.GGMLType.Q4_K, (256, 256)):
        pytest.skip(f"no repacked Q4_K layout on this CPU ({tg.cpu_variant().tag})")
    assert got[True] <= REPACK_TYPES and tg.GGMLType.Q4_K not in got[True], got
    assert got["all"] == got[True] | {tg.GGMLType.Q4_K}, got
    with pytest.raises(BadInputError, match="repack='yes' must be True, False or 'all'"):
        toy.load(path, repack="yes")


def _first_moe_block(rt, path, u: np.ndarray, repack) -> tuple[np.ndarray, set[str]]:
    """Layer 0's MoE feed-forward (``toy.models.moe.ffn``) of ``u`` (T, d) on ``path``'s weights, bound
    as ``toy.load`` binds them (``repack``) or in the file's layout, and the names of the repacked weights."""
    from toy.models import config_from_gguf, moe
    from toy.models.common import lora_linear

    with GGUFFile(path) as gf:
        cfg = config_from_gguf(gf)
        bound = bind_tensors(gf, rt, repack=repack)
        try:
            with tg.Context(max_tensors=256) as ops:
                ut = ops.tensor(tg.GGMLType.F32, u.shape)
                _, lin = lora_linear(ops, bound, None)
                out = moe.ffn(ops, cfg, bound, lin, "blk.0", ut).set_output()
                g = tg.Graph(ops, size=512).build_forward(out)
                ops.allocate(rt)
                ut.set(u)
                rt.compute(g)
                return out.numpy().copy(), set(bound.repacked)
        finally:
            bound.close()


@pytest.mark.parametrize("shape", ["olmoe-k", "qwen2moe-k", "qwen3moe-k"])
def test_repacked_experts_give_the_plain_products_within_rounding(rt, shape):
    """The Q4_K experts in ggml's repacked layout (``toy.load(repack="all")``) against the file's plain layout, on
    llama.cpp's Q4_K_M mix: layer 0's MoE feed-forward of the same 24 input rows gives the plain output
    within float32 rounding (1e-6 of its largest value) on most rows, and within 1e-3 on all: the down
    projection quantizes its input (the gate/up products) to 8 bits, and where a rounding difference lands
    that input on the other side of a step the row moves by that step (measured: up to 4e-5). In a whole
    model such moves and near-tied routings grow from layer to layer, as llama.cpp's repacked run parts
    from its plain one: the llama.cpp parity records are compared with toy's plain layout
    (test_moe_llamacpp.py)."""
    path = moe_ref.gguf_path(shape, 0, "q4_k_m")
    d = moe_ref.SHAPES[shape]["hidden_size"]
    close = rows = 0
    for seed in (5, 6, 7):
        u = np.random.default_rng(seed).standard_normal((24, d)).astype(np.float32)
        want, _ = _first_moe_block(rt, path, u, False)
        got, packed = _first_moe_block(rt, path, u, "all")
        if not packed:
            pytest.skip(f"no repacked Q4_K layout on this CPU ({tg.cpu_variant().tag})")
        assert {f"blk.0.ffn_{w}_exps.weight" for w in ("gate", "up")} <= packed, packed
        assert not np.array_equal(got, want)  # the experts did go through the repacked kernel
        scale = float(np.abs(want).max())
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-3 * scale)
        close += int(np.sum(np.abs(got - want).max(axis=1) <= 1e-6 * scale))
        rows += len(u)
    assert close >= 0.75 * rows, (close, rows)


@pytest.mark.parametrize("shape", SHAPES)
def test_toy_routes_tokens_to_hf_experts(rt, shape):
    ids = moe_ref.sample_ids(32, seed=5)
    hf = moe_ref.hf_router_topk(moe_ref.hf_dir(shape, 0), ids)
    got, probs = _router_choices(rt, moe_ref.gguf_path(shape, 0, "f32"), ids)
    np.testing.assert_allclose(probs, hf["probs"], atol=5e-6)  # float32 of two implementations (measured 1.2e-6)
    np.testing.assert_array_equal(np.sort(got, -1), np.sort(hf["experts"], -1))


def test_tied_router_logits_pick_the_lower_expert(rt):
    # experts 2 and 5 have identical router rows: where they straddle the top-2 boundary,
    # ggml's argsort (llama.cpp's selection) keeps expert 2
    ids = moe_ref.sample_ids(64, seed=0)
    got, probs = _router_choices(rt, moe_ref.gguf_path("qwen3moe-tied-router", 0, "f32"), ids)
    np.testing.assert_array_equal(probs[..., 2], probs[..., 5])
    straddle = (got == 2).any(-1) & ~(got == 5).any(-1)
    assert straddle.sum() > 0
    assert not ((got == 5).any(-1) & ~(got == 2).any(-1)).any()


def _batch(seed: int, B: int = 2, T: int = 12) -> Batch:
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, 50257, (B, T)).astype(np.int32)
    targets = rng.integers(0, 50257, (B, T)).astype(np.int32)
    mask = (rng.random((B, T)) >= 0.2).astype(np.float32)
    return Batch(tokens, targets, mask, np.tile(np.arange(T, dtype=np.int32), (B, 1)), np.zeros((B, T), np.int32))


def _hf_grads(shape: str, weights: dict[str, np.ndarray], b: Batch):
    """(mean NLL over kept targets, d/d(GGUF tensor)) from HF's float64 model carrying ``weights``."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    hf_dir = moe_ref.hf_dir(shape, 0)
    cfg = AutoConfig.from_pretrained(str(hf_dir), local_files_only=True)
    model = AutoModelForCausalLM.from_config(cfg, torch_dtype=torch.float64, attn_implementation="eager")
    names = _gguf_of(model, cfg.num_hidden_layers)
    params = dict(model.named_parameters())
    with torch.no_grad():
        for hf, (g, e) in names.items():
            v = weights[g] if e is None else weights[g][e]
            params[hf].copy_(torch.from_numpy(np.asarray(v, np.float64).reshape(params[hf].shape)))
    loss = hf_masked_loss_backward(model, b)
    grads: dict[str, np.ndarray] = {}
    for hf, (g, e) in names.items():
        gr = params[hf].grad
        gr = np.zeros(tuple(params[hf].shape)) if gr is None else gr.numpy()  # an expert no token chose
        if e is None:
            grads[g] = gr.reshape(weights[g].shape).copy()
        else:
            grads.setdefault(g, np.zeros(weights[g].shape))[e] = gr
    return loss, grads


def _gguf_of(model, n_layer: int) -> dict[str, tuple[str, int | None]]:
    """HF parameter name -> (GGUF tensor, expert index or None)."""
    out = {}
    for name, _ in model.named_parameters():
        if name == "model.embed_tokens.weight":
            out[name] = ("token_embd.weight", None)
        elif name == "model.norm.weight":
            out[name] = ("output_norm.weight", None)
        elif name == "lm_head.weight":
            out[name] = ("output.weight", None)
        else:
            _, _, i, rest = name.split(".", 3)
            module, kind = rest.rsplit(".", 1)
            if module.startswith("mlp.experts."):
                _, _, e, proj = module.split(".")
                out[name] = (f"blk.{i}.ffn_{proj.split('_')[0]}_exps.weight", int(e))
            else:
                out[name] = (f"blk.{i}.{moe_ref.GGUF_LAYER_NAMES[module]}.{kind}", None)
    return out


@pytest.mark.parametrize("shape", SHAPES)
def test_full_gradients_equal_hf_autograd(rt, shape):
    with GGUFFile(moe_ref.gguf_path(shape, 0, "f32")) as gf:
        cfg = models.config_from_gguf(gf)
        w = {k: v.astype(np.float32) for k, v in load_weights(gf).items()}
    b = _batch(6)
    model = ArchTrain(cfg)
    eng = TrainEngine(model, {s.name: w[s.name] for s in model.param_specs()}, rt, OptimConfig(), batch=2, context=12)
    try:
        loss, grads = eng.gradients([b])
    finally:
        eng.close()
    ref_loss, ref = _hf_grads(shape, w, b)
    assert loss == pytest.approx(ref_loss, rel=1e-5)
    assert_grads_close(grads, ref)


@pytest.mark.parametrize("shape", ["qwen2moe-tiny", "qwen3moe-tiny"])
def test_lora_gradients_on_attention_and_router_equal_hf_autograd(rt, shape):
    gf = GGUFFile(moe_ref.gguf_path(shape, 0, "f32"))
    try:
        cfg = models.config_from_gguf(gf)
        bound = bind_tensors(gf, rt)
        w = {k: v.astype(np.float32) for k, v in load_weights(gf).items()}
        model = LoraTrain(cfg, bound.tensors, LoraSettings(targets=["q", "v", "router"], rank=3, alpha=6.0))
        rng = np.random.default_rng(7)
        lora = {n: (rng.standard_normal(s) * 0.2).astype(np.float32) for n, s in model.shapes.items()}
        b = _batch(8)
        eng = TrainEngine(model, lora, rt, OptimConfig(), batch=2, context=12)
        try:
            loss, grads = eng.gradients([b])
        finally:
            eng.close()
        bound.close()
    finally:
        gf.close()
    ref_loss, ref = lora_reference(model, lora, w, lambda eff: _hf_grads(shape, eff, b))
    assert loss == pytest.approx(ref_loss, rel=1e-5)
    assert_grads_close(grads, ref)
