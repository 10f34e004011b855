"""Training GPT-2 (``toy.models.gpt2``) against an independent PyTorch reference,
and GPT-2 runs end to end.

Reference: ``torch_gpt2`` (toy_testsupport/torch_gpt2.py), a float64 GPT-2 written from
the math with torch autograd; ``torch_llama.adamw_step`` for AdamW (it is
architecture-free). Inputs: tiny random GPT-2 configs (from the registry's
``train_config``), tied and untied, with random non-trivial LayerNorm gains
and shifts and random biases, batches of packed documents (block-causal
masks, positions restarting at each document) with masked targets.

Tolerances. ggml's CPU GELU reads a float16 table: its value is
f16(gelu(f16(x))) while its backward (toy-ggml patch 0002) is the exact
derivative at x. Gradients are compared per tensor as
``|g - ref| <= tol * max|ref| + 1e-6`` against two references:

- ``gelu="fp16"`` emulates the table (bit-identical to ggml's on every
  float16 input, straight-through gradient), leaving toy's float32
  arithmetic, plus one effect no emulation removes: a GELU input within
  float32 noise of a float16 rounding midpoint rounds one way in ggml and
  the other in float64, moving that activation by one float16 ulp. Measured
  over 24 seeds: usually ~1e-6 (as the llama tests), up to 2.8e-4 when such
  a flip happens (2.8e-4 in the untied case here, 1.4e-4 tied, 2e-6 LoRA);
  ``FP16_EMU_TOL = 5e-4``; loss to 1e-5 relative (measured <= 4.7e-6);
- ``gelu="exact"`` (the plain tanh formula in float64): the table's
  rounding (~2^-11 relative per GELU value) reaches every gradient.
  Measured: up to 1.44e-3 over 24 seeds, 0.9e-3 on the cases here, 1.66e-3
  on the LoRA case; ``GELU_TABLE_TOL = 3e-3``; loss to 2e-4 relative
  (measured <= 6.3e-5). This check alone would not tell the tanh GELU from
  the erf one (2.3e-3 apart here); the emulated check does, as it catches
  a LayerNorm ignoring its eps (9e-2) or attention across documents (1.6).

AdamW steps feed torch's AdamW toy's own gradients (see that test for
why) and compare parameters within 1e-6 absolute (measured < 2e-7; the
update is ~lr = 1e-2, so a wrong bias correction, decay group or clip
factor is off by 1e-4 or more).

Runs: ``toy train from-scratch --arch gpt2 --preset tiny`` on the demo corpus
(``toy train demo-corpus``: Python's documentation topics) through
``toy.train.lmrun.train`` with the config that command builds. Cheapest
honest setting: the preset's model (d 128, 4 layers, 4 heads, FFN 512, 0.87M
parameters) with a 512-token BPE, batch 4 x context 64 and one thread: 300
steps take ~30 s here including the tokenizer (the defaults, 1024 tokens and
8 x 128, take ~130 s on one thread; two threads on this shared 2-core
machine are slower still). Measured: validation loss 4.84 / 4.53 / 4.46 at
steps 100 / 200 / 300 against a unigram baseline of 5.26 nats/token.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
from pathlib import Path

import numpy as np
import pytest

from toy import models
from toy.errors import BadInputError
from toy.gguf import GGUFFile, GGUFWriter
from toy.models.gpt2 import GPT2Config
from toy.train import checkpoint
from toy.train import config as C
from toy.train.demodata import write_python_docs
from toy.train.lmrun import Hooks, resume, train
from toy.train.lora import LoraSettings, LoraTrain, init_lora
from toy.train.model import ArchTrain, init_params
from toy.train.optim import OptimConfig
from toy.train.stepgraph import TrainEngine
from toy_testsupport import torch_gpt2, torch_llama
from toy_testsupport.train_helpers import BoundModel as Base
from toy_testsupport.train_helpers import packed_batch

GPT2 = models.get("gpt2")
FP16_EMU_TOL = 5e-4  # against the float16-table emulation; measured up to 2.8e-4 (module docstring)
GELU_TABLE_TOL = 3e-3  # against the plain formula; measured up to 1.4e-3

# the two gradient variants: untied head with GPT-2's eps, tied head with a
# large eps (so a LayerNorm that ignored the configured eps would show)
VARIANTS = {"untied": {"tied_output": False, "norm_eps": 1e-5}, "tied": {"tied_output": True, "norm_eps": 1e-2}}


def tiny_cfg(variant: str = "untied", n_vocab: int = 61, context: int = 16) -> GPT2Config:
    shape = C.ModelShape(arch="gpt2", preset=None, d_model=32, n_layer=2, n_head=4, d_ff=64, **VARIANTS[variant])
    return GPT2.train_config(C.resolve_shape(shape), n_vocab, context)


def random_params(cfg, seed: int) -> dict[str, np.ndarray]:
    """Random values for every parameter, by kind: gains 1 + 0.2 N, norm
    shifts and biases 0.2 N (non-zero, so a dropped one shows), embeddings
    and positions 0.5 N, matrices 0.3 N."""
    rng = np.random.default_rng(seed)
    out = {}
    for name, p in GPT2.params(cfg).items():
        if p.kind == "norm":
            a = 1.0 + 0.2 * rng.standard_normal(p.shape)
        elif p.kind in ("norm_bias", "bias"):
            a = 0.2 * rng.standard_normal(p.shape)
        elif p.kind in ("embedding", "position"):
            a = 0.5 * rng.standard_normal(p.shape)
        else:
            a = 0.3 * rng.standard_normal(p.shape)
        out[name] = a.astype(np.float32)
    return out


def ref_grads(w, cfg, b, gelu: str, **kw):
    return torch_gpt2.loss_and_grads(w, cfg, b.tokens, b.pos, b.doc, b.targets, b.loss_mask, gelu=gelu, **kw)


def assert_close_rel(got, want, rel: float):
    assert set(got) == set(want)
    for name in want:
        ref = np.asarray(want[name], np.float64)
        tol = rel * float(np.abs(ref).max()) + 1e-6
        err = float(np.abs(np.asarray(got[name]) - ref).max())
        assert err <= tol, f"{name}: max error {err:.3g} > {tol:.3g}"


def two_docs_per_row(b) -> bool:
    return bool((b.doc.max(axis=1) >= 1).all())


# ---------------------------------------------------------------- gradients


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_gradients_of_every_parameter_match_torch(rt, variant):
    cfg = tiny_cfg(variant)
    assert cfg.architecture == "gpt2" and cfg.tied_output == VARIANTS[variant]["tied_output"]
    w = random_params(cfg, 1)
    b = packed_batch(np.random.default_rng(2), cfg.n_vocab, 2, 12)
    assert two_docs_per_row(b) and (b.loss_mask == 0).any()
    eng = TrainEngine(ArchTrain(cfg), w, rt, OptimConfig(), batch=2, context=12)
    try:
        loss, grads = eng.gradients([b])
    finally:
        eng.close()
    # every GPT-2 parameter is trained: biases, both norms' shifts, positions
    names = set(GPT2.params(cfg))
    assert set(grads) == names
    assert ("output.weight" in names) == (not cfg.tied_output)
    ref_loss, ref = ref_grads(w, cfg, b, "fp16")
    assert loss == pytest.approx(ref_loss, rel=1e-5)
    assert_close_rel(grads, ref, FP16_EMU_TOL)
    assert all(float(np.abs(g).max()) > 1e-4 for g in ref.values())  # every tensor's check means something
    exact_loss, exact = ref_grads(w, cfg, b, "exact")
    assert loss == pytest.approx(exact_loss, rel=2e-4)
    assert_close_rel(grads, exact, GELU_TABLE_TOL)


def test_gradients_are_block_causal_and_masked_targets_change_nothing(rt):
    """A masked target enters neither the loss nor any gradient; and the
    reference's mask is block-causal (a later document's logits are those of
    the document alone at positions from 0), so the packed gradient
    comparisons above check toy's masks."""
    cfg = tiny_cfg("untied")
    w = random_params(cfg, 3)
    b = packed_batch(np.random.default_rng(4), cfg.n_vocab, 2, 12)
    eng = TrainEngine(ArchTrain(cfg), w, rt, OptimConfig(), batch=2, context=12)
    try:
        l1, g1 = eng.gradients([b])
        masked = b.loss_mask == 0
        b.targets[masked] = (b.targets[masked] + 7) % cfg.n_vocab
        l2, g2 = eng.gradients([b])
        kept = tuple(np.argwhere(b.loss_mask > 0)[0])
        b.targets[kept] = (b.targets[kept] + 1) % cfg.n_vocab
        l3, _ = eng.gradients([b])
    finally:
        eng.close()
    assert l1 == l2 and all(np.array_equal(g1[k], g2[k]) for k in g1)
    assert l3 != l1
    # the reference's own block-causal mask: a later document alone gives the same logits
    row = 0
    start = int(np.argmax(b.doc[row] == b.doc[row].max()))
    full = torch_gpt2.logits(w, cfg, b.tokens, b.pos, b.doc)[row, start:]
    alone = torch_gpt2.logits(w, cfg, b.tokens[row:row + 1, start:], b.pos[row:row + 1, start:],
                              np.zeros((1, 12 - start), np.int32))[0]  # fmt: skip
    np.testing.assert_allclose(full, alone, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("clip", [0.0, 0.05])
def test_adamw_steps_match_torch(rt, clip):
    """Three steps (decayed matrices; undecayed embeddings, positions, norm
    gains and shifts, biases; a changing learning rate; with and without
    clipping) equal torch.optim.AdamW + clip_grad_norm_ applied to the
    step's gradients.

    Torch's optimizer gets toy's own gradients of the step (float64 sums,
    ``TrainEngine.gradients`` at the same parameters), which the gradient
    tests above check against torch's; the loss and the norm are also
    compared with torch's own. Fed torch's float64 gradients instead, an
    element whose true gradient is ~0 would move by up to lr under Adam's
    normalization whatever toy does: the K third of ``attn_qkv.bias`` has
    gradient exactly 0 (softmax is invariant to q·b_k, the same for every
    key), float32 leaves ~1e-8 there, and Adam turns that into ±lr."""
    cfg = tiny_cfg("untied")
    w = random_params(cfg, 5)
    rng = np.random.default_rng(6)
    opt = OptimConfig(lr=1e-2, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1, grad_clip=clip)
    eng = TrainEngine(ArchTrain(cfg), w, rt, opt, batch=2, context=8)
    no_decay = {s.name for s in eng.specs if not s.decays(opt)}
    kinds = {n: p.kind for n, p in GPT2.params(cfg).items()}
    assert no_decay == {n for n, k in kinds.items() if k not in ("matrix", "residual")}
    assert {"token_embd.weight", "position_embd.weight", "output_norm.bias", "blk.0.attn_qkv.bias"} <= no_decay
    assert "output.weight" not in no_decay and "blk.1.ffn_down.weight" not in no_decay
    state = None
    try:
        for step, lr in enumerate([1e-2, 5e-3, 2e-3]):
            b = packed_batch(rng, cfg.n_vocab, 2, 8)
            cur = eng.param_values()
            ref_loss, ref_g = ref_grads(cur, cfg, b, "fp16")
            _, toy_g = eng.gradients([b])
            k_bias = ref_g["blk.0.attn_qkv.bias"][cfg.d_model : 2 * cfg.d_model]
            assert float(np.abs(k_bias).max()) < 1e-12  # the structural zero described above
            r = eng.train_step([b], lr)
            ref_params, state, ref_norm = torch_llama.adamw_step(
                {k: v.astype(np.float64) for k, v in cur.items()}, toy_g, state, lr=lr, beta1=0.9, beta2=0.95,
                eps=1e-8, weight_decay=0.1, no_decay=no_decay, max_grad_norm=clip or None,
            )  # fmt: skip
            torch_norm = math.sqrt(sum(float((g**2).sum()) for g in ref_g.values()))
            assert r.loss == pytest.approx(ref_loss, rel=1e-5)
            assert r.grad_norm == pytest.approx(ref_norm, rel=1e-5)
            assert r.grad_norm == pytest.approx(torch_norm, rel=FP16_EMU_TOL)
            got = eng.param_values()
            for k in ref_params:
                err = float(np.abs(got[k] - ref_params[k]).max())
                assert err < 1e-6, f"step {step} {k}: {err}"
    finally:
        eng.close()
    if clip:
        assert ref_norm > clip  # clipping was active


def test_loss_curve_is_deterministic(rt):
    """Same seed, same threads: byte-identical GPT-2 losses and weights twice."""
    cfg = tiny_cfg("tied", n_vocab=97, context=16)

    def run():
        rng = np.random.default_rng(7)
        eng = TrainEngine(ArchTrain(cfg), init_params(cfg, 3), rt, OptimConfig(lr=3e-3), batch=2, context=16, accum=2)
        try:
            losses = [eng.train_step([packed_batch(rng, 97, 2, 16) for _ in range(2)], 3e-3).loss for _ in range(4)]
            return losses, eng.param_values()
        finally:
            eng.close()

    (l1, p1), (l2, p2) = run(), run()
    assert l1 == l2
    assert all(p1[k].tobytes() == p2[k].tobytes() for k in p1)


# ---------------------------------------------------------------- LoRA


def write_gpt2(path: Path, cfg: GPT2Config, params: dict[str, np.ndarray]) -> Path:
    """A GPT-2 GGUF as a checkpoint writes it (the registry's metadata, F32 tensors)."""
    w = GGUFWriter(path)
    for k, v in checkpoint.model_metadata(cfg, "tiny-gpt2").items():
        if isinstance(v, tuple):
            w.add(k, v[0], v[1])
        else:
            w.add(k, v)
    for name, a in params.items():
        w.add_tensor(name, np.ascontiguousarray(a, np.float32))
    w.write()
    return path


@pytest.fixture
def base(tmp_path, rt):
    cfg = tiny_cfg("untied")
    params = random_params(cfg, 8)
    b = Base(write_gpt2(tmp_path / "gpt2-base.gguf", cfg, params), rt, GPT2Config.from_gguf)
    # the file's metadata gives back the config (eps is stored as FLOAT32, as llama.cpp reads it)
    assert dataclasses.replace(b.cfg, norm_eps=cfg.norm_eps) == cfg
    assert b.cfg.norm_eps == pytest.approx(cfg.norm_eps, rel=1e-7)
    yield b
    b.close()


def random_lora(model: LoraTrain, seed: int) -> dict[str, np.ndarray]:
    """A and B both non-zero (with B = 0 the gradient of A vanishes)."""
    rng = np.random.default_rng(seed)
    return {n: (rng.standard_normal(s) * 0.2).astype(np.float32) for n, s in model.shapes.items()}


@pytest.mark.parametrize(
    "settings, targets",
    [
        (LoraSettings(targets=["qkv", "o", "up", "down"], rank=3, alpha=5.0), ["qkv", "o", "up", "down"]),
        (LoraSettings(rank=4, alpha=6.0, rslora=True), ["qkv", "o"]),  # GPT-2's default targets
    ],
    ids=["all_targets", "default_rslora"],
)
def test_lora_gradients_match_torch(base, rt, settings, targets):
    model = LoraTrain(base.cfg, base.bound.tensors, settings)
    assert model.settings.targets == targets
    stems = {"qkv": "attn_qkv", "o": "attn_output", "up": "ffn_up", "down": "ffn_down"}
    d, f = base.cfg.d_model, base.cfg.d_ff
    widths = {"qkv": (d, 3 * d), "o": (d, d), "up": (d, f), "down": (f, d)}
    r = settings.rank
    want_shapes = {}
    for i in range(base.cfg.n_layer):
        for t in targets:
            n_in, n_out = widths[t]
            want_shapes[f"blk.{i}.{stems[t]}.weight.lora_a"] = (r, n_in)
            want_shapes[f"blk.{i}.{stems[t]}.weight.lora_b"] = (n_out, r)
    assert model.shapes == want_shapes
    lora = random_lora(model, 3)
    batch = packed_batch(np.random.default_rng(2), base.cfg.n_vocab, 2, 12)
    eng = TrainEngine(model, lora, rt, OptimConfig(), batch=2, context=12)
    try:
        loss, grads = eng.gradients([batch])
    finally:
        eng.close()
    s = settings.scale
    assert s == (settings.alpha / math.sqrt(r) if settings.rslora else settings.alpha / r)
    terms = {w: (a, b, s) for w, (a, b) in model.adapter_pairs(lora).items()}  # W + s·B·A
    ref_loss, ref = ref_grads(base.w, base.cfg, batch, "fp16", lora=terms)
    assert loss == pytest.approx(ref_loss, rel=1e-5)
    assert_close_rel(grads, {k: ref[k] for k in want_shapes}, FP16_EMU_TOL)
    exact_loss, exact = ref_grads(base.w, base.cfg, batch, "exact", lora=terms)
    assert loss == pytest.approx(exact_loss, rel=2e-4)
    assert_close_rel(grads, {k: exact[k] for k in want_shapes}, GELU_TABLE_TOL)


def test_lora_b_zero_is_the_base_and_steps_leave_it_untouched(base, rt):
    before = hashlib.sha256(base.path.read_bytes()).hexdigest()
    batch = packed_batch(np.random.default_rng(4), base.cfg.n_vocab, 2, 12)
    full = TrainEngine(ArchTrain(base.cfg), base.w, rt, OptimConfig(), batch=2, context=12)
    try:
        want = full.eval_nll(batch)
    finally:
        full.close()
    settings = LoraSettings(targets=["qkv", "o", "up", "down"])
    model = LoraTrain(base.cfg, base.bound.tensors, settings)
    init = init_lora(model.shapes, seed=0)
    assert all(not v.any() for n, v in init.items() if n.endswith(".lora_b"))
    eng = TrainEngine(model, init, rt, OptimConfig(lr=1e-2), batch=2, context=12)
    try:
        assert eng.eval_nll(batch) == want  # B = 0: the base model's loss, bit for bit
        _, g = eng.gradients([batch])
        assert all(not g[n].any() for n in g if n.endswith(".lora_a"))  # dL/dA = s Bᵀ dL/dW = 0
        assert all(np.abs(g[n]).max() > 0 for n in g if n.endswith(".lora_b"))
        for _ in range(3):
            eng.train_step([batch], 1e-2)
        after = eng.eval_nll(batch)
    finally:
        eng.close()
    assert after[0] < want[0]  # it learns
    assert hashlib.sha256(base.path.read_bytes()).hexdigest() == before
    np.testing.assert_array_equal(base.gf.tensor_to_float("blk.0.attn_qkv.weight"), base.w["blk.0.attn_qkv.weight"])


# ---------------------------------------------------------------- runs


def events(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]


def step_curve(run_dir: Path) -> list[tuple]:
    by_step = {}
    for e in events(run_dir):
        if e["kind"] == "step":  # a step seen twice (after a resume): the later one
            by_step[e["step"]] = (e["loss"], e["grad_norm"], e["lr"], e["tokens"])
    return [by_step[i] for i in sorted(by_step)]


# what `toy train from-scratch --arch gpt2 --preset tiny --vocab-size 512 -b 4
# --context 64 --steps 300 -t 1 --eval-every 100 --save-every 150 CORPUS` sets
# (toy_cli.commands.train), with shorter samples
RUN = {
    "model.arch": "gpt2",
    "model.preset": "tiny",
    "tokenizer.vocab_size": 512,
    "batch_size": 4,
    "context": 64,
    "steps": 300,
    "threads": 1,  # two threads spin-wait badly when the 2 cores are shared
    "eval_every": 100,
    "save_every": 150,
    "sample_tokens": 8,
}


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    d = tmp_path_factory.mktemp("gpt2-demo")
    write_python_docs(d / "corpus")  # what `toy train demo-corpus` writes
    return {"corpus": d / "corpus", "cache": d / "cache", "dir": d}


def run_cfg(demo, out: Path, **kw) -> C.TrainConfig:
    values = {**RUN, "data.paths": [str(demo["corpus"])], "data.cache_dir": str(demo["cache"]), "out": str(out)}
    values.update(kw)
    return C.override(C.TrainConfig(), **values)


@pytest.fixture(scope="module")
def run300(demo):
    r = train(run_cfg(demo, demo["dir"] / "runs"))
    assert r.reason == "completed" and r.final_step == 300
    return r


@pytest.mark.slow  # the 300-step run (~30 s) is shared by the run tests
def test_from_scratch_300_steps_learns(run300):
    ev = events(run300.run_dir)
    start = ev[0]
    assert start["config"]["model"]["arch"] == "gpt2" and start["model"]["architecture"] == "gpt2"
    m = start["model"]
    assert (m["d_model"], m["n_layer"], m["n_head"], m["d_ff"], m["n_ctx_train"]) == (128, 4, 4, 512, 64)
    assert m["tied_output"] and m["n_vocab"] == 512
    cfg = GPT2Config(**{k: v for k, v in m.items() if k != "architecture"})
    assert start["n_params"] == sum(int(np.prod(p.shape)) for p in GPT2.params(cfg).values())
    unigram = start["data"]["unigram_nats"]
    assert 0 < unigram < math.log(512)
    steps = [e for e in ev if e["kind"] == "step"]
    assert [e["step"] for e in steps] == list(range(1, 301))
    assert all(math.isfinite(e["loss"]) for e in steps)
    assert abs(steps[0]["loss"] - math.log(512)) < 0.1  # small init: near-uniform predictions
    val = {e["step"]: e["loss"] for e in ev if e["kind"] == "eval"}
    assert sorted(val) == [100, 200, 300]
    assert val[100] > val[200] > val[300]
    # measured: 4.84 / 4.53 / 4.46 against a unigram baseline of 5.26
    assert val[300] < unigram - 0.5, (val, unigram)
    assert run300.val_loss == val[300]
    assert [e["step"] for e in ev if e["kind"] == "checkpoint"] == [150, 300]
    assert any(e["kind"] == "sample" and e["text"] for e in ev)


@pytest.mark.slow  # the 300-step run (~30 s) is shared by the run tests
def test_checkpoint_is_a_gpt2_gguf(run300):
    path = run300.checkpoint
    with GGUFFile(path) as gf:
        md = gf.metadata
        assert md["general.architecture"] == "gpt2" and md["general.type"] == "model"
        assert md["gpt2.block_count"] == 4 and md["gpt2.embedding_length"] == 128
        assert md["gpt2.attention.head_count"] == 4 and md["gpt2.feed_forward_length"] == 512
        assert md["gpt2.context_length"] == 64 and md["toy.train.step"] == 300
        assert len(md["tokenizer.ggml.tokens"]) == 512
        cfg = GPT2Config.from_gguf(gf)
        assert set(gf.tensors) == set(GPT2.params(cfg))  # tied: no output.weight
        assert tuple(gf.tensors["position_embd.weight"].shape) == (64, 128)
        assert tuple(gf.tensors["blk.0.attn_qkv.weight"].shape) == (384, 128)
    gguf = pytest.importorskip("gguf")  # a dev requirement: llama.cpp's own reader
    reader = gguf.GGUFReader(str(path))
    u32 = [gguf.GGUFValueType.UINT32]
    for key in ("gpt2.block_count", "gpt2.context_length", "gpt2.embedding_length", "gpt2.feed_forward_length",
                "gpt2.attention.head_count", "general.file_type"):  # fmt: skip
        assert reader.fields[key].types == u32, key
    assert reader.fields["gpt2.attention.layer_norm_epsilon"].types == [gguf.GGUFValueType.FLOAT32]


@pytest.mark.slow  # the 300-step run (~30 s) is shared by the run tests
def test_checkpoint_loads_with_toy_load_and_generates(run300):
    import toy

    ck = checkpoint.load(run300.run_dir / "checkpoints")
    with GGUFFile(ck.model_path) as gf:
        cfg = GPT2Config.from_gguf(gf)
    params = {k: v.astype(np.float64) for k, v in ck.params.items()}
    m = toy.load(run300.run_dir / "checkpoints" / "latest", threads=1)
    try:
        assert m.cfg == cfg
        ids = m.tokenize("The for statement is used to iterate", add_special=False)
        T = len(ids)
        got = m.logits(ids)
        ref = torch_gpt2.logits(params, cfg, [ids], [list(range(T))], [[0] * T], gelu="fp16")[0]
        # the inference engine rounds K/V to F16 (its cache type): float16-level agreement
        np.testing.assert_allclose(got, ref, atol=2e-3 * float(np.abs(ref).max()) + 1e-4)
        out = m.generate("The for statement", max_tokens=8, temperature=0, ignore_eos=True)
        assert len(out.tokens) == 8
        # each greedy choice is the reference's argmax after the same tokens,
        # wherever the reference's top-2 margin is clear of the logit tolerance
        seq = m.tokenize("The for statement", add_special=False)
        checked = 0
        for tok in out.tokens:
            z = torch_gpt2.logits(params, cfg, [seq], [list(range(len(seq)))], [[0] * len(seq)], gelu="fp16")[0, -1]
            top2 = np.sort(z)[-2:]
            if top2[1] - top2[0] > 0.05:
                assert tok == int(np.argmax(z))
                checked += 1
            seq.append(tok)
        assert checked >= 4, f"only {checked} clear greedy choices to compare"
    finally:
        m.close()


@pytest.mark.slow  # the 300-step run (~30 s) is shared by the run tests
def test_resume_is_exact(run300, demo, tmp_path):
    """10 steps straight == 5 steps, stop, resume for 5: identical losses,
    gradient norms, weights and AdamW moments (gradient accumulation on).
    The tokenizer is the 300-step run's (skips training another BPE)."""
    kw = {"steps": 10, "grad_accum": 2, "eval_every": 0, "save_every": 0, "sample_tokens": 0,
          "tokenizer.model": str(run300.checkpoint)}  # fmt: skip
    full = train(run_cfg(demo, tmp_path / "a", **kw))
    polls = {"n": 0}

    def should_stop():  # polled before each step: the 6th poll comes after step 5
        polls["n"] += 1
        return polls["n"] == 6

    half = train(run_cfg(demo, tmp_path / "b", **kw), Hooks(should_stop=should_stop))
    assert half.reason == "interrupted" and half.final_step == 5
    rest = resume(half.run_dir)
    assert rest.reason == "completed" and rest.final_step == 10
    assert step_curve(half.run_dir) == step_curve(full.run_dir)
    a = checkpoint.load(full.run_dir / "checkpoints")
    b = checkpoint.load(half.run_dir / "checkpoints")
    assert a.step == b.step == 10 and set(a.params) == set(b.params) == set(GPT2.params(tiny_like(a)))
    for name in a.params:
        assert a.params[name].tobytes() == b.params[name].tobytes(), name
    for name in a.optimizer:
        assert a.optimizer[name].tobytes() == b.optimizer[name].tobytes(), name


def tiny_like(ck) -> GPT2Config:
    with GGUFFile(ck.model_path) as gf:
        return GPT2Config.from_gguf(gf)


@pytest.mark.slow  # the 300-step run (~30 s) is shared by the run tests
def test_warm_start_from_a_gpt2_donor(run300, demo, tmp_path):
    """`toy train warm-start --arch gpt2 --preset tiny --layers 2 --context 32
    --model DONOR`: the donor's embedding, first 32 positions and blocks 0-1
    (every tensor of them, biases and norm shifts included) are the new
    model's starting values, as the run reports."""
    from toy.train.model import model_config
    from toy.train.recipes import warm_start_params

    donor = run300.checkpoint
    over = {"recipe": "warm-start", "base": str(donor), "model.n_layer": 2, "context": 32, "steps": 2,
            "eval_every": 0, "save_every": 0, "sample_tokens": 0, "seed": 3}  # fmt: skip
    cfg = run_cfg(demo, tmp_path / "w", **over)
    res = train(cfg)
    assert res.reason == "completed" and math.isfinite(res.final_loss)
    start = events(res.run_dir)[0]
    assert start["recipe"] == "warm-start" and start["model"]["architecture"] == "gpt2"
    assert start["tokenizer"].startswith("model:")  # the donor's tokenizer
    ws = start["warm_start"]
    assert ws["embedding"] == "copied" and ws["positions"] == {"position_embd.weight": "copied"}
    assert ws["blocks_copied"] == [0, 1] and ws["blocks_skipped_shape"] == []
    with GGUFFile(donor) as gf:
        mc = model_config(cfg.model, 512, cfg.context)
        params, facts = warm_start_params(cfg, mc, gf, cfg.seed)
        assert facts == {k: ws[k] for k in facts}
        assert set(params) == set(GPT2.params(mc))
        np.testing.assert_array_equal(params["token_embd.weight"], gf.tensor_to_float("token_embd.weight"))
        np.testing.assert_array_equal(params["position_embd.weight"], gf.tensor_to_float("position_embd.weight")[:32])
        for n in (n for n in params if n.startswith("blk.")):
            np.testing.assert_array_equal(params[n], gf.tensor_to_float(n), err_msg=n)
        # the final norm is not a block's: from scratch (gain 1, shift 0)
        assert (params["output_norm.weight"] == 1).all() and not params["output_norm.bias"].any()
        # a narrower model: projected embedding, no position or block fits
        narrow = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, d_model=64))
        mc = model_config(narrow.model, 512, narrow.context)
        params, facts = warm_start_params(narrow, mc, gf, 3)
        assert facts["embedding"].startswith("projected 128 -> 64") and facts["blocks_copied"] == []
        assert facts["positions"]["position_embd.weight"].startswith("random")
        assert params["token_embd.weight"].shape == (512, 64)
        # more positions than the donor has: random, said so
        longer = dataclasses.replace(cfg, context=128)
        _, facts = warm_start_params(longer, model_config(longer.model, 512, 128), gf, 3)
        assert facts["positions"]["position_embd.weight"].startswith("random") and facts["blocks_copied"] == [0, 1]
        # the default architecture (llama) with this donor: one clear error naming the way out
        as_llama = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, arch="llama"))
        with pytest.raises(BadInputError, match="donor is a gpt2 model, the new model llama") as e:
            warm_start_params(as_llama, model_config(as_llama.model, 512, 32), gf, 3)
        assert "--arch gpt2" in (e.value.hint or "")


