"""Fixtures of the GPU tests: every feature family run on a device, compared with the CPU.

Every module here is marked ``gpu``: ``just test`` (and CI) leaves them out, ``just test-gpu`` and
``just gpu-check`` (tools/gpu_check.py) run them.

``gpu_device``: the device under test. ``TOY_TEST_GPU_DEVICE`` when set: a device name that
``toy_ggml.devices()`` lists (any case, e.g. ``cuda0``), or ``cpu``, which rehearses the tests on a
machine without a GPU (they then compare the CPU with itself and must pass); a name that is not there
fails the test rather than skipping it, since someone asked for it. Unset: the first device that
toy_ggml reports whose kind is ``gpu``, ``igpu`` or ``accel``; without one every test skips, saying so.
The reference is always the CPU.

``report``: a figure a test measures without asserting it (CUDA's batch invariance, the largest
logit difference against the CPU, ...): one JSON object per figure, ``{"test", "figure", "value",
"unit", "device", ...}``, printed, kept in the test's ``user_properties`` (JUnit XML) and appended to
the file ``$TOY_GPU_CHECK_REPORT`` names when set (tools/gpu_check.py prints them as its records).
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass

import pytest

GPU_KINDS = ("gpu", "igpu", "accel")
ENV = "TOY_TEST_GPU_DEVICE"
REPORT_ENV = "TOY_GPU_CHECK_REPORT"
#: CPU threads of every runtime in these tests (the CPU reference, and the device runtime's CPU side)
THREADS = 2


@dataclass(frozen=True)
class DeviceUnderTest:
    name: str  # what device= takes (toy.load, TrainConfig.device, toy serve --device, ViTTrainConfig.device)
    label: str  # the ggml device name a Runtime on it reports (Runtime.device): "CUDA0", or "CPU"
    description: str  # as ggml describes it (the GPU's name)

    @property
    def is_cpu(self) -> bool:
        """A rehearsal: the CPU compared with itself."""
        return self.label == "CPU"


def find_device() -> DeviceUnderTest | str:
    """The device under test, or why there is none (the skip reason). ``pytest.fail`` for a named device
    that is not there."""
    import toy_ggml

    devs = toy_ggml.devices()
    want = os.environ.get(ENV, "").strip()
    if want:
        if want.lower() == "cpu":
            cpu = next(d for d in devs if d.kind == "cpu")
            return DeviceUnderTest("cpu", "CPU", cpu.description)
        for d in devs:
            if d.name.lower() == want.lower():
                return DeviceUnderTest(d.name, "CPU" if d.kind == "cpu" else d.name, d.description)
        pytest.fail(f"{ENV}={want!r} is not a device toy_ggml reports here: {', '.join(d.name for d in devs)}")
    for d in devs:
        if d.kind in GPU_KINDS:
            return DeviceUnderTest(d.name, d.name, d.description)
    return (
        f"no GPU device: toy_ggml reports only {', '.join(f'{d.name} ({d.kind})' for d in devs)} "
        f"(install the CUDA plugin with `just cuda`; {ENV}=cpu rehearses these tests on the CPU)"
    )


@pytest.fixture(scope="session")
def gpu_device() -> DeviceUnderTest:
    found = find_device()
    if isinstance(found, str):
        pytest.skip(found)
    return found


def _clean(v):
    if isinstance(v, float):
        return float(f"{v:.4g}") if math.isfinite(v) else None
    if isinstance(v, (list, tuple)):
        return [_clean(x) for x in v]
    if isinstance(v, dict):
        return {str(k): _clean(x) for k, x in v.items()}
    return v


@pytest.fixture
def report(request, gpu_device):
    """``report(figure, value, unit, **context)``: record one measured figure (see the module docstring)."""

    def rec(figure: str, value, unit: str, **context) -> dict:
        line = _clean(
            {
                "test": request.node.nodeid,
                "figure": figure,
                "value": value,
                "unit": unit,
                "device": gpu_device.label,
                "device_description": gpu_device.description,
                **context,
            }
        )
        request.node.user_properties.append((figure, json.dumps(line)))
        print(json.dumps(line))
        path = os.environ.get(REPORT_ENV)
        if path:
            with open(path, "a", encoding="utf-8") as f:
                f.write(json.dumps(line) + "\n")
        return line

    return rec
