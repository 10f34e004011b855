"""Wall time of `toy describe` on the real model in a fresh process (target
under 0.3 s), beside a bare interpreter start and `toy --version` in the same
run, so the share that is start-up (Python, numpy, typer) is visible."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

pytestmark = pytest.mark.bench


def best_of(cmd: list[str], n: int = 5) -> float:
    walls = []
    for _ in range(n):
        t = time.perf_counter()
        p = subprocess.run(cmd, capture_output=True, timeout=120)
        walls.append(time.perf_counter() - t)
        assert p.returncode == 0, p.stderr
    return min(walls)


def test_describe_wall_time(record, smollm2_path):
    bare = best_of([sys.executable, "-c", "pass"])
    version = best_of([sys.executable, "-m", "toy_cli", "--version"])
    describe = best_of([sys.executable, "-m", "toy_cli", "describe", str(smollm2_path)])
    record(
        "cli",
        figure="toy describe SmolLM2 (fresh process)",
        value=describe,
        unit="s",
        target=0.3,
        met=describe < 0.3,
        peer="python -c pass",
        peer_value=bare,
        ratio=describe / bare,
        toy_version_s=version,
    )
