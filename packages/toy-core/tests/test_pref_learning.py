"""Preference tuning and GRPO learn on the real model, and their adapters
run in llama.cpp.

Two pinned LoRA runs on SmolLM2-135M-Instruct (QLoRA: the base is the Q4_1
file), rank 8 on q, k, v, o, 2 threads, seed 3, each checked on prompts it
never trained on:

- DPO (``dpo_config``): ``toy_testsupport.pref_tasks.punctuation_pairs``:
  each prompt asks for an answer that ends with an exclamation mark; the
  chosen answer does, the rejected one is the same words ending with a full
  stop. 16 training pairs, 2 a step, 8 steps, lr 1e-3, beta 0.1, sigmoid
  loss; 32 held-out pairs whose items the training pairs never show.
  ``test_dpo_raises_held_out_preference_accuracy``: preference accuracy =
  the share of held-out pairs whose chosen completion has the higher
  sequence log-probability, computed by the inference engine (``toy.load``
  with and without the run's adapter file, float64 log-softmax in NumPy),
  not the engine that trained; also TRL's reward accuracy
  (``rewards/accuracies``: the implicit reward margin, the chosen minus the
  rejected log-ratio to the base, is positive). Measured (AVX2 and AVX-512
  CPU variants alike): base 1/32 = 0.031, trained 32/32 = 1.0 (smallest
  chosen-minus-rejected log-prob 8.8 nats; the base's largest 2.2), reward
  accuracy 1.0. Required: base <= 0.25, trained >= 0.9, trained - base >=
  0.6, reward accuracy >= 0.9.
- GRPO (``grpo_config``): ``sum_split``: "What is a + b?" (one-digit a, b;
  no instruction on the answer's form), the exact-answer reward (the last
  number of the completion equals the sum), at most 8 new tokens, a group
  of 4 at temperature 0.7, 2 prompts a step, 8 steps, lr 1e-3; 32 held-out
  questions none of the 32 training ones repeats. The base often starts a
  long answer ("To add 7 and 9, ...") that 8 tokens cut before the sum; the
  run learns to answer "7 + 9 = 16". ``test_grpo_raises_held_out_accuracy``:
  held-out accuracy of greedy answers, from the run's own evaluation (its
  rollout engine, step 0 and the end) and from ``toy.load`` with the
  adapter file (F16 K/V: near-tied tokens may differ). Measured on the AVX2
  variant: run 0.28 -> 0.81, ``toy.load`` 0.34 -> 0.81; on the AVX-512
  variant with seeds 3, 5, 7: 0.25 -> 0.91, 0.69, 0.75 (at temperature 1.0
  one seed of two did not learn in 8 steps: hence 0.7). Required, of both:
  base <= 0.5, trained >= 0.6, trained - base >= 0.25.
- ``test_adapter_greedy_equals_llama_cpp``: llama.cpp (llama-cpp-python
  0.3.36, ``tools/fixtures/record_pref_llamacpp.py``) loaded the base with
  each adapter these runs wrote on the AVX2 variant and recorded 16 greedy
  tokens for three held-out prompts and one off the task, with and without
  the adapter (``fixtures/pref_llamacpp.json``; every prompt's tokens
  changed). When a run's adapter has the recorded weights (their sha256,
  required on the recorded kind of CPU), toy's greedy tokens with the
  adapter must equal llama.cpp's.

Times (this 2-core machine, other work running): DPO ~35 s, GRPO ~60 s.
The module is ``avx2_reference`` (conftest.py: it runs under the AVX2 CPU
variant, in `just test`'s second pass on AVX-512 machines), so each run is
trained once, on the kernels the fixture was recorded with.
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

import numpy as np
import pytest

import toy_ggml
from toy_testsupport import train_helpers as th
from toy_testsupport.llamacpp_parity import weights_sha256
from toy_testsupport.pref_tasks import punctuation_pairs, sum_split, write_jsonl

FIXTURE = Path(__file__).parent / "fixtures" / "pref_llamacpp.json"
# DPO: pairs; 2 pairs a step
N_TRAIN, N_VAL = 16, 32
STEPS, PAIRS, LR, CONTEXT = 8, 2, 1e-3, 56
# GRPO: prompts; 8 completions a step = 2 prompts x a group of 4
G_TRAIN, G_VAL = 32, 32
G_STEPS, G_ROWS, G_GROUP, G_LR, G_NEW, G_TEMP = 8, 8, 4, 1e-3, 8, 0.7
N_GEN = 16  # greedy tokens of the llama.cpp comparison

pytestmark = [pytest.mark.model, pytest.mark.avx2_reference]


def dpo_config(base, data, out):
    """The pinned DPO run's config (the recorder runs the same)."""
    values = {
        "data.val_fraction": 0.0,  # every pair of the file trains; the held-out pairs are scored here
        "optim.lr": LR,
        "batch_size": PAIRS,
        "eval_every": 0,
        "save_every": 0,
        "sample_tokens": 0,
        "threads": 2,
    }
    return th.recipe_config("dpo", base, data, out, STEPS, CONTEXT, **values)


