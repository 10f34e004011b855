"""Build llama.cpp's ``llama-server`` (dev-only: the serving benchmark's peer).

The source is the llama.cpp vendored in the ``llama-cpp-python==0.3.36`` sdist that
``tools/fetch_ggml.py`` downloads and caches (the same ggml toy builds, without toy's
patches). The CPU flags equal those of the ggml CPU variant toy loads on this machine
(``toy_ggml.cpu_variant().tag``, e.g. ``zen4``): the variant's feature list from ggml's own
table (``src/CMakeLists.txt``) becomes ``GGML_<FEATURE>=ON`` with ``GGML_NATIVE=OFF``, so
both sides run the same kernels' instruction sets. One static CPU backend, no CURL, no
tests or examples.

    python tools/build_llama_server.py            # prints the binary's path
    python tools/build_llama_server.py --variant haswell

The build goes to ``$TOY_HOME/llama-server/<sdist version>-<variant>/`` (default
``~/.cache/toy``) and is reused when the binary is there; about 10 minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))

import fetch_ggml  # noqa: E402  (the sdist's pinned name, hash and cache)

PREFIX = "llama_cpp_python-0.3.36/vendor/llama.cpp/"


def sdist_path() -> Path:
    cached = fetch_ggml.DEST.parent / "packagecache" / fetch_ggml.SDIST_NAME
    if not cached.is_file():
        fetch_ggml.run(None, force=True)
    if fetch_ggml.sha256(cached) != fetch_ggml.SDIST_SHA256:
        raise SystemExit(f"build_llama_server: {cached} does not have the pinned sha256")
    return cached


def variant_features(src: Path, tag: str) -> list[str]:
    """The features of ggml's CPU variant ``tag`` (its ggml_add_cpu_backend_variant line)."""
    text = (src / "ggml" / "src" / "CMakeLists.txt").read_text()
    m = re.search(rf"ggml_add_cpu_backend_variant\({re.escape(tag)}\b([^)]*)\)", text)
    if m is None:
        raise SystemExit(f"build_llama_server: ggml has no CPU variant {tag!r}")
    return m.group(1).split()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--variant", help="ggml CPU variant tag (default: the one toy_ggml loads here)")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 2)
    args = ap.parse_args()
    tag = args.variant
    if tag is None:
        import toy_ggml

        tag = toy_ggml.cpu_variant().tag
    home = Path(os.environ.get("TOY_HOME", Path.home() / ".cache" / "toy"))
    base = home / "llama-server" / f"0.3.36-{tag}"
    binary = base / "build" / "bin" / "llama-server"
    if binary.is_file():
        print(binary)
        return
    src = base / "src"
    if not (src / "CMakeLists.txt").is_file():
        shutil.rmtree(src, ignore_errors=True)
        fetch_ggml.extract(sdist_path(), src, PREFIX)
    feats = variant_features(src, tag)
    defines = {
        "CMAKE_BUILD_TYPE": "Release",
        "BUILD_SHARED_LIBS": "OFF",
        "GGML_NATIVE": "OFF",
        "GGML_BACKEND_DL": "OFF",
        "GGML_OPENMP": "OFF",
        "LLAMA_CURL": "OFF",
        "LLAMA_BUILD_TESTS": "OFF",
        "LLAMA_BUILD_EXAMPLES": "OFF",
        "LLAMA_BUILD_TOOLS": "ON",
        "LLAMA_BUILD_SERVER": "ON",
        **{f"GGML_{f}": "ON" for f in feats},
    }
    print(f"build_llama_server: llama-server for CPU variant {tag} ({' '.join(feats) or 'baseline'})", file=sys.stderr)
    cmd = ["cmake", "-S", str(src), "-B", str(base / "build"), *[f"-D{k}={v}" for k, v in defines.items()]]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    build = ["cmake", "--build", str(base / "build"), "--target", "llama-server", "-j", str(args.jobs)]
    subprocess.run(build, check=True, stdout=subprocess.DEVNULL)
    if not binary.is_file():
        raise SystemExit(f"build_llama_server: the build did not produce {binary}")
    print(binary)


if __name__ == "__main__":
    main()
