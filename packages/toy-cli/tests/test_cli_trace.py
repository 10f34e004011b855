"""``toy train ... --trace FILE``: the traced step's Chrome trace file, the
``trace`` event naming it, and a run whose losses are bit-identical to the
same run without a trace; ``toy infer --trace FILE``: one decode step."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

TOY = [sys.executable, "-m", "toy_cli"]
SMALL = ["--d-model", "32", "--layers", "2", "--heads", "4", "--kv-heads", "2", "--ffn", "64"]
SMALL += ["--vocab-size", "300", "--batch-size", "2", "--context", "32", "--threads", "1"]
SMALL += ["--steps", "3", "--eval-every", "0", "--save-every", "0", "--seed", "3"]


def run(args, cwd):
    e = {**os.environ, "TOY_HOME": str(cwd / "home")}
    return subprocess.run(TOY + args, cwd=cwd, env=e, capture_output=True, text=True, timeout=300)


def events(out: Path) -> list[dict]:
    (run_dir,) = [p for p in out.iterdir() if p.is_dir()]
    return [json.loads(x) for x in (run_dir / "events.jsonl").read_text().splitlines() if x.strip()]


def test_trace_flag_writes_the_step_and_changes_no_loss(tmp_path):
    r = run(["train", "demo-corpus", "corpus"], tmp_path)
    assert r.returncode == 0, r.stderr
    for p in sorted((tmp_path / "corpus").iterdir())[8:]:
        p.unlink()
    r = run(["train", "from-scratch", "corpus", *SMALL, "--out", "plain"], tmp_path)
    assert r.returncode == 0, r.stderr
    r = run(["train", "from-scratch", "corpus", *SMALL, "--out", "traced", "--trace", "t/step.json"], tmp_path)
    assert r.returncode == 0, r.stderr

    plain, traced = events(tmp_path / "plain"), events(tmp_path / "traced")
    losses = [[e["loss"] for e in evs if e["kind"] == "step"] for evs in (plain, traced)]
    assert len(losses[0]) == 3 and losses[0] == losses[1]  # bit for bit (JSON keeps every digit of a float)
    norms = [[e["grad_norm"] for e in evs if e["kind"] == "step"] for evs in (plain, traced)]
    assert norms[0] == norms[1]

    (ev,) = [e for e in traced if e["kind"] == "trace"]
    assert ev["step"] == 2  # trace_step's default
    path = Path(ev["path"]) if Path(ev["path"]).is_absolute() else tmp_path / ev["path"]
    assert path == tmp_path / "t" / "step.json"
    doc = json.loads(path.read_text())
    xs = [e for e in doc["traceEvents"] if e["ph"] == "X"]
    assert len(xs) == ev["nodes"] > 100
    assert {"MUL_MAT", "SOFT_MAX", "CROSS_ENTROPY_LOSS"} <= {e["name"] for e in xs}
    tracks = {e["args"]["name"] for e in doc["traceEvents"] if e.get("name") == "thread_name"}
    assert {"layer 0", "layer 1", "head", "optimizer"} <= tracks
    assert sum(e["dur"] for e in xs) / 1e3 == pytest.approx(ev["node_ms"], rel=1e-3, abs=1e-3)
    assert not any(e["kind"] == "trace" for e in plain)

    # toy infer --trace: one decode step of the run's checkpoint
    ckpt = next((tmp_path / "traced").glob("*/checkpoints/step_3.gguf"))
    r = run(["infer", str(ckpt), "The", "-n", "3", "--greedy", "--ignore-eos", "--trace", "dec.json"], tmp_path)
    assert r.returncode == 0, r.stderr
    assert "trace: dec.json (one decode step" in r.stderr
    doc = json.loads((tmp_path / "dec.json").read_text())
    xs = [e for e in doc["traceEvents"] if e["ph"] == "X"]
    assert doc["otherData"]["what"] == "decode step"
    tracks = {e["args"]["name"] for e in doc["traceEvents"] if e.get("name") == "thread_name"}
    assert tracks == {"embed", "layer 0", "layer 1", "head"}
    assert sum(e["name"] == "SET_ROWS" for e in xs) == 4  # K and V of 2 layers
