"""tools/gpu_check.py's machinery, without a GPU: phases bounded in time and recorded whatever happens,
one JSON record per line, the JUnit summary the tests' records take their status from, and the CMake
options of the llama.cpp CUDA peer.

The whole check is rehearsed on the CPU by ``just gpu-check --device cpu --skip-setup --skip-build
--quick`` (minutes: it runs the gpu tests and the benchmarks); these tests cover what that run cannot
make fail on purpose. References: the records are read back from stdout and from records.jsonl; the
JUnit file is written here by hand in pytest's format.
"""

from __future__ import annotations

import importlib.util
import json
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def gc():
    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "tools/gpu_check.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look the module up
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture
def check(gc, tmp_path, monkeypatch):
    monkeypatch.setitem(gc.CAPS, "tests", 30)
    return gc.Check(tmp_path / "out", budget=60)


def _stdout_records(capsys) -> list[dict]:
    return [json.loads(ln) for ln in capsys.readouterr().out.splitlines()]


def test_phases_are_recorded_ok_failed_and_timed_out(gc, check, capsys, monkeypatch):
    py = sys.executable
    ok, _ = gc.run_phase(check, "tests", [py, "-c", "print('fine')"])
    assert ok
    bad, log = gc.run_phase(check, "tests", [py, "-c", "import sys; print('the reason'); sys.exit(3)"])
    assert not bad and "the reason" in log.read_text()
    monkeypatch.setitem(gc.CAPS, "tests", 2)
    monkeypatch.setattr(gc, "MIN_PHASE_S", 1)
    t0 = time.monotonic()
    late, _ = gc.run_phase(check, "tests", [py, "-c", "import time; print('started', flush=True); time.sleep(60)"])
    assert not late and time.monotonic() - t0 < 20  # killed at its limit, not waited for
    missing, _ = gc.run_phase(check, "tests", ["/nonexistent/program"])
    assert not missing
    recs = _stdout_records(capsys)
    assert [r["status"] for r in recs] == ["ok", "failed", "timeout", "failed"]
    for r in recs:
        assert r["check"] == "gpu-check" and r["phase"] == "tests" and r["figure"] == "phase tests"
        assert r["unit"] == "s" and r["value"] == r["elapsed_s"] and r["elapsed_s"] >= 0
    assert recs[0]["limit_s"] == 30 and recs[0].get("reason") is None
    assert recs[1]["reason"].startswith("exit status 3") and "the reason" in recs[1]["reason"]
    assert recs[2]["limit_s"] == 2 and "still running after 2 s" in recs[2]["reason"] and "started" in recs[2]["reason"]
    assert "/nonexistent/program" in recs[3]["reason"]
    # the same records, in order, in records.jsonl
    kept = [json.loads(ln) for ln in check.records_file.read_text().splitlines()]
    assert kept == recs


def test_a_phase_past_the_budget_is_skipped_and_the_summary_fails_on_a_failed_phase(gc, tmp_path, capsys):
    ck = gc.Check(tmp_path / "out", budget=5)  # less than MIN_PHASE_S
    ok, _ = gc.run_phase(ck, "tests", [sys.executable, "-c", "pass"])
    assert not ok and ck.status == {"tests": "skipped"}
    assert gc.summary(ck, 0) == 0  # skipped is not failed
    ck.status["bench-infer"] = "timeout"
    assert gc.summary(ck, 0) == 1
    recs = _stdout_records(capsys)
    assert recs[0]["status"] == "skipped" and "budget" in recs[0]["reason"]
    first, last = recs[1], recs[2]
    assert first["figure"] == "gpu check total" and first["status"] == "ok" and first["target_s"] == 600
    assert last["status"] == "failed" and last["failed_phases"] == ["bench-infer"]
    assert last["phases"] == {"tests": "skipped", "bench-infer": "timeout"}


def test_context_fields_join_every_later_record(gc, check, capsys):
    check.context.update(device="CUDA0", gpu="NVIDIA H100")
    check.emit("bench-infer", {"figure": "decode tokens/s Q4_1", "value": 1.0, "unit": "tokens/s", "device": "X"})
    (rec,) = _stdout_records(capsys)
    assert rec["device"] == "X" and rec["gpu"] == "NVIDIA H100"  # a record's own field wins
    assert rec["phase"] == "bench-infer" and isinstance(rec["t"], float)


