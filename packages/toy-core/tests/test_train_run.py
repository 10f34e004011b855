"""Training runs end to end: events, checkpoints, exact resume, stopping,
the independent ``gguf`` reader, ``toy infer`` on a checkpoint, config errors.

The corpus is Python's own documentation topics (``toy.train.demodata``), so
the runs train on real English text without downloading anything. Most runs
use a very small model shape so each takes a few seconds.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from toy.train import checkpoint
from toy.train import config as C
from toy.train.lmrun import Hooks, TrainingIOError, resume, train
from toy_testsupport.train_helpers import python_docs_corpus

SMALL = {
    "model.preset": None,
    "model.d_model": 32,
    "model.n_layer": 2,
    "model.n_head": 4,
    "model.n_head_kv": 2,
    "model.d_ff": 64,
    "tokenizer.vocab_size": 320,
    "batch_size": 4,
    "context": 32,
    "threads": 2,
}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return python_docs_corpus(tmp_path_factory.mktemp("corpus"), 12)


def make_cfg(corpus, tmp_path, **kw):
    values = {**SMALL, "data.paths": [str(corpus["small"])], "data.cache_dir": str(corpus["cache"])}
    values.update({"out": str(tmp_path / "runs"), "steps": 8, "eval_every": 4, "save_every": 4})
    values.update(kw)
    return C.override(C.TrainConfig(), **values)


def events(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]


def test_run_writes_events_checkpoints_and_config(corpus, tmp_path):
    cfg = make_cfg(corpus, tmp_path, steps=8, sample_tokens=6)
    seen = []
    r = train(cfg, Hooks(progress=seen.append))
    assert r.reason == "completed" and r.final_step == 8
    ev = events(r.run_dir)
    kinds = [e["kind"] for e in ev]
    assert kinds[0] == "run_start" and kinds[-1] == "run_end"
    start = ev[0]
    assert start["schema"] == "toy/v1" and start["run_kind"] == "train"
    assert start["model"]["d_model"] == 32 and start["model"]["n_vocab"] == 320
    assert start["n_params"] > 0 and start["data"]["tokens"] > 0
    assert 0 < start["data"]["unigram_nats"] < math.log(320)
    assert start["config"]["steps"] == 8
    steps = [e for e in ev if e["kind"] == "step"]
    assert [e["step"] for e in steps] == list(range(1, 9))
    for e in steps:
        for key in ("loss", "lr", "tokens", "tokens_per_s", "grad_norm", "wall_us", "t"):
            assert isinstance(e[key], (int, float)), key
    assert [e["tokens"] for e in steps] == [4 * 32 * i for i in range(1, 9)]
    evals = [e for e in ev if e["kind"] == "eval"]
    assert [e["step"] for e in evals] == [4, 8]
    assert all(e["name"] == "val" and e["ppl"] == pytest.approx(math.exp(e["loss"])) for e in evals)
    samples = [e for e in ev if e["kind"] == "sample"]
    assert samples and all(isinstance(s["text"], str) for s in samples)
    assert [e["step"] for e in ev if e["kind"] == "checkpoint"] == [4, 8]
    assert ev[-1]["reason"] == "completed" and ev[-1]["final_step"] == 8
    assert ev[-1]["final_loss"] == steps[-1]["loss"]
    assert json.loads((r.run_dir / "config.json").read_text())["steps"] == 8
    ck = r.run_dir / "checkpoints"
    assert (ck / "latest").resolve() == (ck / "step_8.gguf").resolve()
    assert checkpoint.list_steps(ck) == [4, 8]
    assert [p["step"] for p in seen] == list(range(1, 9)) and seen[-1]["total"] == 8


def test_resume_is_exact(corpus, tmp_path):
    """8 steps straight == 4 steps, stop, resume for 4: byte-identical losses,
    gradient norms and weights (grad accumulation on, so the accumulators
    and the data cursor are part of what must survive)."""
    kw = {"steps": 8, "grad_accum": 2, "save_every": 0, "eval_every": 0, "sample_tokens": 0}
    full = train(make_cfg(corpus, tmp_path / "a", **kw))
    stop_at = {"n": 0}

    def should_stop():  # polled before each step: the 5th poll comes after step 4
        stop_at["n"] += 1
        return stop_at["n"] == 5

    half = train(make_cfg(corpus, tmp_path / "b", **kw), Hooks(should_stop=should_stop))
    assert half.reason == "interrupted" and half.final_step == 4
    assert events(half.run_dir)[-1]["reason"] == "interrupted"
    rest = resume(half.run_dir)
    assert rest.reason == "completed" and rest.final_step == 8

    def curve(run_dir):
        by_step = {}
        for e in events(run_dir):
            if e["kind"] == "step":
                by_step[e["step"]] = (e["loss"], e["grad_norm"], e["lr"], e["tokens"])
        return [by_step[i] for i in sorted(by_step)]

    assert curve(half.run_dir) == curve(full.run_dir)
    a = checkpoint.load(full.run_dir / "checkpoints")
    b = checkpoint.load(half.run_dir / "checkpoints")
    assert a.step == b.step == 8
    for name in a.params:
        assert a.params[name].tobytes() == b.params[name].tobytes(), name
    for name in a.optimizer:
        assert a.optimizer[name].tobytes() == b.optimizer[name].tobytes(), name
    kinds = [e["kind"] for e in events(half.run_dir)]
    assert "resume" in kinds and kinds[-1] == "run_end"


def test_same_seed_same_curve_and_seed_matters(corpus, tmp_path):
    kw = {"steps": 4, "save_every": 0, "eval_every": 0, "sample_tokens": 0}

    def losses(sub, **extra):
        r = train(make_cfg(corpus, tmp_path / sub, **kw, **extra))
        return [e["loss"] for e in events(r.run_dir) if e["kind"] == "step"]

    assert losses("a") == losses("b")
    assert losses("c", seed=1) != losses("a")


def test_checkpoint_is_a_llama_gguf_for_other_readers(corpus, tmp_path):
    gguf = pytest.importorskip("gguf")  # a dev requirement: always there in CI
    r = train(make_cfg(corpus, tmp_path, steps=2, save_every=0, eval_every=0, sample_tokens=0))
    path = r.run_dir / "checkpoints" / "step_2.gguf"
    reader = gguf.GGUFReader(str(path))
    fields = reader.fields

    def val(key):
        f = fields[key]
        if f.types and f.types[0] == gguf.GGUFValueType.STRING:
            return bytes(f.parts[f.data[0]]).decode()
        return f.parts[f.data[0]].tolist()[0]

    assert val("general.architecture") == "llama"
    assert val("llama.block_count") == 2 and val("llama.embedding_length") == 32
    assert val("llama.attention.head_count") == 4 and val("llama.attention.head_count_kv") == 2
    assert val("llama.context_length") == 32 and val("llama.rope.dimension_count") == 8
    assert val("tokenizer.ggml.model") == "gpt2"
    assert len(fields["tokenizer.ggml.tokens"].data) == 320
    # llama.cpp refuses counts and special ids stored as anything but UINT32
    u32 = [gguf.GGUFValueType.UINT32]
    for key in (
        "general.file_type",
        "llama.block_count",
        "llama.context_length",
        "llama.embedding_length",
        "llama.feed_forward_length",
        "llama.attention.head_count",
        "llama.attention.head_count_kv",
        "llama.rope.dimension_count",
        "llama.vocab_size",
        "tokenizer.ggml.eos_token_id",
        "tokenizer.ggml.bos_token_id",
    ):
        assert fields[key].types == u32, key
    assert fields["llama.rope.freq_base"].types == [gguf.GGUFValueType.FLOAT32]
    names = {t.name for t in reader.tensors}
    want = {"token_embd.weight", "output_norm.weight"} | {
        f"blk.{i}.{n}"
        for i in range(2)
        for n in (
            "attn_norm.weight",
            "attn_q.weight",
            "attn_k.weight",
            "attn_v.weight",
            "attn_output.weight",
            "ffn_norm.weight",
            "ffn_gate.weight",
            "ffn_up.weight",
            "ffn_down.weight",
        )
    }
    assert names == want  # tied head: no output.weight
    t = {t.name: t for t in reader.tensors}
    assert t["blk.0.attn_k.weight"].data.shape == (16, 32)  # 2 KV heads x 8, d 32 (NumPy order)
    assert all(x.tensor_type == gguf.GGMLQuantizationType.F32 for x in reader.tensors)


def test_checkpoint_generates_through_toy_load(corpus, tmp_path):
    import toy

    r = train(make_cfg(corpus, tmp_path, steps=2, save_every=0, eval_every=0, sample_tokens=0))
    ck = checkpoint.load(r.run_dir / "checkpoints")
    m = toy.load(r.run_dir / "checkpoints" / "latest", threads=1)
    try:
        # the inference engine and the training graph compute the same logits
        ids = m.tokenize("The for statement", add_special=False)
        got = m.logits(ids)[-1]
        from toy.gguf import GGUFFile
        from toy.models.llama import LlamaConfig
        from toy_testsupport.reference.llama_np import forward_logits

        with GGUFFile(ck.model_path) as gf:
            cfg = LlamaConfig.from_gguf(gf)
        ref = forward_logits(cfg, {k: v.astype(np.float64) for k, v in ck.params.items()}, np.array(ids))[-1]
        # the inference engine rounds K/V to F16 (its cache type): float16-level agreement
        np.testing.assert_allclose(got, ref, atol=2e-3 * float(np.abs(ref).max()) + 1e-4)
        out = m.generate("The for statement", max_tokens=5, temperature=0, ignore_eos=True)
        assert len(out.tokens) == 5
    finally:
        m.close()


@pytest.mark.parametrize(
    "kw, match",
    [
        ({"data.paths": []}, "no training data"),
        ({"batch_size": 4000}, "tokens"),
    ],
)
def test_bad_data_is_refused_before_training(corpus, tmp_path, kw, match):
    from toy.errors import ToyError

    with pytest.raises(ToyError, match=match):
        train(make_cfg(corpus, tmp_path, **kw))
    assert not list((tmp_path / "runs").glob("*")) if (tmp_path / "runs").exists() else True


def test_config_file_validation(tmp_path):
    p = tmp_path / "c.toml"
    p.write_text('steps = 5\n[optim]\nlr = 0.01\nschedule = "wsd"\n[model]\npreset = "small"\n')
    cfg = C.load_toml(p)
    assert cfg.steps == 5 and cfg.optim.lr == 0.01 and cfg.optim.schedule == "wsd"
    assert C.resolve_shape(cfg.model)["d_model"] == 384
    cfg2 = C.override(cfg, **{"optim.lr": 0.5, "steps": None})
    assert cfg2.optim.lr == 0.5 and cfg2.steps == 5
    bad = {
        "stepz = 5\n": "unknown key 'stepz'",
        "[optim]\nlearning_rate = 1\n": "unknown key 'optim.learning_rate'",
        'steps = "5"\n': "steps: expected an integer",
        "[optim]\nschedule = 'sine'\n": "schedule 'sine'",
        "steps = 0\n": "steps=0",
        "[model]\npreset = 'huge'\n": "preset 'huge'",
        "[model]\npreset = 'tiny'\nn_head = 3\n": "multiple",
        "steps = \n": "not valid TOML",
    }
    for text, match in bad.items():
        p.write_text(text)
        with pytest.raises(C.ConfigError, match=match):
            C.load_toml(p)
    with pytest.raises(C.ConfigError, match="cannot read"):
        C.load_toml(tmp_path / "missing.toml")


def test_an_architectures_shape_check_names_the_key(tmp_path):
    """The architectures' own checks raise toy.errors.ConfigError (re-exported by toy.train.config) with the
    offending key as its field."""
    p = tmp_path / "c.toml"
    bad = {
        "[model]\npreset = 'tiny'\nhead_dim = 7\n": ("must be even", "model.head_dim"),
        "[model]\narch = 'gpt2'\npreset = 'tiny'\nn_head_kv = 2\n": ("one K/V head per head", "model.n_head_kv"),
        "[model]\narch = 'gpt2'\npreset = 'tiny'\nhead_dim = 8\n": ("d_model / n_head", "model.head_dim"),
    }
    for text, (match, field) in bad.items():
        p.write_text(text)
        with pytest.raises(C.ConfigError, match=match) as e:
            C.load_toml(p)
        assert e.value.field == field


def test_schedules():
    from toy.train.optim import OptimConfig, lr_at

    c = OptimConfig(lr=1.0, min_lr=0.0, warmup=2, schedule="cosine")
    lrs = [lr_at(c, s, 10) for s in range(10)]
    assert lrs[:2] == [0.5, 1.0]  # linear warmup, never 0
    assert lrs[2] == 1.0 and all(a > b for a, b in zip(lrs[2:], lrs[3:]))
    assert lrs[-1] > 0  # the last step still learns
    assert lrs[6] == pytest.approx(0.5 * (1 + math.cos(math.pi * 4 / 8)))
    lin = OptimConfig(lr=1.0, warmup=0, schedule="linear")
    assert [lr_at(lin, s, 4) for s in range(4)] == [1.0, 0.75, 0.5, 0.25]
    const = OptimConfig(lr=0.3, warmup=0, schedule="constant")
    assert {lr_at(const, s, 5) for s in range(5)} == {0.3}
    wsd = OptimConfig(lr=1.0, warmup=1, schedule="wsd", decay_fraction=0.5)
    assert [lr_at(wsd, s, 6) for s in range(6)] == [1.0, 1.0, 1.0, 0.75, 0.5, 0.25]


def test_crash_while_saving_keeps_the_previous_checkpoint(corpus, tmp_path, monkeypatch):
    """A failure in the middle of writing step 8 leaves step 4 complete and
    ``latest`` pointing at it; resuming starts from step 4."""
    from toy.gguf import GGUFWriter

    real = GGUFWriter.write
    calls = {"n": 0}

    def flaky(self):
        calls["n"] += 1
        if self.path.name.startswith("step_8"):
            raise OSError("disk full (simulated)")
        return real(self)

    monkeypatch.setattr(GGUFWriter, "write", flaky)
    # the OSError is reported with the file and the checkpoint left to resume from
    with pytest.raises(TrainingIOError, match=r"step_8 .*disk full \(simulated\); the last good checkpoint is step_4"):
        train(make_cfg(corpus, tmp_path, steps=8, save_every=4, eval_every=0, sample_tokens=0))
    monkeypatch.setattr(GGUFWriter, "write", real)
    (run_dir,) = (tmp_path / "runs").iterdir()
    ck = run_dir / "checkpoints"
    assert checkpoint.latest_step(ck) == 4
    assert (ck / "latest").resolve() == (ck / "step_4.gguf").resolve()
    assert not list(ck.glob("step_8*")) and not list(ck.glob(".*tmp"))
    ev = events(run_dir)
    assert ev[-1]["kind"] == "run_end" and ev[-1]["reason"] == "errored"
    r = resume(run_dir)
    assert r.final_step == 8 and checkpoint.latest_step(ck) == 8


@pytest.mark.model
def test_tokenizer_taken_from_a_gguf_model(corpus, tmp_path, smollm2_path):
    """--tokenizer MODEL: the checkpoint embeds that model's tokenizer
    exactly (same tokens, types and merges) and the vocabulary sizes the model."""
    from toy.gguf import GGUFFile

    cfg = make_cfg(
        corpus,
        tmp_path,
        steps=2,
        batch_size=2,
        context=16,
        save_every=0,
        eval_every=0,
        sample_tokens=4,
        **{"tokenizer.model": str(smollm2_path)},
    )
    r = train(cfg)
    with GGUFFile(r.run_dir / "checkpoints" / "step_2.gguf") as out, GGUFFile(smollm2_path) as src:
        for key in (
            "tokenizer.ggml.tokens",
            "tokenizer.ggml.merges",
            "tokenizer.ggml.token_type",
            "tokenizer.ggml.eos_token_id",
            "tokenizer.chat_template",
        ):
            assert list(np.atleast_1d(out.metadata[key])) == list(np.atleast_1d(src.metadata[key])), key
            assert out.types[key] == src.types[key], key
        assert out.tensors["token_embd.weight"].shape[0] == 49152
    start = events(r.run_dir)[0]
    assert start["tokenizer"].startswith("model:") and start["model"]["n_vocab"] == 49152
