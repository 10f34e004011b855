"""``--lora`` on `toy infer`, `toy chat` and `toy serve`, and `toy merge`.

Driven through ``toy_cli.main.main`` with captured stdout/stderr. What the
answers are checked against:

- `toy infer --lora` / `toy chat --lora` on the real SmolLM2 file: the
  library (``toy.load(..., lora=...)``, itself checked against the NumPy
  reference and llama.cpp in toy-core's test_lora_inference.py) with the
  same adapters, and the base without them, which must differ (the flag
  must reach the model);
- `toy merge`: the merged file's logits against the library's base +
  adapters on a tiny seeded F32 model (float32 rounding: rtol 1e-5), and
  the report's figures (KL ~0 for F32, small and positive for Q8_0);
- `toy serve --lora`: ``/v1/models``, the run bundle's run_start and a
  greedy completion against the library with the same adapter;
- bad input: exit 2, an ``error:`` line, a ``hint:`` where there is one, no
  traceback, nothing loaded when the options are wrong.

Runs are pinned to the CPU and one thread (the machine may be shared).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import numpy as np
import pytest

import toy
from toy.adapters import save_adapter
from toy_testsupport import toy_test_models as mp
from toy_testsupport.cli_helpers import FakeStdin, assert_clean_error, run

PROMPT = "Once upon a time, in a small village,"
QUESTION = "What is the tallest mountain in the world?"
IDS = [1, 5, 9, 33, 2, 70, 4, 4, 12, 88, 40, 41, 7, 0, 63, 95, 17]


@pytest.fixture(autouse=True)
def _cpu_one_thread(monkeypatch):
    monkeypatch.setenv("TOY_DEVICE", "cpu")
    monkeypatch.setenv("TOY_THREADS", "1")


def _pairs(shapes: dict, layers, stems, rank: int, seed: int, std: float):
    rng = np.random.default_rng(seed)
    out = {}
    for i in layers:
        for stem in stems:
            name = f"blk.{i}.{stem}.weight"
            o, n = shapes[name]
            out[name] = (
                (rng.standard_normal((rank, n)) * std).astype(np.float32),
                (rng.standard_normal((o, rank)) * std).astype(np.float32),
            )
    return out


def _shapes(path) -> dict:
    from toy.gguf import GGUFFile

    with GGUFFile(path) as gf:
        return {n: tuple(i.shape) for n, i in gf.tensors.items()}


@pytest.fixture(scope="module")
def smol_adapters(smollm2_path, tmp_path_factory):
    """Two random adapters for SmolLM2 (q, v of every layer; v, up of the first 10)."""
    d = tmp_path_factory.mktemp("smol-lora")
    shapes = _shapes(smollm2_path)
    one = save_adapter(
        d / "qv.gguf",
        architecture="llama",
        pairs=_pairs(shapes, range(30), ("attn_q", "attn_v"), 8, 1, 0.07),
        alpha=16.0,
        rank=8,
    )
    two = save_adapter(
        d / "up.gguf",
        architecture="llama",
        pairs=_pairs(shapes, range(10), ("attn_v", "ffn_up"), 4, 2, 0.05),
        alpha=4.0,
        rank=4,
    )
    return one, two


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny F32 llama, two adapters for it and one with a wrong shape."""
    d = tmp_path_factory.mktemp("tiny-lora")
    base = Path(mp.write_tiny_model(d / "tiny.gguf", seed=4, extra_metadata={"tokenizer.ggml.merges": []}))
    shapes = _shapes(base)
    a1 = save_adapter(
        d / "a1.gguf",
        architecture="llama",
        pairs=_pairs(shapes, (0, 1), ("attn_q", "attn_v", "ffn_down"), 4, 3, 0.3),
        alpha=8.0,
        rank=4,
    )
    a2 = save_adapter(
        d / "a2.gguf",
        architecture="llama",
        pairs=_pairs(shapes, (1,), ("attn_output",), 2, 4, 0.3),
        alpha=2.0,
        rank=2,
    )
    wrong = save_adapter(
        d / "wrong.gguf",
        architecture="llama",
        pairs={"blk.0.attn_k.weight": (np.zeros((2, 64), np.float32), np.zeros((64, 2), np.float32))},
        alpha=2.0,
        rank=2,
    )
    return base, a1, a2, wrong


# ---------------------------------------------------------------- infer and chat


@pytest.mark.model
def test_infer_lora_greedy_json_equals_library(capsys, smollm2_path, smol_adapters):
    one, two = smol_adapters
    code, out, err = run(
        capsys,
        "infer",
        smollm2_path,
        PROMPT,
        "--lora",
        f"{one}:0.5",
        "--lora",
        two,
        "--greedy",
        "-n",
        12,
        "--ignore-eos",
        "--ctx",
        256,
        "--json",
    )
    assert code == 0, err
    d = json.loads(out)
    assert d["lora"] == [{"path": str(one), "scale": 0.5}, {"path": str(two), "scale": 1.0}]
    with toy.load(smollm2_path, n_ctx=256, threads=1, lora=[(one, 0.5), (two, 1.0)]) as m:
        want = m.generate(PROMPT, temperature=0, max_tokens=12, ignore_eos=True)
    with toy.load(smollm2_path, n_ctx=256, threads=1) as m:
        base = m.generate(PROMPT, temperature=0, max_tokens=12, ignore_eos=True)
    assert d["tokens"] == want.tokens and d["text"] == want.text
    assert d["tokens"] != base.tokens  # the adapters reached the model


