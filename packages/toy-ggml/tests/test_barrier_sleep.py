"""Toy patch 0021: ggml_barrier spins for ``TOY_GGML_SPIN_US`` (read when a
thread pool is made) and then sleeps on a futex, woken by the last thread in.

Each case runs in a child process (the spin time is read from its
environment) that computes a graph of 60 dependent nodes 40 times and prints
the output's bytes' hash and the voluntary context switches of its threads
(``/proc/self/task/*/status``: a thread that sleeps in the barrier switches
voluntarily; one that spins does not). Expected: the same bits as one thread
with the default spin, whatever the spin time and thread count, also while
another process keeps a core busy; with a spin time of 0 the threads sleep
(many more voluntary switches than with a spin of one second, where they
sleep only between graphs); and no child hangs (a lost wake-up would: each
child has a time limit).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from contextlib import contextmanager

import pytest

CHILD = r"""
import hashlib, json, os, sys
import numpy as np
import toy_ggml as tg

def switches():
    n = 0
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/status") as f:
                for line in f:
                    if line.startswith("voluntary_ctxt_switches"):
                        n += int(line.split()[1])
        except OSError:
            pass
    return n

threads = int(sys.argv[1])
rng = np.random.default_rng(7)
ws = [rng.standard_normal((32, 32)).astype(np.float32) * 0.2 for _ in range(20)]
x = rng.standard_normal((5, 32)).astype(np.float32)
with tg.Runtime("cpu", threads=threads) as rt, tg.Context() as ctx:
    wt = [ctx.tensor(tg.GGMLType.F32, w.shape) for w in ws]
    xt = ctx.tensor(tg.GGMLType.F32, x.shape)
    h = xt
    for w in wt:  # 3 nodes a layer, each waiting for the one before
        h = ctx.add(ctx.gelu(ctx.mul_mat(w, h)), h)
    g = tg.Graph(ctx).build_forward(h)
    ctx.allocate(rt)
    for t, w in zip(wt, ws):
        t.set(w)
    xt.set(x)
    rt.compute(g)
    before = switches()
    for _ in range(40):
        rt.compute(g)
    after = switches()
    print(json.dumps({"hash": hashlib.sha256(h.numpy().tobytes()).hexdigest(), "switches": after - before}))
"""


def run(threads: int, spin_us: int | None) -> dict:
    env = dict(os.environ)
    env.pop("TOY_GGML_SPIN_US", None)
    if spin_us is not None:
        env["TOY_GGML_SPIN_US"] = str(spin_us)
    proc = subprocess.run(
        [sys.executable, "-c", CHILD, str(threads)], capture_output=True, text=True, env=env, timeout=60, check=False
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@contextmanager
def busy_core():
    code = "import time\nend = time.monotonic() + 60\nwhile time.monotonic() < end:\n    pass\n"
    child = subprocess.Popen([sys.executable, "-c", code])
    try:
        time.sleep(0.2)
        yield
    finally:
        child.kill()
        child.wait()


@pytest.fixture(scope="module")
def reference() -> str:
    return run(1, None)["hash"]


@pytest.mark.parametrize("spin_us", [None, 0, 1000000])
def test_the_spin_time_changes_no_bit(reference, spin_us):
    assert run(2, spin_us)["hash"] == reference


def test_no_bit_changes_while_a_core_is_busy(reference):
    with busy_core():
        assert run(2, 0)["hash"] == reference
        assert run(2, None)["hash"] == reference


def test_threads_sleep_in_the_barrier_after_the_spin_time():
    sleeping = run(2, 0)["switches"]
    spinning = run(2, 1000000)["switches"]
    # 40 graphs of 60 nodes: ~2400 barriers; spinning for up to a second, a thread
    # sleeps only between graphs (~40 times per worker)
    assert sleeping > spinning + 200, (sleeping, spinning)
