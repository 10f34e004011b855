#!/usr/bin/env python3
"""The GPU check (``just gpu-check``): build, test and benchmark toy on this machine's GPU in one run.

Made for a machine with an NVIDIA GPU, 16 cores and a clean checkout: about 10 minutes in all
(docs/reference/gpu-check.md has the phases' times and the record format). Every phase is bounded in
time; one that fails or runs out of time is recorded with the end of its log, and the check goes on
with what does not depend on it. Output: one JSON object per line on stdout, one per figure (also
kept in ``build/gpu-check/records.jsonl``); progress on stderr; each phase's log in
``build/gpu-check/logs/``.

Phases, in order:

1. ``setup``: ``python3 tools/setup_env.py`` (the dev venv and toy-ggml's CPU build, with
   ``TOY_GGML_JOBS`` = ``--jobs``);
2. ``gpu``: ``nvidia-smi``: the GPU's name, driver and compute capability (the archs to build for,
   unless ``--archs`` names them);
3. ``cuda``: ``just cuda --archs <cc> --jobs N``: the CUDA plugin built and installed into .venv;
   ``peer-build`` starts at the same time, in the background: llama.cpp built for CUDA from the sdist
   toy's ggml comes from (``llama-cpp-python==0.3.36``, the file tools/fetch_ggml.py keeps), for the
   same archs, with the plugin's CUDA options (no VMM), into the venv ``build/gpu-check/llama-cuda``
   (reused while the sdist, the archs and the options are the same);
4. ``devices``: which devices toy_ggml reports now and what the plugin loader says; the device under
   test is the first GPU (or ``--device``);
5. ``tests``: ``pytest -m gpu`` (tests/gpu/ and every gpu-marked module under packages/*/tests) with
   ``TOY_TEST_GPU_DEVICE`` set to that device; the figures the tests report become records;
6. ``bench-infer``: prefill and decode tokens/s, toy on the device against llama.cpp with every layer
   on the device (tools/gpu_bench.py ``infer``), once ``peer-build`` is done;
7. ``bench-train``: a training step, toy on the device against PyTorch on the device, same weights,
   PyTorch in float32 and under bf16 autocast (tools/gpu_bench.py ``train``);
8. ``summary``: the total time and every phase's status.

``--device cpu`` runs the same flow on the CPU (a rehearsal for machines without a GPU: no nvidia-smi,
no CUDA builds; the tests compare the CPU with itself; the benchmarks run toy, llama.cpp and PyTorch
on the CPU). ``--skip-setup`` and ``--skip-build`` use the environment as it is (the plugin installed,
the peer from ``--llama-python`` or an earlier build). ``--quick`` shortens the benchmarks.
``--budget`` (default 600 s) bounds the whole run: a phase gets at most what is left of it.

Exit status: 0 when every phase that ran succeeded, 1 otherwise (the records say which failed).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PY = ROOT / ".venv" / "bin" / "python"
SDIST = ROOT / "packages" / "toy-ggml" / "subprojects" / "packagecache" / "llama_cpp_python-0.3.36.tar.gz"
TARGET_S = 600  # the bound for the whole check on a 16-core GPU machine
MIN_PHASE_S = 15  # a phase with less than this left of the budget is skipped
# each phase's own cap in seconds (the budget may cut it shorter)
CAPS = {
    "setup": 300,
    "gpu": 30,
    "cuda-deps": 120,
    "cuda": 420,
    "peer-build": 480,
    "devices": 60,
    "tests": 300,
    "bench-infer": 240,
    "bench-train": 180,
}
# what the llama.cpp peer's venv needs besides the sdist (its build backend and runtime dependencies)
PEER_REQUIREMENTS = ["scikit-build-core[pyproject]>=0.9.2", "cmake>=3.21", "ninja", "numpy", "typing-extensions",
                     "diskcache", "jinja2"]  # fmt: skip


def log(msg: str) -> None:
    print(f"gpu-check: {msg}", file=sys.stderr, flush=True)


@dataclass
class Check:
    """The run's state: where records and logs go, the budget, what is known so far."""

    out: Path
    budget: float
    t0: float = field(default_factory=time.monotonic)
    records: list[dict] = field(default_factory=list)
    status: dict[str, str] = field(default_factory=dict)
    context: dict = field(default_factory=dict)  # device, gpu: added to every record once known

    def __post_init__(self) -> None:
        (self.out / "logs").mkdir(parents=True, exist_ok=True)
        self.records_file = self.out / "records.jsonl"
        self.records_file.write_text("")

    def left(self) -> float:
        return self.budget - (time.monotonic() - self.t0)

    def limit(self, phase: str) -> float:
        return min(CAPS[phase], self.left())

    def emit(self, phase: str, rec: dict) -> dict:
        rec = {"check": "gpu-check", "phase": phase, **rec, **{k: v for k, v in self.context.items() if k not in rec}}
        rec["t"] = round(time.monotonic() - self.t0, 1)
        line = json.dumps(rec)
        print(line, flush=True)
        with open(self.records_file, "a") as f:
            f.write(line + "\n")
        self.records.append(rec)
        return rec

    def phase_record(self, phase: str, status: str, elapsed: float, limit: float | None, **extra) -> dict:
        self.status[phase] = status
        log(f"{phase}: {status} ({elapsed:.0f} s)" + (f": {extra['reason']}" if extra.get("reason") else ""))
        return self.emit(
            phase,
            {"figure": f"phase {phase}", "value": round(elapsed, 1), "unit": "s", "status": status,
             "elapsed_s": round(elapsed, 1), "limit_s": None if limit is None else round(limit), **extra},
        )  # fmt: skip

    def skip(self, phase: str, reason: str) -> None:
        self.phase_record(phase, "skipped", 0.0, None, reason=reason)