@pytest.mark.model
def test_chat_lora_reply_equals_library(capsys, smollm2_path, smol_adapters, monkeypatch):
    one, _ = smol_adapters
    monkeypatch.setattr(sys, "stdin", FakeStdin(QUESTION + "\n"))
    code, out, err = run(capsys, "chat", smollm2_path, "--lora", one, "--greedy", "-n", 16, "--ctx", 256, "-q")
    assert code == 0, err
    with toy.load(smollm2_path, n_ctx=256, threads=1, lora=[one]) as m:
        want = m.chat().send(QUESTION, temperature=0, max_tokens=16)
        for _ in want:
            pass
    assert out == want.result.text + "\n"


def test_bad_lora_inputs_exit_2(capsys, tiny, tmp_path, monkeypatch):
    base, a1, _, wrong = tiny
    monkeypatch.setattr(sys, "stdin", FakeStdin(""))
    for cmd in (["infer", base, "x"], ["chat", base]):
        code, out, err = run(capsys, *cmd, "--lora", tmp_path / "absent.gguf")
        assert_clean_error(code, err, 2, "absent.gguf", "no such file", hint=True)
        assert out == ""
        code, _, err = run(capsys, *cmd, "--lora", f"{a1}:half")
        assert_clean_error(code, err, 2, "scale", "'half'", hint=True)
        code, _, err = run(capsys, *cmd, "--lora", f"{a1}:1e999")
        assert_clean_error(code, err, 2, "not finite")
        code, _, err = run(capsys, *cmd, "--lora", wrong)
        assert_clean_error(code, err, 2, "blk.0.attn_k.weight", "wrong base model", hint=True)
        code, _, err = run(capsys, *cmd, "--lora", base)
        assert_clean_error(code, err, 2, "not an adapter")


# ---------------------------------------------------------------- merge


