"""The default thread count under load (issue 41): ``toy_ggml.load``'s
sampler and thread choice, ``runtime_threads``' precedence, and
``Runtime(adaptive=True)``.

Expected values are worked out by hand from the module's rule (a busy
process on one of two cores leaves one of two threads), from NumPy, or from
a fixed-thread Runtime; the one test on the real machine spawns a process
that spins on a core (ending by itself after 30 s) and asks only that the
sampler sees it, not how fast anything runs.
"""

from __future__ import annotations

import subprocess
import sys
import time

import numpy as np
import pytest

import toy_ggml as tg
from toy_ggml import load

STAT = """cpu  700 10 200 1000 40 0 30 20 0 0
cpu0 300 5 100 600 20 0 10 10 0 0
cpu1 400 5 100 400 20 0 20 10 0 0
intr 12345 0 0
ctxt 999
procs_running 3
procs_blocked 0
"""


def test_read_cpu_times_sums_the_allowed_cpus():
    tick = load._TICK_S
    both = load.read_cpu_times(STAT, {0, 1})
    # busy = user+nice+system+irq+softirq+steal; idle and iowait are not busy
    assert both.busy == pytest.approx((300 + 5 + 100 + 10 + 10 + 400 + 5 + 100 + 20 + 10) * tick)
    assert both.total == pytest.approx((1045 + 955) * tick)  # user..steal of cpu0 and cpu1
    assert (both.cpus, both.running) == (2, 3)
    one = load.read_cpu_times(STAT, {1})
    assert one.busy == pytest.approx((400 + 5 + 100 + 20 + 10) * tick)
    assert one.total == pytest.approx(955 * tick)
    assert one.cpus == 1
    assert one.own > 0  # this process's CPU time so far


def test_read_cpu_times_without_per_cpu_lines_uses_the_total():
    t = load.read_cpu_times("cpu  700 10 200 1000 40 0 30 20\nprocs_running 1\n", None)
    assert t.busy == pytest.approx((700 + 10 + 200 + 30 + 20) * load._TICK_S)
    assert t.total == pytest.approx(2000 * load._TICK_S)


@pytest.mark.parametrize("text", ["", "cpu0 a b c\n", "intr 1\n"])
def test_read_cpu_times_of_unreadable_text_is_none(text):
    assert load.read_cpu_times(text, None) is None


def test_others_cores_subtracts_this_process():
    a = load.CpuTimes(busy=10.0, total=100.0, own=1.0, cpus=2, running=1)
    # one second of wall time on 2 CPUs: 2 s of CPU time passed, 1.5 s busy, 0.4 s of it ours
    b = load.CpuTimes(busy=11.5, total=102.0, own=1.4, cpus=2, running=1)
    assert load.others_cores(a, b) == pytest.approx(1.1)
    assert load.others_cores(a, a) is None
    # our own time counted in another window than the machine's: never below zero
    c = load.CpuTimes(busy=10.1, total=102.0, own=1.5, cpus=2, running=1)
    assert load.others_cores(a, c) == 0.0


@pytest.mark.parametrize(
    ("n_max", "others", "cpus", "want"),
    [
        (2, 0.0, 2, 2),
        (2, 0.4, 2, 2),  # a little background work: both threads
        (2, 0.6, 2, 1),
        (2, 1.0, 2, 1),  # a busy process on one of two cores: one thread (issue 41)
        (2, 2.0, 2, 1),  # never fewer than one
        (4, 1.0, 8, 3),  # 4 physical cores, 8 CPUs: one busy CPU takes half a core, rounded up
        (8, 0.2, 8, 8),
        (1, 0.0, 2, 1),
    ],
)
def test_threads_for(n_max, others, cpus, want):
    assert load.threads_for(n_max, others, cpus) == want


class FakeMachine:
    """A clock and a /proc/stat reader whose other-process load is set by the test."""

    def __init__(self, cpus=2):
        self.t = 0.0
        self.cpus = cpus
        self.busy = self.own = 0.0
        self.others = 0.0  # cores' worth of other processes from now on
        self.running = 1
        self.reads = 0

    def advance(self, seconds, own_cores=1.0):
        self.t += seconds
        self.busy += (self.others + own_cores) * seconds
        self.own += own_cores * seconds

    def read(self):
        self.reads += 1
        return load.CpuTimes(self.busy, self.t * self.cpus, self.own, self.cpus, self.running)


