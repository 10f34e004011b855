"""Fixtures shared by toy-core's tests (the helper modules are the
test-support package's, ``toy_testsupport``).

- ``rt``: a CPU ``toy_ggml.Runtime`` with 2 threads, one per test module
  (a module that needs other settings defines its own ``rt``).
"""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def rt():
    import toy_ggml

    r = toy_ggml.Runtime("cpu", threads=2)
    yield r
    r.close()