def tail(path: Path, lines: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def start(cmd: list[str], logfile: Path, env: dict | None = None, stdout: Path | None = None) -> subprocess.Popen:
    """``cmd`` in its own process group, its output to ``logfile`` (stdout to ``stdout`` when given)."""
    with open(logfile, "w") as f:
        f.write("$ " + " ".join(cmd) + "\n")
        f.flush()
        if stdout is None:
            return subprocess.Popen(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        with open(stdout, "w") as o:
            return subprocess.Popen(cmd, cwd=ROOT, stdout=o, stderr=f, env=env, start_new_session=True)


def finish(proc: subprocess.Popen, timeout: float) -> tuple[int | None, bool]:
    """(exit status, timed out); a process still running at ``timeout`` is killed with its group."""
    try:
        return proc.wait(timeout=max(timeout, 0)), False
    except subprocess.TimeoutExpired:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()
        return None, True


def run_phase(
    ck: Check, phase: str, cmd: list[str], env: dict | None = None, stdout: Path | None = None, **extra
) -> tuple[bool, Path]:
    """Run ``cmd`` as phase ``phase`` within its limit; record it. Returns (ok, log path)."""
    logfile = ck.out / "logs" / f"{phase}.log"
    limit = ck.limit(phase)
    if limit < MIN_PHASE_S:
        ck.skip(phase, f"over the check's budget ({ck.budget:.0f} s)")
        return False, logfile
    log(f"{phase}: {' '.join(cmd)} (at most {limit:.0f} s)")
    t = time.monotonic()
    try:
        proc = start(cmd, logfile, env, stdout)
    except OSError as e:  # no such program (just, nice)
        ck.phase_record(phase, "failed", time.monotonic() - t, limit, command=" ".join(cmd), reason=str(e), **extra)
        return False, logfile
    rc, timed_out = finish(proc, limit)
    return _record_run(ck, phase, rc, timed_out, time.monotonic() - t, limit, logfile, cmd, **extra), logfile


def _record_run(ck, phase, rc, timed_out, elapsed, limit, logfile, cmd, **extra) -> bool:
    rel = str(logfile.relative_to(ROOT)) if logfile.is_relative_to(ROOT) else str(logfile)
    if timed_out:
        ck.phase_record(phase, "timeout", elapsed, limit, log=rel, command=" ".join(cmd),
                        reason=f"still running after {limit:.0f} s: killed\n{tail(logfile)}", **extra)  # fmt: skip
        return False
    if rc != 0:
        ck.phase_record(phase, "failed", elapsed, limit, log=rel, command=" ".join(cmd),
                        reason=f"exit status {rc}\n{tail(logfile)}", **extra)  # fmt: skip
        return False
    ck.phase_record(phase, "ok", elapsed, limit, log=rel, command=" ".join(cmd), **extra)
    return True


# ---------------------------------------------------------------- the GPU and the peer build


def query_gpu() -> dict:
    """nvidia-smi's view of the first GPU: name, compute capability ("9.0"), driver, memory."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        raise RuntimeError("nvidia-smi is not on PATH: no NVIDIA driver here (`--device cpu` rehearses on the CPU)")
    q = "name,compute_cap,driver_version,memory.total"
    proc = subprocess.run([smi, f"--query-gpu={q}", "--format=csv,noheader"], capture_output=True, text=True)
    if proc.returncode != 0 or not proc.stdout.strip():
        raise RuntimeError(f"nvidia-smi failed: {(proc.stderr or proc.stdout).strip()}")
    gpus = [[x.strip() for x in ln.split(",")] for ln in proc.stdout.strip().splitlines()]
    name, cc, driver, mem = gpus[0]
    return {"gpu": name, "compute_capability": cc, "driver": driver, "gpu_memory": mem, "gpus": len(gpus)}


def cuda_requirements() -> list[str]:
    """What ``just cuda`` installs into .venv before it builds (tools/build_cuda.py's NEEDS)."""
    sys.path.insert(0, str(ROOT / "tools"))
    try:
        import build_cuda
    finally:
        sys.path.pop(0)
    return [req for _, req in build_cuda.NEEDS]


def find_nvcc() -> str | None:
    return shutil.which("nvcc") or ("/usr/local/cuda/bin/nvcc" if Path("/usr/local/cuda/bin/nvcc").is_file() else None)


def cuda_root(nvcc: str) -> Path:
    """The CUDA toolkit's folder: $CUDA_HOME or $CUDA_PATH, else the one nvcc is in (through links), else
    /usr/local/cuda (an nvcc on PATH may be a wrapper script elsewhere)."""
    for c in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), Path(nvcc).resolve().parent.parent,
              "/usr/local/cuda"):  # fmt: skip
        if not c:
            continue
        root = Path(c)
        headers = any((root / d / "cuda_runtime.h").is_file() for d in ("include", "targets/x86_64-linux/include"))
        if (root / "bin" / "nvcc").is_file() and headers:
            return root
    return Path(nvcc).resolve().parent.parent


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def toy_site() -> Path:
    """.venv's site-packages (NVIDIA's cuBLAS wheel is there once ``just cuda`` ran)."""
    out = subprocess.run([str(PY), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                         capture_output=True, text=True, check=True).stdout  # fmt: skip
    return Path(out.strip())


def peer_cmake_args(archs: str, nvcc: str, site: Path, include_dir: Path) -> tuple[list[str], list[str]]:
    """CMake options of the llama.cpp peer: CUDA for ``archs``, no VMM (as toy's plugin; the rest as
    llama-cpp-python builds by default, its CPU backend for this CPU), and cuBLAS from
    NVIDIA's wheel in ``site`` when the toolkit beside nvcc has none (its headers through a folder of
    links to the cublas*.h headers alone: the wheel's other CUDA headers are another version's).
    Returns (CMake options, folders of the libraries it runs with)."""
    cuda_home = cuda_root(nvcc)
    # no multimodal library (LLAVA_BUILD): llama_cpp imports it only for image chat formats
    args = [f"-DCMAKE_CUDA_COMPILER={cuda_home / 'bin' / 'nvcc'}", "-DGGML_CUDA=ON", "-DGGML_CUDA_NO_VMM=ON",
            f"-DCMAKE_CUDA_ARCHITECTURES={archs}", "-DLLAVA_BUILD=OFF"]  # fmt: skip
    libdirs = [str(cuda_home / "lib64")]
    toolkit_has_cublas = any(any((cuda_home / d).glob("libcublas.so*")) for d in ("lib64", "targets/x86_64-linux/lib"))
    if not toolkit_has_cublas:
        wheel = site / "nvidia" / "cu13"
        include_dir.mkdir(parents=True, exist_ok=True)
        for h in sorted((wheel / "include").glob("cublas*.h")):
            link = include_dir / h.name
            if not link.exists():
                link.symlink_to(h)
        args += [f"-DCUDA_cublas_LIBRARY={wheel / 'lib' / 'libcublas.so.13'}",
                 f"-DCUDA_cublasLt_LIBRARY={wheel / 'lib' / 'libcublasLt.so.13'}",
                 f"-DCMAKE_CUDA_FLAGS=-I{include_dir}", f"-DCMAKE_CXX_FLAGS=-I{include_dir}"]  # fmt: skip
        libdirs.insert(0, str(wheel / "lib"))
    return args, libdirs


def build_peer(out: Path, archs: str, jobs: int) -> int:
    """``--task build-peer``: llama-cpp-python from the sdist, built for CUDA, into ``out/llama-cuda``.
    Prints ``{"python": ..., "ld_path": ...}`` last."""
    venv = out / "llama-cuda"
    py = venv / "bin" / "python"
    nvcc = find_nvcc()
    if nvcc is None:
        print("error: nvcc is neither on PATH nor in /usr/local/cuda/bin", file=sys.stderr)
        return 1
    if not SDIST.is_file():
        print(f"error: {SDIST} is missing (tools/fetch_ggml.py keeps it; `just setup` runs that)", file=sys.stderr)
        return 1
    cmake_args, libdirs = peer_cmake_args(archs, nvcc, toy_site(), out / "cublas-include")
    want = {"sdist_sha256": sha256(SDIST), "cmake_args": cmake_args}
    stamp = venv / ".toy-gpu-check.json"
    reuse = stamp.is_file() and json.loads(stamp.read_text()) == want
    if reuse and subprocess.run([str(py), "-c", "import llama_cpp"], env=_ld_env(libdirs)).returncode == 0:
        print("peer-build: reusing the llama.cpp CUDA build in", venv, file=sys.stderr)
    else:
        if venv.exists():
            shutil.rmtree(venv)
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        pip = [str(py), "-m", "pip", "--disable-pip-version-check"]
        subprocess.run([*pip, "install", "-q", *PEER_REQUIREMENTS], check=True)
        env = dict(os.environ, CMAKE_ARGS=" ".join(cmake_args), CMAKE_BUILD_PARALLEL_LEVEL=str(jobs))
        env["PATH"] = os.pathsep.join([str(venv / "bin"), str(Path(nvcc).parent), env.get("PATH", "")])
        # from the sdist file, without pip's wheel cache: a wheel built earlier from the same sdist (a CPU
        # build) must not be taken for this one
        cmd = [*pip, "install", "-v", "--no-build-isolation", "--no-deps", "--no-cache-dir", str(SDIST)]
        print("peer-build: CMAKE_ARGS=" + env["CMAKE_ARGS"], file=sys.stderr, flush=True)
        subprocess.run(cmd, env=env, check=True)
        stamp.write_text(json.dumps(want, indent=2) + "\n")
    probe = "import llama_cpp; print(llama_cpp.__version__, llama_cpp.llama_supports_gpu_offload())"
    subprocess.run([str(py), "-c", probe], env=_ld_env(libdirs), check=True)
    print(json.dumps({"python": str(py), "ld_path": os.pathsep.join(libdirs)}), flush=True)
    return 0


def _ld_env(libdirs: list[str]) -> dict:
    return dict(os.environ, LD_LIBRARY_PATH=os.pathsep.join([*libdirs, os.environ.get("LD_LIBRARY_PATH", "")]))


# ---------------------------------------------------------------- the records of the tests and benchmarks


def gpu_test_paths() -> list[str]:
    """tests/gpu and every test module under packages/*/tests that uses the gpu marker (a full
    collection of every test module only to deselect them costs most of a minute)."""
    paths = ["tests/gpu"]
    for p in sorted(ROOT.glob("packages/*/tests/**/test_*.py")):
        if "mark.gpu" in p.read_text(errors="replace"):
            paths.append(str(p.relative_to(ROOT)))
    return paths


def junit_summary(path: Path) -> dict:
    """Counts and the failed tests (with the first line of their message) of a JUnit XML file."""
    out: dict = {
        "passed": 0,
        "failed": 0,
        "errors": 0,
        "skipped": 0,
        "failures": [],
        "skip_reasons": [],
        "outcomes": {},
    }
    try:
        root = ET.parse(path).getroot()
    except (OSError, ET.ParseError):
        return out
    for case in root.iter("testcase"):
        # pytest's node id of a module-level test: classname "tests.gpu.test_x", name "test_y[p]"
        name = f"{case.get('classname', '').replace('.', '/')}.py::{case.get('name', '')}"
        bad = case.find("failure")
        err = case.find("error")
        skip = case.find("skipped")
        if bad is not None or err is not None:
            el = bad if bad is not None else err
            outcome = "failed" if bad is not None else "errors"
            msg = (el.get("message") or el.text or "").strip().splitlines()
            out["failures"].append({"test": name, "message": msg[0][:400] if msg else ""})
        elif skip is not None:
            outcome = "skipped"
            reason = (skip.get("message") or "").strip()
            if reason not in out["skip_reasons"]:
                out["skip_reasons"].append(reason)
        else:
            outcome = "passed"
        out[outcome] += 1
        # a test's figures take its outcome ("failed" for an error in its setup or teardown too)
        if out["outcomes"].get(name) not in ("failed",):
            out["outcomes"][name] = {"passed": "ok", "skipped": "skipped"}.get(outcome, "failed")
    return out


def json_lines(text: str) -> list[dict]:
    out = []
    for ln in text.splitlines():
        if ln.startswith("{"):
            try:
                out.append(json.loads(ln))
            except ValueError:
                pass
    return out


# ---------------------------------------------------------------- the check


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="auto", help="auto (the first GPU toy_ggml reports), a device name, or cpu")
    ap.add_argument("--archs", help='CUDA archs to build for (default: the GPU\'s compute capability, e.g. "90")')
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 2, help="parallel compile jobs")
    ap.add_argument("--skip-setup", action="store_true", help="use .venv as it is (no tools/setup_env.py)")
    ap.add_argument("--skip-build", action="store_true", help="no CUDA builds (the plugin and peer as they are)")
    ap.add_argument("--llama-python", help="a Python with llama-cpp-python 0.3.36 as the peer (no peer build)")
    ap.add_argument("--quick", action="store_true", help="shorter benchmarks (one model file, fewer reps, one shape)")
    ap.add_argument("--budget", type=float, default=TARGET_S, help="seconds the whole check may take")
    ap.add_argument("--out", type=Path, default=ROOT / "build" / "gpu-check", help="records, logs, models, the peer")
    ap.add_argument("--task", choices=["build-peer"], help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    out = args.out.absolute()
    if args.task == "build-peer":
        return build_peer(out, args.archs, args.jobs)

    ck = Check(out, args.budget)
    on_cpu = args.device.lower() == "cpu"
    ck.context["requested_device"] = args.device
    env = dict(os.environ, TOY_GGML_JOBS=str(args.jobs))

    # 1. setup
    if args.skip_setup:
        ck.skip("setup", "--skip-setup")
    else:
        run_phase(ck, "setup", [sys.executable, "tools/setup_env.py"], env=env)
    if not PY.is_file():
        log(f"{PY} is missing: nothing else can run")
        return summary(ck, 1)

    # 2. the GPU
    archs = args.archs
    if on_cpu:
        ck.skip("gpu", "--device cpu")
    else:
        t = time.monotonic()
        try:
            info = query_gpu()
        except RuntimeError as e:
            ck.phase_record("gpu", "failed", time.monotonic() - t, CAPS["gpu"], reason=str(e))
        else:
            ck.context.update(gpu=info["gpu"], driver=info["driver"], compute_capability=info["compute_capability"])
            archs = archs or info["compute_capability"].replace(".", "")
            ck.phase_record("gpu", "ok", time.monotonic() - t, CAPS["gpu"], gpu_memory=info["gpu_memory"],
                            gpus=info["gpus"], archs=archs)  # fmt: skip

    # 3. the plugin (foreground) and the peer (background)
    peer = None
    peer_python, peer_ld, peer_missing = args.llama_python, None, None
    if on_cpu or args.skip_build or not archs:
        why = "--device cpu" if on_cpu else "--skip-build" if args.skip_build else "no archs (the gpu phase failed)"
        ck.skip("cuda", why)
        if not peer_python:
            peer_python = _earlier_peer(out)
            if peer_python:
                peer_python, peer_ld = peer_python
            else:
                peer_missing = f"no llama.cpp peer: {why} and no --llama-python"
    else:
        # NVIDIA's cuBLAS and runtime wheels (and ccache) into .venv first, as `just cuda` would: the peer
        # build, started beside it, links against the same cuBLAS when the toolkit has none
        run_phase(ck, "cuda-deps", [str(PY), "-m", "pip", "install", "-q", *cuda_requirements()])
        if not peer_python:
            limit = ck.limit("peer-build")
            cmd = [sys.executable, __file__, "--task", "build-peer", "--out", str(out), "--archs", archs,
                   "--jobs", str(args.jobs)]  # fmt: skip
            log(f"peer-build: in the background (at most {limit:.0f} s)")
            peer = (start(["nice", "-n", "5", *cmd], out / "logs" / "peer-build.log"), time.monotonic(), limit, cmd)
        run_phase(ck, "cuda", ["just", "cuda", "--archs", archs, "--jobs", str(args.jobs)], env=env, archs=archs)

    # 4. the device under test
    device = "cpu" if on_cpu else None
    found_file = out / "devices.json"
    ok, _ = run_phase(ck, "devices", [str(PY), "tools/gpu_bench.py", "devices"], stdout=found_file)
    if ok:
        found = json_lines(found_file.read_text())
        info = found[-1] if found else {}
        devs = info.get("devices", [])
        if not on_cpu:
            want = args.device.lower()
            pick = [d for d in devs if (d["name"].lower() == want if want != "auto" else d["kind"] in ("gpu", "igpu"))]
            device = pick[0]["name"] if pick else None
        chosen = next((d for d in devs if d["name"].lower() == (device or "").lower()), None)
        # the device as ggml names it ("CUDA0", "CPU"): the label the tests' and benchmarks' records carry
        ck.context.update(device=chosen["name"] if chosen else device)
        ck.context.update(device_description=chosen["description"] if chosen else None)
        ck.emit("devices", {"figure": "devices", "value": len(devs), "unit": "devices", "status": "ok",
                            "devices": devs, "plugins": info.get("plugins"), "cpu_variant": info.get("cpu_variant")})  # fmt: skip
    if device is None:
        log("no GPU device: the tests skip and the benchmarks do not run")

    # 5. the gpu tests
    report = out / "test-figures.jsonl"
    report.write_text("")
    junit = out / "junit.xml"
    tenv = dict(os.environ, TOY_GPU_CHECK_REPORT=str(report))
    if device:
        tenv["TOY_TEST_GPU_DEVICE"] = device
    cmd = [str(PY), "-m", "pytest", "-m", "gpu", "-q", "-rs", "-p", "no:cacheprovider", f"--junitxml={junit}",
           f"--basetemp={out / 'pytest-tmp'}", *gpu_test_paths()]  # fmt: skip
    if junit.exists():
        junit.unlink()
    ok, _ = run_phase(ck, "tests", cmd, env=tenv)
    if ck.status.get("tests") != "skipped":
        s = junit_summary(junit)
        status = "ok" if ok and not s["failed"] and not s["errors"] else "failed"
        if status == "ok" and not s["passed"]:
            status = "skipped"  # every test skipped (no device): nothing was shown
        ck.emit("tests", {"figure": "gpu tests passed", "value": s["passed"], "unit": "tests", "status": status, **s})
        for rec in json_lines(report.read_text()):  # a figure's status: its test's outcome
            ck.emit("tests", {"status": s["outcomes"].get(rec.get("test"), "unknown"), **rec})

    # 6. the peer build ends; inference against it
    if peer is not None:
        proc, started, limit, cmd = peer
        rc, timed_out = finish(proc, min(limit - (time.monotonic() - started), ck.left()))
        logfile = out / "logs" / "peer-build.log"
        if _record_run(ck, "peer-build", rc, timed_out, time.monotonic() - started, limit, logfile, cmd, archs=archs):
            res = json_lines(logfile.read_text())
            peer_python, peer_ld = (res[-1]["python"], res[-1]["ld_path"]) if res else (None, None)
        if not peer_python:
            peer_missing = f"the llama.cpp CUDA build failed (see {logfile.relative_to(ROOT)})"
    bench_args = ["--device", device or "", "--out", str(out / "bench")] + (["--quick"] if args.quick else [])
    if device is None:
        ck.skip("bench-infer", "no device to benchmark")
        ck.skip("bench-train", "no device to benchmark")
    else:
        cmd = [str(PY), "tools/gpu_bench.py", "infer", *bench_args]
        cmd += ["--peer-python", peer_python] if peer_python else ["--peer-missing", peer_missing or "none"]
        cmd += ["--peer-ld-path", peer_ld] if peer_ld else []
        _bench(ck, "bench-infer", cmd)
        _bench(ck, "bench-train", [str(PY), "tools/gpu_bench.py", "train", *bench_args])
    return summary(ck, 0)


def _earlier_peer(out: Path) -> tuple[str, str | None] | None:
    """A peer from an earlier check's build, or $TOY_BENCH_LLAMA_PYTHON."""
    env = os.environ.get("TOY_BENCH_LLAMA_PYTHON")
    if env:
        return env, None
    py = out / "llama-cuda" / "bin" / "python"
    if py.is_file() and (out / "llama-cuda" / ".toy-gpu-check.json").is_file():
        nvcc = find_nvcc()
        ld = None
        if nvcc is not None:
            try:
                ld = os.pathsep.join(peer_cmake_args("", nvcc, toy_site(), out / "cublas-include")[1])
            except (OSError, subprocess.CalledProcessError):
                ld = None
        return str(py), ld
    return None


def _bench(ck: Check, phase: str, cmd: list[str]) -> None:
    t = time.monotonic()
    figures = ck.out / f"{phase}.jsonl"
    run_phase(ck, phase, cmd, stdout=figures)
    if ck.status.get(phase) == "skipped":
        return
    for rec in json_lines(figures.read_text()):  # what it printed before it ended (or was stopped)
        if "figure" in rec:
            ck.emit(
                phase, {"status": rec.pop("status", "ok"), **rec, "phase_elapsed_s": round(time.monotonic() - t, 1)}
            )


def summary(ck: Check, rc: int) -> int:
    total = time.monotonic() - ck.t0
    bad = sorted(p for p, s in ck.status.items() if s not in ("ok", "skipped"))
    ck.emit("summary", {"figure": "gpu check total", "value": round(total, 1), "unit": "s",
                        "status": "failed" if bad or rc else "ok", "target_s": TARGET_S, "met": total <= TARGET_S,
                        "budget_s": ck.budget, "phases": ck.status, "failed_phases": bad})  # fmt: skip
    return 1 if bad or rc else 0


if __name__ == "__main__":
    sys.exit(main())
