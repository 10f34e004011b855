"""The fine-tuning recipes end to end: lora, full, warm-start runs on tiny
bases (a from-scratch checkpoint made here, F32 and a Q8_0 copy), their
checkpoints, events, and exact resume.

References: resume equivalence compares a run against itself interrupted
and continued (losses, adapter/model bytes and AdamW moments identical);
the adapter is read back with ``load_adapter`` and the base's bytes are
hashed before and after; warm-start's copied tensors are compared with the
donor's.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from toy.adapters import load_adapter
from toy.errors import BadInputError
from toy.gguf import GGUFFile, quantize_model
from toy.train.config import defaults, override
from toy.train.lmrun import Hooks, resume, train
from toy_testsupport import train_helpers as th
from toy_testsupport.gpt2_ref import sha256 as sha
from toy_testsupport.train_helpers import RECIPE_WORDS as WORDS
from toy_testsupport.train_helpers import StopAt, events, run_and_resume, step_losses


@pytest.fixture(scope="module")
def bases(tmp_path_factory):
    """A tiny from-scratch checkpoint (F32, with its BPE tokenizer) and a Q8_0 copy, plus JSONL data."""
    d = tmp_path_factory.mktemp("recipes")
    rng = np.random.default_rng(0)
    text = "\n".join(" ".join(rng.choice(WORDS, size=12)) + "." for _ in range(400))
    (d / "corpus.txt").write_text(text)
    cfg = override(
        defaults(),
        **{"data.paths": [str(d / "corpus.txt")], "tokenizer.vocab_size": 300, "steps": 4, "batch_size": 2,
           "context": 32, "eval_every": 0, "save_every": 0, "sample_tokens": 0, "out": str(d / "runs"), "threads": 1},
    )  # fmt: skip
    res = train(cfg)
    f32 = res.checkpoint
    q8 = d / "base-q8_0.gguf"
    quantize_model(f32, q8, "q8_0")
    lines = []
    for i in range(60):
        a, b = rng.choice(WORDS, size=2)
        if i % 3 == 0:
            lines.append({"text": f"{a} {b} {a}."})
        else:
            lines.append({"prompt": f"say {a} twice:", "completion": f" {a} {a}."})
    data = d / "data.jsonl"
    data.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    return {"f32": f32, "q8": q8, "data": data, "corpus": d / "corpus.txt", "dir": d}


def cfg_for(bases, recipe: str, out: Path, steps: int, **kw):
    base = bases[kw.pop("base", "f32")]
    data = bases["data"] if recipe != "warm-start" else bases["corpus"]
    return th.recipe_config(recipe, base, data, out, steps, 32, **kw)


@pytest.mark.parametrize("which", ["f32", "q8"])
def test_lora_run_resumes_exactly_and_writes_adapters(bases, tmp_path, which):
    before = sha(bases[which])
    cfg = cfg_for(bases, "lora", tmp_path / "a", 6, base=which, **{"lora.targets": ["q", "v", "down"], "lora.rank": 4})
    straight, done = run_and_resume(cfg, tmp_path, 2)
    assert step_losses(straight.run_dir) == step_losses(done.run_dir)
    a, b = straight.checkpoint, done.checkpoint
    assert a.name == b.name == "step_6.gguf"
    ad, bd = load_adapter(a), load_adapter(b)
    assert ad.pairs.keys() == bd.pairs.keys()
    for k in ad.pairs:
        for x, y in zip(ad.pairs[k], bd.pairs[k]):
            np.testing.assert_array_equal(x, y)
    sa, sb = (p.with_name("step_6.state.gguf") for p in (a, b))
    with GGUFFile(sa) as fa, GGUFFile(sb) as fb:
        for n in fa.tensors:
            np.testing.assert_array_equal(fa.tensor_to_float(n), fb.tensor_to_float(n))
    assert ad.meta["toy.lora.targets"] == ["q", "v", "down"] and ad.rank == 4
    assert len(ad.pairs) == 3 * 4  # 3 targets x 4 blocks of the tiny preset
    assert sha(bases[which]) == before  # the base is never written
    ev = events(straight.run_dir)
    start = ev[0]
    assert start["recipe"] == "lora" and start["base"]["sha256"] == before
    assert start["lora"]["scale"] == 16.0 / 4 and start["data"]["kinds"] == {"text": 20, "prompt_completion": 40}
    assert {e["kind"] for e in ev} >= {"step", "eval", "sample", "checkpoint", "run_end"}
    (note,) = [e["text"] for e in ev if e["kind"] == "note"]  # the data line: nothing truncated silently
    assert (
        note.startswith("data: 60 examples used (text 20, prompt_completion 40 read)")
        and "0 truncated, 0 dropped" in note
    )
    losses = step_losses(straight.run_dir)
    assert losses[6] < losses[1]


def test_lora_resume_refuses_a_changed_base(bases, tmp_path):
    import shutil

    base = tmp_path / "base.gguf"
    shutil.copy(bases["f32"], base)
    cfg = cfg_for(bases, "lora", tmp_path / "r", 4, base="f32")
    cfg = cfg.__class__(**{**cfg.__dict__, "base": str(base)})
    s = StopAt(1)
    part = train(cfg, Hooks(progress=s.progress, should_stop=s.should_stop))
    data = bytearray(base.read_bytes())
    data[-1] ^= 1
    base.write_bytes(bytes(data))
    with pytest.raises(BadInputError, match="changed since the run started"):
        resume(part.run_dir)


def test_full_fine_tune_resumes_exactly_and_freezes(bases, tmp_path):
    cfg = cfg_for(bases, "full", tmp_path / "f", 5, **{"freeze": ["embeddings"], "optim.lr": 1e-3})
    straight, done = run_and_resume(cfg, tmp_path, 3)
    assert step_losses(straight.run_dir) == step_losses(done.run_dir)
    # the two files differ only in their run ids (metadata): compare every tensor
    with GGUFFile(straight.checkpoint) as a, GGUFFile(done.checkpoint) as b, GGUFFile(bases["f32"]) as base:
        assert set(a.tensors) == set(base.tensors)
        for n in a.tensors:
            np.testing.assert_array_equal(a.tensor_to_float(n), b.tensor_to_float(n))
        # frozen: the embedding is the base's; trained: a block weight moved
        np.testing.assert_array_equal(a.tensor_to_float("token_embd.weight"), base.tensor_to_float("token_embd.weight"))
        assert not np.array_equal(a.tensor_to_float("blk.0.attn_q.weight"), base.tensor_to_float("blk.0.attn_q.weight"))
        # the base's metadata travels (tokenizer, architecture), weights are F32
        assert a.metadata["tokenizer.ggml.tokens"] == base.metadata["tokenizer.ggml.tokens"]
        assert a.metadata["general.file_type"] == 0 and a.metadata["toy.train.step"] == 5
    start = events(straight.run_dir)[0]
    assert start["recipe"] == "full" and start["frozen"] == ["token_embd.weight"]


def test_full_fine_tune_of_a_quantized_base_says_it_dequantized(bases, tmp_path):
    cfg = cfg_for(bases, "full", tmp_path / "q", 1, base="q8", save_every=0, eval_every=0, sample_tokens=0)
    res = train(cfg)
    ev = events(res.run_dir)
    notes = [e["text"] for e in ev if e["kind"] == "note"]
    deq = [n for n in notes if "dequantized" in n]
    assert len(deq) == 1 and "Q8_0" in deq[0]
    assert ev[0]["base"]["dequantized"] == ["Q8_0"]
    import toy

    with toy.load(res.checkpoint, threads=1) as m:  # the checkpoint is a normal model
        assert m.logits([1, 2, 3]).shape == (3, m.cfg.n_vocab)


def test_warm_start_copies_embedding_and_matching_blocks(bases, tmp_path):
    cfg = cfg_for(bases, "warm-start", tmp_path / "w", 2, **{"model.preset": "tiny", "model.n_layer": 2})
    res = train(cfg)
    start = events(res.run_dir)[0]
    assert start["recipe"] == "warm-start"
    ws = start["warm_start"]
    assert ws["embedding"] == "copied" and ws["blocks_copied"] == [0, 1] and ws["blocks_skipped_shape"] == []
    # at step 0 the copied tensors are the donor's: check through a 0-step comparison of init values
    from toy.models.llama import LlamaConfig
    from toy.train.model import model_config
    from toy.train.recipes import warm_start_params

    with GGUFFile(bases["f32"]) as gf:
        mc = model_config(cfg.model, LlamaConfig.from_gguf(gf).n_vocab, cfg.context)
        params, facts = warm_start_params(cfg, mc, gf, 3)
        np.testing.assert_array_equal(params["blk.1.ffn_up.weight"], gf.tensor_to_float("blk.1.ffn_up.weight"))
        np.testing.assert_array_equal(params["token_embd.weight"], gf.tensor_to_float("token_embd.weight"))
    # a narrower model: the embedding is projected, no block matches
    narrow = cfg.__class__(
        **{**cfg.__dict__, "model": cfg.model.__class__(**{**cfg.model.__dict__, "d_model": 64, "n_head": 4})}
    )
    with GGUFFile(bases["f32"]) as gf:
        mc = model_config(narrow.model, LlamaConfig.from_gguf(gf).n_vocab, narrow.context)
        params, facts = warm_start_params(narrow, mc, gf, 3)
        donor = gf.tensor_to_float("token_embd.weight")
    assert facts["embedding"].startswith("projected 128 -> 64") and facts["blocks_copied"] == []
    emb = params["token_embd.weight"]
    assert emb.shape == (donor.shape[0], 64)

    # PCA keeps the donor's geometry: nearest neighbours of tokens mostly agree
    def nn(x):
        x = x - x.mean(0)
        g = x @ x.T
        np.fill_diagonal(g, -np.inf)
        return g.argmax(1)

    assert (nn(emb.astype(np.float64)) == nn(donor.astype(np.float64))).mean() > 0.3


def test_recipe_config_errors(bases, tmp_path):
    from toy.train.config import ConfigError

    with pytest.raises(ConfigError, match="needs a base"):
        override(defaults("lora"), **{"data.paths": ["x"]})
    with pytest.raises(ConfigError, match="lora.targets"):
        cfg_for(bases, "lora", tmp_path, 1, **{"lora.targets": ["q", "nope"]})
    with pytest.raises(ConfigError, match="freeze"):
        cfg_for(bases, "full", tmp_path, 1, freeze=["everything"])
    with pytest.raises(ConfigError, match="max_length"):
        cfg_for(bases, "lora", tmp_path, 1, **{"data.max_length": 999})
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "a", "completion": "b"}\n{"prompt": 1}\n')
    with pytest.raises(BadInputError, match="bad.jsonl:2"):
        train(cfg_for(bases, "lora", tmp_path / "bad", 1, **{"data.paths": [str(bad)]}))


def test_warm_start_resumes_exactly(bases, tmp_path):
    cfg = cfg_for(bases, "warm-start", tmp_path / "ws", 4, **{"model.preset": "tiny", "model.n_layer": 2})
    straight, done = run_and_resume(cfg, tmp_path, 2)
    assert step_losses(straight.run_dir) == step_losses(done.run_dir)
    with GGUFFile(straight.checkpoint) as a, GGUFFile(done.checkpoint) as b:
        for n in a.tensors:
            np.testing.assert_array_equal(a.tensor_to_float(n), b.tensor_to_float(n))