def grpo_config(base, data, out):
    """The pinned GRPO run's config: the exact-answer reward, the last G_VAL
    prompts of the file are the validation split, evaluated at step 0 and
    at the end."""
    values = {
        "data.val_fraction": G_VAL / (G_TRAIN + G_VAL),
        "optim.lr": G_LR,
        "batch_size": G_ROWS,
        "eval_every": G_STEPS,
        "eval_batches": 0,
        "save_every": 0,
        "sample_tokens": 0,
        "threads": 2,
        "grpo.group": G_GROUP,
        "grpo.max_new_tokens": G_NEW,
        "grpo.temperature": G_TEMP,
        "grpo.rewards": ["exact_answer"],
    }
    return th.recipe_config("grpo", base, data, out, G_STEPS, CONTEXT, **values)


def sums():
    """(training, held-out) GRPO prompts: "What is a + b?" (no instruction on the form of the answer)."""
    return sum_split(G_TRAIN, G_VAL, seed=0, instruction="")


def dpo_run(base, workdir):
    """Train the pinned DPO run in ``workdir``: its ``RunResult``."""
    from toy.train.lmrun import train

    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    data = write_jsonl(workdir / "pairs.jsonl", punctuation_pairs(N_TRAIN, N_VAL, seed=0)[0])
    return train(dpo_config(base, data, workdir / "runs"))


def grpo_run(base, workdir):
    """Train the pinned GRPO run in ``workdir``: its ``RunResult``."""
    from toy.train.lmrun import train

    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    train_prompts, held_out = sums()
    data = write_jsonl(workdir / "prompts.jsonl", train_prompts + held_out)
    return train(grpo_config(base, data, workdir / "runs"))


def _chat(base, users: list[str]) -> list[str]:
    from toy.gguf import GGUFFile
    from toy.tokenizer import ChatTemplate

    with GGUFFile(base) as gf:
        tmpl = ChatTemplate.from_gguf(gf.metadata)
    return [tmpl.render([{"role": "user", "content": u}], add_generation_prompt=True) for u in users]


def greedy_prompts(base, recipe: str) -> list[str]:
    """The llama.cpp comparison's prompts of a run: three held-out prompts
    and one off the task, rendered with the model's chat template (an
    assistant turn opened)."""
    held_out = punctuation_pairs(N_TRAIN, N_VAL, seed=0)[1] if recipe == "dpo" else sums()[1]
    seen: list[str] = []
    for p in held_out:
        text = p["prompt"][0]["content"]
        if text not in seen:
            seen.append(text)
    return _chat(base, [*seen[:3], "What is the capital of France?"])


def toy_greedy(base, adapter, prompts: list[str], n_ctx: int = 128, n_gen: int = N_GEN, ignore_eos: bool = True):
    """(prompt ids, greedy tokens) from ``toy.load(base, lora=[(adapter, 1.0)])`` (None: the base)."""
    import toy

    kw = {"lora": [(adapter, 1.0)]} if adapter is not None else {}
    with toy.load(base, n_ctx=n_ctx, threads=2, **kw) as m:
        ids = [m.tokenize(p) for p in prompts]
        out = [m.generate(i, temperature=0, max_tokens=n_gen, ignore_eos=ignore_eos).tokens for i in ids]
    return ids, out


def _sequence_logps(base, adapter, examples) -> np.ndarray:
    """(n, 2): log p(chosen), log p(rejected) summed over each completion's
    tokens, from the inference engine's logits (float64 log-softmax); the
    base model when ``adapter`` is None."""
    import toy

    out = np.zeros((len(examples), 2))
    kw = {"lora": [(adapter, 1.0)]} if adapter is not None else {}
    with toy.load(base, threads=2, **kw) as m:
        for i, ex in enumerate(examples):
            for side in (0, 1):
                tokens, loss = ex.sequence(side)
                logits = np.asarray(m.logits([int(t) for t in tokens[:-1]]), np.float64)
                logp = logits - logits.max(axis=1, keepdims=True)
                logp -= np.log(np.exp(logp).sum(axis=1, keepdims=True))
                picked = logp[np.arange(len(tokens) - 1), tokens[1:]]
                out[i, side] = picked[loss[1:]].sum()
    return out


@pytest.fixture(scope="module")
def dpo(smollm2_path, tmp_path_factory):
    """The pinned DPO run: (RunResult, its events)."""
    res = dpo_run(smollm2_path, tmp_path_factory.mktemp("dpo-learn"))
    return res, th.events(res.run_dir)


@pytest.fixture(scope="module")
def grpo(smollm2_path, tmp_path_factory):
    """The pinned GRPO run: (RunResult, its events)."""
    res = grpo_run(smollm2_path, tmp_path_factory.mktemp("grpo-learn"))
    return res, th.events(res.run_dir)


