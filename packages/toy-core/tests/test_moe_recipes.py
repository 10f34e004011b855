"""The fine-tuning recipes on mixture-of-experts GGUFs: LoRA, QLoRA and full
fine-tunes through ``toy.train.lmrun.train`` / ``resume`` (the entry points
of the llama and Gemma recipe tests), on ``moe_ref``'s converted OLMoE,
Qwen2-MoE (shared expert) and Qwen3-MoE (renormalised expert weights)
models: 8 experts, top-2, GPT-2's tokenizer (no chat template, so the data
is JSONL text and prompt/completion).

Where each expectation comes from:

- resume: a run stopped at step k and resumed equals the uninterrupted run
  (as test_train_recipes.py and test_gemma_recipes.py assert): step losses,
  the adapter's A/B (LoRA) or every weight (full), and the AdamW moments,
  bit for bit;
- LoRA targets: a MoE model's are q, k, v, o and ``router``
  (``ffn_gate_inp``; the 3-D experts take no adapter), so the adapter holds
  exactly those pairs per layer, the router's B moves off zero, and naming
  a dense feed-forward target (gate, up, down) is a ``ConfigError`` naming
  the model's targets before any step;
- the adapter at inference: ``toy.load(base, lora=adapter)`` against the
  merged model ``toy.merge`` writes (W + s·B·A in float64, then the
  plain forward), both with an F32 KV cache, within ``TOL`` of the largest
  logit (float32 rounding of two ways to compute the same products,
  measured 3.6e-7 and 9.4e-7 of it; routing decisions are ~1e-3 apart in
  probability, far above that, so no token changes experts); the adapter
  moves logits by 3.1 and 4.0, thousands of times ``TOL``;
- QLoRA: the same recipe on a Q8_0 file (``moe_ref``'s converter output):
  the adapted attention weights stay Q8_0 (``weight_types`` of the run's
  start event), the run learns (validation loss 11.29 -> 9.79 in six
  steps), its adapter loads on the Q8_0 file and changes its logits;
- the full fine-tune (weight decay 0, so a tensor moves only by its
  gradient): the experts of every layer are trained (each of the 8 experts
  of gate, up and down in every layer moves: five steps of 96 tokens route
  tokens to all of them), the router and the shared expert too; the checkpoint keeps the base's metadata key
  for key and type for type (``expert_count``, ``expert_used_count``,
  ``expert_feed_forward_length``, ``expert_shared_feed_forward_length``,
  …), reads back to the same config, and ``toy.load`` runs it.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import toy
from toy import models
from toy.adapters import load_adapter
from toy.gguf import GGUFFile
from toy.train.config import ConfigError
from toy.train.lmrun import train
from toy_testsupport import moe_ref
from toy_testsupport import train_helpers as th
from toy_testsupport.gpt2_ref import sha256 as sha
from toy_testsupport.train_helpers import assert_full_checkpoints, events

CONTEXT = 48
# adapter applied vs merged weights, relative to the largest |logit|: float32 rounding
# (measured 3.6e-7 qwen2moe-tiny, 9.4e-7 olmoe-tiny)
TOL = 1e-5
LORA_TARGETS = ["q", "k", "v", "o", "router"]
LORA_STEMS = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate_inp")


def base_path(shape: str, outtype: str = "f32") -> Path:
    return moe_ref.gguf_path(shape, 0, outtype)


def sample_ids(n: int = 24) -> list[int]:
    return moe_ref.sample_ids(n, seed=7)


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    """48 examples, 24 text and 24 prompt/completion, each fitting a row."""
    return th.write_examples(tmp_path_factory.mktemp("moe-data") / "data.jsonl", 48, ("text", "prompt_completion"))


def cfg_for(base: Path, recipe: str, data: Path, out: Path, steps: int, **kw):
    return th.recipe_config(recipe, base, data, out, steps, CONTEXT, **kw)


def resumed(cfg, tmp: Path, stop: int):
    """``train_helpers.resumed_run`` on this module's data: (straight, resumed, the base's config)."""
    return th.resumed_run(cfg, tmp, stop, {"text": 24, "prompt_completion": 24})


def logits_of(path: Path, ids, lora=None) -> np.ndarray:
    with toy.load(path, threads=1, kv_type="f32", lora=lora) as m:
        return m.logits(ids)


# ---------------------------------------------------------------- LoRA


@pytest.mark.parametrize("shape", ["qwen2moe-tiny", "olmoe-tiny"])
def test_lora_run_resumes_exactly_and_its_adapter_loads(shape, data, tmp_path):
    base = base_path(shape)
    before = sha(base)
    cfg = cfg_for(
        base, "lora", data, tmp_path / "a", 6, **{"lora.targets": LORA_TARGETS, "lora.rank": 4, "optim.lr": 1e-2}
    )
    straight, done, mcfg = resumed(cfg, tmp_path, 2)
    assert mcfg.n_expert == 8 and mcfg.architecture == moe_ref.SHAPES[shape]["arch"]
    start = events(straight.run_dir)[0]
    assert start["lora"]["targets"] == LORA_TARGETS and start["base"]["weight_types"] == ["F32"]
    assert straight.checkpoint.name == done.checkpoint.name == "step_6.gguf"

    ad, bd = load_adapter(straight.checkpoint), load_adapter(done.checkpoint)
    assert ad.architecture == mcfg.architecture and (ad.rank, ad.alpha) == (4, 16.0)
    want = {f"blk.{i}.{s}.weight" for i in range(mcfg.n_layer) for s in LORA_STEMS}
    assert set(ad.pairs) == set(bd.pairs) == want
    for k in ad.pairs:
        for x, y in zip(ad.pairs[k], bd.pairs[k]):
            assert x.tobytes() == y.tobytes(), k
    a, b = ad.pairs["blk.0.ffn_gate_inp.weight"]
    assert a.shape == (4, mcfg.d_model) and b.shape == (8, 4)  # the router: d_model -> 8 experts
    for i in range(mcfg.n_layer):  # B moved off zero, the router's too
        for s in LORA_STEMS:
            assert np.abs(ad.pairs[f"blk.{i}.{s}.weight"][1]).max() > 0, (i, s)
    assert sha(base) == before  # the base is never written

    # toy.load applies the adapter: the logits of the merged weights, not the base's
    from toy.merge import merge_adapters

    merged = tmp_path / "merged.gguf"
    merge_adapters(base, [(straight.checkpoint, 1.0)], merged, drift=False)
    ids = sample_ids()
    plain = logits_of(base, ids)
    adapted = logits_of(base, ids, lora=str(straight.checkpoint))
    want_logits = logits_of(merged, ids)
    tol = TOL * float(np.abs(want_logits).max())
    np.testing.assert_allclose(adapted, want_logits, rtol=0, atol=tol)
    assert float(np.abs(adapted - plain).max()) > 100 * tol
    assert sha(base) == before


def test_qlora_run_on_a_q8_0_file(data, tmp_path):
    """The LoRA recipe on qwen3moe-tiny's Q8_0 file: the adapted attention
    weights stay Q8_0, the run learns, its adapter changes the Q8_0 model's
    logits through ``toy.load``."""
    base = base_path("qwen3moe-tiny", "q8_0")
    before = sha(base)
    with GGUFFile(base) as gf:
        assert gf.tensors["blk.0.attn_q.weight"].dtype.name == "Q8_0"
        assert gf.tensors["blk.0.ffn_up_exps.weight"].dtype.name == "Q8_0"  # the experts too (frozen)
        assert gf.tensors["blk.0.ffn_gate_inp.weight"].dtype.name == "F32"  # the converter keeps routers F32
    cfg = cfg_for(
        base, "lora", data, tmp_path / "q", 6,
        **{"lora.targets": LORA_TARGETS, "lora.rank": 4, "optim.lr": 1e-2, "eval_every": 6, "save_every": 6},
    )  # fmt: skip
    res = train(cfg)
    assert res.reason == "completed" and res.checkpoint.name == "step_6.gguf"
    start = events(res.run_dir)[0]
    assert start["base"]["weight_types"] == ["F32", "Q8_0"]  # the routers, and attention
    evals = [e["loss"] for e in events(res.run_dir) if e["kind"] == "eval"]
    assert len(evals) == 2 and evals[1] < evals[0]  # it learns
    ad = load_adapter(res.checkpoint)
    assert set(ad.pairs) == {f"blk.{i}.{s}.weight" for i in range(3) for s in LORA_STEMS}
    ids = sample_ids()
    plain = logits_of(base, ids)
    adapted = logits_of(base, ids, lora=str(res.checkpoint))
    assert np.isfinite(adapted).all() and float(np.abs(adapted - plain).max()) > 1e-2
    assert sha(base) == before


@pytest.mark.parametrize("dense", ["gate", "up", "down"])
def test_a_dense_feed_forward_target_is_a_clear_error(dense, data, tmp_path):
    base = base_path("qwen2moe-tiny")
    cfg = cfg_for(base, "lora", data, tmp_path / "runs", 2, **{"lora.targets": ["q", dense]})
    with pytest.raises(ConfigError, match=rf"lora.targets: '{dense}' is not a module of qwen2moe models") as e:
        train(cfg)
    assert e.value.hint == "qwen2moe modules: q, k, v, o, router"
    assert not any((tmp_path / "runs").glob("*/checkpoints/*.gguf"))


# ---------------------------------------------------------------- full fine-tune


def test_full_fine_tune_trains_the_experts_resumes_exactly_and_keeps_the_moe_keys(data, tmp_path):
    shape = "qwen3moe-tiny"
    base = base_path(shape)
    before = sha(base)
    # no weight decay: a tensor that moves, moved by its gradient
    cfg = cfg_for(base, "full", data, tmp_path / "f", 5, **{"optim.lr": 1e-3, "optim.weight_decay": 0.0})
    straight, done, bcfg = resumed(cfg, tmp_path, 3)
    arch = bcfg.architecture
    assert arch == "qwen3moe" and bcfg.expert_weights_norm
    assert sha(base) == before

    with GGUFFile(straight.checkpoint) as a, GGUFFile(done.checkpoint) as b, GGUFFile(base) as gf:
        # the weights: the resumed run's equal the straight run's; every base tensor, trained; the metadata:
        # the base's, key for key and type for type (the expert layout, the tokenizer)
        assert_full_checkpoints(a, b, gf, arch, 5)
        for i in range(bcfg.n_layer):
            p = f"blk.{i}"
            router = a.tensor_to_float(f"{p}.ffn_gate_inp.weight"), gf.tensor_to_float(f"{p}.ffn_gate_inp.weight")
            assert not np.array_equal(*router), f"{p} router"
            for which in ("gate", "up", "down"):
                n = f"{p}.ffn_{which}_exps.weight"
                got, was = a.tensor_to_float(n), gf.tensor_to_float(n)  # (E, rows, cols)
                assert got.shape == was.shape == ((8, 32, 64) if which != "down" else (8, 64, 32))
                moved = [not np.array_equal(got[e], was[e]) for e in range(8)]
                assert all(moved), f"{n}: experts moved {moved}"
        hf = moe_ref.SHAPES[shape]
        assert a.metadata[f"{arch}.expert_count"] == hf["num_experts"] == 8
        assert a.metadata[f"{arch}.expert_used_count"] == hf["num_experts_per_tok"] == 2
        assert a.metadata[f"{arch}.expert_feed_forward_length"] == hf["moe_intermediate_size"]
        assert models.config_from_gguf(a) == bcfg  # the same model, read back

    ids = sample_ids()
    plain = logits_of(base, ids)
    with toy.load(straight.checkpoint, threads=1, kv_type="f32") as m:
        assert m.cfg == bcfg
        tuned = m.logits(ids)
        out = m.generate("The river", max_tokens=6, temperature=0, ignore_eos=True)
    assert np.isfinite(tuned).all() and float(np.abs(tuned - plain).max()) > 1e-3
    assert len(out.tokens) == 6


def test_full_fine_tune_keeps_the_shared_expert_keys(data, tmp_path):
    """qwen2moe: the shared expert and its gate are trained, and the
    checkpoint keeps ``expert_shared_feed_forward_length``."""
    base = base_path("qwen2moe-tiny")
    res = train(
        cfg_for(
            base, "full", data, tmp_path, 2,
            **{"optim.lr": 1e-3, "optim.weight_decay": 0.0, "eval_every": 0, "save_every": 0, "sample_tokens": 0},
        )
    )  # fmt: skip
    with GGUFFile(res.checkpoint) as a, GGUFFile(base) as gf:
        assert a.metadata["qwen2moe.expert_shared_feed_forward_length"] == 48
        assert (
            a.types["qwen2moe.expert_shared_feed_forward_length"]
            == gf.types["qwen2moe.expert_shared_feed_forward_length"]
        )
        for n in ("ffn_gate_inp_shexp", "ffn_gate_shexp", "ffn_up_shexp", "ffn_down_shexp", "ffn_gate_inp"):
            w = f"blk.1.{n}.weight"
            assert not np.array_equal(a.tensor_to_float(w), gf.tensor_to_float(w)), w
        cfg = models.config_from_gguf(a)
    assert (cfg.d_ff_shared, cfg.n_expert, cfg.d_ff_expert) == (48, 8, 32)
