"""`toy vit train`: stop signals at awkward moments, and what ``--resume`` says after.

The same contract as ``toy train``'s (toy-cli's test_cli_train_signals.py,
``toy_cli.ui.training``): a second signal during a stop is ignored, a third
aborts without leaving a half-written checkpoint, a stop before the first
step trains and saves nothing, and ``--resume`` of a run without a
checkpoint says why. The moments are made deterministic by delivering real
signals to this process from inside the function that runs at that moment;
one test sends two SIGINTs to a child process at once, as ``timeout -s INT``
does (issue 41's ``timeout -s INT 6 toy vit train digits --preset
vit-micro``, which exited 130 with no message and no checkpoint).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from toy.train import checkpoint
from toy_testsupport.cli_helpers import run
from toy_testsupport.signals import double_sigint, signals_at
from toy_testsupport.vit_images import write_folder
from toy_vit.config import ViTConfig
from toy_vit.gguf_io import write_gguf
from toy_vit.train import init_params

MICRO = ["--preset", "vit-micro", "--batch-size", "4", "--threads", "1", "--eval-every", "0"]


def events(run_dir: Path) -> list[dict]:
    return [json.loads(x) for x in (Path(run_dir) / "events.jsonl").read_text().splitlines() if x.strip()]


def the_run(root: Path) -> Path:
    (run_dir,) = list(root.glob("train-*"))
    return run_dir


@pytest.fixture(autouse=True)
def _home(tmp_path, monkeypatch):
    assert threading.current_thread() is threading.main_thread()  # signal handlers need it
    monkeypatch.setenv("TOY_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("TOY_RUNS_DIR", raising=False)
    monkeypatch.chdir(tmp_path)


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    return write_folder(tmp_path_factory.mktemp("vitsig") / "data", per_class=10)


def test_a_stop_during_the_step0_evaluation_of_a_fine_tune(capsys, monkeypatch, data, tmp_path):
    import toy_vit.train as vit_train

    cfg = ViTConfig.preset("vit-micro", labels=("a", "b", "c"))
    base = write_gguf(tmp_path / "base.gguf", cfg, init_params(cfg, 1))
    calls = signals_at(monkeypatch, vit_train, "patchify", 1)  # the first validation batch (before any step)
    code, out, err = run(capsys, "vit", "train", data, "--from", base, "--steps", "5", "-b", "1", "--threads", "1",
                         "--eval-every", "5", "--no-flip")  # fmt: skip
    assert code == 130, err
    assert len(calls) == 1  # the evaluation stopped after its first batch
    assert "evaluating the validation set before training: 1/3 batches" in err  # 3 validation images, -b 1
    assert "interrupted before the first step: nothing was trained, nothing needs resuming" in err
    run_dir = the_run(tmp_path / "runs")
    assert not list((run_dir / "checkpoints").glob("step_*"))
    kinds = [e["kind"] for e in events(run_dir)]
    assert "step" not in kinds and "eval" not in kinds and kinds[-1] == "run_end"
    code, out, err = run(capsys, "vit", "train", "--resume", run_dir)
    assert code == 2 and out == ""
    assert f"error: {run_dir}: nothing to resume: it stopped before its first step (interrupted)" in err


def test_a_second_signal_during_the_first_checkpoint_write_keeps_it(capsys, monkeypatch, data, tmp_path):
    calls = signals_at(monkeypatch, checkpoint, "_crc_file", 2)  # between the model file and the state file
    code, out, err = run(capsys, "vit", "train", data, *MICRO, "--steps", "4", "--save-every", "1")
    assert calls and code == 130, err
    assert "stopping: finishing the step and writing its checkpoint; press Ctrl-C again to abort without it" in err
    run_dir = the_run(tmp_path / "runs")
    assert "interrupted at step 1" in err and f"resume: toy vit train --resume runs/{run_dir.name}" in err
    assert checkpoint.load(run_dir / "checkpoints").step == 1
    code, out, err = run(capsys, "vit", "train", "--resume", run_dir, "--json")
    assert code == 0, err
    assert json.loads(out)["final_step"] == 4


def test_a_third_signal_aborts_without_a_half_written_checkpoint(capsys, monkeypatch, data, tmp_path):
    calls = signals_at(monkeypatch, checkpoint, "_crc_file", 3)
    code, out, err = run(capsys, "vit", "train", data, *MICRO, "--steps", "4", "--save-every", "1")
    assert calls and code == 130, err
    run_dir = the_run(tmp_path / "runs")
    assert "error: aborted at step 1, before the run's first checkpoint: nothing to resume" in err
    assert "Traceback" not in err and out == ""
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == []  # nothing half-written left
    code, out, err = run(capsys, "vit", "train", "--resume", run_dir)
    assert code == 2 and "nothing to resume: it stopped at step 1 before its first checkpoint" in err


def test_two_sigints_at_once_as_timeout_sends_them(tmp_path, data):
    """``timeout -s INT`` signals the process and then its process group: two
    SIGINTs back to back. The run must stop with a checkpoint it resumes from."""
    env = {**os.environ, "TOY_HOME": str(tmp_path / "home"), "NO_COLOR": "1"}
    toy = [sys.executable, "-m", "toy_cli", "vit", "train"]
    cmd = [*toy, str(data), *MICRO, "--steps", "100000", "--save-every", "0"]
    code, out, err, run_dir = double_sigint(cmd, tmp_path, env)
    assert code == 130, err
    end = events(run_dir)[-1]
    assert end["reason"] == "interrupted" and "error" not in end, end
    step = end["final_step"]
    assert checkpoint.load(run_dir / "checkpoints").step == step >= 3
    r = subprocess.run([*toy, "--resume", str(run_dir), "--steps", str(step + 1), "--json"], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=300)  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["final_step"] == step + 1
