"""`toy eval`: logprobs, perplexity, compare and lmc through the command line.

The numbers themselves are checked in packages/toy-core/tests/test_eval.py
(NumPy reference, llama.cpp's recorded figures); here: the wiring (the CLI
prints what the library computes, and the perplexity of the real model
through the CLI equals llama.cpp's recorded figure), the run bundles, the
progress lines and every bad-input path (exit 2, ``error:`` line, no
traceback). Driven in-process through ``toy_cli.main.main``; one thread.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from toy_cli.main import main
from toy_testsupport.cli_helpers import run

FIX = Path(__file__).resolve().parents[2] / "toy-core/tests/fixtures"


@pytest.fixture(autouse=True)
def _env(monkeypatch, tmp_path):
    monkeypatch.setenv("TOY_THREADS", "1")
    monkeypatch.setenv("TOY_DEVICE", "cpu")
    monkeypatch.setenv("TOY_RUNS_DIR", str(tmp_path / "runs"))


def bad(capsys, want, *args):
    code, out, err = run(capsys, *args)
    assert code == 2, (code, err)
    assert err.startswith("error: ") and "Traceback" not in err, err
    for w in [want] if isinstance(want, str) else want:
        assert w in err, err
    return err


def events(runs: Path, run_id: str) -> list[dict]:
    return [json.loads(x) for x in (runs / run_id / "events.jsonl").read_text().splitlines()]


@pytest.mark.model
def test_logprobs_json_and_table(capsys, smollm2_path, tmp_path):
    import toy
    import toy.eval as E

    text = "The capital of France is Paris."
    code, out, err = run(capsys, "eval", "logprobs", smollm2_path, text, "--top", 3, "--json")
    assert code == 0, err
    got = json.loads(out)
    with toy.load(smollm2_path, device="cpu", threads=1) as m:
        want = E.logprobs(m, text, top_k=3).to_dict()
    assert got["tokens"] == json.loads(json.dumps(want["tokens"])) and got["nll"] == want["nll"]
    ev = events(tmp_path / "runs", got["run_id"])
    assert ev[0]["config"]["command"] == "logprobs" and ev[0]["model"]["architecture"] == "llama"
    assert ev[1] == {**ev[1], "kind": "eval", "name": "logprobs", "loss": want["nll"], "tokens": 6}
    assert ev[-1]["reason"] == "completed"
    # the table: one row per token, the summary line on stdout, the run on stderr
    (tmp_path / "t.txt").write_text(text)
    code, out, err = run(capsys, "eval", "logprobs", smollm2_path, "--file", tmp_path / "t.txt")
    assert code == 0, err
    assert "' Paris'" in out and f"PPL {want['ppl']:.4f} over 6 tokens" in out and "run: " in err


@pytest.mark.avx2_reference
@pytest.mark.model
def test_perplexity_through_the_cli_equals_llama_cpp(capsys, smollm2_path, tmp_path):
    ref = json.loads((FIX / "eval_llamacpp.json").read_text())
    sums = ref["perplexity"]["window_nll_sums"][:2]
    n = 2 * (ref["context"] - 1 - ref["context"] // 2)
    code, out, err = run(
        capsys,
        "eval",
        "perplexity",
        smollm2_path,
        FIX / "eval_text.md",
        "-c",
        ref["context"],
        "--max-chunks",
        2,
        "--json",
    )
    assert code == 0, err
    got = json.loads(out)
    assert got["n_scored"] == n and got["n_windows"] == 2 and got["n_tokens"] == ref["n_tokens"]
    assert got["ppl"] == pytest.approx(math.exp(sum(sums) / n), rel=1e-4)
    assert "perplexity: window 1/2" in err and "perplexity: window 2/2" in err  # progress lines (not a terminal)
    ev = events(tmp_path / "runs", got["run_id"])
    assert ev[1]["name"] == "perplexity" and ev[1]["ppl"] == got["ppl"] and ev[1]["context"] == ref["context"]
    code, out, _ = run(capsys, "eval", "perplexity", smollm2_path, FIX / "eval_text.md", "-c", 64, "--max-chunks", 1)
    assert code == 0 and out.startswith("PPL = ") and "+/-" in out and "1 windows of 64" in out


@pytest.mark.model
def test_compare_a_model_with_itself(capsys, smollm2_path):
    code, out, err = run(
        capsys,
        "eval",
        "compare",
        smollm2_path,
        smollm2_path,
        FIX / "eval_text.md",
        "-c",
        64,
        "--max-chunks",
        2,
        "--json",
    )
    assert code == 0, err
    got = json.loads(out)
    assert got["kl_mean"] == 0.0 and got["top1_agreement"] == 1.0 and got["ppl_a"] == got["ppl_b"]
    assert got["n_scored"] == 2 * 31


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """Two checkpoints of one tiny training run (steps 2 and 4) and one of another shape."""
    import os

    d = tmp_path_factory.mktemp("lmc")
    corpus = d / "corpus.txt"
    corpus.write_text((FIX / "eval_text.md").read_text(encoding="utf-8"))
    old = {k: os.environ.get(k) for k in ("TOY_THREADS", "TOY_DEVICE")}
    os.environ.update(TOY_THREADS="1", TOY_DEVICE="cpu")
    try:
        common = [
            "--preset",
            "tiny",
            "--vocab-size",
            "300",
            "--batch-size",
            "2",
            "--context",
            "32",
            "--eval-every",
            "0",
            "-q",
        ]
        assert (
            main(
                [
                    "train",
                    "from-scratch",
                    str(corpus),
                    *common,
                    "--steps",
                    "4",
                    "--save-every",
                    "2",
                    "--out",
                    str(d / "a"),
                ]
            )
            == 0
        )
        assert (
            main(["train", "from-scratch", str(corpus), *common, "--steps", "1", "--ffn", "64", "--out", str(d / "b")])
            == 0
        )
    finally:
        for k, v in old.items():
            os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)
    (ra,), (rb,) = list((d / "a").iterdir()), list((d / "b").iterdir())
    return {"s2": ra / "checkpoints/step_2.gguf", "s4": ra / "checkpoints/step_4.gguf",
            "other": rb / "checkpoints/step_1.gguf", "corpus": corpus}  # fmt: skip


def test_lmc_end_points_equal_each_checkpoint_s_perplexity(capsys, checkpoints, tmp_path):
    c = checkpoints
    code, out, err = run(
        capsys,
        "eval",
        "lmc",
        c["s2"],
        c["s4"],
        c["corpus"],
        "--alphas",
        "0,0.5,1",
        "-c",
        32,
        "--max-chunks",
        4,
        "--json",
    )
    assert code == 0, err
    got = json.loads(out)
    own = []
    for k in ("s2", "s4"):
        code, o, e = run(capsys, "eval", "perplexity", c[k], c["corpus"], "-c", 32, "--max-chunks", 4, "--json")
        assert code == 0, e
        own.append(json.loads(o)["nll"])
    assert [p["alpha"] for p in got["points"]] == [0.0, 0.5, 1.0]
    assert got["points"][0]["nll"] == own[0] and got["points"][2]["nll"] == own[1]
    assert got["barrier"] == pytest.approx(got["points"][1]["nll"] - (own[0] + own[1]) / 2, abs=1e-12)
    ev = events(tmp_path / "runs", got["run_id"])
    assert [e["name"] for e in ev if e["kind"] == "eval"] == ["lmc@0", "lmc@0.5", "lmc@1", "lmc"]
    code, out, err = run(capsys, "eval", "lmc", c["s2"], c["s4"], c["corpus"], "-c", 32, "--max-chunks", 1)
    assert code == 0 and "barrier:" in out and len(out.splitlines()) == 7, out


def test_lmc_shape_mismatch_names_the_field(capsys, checkpoints, tmp_path):
    c = checkpoints
    bad(capsys, ["differ in d_ff", "step_1.gguf"], "eval", "lmc", c["s2"], c["other"], c["corpus"], "-c", 32)
    # the run bundle records the failure
    (run_dir,) = (tmp_path / "runs").iterdir()
    end = events(tmp_path / "runs", run_dir.name)[-1]
    assert end["kind"] == "run_end" and end["reason"] == "errored" and "d_ff" in end["error"]


def test_bad_input_exits_2(capsys, checkpoints, tmp_path):
    c = checkpoints
    bad(capsys, "no such file", "eval", "perplexity", c["s2"], tmp_path / "missing.txt")
    bad(capsys, "not both", "eval", "logprobs", c["s2"])
    bad(capsys, "not both", "eval", "logprobs", c["s2"], "text", "--file", c["corpus"])
    bad(capsys, "at least 4", "eval", "perplexity", c["s2"], c["corpus"], "-c", 2)
    bad(capsys, "--batch 0", "eval", "perplexity", c["s2"], c["corpus"], "-b", 0)
    bad(capsys, "not a number", "eval", "lmc", c["s2"], c["s4"], c["corpus"], "--alphas", "0,half")
    bad(capsys, "smaller than the context", "eval", "perplexity", c["s2"], c["corpus"], "-c", 32, "--stride", 32)
    (tmp_path / "short.txt").write_text("a few words")
    bad(capsys, ["one window of context 32", "hint:"], "eval", "perplexity", c["s2"], tmp_path / "short.txt", "-c", 32)
    (tmp_path / "bad.jsonl").write_text('{"text": "ok"}\nnot json\n')
    bad(capsys, "bad.jsonl:2", "eval", "perplexity", c["s2"], tmp_path / "bad.jsonl", "-c", 32)
    bad(capsys, "", "eval", "perplexity", tmp_path / "nomodel.gguf", c["corpus"])
