#!/usr/bin/env python3
"""Build the sdist and wheel of every package into ``dist/`` (``just dist``).

1. ``tools/version.py check``: every package has the same version and the
   pins between them equal it;
2. ``tools/fetch_ggml.py``: the pinned, patched ggml that toy-ggml's build
   (and its sdist) needs;
3. for each ``packages/*/`` (whatever the folder holds): ``python -m build``
   -- the sdist, then the wheel built FROM that sdist, each in an isolated
   environment with only the package's ``[build-system] requires``, so a
   file the sdist forgot fails here and not on a user's machine;
4. ``twine check --strict`` on everything built;
5. a list of the files with their sizes.

Each build's output goes to ``build/dist-logs/<package>.log``; a failure
prints the end of it.

toy-ggml's wheel is built with the package's default options (CPU, portable);
``TOY_GGML_BACKEND``/``TOY_GGML_NATIVE`` apply to ``just setup`` only. The
sdist of toy-ggml is made by ``meson dist``, which packs the committed tree
(plus what the project's dist script adds): uncommitted changes are not in it.

Usage: ``python tools/dist.py [--out DIR] [PACKAGE ...]`` (default: all, into
``dist/``, which is emptied first). Needs ``build`` and ``twine`` (dev
requirements). Failures end with an ``error:`` line and exit status 1.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def fail(msg: str) -> int:
    print(f"error: {msg}", file=sys.stderr)
    return 1


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="build every package's sdist and wheel")
    ap.add_argument("--out", default="dist", help="output folder, emptied first (default: dist)")
    ap.add_argument("packages", nargs="*", help="package folders under packages/ (default: all)")
    args = ap.parse_args(argv)

    all_pkgs = sorted(p.parent.name for p in (ROOT / "packages").glob("*/pyproject.toml"))
    names = args.packages or all_pkgs
    unknown = [n for n in names if n not in all_pkgs]
    if unknown:
        return fail(f"no such package under packages/: {', '.join(unknown)} (have: {', '.join(all_pkgs)})")
    for mod in ("build", "twine"):
        if subprocess.run([sys.executable, "-c", f"import {mod}"], capture_output=True).returncode != 0:
            return fail(f"{mod} is not installed for {sys.executable} (it is a dev requirement: run `just setup`)")

    if subprocess.run([sys.executable, str(ROOT / "tools" / "version.py"), "check"], cwd=ROOT).returncode != 0:
        return fail("the packages' versions disagree (see above; `python tools/version.py bump X.Y.Z` aligns them)")
    if "toy-ggml" in names:
        print("dist: laying out ggml source", file=sys.stderr, flush=True)
        if subprocess.run([sys.executable, str(ROOT / "tools" / "fetch_ggml.py")], cwd=ROOT).returncode != 0:
            return fail("tools/fetch_ggml.py failed")

    out = (ROOT / args.out).resolve()
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    env = {k: v for k, v in os.environ.items() if k not in ("TOY_GGML_BACKEND", "TOY_GGML_NATIVE")}
    timings = []
    logs = ROOT / "build" / "dist-logs"
    logs.mkdir(parents=True, exist_ok=True)
    for name in names:
        log = logs / f"{name}.log"
        print(f"dist: building {name} (sdist, then the wheel from it; log: {log.relative_to(ROOT)})", file=sys.stderr)
        t0 = time.monotonic()
        cmd = [sys.executable, "-m", "build", "--outdir", str(out), str(ROOT / "packages" / name)]
        with open(log, "w") as f:
            proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT)
            while proc.poll() is None:
                try:
                    proc.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    print(f"dist: {name}: still building ({time.monotonic() - t0:.0f} s)", file=sys.stderr, flush=True)
        if proc.returncode != 0:
            tail = log.read_text(errors="replace").splitlines()[-60:]
            print("\n".join(tail), file=sys.stderr)
            return fail(
                f"building {name} failed (exit status {proc.returncode}; the end of {log.relative_to(ROOT)} is above)"
            )
        timings.append((name, time.monotonic() - t0))

    files = sorted(p for p in out.iterdir() if p.suffix == ".whl" or p.name.endswith(".tar.gz"))
    if subprocess.run([sys.executable, "-m", "twine", "check", "--strict", *map(str, files)]).returncode != 0:
        return fail("twine check failed")
    print(f"dist: {len(files)} files in {out.relative_to(ROOT) if out.is_relative_to(ROOT) else out}:")
    for p in files:
        print(f"  {p.name}  {p.stat().st_size / 1e6:.2f} MB")
    print("dist: " + ", ".join(f"{n} {s:.0f} s" for n, s in timings))
    return 0


if __name__ == "__main__":
    sys.exit(main())
