#!/usr/bin/env python3
"""Lay out the pinned, patched ggml source tree that toy-ggml builds from.

ggml is not committed. Its source comes from one registry artifact: the sdist
of ``llama-cpp-python==0.3.36`` on PyPI, which carries ggml 0.25.3 under
``vendor/llama.cpp/ggml``. This script

1. downloads that sdist with ``pip download`` (no other channel),
2. checks its sha256 against the pin below,
3. extracts only the ``ggml/`` tree into a temporary folder,
4. adds what the tree lacks to build standalone (``ggml.pc.in``),
5. applies every ``packages/toy-ggml/patches/*.patch`` in name order,
6. moves the result to ``packages/toy-ggml/subprojects/ggml`` and writes a stamp.

A second run with the same pin and patch set is a no-op (the stamp matches).
When the patch set changes, the tree is re-extracted from scratch. Any failure
stops with one ``error:`` line and exit status 1; the previous tree is left as
it was, because the new one is assembled aside and swapped in at the end.

Usage: ``python tools/fetch_ggml.py [--sdist PATH] [--force]``. ``--sdist``
uses an already downloaded archive (it is still hash-checked).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

PACKAGE = "llama-cpp-python"
VERSION = "0.3.36"
SDIST_NAME = "llama_cpp_python-0.3.36.tar.gz"
SDIST_SHA256 = "832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e"
GGML_VERSION = "0.25.3"
GGML_PREFIX = "llama_cpp_python-0.3.36/vendor/llama.cpp/ggml/"

ROOT = Path(__file__).resolve().parent.parent
PKG = ROOT / "packages" / "toy-ggml"
PATCH_DIR = PKG / "patches"
DEST = PKG / "subprojects" / "ggml"
STAMP = ".toy-stamp.json"

# ggml's CMakeLists configures this file only when built standalone; the sdist
# does not ship it. Meson's cmake module builds the tree standalone.
GGML_PC_IN = """prefix=@CMAKE_INSTALL_PREFIX@
exec_prefix=${prefix}
includedir=${prefix}/include
libdir=${prefix}/lib

Name: ggml
Description: tensor library (pinned and patched for toy)
Version: @GGML_INSTALL_VERSION@
Cflags: -I${includedir}
Libs: -L${libdir} -lggml -lggml-base
"""


class FetchError(Exception):
    pass


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def patch_set() -> list[dict[str, str]]:
    return [{"name": p.name, "sha256": sha256(p)} for p in sorted(PATCH_DIR.glob("*.patch"))]


def wanted_stamp() -> dict:
    return {
        "source": f"{PACKAGE}=={VERSION}",
        "sdist_sha256": SDIST_SHA256,
        "ggml_version": GGML_VERSION,
        "patches": patch_set(),
    }


def current_stamp() -> dict | None:
    try:
        return json.loads((DEST / STAMP).read_text())
    except (OSError, ValueError):
        return None


def download(tmp: Path) -> Path:
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--no-binary",
        PACKAGE,
        "--disable-pip-version-check",
        "-q",
        "-d",
        str(tmp),
        f"{PACKAGE}=={VERSION}",
    ]
    print(f"fetch_ggml: downloading {PACKAGE}=={VERSION} sdist with pip", file=sys.stderr)
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True)
    except OSError as e:
        raise FetchError(f"could not run pip ({e}); install pip for {sys.executable}") from None
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
        raise FetchError(
            f"pip could not download {PACKAGE}=={VERSION} (no network or no package index?): " + " | ".join(tail)
        )
    path = tmp / SDIST_NAME
    if not path.exists():
        raise FetchError(f"pip finished but {SDIST_NAME} is not in {tmp}")
    return path


def extract(sdist: Path, out: Path, prefix: str = GGML_PREFIX) -> None:
    """The sdist's ``prefix`` tree (default: the vendored ggml) into ``out``: plain files and folders only."""
    with tarfile.open(sdist, "r:gz") as tar:
        members = [m for m in tar.getmembers() if m.name.startswith(prefix)]
        if not members:
            raise FetchError(f"{sdist.name} has no {prefix} tree")
        for m in members:
            if not (m.isfile() or m.isdir()):
                continue  # no links or devices from an archive
            rel = m.name[len(prefix) :]
            if not rel or rel.startswith("/") or ".." in Path(rel).parts:
                continue
            target = out / rel
            if m.isdir():
                target.mkdir(parents=True, exist_ok=True)
                continue
            target.parent.mkdir(parents=True, exist_ok=True)
            src = tar.extractfile(m)
            assert src is not None
            with open(target, "wb") as f:
                shutil.copyfileobj(src, f)
            os.chmod(target, 0o644)


def apply_patches(tree: Path) -> None:
    git = shutil.which("git")
    patch = shutil.which("patch")
    for p in sorted(PATCH_DIR.glob("*.patch")):
        if git:
            # The tree is outside any repository (a temp dir), so paths resolve
            # against it, not against toy's checkout.
            cmd = [git, "apply", "--whitespace=nowarn", "-p1", str(p)]
        elif patch:
            cmd = [patch, "-p1", "--forward", "--batch", "-i", str(p)]
        else:
            raise FetchError("neither git nor patch is installed; one is needed to apply patches")
        env = dict(os.environ, GIT_CEILING_DIRECTORIES=str(tree.parent))
        proc = subprocess.run(cmd, cwd=tree, capture_output=True, text=True, env=env)
        if proc.returncode != 0:
            raise FetchError(f"patch {p.name} does not apply: {(proc.stderr or proc.stdout).strip()}")
        print(f"fetch_ggml: applied {p.name}", file=sys.stderr)


def run(sdist_arg: str | None, force: bool) -> None:
    want = wanted_stamp()
    if not force and current_stamp() == want:
        print(f"fetch_ggml: {DEST.relative_to(ROOT)} is up to date", file=sys.stderr)
        return
    DEST.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="toy-ggml-") as tmp_s:
        tmp = Path(tmp_s)
        cached = DEST.parent / "packagecache" / SDIST_NAME
        if sdist_arg:
            sdist = Path(sdist_arg)
        elif cached.is_file() and sha256(cached) == SDIST_SHA256:
            sdist = cached
        else:
            sdist = download(tmp)
        if not sdist.is_file():
            raise FetchError(f"no such file: {sdist}")
        got = sha256(sdist)
        if got != SDIST_SHA256:
            raise FetchError(f"sha256 mismatch for {sdist.name}: got {got}, pinned {SDIST_SHA256}")
        if sdist != cached and not sdist_arg:
            cached.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(sdist, cached)  # re-extractions after a patch change need no download
        tree = tmp / "ggml"
        tree.mkdir()
        extract(sdist, tree)
        (tree / "ggml.pc.in").write_text(GGML_PC_IN)
        apply_patches(tree)
        (tree / STAMP).write_text(json.dumps(want, indent=2) + "\n")
        # Swap in: build aside, then replace, so a failure leaves the old tree.
        staged = DEST.parent / ".ggml.new"
        if staged.exists():
            shutil.rmtree(staged)
        shutil.copytree(tree, staged)
        if DEST.exists():
            shutil.rmtree(DEST)
        staged.rename(DEST)
    print(f"fetch_ggml: ggml {GGML_VERSION} ready in {DEST.relative_to(ROOT)}", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sdist", help="use this already downloaded sdist (hash-checked)")
    ap.add_argument("--force", action="store_true", help="re-extract even if the stamp matches")
    args = ap.parse_args(argv)
    try:
        run(args.sdist, args.force)
    except FetchError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
