"""`toy runs show RUN --rollouts [--step N]` on a hand-written GRPO run
bundle (events.jsonl + rollouts.jsonl): the step's completions grouped by
prompt with their rewards and errors, --json, a repeated record (a resumed
run writes a rollout batch again) shown once, and clear errors."""

from __future__ import annotations

import json

import pytest

from toy_testsupport.cli_helpers import assert_clean_error, run

RUN = "train-20260105-000000-dddd"


def rec(step, rollout, row, prompt_index, sample, completion, reward, adv, errors=()):
    return {
        "step": step, "rollout": rollout, "row": row, "prompt_index": prompt_index, "sample": sample,
        "source": "/data/p.jsonl", "line": prompt_index + 1, "prompt": f"question {prompt_index}",
        "completion": completion, "tokens": 5, "finish": "stop", "seed": 7,
        "rewards": {"exact_answer": reward, "length": None}, "reward": reward, "advantage": adv,
        "errors": list(errors),
    }  # fmt: skip


@pytest.fixture
def root(tmp_path, monkeypatch):
    monkeypatch.delenv("TOY_RUNS_DIR", raising=False)
    monkeypatch.chdir(tmp_path)
    d = tmp_path / "runs" / RUN
    d.mkdir(parents=True)
    (d / "config.json").write_text(json.dumps({"recipe": "grpo"}))
    start = {"kind": "run_start", "t": 0.0, "schema": "toy/v1", "run_id": RUN, "run_kind": "train", "recipe": "grpo"}
    steps = [{"kind": "step", "t": float(n), "step": n, "loss": 0.1, "lr": 1e-3} for n in (1, 2, 3, 4)]
    (d / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in [start, *steps]))
    lines = [
        rec(1, 0, 0, 3, 0, "it is 4", 1.0, 0.87),
        rec(1, 0, 1, 3, 1, "it is 5", 0.0, -0.87, [{"reward": "mine:f", "error": "ValueError: bad"}]),
        rec(3, 1, 0, 8, 0, "twelve", 0.0, 0.0),
        rec(3, 1, 1, 8, 1, "12", 1.0, 0.7),
        rec(3, 1, 1, 8, 1, "12", 1.0, 0.7),  # the same record again (a resumed run)
    ]
    (d / "rollouts.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines) + '{"torn')
    return d


def test_show_rollouts_of_the_last_step(root, capsys):
    code, out, err = run(capsys, "runs", "show", RUN, "--rollouts")
    assert code == 0, err
    assert out.splitlines()[0] == f"run {RUN}: step 3, 2 completions (rollout 1), mean reward 0.5000"
    assert 'prompt "question 8" (/data/p.jsonl:9)' in out
    assert '[1] reward 1 (adv +0.700; exact_answer=1, length=none) 5 tokens, stop: "12"' in out
    assert out.count('"12"') == 1


def test_show_rollouts_of_a_step_and_its_errors(root, capsys):
    code, out, err = run(capsys, "runs", "show", RUN, "--step", "2")  # trained on the batch made for step 1
    assert code == 0, err
    assert "step 2 (rollouts made for step 1)" in out
    assert "error in mine:f: ValueError: bad" in out
    code, out, err = run(capsys, "runs", "show", RUN, "--rollouts", "--step", "1", "--json")
    assert code == 0, err
    doc = json.loads(out)
    assert doc["step"] == 1 and [r["completion"] for r in doc["rollouts"]] == ["it is 4", "it is 5"]


def test_show_rollouts_errors(root, tmp_path, capsys):
    (root / "rollouts.jsonl").rename(root / "kept.jsonl")
    code, out, err = run(capsys, "runs", "show", RUN, "--rollouts")
    assert_clean_error(code, err, 2, "no rollouts.jsonl")
    (root / "kept.jsonl").rename(root / "rollouts.jsonl")
    code, out, err = run(capsys, "runs", "show", RUN, "--rollouts", "--step", "1", "--runs-dir", tmp_path / "runs")
    assert code == 0, err


def test_show_draws_the_reward_curves(root, capsys):
    """A GRPO run's summary: the rollouts' mean reward per step and the
    held-out reward of each evaluation as curves (its evaluations have no
    loss, so no empty validation-loss curve)."""
    ev = root / "events.jsonl"
    steps = [{"kind": "step", "t": 5.0 + n, "step": n, "loss": 0.0, "lr": 1e-3, "reward_mean": r}
             for n, r in ((5, 0.25), (6, 0.75))]  # fmt: skip
    evals = [{"kind": "eval", "t": 9.0 + s, "step": s, "name": "val_reward", "reward": r, "accuracy": r, "prompts": 4}
             for s, r in ((0, 0.25), (6, 0.5))]  # fmt: skip
    ev.write_text(ev.read_text() + "".join(json.dumps(e) + "\n" for e in [*steps, *evals]))
    code, out, err = run(capsys, "runs", "show", RUN)
    assert code == 0, err
    lines = {
        ln.split()[0] + (" " + ln.split()[1] if ln.startswith("val reward") else ""): ln
        for ln in out.splitlines()
        if ln.strip()
    }
    assert "first 0.2500 @5, last 0.7500 @6" in lines["reward"]
    assert "first 0.2500 @0, last 0.5000 @6" in lines["val reward"]
    assert "val_reward" not in lines and "(no values)" not in out
