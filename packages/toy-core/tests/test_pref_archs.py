"""The preference and RL recipes on every registered language architecture
(``toy_testsupport.tiny_archs``: llama, qwen2, qwen3, gpt2, gemma2, gemma3,
olmoe, qwen2moe, qwen3moe; seeded random weights, an ASCII vocabulary).

Each gets a LoRA DPO run and a LoRA GRPO run of two steps: the runs
complete, every step has a finite loss and a non-zero gradient (the first
step is at the reference point, where a kink would give 0), DPO's step-0
evaluation is log 2 (policy = reference: an independent fact of the
formula), and GRPO's rollouts are sampled by the inference engine over the
architecture's own graph (gemma's sliding windows and soft-caps, the MoE
routers) and written to the bundle. What the objectives compute is checked
against TRL and torch elsewhere (test_pref_trl.py, test_objectives.py);
this is about every architecture's training graph taking them.
"""

from __future__ import annotations

import json
import math

import pytest

from toy.train.config import defaults, override
from toy.train.grpo import read_rollouts
from toy.train.lmrun import train
from toy_testsupport import tiny_archs
from toy_testsupport.train_helpers import events


def _with_eos(src, dst):
    """The tiny model with its ``<|end|>`` token as end of sequence (the ASCII
    vocabulary has none, and a preference completion ends with it)."""
    from toy.gguf import GGUFFile, ValueType
    from toy.gguf.reader import TypeInfo
    from toy.gguf.writer import GGUFWriter, copy_metadata

    w = GGUFWriter(dst)
    with GGUFFile(src) as f:
        copy_metadata(f, w)
        w.add(
            "tokenizer.ggml.eos_token_id",
            f.metadata["tokenizer.ggml.tokens"].index("<|end|>"),
            TypeInfo(ValueType.UINT32),
        )
        for name in f.tensors:
            w.add_tensor(name, f.tensor_to_float(name))
        return w.write()


WORDS = ["alpha", "beta", "gamma", "delta", "omega", "sigma", "kappa", "theta"]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    d = tmp_path_factory.mktemp("pref-archs")
    pairs = [
        {"prompt": f"say {a}:", "chosen": f" {a} {a}.", "rejected": f" {b}."}
        for i, a in enumerate(WORDS)
        for b in WORDS[i + 1 : i + 3]
    ]
    prompts = [{"prompt": f"say {w}:", "answer": w} for w in WORDS]
    (d / "pairs.jsonl").write_text("".join(json.dumps(x) + "\n" for x in pairs))
    (d / "prompts.jsonl").write_text("".join(json.dumps(x) + "\n" for x in prompts))
    return d


def _cfg(recipe: str, base, data_file, out, **kw):
    values = {
        "base": str(base),
        "data.paths": [str(data_file)],
        "steps": 2,
        "batch_size": 2,
        "context": 24,
        "eval_every": 2,
        "save_every": 0,
        "sample_tokens": 0,
        "out": str(out),
        "threads": 1,
        "seed": 1,
        "optim.lr": 1e-2,
        **kw,
    }
    return override(defaults(recipe), **values)


@pytest.mark.parametrize("name", tiny_archs.NAMES)
def test_dpo_and_grpo_train_every_architecture(data, tmp_path, name):
    base = _with_eos(tiny_archs.write(tmp_path / f"{name}-src.gguf", name, seed=2), tmp_path / f"{name}.gguf")

    dpo = train(_cfg("dpo", base, data / "pairs.jsonl", tmp_path / "dpo", **{"data.val_fraction": 0.25}))
    assert dpo.reason == "completed" and dpo.final_step == 2
    ev = events(dpo.run_dir)
    steps = [e for e in ev if e["kind"] == "step"]
    assert len(steps) == 2 and all(math.isfinite(e["loss"]) and e["grad_norm"] > 0 for e in steps), steps
    evals = [e for e in ev if e["kind"] == "eval"]
    assert evals[0]["step"] == 0 and evals[0]["loss"] == pytest.approx(math.log(2), abs=1e-6)

    grpo_kw = {
        "batch_size": 4,
        "grpo.group": 4,
        "grpo.max_new_tokens": 4,
        "grpo.rewards": ["regex=(alpha|beta)"],
        "grpo.beta": 0.04,
        "data.val_fraction": 0.25,
    }
    grpo = train(_cfg("grpo", base, data / "prompts.jsonl", tmp_path / "grpo", **grpo_kw))
    assert grpo.reason == "completed" and grpo.final_step == 2
    steps = [e for e in events(grpo.run_dir) if e["kind"] == "step"]
    assert len(steps) == 2 and all(math.isfinite(e["loss"]) for e in steps), steps
    recs = read_rollouts(grpo.run_dir)
    assert len(recs) == 2 * 4 and all(1 <= r["tokens"] <= 4 and r["finish"] in ("stop", "length") for r in recs)
    assert all(r["rewards"]["regex"] in (0.0, 1.0) for r in recs)
