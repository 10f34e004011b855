"""`toy train dpo | orpo | kto | grpo`: the preference and RL commands over
``toy.train.prefrun`` (and ``toy.train.grpo``).

Driven through ``toy_cli.main.main`` with captured stdout/stderr, on a tiny
base made here (a from-scratch checkpoint with its BPE tokenizer). What is
checked: the help lists the commands and their options; a tiny run of each
preference recipe records the flags in its config and objective (the run
bundle's run_start) and prints the JSON summary; bad flags exit 2 with an
``error:`` line and no traceback, before anything is trained.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from toy_testsupport.cli_helpers import assert_clean_error, run
from toy_testsupport.train_helpers import RECIPE_WORDS as WORDS
from toy_testsupport.train_helpers import events


@pytest.fixture(autouse=True)
def _cpu_one_thread(monkeypatch):
    monkeypatch.setenv("TOY_DEVICE", "cpu")
    monkeypatch.setenv("TOY_THREADS", "1")


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    from toy.train.config import defaults, override
    from toy.train.lmrun import train

    d = tmp_path_factory.mktemp("cli-pref")
    rng = np.random.default_rng(0)
    (d / "corpus.txt").write_text("\n".join(" ".join(rng.choice(WORDS, size=12)) + "." for _ in range(300)))
    cfg = override(
        defaults(),
        **{"data.paths": [str(d / "corpus.txt")], "tokenizer.vocab_size": 300, "steps": 2, "batch_size": 2,
           "context": 32, "eval_every": 0, "save_every": 0, "sample_tokens": 0, "out": str(d / "runs0"), "threads": 1},
    )  # fmt: skip
    base = train(cfg).checkpoint
    pairs, unpaired = [], []
    for i in range(16):
        a, b = (str(w) for w in rng.choice(WORDS, size=2, replace=False))
        pairs.append({"prompt": f"say {a}:", "chosen": f" {a} {a}.", "rejected": f" {b}."})
        unpaired.append(
            {"prompt": f"say {a}:", "completion": f" {a} {a}." if i % 2 else f" {b}.", "label": bool(i % 2)}
        )
    (d / "pairs.jsonl").write_text("".join(json.dumps(x) + "\n" for x in pairs))
    (d / "unpaired.jsonl").write_text("".join(json.dumps(x) + "\n" for x in unpaired))
    (d / "prompts.jsonl").write_text("".join(json.dumps({"prompt": f"say {w}:", "answer": w}) + "\n" for w in WORDS))
    return {"base": base, "pairs": d / "pairs.jsonl", "unpaired": d / "unpaired.jsonl", "prompts": d / "prompts.jsonl"}


TINY = ["--steps", 2, "--batch-size", 2, "--context", 32, "--eval-every", 0, "--json", "-q"]


def test_help_lists_the_commands_and_their_options(capsys):
    code, out, _ = run(capsys, "train", "--help")
    assert code == 0
    for name in ("dpo", "orpo", "kto", "grpo"):
        assert f" {name} " in out, name
    wants = {
        "dpo": ["--beta", "--loss", "--label-smoothing", "--adapter", "--rank", "--freeze"],
        "orpo": ["--lambda", "--adapter"],
        "kto": ["--beta", "--desirable-weight", "--undesirable-weight", "--adapter"],
        "grpo": ["--reward", "--reward-weight", "--group", "--max-new-tokens", "--temperature", "--epsilon",
                 "--iterations", "--scale-rewards", "--mask-truncated", "--adapter"],
    }  # fmt: skip
    for name, flags in wants.items():
        code, out, _ = run(capsys, "train", name, "--help")
        assert code == 0, name
        for f in flags:
            assert f in out, (name, f)


@pytest.mark.parametrize(
    ("recipe", "data", "flags", "config", "objective"),
    [
        ("dpo", "pairs", ["--beta", 0.2, "--loss", "ipo"], {"beta": 0.2, "loss_type": "ipo"},
         {"name": "dpo", "beta": 0.2, "loss_type": "ipo"}),
        ("dpo", "pairs", ["--loss", "robust", "--label-smoothing", 0.1, "--rank", 4],
         {"loss_type": "robust", "label_smoothing": 0.1}, {"label_smoothing": 0.1}),
        ("orpo", "pairs", ["--lambda", 0.5, "--adapter", "full"], {"orpo_lambda": 0.5}, {"name": "orpo", "lambda": 0.5}),
        ("kto", "unpaired", ["--desirable-weight", 2, "--beta", 0.3], {"desirable_weight": 2.0, "beta": 0.3},
         {"name": "kto", "beta": 0.3}),
    ],
)  # fmt: skip
def test_a_tiny_run_records_the_flags(capsys, tmp_path, work, recipe, data, flags, config, objective):
    code, out, err = run(
        capsys, "train", recipe, work[data], "--model", work["base"], *TINY, *flags, "--out", tmp_path / "runs"
    )
    assert code == 0, err
    summary = json.loads(out)
    assert summary["reason"] == "completed" and summary["final_step"] == 2
    start = events(summary["run_dir"])[0]
    assert start["recipe"] == recipe
    assert start["adapter"] == ("full" if "full" in flags else "lora")
    assert {k: start["config"]["pref"][k] for k in config} == config
    assert {k: start["objective"][k] for k in objective} == objective
    if "--rank" in flags:
        assert start["lora"]["rank"] == 4
    # the default learning rate of the kind trained (toy.train.config.RECIPE_DEFAULTS)
    assert start["config"]["optim"]["lr"] == (1e-6 if "full" in flags else 5e-5)


def test_a_tiny_grpo_run_records_the_flags_and_shows_the_reward(capsys, tmp_path, work):
    """toy train grpo end to end: the flags reach the run's config, the
    progress lines show each step's mean reward, the rollouts are written."""
    flags = ["--reward", "regex=(alpha|beta)", "--reward", "length=20", "--reward-weight", 1, "--reward-weight", 0.5]
    flags += ["--group", 2, "--max-new-tokens", 4, "--temperature", 0.8, "--beta", 0.04, "--iterations", 2]
    flags += ["--loss", "grpo", "--scale-rewards", "batch", "--steps", 2, "--batch-size", 4, "--context", 32]
    code, out, err = run(
        capsys, "train", "grpo", work["prompts"], "--model", work["base"], *flags, "--out", tmp_path / "runs"
    )
    assert code == 0, err
    steps = [ln for ln in err.splitlines() if ln.startswith("step 2/2 ")]
    assert steps and " reward " in steps[0], err
    run_dir = next((tmp_path / "runs").iterdir())
    start = events(run_dir)[0]
    g = start["config"]["grpo"]
    assert g["rewards"] == ["regex=(alpha|beta)", "length=20"] and g["reward_weights"] == [1.0, 0.5]
    assert (g["group"], g["max_new_tokens"], g["temperature"], g["beta"], g["iterations"]) == (2, 4, 0.8, 0.04, 2)
    assert (g["loss_type"], g["scale_rewards"]) == ("grpo", "batch")
    assert start["config"]["optim"]["lr"] == 1e-5  # GRPO's LoRA default (toy.train.config.RECIPE_DEFAULTS)
    assert (run_dir / "rollouts.jsonl").read_text().count("\n") == 4  # one rollout batch of 4, trained twice


