"""Training diagnostics (``toy.train.diagnostics``) against independent references.

- gradient norms per tensor / block / kind: PyTorch float64 autograd
  (``torch_llama.loss_and_grads``) on the same tiny model and batch;
- update ratios ||dtheta|| / ||theta||: ``torch.optim.AdamW`` + ``clip_grad_norm_``
  (``torch_llama.adamw_step``) from the same parameters and gradients;
- activations: the NumPy llama forward (``llama_np.forward_logits(hidden=)``);
- drift: NumPy norms of the parameters the engine returns;
- the divergence diagnosis: a NaN planted in one weight is named, in the
  engine and in a whole run (error message and ``diag_nonfinite`` event).

Tolerances: toy computes in float32, the references in float64; norms
agree to ~1e-6 relative (1e-4 asserted); an update ratio is ~lr-sized and
its float32 error is ~1e-5 of the update (1e-3 relative asserted: a wrong
clip factor, decay group or bias correction is off by far more).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from toy.gguf import GGUFFile
from toy.models.llama import LlamaConfig
from toy.train import config as C
from toy.train.diagnostics import Diagnostics, block_of, diagnose, resolve_kinds
from toy.train.model import ArchTrain
from toy.train.optim import OptimConfig
from toy.train.stepgraph import TrainEngine
from toy.train.steploop import TrainingDivergedError
from toy_testsupport import torch_llama
from toy_testsupport.reference import llama_np
from toy_testsupport.tiny_llama import VARIANTS, write_tiny
from toy_testsupport.train_helpers import TINY_SCRATCH, Batch, packed_batch, python_docs_corpus


def load_tiny(tmp_path, variant: str):
    path = write_tiny(tmp_path / f"{variant}.gguf", **VARIANTS[variant])
    with GGUFFile(path) as gf:
        cfg = LlamaConfig.from_gguf(gf)
        w = {k: v.astype(np.float32) for k, v in llama_np.load_weights(gf).items()}
    return cfg, w


def _grouped(ref: dict[str, float], kinds: dict[str, str], n_layer: int):
    """Reference per-block / per-kind / other sums (of squares or otherwise)."""
    layers = [0.0] * n_layer
    by_kind: dict[str, float] = {}
    other: dict[str, float] = {}
    for name, v in ref.items():
        b = block_of(name)
        if b is None:
            other[name] = v
        else:
            layers[b] += v
        by_kind[kinds[name]] = by_kind.get(kinds[name], 0.0) + v
    return layers, by_kind, other


def test_resolve_kinds():
    assert resolve_kinds(["all"]) == list(C.DIAGNOSTICS)
    assert resolve_kinds(["drift", "grads"]) == ["grads", "drift"]
    with pytest.raises(ValueError, match="unknown"):
        resolve_kinds(["grad"])


@pytest.mark.parametrize("clip", [0.0, 0.05])
def test_grad_norms_and_update_ratios_match_torch(tmp_path, rt, clip):
    cfg, w = load_tiny(tmp_path, "qwen2_bias_neox")
    opt = OptimConfig(lr=1e-2, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1, grad_clip=clip)
    eng = TrainEngine(ArchTrain(cfg), w, rt, opt, batch=2, context=8)
    diag = Diagnostics(["grads", "updates"], 1, eng)
    kinds = {s.name: s.kind for s in eng.specs}
    no_decay = {s.name for s in eng.specs if not s.decays(opt)}
    rng = np.random.default_rng(4)
    state = None
    for lr in [1e-2, 5e-3]:
        b = packed_batch(rng, cfg.n_vocab, 2, 8)
        before = {k: v.astype(np.float64) for k, v in eng.param_values().items()}
        _, ref_g = torch_llama.loss_and_grads(
            eng.param_values(), cfg, b.tokens, b.pos, b.doc, b.targets, b.loss_mask, float(b.loss_mask.sum())
        )
        ref_p, state, ref_norm = torch_llama.adamw_step(
            before, ref_g, state, lr=lr, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1,
            no_decay=no_decay, max_grad_norm=clip or None,
        )  # fmt: skip
        diag.before_step(eng)
        eng.train_step([b], lr)
        events = dict(diag.after_step(eng))
        assert set(events) == {"diag_grads", "diag_updates"}
        g = events["diag_grads"]
        # per tensor
        ref_sq = {k: float(np.sum(v * v)) for k, v in ref_g.items()}
        for name, got in g["tensors"].items():
            assert got == pytest.approx(math.sqrt(ref_sq[name]), rel=1e-4, abs=1e-9), name
        assert g["total"] == pytest.approx(ref_norm, rel=1e-4)
        layers, by_kind, other = _grouped(ref_sq, kinds, cfg.n_layer)
        assert g["layers"] == pytest.approx([math.sqrt(v) for v in layers], rel=1e-4)
        assert g["kinds"] == pytest.approx({k: math.sqrt(v) for k, v in by_kind.items()}, rel=1e-4)
        assert g["other"] == pytest.approx({k: math.sqrt(v) for k, v in other.items()}, rel=1e-4)
        # update ratios against torch's AdamW step from the same parameters and gradients
        u = events["diag_updates"]
        d_sq = {k: float(np.sum((ref_p[k] - before[k]) ** 2)) for k in before}
        p_sq = {k: float(np.sum(before[k] ** 2)) for k in before}
        dl, dk, do = _grouped(d_sq, kinds, cfg.n_layer)
        pl, pk, po = _grouped(p_sq, kinds, cfg.n_layer)
        assert u["layers"] == pytest.approx([math.sqrt(a / c) for a, c in zip(dl, pl)], rel=1e-3)
        assert u["kinds"] == pytest.approx({k: math.sqrt(dk[k] / pk[k]) for k in dk if pk[k] > 0}, rel=1e-3)
        assert u["other"] == pytest.approx({k: math.sqrt(do[k] / po[k]) for k in do}, rel=1e-3)
        assert all(v > 0 for v in u["layers"])
    eng.close()


def test_drift_and_activations_match_numpy(tmp_path, rt):
    cfg, w = load_tiny(tmp_path, "gqa_untied")
    eng = TrainEngine(ArchTrain(cfg), w, rt, OptimConfig(lr=1e-2), batch=2, context=10)
    rng = np.random.default_rng(7)
    # the probe: two whole rows (one document each), so each row is the NumPy forward of its tokens
    toks = rng.integers(0, cfg.n_vocab, size=(2, 10))
    probe = Batch(toks, np.roll(toks, -1, axis=1), np.ones((2, 10)), np.tile(np.arange(10), (2, 1)), np.zeros((2, 10)))
    probe.loss_mask[1, 5:] = 0  # rows without a target are left out of the statistics
    diag = Diagnostics(["drift", "activations"], 3, eng, reference=w, probe=probe)
    for step in range(1, 7):
        diag.before_step(eng)
        eng.train_step([packed_batch(rng, cfg.n_vocab, 2, 10)], 1e-2)
        events = dict(diag.after_step(eng))
        assert bool(events) == (step % 3 == 0)
    now = eng.param_values()
    d = events["diag_drift"]
    assert d["reference"] == "initial"
    num = [0.0] * cfg.n_layer
    den = [0.0] * cfg.n_layer
    for k in w:
        b = block_of(k)
        if b is not None:
            num[b] += float(np.sum((now[k].astype(np.float64) - w[k]) ** 2))
            den[b] += float(np.sum(w[k].astype(np.float64) ** 2))
    assert d["layers"] == pytest.approx([math.sqrt(a / c) for a, c in zip(num, den)], rel=1e-5)
    total = math.sqrt(sum(float(np.sum((now[k].astype(np.float64) - w[k]) ** 2)) for k in w))
    assert d["total"] == pytest.approx(total / math.sqrt(sum(float(np.sum(w[k] ** 2.0)) for k in w)), rel=1e-5)
    a = events["diag_activations"]
    rows = []
    for r in range(2):
        hidden: list = []
        llama_np.forward_logits(cfg, {k: v.astype(np.float64) for k, v in now.items()}, toks[r], hidden=hidden)
        rows.append(hidden)
    for i in range(cfg.n_layer):
        x = np.concatenate([rows[0][i], rows[1][i][:5]])
        assert a["mean"][i] == pytest.approx(float(x.mean()), abs=1e-4 * float(np.abs(x).max()))
        assert a["rms"][i] == pytest.approx(float(np.sqrt(np.mean(x * x))), rel=1e-4)
        assert a["max_abs"][i] == pytest.approx(float(np.abs(x).max()), rel=1e-4)
    eng.close()


def test_planted_nan_is_named_by_the_engine(tmp_path, rt):
    cfg, w = load_tiny(tmp_path, "gqa_untied")
    bad = dict(w)
    bad["blk.1.attn_v.weight"] = w["blk.1.attn_v.weight"].copy()
    bad["blk.1.attn_v.weight"][3, 5] = np.nan
    batch = packed_batch(np.random.default_rng(1), cfg.n_vocab, 2, 12)
    eng = TrainEngine(ArchTrain(cfg), bad, rt, OptimConfig(), batch=2, context=12)
    eng.watch_steps()  # what a run with diagnostics does
    r = eng.train_step([batch], 1e-3)
    assert not math.isfinite(r.loss)
    # AdamW spread the NaN: after the step every tensor holds NaN, so only the pre-update check can tell
    assert all(np.isnan(v).any() for v in eng.param_values().values())
    text, fields = diagnose(eng)
    assert fields == {"source": "parameter", "tensor": "blk.1.attn_v.weight", "block": 1}
    assert "blk.1.attn_v.weight (block 1)" in text
    eng.close()
    # unwatched (no diagnostics: no pass over the weights per step): the gradients only, and the way to see more
    eng = TrainEngine(ArchTrain(cfg), bad, rt, OptimConfig(), batch=2, context=12)
    assert not math.isfinite(eng.train_step([batch], 1e-3).loss)
    text, fields = diagnose(eng)
    assert fields["source"] == "gradient" and "--diagnostics nonfinite" in text
    eng.close()


def test_diagnostics_leave_the_steps_unchanged(tmp_path, rt):
    """The outputs the diagnostics read do not change a step's arithmetic."""
    cfg, w = load_tiny(tmp_path, "mha_tied")
    curves = []
    for kinds in ([], ["all"]):
        eng = TrainEngine(ArchTrain(cfg), w, rt, OptimConfig(lr=3e-3), batch=2, context=12)
        diag = Diagnostics(kinds, 1, eng, reference=w) if kinds else None
        rng = np.random.default_rng(2)
        out = []
        for _ in range(3):
            b = packed_batch(rng, cfg.n_vocab, 2, 12)
            if diag:
                diag.before_step(eng)
            r = eng.train_step([b], 3e-3)
            if diag:
                diag.after_step(eng)
                eng.activations(b)
            out.append((r.loss, r.grad_norm))
        curves.append(out)
        eng.close()
    assert curves[0] == curves[1]


