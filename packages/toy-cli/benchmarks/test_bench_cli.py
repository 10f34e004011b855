"""Wall time of ``toy --help`` and ``toy describe`` on the real model, each
in a fresh process (target: at most 0.3 s each), beside a bare interpreter
start, ``import toy_ggml`` alone and ``toy --version`` in the same run, so the
share that is start-up (Python, NumPy, toy_ggml, typer) is visible.

Each round runs every command once, in turn, so all of them see the same
machine noise; each figure is the best of ``$TOY_BENCH_CLI_REPS`` (7) rounds
(the median is in the record too, and ``cpu_s``, the least user + system CPU
time of the process and its children, which a busy machine disturbs less). Commands run as ``python -m toy_cli`` with
this interpreter. In a development install (``pip install -e``, meson-python)
``import toy_ggml`` first asks ninja whether the extension is up to date, a
subprocess an installed wheel does not run; ``import_toy_ggml_s`` includes it.
The children run with bytecode caches, as an installed wheel does (pip compiles
at install): ``PYTHONDONTWRITEBYTECODE``, set on some machines, is dropped from
their environment, so the first round writes the ``.pyc`` files of an editable
checkout instead of every round compiling toy's modules from source.
"""

from __future__ import annotations

import os
import resource
import statistics
import subprocess
import sys
import time

import pytest

pytestmark = pytest.mark.bench

TARGET_S = 0.3
REPS = int(os.environ.get("TOY_BENCH_CLI_REPS", "7"))
ENV = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}


def cpu_of_children() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def wall(cmd: list[str]) -> tuple[float, float]:
    """(wall seconds, CPU seconds: user + system of the process and its children)."""
    c = cpu_of_children()
    t = time.perf_counter()
    p = subprocess.run(cmd, capture_output=True, timeout=120, env=ENV)
    w = time.perf_counter() - t
    assert p.returncode == 0, p.stderr
    return w, cpu_of_children() - c


def test_cli_wall_time(record, smollm2_path):
    py = sys.executable
    cmds = {
        "bare": [py, "-c", "pass"],
        "import_toy_ggml": [py, "-c", "import toy_ggml"],
        "version": [py, "-m", "toy_cli", "--version"],
        "help": [py, "-m", "toy_cli", "--help"],
        "describe": [py, "-m", "toy_cli", "describe", str(smollm2_path)],
    }
    for cmd in cmds.values():  # warm the page cache and the interpreter's bytecode cache
        wall(cmd)
    walls: dict[str, list[float]] = {name: [] for name in cmds}
    cpus: dict[str, list[float]] = {name: [] for name in cmds}
    load_before = os.getloadavg()[0]
    for _ in range(REPS):
        for name, cmd in cmds.items():
            w, c = wall(cmd)
            walls[name].append(w)
            cpus[name].append(c)
    load_after = os.getloadavg()[0]
    best = {name: min(w) for name, w in walls.items()}
    context = {
        "reps": REPS,
        "peer": "python -c pass",
        "peer_value": best["bare"],
        "import_toy_ggml_s": best["import_toy_ggml"],
        "toy_version_s": best["version"],
        "loadavg_before": load_before,
        "loadavg_after": load_after,
    }
    for name, figure in (("help", "toy --help (fresh process)"), ("describe", "toy describe SmolLM2 (fresh process)")):
        record(
            "cli",
            figure=figure,
            value=best[name],
            unit="s",
            stat="best",
            median=statistics.median(walls[name]),
            cpu_s=min(cpus[name]),
            target=TARGET_S,
            met=best[name] <= TARGET_S,
            ratio=best[name] / best["bare"],
            **context,
        )
