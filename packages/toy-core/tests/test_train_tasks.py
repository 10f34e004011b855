"""Resuming dispatches on the checkpoint's task (``toy.train.lmrun.resume``):
a run whose state names a task no installed package trains is refused with
the task's name, and the run's lock is released (a second try gives the
same error, not "in use")."""

from __future__ import annotations

import numpy as np
import pytest

from toy.gguf import GGUFWriter
from toy.train import checkpoint, lmrun


def _checkpoint(run_dir, task: str):
    def write_model(path, params, step, run_id):
        w = GGUFWriter(path)
        w.add("general.architecture", "nothing")
        for name, a in params.items():
            w.add_tensor(name, a)
        w.write()

    checkpoint.save(
        run_dir / "checkpoints",
        step=2,
        cfg=None,
        params={"w": np.ones((2, 3), np.float32)},
        optimizer={"adam_m.w": np.zeros((2, 3), np.float32), "adam_v.w": np.zeros((2, 3), np.float32)},
        tokenizer_metadata={},
        state={"task": task, "config": {}},
        run_id="r1",
        write_model=write_model,
    )


def test_unknown_task_is_refused_with_its_name(tmp_path):
    run = tmp_path / "run"
    _checkpoint(run, "no-such-task")
    for _ in range(2):  # the lock is released after the refusal
        with pytest.raises(checkpoint.CheckpointError, match="no installed package trains 'no-such-task' runs"):
            lmrun.resume(run)


def test_a_missing_run_folder_is_refused(tmp_path):
    with pytest.raises(checkpoint.CheckpointError, match="no such run folder"):
        lmrun.resume(tmp_path / "nope")
