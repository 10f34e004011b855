#!/usr/bin/env python3
"""Build the patched ggml with CMake for toy-ggml's meson build.

meson.build runs this script as one custom target. It configures ggml (in
``subprojects/ggml``, laid out by ``tools/fetch_ggml.py``) in a CMake build
folder of its own, builds it with ninja, and copies the libraries meson
expects into meson's output folder:

- ``libggml-base`` and ``libggml`` (shared libraries the extension module
  links against: ggml's core and its backend registry);
- the CPU backend as loadable modules: one ``libggml-cpu-<tag>.so`` per x86-64
  level named in ``--variants`` (ggml's own variant table, narrowed by toy
  patch 0009), or a single ``libggml-cpu.so`` for a native build or on a CPU
  family without a variant list;
- ``libggml-cuda.so`` / ``libggml-metal.so`` when that backend is chosen;
- ``libggml-rpc.so``, ggml's RPC backend (remote devices over TCP, and the
  server side of ``toy rpc-server``), always.

Every library gets ``$ORIGIN`` as its run path and an unversioned soname, so
the set works from any folder it is copied to (a wheel's package folder).
The backends are dynamic modules (``GGML_BACKEND_DL``): ``toy_ggml`` picks and
loads exactly one CPU variant at import time (``toy_ggml._dispatch``).

Usage (meson passes these): ``build_ggml.py --source DIR --build DIR --out DIR
--backend cpu|cuda|metal --native 0|1 --variants "x64;haswell;..." OUTPUT...``.
A second run with the same options reconfigures nothing; CMake rebuilds what
changed. Failures end with one ``error:`` line and exit status 1.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

# ggml's AMX code path dies with SIGILL on the Xeons toy was measured on: a
# native build must not enable it even where the CPU has AMX.
NO_AMX = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"


def cmake_defines(args: argparse.Namespace) -> dict[str, str]:
    d = {
        "CMAKE_BUILD_TYPE": "Release",
        "BUILD_SHARED_LIBS": "ON",
        "GGML_BACKEND_DL": "ON",
        "GGML_BUILD_TESTS": "OFF",
        "GGML_BUILD_EXAMPLES": "OFF",
        "GGML_OPENMP": "OFF",
        "GGML_LLAMAFILE": "ON",
        "GGML_CCACHE": "OFF",
        "GGML_CUDA": "ON" if args.backend == "cuda" else "OFF",
        "GGML_METAL": "ON" if args.backend == "metal" else "OFF",
        "GGML_METAL_EMBED_LIBRARY": "ON" if args.backend == "metal" else "OFF",
        # ggml's RPC backend (toy rpc-server, --rpc): a loadable module like the others, over
        # TCP only (no RDMA transport, which would link libibverbs where it happens to exist)
        "GGML_RPC": "ON",
        "GGML_RPC_RDMA": "OFF",
        # plain file names (no libggml.so.0 -> libggml.so.0.25.3 links) and $ORIGIN run paths
        "CMAKE_PLATFORM_NO_VERSIONED_SONAME": "ON",
        "CMAKE_BUILD_WITH_INSTALL_RPATH": "ON",
        "CMAKE_INSTALL_RPATH": "@loader_path" if sys.platform == "darwin" else "$ORIGIN",
    }
    if args.native == "1":
        d.update({"GGML_NATIVE": "ON", "GGML_CPU_ALL_VARIANTS": "OFF", "GGML_CPU_VARIANTS": ""})
        if args.x86:
            # ggml refuses GGML_NATIVE with GGML_BACKEND_DL on x86 (its variant score
            # needs the feature definitions); for the CPU backend GGML_NATIVE only
            # adds -march=native, so pass that directly (the module's score is then
            # the baseline's, which is all one module needs)
            d["GGML_NATIVE"] = "OFF"
            d["CMAKE_C_FLAGS"] = "-march=native " + NO_AMX
            d["CMAKE_CXX_FLAGS"] = "-march=native " + NO_AMX
    elif args.variants:
        d.update({"GGML_NATIVE": "OFF", "GGML_CPU_ALL_VARIANTS": "ON", "GGML_CPU_VARIANTS": args.variants})
    else:
        d.update({"GGML_NATIVE": "OFF", "GGML_CPU_ALL_VARIANTS": "OFF", "GGML_CPU_VARIANTS": ""})
    return d


def run(cmd: list[str], what: str) -> None:
    proc = subprocess.run(cmd)
    if proc.returncode != 0:
        raise SystemExit(f"error: {what} failed (exit {proc.returncode}): {' '.join(cmd)}")


def find_built(build: Path, name: str) -> Path:
    for sub in ("bin", "src", "lib", "."):
        p = build / sub / name
        if p.is_file():
            return p
    hits = [p for p in build.rglob(name) if p.is_file()]
    if not hits:
        raise SystemExit(f"error: the ggml build did not produce {name} (under {build})")
    return hits[0]


def copy_if_changed(src: Path, dst: Path) -> None:
    if dst.is_file() and dst.stat().st_size == src.stat().st_size and dst.read_bytes() == src.read_bytes():
        os.utime(dst)  # newer than its inputs, so ninja sees the target done
        return
    tmp = dst.with_name(dst.name + ".tmp")
    shutil.copy2(src, tmp)
    os.replace(tmp, dst)
    os.utime(dst)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--source", required=True, type=Path)
    ap.add_argument("--build", required=True, type=Path)
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--backend", choices=["cpu", "cuda", "metal"], default="cpu")
    ap.add_argument("--native", choices=["0", "1"], default="0")
    ap.add_argument("--variants", default="")
    ap.add_argument("--x86", action="store_true", help="the host is x86-64 (AMX flags apply)")
    ap.add_argument("outputs", nargs="+")
    args = ap.parse_args()

    cmake = shutil.which("cmake")
    if cmake is None:
        raise SystemExit("error: cmake is not on PATH (pip install cmake)")
    defines = cmake_defines(args)
    args.build.mkdir(parents=True, exist_ok=True)
    record = args.build / "toy-options.json"
    want = json.dumps({"defines": defines, "source": str(args.source.resolve())}, sort_keys=True)
    if not (args.build / "CMakeCache.txt").is_file() or not record.is_file() or record.read_text() != want:
        cmd = [cmake, "-S", str(args.source), "-B", str(args.build), "-G", "Ninja", "--fresh"]
        cmd += [f"-D{k}={v}" for k, v in defines.items()]
        print(
            f"build_ggml: configuring ggml ({args.backend}, native={args.native}, variants={args.variants or '-'})",
            file=sys.stderr,
            flush=True,
        )
        run(cmd, "configuring ggml with cmake")
        record.write_text(want)
    jobs = os.environ.get("TOY_GGML_JOBS") or str(os.cpu_count() or 2)
    run([cmake, "--build", str(args.build), "-j", jobs], "building ggml")
    args.out.mkdir(parents=True, exist_ok=True)
    for name in args.outputs:
        copy_if_changed(find_built(args.build, name), args.out / name)
    return 0


if __name__ == "__main__":
    sys.exit(main())
