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

The CUDA plugin (``--cuda-plugin``, the meson build of ``packages/toy-ggml-cuda``)
builds ggml's CUDA module only (``ninja ggml-cuda``; ``libggml-base`` is built as
its dependency and not copied) and writes ``build-info.json`` beside it::

    build_ggml.py --cuda-plugin --source DIR --build DIR --out DIR [--archs "80;86;89;90"]
        libggml-cuda.so build-info.json

Its CMake line is fixed (``cuda_plugin_defines``): CUDA 13's ``nvcc`` (``$CUDACXX``,
else ``/usr/local/cuda/bin``, else on PATH); cuBLAS and its headers from the ``nvidia-cublas``
wheel of the Python running this script, through a folder of links to the
``cublas*.h`` headers only (``<build>/../cublas-include``: the wheel's include
folder also holds CUDA runtime headers of a newer minor version, which nvcc 13.0
refuses to compile with); ``GGML_CUDA_NO_VMM`` (no link to the driver's
``libcuda.so.1``: the module loads on a machine without a driver and then
reports no device); run path ``$ORIGIN:$ORIGIN/../nvidia/cu13/lib`` (the
``nvidia-cuda-runtime`` and ``nvidia-cublas`` wheels' libraries, from
``site-packages/toy_ggml_cuda/``); ``ccache`` as the compiler launcher when it is
on PATH (``TOY_CCACHE=0`` turns that off). The archs: ``--archs``, else
``TOY_CUDA_ARCHS``, else ``80;86;89;90``. A build folder whose CMake cache
already holds these values is not configured again, so a folder configured by
hand with the same line is reused as it is.
"""

from __future__ import annotations

import argparse
import json
import os
import re
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


# --- the CUDA plugin (packages/toy-ggml-cuda) ---------------------------------

CUDA_ARCHS = "80;86;89;90"  # Ampere (A100, RTX 30), Ada (RTX 40, L4, L40), Hopper (H100, H200)
CUDA_MAJOR = 13  # the nvidia-*-cu13 wheels the plugin runs with
CUDA_RPATH = "$ORIGIN:$ORIGIN/../nvidia/cu13/lib"
ARCH_RE = re.compile(r"^[0-9]{2,3}[a-z]?(-real|-virtual)?$")


def find_nvcc() -> Path:
    """The CUDA compiler: ``$CUDACXX`` (CMake's own variable) when set, else /usr/local/cuda/bin/nvcc, else
    nvcc on PATH. The toolkit's own folder comes before PATH so that the compile commands, which name the
    toolkit's include folders, are the same whatever shim a shell's PATH holds (ccache hits depend on it)."""
    given = os.environ.get("CUDACXX")
    if given:
        if not Path(given).is_file():
            raise SystemExit(f"error: CUDACXX={given!r} is not a file")
        return Path(given)
    default = Path("/usr/local/cuda/bin/nvcc")
    if default.is_file():
        return default
    found = shutil.which("nvcc")
    if found:
        return Path(found)
    raise SystemExit(
        f"error: nvcc (the CUDA {CUDA_MAJOR} compiler) is neither in /usr/local/cuda/bin nor on PATH: install the "
        f"CUDA toolkit {CUDA_MAJOR}.x, or put the folder holding its nvcc on PATH (or name it in CUDACXX)"
    )


def nvcc_version(nvcc: Path) -> str:
    """nvcc's release, e.g. "13.0"; exits when it is not CUDA 13."""
    try:
        out = subprocess.run([str(nvcc), "--version"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError) as e:
        raise SystemExit(f"error: {nvcc} --version failed: {e}") from None
    m = re.search(r"release (\d+)\.(\d+)", out)
    if not m:
        raise SystemExit(f"error: cannot read the CUDA release from `{nvcc} --version`: {out.strip()!r}")
    if int(m.group(1)) != CUDA_MAJOR:
        raise SystemExit(
            f"error: {nvcc} is CUDA {m.group(1)}.{m.group(2)}; toy-ggml-cuda is built with CUDA {CUDA_MAJOR} (it runs "
            f"with the nvidia-cuda-runtime and nvidia-cublas {CUDA_MAJOR}.x wheels): put a CUDA {CUDA_MAJOR} nvcc first "
            "on PATH"
        )
    return f"{m.group(1)}.{m.group(2)}"


def find_cu13() -> Path:
    """The ``nvidia/cu13`` folder of the nvidia-cublas wheel installed for this Python (libraries and headers)."""
    import importlib.util

    spec = importlib.util.find_spec("nvidia")
    for base in list(spec.submodule_search_locations or []) if spec else []:
        cu = Path(base) / f"cu{CUDA_MAJOR}"
        if (cu / "lib" / f"libcublas.so.{CUDA_MAJOR}").is_file() and (cu / "include" / "cublas_v2.h").is_file():
            return cu
    raise SystemExit(
        f"error: cuBLAS {CUDA_MAJOR} is not installed for {sys.executable} (no nvidia/cu{CUDA_MAJOR}/lib/"
        f"libcublas.so.{CUDA_MAJOR} with its headers): pip install 'nvidia-cublas>={CUDA_MAJOR},<{CUDA_MAJOR + 1}'"
    )


def cublas_include(folder: Path, cu: Path) -> Path:
    """A folder of links to the wheel's ``cublas*.h`` only (its CUDA runtime headers are a newer minor
    version than nvcc's and must not be seen); links already right are left as they are."""
    folder.mkdir(parents=True, exist_ok=True)
    want = {h.name: h for h in sorted((cu / "include").glob("cublas*.h"))}
    for old in folder.iterdir():
        if old.name not in want:
            old.unlink()
    for name, target in want.items():
        link = folder / name
        if link.is_symlink() and os.readlink(link) == str(target):
            continue
        if link.exists() or link.is_symlink():
            link.unlink()
        link.symlink_to(target)
    return folder


def cuda_archs(given: str) -> str:
    """The archs for CMAKE_CUDA_ARCHITECTURES: ``given``, else TOY_CUDA_ARCHS, else CUDA_ARCHS (commas or
    semicolons between them)."""
    raw = given or os.environ.get("TOY_CUDA_ARCHS") or CUDA_ARCHS
    archs = [a.strip() for a in re.split(r"[;,\s]+", raw) if a.strip()]
    bad = [a for a in archs if not ARCH_RE.match(a)]
    if not archs or bad:
        raise SystemExit(
            f"error: CUDA archs {raw!r}: expected compute capabilities without the dot, e.g. '80;86;89;90' "
            f"(bad: {', '.join(bad) or 'none given'})"
        )
    return ";".join(archs)


def cuda_plugin_defines(archs: str, cu: Path, include: Path, launcher: str | None) -> dict[str, str]:
    """The CMake line of the CUDA plugin (docs/reference/build.md, "The CUDA plugin")."""
    d = {
        "GGML_BUILD_TESTS": "OFF",
        "GGML_BUILD_EXAMPLES": "OFF",
        "CMAKE_BUILD_TYPE": "Release",
        "BUILD_SHARED_LIBS": "ON",
        "GGML_BACKEND_DL": "ON",
        "GGML_NATIVE": "OFF",
        "GGML_CPU_ALL_VARIANTS": "OFF",
        "GGML_CPU_VARIANTS": "",
        "GGML_CUDA": "ON",
        "GGML_CUDA_NO_VMM": "ON",  # no libcuda.so.1 link: loads without a driver, reports no device
        "GGML_CUDA_NCCL": "OFF",
        "GGML_RPC": "OFF",
        "GGML_OPENMP": "OFF",
        "GGML_LLAMAFILE": "ON",
        "GGML_CCACHE": "OFF",  # the launcher below instead (ggml's own ccache switch finds no wheel's ccache)
        "CMAKE_CUDA_ARCHITECTURES": archs,
    }
    if launcher:
        d.update({f"CMAKE_{lang}_COMPILER_LAUNCHER": launcher for lang in ("CUDA", "C", "CXX")})
    d.update(
        {
            "CMAKE_PLATFORM_NO_VERSIONED_SONAME": "ON",
            "CMAKE_BUILD_WITH_INSTALL_RPATH": "ON",
            "CMAKE_INSTALL_RPATH": CUDA_RPATH,
            "CUDA_cublas_LIBRARY": str(cu / "lib" / f"libcublas.so.{CUDA_MAJOR}"),
            "CUDA_cublasLt_LIBRARY": str(cu / "lib" / f"libcublasLt.so.{CUDA_MAJOR}"),
            "CMAKE_CUDA_FLAGS": f"-I{include}",
            "CMAKE_CXX_FLAGS": f"-I{include}",
        }
    )
    return d


def cmake_cache(build: Path) -> dict[str, str]:
    """``NAME -> value`` of a CMake build folder's CMakeCache.txt ({} when there is none)."""
    out: dict[str, str] = {}
    try:
        text = (build / "CMakeCache.txt").read_text(errors="replace")
    except OSError:
        return out
    for line in text.splitlines():
        m = re.match(r"^([A-Za-z0-9_.+-]+):[A-Z_]+=(.*)$", line)
        if m:
            out[m.group(1)] = m.group(2)
    return out


def elf_dynamic(path: Path) -> dict[str, list[str]]:
    """The string entries of an ELF file's dynamic section, as ``readelf -d`` (binutils, beside every
    compiler that builds the plugin) prints them: ``{"NEEDED": [...], "RUNPATH": [...], "RPATH": [...],
    "SONAME": [...]}``. ValueError when readelf cannot read the file."""
    readelf = shutil.which("readelf")
    if readelf is None:
        raise SystemExit("error: readelf (binutils) is not on PATH: it checks the built module's dependencies")
    proc = subprocess.run([readelf, "-d", "--wide", str(path)], capture_output=True, text=True)
    if proc.returncode != 0 or "Dynamic section" not in proc.stdout:
        raise ValueError(f"{path} is not an ELF file with a dynamic section: {proc.stderr.strip()}")
    out: dict[str, list[str]] = {"NEEDED": [], "SONAME": [], "RPATH": [], "RUNPATH": []}
    for line in proc.stdout.splitlines():
        m = re.search(r"\((NEEDED|SONAME|RPATH|RUNPATH)\)\s+[^:]*: \[(.*)\]\s*$", line)
        if m:
            out[m.group(1)].append(m.group(2))
    return out


def check_plugin_library(lib: Path) -> None:
    """What the plugin promises of its library: the run path of the nvidia wheels, no driver library, no
    CPU backend."""
    dyn = elf_dynamic(lib)
    bad = [n for n in dyn["NEEDED"] if n.startswith(("libcuda.so", "libggml-cpu", "libggml.so"))]
    if bad:
        raise SystemExit(f"error: {lib} needs {', '.join(bad)} (a GGML_CUDA_NO_VMM module needs none of these)")
    if (dyn["RUNPATH"] or dyn["RPATH"]) != [CUDA_RPATH]:
        raise SystemExit(f"error: {lib} has the run path {dyn['RUNPATH'] or dyn['RPATH']}, not [{CUDA_RPATH!r}]")


def build_cuda_plugin(args: argparse.Namespace) -> int:
    """``--cuda-plugin``: configure (when the cache differs) and build ggml's CUDA module."""
    cmake = shutil.which("cmake")
    if cmake is None:
        raise SystemExit("error: cmake is not on PATH (pip install cmake)")
    if shutil.which("ninja") is None:
        raise SystemExit("error: ninja is not on PATH (pip install ninja)")
    source = args.source.resolve()
    stamp_file = source / ".toy-stamp.json"
    if not stamp_file.is_file():
        raise SystemExit(f"error: {source} is not a laid-out ggml tree: run `python tools/fetch_ggml.py` first")
    nvcc = find_nvcc()
    version = nvcc_version(nvcc)
    env = dict(os.environ)
    env["PATH"] = f"{nvcc.parent}{os.pathsep}{env.get('PATH', '')}"  # CMake takes the first nvcc on PATH
    cu = find_cu13()
    build = args.build.absolute()
    include = cublas_include(build.parent / "cublas-include", cu)
    launcher = "ccache" if os.environ.get("TOY_CCACHE", "1") != "0" and shutil.which("ccache") else None
    archs = cuda_archs(args.archs)
    defines = cuda_plugin_defines(archs, cu, include, launcher)
    build.mkdir(parents=True, exist_ok=True)
    cache = cmake_cache(build)
    same = cache.get("CMAKE_HOME_DIRECTORY") == str(source) and all(cache.get(k) == v for k, v in defines.items())
    if launcher is None and any(cache.get(f"CMAKE_{lang}_COMPILER_LAUNCHER") for lang in ("CUDA", "C", "CXX")):
        same = False  # a launcher left in the cache would still be used
    if not same:
        cmd = [cmake, "-S", str(source), "-B", str(build), "-G", "Ninja"] + (["--fresh"] if cache else [])
        cmd += [f"-D{k}={v}" for k, v in defines.items()]
        print(
            f"build_ggml: configuring ggml's CUDA module (archs {archs}, nvcc {version})", file=sys.stderr, flush=True
        )
        proc = subprocess.run(cmd, env=env)
        if proc.returncode != 0:
            raise SystemExit(f"error: configuring ggml with cmake failed (exit {proc.returncode}): {' '.join(cmd)}")
    jobs = os.environ.get("TOY_GGML_JOBS") or str(os.cpu_count() or 2)
    cmd = [cmake, "--build", str(build), "--target", "ggml-cuda", "-j", jobs]
    proc = subprocess.run(cmd, env=env)
    if proc.returncode != 0:
        raise SystemExit(f"error: building ggml's CUDA module failed (exit {proc.returncode}): {' '.join(cmd)}")
    lib = find_built(build, "libggml-cuda.so")
    check_plugin_library(lib)
    args.out.mkdir(parents=True, exist_ok=True)
    for name in args.outputs:
        if name == "libggml-cuda.so":
            copy_if_changed(lib, args.out / name)
        elif name == "build-info.json":
            stamp = json.loads(stamp_file.read_text())
            info = {
                "archs": archs.split(";"),
                "cuda_version": version,
                "no_vmm": True,
                "ggml_version": stamp["ggml_version"],
                "source": stamp["source"],
                "patches": stamp["patches"],
            }
            tmp = build / "build-info.json"
            tmp.write_text(json.dumps(info, indent=2) + "\n")
            copy_if_changed(tmp, args.out / name)
        else:
            raise SystemExit(f"error: --cuda-plugin makes libggml-cuda.so and build-info.json, not {name}")
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--source", required=True, type=Path)
    ap.add_argument("--build", required=True, type=Path)
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--backend", choices=["cpu", "cuda", "metal"], default="cpu")
    ap.add_argument("--native", choices=["0", "1"], default="0")
    ap.add_argument("--variants", default="")
    ap.add_argument("--x86", action="store_true", help="the host is x86-64 (AMX flags apply)")
    ap.add_argument("--cuda-plugin", action="store_true", help="build ggml's CUDA module only (toy-ggml-cuda)")
    ap.add_argument(
        "--archs", default="", help="CUDA archs (--cuda-plugin; default: $TOY_CUDA_ARCHS, else 80;86;89;90)"
    )
    ap.add_argument("outputs", nargs="+")
    args = ap.parse_args()
    if args.cuda_plugin:
        return build_cuda_plugin(args)

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
