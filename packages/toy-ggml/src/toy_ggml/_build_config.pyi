"""Type stub of toy_ggml._build_config, which meson generates from _build_config.py.in into the build
directory (mypy, reading the source tree, finds no module there without this stub).

Keep it in step with the .in template (``just lint`` compares them: mypy's stubtest).
"""

BACKEND: str
NATIVE: bool
CPU_VARIANTS: tuple[str, ...]
GGML_VERSION: str
SOURCE: str
PATCHES: tuple[str, ...]
