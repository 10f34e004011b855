"""Shared pieces of the toy_ggml benchmarks.

Benchmarks report, they do not gate: each figure is printed as one JSON line
on stdout (``just bench`` runs pytest with ``-s``), with at least the keys
``bench``, ``figure``, ``value`` and ``unit``, plus whatever context makes it
readable (threads, shape, the peer it was measured against in the same run
and the ratio to it, a target and whether it was met). Lines start with ``{``
so ``grep '^{'`` pulls them out of pytest's own output.
"""

from __future__ import annotations

import json
import math
import sys

import pytest


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


@pytest.fixture(autouse=True)
def _own_line():
    # pytest -q -s prints the file name / progress dots without a newline;
    # start each benchmark's records on a line of their own.
    sys.stdout.write("\n")
    sys.stdout.flush()
    yield