JUNIT = """<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest" tests="4">
<testcase classname="tests.gpu.test_a" name="test_ok[Q4_1]" time="1.0" />
<testcase classname="tests.gpu.test_a" name="test_bad" time="1.0"><failure message="AssertionError: off by 3&#10;more">x</failure></testcase>
<testcase classname="tests.gpu.test_b" name="test_skip" time="0.0"><skipped type="pytest.skip" message="no GPU device: ...">s</skipped></testcase>
<testcase classname="packages.toy-ggml.tests.test_c" name="test_err" time="0.1"><error message="fixture broke">e</error></testcase>
</testsuite></testsuites>"""


def test_junit_summary_counts_and_maps_node_ids(gc, tmp_path):
    p = tmp_path / "junit.xml"
    p.write_text(JUNIT)
    s = gc.junit_summary(p)
    assert (s["passed"], s["failed"], s["errors"], s["skipped"]) == (1, 1, 1, 1)
    assert s["failures"] == [
        {"test": "tests/gpu/test_a.py::test_bad", "message": "AssertionError: off by 3"},
        {"test": "packages/toy-ggml/tests/test_c.py::test_err", "message": "fixture broke"},
    ]
    assert s["skip_reasons"] == ["no GPU device: ..."]
    assert s["outcomes"] == {
        "tests/gpu/test_a.py::test_ok[Q4_1]": "ok",
        "tests/gpu/test_a.py::test_bad": "failed",
        "tests/gpu/test_b.py::test_skip": "skipped",
        "packages/toy-ggml/tests/test_c.py::test_err": "failed",
    }
    assert gc.junit_summary(tmp_path / "absent.xml")["passed"] == 0


def test_json_lines_keeps_only_json_objects(gc):
    text = 'progress\n{"figure": "a", "value": 1}\n{not json\n  {"indented": 1}\n{"b": 2}\n'
    assert gc.json_lines(text) == [{"figure": "a", "value": 1}, {"b": 2}]


def test_peer_cmake_options_take_cublas_from_the_wheel_when_the_toolkit_has_none(gc, tmp_path, monkeypatch):
    cuda = tmp_path / "cuda"
    (cuda / "bin").mkdir(parents=True)
    (cuda / "lib64").mkdir()
    (cuda / "include").mkdir()
    (cuda / "include" / "cuda_runtime.h").write_text("")
    nvcc = cuda / "bin" / "nvcc"
    nvcc.write_text("")
    wrapper = tmp_path / "elsewhere" / "nvcc"  # a script on PATH that runs the toolkit's nvcc
    wrapper.parent.mkdir()
    wrapper.write_text(f'#!/bin/sh\nexec {nvcc} "$@"\n')
    site = tmp_path / "site"
    inc = site / "nvidia" / "cu13" / "include"
    inc.mkdir(parents=True)
    for h in ("cublas_v2.h", "cublasLt.h", "cuda_runtime.h"):
        (inc / h).write_text("")
    monkeypatch.delenv("CUDA_HOME", raising=False)
    monkeypatch.setenv("CUDA_PATH", str(cuda))
    args, libdirs = gc.peer_cmake_args("90", str(wrapper), site, tmp_path / "links")
    assert f"-DCMAKE_CUDA_COMPILER={nvcc}" in args  # the toolkit's nvcc, not the wrapper
    assert "-DGGML_CUDA=ON" in args and "-DGGML_CUDA_NO_VMM=ON" in args and "-DCMAKE_CUDA_ARCHITECTURES=90" in args
    assert f"-DCUDA_cublas_LIBRARY={site}/nvidia/cu13/lib/libcublas.so.13" in args
    assert f"-DCMAKE_CUDA_FLAGS=-I{tmp_path / 'links'}" in args
    assert sorted(p.name for p in (tmp_path / "links").iterdir()) == ["cublasLt.h", "cublas_v2.h"]  # not cudart's
    assert libdirs == [f"{site}/nvidia/cu13/lib", f"{cuda}/lib64"]
    (cuda / "lib64" / "libcublas.so.13").write_text("")  # a toolkit with cuBLAS: nothing from the wheel
    args, libdirs = gc.peer_cmake_args("90", str(nvcc), site, tmp_path / "links2")
    assert not any("cublas" in a for a in args) and libdirs == [f"{cuda}/lib64"]
