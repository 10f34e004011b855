"""`toy train`: stop signals at awkward moments, and what ``--resume`` says after.

The contract (``toy_cli.ui.training``'s docstring): the first SIGINT/SIGTERM
stops after the current step with a checkpoint (none when nothing was
trained yet); a second one during the stop is ignored with a line; a third
aborts, with an ``error:`` line saying which checkpoint is left, and leaves
no half-written checkpoint; ``--resume`` on a run that has no checkpoint
says why there is nothing to resume.

Every recipe (from-scratch, warm-start, lora, full) runs through the same
loop (``toy.train.steploop.StepRun._run``) and the same CLI wrapper
(``toy_cli.ui.run_training``); recipes differ only in their set-up. So the
loop is tested once per moment: the checkpoint write and the set-up on a
tiny from-scratch run, the step-0 evaluation (which only fine-tunes have)
on a LoRA run of SmolLM2; toy-vit's tests do the same for ``toy vit train``.

The moments are made deterministic by delivering real signals to this
process (``signal.raise_signal``: the handler runs before the call returns)
from inside the function that runs at that moment (as test_cli_infer.py's
Ctrl-C test does). One test sends two SIGINTs to a child process at once, as
``timeout -s INT`` does (to the process, then to its process group): the
outcome must not depend on whether the two arrive as one.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
from pathlib import Path

import pytest

from toy.train import checkpoint
from toy_testsupport.cli_helpers import run
from toy_testsupport.signals import double_sigint, signals_at

SMALL = ["--d-model", "32", "--layers", "2", "--heads", "4", "--kv-heads", "2", "--ffn", "64"]
SMALL += ["--vocab-size", "300", "--batch-size", "2", "--context", "32", "--threads", "1"]


@pytest.fixture(autouse=True)
def _main_thread_cpu(monkeypatch, tmp_path):
    assert threading.current_thread() is threading.main_thread()  # signal handlers need it
    monkeypatch.setenv("TOY_DEVICE", "cpu")
    monkeypatch.setenv("TOY_HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)


@pytest.fixture()
def corpus(capsys, tmp_path) -> Path:
    code, _, err = run(capsys, "train", "demo-corpus", tmp_path / "corpus")
    assert code == 0, err
    for p in sorted((tmp_path / "corpus").iterdir())[12:]:  # a smaller corpus keeps tokenizer training short
        p.unlink()
    return tmp_path / "corpus"


def events(run_dir: Path) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "events.jsonl").read_text().splitlines() if x.strip()]


def the_run(root: Path) -> Path:
    (run_dir,) = list(root.glob("train-*"))
    return run_dir


def test_a_stop_during_tokenizer_training_keeps_the_tokenizer(capsys, monkeypatch, corpus, tmp_path):
    import toy.train.lmrun as lmrun

    calls = signals_at(monkeypatch, lmrun, "train_bpe", 1)  # Ctrl-C while the tokenizer is trained
    code, out, err = run(capsys, "train", "from-scratch", corpus, *SMALL, "--steps", "6", "--out", tmp_path / "runs")
    assert calls and code == 130, err
    assert "stopping after this step" in err
    run_dir = the_run(tmp_path / "runs")
    assert out.strip() == str(run_dir)
    # nothing was trained, but the tokenizer cost time to make: a step-0 checkpoint keeps it
    assert "interrupted at step 0" in err and f"resume: toy train --resume {run_dir}" in err
    ck = checkpoint.load(run_dir / "checkpoints")
    assert ck.step == 0 and "tokenizer.ggml.tokens" in ck.tokenizer_metadata
    end = events(run_dir)[-1]
    assert end["kind"] == "run_end" and end["reason"] == "interrupted" and end["final_step"] == 0

    def no_second_tokenizer(*a, **k):
        raise AssertionError("--resume trained the tokenizer again")

    monkeypatch.setattr(lmrun, "train_bpe", no_second_tokenizer)
    code, out, err = run(capsys, "train", "--resume", run_dir)
    assert code == 0, err
    assert events(run_dir)[-1]["reason"] == "completed" and events(run_dir)[-1]["final_step"] == 6


def test_a_stop_during_set_up_trains_nothing_and_resume_explains(capsys, monkeypatch, corpus, tmp_path):
    import toy.train.lmrun as lmrun

    # Ctrl-C while the corpus is tokenized, with a tokenizer taken from a file (nothing costly made yet)
    code, _, err = run(capsys, "train", "from-scratch", corpus, *SMALL, "--steps", "1", "--out", tmp_path / "tok")
    assert code == 0, err
    (tok_model,) = the_run(tmp_path / "tok").glob("checkpoints/step_1.gguf")
    calls = signals_at(monkeypatch, lmrun.Tokenizer, "from_gguf", 1)
    args = ["train", "from-scratch", corpus, *SMALL, "--tokenizer", tok_model, "--steps", "50"]
    code, out, err = run(capsys, *args, "--out", tmp_path / "runs")
    assert calls and code == 130, err
    assert "stopping after this step" in err
    assert "interrupted before the first step: nothing was trained, nothing needs resuming" in err
    run_dir = the_run(tmp_path / "runs")
    assert out.strip() == str(run_dir)
    assert not list((run_dir / "checkpoints").glob("step_*"))  # no step-0 checkpoint: nothing was trained
    end = events(run_dir)[-1]
    assert end["kind"] == "run_end" and end["reason"] == "interrupted" and end["final_step"] == 0
    code, out, err = run(capsys, "train", "--resume", run_dir)
    assert code == 2 and out == "", err
    assert f"error: {run_dir}: nothing to resume: it stopped before its first step (interrupted)" in err
    assert "hint: start it again with the command that started it" in err and "Traceback" not in err


def test_a_second_signal_during_the_first_checkpoint_write_keeps_it(capsys, monkeypatch, corpus, tmp_path):
    # _crc_file runs between the model file's write and the state file's: the middle of the checkpoint
    calls = signals_at(monkeypatch, checkpoint, "_crc_file", 2)
    args = ["train", "from-scratch", corpus, *SMALL, "--steps", "4", "--save-every", "1", "--eval-every", "0"]
    code, out, err = run(capsys, *args, "--out", tmp_path / "runs")
    assert calls and code == 130, err
    assert "stopping after this step" in err
    assert "stopping: finishing the step and writing its checkpoint; press Ctrl-C again to abort without it" in err
    run_dir = the_run(tmp_path / "runs")
    assert "interrupted at step 1" in err and f"resume: toy train --resume {run_dir}" in err
    ck = checkpoint.load(run_dir / "checkpoints")  # complete and verified
    assert ck.step == 1 and (run_dir / "checkpoints" / "latest").resolve().name == "step_1.gguf"
    code, out, err = run(capsys, "train", "--resume", run_dir, "--json")
    assert code == 0, err
    assert json.loads(out)["final_step"] == 4
    assert [e["step"] for e in events(run_dir) if e["kind"] == "step"] == [1, 2, 3, 4]


def test_a_third_signal_aborts_without_a_half_written_checkpoint(capsys, monkeypatch, corpus, tmp_path):
    calls = signals_at(monkeypatch, checkpoint, "_crc_file", 3)
    args = ["train", "from-scratch", corpus, *SMALL, "--steps", "4", "--save-every", "1", "--eval-every", "0"]
    code, out, err = run(capsys, *args, "--out", tmp_path / "runs")
    assert calls and code == 130, err
    run_dir = the_run(tmp_path / "runs")
    assert "error: aborted at step 1, before the run's first checkpoint: nothing to resume" in err
    assert f"hint: run the command again to start over ({run_dir} can be deleted)" in err
    assert "Traceback" not in err and out == ""
    # the checkpoint being written was removed: no step files, no latest, no temporary files
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == []
    end = events(run_dir)[-1]
    assert end["kind"] == "run_end" and end["reason"] == "interrupted" and end["final_step"] == 1
    code, out, err = run(capsys, "train", "--resume", run_dir)
    assert code == 2
    assert "nothing to resume: it stopped at step 1 before its first checkpoint (interrupted)" in err


def test_a_third_signal_after_a_checkpoint_names_it(capsys, monkeypatch, corpus, tmp_path):
    from toy.train import steploop

    # three signals as step 2's checkpoint is written: step 1's stays the last one
    orig = steploop.StepRun.save
    seen: list[int] = []

    def save(self):
        seen.append(self.engine.step)
        if self.engine.step == 2:
            for _ in range(3):
                signal.raise_signal(signal.SIGINT)
        return orig(self)

    monkeypatch.setattr(steploop.StepRun, "save", save)
    args = ["train", "from-scratch", corpus, *SMALL, "--steps", "4", "--save-every", "1", "--eval-every", "0"]
    code, out, err = run(capsys, *args, "--out", tmp_path / "runs")
    run_dir = the_run(tmp_path / "runs")
    assert code == 130 and seen == [1, 2], err
    assert f"error: aborted at step 2 without saving it; the last checkpoint is {run_dir}" in err
    assert f"hint: go on from it: toy train --resume {run_dir}" in err
    assert checkpoint.load(run_dir / "checkpoints").step == 1


@pytest.mark.model
def test_a_stop_during_the_step0_evaluation_of_a_lora_run(capsys, monkeypatch, smollm2_path, tmp_path):
    from toy.train.demodata import write_demo_chat
    from toy.train.stepgraph import TrainEngine

    data = tmp_path / "chat.jsonl"
    write_demo_chat(data, n=80, seed=0)
    calls = signals_at(monkeypatch, TrainEngine, "eval_nll", 1)  # Ctrl-C during the first validation batch
    args = ["train", "lora", data, "-m", smollm2_path, "--steps", "5", "-b", "2", "--context", "64",
            "--max-length", "65", "--overflow", "drop", "--eval-every", "5", "--threads", "1"]  # fmt: skip
    code, out, err = run(capsys, *args, "--out", tmp_path / "runs")
    assert code == 130, err
    assert len(calls) == 1  # the evaluation stopped after its first batch
    # its progress on the same display as the steps (a line: stderr is not a terminal here)
    assert "evaluating the validation set before training: 1/" in err
    assert "interrupted before the first step: nothing was trained, nothing needs resuming" in err
    run_dir = the_run(tmp_path / "runs")
    assert not list((run_dir / "checkpoints").glob("step_*"))
    kinds = [e["kind"] for e in events(run_dir)]
    assert "step" not in kinds and "eval" not in kinds and kinds[-1] == "run_end"
    code, _, err = run(capsys, "train", "--resume", run_dir)
    assert code == 2 and "nothing to resume: it stopped before its first step" in err


def test_two_sigints_at_once_as_timeout_sends_them(tmp_path, corpus):
    """``timeout -s INT`` signals the process and then its process group: two
    SIGINTs back to back. The run must still stop with a checkpoint."""
    env = {**os.environ, "TOY_HOME": str(tmp_path / "home")}
    cmd = [sys.executable, "-m", "toy_cli", "train", "from-scratch", str(corpus), *SMALL, "--steps", "100000",
           "--save-every", "0", "--eval-every", "0"]  # fmt: skip
    code, out, err, run_dir = double_sigint(cmd, tmp_path, env)
    assert code == 130, err
    end = events(run_dir)[-1]
    assert end["reason"] == "interrupted" and "error" not in end, end
    assert checkpoint.load(run_dir / "checkpoints").step == end["final_step"] >= 3
    assert "error:" not in err


def test_resume_of_a_bundle_that_is_not_a_training_run(capsys, tmp_path):
    bundle = tmp_path / "runs" / "eval-20261206-000000-abcd"
    bundle.mkdir(parents=True)
    start = {"kind": "run_start", "t": 0, "schema": "toy/v1", "run_kind": "eval", "run_id": bundle.name}
    (bundle / "events.jsonl").write_text(json.dumps(start) + "\n" + json.dumps({"kind": "run_end", "t": 1}) + "\n")
    code, out, err = run(capsys, "train", "--resume", bundle)
    assert code == 2 and f"error: {bundle}: not a training run" in err and "nothing to resume" not in err
