"""Resuming a ViT run from a checkpoint whose state is wrong as written
(issue 42, item 7): NaN in an optimizer moment, a moment of another shape,
a nested run config or model config. Each bad checkpoint is a real one
edited with its checksums recomputed as the writer does
(``toy_testsupport.checkpoint_edit``), so the validation on resume
(``toy.train.checkpoint.check_state``), not the integrity check, is what
refuses it: a ``CheckpointStateError`` naming the file and the tensor or
key, exit 2 with an ``error:`` line from ``toy vit train --resume``.

Before it, these resumed: NaN diverged a few steps later
(``TrainingDivergedError``), a moment of another shape failed with numpy's
shape message, a nested config named a key but not the checkpoint it came
from. Runs: a micro ViT, 2 of 4 steps, a fraction of a second each.
"""

from __future__ import annotations

import importlib.util
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest

from toy.errors import BadInputError
from toy.train import checkpoint, lmrun
from toy.train.steploop import Hooks
from toy_testsupport.checkpoint_edit import edit_checkpoint
from toy_testsupport.cli_helpers import assert_clean_error, run
from toy_vit import train as vit_train
from toy_vit.trainconfig import ViTTrainConfig

if "torch_vit" not in sys.modules:
    _spec = importlib.util.spec_from_file_location("torch_vit", Path(__file__).with_name("torch_vit.py"))
    sys.modules["torch_vit"] = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(sys.modules["torch_vit"])
import torch_vit  # noqa: E402

W = "v.blk.0.ffn_up.weight"


def _stopped_run(root: Path, **kw) -> Path:
    data = torch_vit.write_shapes_folder(root / "data", per_class=4)
    cfg = ViTTrainConfig(
        data=str(data), preset="vit-micro", steps=4, batch_size=4, lr=3e-3, warmup=1, eval_every=0, save_every=0,
        out=str(root / "runs"), cache_dir=str(root / "cache"), threads=1, val_fraction=0.0, **kw,
    )  # fmt: skip
    done: list[int] = []
    r = vit_train.train(cfg, Hooks(progress=lambda i: done.append(i["step"]), should_stop=lambda: len(done) >= 2))
    assert r.reason == "interrupted" and checkpoint.list_steps(r.run_dir / "checkpoints") == [2]
    return r.run_dir


@pytest.fixture(scope="module")
def stopped(tmp_path_factory) -> Path:
    return _stopped_run(tmp_path_factory.mktemp("vit-resume-hardening"))


@pytest.fixture
def run_dir(stopped, tmp_path) -> Path:
    return Path(shutil.copytree(stopped, tmp_path / "run", symlinks=True))


def _nan(tensors):
    tensors[f"adam_v.{W}"] = tensors[f"adam_v.{W}"].copy()
    tensors[f"adam_v.{W}"].flat[5] = np.nan


CASES = {
    "nan in a moment": (
        dict(optimizer=_nan),
        f"adam_v.{W}",
        f"tensor adam_v.{W} holds 1 non-finite value(s) (nan at flat index 5), expected finite",
    ),
    "moment of another shape": (
        dict(optimizer=lambda t: t.update({f"adam_m.{W}": np.zeros((32, 64), np.float32)})),
        f"adam_m.{W}",
        f"tensor adam_m.{W} has shape (32, 64), expected (64, 32) (the shape of parameter {W})",
    ),
    "nested run config": (
        dict(state=lambda s: s.update(config={"config": s["config"]})),
        "config.config",
        "the run config it records (config in toy.state.json) is invalid: config: unknown key",
    ),
    "nested model config": (
        dict(state=lambda s: s["model"].update(d_model={"value": 32})),
        "model",
        "the model config it records (model in toy.state.json) is invalid: d_model=",
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_wrong_state_is_refused_naming_the_tensor_or_key(run_dir, case):
    edits, field, fragment = CASES[case]
    ckpt = run_dir / "checkpoints"
    edit_checkpoint(ckpt, 2, **edits)
    assert checkpoint.load(ckpt).verified  # the checksums match: not damage
    before = (run_dir / "events.jsonl").read_bytes()
    with pytest.raises(BadInputError) as ei:
        lmrun.resume(run_dir)
    e = ei.value
    assert str(e).startswith(f"checkpoint {ckpt / 'step_2.state.gguf'}: ") and fragment in str(e), str(e)
    assert type(e).__name__ == "CheckpointStateError" and e.field == field and e.hint
    assert (run_dir / "events.jsonl").read_bytes() == before


def test_lora_run_checks_its_trained_tensors(stopped, tmp_path):
    run_dir = _stopped_run(tmp_path, lora_rank=2, base=str(stopped / "checkpoints" / "step_2.gguf"))
    ckpt = run_dir / "checkpoints"
    name = sorted(n for n in checkpoint.load(ckpt).optimizer if n.endswith(".lora_a") and n.startswith("adam_m."))[0]
    edit_checkpoint(ckpt, 2, optimizer=lambda t: t.update({name: np.ones((3, 32), np.float32)}))
    with pytest.raises(BadInputError, match=rf"tensor {name} has shape \(3, 32\), expected \(2, 32\)") as ei:
        lmrun.resume(run_dir)
    assert ei.value.field == name


def test_cli_resume_of_a_wrong_state_exits_2(run_dir, capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("TOY_HOME", str(tmp_path / "home"))
    edit_checkpoint(run_dir / "checkpoints", 2, optimizer=_nan)
    code, _, err = run(capsys, "vit", "train", "--resume", run_dir)
    assert_clean_error(code, err, 2, f"tensor adam_v.{W} holds 1 non-finite value(s)", hint=True)


def test_an_intact_state_still_resumes(run_dir):
    edit_checkpoint(run_dir / "checkpoints", 2)  # rewritten, unchanged
    r = lmrun.resume(run_dir)
    assert r.reason == "completed" and r.final_step == 4
