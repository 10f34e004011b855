"""GRPO (``toy.train.grpo``): advantages against a NumPy computation of
TRL's formula, rollouts reproducible from the seed and independent of how
the sequences are batched, the rollout engine sampling from the values
being trained (its logits equal the training engine's), and a tiny run
that writes ``rollouts.jsonl`` and resumes exactly (in the middle of a
rollout batch's iterations too)."""

from __future__ import annotations

import dataclasses
import json
import warnings
from pathlib import Path

import numpy as np
import pytest

from toy import models
from toy.engine.sampling import SamplingParams
from toy.errors import BadInputError
from toy.gguf import GGUFFile, bind_tensors, quantize_model
from toy.tokenizer import Tokenizer
from toy.train.config import defaults, override
from toy.train.grpo import ROLLOUTS, RolloutEngine, read_rollouts, rollout_seed
from toy.train.lmrun import Hooks, resume, train
from toy.train.lora import LoraSettings, LoraTrain, init_lora
from toy.train.model import ArchTrain
from toy.train.optim import OptimConfig
from toy.train.rewards import advantages
from toy.train.stepgraph import TrainEngine
from toy_testsupport.train_helpers import RECIPE_WORDS as WORDS
from toy_testsupport.train_helpers import StopAt, assert_same_state, events, packed_batch, step_losses

# -- advantages -------------------------------------------------------------------


def trl_advantages(r: np.ndarray, G: int, scale: str) -> np.ndarray:
    """TRL 1.16 GRPOTrainer (sum_then_normalize): nanmean per group, nanstd
    with Bessel's correction (per group, or over the batch), 1e-4 added to
    the std, NaN advantages set to 0 — written with NumPy's nan* functions."""
    g = r.reshape(-1, G)
    with warnings.catch_warnings():  # an all-NaN group: NumPy warns, the result is NaN (then 0)
        warnings.simplefilter("ignore", RuntimeWarning)
        mean = np.repeat(np.nanmean(g, axis=1), G)
        std = np.repeat(np.nanstd(g, axis=1, ddof=1), G) if scale == "group" else np.nanstd(r, ddof=1)
    adv = r - mean
    if scale != "none":
        adv = adv / (std + 1e-4)
    return np.nan_to_num(adv, nan=0.0)


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_advantages_match_trls_formula(scale):
    rng = np.random.default_rng(0)
    G = 4
    r = rng.standard_normal(6 * G)
    r[5] = np.nan  # a completion no reward applied to: out of its group's mean and std
    r[8:12] = 1.5  # a group whose rewards are all equal: std 0, advantages 0
    got = advantages(r, G, scale)
    assert got.dtype == np.float32
    np.testing.assert_allclose(got, trl_advantages(r, G, scale), rtol=1e-6, atol=1e-6)
    assert got[5] == 0.0
    if scale != "none":
        np.testing.assert_array_equal(got[8:12], 0.0)


def test_advantages_of_an_unscorable_group_are_zero():
    r = np.array([np.nan, np.nan, 1.0, 0.0])
    np.testing.assert_array_equal(advantages(r, 2, "group"), trl_advantages(r, 2, "group").astype(np.float32))
    np.testing.assert_array_equal(advantages(r, 2, "group")[:2], [0.0, 0.0])
    with pytest.raises(ValueError, match="groups of 3"):
        advantages(r, 3)


# -- a tiny base with a tokenizer ----------------------------------------------------


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """A tiny from-scratch checkpoint with its BPE tokenizer, and prompts JSONL."""
    d = tmp_path_factory.mktemp("grpo")
    rng = np.random.default_rng(0)
    (d / "corpus.txt").write_text("\n".join(" ".join(rng.choice(WORDS, size=12)) + "." for _ in range(300)))
    cfg = override(
        defaults(),
        **{"data.paths": [str(d / "corpus.txt")], "tokenizer.vocab_size": 300, "steps": 3, "batch_size": 2,
           "context": 32, "eval_every": 0, "save_every": 0, "sample_tokens": 0, "out": str(d / "runs"), "threads": 1},
    )  # fmt: skip
    f32 = train(cfg).checkpoint
    q8 = d / "base-q8_0.gguf"
    quantize_model(f32, q8, "q8_0")
    prompts = d / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"say {w}:", "answer": w}) + "\n" for w in WORDS * 2))
    return {"f32": f32, "q8": q8, "prompts": prompts}


