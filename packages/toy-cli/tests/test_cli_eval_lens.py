"""`toy eval lens` and `toy eval cka` through the command line.

The numbers are checked against NumPy references in
packages/toy-core/tests/test_eval_lens.py; here: the CLI prints what
``toy.eval.lens`` / ``toy.eval.cka`` compute (``--json`` equals the
library's result), the text table, the run bundle, ``--lora`` and every
bad-input path (exit 2, an ``error:`` line, no traceback). In-process
through ``toy_cli.main.main``; one thread.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from toy_testsupport import tiny_archs
from toy_testsupport.cli_helpers import run

TEXT = "the cat sat on the mat"


@pytest.fixture(autouse=True)
def _env(monkeypatch, tmp_path):
    monkeypatch.setenv("TOY_THREADS", "1")
    monkeypatch.setenv("TOY_DEVICE", "cpu")
    monkeypatch.setenv("TOY_RUNS_DIR", str(tmp_path / "runs"))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("lens-cli")
    return {n: tiny_archs.write(root / f"{n}.gguf", n, seed=s) for n, s in [("llama", 0), ("gpt2", 0), ("gemma2", 0)]}


def bad(capsys, want, *args):
    code, out, err = run(capsys, *args)
    assert code == 2, (code, err)
    assert err.startswith("error: ") and "Traceback" not in err, err
    assert want in err, err
    return err


def test_lens_json_is_the_library_result(capsys, tiny, tmp_path):
    import toy
    import toy.eval as E

    code, out, err = run(capsys, "eval", "lens", tiny["gemma2"], "--text", TEXT, "--top", 2, "--json")
    assert code == 0, err
    got = json.loads(out)
    with toy.load(tiny["gemma2"], threads=1) as m:
        want = E.logit_lens(m, TEXT, top_k=2).to_dict()
    assert got["positions"] == json.loads(json.dumps(want["positions"]))
    assert got["n_layer"] == tiny_archs.N_LAYER and len(got["positions"]) == got["n_tokens"]
    ev = [json.loads(x) for x in (tmp_path / "runs" / got["run_id"] / "events.jsonl").read_text().splitlines()]
    assert ev[0]["config"]["command"] == "lens"
    kl = [e for e in ev if e.get("name", "").startswith("lens@")]
    assert [e["layer"] for e in kl] == list(range(tiny_archs.N_LAYER))
    assert kl[-1]["kl_mean"] == pytest.approx(0.0, abs=1e-9)
    assert ev[-1]["reason"] == "completed"


def test_lens_table_and_positions(capsys, tiny):
    code, out, err = run(capsys, "eval", "lens", tiny["llama"], "--text", TEXT, "--positions", "0,-1", "-k", 1)
    assert code == 0, err
    assert "LAYER" in out and "blk.0" in out and "blk.1" in out and "KL 0.000" in out
    assert "showing" not in err  # the positions asked for are all shown
    code, out, err = run(capsys, "eval", "lens", tiny["llama"], "--text", TEXT, "-k", 1)
    assert code == 0, err
    n = json.loads(run(capsys, "eval", "lens", tiny["llama"], "--text", TEXT, "--json")[1])["n_tokens"]
    assert f"showing 8 of the text's {n} positions ({n - 8}..{n - 1})" in err
    assert out.splitlines()[0].split()[0] == str(n - 8) and f"{n - 1} 't'" in out  # the header: positions
    code, out, _ = run(capsys, "eval", "lens", tiny["llama"], "--text", TEXT, "--positions", "2-3", "--json")
    assert [p["position"] for p in json.loads(out)["positions"]] == [2, 3]


def test_a_long_text_is_cut_to_max_tokens_and_the_context(capsys, tiny):
    code, out, err = run(capsys, "eval", "lens", tiny["llama"], "--text", "x" * 100, "--json")
    assert code == 0, err
    assert json.loads(out)["n_tokens"] == tiny_archs.CTX  # the model's context (64) < --max-tokens 512
    assert f"reading the first {tiny_archs.CTX} of the text's" in err
    code, out, err = run(capsys, "eval", "cka", tiny["llama"], tiny["gpt2"], "--text", "x" * 100, "-n", 10, "--json")
    assert code == 0, err
    assert json.loads(out)["n_tokens"] == 10 and "reading the first 10 of the text's" in err


def test_lens_reads_a_file(capsys, tiny, tmp_path):
    f = tmp_path / "t.txt"
    f.write_text(TEXT)
    code, a, err = run(capsys, "eval", "lens", tiny["llama"], "--file", f, "--json")
    assert code == 0, err
    code, b, err = run(capsys, "eval", "lens", tiny["llama"], "--text", TEXT, "--json")
    assert json.loads(a)["positions"] == json.loads(b)["positions"]


def test_lens_applies_a_lora_adapter(capsys, tiny, tmp_path):
    from toy.adapters import save_adapter

    rng = np.random.default_rng(0)
    d, r = tiny_archs.D_MODEL, 2
    pairs = {
        f"blk.{i}.attn_v.weight": (
            (rng.standard_normal((r, d)) * 0.3).astype(np.float32),
            (rng.standard_normal((tiny_archs.N_HEAD_KV * tiny_archs.HEAD_DIM, r)) * 0.3).astype(np.float32),
        )
        for i in range(tiny_archs.N_LAYER)
    }
    adapter = save_adapter(tmp_path / "a.gguf", architecture="llama", pairs=pairs, alpha=4.0, rank=r)
    _, plain, _ = run(capsys, "eval", "lens", tiny["llama"], "--text", TEXT, "--json")
    code, adapted, err = run(capsys, "eval", "lens", tiny["llama"], "--text", TEXT, "--lora", adapter, "--json")
    assert code == 0, err
    assert json.loads(plain)["positions"] != json.loads(adapted)["positions"]
    bad(capsys, "is a LoRA adapter, not a model", "eval", "lens", adapter, "--text", TEXT)


def test_cka_json_and_table(capsys, tiny):
    import toy
    import toy.eval as E

    code, out, err = run(capsys, "eval", "cka", tiny["llama"], tiny["gpt2"], "--text", TEXT, "--json")
    assert code == 0, err
    got = json.loads(out)
    with toy.load(tiny["llama"], threads=1) as a, toy.load(tiny["gpt2"], threads=1) as b:
        want = E.layer_cka(a, b, TEXT)
    np.testing.assert_array_equal(np.array(got["matrix"]), want.matrix)
    assert got["layers_a"] == got["layers_b"] == tiny_archs.N_LAYER and got["diagonal"] == want.diagonal
    code, out, err = run(capsys, "eval", "cka", tiny["llama"], tiny["llama"], "--text", TEXT)
    assert code == 0, err
    rows = [line.split() for line in out.splitlines()]
    assert rows[0] == ["A", "\\", "B", "blk.0", "blk.1"]
    assert rows[1][0] == "blk.0" and rows[1][1] == "1.000" and rows[2][:1] + rows[2][2:] == ["blk.1", "1.000"]
    assert "mean CKA of layer i with layer i: 1.0000" in out


def test_cka_of_a_deep_model_lists_each_layers_best_match(capsys, tmp_path):
    from toy_testsupport.toy_test_models import write_ascii_tiny_model

    deep = write_ascii_tiny_model(tmp_path / "deep.gguf", d=32, n_head=4, n_layer=13, seed=1)
    shallow = write_ascii_tiny_model(tmp_path / "shallow.gguf", d=32, n_head=4, n_layer=3, seed=2)
    code, out, err = run(capsys, "eval", "cka", shallow, deep, "--text", TEXT, "--json")
    assert code == 0, err
    m = np.array(json.loads(out)["matrix"])
    assert m.shape == (3, 13) and json.loads(out)["diagonal"] is None
    code, out, err = run(capsys, "eval", "cka", shallow, deep, "--text", TEXT)
    assert code == 0, err
    rows = [line.split() for line in out.splitlines()]
    assert rows[0] == ["A", "same", "B", "best", "B", "CKA"]
    for i in range(3):
        j = int(m[i].argmax())
        assert rows[i + 1] == [f"blk.{i}", f"{m[i, i]:.3f}", f"blk.{j}", f"{m[i, j]:.3f}"]
    assert "3 layers of A x 13 of B" in out and "mean CKA" not in out


@pytest.mark.parametrize("command", ["lens", "cka"])
def test_ctrl_c_exits_130_and_the_run_says_interrupted(capsys, tiny, tmp_path, monkeypatch, command):
    import toy.eval as E

    def stop(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(E, {"lens": "logit_lens", "cka": "layer_cka"}[command], stop)
    models = [tiny["llama"]] * (2 if command == "cka" else 1)
    code, out, err = run(capsys, "eval", command, *models, "--text", TEXT)
    assert code == 130 and f"{command}: interrupted: no result was recorded" in err, err
    (bundle,) = (tmp_path / "runs").iterdir()
    last = json.loads((bundle / "events.jsonl").read_text().splitlines()[-1])
    assert last["kind"] == "run_end" and last["reason"] == "interrupted"


def test_bad_inputs(capsys, tiny, tmp_path):
    bad(capsys, "give --text or --file", "eval", "lens", tiny["llama"])
    bad(capsys, "give --text or --file", "eval", "cka", tiny["llama"], tiny["llama"], "--text", "a", "--file", "x")
    bad(capsys, "outside the text's", "eval", "lens", tiny["llama"], "--text", "ab", "--positions", "5")
    bad(capsys, "not an integer", "eval", "lens", tiny["llama"], "--text", "ab", "--positions", "x")
    bad(capsys, "no such file", "eval", "lens", tiny["llama"], "--file", tmp_path / "missing.txt")
    bad(capsys, "--top -1", "eval", "lens", tiny["llama"], "--text", "ab", "--top", -1)
    bad(capsys, "--max-tokens 0", "eval", "lens", tiny["llama"], "--text", "ab", "--max-tokens", 0)
    other = tiny_archs.write(Path(tmp_path) / "v.gguf", "llama")
    from toy.gguf import GGUFFile, GGUFWriter

    with GGUFFile(other) as f:  # the same model with one token renamed
        w = GGUFWriter(tmp_path / "renamed.gguf")
        for k, v in f.metadata.items():
            if k == "tokenizer.ggml.tokens":
                v = [*v[:-1], "zz"]
            w.add(k, v, f.types[k])
        for name in f.tensors:
            w.add_tensor(name, f.tensor_to_float(name))
        w.write()
    bad(capsys, "vocabularies differ", "eval", "cka", tiny["llama"], tmp_path / "renamed.gguf", "--text", TEXT)
