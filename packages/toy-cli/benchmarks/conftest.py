"""Benchmarks of the toy command: ``record`` comes from the repository's root
conftest.py; each benchmark starts its records on a line of its own."""

import pytest


@pytest.fixture(autouse=True)
def _own_line(bench_line):
    yield
