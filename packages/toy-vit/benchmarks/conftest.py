"""Benchmarks of toy-vit: ``record`` comes from the repository's root
conftest.py; each benchmark starts its records on a line of its own. The
Hugging Face peer never goes online (its models are built from configs)."""

import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


@pytest.fixture(autouse=True)
def _own_line(bench_line):
    yield
