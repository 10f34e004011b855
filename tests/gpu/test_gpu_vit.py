"""toy-vit training on the device against the CPU: a short run on the bundled digits.

``toy_vit.train`` (what ``toy vit train`` runs) on the digits ``toy vit demo-data`` writes, preset
``vit-micro``, 16 steps of batches of 16, augmentation on (crops, no flips: digits), an evaluation at
the end, once on the CPU and twice on the device under test. Asserted, as for the language-model
recipes (test_gpu_train.py): the two device runs give the same step losses and checkpoint tensors bit
for bit, and every step's loss is within ``RTOL`` (2e-3, relative) of the CPU's (F32 throughout: the
CPU's builds agree to float32 rounding; the device sums in another order). The largest relative
difference and the final validation accuracy on both are reported.
"""

from __future__ import annotations

import json

import pytest

from toy_testsupport.gpu import checkpoint_tensors, max_rel_diff
from toy_vit.digits import write_demo_data
from toy_vit.train import train
from toy_vit.trainconfig import ViTTrainConfig

pytestmark = pytest.mark.gpu

STEPS = 16
RTOL = 2e-3


def _events(run_dir) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "events.jsonl").read_text().splitlines() if x.strip()]


def test_vit_training_is_close_to_the_cpu_and_deterministic(gpu_device, report, tmp_path):
    data = write_demo_data(tmp_path / "digits")
    runs = {}
    for name, device in (("cpu", "cpu"), ("device", gpu_device.name), ("device-again", gpu_device.name)):
        cfg = ViTTrainConfig(
            data=str(data), preset="vit-micro", steps=STEPS, batch_size=16, lr=3e-3, warmup=2, eval_every=0,
            save_every=0, flip=False, out=str(tmp_path / name), cache_dir=str(tmp_path / "cache"), threads=2,
            device=device,
        )  # fmt: skip
        r = train(cfg)
        assert r.reason == "completed" and r.final_step == STEPS
        ev = _events(r.run_dir)
        losses = {e["step"]: e["loss"] for e in ev if e["kind"] == "step"}
        final = [e for e in ev if e["kind"] == "eval"][-1]
        runs[name] = (losses, checkpoint_tensors(r.checkpoint), final)
    (want, _, want_eval), (got, got_w, got_eval), (again, again_w, _) = runs.values()
    assert sorted(got) == list(range(1, STEPS + 1))
    assert got == again, f"two runs on {gpu_device.label} gave different losses: {got} / {again}"
    assert got_w.keys() == again_w.keys()
    for k in got_w:
        assert got_w[k].tobytes() == again_w[k].tobytes(), f"{k} differs between two device runs"
    rel = max_rel_diff(got, want)
    report("vit-micro digits: max relative loss difference to the cpu", rel, "ratio", tolerance=RTOL, steps=STEPS,
           accuracy=got_eval["accuracy"], cpu_accuracy=want_eval["accuracy"])  # fmt: skip
    assert rel <= RTOL, f"device losses {got} against the cpu's {want}"
    if gpu_device.is_cpu:
        assert got == want