def test_a_model_without_taps_skips_activations_with_a_note(tmp_path, rt):
    cfg, w = load_tiny(tmp_path, "gqa_untied")

    class NoTaps(ArchTrain):  # a model whose logits take no taps (as toy-vit's classifier)
        def logits(self, ctx, params, inputs, training=True):
            return super().logits(ctx, params, inputs, training)

    eng = TrainEngine(NoTaps(cfg), w, rt, OptimConfig(), batch=2, context=8)
    assert not eng.supports_taps
    b = packed_batch(np.random.default_rng(3), cfg.n_vocab, 2, 8)
    diag = Diagnostics(["grads", "activations"], 1, eng, probe=b)
    assert diag.skipped == ["diagnostics: activations skipped: this model's graph gives no per-block residual stream"]
    diag.before_step(eng)
    eng.train_step([b], 1e-3)
    assert [k for k, _ in diag.after_step(eng)] == ["diag_grads"]
    assert eng.step_taps() == [] and eng.activations(b) == []
    eng.close()


def test_lora_adapters_drift_and_activations(tmp_path, rt):
    """LoRA: the parameters are the adapters. With B = 0 the adapted model is
    the base, so the activations equal the NumPy base forward; a block's
    drift and update ratios stay finite although B starts at zero."""
    from toy.train.lora import LoraSettings, LoraTrain, init_lora
    from toy_testsupport.train_helpers import BoundModel

    base = BoundModel(write_tiny(tmp_path / "base.gguf", **VARIANTS["gqa_untied"]), rt, LlamaConfig.from_gguf)
    model = LoraTrain(base.cfg, base.bound.tensors, LoraSettings())
    init = init_lora(model.shapes, seed=0)
    eng = TrainEngine(model, init, rt, OptimConfig(lr=1e-2), batch=1, context=12)
    toks = np.random.default_rng(5).integers(0, base.cfg.n_vocab, size=(1, 12))
    probe = Batch(toks, np.roll(toks, -1, axis=1), np.ones((1, 12)), np.arange(12)[None], np.zeros((1, 12)))
    try:
        hidden: list = []
        llama_np.forward_logits(base.cfg, {k: v.astype(np.float64) for k, v in base.w.items()}, toks[0], hidden=hidden)
        got = eng.activations(probe)
        for i, h in enumerate(hidden):
            np.testing.assert_allclose(got[i], h, rtol=1e-4, atol=1e-5 * float(np.abs(h).max()))
        diag = Diagnostics(["updates", "drift"], 1, eng, reference=init, reference_label="initial adapters")
        diag.before_step(eng)
        eng.train_step([packed_batch(np.random.default_rng(6), base.cfg.n_vocab, 1, 12)], 1e-2)
        ev = dict(diag.after_step(eng))
    finally:
        eng.close()
        model.close()
        base.close()
    for kind in ("diag_updates", "diag_drift"):
        assert len(ev[kind]["layers"]) == base.cfg.n_layer
        assert all(v is not None and 0 < v < 1 for v in ev[kind]["layers"]), ev[kind]
    assert ev["diag_drift"]["reference"] == "initial adapters" and ev["diag_drift"]["other"] == {}


