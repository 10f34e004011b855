"""Build toy-core's small Cython helpers (everything else is pure Python)."""

from Cython.Build import cythonize
from setuptools import Extension, setup

setup(
    ext_modules=cythonize(
        [
            Extension("toy._native.gguf_scan", ["src/toy/_native/gguf_scan.pyx"]),
            Extension("toy._native.pieces", ["src/toy/_native/pieces.pyx"]),
        ],
        compiler_directives={"language_level": "3"},
    )
)
