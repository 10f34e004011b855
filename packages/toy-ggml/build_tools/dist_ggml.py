#!/usr/bin/env python3
"""meson dist script: put the patched ggml tree into toy-ggml's sdist.

ggml is not committed (``tools/fetch_ggml.py`` lays it out, patched, in
``subprojects/ggml``), so ``meson dist`` would pack an sdist that cannot
build. This script, registered with ``meson.add_dist_script``, copies the
laid-out tree into the dist folder (``$MESON_DIST_ROOT/subprojects/ggml``),
so ``pip install toy-ggml-<v>.tar.gz`` builds with no network beyond the
package index (for its build requirements).

Only what toy-ggml's backends build from is copied: the CMake files, the
headers, the core sources and the CPU, RPC, CUDA and Metal backends (with
the stamp that names the source and the patch set); the other backends'
folders (Vulkan, SYCL, OpenCL, ...) are left out, which ggml's CMake never
reads unless they are enabled.
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

KEEP_BACKENDS = {"ggml-cpu", "ggml-cuda", "ggml-metal", "ggml-rpc"}


def main() -> int:
    src = Path(os.environ["MESON_PROJECT_SOURCE_ROOT"]) / "subprojects" / "ggml"
    dest = Path(os.environ["MESON_PROJECT_DIST_ROOT"]) / "subprojects" / "ggml"
    if not (src / ".toy-stamp.json").is_file():
        print(f"error: {src} is not laid out: run `python tools/fetch_ggml.py` first", file=sys.stderr)
        return 1

    def ignore(folder: str, names: list[str]) -> set[str]:
        if Path(folder).resolve() == (src / "src").resolve():
            return {n for n in names if n.startswith("ggml-") and (src / "src" / n).is_dir() and n not in KEEP_BACKENDS}
        return set()

    if dest.exists():
        shutil.rmtree(dest)
    shutil.copytree(src, dest, ignore=ignore)
    return 0


if __name__ == "__main__":
    sys.exit(main())
