"""Devices, runtime choice, thread defaults, build record and the type enum."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

import toy_ggml as tg
from toy_ggml import _core


def test_every_enum_member_matches_ggml_type_name():
    for t in tg.GGMLType:
        name, blck, size, _quant, _ = _core.type_info(int(t))
        assert name.upper() == t.name, (t, name)
        assert blck >= 1 and size >= 1
    # and every type ggml knows is in the enum
    known = {int(t) for t in tg.GGMLType}
    for i in range(_core.type_count()):
        try:
            _core.type_info(i)
        except ValueError:
            continue  # a removed id
        assert i in known, f"ggml type {i} missing from GGMLType"


def test_public_type_info_is_ggmls_traits():
    """``toy_ggml.type_info`` (what toy's GGUF reader and writer use) names ggml's traits
    and takes a member, an id or a name."""
    for t in tg.GGMLType:
        assert tuple(tg.type_info(t)) == _core.type_info(int(t))
    q = tg.type_info("q4_k")
    assert (q.name, q.block_size, q.type_size, q.is_quantized) == ("q4_K", 256, 144, True)
    assert tg.type_info(0) == tg.type_info(tg.GGMLType.F32)
    assert (tg.type_info(tg.GGMLType.F32).block_size, tg.type_info(tg.GGMLType.F32).type_size) == (1, 4)
    with pytest.raises(ValueError, match="unknown ggml type id 4"):
        tg.type_info(4)


def test_ggmltype_parse():
    assert tg.GGMLType.parse("q8_0") is tg.GGMLType.Q8_0
    assert tg.GGMLType.parse(1) is tg.GGMLType.F16
    with pytest.raises(ValueError, match="unknown ggml type 'Q9'"):
        tg.GGMLType.parse("Q9")
    with pytest.raises(ValueError, match="unknown ggml type id 4"):
        tg.GGMLType.parse(4)  # removed from ggml


def test_devices_include_the_cpu():
    devs = tg.devices()
    cpu = [d for d in devs if d.kind == "cpu"]
    assert cpu and cpu[0].name == "CPU"
    assert all(isinstance(d.memory_total, int) for d in devs)


def test_runtime_auto_and_cpu_pick_a_device():
    with tg.Runtime("cpu", threads=1) as rt:
        assert rt.device == "CPU" and rt.backends == ["CPU"]
    with tg.Runtime("auto", threads=1) as rt:
        gpus = [d for d in tg.devices() if d.kind in ("gpu", "igpu")]
        assert rt.device == (gpus[0].name if gpus else "CPU")
        assert rt.backends[-1] == "CPU"  # the CPU is always the fallback


def test_runtime_device_name_is_case_insensitive():
    with tg.Runtime("cpu", threads=1) as rt:
        assert rt.device == "CPU"
    with pytest.raises(ValueError, match="unknown device 'nope'; available: CPU"):
        tg.Runtime("nope")


def test_resolve_device_precedence(monkeypatch):
    monkeypatch.delenv("TOY_DEVICE", raising=False)
    assert tg.resolve_device(None) == "auto"
    monkeypatch.setenv("TOY_DEVICE", "cpu")
    assert tg.resolve_device(None) == "cpu"
    assert tg.resolve_device("CUDA0") == "CUDA0"


def test_default_threads(monkeypatch):
    monkeypatch.delenv("TOY_THREADS", raising=False)
    n = tg.default_threads()
    assert n == tg.physical_cores() >= 1
    monkeypatch.setenv("TOY_THREADS", "3")
    assert tg.default_threads() == 3
    monkeypatch.setenv("TOY_THREADS", "zero")
    with pytest.raises(ValueError, match="TOY_THREADS"):
        tg.default_threads()


def test_threads_give_identical_results(rng):
    # the thread count changes the split of work, never the numbers (F32 matmul rows are independent)
    w = rng.standard_normal((64, 96)).astype(np.float32)
    x = rng.standard_normal((7, 96)).astype(np.float32)
    outs = []
    for threads in (1, 2):
        with tg.Runtime("cpu", threads=threads) as rt, tg.Context() as ctx:
            a = ctx.tensor(tg.GGMLType.F32, w.shape)
            b = ctx.tensor(tg.GGMLType.F32, x.shape)
            y = ctx.mul_mat(a, b)
            g = tg.Graph(ctx).build_forward(y)
            ctx.allocate(rt)
            a.set(w)
            b.set(x)
            rt.compute(g)
            outs.append(y.numpy())
    np.testing.assert_array_equal(outs[0], outs[1])
    np.testing.assert_allclose(outs[0], x @ w.T, rtol=1e-4, atol=1e-4)


def test_build_config_records_the_patch_set():
    cfg = tg.build_config
    assert cfg.BACKEND in ("cpu", "cuda", "metal")
    assert cfg.GGML_VERSION == "0.25.3" == tg.GGML_VERSION
    patches_dir = Path(__file__).resolve().parents[1] / "patches"
    assert list(cfg.PATCHES) == sorted(p.name for p in patches_dir.glob("*.patch"))
    stamp = json.loads((Path(__file__).resolve().parents[1] / "subprojects/ggml/.toy-stamp.json").read_text())
    assert cfg.SOURCE == stamp["source"] == "llama-cpp-python==0.3.36"