class Opened:
    def __init__(self, path, rt):
        self.gf = GGUFFile(path)
        self.cfg = models.config_from_gguf(self.gf)
        self.tok = Tokenizer.from_gguf(self.gf.metadata)
        self.bound = bind_tensors(self.gf, rt)

    def close(self):
        self.bound.close()
        self.gf.close()


@pytest.fixture
def opened(base, rt):
    o = Opened(base["f32"], rt)
    yield o
    o.close()


@pytest.fixture
def opened_q8(base, rt):
    o = Opened(base["q8"], rt)
    yield o
    o.close()


def lora_policy(o: Opened, rt, start: str = "random") -> tuple[TrainEngine, LoraTrain]:
    """A training engine of a LoRA model (rank 4) starting from random values
    (B non-zero: the adapter changes the model) or its initial ones ("init": B = 0)."""
    model = LoraTrain(o.cfg, o.bound.tensors, LoraSettings(rank=4, alpha=8.0))
    rng = np.random.default_rng(5)
    values = (
        init_lora(model.shapes, 1)
        if start == "init"
        else {n: (rng.standard_normal(s) * 0.3).astype(np.float32) for n, s in model.shapes.items()}
    )
    return TrainEngine(model, values, rt, OptimConfig(lr=0.05), batch=2, context=16), model


def lora_sampler(o: Opened, rt, policy: TrainEngine, model: LoraTrain, n_slot: int) -> RolloutEngine:
    """The rollout engine over the policy engine's own parameter tensors (as ``GRPORun`` builds it)."""
    names = policy.params
    pairs = {
        n.removesuffix(".lora_a"): (n, n.removesuffix(".lora_a") + ".lora_b") for n in names if n.endswith(".lora_a")
    }
    return RolloutEngine(
        o.cfg,
        o.bound.tensors,
        rt,
        o.tok,
        policy.params,
        n_ctx=48,
        n_slot=n_slot,
        lora=pairs,
        scale=model.settings.scale,
    )


def requests(o: Opened, which: list[tuple[int, int]], seed: int = 11):
    out = []
    for p, j in which:
        ids = np.asarray(o.tok.encode(f"say {WORDS[p]}:", add_special=True), np.int32)
        params = SamplingParams(
            temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, max_tokens=12, seed=rollout_seed(seed, 0, p, j)
        )
        out.append((p, j, ids, params))
    return out


def test_rollouts_are_reproducible_and_independent_of_batching(opened, rt):
    pairs = [(p, j) for p in range(3) for j in range(3)]
    policy, model = lora_policy(opened, rt)
    one = lora_sampler(opened, rt, policy, model, n_slot=1)
    many = lora_sampler(opened, rt, policy, model, n_slot=4)
    try:
        alone = {(r.prompt, r.sample): r.tokens for r in one.generate(requests(opened, pairs))}
        # other slots, another order, other sequences beside them
        mixed = list(reversed(pairs)) + [(5, 0), (6, 1), (7, 2)]
        batched = {(r.prompt, r.sample): r.tokens for r in many.generate(requests(opened, mixed))}
        again = {(r.prompt, r.sample): r.tokens for r in many.generate(requests(opened, pairs))}
        other = {(r.prompt, r.sample): r.tokens for r in many.generate(requests(opened, pairs, seed=12))}
    finally:
        one.close()
        many.close()
        policy.close()
    assert all(alone[k] == batched[k] == again[k] for k in pairs)
    assert len({tuple(v) for v in alone.values()}) > 3  # the samples differ from one another
    assert sum(alone[k] != other[k] for k in pairs) >= 6  # and another seed gives others
    ends = {opened.tok.vocab.special.get("eos"), *opened.tok.eog_ids}
    for toks in alone.values():  # a completion ends at its first end token, or at max_tokens
        assert len(toks) <= 12 and not any(t in ends for t in toks[:-1])


@pytest.mark.parametrize("which", ["f32", "q8"])
def test_rollout_engine_samples_the_trained_lora_values(which, request, rt):
    """After an optimizer step the rollout engine (over the training
    engine's parameter tensors) gives the training engine's logits, and
    they moved (QLoRA too: both read the same Q8_0 base tensors)."""
    opened = request.getfixturevalue("opened" if which == "f32" else "opened_q8")
    policy, model = lora_policy(opened, rt, "init")  # B = 0: the base model until the step
    roll = lora_sampler(opened, rt, policy, model, n_slot=2)
    try:
        ids = [int(x) for x in opened.tok.encode("say river: green stone", add_special=True)]
        before = roll.logits(ids)[-1]
        policy.train_step([packed_batch(np.random.default_rng(3), opened.cfg.n_vocab, 2, 16)], 0.05)
        assert any(np.abs(v).max() > 0 for n, v in policy.param_values().items() if n.endswith("lora_b"))
        got = roll.logits(ids)[-1]
        want = policy.next_token_logits(ids)
        # float32 rounding of other kernels (measured 4e-7 of a 0.8 logit; an F16 K/V cache gave 1e-4)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
        assert np.abs(before - want).max() > 1e-3  # the step changed the model the rollouts sample
    finally:
        roll.close()
        policy.close()


