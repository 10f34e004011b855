"""Resuming ViT runs: a run stopped at step k (``hooks.should_stop``) and
resumed through ``toy.train.lmrun.resume`` (which dispatches on the
checkpoint's ``"task": "vit"`` to the ``toy.train_tasks`` entry point)
equals the run that never stopped, losses and final weights byte for byte;
with augmentation, accumulation, label smoothing and the fine-tunes
(freeze, LoRA) too. Refusals: a finished run, a changed base, changed data."""

from __future__ import annotations

import importlib.util
import json
import shutil
import sys
from importlib.metadata import entry_points
from pathlib import Path

import numpy as np
import pytest

from toy.errors import BadInputError
from toy.gguf import GGUFFile
from toy.train import checkpoint, lmrun
from toy.train.steploop import Hooks
from toy_vit import train as vit_train
from toy_vit.trainconfig import ViTTrainConfig

if "torch_vit" not in sys.modules:
    _spec = importlib.util.spec_from_file_location("torch_vit", Path(__file__).with_name("torch_vit.py"))
    sys.modules["torch_vit"] = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(sys.modules["torch_vit"])
import torch_vit  # noqa: E402


@pytest.fixture(scope="module")
def shapes(tmp_path_factory):
    return torch_vit.write_shapes_folder(tmp_path_factory.mktemp("shapes") / "data", per_class=20, noise=60.0)


def _cfg(data, tmp_path, **kw) -> ViTTrainConfig:
    base = dict(
        data=str(data), preset="vit-micro", steps=12, batch_size=8, lr=3e-3, warmup=2, eval_every=5, save_every=0,
        out=str(tmp_path / "runs"), cache_dir=str(tmp_path / "cache"), threads=2, val_fraction=0.2,
        crop_scale=(0.6, 1.0),
    )  # fmt: skip
    return ViTTrainConfig(**{**base, **kw})


def _stop_after(k: int) -> Hooks:
    done = []
    return Hooks(progress=lambda info: done.append(info["step"]), should_stop=lambda: len(done) >= k)


def _events(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines() if line.strip()]


def _losses(run_dir: Path) -> dict[int, float]:
    """step -> loss; a step seen twice (after a resume) counts its later event."""
    return {e["step"]: e["loss"] for e in _events(run_dir) if e["kind"] == "step"}


def _tensors(path: Path) -> dict[str, bytes]:
    with GGUFFile(path) as gf:
        return {n: np.asarray(gf.tensor_to_float(n), np.float32).tobytes() for n in gf.tensors}


def _same_run(a, b) -> None:
    la, lb = _losses(a.run_dir), _losses(b.run_dir)
    assert list(la) == list(range(1, a.final_step + 1)) and la == lb  # float equality: byte for byte
    ta, tb = _tensors(a.checkpoint), _tensors(b.checkpoint)
    assert ta.keys() == tb.keys()
    for k in ta:
        assert ta[k] == tb[k], k
    va = [(e["step"], e["loss"], e["accuracy"]) for e in _events(a.run_dir) if e["kind"] == "eval"]
    vb = [(e["step"], e["loss"], e["accuracy"]) for e in _events(b.run_dir) if e["kind"] == "eval"]
    assert va[-1] == vb[-1]


def test_the_entry_point_is_registered():
    (ep,) = [e for e in entry_points(group="toy.train_tasks") if e.name == "vit"]
    assert ep.load() is vit_train.resume_task


CASES = {
    "plain": {},
    "accum_smoothing": dict(grad_accum=2, batch_size=4, label_smoothing=0.1, flip=False),
    "no_augment": dict(augment=False),
}


@pytest.mark.parametrize("case", list(CASES))
def test_stopped_and_resumed_equals_uninterrupted(shapes, tmp_path, case):
    kw = CASES[case]
    full = vit_train.train(_cfg(shapes, tmp_path / "full", **kw))
    part = vit_train.train(_cfg(shapes, tmp_path / "part", **kw), _stop_after(7))
    assert part.reason == "interrupted" and part.final_step == 7
    ev = _events(part.run_dir)
    assert ev[-1]["kind"] == "run_end" and ev[-1]["reason"] == "interrupted"
    # the checkpoint state says which task resumes it
    ck = checkpoint.load(part.run_dir / "checkpoints")
    assert ck.step == 7 and ck.state["task"] == "vit" and ck.state["images_seen"] == 7 * 8
    assert ck.state["data"]["cursor"] == 56 - 48 and ck.state["data"]["epoch"] == 1  # 48 training images
    done = lmrun.resume(part.run_dir)  # dispatches through the entry point
    assert done.reason == "completed" and done.final_step == 12 and done.run_id == part.run_id
    kinds = [e["kind"] for e in _events(part.run_dir)]
    assert kinds.count("resume") == 1 and kinds.count("run_start") == 1 and kinds[-1] == "run_end"
    _same_run(full, done)


def test_resume_of_a_finished_run_is_refused_and_steps_extends_it(shapes, tmp_path):
    r = vit_train.train(_cfg(shapes, tmp_path, steps=4, eval_every=0))
    for _ in range(2):  # the lock is released after the refusal
        with pytest.raises(checkpoint.CheckpointError, match="already at step 4 of 4"):
            vit_train.resume(r.run_dir)
    more = vit_train.resume(r.run_dir, steps=6)
    assert more.final_step == 6 and list(_losses(r.run_dir)) == list(range(1, 7))


@pytest.fixture(scope="module")
def base_model(shapes, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("base")
    return vit_train.train(_cfg(shapes, tmp, steps=10, eval_every=0)).checkpoint


@pytest.mark.parametrize("mode", [dict(freeze=True), dict(lora_rank=2, lora_alpha=4.0)], ids=["freeze", "lora"])
def test_fine_tunes_resume_exactly(shapes, base_model, tmp_path, mode):
    base = tmp_path / "base.gguf"
    shutil.copy(base_model, base)
    kw = dict(base=str(base), lr=1e-2, **mode)
    full = vit_train.train(_cfg(shapes, tmp_path / "full", **kw))
    part = vit_train.train(_cfg(shapes, tmp_path / "part", **kw), _stop_after(5))
    assert part.final_step == 5
    done = lmrun.resume(part.run_dir)
    _same_run(full, done)
    # a base that changed is refused: the frozen tensors could not be the run's
    part2 = vit_train.train(_cfg(shapes, tmp_path / "part2", **kw), _stop_after(3))
    with open(base, "ab") as f:
        f.write(b"\0" * 32)
    with pytest.raises(BadInputError, match="the base model changed since the run started"):
        lmrun.resume(part2.run_dir)


def test_changed_data_is_refused(shapes, tmp_path):
    data = tmp_path / "data"
    shutil.copytree(shapes, data)
    part = vit_train.train(_cfg(data, tmp_path, eval_every=0), _stop_after(3))
    (data / "extra").mkdir()
    shutil.copy(next((data / "vertical").iterdir()), data / "extra" / "x.png")
    shutil.copy(next((data / "horizontal").iterdir()), data / "extra" / "y.png")
    for _ in range(2):  # and the lock is released each time
        with pytest.raises(BadInputError, match="the data changed"):
            lmrun.resume(part.run_dir)