# -- whole runs ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return python_docs_corpus(tmp_path_factory.mktemp("corpus"), 4)


def _cfg(corpus, out: Path, **kw):
    values = {**TINY_SCRATCH, "data.paths": [str(corpus["small"])], "data.cache_dir": str(corpus["cache"])}
    values.update({"out": str(out), "steps": 4, "save_every": 0, "eval_every": 2, "data.val_fraction": 0.2})
    values.update(kw)
    return C.override(C.TrainConfig(), **values)


def _events(run_dir: Path) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "events.jsonl").read_text().splitlines() if x.strip()]


def test_run_writes_every_diagnostics_event(corpus, tmp_path):
    from toy.train.lmrun import train

    # with accumulation: the norms are those of the step's summed micro-batches ("last" graph)
    r = train(_cfg(corpus, tmp_path, grad_accum=2, **{"diagnostics.kinds": ["all"], "diagnostics.every": 2}))
    ev = _events(r.run_dir)
    by_kind: dict[str, list[int]] = {}
    for e in ev:
        if e["kind"].startswith("diag_"):
            by_kind.setdefault(e["kind"], []).append(e["step"])
    assert by_kind == {k: [2, 4] for k in ("diag_grads", "diag_updates", "diag_drift", "diag_activations")}
    steps = {e["step"]: e for e in ev if e["kind"] == "step"}
    for e in ev:
        if e["kind"] == "diag_grads":
            assert e["total"] == pytest.approx(steps[e["step"]]["grad_norm"], rel=1e-5)
            assert len(e["layers"]) == 2 and len(e["tensors"]) > 0
        if e["kind"] == "diag_activations":
            assert len(e["rms"]) == 2 and all(v > 0 for v in e["rms"])
        if e["kind"] == "diag_drift":
            assert e["reference"] == "initial" and e["total"] > 0


def test_run_with_a_planted_nan_names_the_tensor(corpus, tmp_path, monkeypatch):
    import toy.train.lmrun as lmrun

    real = lmrun.init_params

    def planted(cfg, seed, *a, **kw):
        p = real(cfg, seed, *a, **kw)
        p["blk.1.ffn_up.weight"][0, 0] = np.nan
        return p

    monkeypatch.setattr(lmrun, "init_params", planted)
    with pytest.raises(TrainingDivergedError, match=r"parameter blk\.1\.ffn_up\.weight \(block 1\) held NaN"):
        lmrun.train(_cfg(corpus, tmp_path, **{"diagnostics.kinds": ["nonfinite"]}))
    (run_dir,) = [p for p in tmp_path.iterdir() if (p / "events.jsonl").is_file()]
    ev = _events(run_dir)
    nf = [e for e in ev if e["kind"] == "diag_nonfinite"]
    assert len(nf) == 1 and nf[0]["tensor"] == "blk.1.ffn_up.weight" and nf[0]["source"] == "parameter"
    assert ev[-1]["kind"] == "run_end" and ev[-1]["reason"] == "errored"