@pytest.fixture(scope="module")
def held_out(smollm2_path, tmp_path_factory):
    """The held-out pairs, tokenized as a run reads them (``prefdata.load_pref``)."""
    from toy.gguf import GGUFFile
    from toy.tokenizer import ChatTemplate, Tokenizer
    from toy.train import prefdata

    path = write_jsonl(tmp_path_factory.mktemp("held-out") / "pairs.jsonl", punctuation_pairs(N_TRAIN, N_VAL)[1])
    with GGUFFile(smollm2_path) as gf:
        tok, tmpl = Tokenizer.from_gguf(gf.metadata), ChatTemplate.from_gguf(gf.metadata)
    exs, _ = prefdata.load_pref([str(path)], tok, tmpl, format="pairs", max_length=CONTEXT + 1)
    assert len(exs) == N_VAL
    return exs


def test_dpo_raises_held_out_preference_accuracy(dpo, held_out, smollm2_path):
    res, ev = dpo
    assert res.final_step == STEPS and res.checkpoint is not None
    assert ev[0]["data"]["train_examples"] == N_TRAIN
    steps = [e for e in ev if e["kind"] == "step"]
    assert len(steps) == STEPS and all(e["grad_norm"] > 0 for e in steps)
    base = _sequence_logps(smollm2_path, None, held_out)
    pol = _sequence_logps(smollm2_path, res.checkpoint, held_out)
    base_acc = float(np.mean(base[:, 0] > base[:, 1]))
    trained_acc = float(np.mean(pol[:, 0] > pol[:, 1]))
    # TRL's rewards/accuracies: the implicit reward margin beta * (chosen's - rejected's log-ratio to the reference)
    reward_acc = float(np.mean((pol[:, 0] - base[:, 0]) - (pol[:, 1] - base[:, 1]) > 0))
    summary = {"base": base_acc, "trained": trained_acc, "reward": reward_acc, "margins": pol[:, 0] - pol[:, 1]}
    assert base_acc <= 0.25, summary
    assert trained_acc >= 0.9, summary
    assert trained_acc - base_acc >= 0.6, summary
    assert reward_acc >= 0.9, summary


def _last_number(text: str) -> str | None:
    found = re.findall(r"-?\d+", text)
    return found[-1] if found else None


def test_grpo_raises_held_out_accuracy(grpo, smollm2_path):
    res, ev = grpo
    assert res.final_step == G_STEPS and res.checkpoint is not None
    evals = {e["step"]: e for e in ev if e["kind"] == "eval"}
    assert set(evals) == {0, G_STEPS} and all(e["prompts"] == G_VAL for e in evals.values())
    # the run's own evaluation: greedy completions of the held-out prompts by its rollout engine
    run_base, run_trained = evals[0]["accuracy"], evals[G_STEPS]["accuracy"]
    # and the inference engine's, with the adapter file: the last number of the greedy answer is the sum
    import toy

    _, held_out = sums()
    prompts = _chat(smollm2_path, [p["prompt"][0]["content"] for p in held_out])
    acc = {}
    for name, adapter in (("base", None), ("trained", res.checkpoint)):
        _, out = toy_greedy(smollm2_path, adapter, prompts, n_gen=G_NEW, ignore_eos=False)
        with toy.load(smollm2_path, threads=1) as m:
            texts = [m.detokenize(o) for o in out]
        acc[name] = float(np.mean([_last_number(t) == p["answer"] for t, p in zip(texts, held_out)]))
    summary = {"run": (run_base, run_trained), "toy.load": acc}
    for base_acc, trained_acc in ((run_base, run_trained), (acc["base"], acc["trained"])):
        assert base_acc <= 0.5, summary
        assert trained_acc >= 0.6, summary
        assert trained_acc - base_acc >= 0.25, summary


def _file_sha256(path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


@pytest.mark.parametrize("recipe", ["dpo", "grpo"])
def test_adapter_greedy_equals_llama_cpp(recipe, request, smollm2_path):
    rec = json.loads(FIXTURE.read_text())
    assert rec["model"]["sha256"] == _file_sha256(smollm2_path)
    res, _ = request.getfixturevalue(recipe)
    want = rec["runs"][recipe]
    sha = weights_sha256(res.checkpoint)
    # recorded on the AVX2 CPU variant, whose features this compares (the pinned run must give the same bytes)
    if sorted(k for k, v in toy_ggml.cpu_features().items() if v) == rec["cpu_features"]:
        assert sha == want["adapter"]["weights_sha256"]
    prompts = [p["prompt"] for p in want["prompts"]]
    ids, got = toy_greedy(smollm2_path, res.checkpoint, prompts, rec["context"]["n_ctx"])
    assert ids == [p["prompt_ids"] for p in want["prompts"]]  # toy tokenizes as llama.cpp did
    assert any(p["lora_greedy"] != p["base_greedy"] for p in want["prompts"])  # the adapter changes llama.cpp's text
    if sha == want["adapter"]["weights_sha256"]:  # the weights llama.cpp ran
        assert got == [p["lora_greedy"] for p in want["prompts"]]
