"""toy_ggml_cuda: ggml's CUDA backend for toy_ggml, as a module it loads at run time.

This package holds one library, ``libggml-cuda.so`` (ggml's CUDA backend built
as a loadable module), and ``build-info.json``: the compute capabilities it was
compiled for, nvcc's version and the ggml source (version and patch set) it
came from. ``toy_ggml`` finds this folder when it is imported and loads the
library through ggml's backend registry after its CPU backend; nothing here
needs to be imported for that, and this module imports nothing of toy_ggml
(toy_ggml reads the same two files without importing it).

The library needs the CUDA runtime and cuBLAS of NVIDIA's wheels
(``nvidia-cuda-runtime``, ``nvidia-cublas``), which its run path finds in
``site-packages/nvidia/cu13/lib``, and an NVIDIA driver at run time for any
device to appear; it does not link the driver, so it loads without one and
then reports no device. ``toy devices`` says what happened.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

__version__ = "0.1.0"

LIBRARY = "libggml-cuda.so"
BUILD_INFO = "build-info.json"

_HERE = Path(__file__).resolve().parent


def library_path() -> Path:
    """The CUDA backend module (``libggml-cuda.so``) in this package's folder."""
    return _HERE / LIBRARY


def build_info() -> dict[str, Any]:
    """What the module was built for: ``archs`` (compute capabilities, e.g. ``["80", "86", "89", "90"]``),
    ``cuda_version`` (nvcc's, e.g. ``"13.0"``), ``no_vmm``, and the ggml source: ``ggml_version``,
    ``source`` and ``patches`` (name and sha256 of each toy patch applied)."""
    info: dict[str, Any] = json.loads((_HERE / BUILD_INFO).read_text(encoding="utf-8"))
    return info


__all__ = ["BUILD_INFO", "LIBRARY", "build_info", "library_path"]
