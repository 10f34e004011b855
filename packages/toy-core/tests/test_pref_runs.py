"""The preference recipes end to end (``toy.train.prefrun``): dpo, orpo and
kto runs, LoRA and full, on a tiny base (a from-scratch checkpoint made
here, F32 and a Q8_0 copy): run bundles, step and eval metrics, the cached
reference log-probabilities, checkpoints and exact resume.

References: resume equivalence compares a run against itself stopped and
continued (step losses, checkpoints and AdamW moments bit for bit); the
cached reference log-probabilities are checked against the base model's
sequence log-probabilities computed by the inference engine (``toy.load``,
float64 log-softmax in NumPy), not the training engine that wrote them; an
adapter checkpoint is read back with ``load_adapter``.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import numpy as np
import pytest

from toy.adapters import load_adapter
from toy.errors import BadInputError, ConfigError, DataError
from toy.gguf import GGUFFile, quantize_model
from toy.train.config import defaults, override
from toy.train.lmrun import Hooks, resume, train
from toy.train.prefrun import REFERENCE_FILE, REFERENCE_PHASE, orpo_batch
from toy_testsupport import train_helpers as th
from toy_testsupport.gpt2_ref import sha256 as sha
from toy_testsupport.train_helpers import RECIPE_WORDS as WORDS
from toy_testsupport.train_helpers import events, run_and_resume, step_losses

#: what each recipe's step events carry besides lmrun's fields (toy.train.objectives)
METRICS = {
    "dpo": {"rewards_chosen", "rewards_rejected", "margin", "accuracy"},
    "orpo": {"nll", "log_odds_ratio", "margin", "accuracy"},
    "kto": {"kl"},
}


@pytest.fixture(scope="module")
def bases(tmp_path_factory):
    """A tiny from-scratch checkpoint (F32, with its BPE tokenizer), a Q8_0
    copy, 30 preference pairs and 30 labelled examples."""
    d = tmp_path_factory.mktemp("pref")
    rng = np.random.default_rng(0)
    text = "\n".join(" ".join(rng.choice(WORDS, size=12)) + "." for _ in range(400))
    (d / "corpus.txt").write_text(text)
    cfg = override(
        defaults(),
        **{"data.paths": [str(d / "corpus.txt")], "tokenizer.vocab_size": 300, "steps": 4, "batch_size": 2,
           "context": 32, "eval_every": 0, "save_every": 0, "sample_tokens": 0, "out": str(d / "runs"), "threads": 1},
    )  # fmt: skip
    f32 = train(cfg).checkpoint
    q8 = d / "base-q8_0.gguf"
    quantize_model(f32, q8, "q8_0")
    pairs, unpaired = [], []
    for i in range(30):
        a, b = (str(w) for w in rng.choice(WORDS, size=2, replace=False))
        pairs.append({"prompt": f"say {a} twice:", "chosen": f" {a} {a}.", "rejected": f" {b} {a} {b}."})
        good = i % 3 != 0
        unpaired.append({"prompt": f"say {a} twice:", "completion": f" {a} {a}." if good else f" {b}.", "label": good})
    (d / "pairs.jsonl").write_text("".join(json.dumps(x) + "\n" for x in pairs))
    (d / "unpaired.jsonl").write_text("".join(json.dumps(x) + "\n" for x in unpaired))
    return {"f32": f32, "q8": q8, "pairs": d / "pairs.jsonl", "unpaired": d / "unpaired.jsonl"}


def cfg_for(bases, recipe: str, out: Path, steps: int, adapter: str = "lora", base: str = "f32", **kw):
    data = bases["unpaired" if recipe == "kto" else "pairs"]
    values = {"adapter": adapter, "data.val_fraction": 0.2, "optim.lr": 1e-3, **kw}
    return th.recipe_config(recipe, bases[base], data, out, steps, 32, **values)


@pytest.mark.parametrize("adapter", ["lora", "full"])
@pytest.mark.parametrize("recipe", ["dpo", "orpo", "kto"])
def test_run_resumes_exactly_and_records_the_objective(bases, tmp_path, recipe, adapter):
    cfg = cfg_for(bases, recipe, tmp_path / "a", 5, adapter)
    straight, done = run_and_resume(cfg, tmp_path, 2)
    assert step_losses(straight.run_dir) == step_losses(done.run_dir)
    th.assert_same_state(straight.checkpoint, done.checkpoint)
    ev = events(straight.run_dir)
    start = ev[0]
    assert start["recipe"] == recipe and start["adapter"] == adapter
    assert start["objective"]["name"] == recipe
    if recipe != "orpo":
        assert start["objective"]["beta"] == 0.1
    assert start["data"]["format"] == ("unpaired" if recipe == "kto" else "pairs")
    assert start["data"]["examples"] == 30 and start["data"]["val_examples"] == 6
    steps = [e for e in ev if e["kind"] == "step"]
    assert [e["step"] for e in steps] == [1, 2, 3, 4, 5]
    for e in steps:
        assert METRICS[recipe] <= set(e), (recipe, sorted(e))
        assert all(math.isfinite(e[k]) for k in METRICS[recipe])
    # every step trains: at step 1 the policy is the reference (a DPO/KTO margin of exactly 0), which must
    # still give a gradient (the derivative of log sigmoid at 0 is 1/2, not 0)
    assert all(e["grad_norm"] > 0 for e in steps), [e["grad_norm"] for e in steps]
    evals = [e for e in ev if e["kind"] == "eval"]
    assert [e["step"] for e in evals] == [0, 2, 4, 5]
    assert all(e["name"] == "val" and e["examples"] == 6 and math.isfinite(e["loss"]) for e in evals)
    if recipe == "dpo":  # at step 0 the policy is the reference: every reward is 0, the loss log 2
        assert evals[0]["loss"] == pytest.approx(math.log(2), abs=1e-6)
        assert evals[0]["rewards_chosen"] == 0.0 and evals[0]["margin"] == 0.0
    (note,) = [e["text"] for e in ev if e["kind"] == "note" and e["text"].startswith("data:")]
    assert "0 truncated, 0 dropped" in note and "24 training" in note
    cache = straight.run_dir / REFERENCE_FILE
    assert cache.is_file() == (recipe != "orpo") and (start["reference"] is None) == (recipe == "orpo")
    if recipe != "orpo":  # the resume reused the cache the cut run wrote
        assert (done.run_dir / REFERENCE_FILE).read_bytes() == cache.read_bytes()
    if adapter == "lora":
        ad = load_adapter(straight.checkpoint)
        assert ad.rank == 8 and len(ad.pairs) == 4 * 4  # q, k, v, o of the 4 blocks
    else:
        with GGUFFile(straight.checkpoint) as a, GGUFFile(bases["f32"]) as base:
            assert set(a.tensors) == set(base.tensors) and a.metadata["toy.train.step"] == 5


def _base_sequence_logps(base: Path, seqs) -> np.ndarray:
    """Sum of log p(token) over each sequence's loss targets, from the inference engine's logits."""
    import toy

    out = []
    with toy.load(base, threads=1) as m:
        for tokens, loss in seqs:
            logits = np.asarray(m.logits([int(t) for t in tokens[:-1]]), np.float64)
            logp = logits - logits.max(axis=1, keepdims=True)
            logp -= np.log(np.exp(logp).sum(axis=1, keepdims=True))
            picked = logp[np.arange(len(tokens) - 1), tokens[1:]]
            out.append(float(picked[np.asarray(loss[1:], bool)].sum()))
    return np.asarray(out)


@pytest.mark.parametrize("recipe", ["dpo", "kto"])
def test_reference_cache_is_the_base_models_log_probs(bases, tmp_path, recipe):
    from toy.tokenizer import ChatTemplate, Tokenizer
    from toy.train import prefdata

    cfg = cfg_for(bases, recipe, tmp_path / "r", 1, eval_every=0, sample_tokens=0)
    res = train(cfg)
    with np.load(res.run_dir / REFERENCE_FILE) as z:
        ref, kl = z["ref"], (z["kl"] if "kl" in z.files else None)
        assert str(z["base_sha256"]) == sha(bases["f32"])
    with GGUFFile(bases["f32"]) as gf:
        tok, tmpl = Tokenizer.from_gguf(gf.metadata), ChatTemplate.from_gguf(gf.metadata)
    fmt = "unpaired" if recipe == "kto" else "pairs"
    exs, _ = prefdata.load_pref(cfg.data.paths, tok, tmpl, format=fmt, max_length=33)
    sides = 2 if recipe == "dpo" else 1
    assert ref.shape == (len(exs), sides)
    for side in range(sides):
        want = _base_sequence_logps(bases["f32"], [e.sequence(side) for e in exs])
        np.testing.assert_allclose(ref[:, side], want, rtol=1e-4, atol=1e-3)
    if recipe == "kto":  # each row's KL sequence: its prompt, then its partner's completion
        data = prefdata.UnpairedData(exs, 32, val_fraction=0.2, kl_group=cfg.batch_size)
        seqs = []
        for i, e in enumerate(exs):
            c = exs[data.kl_partner(i)].completions[0]
            seqs.append((np.concatenate([e.prompt, c]), np.r_[np.zeros(len(e.prompt), bool), np.ones(len(c), bool)]))
        assert kl is not None
        np.testing.assert_allclose(kl[:, 0], _base_sequence_logps(bases["f32"], seqs), rtol=1e-4, atol=1e-3)


def test_resume_refuses_a_reference_of_other_data_and_recomputes_a_missing_one(bases, tmp_path):
    cfg = cfg_for(bases, "dpo", tmp_path / "m", 4, adapter="full")
    straight, done = run_and_resume(cfg, tmp_path, 2)  # the reference: a run cut and resumed as is
    s = th.StopAt(2)
    part = train(
        dataclasses.replace(cfg, out=str(tmp_path / "x")), Hooks(progress=s.progress, should_stop=s.should_stop)
    )
    cache = part.run_dir / REFERENCE_FILE
    with np.load(cache) as z:
        arrays = {k: z[k] for k in z.files}
    np.savez(cache, **{**arrays, "data_digest": np.array("0" * 64)})
    with pytest.raises(BadInputError, match="reference log-probabilities are for another training data"):
        resume(part.run_dir)
    cache.unlink()  # a missing cache is computed again: the same values, the same run
    again = resume(part.run_dir)
    assert again.reason == "completed"
    assert step_losses(again.run_dir) == step_losses(straight.run_dir)
    notes = [e["text"] for e in events(again.run_dir) if e["kind"] == "note"]
    assert any(f"{REFERENCE_FILE} was missing" in n for n in notes)
    np.testing.assert_array_equal(np.load(cache)["ref"], arrays["ref"])


def test_qlora_on_a_quantized_base(bases, tmp_path):
    before = sha(bases["q8"])
    res = train(cfg_for(bases, "dpo", tmp_path / "q", 2, base="q8"))
    assert res.reason == "completed" and sha(bases["q8"]) == before  # the base is never written
    start = events(res.run_dir)[0]
    assert start["base"]["weight_types"] == ["Q8_0"] and start["base"]["sha256"] == before
    assert load_adapter(res.checkpoint).rank == 8


def test_a_stop_during_the_reference_pass_ends_at_step_0(bases, tmp_path):
    seen = []

    def phase(label, done, total):
        seen.append(label)

    res = train(
        cfg_for(bases, "dpo", tmp_path / "s", 3, **{"data.val_fraction": 0.5}),
        Hooks(phase=phase, should_stop=lambda: bool(seen)),  # asked for once the pass has begun
    )
    assert seen == [REFERENCE_PHASE]
    assert res.reason == "interrupted" and res.final_step == 0 and res.checkpoint is None
    assert not (res.run_dir / REFERENCE_FILE).exists()  # an incomplete pass is not cached
    assert {e["kind"] for e in events(res.run_dir)} == {"run_start", "note", "run_end"}


def test_orpo_batch_masks():
    from toy.train.prefdata import sequence_batch

    seq = [(np.array([5, 6, 7, 8, 9]), np.array([0, 0, 1, 1, 1], bool)),
           (np.array([5, 6, 4, 3]), np.array([0, 0, 1, 1], bool))]  # fmt: skip
    b = orpo_batch(sequence_batch([seq[0], seq[1]], 6))  # one pair: chosen row 0, rejected row 1
    np.testing.assert_array_equal(b.completion_mask, [[0, 1, 1, 1, 0, 0], [0, 1, 1, 0, 0, 0]])
    np.testing.assert_array_equal(b.loss_mask, [[1, 1, 1, 1, 0, 0], [0, 1, 1, 0, 0, 0]])


def test_config_errors(bases, tmp_path):
    with pytest.raises(ConfigError, match="needs a base"):
        override(defaults("dpo"), **{"data.paths": ["x"]})
    with pytest.raises(ConfigError, match="pref.loss_type"):
        cfg_for(bases, "dpo", tmp_path, 1, **{"pref.loss_type": "nope"})
    with pytest.raises(ConfigError, match="robust loss only"):
        cfg_for(bases, "dpo", tmp_path, 1, **{"pref.label_smoothing": 0.1})
    with pytest.raises(ConfigError, match="pref.beta"):
        cfg_for(bases, "kto", tmp_path, 1, **{"pref.beta": 0.0})
    with pytest.raises(ConfigError, match="adapter"):
        cfg_for(bases, "dpo", tmp_path, 1, adapter="qlora")
    with pytest.raises(ConfigError, match="adapter='full' is for the recipes"):
        th.recipe_config("lora", bases["f32"], bases["pairs"], tmp_path, 1, 32, adapter="full")
    # the defaults of each kind: TRL's full fine-tune rate, a LoRA rate (toy.train.config.RECIPE_DEFAULTS)
    assert defaults("dpo").optim.lr == 5e-5 and defaults("dpo", adapter="full").optim.lr == 1e-6
    # labelled examples given to DPO: the data error names the file and line
    with pytest.raises(DataError, match=r"unpaired\.jsonl:1"):
        train(cfg_for(bases, "dpo", tmp_path / "bad", 1, **{"data.paths": [str(bases["unpaired"])]}))