@pytest.mark.parametrize(
    ("args", "fragments"),
    [
        (["--adapter", "qlora"], ["--adapter 'qlora': lora or full"]),
        (["--freeze", "embeddings"], ["--freeze is for a full fine-tune"]),
        (["--adapter", "full", "--rank", 4], ["--rank is a LoRA option"]),
        (["--loss", "nope"], ["pref.loss_type='nope'"]),
        (["--label-smoothing", 0.1], ["robust loss only"]),
        (["--beta", -1], ["pref.beta=-1.0 must be > 0"]),
    ],
)
def test_bad_flags_exit_2(capsys, tmp_path, work, args, fragments):
    out = tmp_path / "runs"
    code, _, err = run(capsys, "train", "dpo", work["pairs"], "--model", work["base"], *TINY, *args, "--out", out)
    assert_clean_error(code, err, 2, *fragments)
    assert not out.exists()  # nothing started


def test_labelled_examples_given_to_dpo_name_the_line(capsys, tmp_path, work):
    code, _, err = run(capsys, "train", "dpo", work["unpaired"], "--model", work["base"], *TINY, "--out", tmp_path)
    assert_clean_error(code, err, 2, "unpaired.jsonl:1")


def test_sigterm_saves_and_resume_finishes(tmp_path, work):
    """A real process: SIGTERM finishes the step, saves, exits 0; --resume reuses the reference cache."""
    import os
    import signal
    import subprocess
    import sys
    import time
    from pathlib import Path

    env = {**os.environ, "TOY_HOME": str(tmp_path / "home")}
    cmd = [sys.executable, "-m", "toy_cli", "train", "dpo", str(work["pairs"]), "--model", str(work["base"])]
    cmd += ["--steps", "100000", "-b", "2", "--context", "32", "--eval-every", "0", "--save-every", "0"]
    p = subprocess.Popen(cmd + ["--out", "runs"], cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)  # fmt: skip
    try:
        deadline, run_dir = time.monotonic() + 120, None
        while time.monotonic() < deadline and run_dir is None:
            dirs = list((tmp_path / "runs").glob("train-*")) if (tmp_path / "runs").exists() else []
            started = dirs and (dirs[0] / "events.jsonl").is_file()  # the folder is made before its events file
            if started and any(e["kind"] == "step" for e in events(dirs[0])):
                run_dir = dirs[0]
            time.sleep(0.2)
        assert run_dir is not None, "no step event within 120 s"
        p.send_signal(signal.SIGTERM)
        out, err = p.communicate(timeout=120)
    finally:
        if p.poll() is None:  # a failure above: no process is left behind
            p.kill()
            p.wait(timeout=30)
    assert p.returncode == 0, err
    ev = events(run_dir)
    assert ev[-1]["kind"] == "run_end" and ev[-1]["reason"] == "interrupted"
    step = ev[-1]["final_step"]
    cache = (run_dir / "reference_logps.npz").read_bytes()
    r = subprocess.run([sys.executable, "-m", "toy_cli", "train", "--resume", str(run_dir), "--steps", str(step + 2),
                        "--json", "-q"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["final_step"] == step + 2
    assert (Path(run_dir) / "reference_logps.npz").read_bytes() == cache
