"""Shared helpers of the training tests
(``from toy_testsupport.train_helpers import ...``): hand-made packed batches and the gradient comparison of the training-engine
tests, seeded LoRA adapters, an instruct example's loss spans, and what the
fine-tuning recipe tests (llama, Gemma, MoE) share: a run's config, its
events, a run stopped and resumed, the saved optimizer state, the run
bundle's checks; ``TINY_SCRATCH``, the hardening tests' from-scratch config."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

#: a from-scratch config small enough for hardening tests (``toy.train.config.override`` keys): 2 layers of
#: width 32, a 300-token BPE, one thread, no eval or samples
TINY_SCRATCH = {
    "model.preset": None,
    "model.d_model": 32,
    "model.n_layer": 2,
    "model.n_head": 4,
    "model.n_head_kv": 2,
    "model.d_ff": 64,
    "tokenizer.vocab_size": 300,
    "batch_size": 2,
    "context": 32,
    "threads": 1,
    "eval_every": 0,
    "sample_tokens": 0,
}


@dataclass
class Batch:
    tokens: np.ndarray
    targets: np.ndarray
    loss_mask: np.ndarray
    pos: np.ndarray
    doc: np.ndarray


def lora_reference(model, lora, weights, dense):
    """The reference gradients of a LoRA model (``LoraTrain``) by the chain
    rule: ``dense(eff)`` gives (loss, {weight: dW}) on the effective weights
    W + s·B·A (float64) of ``weights``; then dA = s·Bᵀ·dW and
    dB = s·dW·Aᵀ. Returns (loss, {"W.lora_a": dA, "W.lora_b": dB})."""
    s = model.settings.scale
    pairs = model.adapter_pairs(lora)
    eff = dict(weights)
    for w, (a, b) in pairs.items():
        eff[w] = weights[w].astype(np.float64) + s * b.astype(np.float64) @ a.astype(np.float64)
    loss, g = dense(eff)
    out = {}
    for w, (a, b) in pairs.items():
        out[f"{w}.lora_a"] = s * b.astype(np.float64).T @ g[w]
        out[f"{w}.lora_b"] = s * g[w] @ a.astype(np.float64).T
    return loss, out


def packed_batch(rng, vocab: int, B: int, T: int, *, mask_some: bool = True) -> Batch:
    """Rows of documents separated by random boundaries: doc ids increment
    at a boundary, positions restart, the target crossing a boundary is
    masked, plus a few random masked targets."""
    tokens = rng.integers(0, vocab, (B, T)).astype(np.int32)
    targets = rng.integers(0, vocab, (B, T)).astype(np.int32)
    doc = np.zeros((B, T), np.int32)
    pos = np.zeros((B, T), np.int32)
    mask = np.ones((B, T), np.float32)
    for b in range(B):
        cuts = sorted(rng.choice(np.arange(2, T - 1), size=2, replace=False)) if T > 5 else []
        d, p = 0, 0
        for t in range(T):
            if t in cuts:
                d, p = d + 1, 0
                mask[b, t - 1] = 0.0  # the last token of a document predicts nothing
            doc[b, t], pos[b, t] = d, p
            p += 1
    if mask_some:
        mask[rng.random((B, T)) < 0.15] = 0.0
    return Batch(tokens, targets, mask, pos, doc)


def assert_grads_close(got, want):
    assert set(got) == set(want)
    for name in want:
        ref = np.asarray(want[name], np.float64)
        tol = 2e-4 * float(np.abs(ref).max()) + 1e-6
        err = float(np.abs(np.asarray(got[name]) - ref).max())
        assert err <= tol, f"{name}: max error {err:.3g} > {tol:.3g}"


def seeded_adapter(base_path, out_path, *, seed: int, rank: int, alpha: float, targets, std: float, base_name: str):
    """A LoRA adapter for the GGUF model ``base_path`` (any architecture):
    ``toy.adapters.demo.random_adapter`` (what ``toy train demo-adapter``
    writes) with every parameter given: for every layer in order and every
    target in ``targets``' order, A (rank, in) then B (out, rank), entries
    ``std · N(0, 1)`` from one ``np.random.default_rng(seed)`` stream,
    float32; ``toy.lora.base`` = ``base_name``. The llama.cpp adapter
    fixtures are recorded on such files."""
    from toy.adapters.demo import random_adapter

    return random_adapter(
        base_path, out_path, seed=seed, rank=rank, alpha=alpha, targets=targets, std=std, base_name=base_name
    )


class BoundModel:
    """A GGUF model for the training tests: the open file, its config
    (``config(gf)``), its tensors bound to the runtime ``rt`` and every
    tensor as a float32 array (``w``)."""

    def __init__(self, path, rt, config):
        from toy.gguf import GGUFFile, bind_tensors

        self.path = path
        self.gf = GGUFFile(path)
        self.cfg = config(self.gf)
        self.bound = bind_tensors(self.gf, rt)
        self.w = {n: np.array(self.gf.tensor_to_float(n), np.float32) for n in self.gf.tensors}

    def close(self):
        self.bound.close()
        self.gf.close()


def python_docs_corpus(root, n_small: int) -> dict:
    """The bundled Python-docs corpus written under ``root`` (``all``), its first ``n_small`` files copied to
    ``small``, and a token cache folder: ``{"all", "small", "cache"}`` paths (for the recipe tests)."""
    from toy.train.demodata import write_python_docs

    paths = write_python_docs(root / "all")
    small = root / "small"
    small.mkdir()
    for p in paths[:n_small]:
        (small / p.name).write_text(p.read_text())
    return {"all": root / "all", "small": small, "cache": root / "cache"}


def loss_spans(tok, ex) -> list[str]:
    """The decoded runs of consecutive loss tokens of an instruct example."""
    out, run = [], []
    for t, flag in zip(ex.tokens.tolist(), ex.loss.tolist()):
        if flag:
            run.append(t)
        elif run:
            out.append(tok.decode(run))
            run = []
    return out + ([tok.decode(run)] if run else [])


# -- the fine-tuning recipe tests (test_train_recipes, test_gemma_recipes, test_moe_recipes)


def recipe_config(recipe: str, base, data, out, steps: int, context: int, **kw):
    """A recipe run's config on ``base`` and the JSONL ``data``: batches of 2
    rows of ``context`` tokens, evals every 2 steps, checkpoints every 3 (all
    kept), 4 sample tokens, one thread, seed 3; ``kw`` overrides any field."""
    from toy.train.config import defaults, override

    values = {
        "base": str(base),
        "data.paths": [str(data)],
        "steps": steps,
        "batch_size": 2,
        "context": context,
        "eval_every": 2,
        "save_every": 3,
        "keep_checkpoints": 0,
        "sample_tokens": 4,
        "out": str(out),
        "threads": 1,
        "seed": 3,
    }
    values.update(kw)
    return override(defaults(recipe), **values)


def events(run_dir) -> list[dict]:
    """A run's events.jsonl."""
    import json
    from pathlib import Path

    return [json.loads(x) for x in (Path(run_dir) / "events.jsonl").read_text().splitlines()]


