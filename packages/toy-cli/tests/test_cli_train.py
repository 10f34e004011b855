"""`toy train`: the command line over toy.train (real processes).

SIGTERM in the middle of a run must leave a loadable checkpoint and a
``run_end`` event with reason "interrupted" and exit 0; ``--resume`` then
finishes the run; bad configs and data exit 2 with an ``error:`` line.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

TOY = [sys.executable, "-m", "toy_cli"]
SMALL = ["--d-model", "32", "--layers", "2", "--heads", "4", "--kv-heads", "2", "--ffn", "64"]
SMALL += ["--vocab-size", "300", "--batch-size", "2", "--context", "32", "--threads", "1"]


def run(args, cwd, env=None, timeout=300):
    e = {**os.environ, "TOY_HOME": str(cwd / "home"), **(env or {})}
    return subprocess.run(TOY + args, cwd=cwd, env=e, capture_output=True, text=True, timeout=timeout)


@pytest.fixture()
def work(tmp_path):
    r = run(["train", "demo-corpus", "corpus"], tmp_path)
    assert r.returncode == 0, r.stderr
    # a smaller corpus keeps tokenizer training short
    for p in sorted((tmp_path / "corpus").iterdir())[12:]:
        p.unlink()
    return tmp_path


def events(run_dir: Path) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "events.jsonl").read_text().splitlines() if x.strip()]


def test_from_scratch_then_json_summary(work):
    r = run(["train", "from-scratch", "corpus", *SMALL, "--steps", "3", "--eval-every", "0", "--json"], work)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["reason"] == "completed" and out["final_step"] == 3
    assert Path(work / out["checkpoint"]).is_file()
    assert "step 3/3" in r.stderr  # progress lines on stderr when it is not a terminal
    # the checkpoint's context is the training context (32): infer's default
    # budget shrinks to fit instead of refusing
    r = run(["infer", str(work / out["checkpoint"]), "The", "--greedy", "--ignore-eos", "--json"], work)
    assert r.returncode == 0, r.stderr
    res = json.loads(r.stdout)
    assert len(res["prompt_ids"]) + len(res["tokens"]) == 32


def test_sigterm_saves_and_resume_finishes(work):
    env = {**os.environ, "TOY_HOME": str(work / "home")}
    p = subprocess.Popen(
        TOY + ["train", "from-scratch", "corpus", *SMALL, "--steps", "100000", "--save-every", "0"],
        cwd=work,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 120
        run_dir = None
        while time.monotonic() < deadline:
            dirs = list((work / "runs").glob("train-*")) if (work / "runs").exists() else []
            if dirs and any(e["kind"] == "step" for e in events(dirs[0])):
                run_dir = dirs[0]
                break
            time.sleep(0.2)
        assert run_dir is not None, "no step event within 120 s"
        p.send_signal(signal.SIGTERM)
        out, err = p.communicate(timeout=120)
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode == 0, err
    ev = events(run_dir)
    assert ev[-1]["kind"] == "run_end" and ev[-1]["reason"] == "interrupted"
    step = ev[-1]["final_step"]
    assert step >= 1
    from toy.train import checkpoint

    ck = checkpoint.load(run_dir / "checkpoints")
    assert ck.step == step
    # resume to a near total: the run continues from that checkpoint and completes
    r = run(["train", "--resume", str(run_dir), "--steps", str(step + 2), "--json"], work)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["final_step"] == step + 2
    ev = events(run_dir)
    assert ev[-1]["reason"] == "completed"
    assert [e["step"] for e in ev if e["kind"] == "step"][-2:] == [step + 1, step + 2]


def test_bad_input_exits_2(work):
    (work / "bad.toml").write_text("stepz = 3\n")
    r = run(["train", "from-scratch", "corpus", "--config", "bad.toml"], work)
    assert r.returncode == 2 and "error: unknown key 'stepz'" in r.stderr
    r = run(["train", "from-scratch", *SMALL], work)
    assert r.returncode == 2 and "no training data" in r.stderr
    r = run(["train", "from-scratch", "nowhere"], work)
    assert r.returncode == 2 and "error:" in r.stderr and "nowhere" in r.stderr
    (work / "empty").mkdir()
    (work / "empty" / "a.txt").write_text("")
    r = run(["train", "from-scratch", "empty", *SMALL], work)
    assert r.returncode == 2 and "error:" in r.stderr
    r = run(["train", "from-scratch", "corpus", *SMALL, "--batch-size", "100000"], work)
    assert r.returncode == 2 and "tokens" in r.stderr
    r = run(["train", "--resume", str(work / "corpus")], work)
    assert r.returncode == 2 and "checkpoint" in r.stderr
    assert not (work / "runs").exists() or not any((work / "runs").iterdir())