def test_sampler_follows_the_load_every_period():
    m = FakeMachine()
    s = load.LoadSampler(period=0.5, read=m.read, clock=lambda: m.t)
    m.advance(0.2)
    assert s.threads(2) == 2 and s.others == pytest.approx(0.0)
    m.others = 1.0
    m.advance(0.3)
    reads = m.reads
    assert s.threads(2) == 2  # within the period: the last decision, nothing read
    assert m.reads == reads
    m.advance(0.3)  # 0.6 s since the last sample, all of them with the busy process
    assert s.threads(2) == 1
    assert s.others == pytest.approx(1.0)
    m.others = 0.0
    m.advance(0.2)
    m.others = 1.0
    m.advance(0.4)  # a busy process for 0.4 of the 0.6 s: 2/3 of a core, still one thread
    assert s.threads(2) == 1
    assert s.others == pytest.approx(0.4 / 0.6)
    m.others = 0.0
    m.advance(0.6)
    assert s.threads(2) == 2
    assert s.threads(1) == 1


def test_sampler_first_decision_on_a_short_window_counts_running_tasks():
    m = FakeMachine()
    s = load.LoadSampler(period=0.5, read=m.read, clock=lambda: m.t)
    m.advance(0.01)
    m.running = 2  # this thread and one other
    assert s.threads(2) == 1
    m.running = 1
    assert s.threads(2) == 2
    assert s.others is None  # no window measured yet
    m.advance(0.1)
    assert s.threads(2) == 2 and s.others is not None


def test_sampler_without_proc_stat_keeps_every_thread():
    s = load.LoadSampler(read=lambda: None)
    assert s.threads(4) == 4


def test_runtime_threads_precedence(monkeypatch):
    monkeypatch.delenv("TOY_THREADS", raising=False)
    n = tg.physical_cores()
    assert tg.runtime_threads() == (n, n > 1)
    assert tg.runtime_threads(3) == (3, False)  # --threads: as given
    monkeypatch.setenv("TOY_THREADS", "3")
    assert tg.runtime_threads() == (3, False)
    assert tg.runtime_threads(1) == (1, False)
    with pytest.raises(ValueError, match="threads=0"):
        tg.runtime_threads(0)


def _mlp(rt, w1, w2, x):
    with tg.Context() as ctx:
        a, b, c = (ctx.tensor(tg.GGMLType.F32, v.shape) for v in (w1, w2, x))
        y = ctx.soft_max(ctx.mul_mat(b, ctx.gelu(ctx.mul_mat(a, c))))
        g = tg.Graph(ctx).build_forward(y)
        ctx.allocate(rt)
        for t, v in zip((a, b, c), (w1, w2, x)):
            t.set(v)
        rt.compute(g)
        return y.numpy()


def test_adaptive_runtime_switching_threads_gives_the_same_bits(rng):
    w1 = rng.standard_normal((96, 64)).astype(np.float32)
    w2 = rng.standard_normal((48, 96)).astype(np.float32)
    x = rng.standard_normal((9, 64)).astype(np.float32)
    with tg.Runtime("cpu", threads=1) as rt:
        want = _mlp(rt, w1, w2, x)
    assert not tg.Runtime("cpu", threads=1, adaptive=True).adaptive  # one thread: nothing to adapt
    with tg.Runtime("cpu", threads=2, adaptive=True) as rt:
        assert rt.adaptive and rt.threads == 2
        assert "adaptive" in repr(rt)
        sampler = load.shared_sampler()
        choices = iter([1, 2, 1, 2])
        sampler.threads = lambda n: next(choices)  # an instance attribute: this test's choices
        try:
            for n in (1, 2, 1, 2):
                np.testing.assert_array_equal(_mlp(rt, w1, w2, x), want)
                assert rt.active_threads == n
        finally:
            del sampler.threads
    with tg.Runtime("cpu", threads=2) as rt:
        assert not rt.adaptive and rt.active_threads == 2


def test_sampler_sees_a_busy_process():
    """A child spinning on a core for the whole window: the sampler counts
    most of a core for other processes and leaves at least one core's threads
    out (on 2 cores: 1 of 2 threads)."""
    code = "import time\nend = time.monotonic() + 30\nwhile time.monotonic() < end:\n    pass\n"
    child = subprocess.Popen([sys.executable, "-c", code])
    try:
        time.sleep(0.3)  # the child is running
        s = load.LoadSampler(period=0.5)
        time.sleep(1.5)
        n = max(2, tg.physical_cores())
        got = s.threads(n)
        assert s.others is not None and s.others >= 0.7, s.others
        if s._last.cpus <= n:  # a thread per CPU (no hyper-threads): one thread fewer at least
            assert got <= n - 1
    finally:
        child.kill()
        child.wait()