def step_losses(run_dir) -> dict[int, float]:
    return {e["step"]: e["loss"] for e in events(run_dir) if e["kind"] == "step"}


class StopAt:
    """Hooks that stop a run once it has done ``step`` steps."""

    def __init__(self, step: int):
        self.step, self.seen = step, 0

    def progress(self, ev):
        self.seen = ev["step"]

    def should_stop(self):
        return self.seen >= self.step


def run_and_resume(cfg, tmp, stop: int):
    """The run straight through, and the same run (in ``tmp/cut``) stopped
    after ``stop`` steps and resumed: both completed."""
    import dataclasses

    from toy.train.lmrun import Hooks, resume, train

    straight = train(cfg)
    assert straight.reason == "completed" and straight.final_step == cfg.steps
    s = StopAt(stop)
    part = train(dataclasses.replace(cfg, out=str(tmp / "cut")), Hooks(progress=s.progress, should_stop=s.should_stop))
    assert part.reason == "interrupted" and part.final_step == stop
    done = resume(part.run_dir)
    assert done.reason == "completed" and done.final_step == cfg.steps
    return straight, done


def resumed_run(cfg, tmp, stop: int, kinds: dict):
    """``run_and_resume`` and what every recipe test checks of it: the
    straight run's bundle (``assert_run_bundle``; ``kinds``: the examples of
    each format), the same step losses and the same optimizer state as the
    resumed run. Returns (straight, resumed, the base's config)."""
    from toy import models
    from toy.gguf import GGUFFile

    straight, done = run_and_resume(cfg, tmp, stop)
    with GGUFFile(cfg.base) as gf:
        base_cfg = models.config_from_gguf(gf)
    assert_run_bundle(straight.run_dir, cfg.recipe, base_cfg.architecture, cfg.steps, kinds)
    assert step_losses(straight.run_dir) == step_losses(done.run_dir)
    assert_same_state(straight.checkpoint, done.checkpoint)
    return straight, done, base_cfg