def test_merge_f32_json_and_text_output(capsys, tiny, tmp_path):
    base, a1, a2, _ = tiny
    out = tmp_path / "merged.gguf"
    code, stdout, err = run(capsys, "merge", base, a1, out, "--lora-scale", 0.5, "--adapter", f"{a2}:2", "--json")
    assert code == 0, err
    rep = json.loads(stdout)
    assert rep["adapters"] == [{"path": str(a1), "scale": 0.5}, {"path": str(a2), "scale": 2.0}]
    assert rep["dtype"] is None and rep["out"] == str(out)
    d = rep["drift"]
    assert d["kl_mean"] < 1e-9 and d["top1_agreement"] == 1.0 and d["max_abs_logit_diff"] < 1e-4
    with toy.load(base, lora=[(a1, 0.5), (a2, 2.0)], kv_type="f32", threads=1) as m:
        want = m.logits(IDS)
    with toy.load(out, kv_type="f32", threads=1) as m:
        np.testing.assert_allclose(m.logits(IDS), want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
    # plain output: OUT, what was merged, the drift line; progress notes on stderr only
    code, stdout, err = run(capsys, "merge", base, a1, tmp_path / "m2.gguf")
    assert code == 0, err
    lines = stdout.splitlines()
    assert lines[0] == str(tmp_path / "m2.gguf") and "merged 1 adapter into 6 weights" in lines[1]
    assert lines[2].startswith("drift on ") and "KL mean" in lines[2]
    assert "merging" in err and "KL" not in err


def test_merge_q8_0(capsys, tiny, tmp_path):
    from toy.gguf import GGUFFile

    base, a1, _, _ = tiny
    out = tmp_path / "q" / "merged.Q8_0.gguf"
    code, stdout, err = run(capsys, "merge", base, a1, out, "--type", "Q8_0", "--json")
    assert code == 0, err
    rep = json.loads(stdout)
    assert rep["dtype"] == "Q8_0"
    assert 1e-7 < rep["drift"]["kl_mean"] < 0.01
    assert [p.name for p in out.parent.iterdir()] == [out.name]
    with GGUFFile(out) as g:
        assert g.tensors["blk.0.attn_q.weight"].dtype.name == "Q8_0"


def test_merge_bad_inputs_exit_2(capsys, tiny, tmp_path):
    base, a1, _, wrong = tiny
    out = tmp_path / "o.gguf"
    code, _, err = run(capsys, "merge", base, tmp_path / "absent.gguf", out)
    assert_clean_error(code, err, 2, "absent.gguf", "no such file", hint=True)
    code, _, err = run(capsys, "merge", base, a1, out, "--type", "Q9")
    assert_clean_error(code, err, 2, "Q9", hint=True)
    code, _, err = run(capsys, "merge", base, a1, out, "--adapter", f"{a1}:x")
    assert_clean_error(code, err, 2, "scale")
    code, _, err = run(capsys, "merge", base, a1, out, "--lora-scale", "inf")
    assert_clean_error(code, err, 2, "--lora-scale")
    code, _, err = run(capsys, "merge", base, wrong, out)
    assert_clean_error(code, err, 2, "blk.0.attn_k.weight", hint=True)
    code, _, err = run(capsys, "merge", tmp_path / "nobase.gguf", a1, out)
    assert_clean_error(code, err, 2, "nobase.gguf")
    assert not out.exists()


# ---------------------------------------------------------------- serve


def test_serve_lora_bad_inputs_exit_2_before_binding(capsys, tiny, tmp_path):
    pytest.importorskip("toy_serve")
    base, a1, _, wrong = tiny
    code, _, err = run(capsys, "serve", base, "--lora", tmp_path / "absent.gguf", "--port", 0)
    assert_clean_error(code, err, 2, "no such file", hint=True)
    code, _, err = run(capsys, "serve", base, "--lora", f"{a1}:abc", "--port", 0)
    assert_clean_error(code, err, 2, "scale")
    code, _, err = run(capsys, "serve", base, "--lora", wrong, "--port", 0)
    assert_clean_error(code, err, 2, "blk.0.attn_k.weight", hint=True)
    assert "toy serve:" not in err  # refused before the server starts


def test_serve_lora_models_run_start_and_completion(tiny, tmp_path):
    pytest.importorskip("toy_serve")
    from fastapi.testclient import TestClient

    from toy_serve import Settings, create_app

    base, a1, _, _ = tiny
    settings = Settings(model=str(base), lora=(f"{a1}:0.5",), threads=1, parallel=2, runs_dir=str(tmp_path / "runs"))
    assert settings.lora == ((str(a1), 0.5),)
    with TestClient(create_app(settings)) as c:
        deadline = time.monotonic() + 60
        while c.get("/health").status_code != 200:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        card = c.get("/v1/models").json()["data"][0]
        assert card["lora"] == [{"name": "a1.gguf", "scale": 0.5}]
        r = c.post("/v1/completions", json={"prompt": IDS[:6], "max_tokens": 6, "temperature": 0}).json()
    with toy.load(base, lora=[(a1, 0.5)], threads=1, exact_batching=True) as m:
        want = m.generate(IDS[:6], temperature=0, max_tokens=6)
    with toy.load(base, threads=1, exact_batching=True) as m:
        plain = m.generate(IDS[:6], temperature=0, max_tokens=6)
    assert r["choices"][0]["text"] == want.text != plain.text
    (bundle,) = (tmp_path / "runs").iterdir()
    start = json.loads((bundle / "events.jsonl").read_text().splitlines()[0])
    assert start["kind"] == "run_start"
    assert start["model"]["lora"] == [{"path": str(a1), "scale": 0.5}]
    assert start["config"]["lora"] == [{"path": str(a1), "scale": 0.5}]


def test_demo_adapter_is_the_llamacpp_parity_adapter(capsys, tmp_path, smollm2_path):
    """`toy train demo-adapter` with its defaults writes, for SmolLM2, the very file whose
    sha256 toy-core's llama.cpp LoRA parity fixture recorded (the guides' story-lora.gguf)."""
    import hashlib

    fixture = Path(__file__).parents[2] / "toy-core/tests/fixtures/lora_llamacpp.json"
    want = json.loads(fixture.read_text())["adapter"]["sha256"]
    base = tmp_path / "SmolLM2-135M-Instruct.Q4_1.gguf"  # the name the adapter records as its base
    base.symlink_to(smollm2_path)
    code, out, err = run(capsys, "train", "demo-adapter", tmp_path / "story-lora.gguf", "--model", base)
    assert code == 0, err
    assert out.strip() == str(tmp_path / "story-lora.gguf")
    assert "random rank-8 adapter on q,v" in err
    assert hashlib.sha256((tmp_path / "story-lora.gguf").read_bytes()).hexdigest() == want


def test_demo_adapter_bad_input(capsys, tiny, tmp_path):
    base = tiny[0]
    code, _, err = run(capsys, "train", "demo-adapter", tmp_path / "a.gguf", "--model", base, "--targets", "q,nope")
    assert_clean_error(code, err, 2, "nope", hint=True)
    code, _, err = run(capsys, "train", "demo-adapter", tmp_path / "a.gguf", "--model", base, "--rank", "0")
    assert_clean_error(code, err, 2, "rank")
    code, _, err = run(capsys, "train", "demo-adapter", tmp_path, "--model", base)
    assert_clean_error(code, err, 2, "is a folder", hint=True)
    assert not (tmp_path / "a.gguf").exists()
