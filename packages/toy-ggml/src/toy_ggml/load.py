"""How busy the machine is, seen from this process, and the CPU thread count
that leaves room for it (the default thread count of inference).

ggml's threads meet at a barrier after every node of a graph, so a graph
runs at the pace of its slowest thread. When another process keeps one of
two cores busy, a second thread spends most of its time waiting for a core,
and ``-t 2`` decodes at half the speed of ``-t 1`` (issue 41; the figures
are in the inference guide). A ``Runtime(adaptive=True)`` therefore asks a
``LoadSampler`` before each compute how many of its threads to use: every
``period`` seconds (0.5) the sampler reads the CPU time the machine spent
(``/proc/stat``, only the CPUs this process may run on) and this process's
own (``os.times``), and takes the difference over the last window as the
cores' worth that other processes used. Of ``n`` threads it keeps ``n``
minus those cores in this machine's proportion of threads to CPUs, rounded
(so a busy process on one of two cores leaves one thread), at least one.

This is only valid where the result does not depend on the thread count:
true of inference graphs (the products split rows or columns between the
threads, never a sum) and, since patch 0022 made the cross-entropy loss add
its rows in a fixed order, of training graphs; the tests check both bit for
bit. (Flash attention's split-key kernel sums in an order set by the thread
count: on an adaptive runtime the engine uses its one-row kernel.) Where
``/proc/stat`` cannot be read (not Linux) the sampler keeps every thread.
"""

from __future__ import annotations

import math
import os
import threading
import time
from collections.abc import Callable
from typing import NamedTuple

PERIOD_S = 0.5  # how often the load is sampled (at most once per compute)
MIN_WINDOW_S = 0.05  # shorter windows are too coarse (clock ticks are 10 ms)
_TICK_S = 1.0 / (os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100)


class CpuTimes(NamedTuple):
    """Seconds of CPU time since boot: ``busy`` and ``total`` summed over the
    CPUs counted (``cpus`` of them), ``own`` this process's (all threads);
    ``running``: runnable tasks on the machine at this instant (this thread
    included)."""

    busy: float
    total: float
    own: float
    cpus: int
    running: int


def _allowed_cpus() -> set[int] | None:
    try:
        return set(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return None


def read_cpu_times(stat_text: str | None = None, allowed: set[int] | None = None) -> CpuTimes | None:
    """The machine's CPU times now (``/proc/stat``, or ``stat_text``), over
    the CPUs in ``allowed`` (all when None), and this process's own; None
    where ``/proc/stat`` cannot be read or parsed."""
    if stat_text is None:
        try:
            with open("/proc/stat") as f:
                stat_text = f.read()
        except OSError:
            return None
    busy = total = 0
    n = 0
    running = 1
    aggregate = None
    try:
        for line in stat_text.splitlines():
            if line.startswith("cpu"):
                name, *fields = line.split()
                # user nice system idle iowait irq softirq steal [guest guest_nice: inside user/nice]
                v = [int(x) for x in fields[:8]]
                v += [0] * (8 - len(v))
                idle = v[3] + v[4]
                all_ = sum(v)
                if name == "cpu":
                    aggregate = (all_ - idle, all_)
                elif allowed is None or int(name[3:]) in allowed:
                    busy += all_ - idle
                    total += all_
                    n += 1
            elif line.startswith("procs_running"):
                running = int(line.split()[1])
    except (ValueError, IndexError):
        return None
    if n == 0:
        if aggregate is None:
            return None
        busy, total = aggregate
        n = os.cpu_count() or 1
    t = os.times()
    return CpuTimes(busy * _TICK_S, total * _TICK_S, t.user + t.system, n, running)


def others_cores(a: CpuTimes, b: CpuTimes) -> float | None:
    """Cores' worth of CPU that processes other than this one used between
    samples ``a`` and ``b`` (None when no time passed)."""
    span = b.total - a.total
    if span <= 0:
        return None
    used = (b.busy - a.busy) - (b.own - a.own)
    return max(0.0, used) / span * b.cpus


def threads_for(n_max: int, others: float, cpus: int) -> int:
    """Threads (1..n_max) to use when other processes use ``others`` cores'
    worth of ``cpus`` CPUs: ``n_max`` less the share they take, rounded."""
    taken = others * n_max / max(cpus, 1)
    return max(1, min(n_max, n_max - math.floor(taken + 0.5)))


class LoadSampler:
    """Chooses a thread count from the machine's load (module docstring).
    ``read``: a function returning ``CpuTimes`` or None (tests pass their
    own); ``clock``: monotonic seconds. Thread-safe."""

    def __init__(
        self,
        period: float = PERIOD_S,
        read: Callable[[], CpuTimes | None] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.period = period
        self._allowed = _allowed_cpus()
        self._read = read or (lambda: read_cpu_times(allowed=self._allowed))
        self._clock = clock
        self._lock = threading.Lock()
        self._last = self._read()
        self._last_t = clock()
        self.others: float | None = None  # cores' worth others used in the last window

    def threads(self, n_max: int) -> int:
        """How many of ``n_max`` threads to use now."""
        if n_max <= 1:
            return 1
        with self._lock:
            now = self._clock()
            window = now - self._last_t
            if self._last is None:
                return n_max  # no /proc/stat: every thread
            if self.others is None or window >= self.period:
                cur = self._read()
                if cur is None:
                    return n_max
                if window >= MIN_WINDOW_S:
                    others = others_cores(self._last, cur)
                    if others is not None:
                        self.others = others
                    self._last, self._last_t = cur, now
                elif self.others is None:
                    # a first decision on a window too short to measure: the tasks
                    # runnable at this instant, less this thread
                    return threads_for(n_max, float(max(0, cur.running - 1)), cur.cpus)
            if self.others is None:
                return n_max
            return threads_for(n_max, self.others, self._last.cpus)


_shared: LoadSampler | None = None
_shared_lock = threading.Lock()


def shared_sampler() -> LoadSampler:
    """The process's sampler (every adaptive Runtime asks the same one); its
    first window starts at the first call."""
    global _shared
    with _shared_lock:
        if _shared is None:
            _shared = LoadSampler()
        return _shared