@pytest.mark.slow  # the 300-step run (~30 s) is shared by the run tests
def test_lora_run_on_a_gpt2_base_writes_an_adapter_toy_load_applies(run300, tmp_path):
    """`toy train lora --model GPT2 --targets qkv,o,up,down`: the adapter
    names GPT-2's weights, and ``toy.load(base, lora=adapter)`` computes the
    logits of W + s·B·A (the reference), with the base file unchanged."""
    import toy
    from toy.adapters import load_adapter
    from toy.train.config import defaults

    base = run300.checkpoint
    before = hashlib.sha256(base.read_bytes()).hexdigest()
    rows = [{"prompt": f"say {w} twice:", "completion": f" {w} {w}."} for w in ("for", "while", "class", "def")]
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows * 8))
    cfg = C.override(
        defaults("lora"),
        **{"base": str(base), "data.paths": [str(data)], "lora.targets": ["qkv", "o", "up", "down"], "steps": 4,
           "batch_size": 2, "context": 32, "eval_every": 0, "save_every": 0, "sample_tokens": 0,
           "out": str(tmp_path / "runs"), "threads": 1},
    )  # fmt: skip
    res = train(cfg)
    assert res.reason == "completed" and math.isfinite(res.final_loss)
    ad = load_adapter(res.checkpoint)
    assert ad.architecture == "gpt2" and ad.rank == 8
    stems = ("attn_qkv", "attn_output", "ffn_up", "ffn_down")
    assert set(ad.pairs) == {f"blk.{i}.{t}.weight" for i in range(4) for t in stems}
    assert any(np.abs(b).max() > 0 for _, b in ad.pairs.values())  # B moved off zero
    with GGUFFile(base) as gf:
        bcfg = GPT2Config.from_gguf(gf)
        w = {n: np.array(gf.tensor_to_float(n), np.float64) for n in gf.tensors}
    terms = {n: (a, b, ad.alpha / ad.rank) for n, (a, b) in ad.pairs.items()}
    with toy.load(base, threads=1, lora=str(res.checkpoint)) as m:
        ids = m.tokenize("say for twice: for for.", add_special=False)
        got = m.logits(ids)
    T = len(ids)
    ref = torch_gpt2.logits(w, bcfg, [ids], [list(range(T))], [[0] * T], lora=terms, gelu="fp16")[0]
    tol = 2e-3 * float(np.abs(ref).max()) + 1e-4  # the F16 KV cache
    np.testing.assert_allclose(got, ref, atol=tol)
    plain = torch_gpt2.logits(w, bcfg, [ids], [list(range(T))], [[0] * T], gelu="fp16")[0]
    assert float(np.abs(ref - plain).max()) > 10 * tol  # the adapter's effect is well above the tolerance
    assert hashlib.sha256(base.read_bytes()).hexdigest() == before


def test_warm_start_refuses_a_donor_of_another_architecture(tmp_path):
    from toy.train.model import model_config
    from toy.train.recipes import warm_start_params
    from toy_testsupport.tiny_llama import write_tiny

    llama = write_tiny(tmp_path / "llama.gguf")
    cfg = C.override(C.TrainConfig(), **{**RUN, "recipe": "warm-start", "base": str(llama), "data.paths": ["x"]})
    with GGUFFile(llama) as gf:
        with pytest.raises(BadInputError, match="donor is a llama model, the new model gpt2") as e:
            warm_start_params(cfg, model_config(cfg.model, 64, cfg.context), gf, 0)
    assert "--arch llama" in (e.value.hint or "")