def test_rollout_engine_samples_the_trained_full_weights(opened, rt):
    arch = models.language_model_of(opened.cfg)
    start = {n: np.array(opened.gf.tensor_to_float(n), np.float32) for n in arch.params(opened.cfg)}
    policy = TrainEngine(ArchTrain(opened.cfg), start, rt, OptimConfig(lr=0.01), batch=2, context=16)
    roll = RolloutEngine(opened.cfg, opened.bound.tensors, rt, opened.tok, policy.params, n_ctx=48, n_slot=2)
    try:
        ids = [int(x) for x in opened.tok.encode("say cloud: alpha", add_special=True)]
        before = roll.logits(ids)[-1]
        policy.train_step([packed_batch(np.random.default_rng(4), opened.cfg.n_vocab, 2, 16)], 0.01)
        want = policy.next_token_logits(ids)
        np.testing.assert_allclose(roll.logits(ids)[-1], want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
        assert np.abs(before - want).max() > 1e-3
    finally:
        roll.close()
        policy.close()


# -- runs -------------------------------------------------------------------------


def grpo_cfg(files, out: Path, **kw):
    values = {
        "base": str(files["f32"]),
        "data.paths": [str(files["prompts"])],
        "steps": 4,
        "batch_size": 4,
        "grad_accum": 2,
        "context": 32,
        "eval_every": 2,
        "save_every": 1,
        "keep_checkpoints": 0,
        "out": str(out),
        "threads": 1,
        "seed": 3,
        "optim.lr": 0.02,
        "grpo.group": 4,
        "grpo.max_new_tokens": 8,
        "grpo.iterations": 2,
        "grpo.beta": 0.05,
        "grpo.rewards": ["regex=(alpha|beta)", "length=12"],
    }
    values.update(kw)
    return override(defaults("grpo"), **values)


def test_grpo_run_writes_rollouts_and_resumes_exactly(base, tmp_path):
    cfg = grpo_cfg(base, tmp_path / "a")
    straight = train(cfg)
    assert straight.reason == "completed" and straight.final_step == 4
    s = StopAt(1)  # mid-way through the first rollout batch's two iterations
    part = train(
        dataclasses.replace(cfg, out=str(tmp_path / "b")), Hooks(progress=s.progress, should_stop=s.should_stop)
    )
    assert part.reason == "interrupted" and part.final_step == 1
    done = resume(part.run_dir)
    assert done.reason == "completed" and done.final_step == 4

    losses = step_losses(straight.run_dir)
    assert sorted(losses) == [1, 2, 3, 4] and losses == step_losses(done.run_dir)
    assert_same_state(straight.checkpoint, done.checkpoint)

    ev = events(straight.run_dir)
    steps = [e for e in ev if e["kind"] == "step"]
    for e in steps:
        assert {
            "reward_mean",
            "reward/regex/mean",
            "reward/length/mean",
            "completion_len_mean",
            "clip_ratio",
            "kl",
        } <= set(e)
    assert steps[0]["clip_ratio"] == 0.0  # first iteration: the ratio is 1
    evals = [e for e in ev if e["kind"] == "eval"]
    assert [e["step"] for e in evals] == [0, 2, 4] and all(e["name"] == "val_reward" for e in evals)

    recs = read_rollouts(straight.run_dir)
    assert len(recs) == 2 * 8  # two rollout batches of 8 completions
    assert sorted({r["step"] for r in recs}) == [1, 3]
    r0 = recs[0]
    assert set(r0["rewards"]) == {"regex", "length"} and r0["finish"] in ("stop", "length")
    assert r0["source"].endswith("prompts.jsonl") and r0["prompt"].startswith("say")
    for g in range(4):  # advantages are group-normalized: each group's sum is ~0
        assert abs(sum(r["advantage"] for r in recs[g * 4 : g * 4 + 4])) < 1e-3
    # the resumed run made the same rollouts (its first batch from the checkpoint, not again)
    key = lambda r: (r["rollout"], r["row"])  # noqa: E731
    assert sorted(map(json.dumps, sorted(recs, key=key))) == sorted(
        map(json.dumps, sorted(read_rollouts(done.run_dir), key=key))
    )
    assert len((done.run_dir / ROLLOUTS).read_text().splitlines()) == 16


def test_grpo_config_errors(base, tmp_path):
    with pytest.raises(BadInputError, match="not whole groups of 3"):
        train(grpo_cfg(base, tmp_path, **{"grpo.group": 3}))
    with pytest.raises(BadInputError, match="not a built-in reward"):
        train(grpo_cfg(base, tmp_path, **{"grpo.rewards": ["nope"]}))


def test_a_reward_error_is_recorded_not_raised(base, tmp_path, monkeypatch):
    (tmp_path / "grpo_flaky_reward.py").write_text(
        "def flaky(completion, example, *, prompt):\n"
        "    if len(completion) % 2:\n"
        "        raise RuntimeError('odd length: ' + example['answer'])\n"
        "    return 1.0\n"
    )
    monkeypatch.chdir(tmp_path)
    cfg = grpo_cfg(
        base, tmp_path / "runs", steps=1, **{"grpo.iterations": 1, "grpo.rewards": ["grpo_flaky_reward:flaky"]}
    )
    res = train(cfg)
    assert res.reason == "completed"
    recs = read_rollouts(res.run_dir)
    bad = [r for r in recs if r["errors"]]
    assert bad and len(bad) < len(recs)  # some completions of each kind (a seeded run: fixed)
    for r in recs:
        if r["errors"]:
            assert r["rewards"] == {"grpo_flaky_reward:flaky": 0.0} and r["reward"] == 0.0
            assert r["errors"][0]["error"].startswith("RuntimeError: odd length: ")
        else:
            assert r["reward"] == 1.0
    ev = [e for e in events(res.run_dir) if e["kind"] == "reward_error"]
    assert len(ev) == len(bad)
    assert ev[0]["source"].endswith("prompts.jsonl") and isinstance(ev[0]["line"], int) and ev[0]["step"] == 1


def test_full_fine_tune_and_qlora_runs(base, tmp_path):
    """The rollouts of a full fine-tune sample its trained weights; a QLoRA
    run samples over the quantized base: both train (two rollout batches)."""
    for name, kw in (("full", {"adapter": "full", "optim.lr": 1e-3}), ("qlora", {"base": str(base["q8"])})):
        cfg = grpo_cfg(base, tmp_path / name, steps=2, eval_every=0, **{"grpo.iterations": 1, **kw})
        res = train(cfg)
        assert res.reason == "completed", name
        losses = step_losses(res.run_dir)
        assert sorted(losses) == [1, 2] and all(np.isfinite(v) for v in losses.values())
        assert sorted({r["step"] for r in read_rollouts(res.run_dir)}) == [1, 2]
    with GGUFFile(res.checkpoint) as gf:  # the QLoRA checkpoint is an adapter
        assert gf.metadata["general.type"] == "adapter"


def test_a_grpo_step_moves_the_policy_towards_positive_advantages(base, tmp_path):
    """One optimizer step on a rollout batch raises the sequence log-prob of
    the completions that scored above their group's mean and lowers the
    others' (the policy gradient's direction, on the run's own rows)."""
    from toy.train.config import validate
    from toy.train.grpo import GRPORun

    cfg = grpo_cfg(base, tmp_path, batch_size=8, grad_accum=1, eval_every=0, save_every=0, **{"grpo.group": 8})
    grpo = dataclasses.replace(cfg.grpo, rewards=["regex=a"], beta=0.0, iterations=1)
    cfg = validate(dataclasses.replace(cfg, grpo=grpo))
    run = GRPORun(cfg, Hooks())
    try:
        agree = 0
        for _ in range(3):
            b = run.stream.next()
            before = run.engine.sequence_logps(b)
            run.engine.train_step([b], 1e-3)  # small: the first-order (policy-gradient) regime
            moved = run.engine.sequence_logps(b) - before
            a = b.advantages.astype(np.float64)
            assert np.any(a != 0) and float(np.sum(a * moved)) > 0
            agree += int(np.sum(np.sign(moved[a != 0]) == np.sign(a[a != 0])))
        assert agree >= 0.75 * 3 * 8
    finally:
        run.close()
        if run.lock is not None:
            run.lock.release()