def assert_same_state(a, b) -> None:
    """The training state saved beside two checkpoints (AdamW moments), tensor for tensor, bit for bit."""
    from toy.gguf import GGUFFile

    sa, sb = (p.with_name(p.name.replace(".gguf", ".state.gguf")) for p in (a, b))
    with GGUFFile(sa) as fa, GGUFFile(sb) as fb:
        assert fa.tensors and set(fa.tensors) == set(fb.tensors)
        for n in fa.tensors:
            assert fa.tensor_to_float(n).tobytes() == fb.tensor_to_float(n).tobytes(), n


def assert_run_bundle(run_dir, recipe: str, arch: str, steps: int, kinds: dict) -> None:
    """run_start .. run_end, finite losses, evals (the base's first),
    samples, checkpoints, the data line (nothing truncated or dropped);
    ``kinds``: the examples of each format."""
    import math

    ev = events(run_dir)
    assert ev[0]["kind"] == "run_start" and ev[-1]["kind"] == "run_end" and ev[-1]["reason"] == "completed"
    start = ev[0]
    assert start["recipe"] == recipe and start["model"]["architecture"] == arch
    assert start["data"]["kinds"] == kinds
    assert {e["kind"] for e in ev} >= {"step", "eval", "sample", "checkpoint", "run_end"}
    losses = step_losses(run_dir)
    assert sorted(losses) == list(range(1, steps + 1))
    assert all(isinstance(v, float) and math.isfinite(v) for v in losses.values()), losses
    evals = [e for e in ev if e["kind"] == "eval"]
    assert evals[0]["step"] == 0 and all(math.isfinite(e["loss"]) for e in evals)  # the base's loss first
    assert all(isinstance(e["text"], str) for e in ev if e["kind"] == "sample")
    (note,) = [e["text"] for e in ev if e["kind"] == "note" and e["text"].startswith("data:")]
    assert "0 truncated, 0 dropped" in note, note


RECIPE_WORDS = "alpha beta gamma delta river stone cloud light green small".split()


def write_examples(path, n: int, formats, seed: int = 0):
    """``n`` JSONL examples into ``path``, example i in format
    ``formats[i % len(formats)]`` (``text``, ``prompt_completion``,
    ``messages``), each on two words drawn from ``RECIPE_WORDS`` by
    ``np.random.default_rng(seed)``."""
    import json

    rng = np.random.default_rng(seed)
    rows = []
    for i in range(n):
        a, b = (str(w) for w in rng.choice(RECIPE_WORDS, size=2))
        kind = formats[i % len(formats)]
        if kind == "text":
            rows.append({"text": f"The {a} and the {b} met by the {a}."})
        elif kind == "prompt_completion":
            rows.append({"prompt": f"say {a} twice:", "completion": f" {a} {a}."})
        else:
            rows.append(
                {"messages": [{"role": "user", "content": f"A word like {a}?"}, {"role": "assistant", "content": b}]}
            )
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


# keys a checkpoint writes itself: what it holds (F32), which run and step
OWN_KEYS = {"general.file_type", "toy.train.run_id", "toy.train.step"}


def assert_full_checkpoints(a, b, base, arch: str, step: int) -> None:
    """Two full fine-tune checkpoints (open GGUFFiles: straight, resumed) of
    ``base``: the same tensors as the base (every one trained), bit for bit
    equal to each other; F32, at ``step``; and the base's metadata, key for
    key and type for type, but ``OWN_KEYS``."""
    assert set(a.tensors) == set(b.tensors) == set(base.tensors)
    for n in a.tensors:
        assert a.tensor_to_float(n).tobytes() == b.tensor_to_float(n).tobytes(), n
    assert a.metadata["general.architecture"] == arch and a.metadata["general.file_type"] == 0
    assert a.metadata["toy.train.step"] == step
    for k, v in base.metadata.items():
        if k in OWN_KEYS:
            continue
        assert k in a.metadata, k
        assert a.types[k] == base.types[k], k
        assert list(np.atleast_1d(a.metadata[k])) == list(np.atleast_1d(v)), k


def hf_masked_loss_backward(model, b: Batch) -> float:
    """The mean NLL of an HF causal LM (put in eval mode: no dropout,
    gradients still flow) over batch ``b``'s kept targets (its loss mask),
    back-propagated into the model's parameters."""
    import torch

    model.eval()
    logits = model(torch.tensor(b.tokens, dtype=torch.long), use_cache=False).logits
    nll = torch.nn.functional.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), torch.tensor(b.targets.reshape(-1), dtype=torch.long), reduction="none"
    )
    keep = torch.tensor(b.loss_mask.reshape(-1), dtype=torch.float64)
    loss = (nll * keep).sum() / keep.sum()
    loss.backward()
    return float(loss.detach())
