#!/usr/bin/env python3
"""meson dist script: make toy-ggml-cuda's sdist build on its own.

In a checkout, the plugin compiles the patched ggml tree of toy-ggml
(``packages/toy-ggml/subprojects/ggml``, laid out by ``tools/fetch_ggml.py``,
not committed) with toy-ggml's ``build_tools/build_ggml.py``. ``meson dist``
packs only this folder's committed files, so this script, registered with
``meson.add_dist_script``, copies both into the dist folder
(``subprojects/ggml`` and ``build_tools/build_ggml.py``), where meson.build
looks first. Of ggml's backends only the folders CMake reads for this build
are copied: ``ggml-cuda``, and ``ggml-cpu`` (configured, never compiled, by
``ninja ggml-cuda``).
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

KEEP_BACKENDS = {"ggml-cpu", "ggml-cuda"}


def main() -> int:
    here = Path(os.environ["MESON_PROJECT_SOURCE_ROOT"])
    dist = Path(os.environ["MESON_PROJECT_DIST_ROOT"])
    ggml_pkg = here.parent / "toy-ggml"
    src = here / "subprojects" / "ggml"
    if not (src / ".toy-stamp.json").is_file():  # a checkout: toy-ggml's tree
        src = ggml_pkg / "subprojects" / "ggml"
    script = here / "build_tools" / "build_ggml.py"
    if not script.is_file():
        script = ggml_pkg / "build_tools" / "build_ggml.py"
    if not (src / ".toy-stamp.json").is_file():
        print(f"error: {src} is not laid out: run `python tools/fetch_ggml.py` first", file=sys.stderr)
        return 1
    if not script.is_file():
        print(f"error: {script} is missing", file=sys.stderr)
        return 1

    def ignore(folder: str, names: list[str]) -> set[str]:
        if Path(folder).resolve() == (src / "src").resolve():
            return {n for n in names if n.startswith("ggml-") and (src / "src" / n).is_dir() and n not in KEEP_BACKENDS}
        return set()

    dest = dist / "subprojects" / "ggml"
    if dest.exists():
        shutil.rmtree(dest)
    shutil.copytree(src, dest, ignore=ignore)
    (dist / "build_tools").mkdir(exist_ok=True)
    shutil.copy2(script, dist / "build_tools" / "build_ggml.py")
    return 0


if __name__ == "__main__":
    sys.exit(main())
