"""The default thread count follows the machine's load (issue 41): toy-vit's
training and classifier use an adaptive Runtime, which is sound only if
every bit they compute is the same with any thread count.

Expected values: the 1-thread run's step losses, evaluations and weights
(and the 1-thread classifier's logits), bit for bit, from a default Runtime
whose load sampler answers 1, 2, 1, 2, ... (one answer per compute; two
physical cores assumed, so that the default is adaptive on any machine).
"""

from __future__ import annotations

import importlib
import importlib.util
import itertools
import json
import sys
from pathlib import Path

import numpy as np
import pytest

from toy_vit.train import train
from toy_vit.trainconfig import ViTTrainConfig

if "torch_vit" not in sys.modules:
    _spec = importlib.util.spec_from_file_location("torch_vit", Path(__file__).with_name("torch_vit.py"))
    sys.modules["torch_vit"] = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(sys.modules["torch_vit"])
import torch_vit  # noqa: E402


@pytest.fixture(scope="module")
def shapes(tmp_path_factory):
    return torch_vit.write_shapes_folder(tmp_path_factory.mktemp("shapes") / "data", per_class=10, noise=60.0)


@pytest.fixture
def switching(monkeypatch):
    from toy_ggml import load

    monkeypatch.delenv("TOY_THREADS", raising=False)
    monkeypatch.setattr(importlib.import_module("toy_ggml.devices"), "physical_cores", lambda: 2)
    cycle = itertools.cycle([1, 2])
    given: list[int] = []

    def threads(n_max: int) -> int:
        given.append(next(cycle))
        return given[-1]

    monkeypatch.setattr(load.shared_sampler(), "threads", threads, raising=False)
    yield given


def _run(data: Path, out: Path, threads: int | None):
    from toy_vit.gguf_io import read_gguf

    cfg = ViTTrainConfig(
        data=str(data), preset="vit-micro", steps=6, batch_size=8, lr=3e-3, warmup=2, eval_every=3, save_every=0,
        out=str(out / "runs"), cache_dir=str(out / "cache"), threads=threads, val_fraction=0.2,
    )  # fmt: skip
    r = train(cfg)
    ev = [json.loads(x) for x in (r.run_dir / "events.jsonl").read_text().splitlines() if x.strip()]
    losses = [e["loss"] for e in ev if e["kind"] == "step"]
    evals = [(e["loss"], e["accuracy"]) for e in ev if e["kind"] == "eval"]
    weights = read_gguf(r.checkpoint)[1]
    return r.checkpoint, losses, evals, {k: v.tobytes() for k, v in weights.items()}


def test_training_switching_threads_keeps_every_bit(shapes, tmp_path, switching):
    _, *got = _run(shapes, tmp_path / "s", None)
    assert set(switching) == {1, 2}, "the default Runtime was not adaptive"
    ckpt, *want = _run(shapes, tmp_path / "o", 1)
    assert len(got[0]) == 6 and len(got[1]) == 2
    assert got == want

    import toy_vit

    with toy_vit.load(ckpt, threads=1) as clf:
        c = clf.config
        pixels = np.random.default_rng(0).random((5, c.n_channels, c.image_size, c.image_size), dtype=np.float32)
        one = clf.logits(pixels)
    switching.clear()
    with toy_vit.load(ckpt) as clf:
        assert clf.runtime.adaptive
        for _ in range(3):
            np.testing.assert_array_equal(clf.logits(pixels), one)
    assert set(switching) == {1, 2}
