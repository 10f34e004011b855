"""toy_ggml benchmarks: binding overhead and CPU matmul throughput.

Run with ``just bench``. Every figure is one JSON line (see conftest.py) and,
where there is one, carries the peer it was measured against in the same run
and the ratio to it, so the ratio survives a noisy machine. Nothing here
asserts on a timing: a figure that misses its target says so (``met``).

Figures:

1. ``op_overhead``: ns per Python call that builds one op (``ctx.tensor``,
   ``ctx.add``, ``ctx.mul_mat``, ``ctx.reshape``), in batches of fresh
   Contexts; peer: ``numpy.add`` on a 4-element array (one small C call).
   Nothing is subtracted; the bare loop's cost is given as ``loop_ns``.
2. ``compute_overhead``: µs per ``Runtime.compute`` of an allocated one-node
   graph (a 4-element add), for 1 and N threads; same peer.
3. ``matmul``: GFLOP/s of ``ctx.mul_mat(W, x)`` at SmolLM2-135M shapes, for
   F32, Q8_0 and Q4_1 weights, decode (N=1) and prefill (N=128), against
   NumPy F32 ``x @ W.T`` with the same number of BLAS threads.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import platform
import statistics
import time

try:
    import resource
except ImportError:  # not POSIX: no fault counts
    resource = None

import numpy as np
import pytest

import toy_ggml as tg

pytestmark = pytest.mark.bench

T = tg.GGMLType


def _bench_threads():
    # Collected (then deselected) by `just test` too: never fail at import.
    try:
        return sorted({1, tg.default_threads()})
    except ValueError:  # a bad TOY_THREADS
        return [1]


THREADS = _bench_threads()

# ---------------------------------------------------------------------------
# NumPy's BLAS thread count: threadpoolctl if installed, else the OpenBLAS that
# NumPy loaded, through ctypes (NumPy wheels bundle scipy-openblas).

try:
    import threadpoolctl
except ImportError:  # not a dependency; the ctypes route covers NumPy wheels
    threadpoolctl = None


class _OpenBLAS:
    """Thread count, core name and config of the OpenBLAS in this process."""

    def __init__(self):
        self.path = self._find()
        self.lib = None
        if self.path:
            try:
                self.lib = ctypes.CDLL(self.path, mode=os.RTLD_NOLOAD | os.RTLD_NOW)
            except OSError:
                self.lib = None
        self._get = self._sym("get_num_threads", ctypes.c_int)
        self._set = self._sym("set_num_threads", None, ctypes.c_int)
        self._corename = self._sym("get_corename", ctypes.c_char_p)
        self._config = self._sym("get_config", ctypes.c_char_p)

    @staticmethod
    def _find():
        try:
            with open("/proc/self/maps") as f:
                for line in f:
                    path = line.split()[-1]
                    if "openblas" in os.path.basename(path).lower() and ".so" in path:
                        return path
        except OSError:
            pass
        return None

    def _sym(self, name, restype, *argtypes):
        if self.lib is None:
            return None
        for prefix in ("scipy_openblas", "openblas"):
            for suffix in ("64_", "", "_64"):
                fn = getattr(self.lib, f"{prefix}_{name}{suffix}", None)
                if fn is not None:
                    fn.restype = restype
                    fn.argtypes = argtypes
                    return fn
        return None

    def threads(self):
        return int(self._get()) if self._get else None

    def set_threads(self, n):
        if self._set:
            self._set(int(n))

    def corename(self):
        return self._corename().decode() if self._corename else None

    def config(self):
        return self._config().decode() if self._config else None


_openblas = _OpenBLAS()


def _blas_control():
    if threadpoolctl is not None:
        return "threadpoolctl"
    if _openblas._set is not None:
        return "ctypes-openblas"
    return "none"


@contextlib.contextmanager
def blas_threads(n):
    """Run NumPy's BLAS with ``n`` threads; yields the count it really has
    (None when it cannot be told)."""
    if threadpoolctl is not None:
        with threadpoolctl.threadpool_limits(limits=n, user_api="blas"):
            infos = [i for i in threadpoolctl.threadpool_info() if i.get("user_api") == "blas"]
            yield infos[0]["num_threads"] if infos else None
    elif _openblas._set is not None:
        old = _openblas.threads()
        _openblas.set_threads(n)
        try:
            yield _openblas.threads()
        finally:
            if old:
                _openblas.set_threads(old)
    else:
        yield None


# ---------------------------------------------------------------------------
# timing


def best_of(fn, k=5, min_time=0.2, max_time=1.5, max_reps=200):
    """(best seconds per call, reps) after one warm-up call: at least ``k``
    reps and ``min_time`` seconds, but stop after ``max_time`` once 3 reps
    are in."""
    fn()
    times = []
    start = time.perf_counter()
    while len(times) < max_reps:
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
        elapsed = time.perf_counter() - start
        if (len(times) >= k and elapsed >= min_time) or (len(times) >= 3 and elapsed >= max_time):
            break
    return min(times), len(times)


def _loop0(n):
    t0 = time.perf_counter()
    for _ in range(n):
        pass
    return time.perf_counter() - t0


def _loop2(fn, a, b, n):
    t0 = time.perf_counter()
    for _ in range(n):
        fn(a, b)
    return time.perf_counter() - t0


def _loop3(fn, a, b, c, n):
    t0 = time.perf_counter()
    for _ in range(n):
        fn(a, b, c)
    return time.perf_counter() - t0


def _loop1(fn, a, n):
    t0 = time.perf_counter()
    for _ in range(n):
        fn(a)
    return time.perf_counter() - t0


def _minor_faults():
    if resource is None:
        return 0
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def _per_call(batches, n):
    """(best, median) seconds per call over batches of ``n`` calls."""
    per = [b / n for b in batches]
    return min(per), statistics.median(per)


def _numpy_peer_ns(batch, n_batches):
    x = np.ones(4, np.float32)
    y = np.ones(4, np.float32)
    z = np.empty(4, np.float32)
    best, _ = _per_call([_loop3(np.add, x, y, z, batch) for _ in range(n_batches)], batch)
    return best * 1e9


# ---------------------------------------------------------------------------


def test_environment(record):
    """What the peer runs on: NumPy's BLAS, its threads, and OPENBLAS_CORETYPE
    (which, when set, forces an OpenBLAS kernel and can slow NumPy down)."""
    blas = {}
    try:
        cfg = np.show_config(mode="dicts")
        b = cfg.get("Build Dependencies", {}).get("blas", {})
        blas = {k: b.get(k) for k in ("name", "version", "openblas configuration") if b.get(k)}
    except Exception as e:  # older NumPy: no dicts mode
        blas = {"error": repr(e)}
    features = [k for k, v in tg.cpu_features().items() if v]
    record(
        "environment",
        figure="numpy_blas_threads",
        value=_openblas.threads(),
        unit="threads",
        numpy=np.__version__,
        numpy_blas=blas,
        openblas_corename=_openblas.corename(),
        openblas_config=_openblas.config(),
        openblas_lib=os.path.basename(_openblas.path) if _openblas.path else None,
        OPENBLAS_CORETYPE_set="OPENBLAS_CORETYPE" in os.environ,
        OPENBLAS_CORETYPE=os.environ.get("OPENBLAS_CORETYPE"),
        thread_env={
            k: os.environ[k]
            for k in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS", "TOY_THREADS")
            if k in os.environ
        },
        blas_thread_control=_blas_control(),
        ggml=tg.GGML_VERSION,
        ggml_cpu_features=features,
        cpus=os.cpu_count(),
        physical_cores=tg.physical_cores(),
        bench_threads=THREADS,
        python=platform.python_version(),
        machine=platform.machine(),
    )


# ---------------------------------------------------------------------------
# 1. Python overhead of building one op

OP_BATCH = 10_000
OP_BATCHES = 10  # 100k calls per op, each batch in a fresh Context
OP_TARGET_NS = 1000.0


def _op_cases():
    # name, fn(ctx) -> (callable, arg1, arg2): every case is a two-argument call
    return {
        "tensor": lambda ctx: (ctx.tensor, T.F32, (8, 576)),
        "add": lambda ctx: (ctx.add, ctx.tensor(T.F32, (8, 576)), ctx.tensor(T.F32, (576,))),
        "mul_mat": lambda ctx: (ctx.mul_mat, ctx.tensor(T.Q4_1, (576, 576)), ctx.tensor(T.F32, (8, 576))),
        "reshape": lambda ctx: (ctx.reshape, ctx.tensor(T.F32, (8, 576)), (8, 9, 64)),
    }


def test_op_overhead(record):
    peer_ns = _numpy_peer_ns(OP_BATCH, OP_BATCHES)
    loop_ns = min(_loop0(OP_BATCH) for _ in range(OP_BATCHES)) / OP_BATCH * 1e9
    for name, make in _op_cases().items():
        batches, faults = [], []
        for i in range(OP_BATCHES + 1):  # batch 0 warms up (and checks the call works)
            with tg.Context(max_tensors=OP_BATCH + 16) as ctx:
                fn, a, b = make(ctx)
                fn(a, b)
                f0 = _minor_faults()
                dt = _loop2(fn, a, b, OP_BATCH)
                if i:
                    batches.append(dt)
                    faults.append(_minor_faults() - f0)
        best, median = _per_call(batches, OP_BATCH)
        ns = best * 1e9
        record(
            "op_overhead",
            figure=f"ctx.{name}",
            value=ns,
            unit="ns/call",
            median=median * 1e9,
            calls=OP_BATCH * OP_BATCHES,
            # first touch of a fresh Context's metadata pages: ~1 fault per 11 tensors when the
            # allocator hands back memory the OS has to map again (costly on VMs)
            faults_per_call=faults[batches.index(min(batches))] / OP_BATCH,
            faults_per_call_mean=sum(faults) / (OP_BATCH * OP_BATCHES),
            batch=OP_BATCH,
            loop_ns=loop_ns,
            peer="numpy.add(x, y, out), 4 float32",
            peer_value=peer_ns,
            ratio=ns / peer_ns,
            target=OP_TARGET_NS,
            met=ns < OP_TARGET_NS,
        )


# ---------------------------------------------------------------------------
# 2. Overhead of computing a one-node graph

COMPUTE_BATCH = 5_000
COMPUTE_BATCHES = 10
COMPUTE_TARGET_US = 20.0


def test_compute_overhead(record):
    peer_us = _numpy_peer_ns(COMPUTE_BATCH, COMPUTE_BATCHES) / 1e3
    for threads in THREADS:
        with tg.Runtime("cpu", threads=threads) as rt, tg.Context(max_tensors=8) as ctx:
            a = ctx.tensor(T.F32, (4,))
            b = ctx.tensor(T.F32, (4,))
            out = ctx.add(a, b)
            g = tg.Graph(ctx, size=16).build_forward(out)
            ctx.allocate(rt)
            a.set(np.arange(4, dtype=np.float32))
            b.set(np.ones(4, np.float32))
            rt.compute(g)
            ok = bool(np.array_equal(out.numpy(), np.arange(4, dtype=np.float32) + 1))
            _loop1(rt.compute, g, 500)  # warm-up
            best, median = _per_call(
                [_loop1(rt.compute, g, COMPUTE_BATCH) for _ in range(COMPUTE_BATCHES)], COMPUTE_BATCH
            )
        us = best * 1e6
        record(
            "compute_overhead",
            figure="rt.compute(1-node add)",
            value=us,
            unit="us/compute",
            median=median * 1e6,
            threads=threads,
            shape=[4],
            computes=COMPUTE_BATCH * COMPUTE_BATCHES,
            result_ok=ok,
            peer="numpy.add(x, y, out), 4 float32",
            peer_value=peer_us,
            ratio=us / peer_us,
            target=COMPUTE_TARGET_US,
            met=us < COMPUTE_TARGET_US,
        )


# ---------------------------------------------------------------------------
# 3. Matmul throughput at SmolLM2-135M shapes (hidden 576, ffn 1536, vocab 49152)

MATMUL_SHAPES = {  # role: W shape (M, K) in NumPy order; y = x @ W.T
    "attn_q/o": (576, 576),
    "ffn_gate/up": (1536, 576),
    "ffn_down": (576, 1536),
    "lm_head": (49152, 576),
}
MATMUL_TOKENS = (1, 128)  # decode, prefill
MATMUL_TYPES = (T.F32, T.Q8_0, T.Q4_1)


def test_matmul(record):
    rng = np.random.default_rng(1234)
    runtimes = {n: tg.Runtime("cpu", threads=n) for n in THREADS}
    try:
        for role, (m, k) in MATMUL_SHAPES.items():
            w32 = (rng.standard_normal((m, k), dtype=np.float32) * 0.05).astype(np.float32)
            xs = {n: rng.standard_normal((n, k), dtype=np.float32) for n in MATMUL_TOKENS}
            with tg.Context(max_tensors=64) as ctx:
                weights = {}
                for dt in MATMUL_TYPES:
                    weights[dt] = ctx.tensor(dt, (m, k), name=f"w_{dt.name}")
                inputs = {n: ctx.tensor(T.F32, (n, k), name=f"x_{n}") for n in MATMUL_TOKENS}
                graphs = {}
                for dt, w in weights.items():
                    for n, x in inputs.items():
                        out = ctx.mul_mat(w, x)
                        graphs[dt, n] = (tg.Graph(ctx, size=16).build_forward(out), out)
                ctx.allocate()
                for w in weights.values():
                    w.set_float(w32)
                for n, x in inputs.items():
                    x.set(xs[n])
                for n in MATMUL_TOKENS:
                    x = xs[n]
                    ref = np.empty((n, m), np.float32)
                    flop = 2.0 * m * k * n
                    for threads in THREADS:
                        with blas_threads(threads) as np_threads:
                            np_s, np_reps = best_of(lambda x=x, wt=w32.T, ref=ref: np.matmul(x, wt, out=ref))
                        np_gflops = flop / np_s / 1e9
                        common = dict(role=role, shape=[m, k], tokens=n, threads=threads)
                        record(
                            "matmul",
                            figure="numpy F32 x @ W.T",
                            value=np_gflops,
                            unit="GFLOP/s",
                            **common,
                            impl="numpy",
                            weight_type="F32",
                            numpy_threads=np_threads,
                            best_s=np_s,
                            reps=np_reps,
                        )
                        rt = runtimes[threads]
                        for dt in MATMUL_TYPES:
                            g, out = graphs[dt, n]
                            s, reps = best_of(lambda g=g, rt=rt: rt.compute(g))
                            got = out.numpy()
                            err = float(np.abs(got - ref).max() / max(float(np.abs(ref).max()), 1e-30))
                            gflops = flop / s / 1e9
                            record(
                                "matmul",
                                figure=f"ggml mul_mat {dt.name}",
                                value=gflops,
                                unit="GFLOP/s",
                                **common,
                                impl="toy_ggml",
                                weight_type=dt.name,
                                best_s=s,
                                reps=reps,
                                rel_err_vs_numpy_f32=err,
                                peer="numpy F32 x @ W.T",
                                peer_value=np_gflops,
                                numpy_threads=np_threads,
                                ratio=gflops / np_gflops,
                            )
    finally:
        for rt in runtimes.values():
            rt.close()
