"""Remote devices over ggml's RPC backend (toy patch 0023, toy_ggml.rpc).

A real server (``toy_ggml.rpc_serve`` in a child process on 127.0.0.1) takes
one weight of a small graph; the result must equal, bit for bit, the same
graph computed on this process's CPU alone (the reference: the server runs
the same toy-patched CPU kernels). The failure cases check that a lost
server is an RPCError within TOY_RPC_TIMEOUT, never an abort or a hang: a
killed server, a stopped (silent) one, a listener that never answers the
handshake, a closed port, and a server that answers with stock ggml's
protocol version (a llama.cpp rpc-server, whose op numbering differs).
Clients that could abort run in a child interpreter, so a regression fails
the test instead of killing the test run.
"""

from __future__ import annotations

import json
import os
import selectors
import signal
import socket
import struct
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator

import numpy as np
import pytest

import toy_ggml as tg

F32 = tg.GGMLType.F32

pytestmark = pytest.mark.skipif(not tg.rpc_available(), reason="this build has no RPC backend")

_TESTS_DIR = os.path.dirname(os.path.abspath(__file__))

# the wire format of ggml-rpc.cpp: a command byte, a u64 size, the payload; HELLO is command 14,
# its request 24 bytes of transport caps, its answer major, minor, patch, padding and 24 bytes
_HELLO = 14
_HELLO_REQ = 24
_STOCK_MAJOR = 7  # RPC_PROTO_MAJOR_VERSION of stock ggml 0.25.3 (ggml-rpc.h before patch 0023)
_TOY_OP_SETS = (
    3  # changes of toy's op set since patch 0023 (0029: GELU_BACK; 0030: I32 cross-entropy labels; 0031: NORM_BACK)
)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Server:
    """``toy_ggml.rpc_serve`` in a child process on 127.0.0.1."""

    def __init__(self, threads: int = 1, port: int | None = None) -> None:
        self.port = port or _free_port()
        self.endpoint = f"127.0.0.1:{self.port}"
        code = (
            "import toy_ggml as tg\n"
            f"tg.rpc_serve('127.0.0.1', {self.port}, {threads}, on_ready=lambda: print('READY', flush=True))\n"
        )
        self.proc = subprocess.Popen(
            [sys.executable, "-c", code],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=_TESTS_DIR,
        )
        assert self.proc.stdout is not None
        sel = selectors.DefaultSelector()
        sel.register(self.proc.stdout, selectors.EVENT_READ)
        deadline = time.monotonic() + 120
        try:
            while time.monotonic() < deadline:
                if not sel.select(timeout=deadline - time.monotonic()):
                    break
                line = self.proc.stdout.readline()
                if line.strip() == "READY":
                    return
                if not line:  # the child ended
                    break
        finally:
            sel.close()
        self.stop()
        raise RuntimeError(f"the rpc server did not start: {self.proc.stderr.read() if self.proc.stderr else ''}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            try:
                os.kill(self.proc.pid, signal.SIGCONT)  # a stopped process dies only when continued
            except ProcessLookupError:
                pass
        self.proc.wait(timeout=30)
        for f in (self.proc.stdout, self.proc.stderr):
            if f is not None:
                f.close()


@pytest.fixture
def server() -> Iterator[Server]:
    s = Server()
    try:
        yield s
    finally:
        s.stop()


def _graph(rt, w1, w2, bias, x, remote: str | None, mode: str):
    """out = (x @ w1.T) @ w2.T + bias; w2 and bias on ``remote`` when given.
    ``mode``: "f32" (ggml's products), "gemm" (toy's GEMM hint, patch 0011) or
    "q4_1" (w2 quantized, row-invariant products: op parameters that must
    cross the wire)."""
    gemm = mode == "gemm"
    quant = mode == "q4_1"
    ctx = tg.Context()
    wctx = tg.Context()
    tw1 = wctx.tensor(F32, w1.shape, name="w1")
    wctx.allocate(rt, weights=True)
    rctx = tg.Context()
    tw2 = rctx.tensor(tg.GGMLType.Q4_1 if quant else F32, w2.shape, name="w2")
    tb = rctx.tensor(F32, bias.shape, name="bias")
    rctx.allocate(rt, device=remote, weights=True)
    tw1.set(w1)
    tw2.set_float(w2)
    tb.set(bias)
    tx = ctx.tensor(F32, x.shape, name="x")
    h = ctx.mul_mat(tw1, tx, gemm=gemm, row_invariant=quant)
    out = ctx.add(ctx.mul_mat(tw2, h, gemm=gemm, row_invariant=quant), tb)
    g = tg.Graph(ctx).build_forward(out)
    rt.allocate(g)
    tx.set(x)
    rt.compute(g)
    first = out.numpy()
    # the same graph again, new input (the server recomputes the graph it stored)
    tx.set(x[::-1].copy())
    rt.compute(g)
    second = out.numpy()
    return (first, second), tw2.device, rt.n_splits(), (ctx, wctx, rctx)


@pytest.mark.parametrize("mode", ["f32", "gemm", "q4_1"])
def test_split_graph_is_bit_identical_to_cpu(server, rng, mode):
    w1 = rng.standard_normal((64, 40)).astype(np.float32)
    w2 = rng.standard_normal((36, 64)).astype(np.float32)
    bias = rng.standard_normal(36).astype(np.float32)
    x = rng.standard_normal((7, 40)).astype(np.float32)

    local = tg.Runtime("cpu", threads=2)
    want, dev, _, keep = _graph(local, w1, w2, bias, x, None, mode)
    assert dev == "CPU"

    devs = tg.rpc_connect(server.endpoint)
    assert len(devs) == 1 and devs[0].kind == "rpc" and devs[0].description == server.endpoint
    assert devs[0].memory_total > 0
    rt = tg.Runtime("cpu", threads=2, extra_devices=[devs[0].name])
    assert rt.extra_devices == [devs[0].name]
    remote = rt.backends[1]
    assert rt.backends == ["CPU", remote] and remote.startswith("RPC") and server.endpoint in remote
    assert rt.cpu_gemm  # the server runs toy's CPU kernels
    assert rt.device_memory(devs[0].name)[1] == devs[0].memory_total
    got, dev, n_splits, keep2 = _graph(rt, w1, w2, bias, x, devs[0].name, mode)
    assert dev == remote  # w2 lives on the server ...
    assert n_splits >= 2  # ... and the scheduler ran its product there
    for a, b in zip(got, want, strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape
        assert np.array_equal(a, b)
    assert not np.array_equal(got[0], got[1])
    for c in (*keep2, *keep):
        c.close()
    rt.close()
    local.close()


def _eye_product(dev_name: str) -> np.ndarray:
    """3 * I (a weight on ``dev_name``) times a row of ones, through a runtime with that device."""
    rt = tg.Runtime("cpu", threads=1, extra_devices=[dev_name])
    wctx = tg.Context()
    w = wctx.tensor(F32, (4, 4), name="w")
    wctx.allocate(rt, device=dev_name, weights=True)
    w.set(3 * np.eye(4, dtype=np.float32))
    ctx = tg.Context()
    x = ctx.tensor(F32, (1, 4), name="x")
    y = ctx.scale(ctx.mul_mat(w, x), 1.0)
    g = tg.Graph(ctx).build_forward(y)
    rt.allocate(g)
    x.set(np.ones((1, 4), np.float32))
    rt.compute(g)
    out = y.numpy()
    ctx.close()
    wctx.close()
    rt.close()
    return out


def test_restarted_server_gets_a_new_connection(server):
    dev = tg.rpc_connect(server.endpoint)[0]
    assert np.array_equal(_eye_product(dev.name), np.full((1, 4), 3, np.float32))
    held = tg.Runtime("cpu", extra_devices=[dev.name])  # keeps the first connection open
    server.stop()
    with pytest.raises(tg.RPCError, match="Connection refused"):
        tg.rpc_connect(server.endpoint)  # the open connection proves dead, a new one is refused
    again = Server(port=server.port)
    try:
        assert [d.name for d in tg.rpc_connect(server.endpoint)] == [dev.name]
        assert np.array_equal(_eye_product(dev.name), np.full((1, 4), 3, np.float32))
        # the runtime on the dead connection stays failed
        ctx = tg.Context()
        g = tg.Graph(ctx).build_forward(ctx.scale(ctx.tensor(F32, (2,), name="t"), 2.0))
        with pytest.raises(tg.RPCError, match=f"RPC device {dev.name} \\({server.endpoint}\\): connection lost"):
            held.compute(g)
        ctx.close()
    finally:
        held.close()
        again.stop()


def test_unknown_devices_are_value_errors(server):
    with pytest.raises(ValueError, match="unknown extra device 'RPC999'"):
        tg.Runtime("cpu", extra_devices=["RPC999"])
    with pytest.raises(TypeError):
        tg.Runtime("cpu", extra_devices="RPC0")
    rt = tg.Runtime("cpu")
    ctx = tg.Context()
    ctx.tensor(F32, (4,))
    with pytest.raises(ValueError, match="no device 'RPC0'"):
        ctx.allocate(rt, device="RPC0")
    with pytest.raises(ValueError, match="needs the runtime"):
        ctx.allocate(device="cpu")
    ctx.close()
    rt.close()
    with pytest.raises(ValueError, match="not HOST:PORT"):
        tg.rpc_connect("127.0.0.1")


# A client in a child interpreter: it connects, puts a weight on the server, computes once,
# prints READY, waits for a line on stdin (the test acts on the server meanwhile), computes
# again and prints the outcome as JSON.
_CLIENT = """
import json, sys, time
import numpy as np
import toy_ggml as tg
F32 = tg.GGMLType.F32
dev = tg.rpc_connect(sys.argv[1])[0]
rt = tg.Runtime("cpu", threads=1, extra_devices=[dev.name])
wctx = tg.Context()
w = wctx.tensor(F32, (8, 8), name="w")
wctx.allocate(rt, device=dev.name, weights=True)
w.set(np.eye(8, dtype=np.float32))
ctx = tg.Context()
x = ctx.tensor(F32, (2, 8), name="x")
y = ctx.mul_mat(w, x)
g = tg.Graph(ctx).build_forward(y)
rt.allocate(g)
x.set(np.ones((2, 8), np.float32))
rt.compute(g)
assert np.array_equal(y.numpy(), np.ones((2, 8), np.float32))
print("READY", flush=True)
sys.stdin.readline()
out = {}
t0 = time.monotonic()
try:
    x.set(np.full((2, 8), 2.0, np.float32))
    rt.compute(g)
    y.numpy()
    out["raised"] = None
except BaseException as e:
    out["raised"] = type(e).__name__
    out["message"] = str(e)
    out["endpoint"] = getattr(e, "endpoint", None)
out["seconds"] = time.monotonic() - t0
try:
    rt.compute(g)  # a dead connection stays dead
    out["again"] = None
except BaseException as e:
    out["again"] = type(e).__name__
try:
    w.numpy()
    out["read"] = None
except BaseException as e:
    out["read"] = type(e).__name__
print("RESULT " + json.dumps(out), flush=True)
"""


def _client_after(server: Server, act, timeout_env: str) -> dict:
    env = dict(os.environ, GGML_NO_BACKTRACE="1", TOY_RPC_TIMEOUT=timeout_env)
    proc = subprocess.Popen(
        [sys.executable, "-c", _CLIENT, server.endpoint],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        cwd=_TESTS_DIR,
    )
    try:
        assert proc.stdout is not None and proc.stdin is not None
        line = proc.stdout.readline()  # the client's own imports and first compute
        assert line.strip() == "READY", proc.stderr.read() if proc.stderr else ""
        act()
        proc.stdin.write("go\n")
        proc.stdin.flush()
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate(timeout=30)
    assert proc.returncode == 0, f"client rc={proc.returncode} (an abort is -6)\n{err[-3000:]}"
    results = [ln for ln in out.splitlines() if ln.startswith("RESULT ")]
    assert results, f"no result\nstdout:\n{out[-2000:]}\nstderr:\n{err[-2000:]}"
    return dict(json.loads(results[-1][len("RESULT ") :]))


def test_killed_server_is_an_rpc_error(server):
    def kill():
        server.proc.kill()
        server.proc.wait(timeout=30)

    r = _client_after(server, kill, "30")
    assert r["raised"] == "RPCError", r
    assert r["endpoint"] == server.endpoint
    assert server.endpoint in r["message"] and "connection lost" in r["message"]
    assert r["seconds"] < 10  # a closed connection is seen at once, not after the timeout
    assert r["again"] == "RPCError" and r["read"] == "RPCError"


def test_silent_server_times_out(server):
    r = _client_after(server, lambda: os.kill(server.proc.pid, signal.SIGSTOP), "3")
    assert r["raised"] == "RPCError", r
    assert "no answer within 3 s" in r["message"] and server.endpoint in r["message"]
    assert 2.5 < r["seconds"] < 30
    assert r["again"] == "RPCError"


class _Listener:
    """A TCP listener on 127.0.0.1 whose one connection is handled by ``answer(conn)``."""

    def __init__(self, answer) -> None:
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(1)
        self.sock.settimeout(30)
        self.endpoint = f"127.0.0.1:{self.sock.getsockname()[1]}"
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._run, args=(answer,), daemon=True)
        self.thread.start()

    def _run(self, answer) -> None:
        try:
            conn, _ = self.sock.accept()
        except OSError:
            return
        with conn:
            conn.settimeout(30)
            try:
                answer(conn)
            except OSError:
                pass
            self.done.wait(30)

    def close(self) -> None:
        self.done.set()
        self.thread.join(timeout=40)
        self.sock.close()


def _read_hello(conn: socket.socket) -> None:
    data = b""
    while len(data) < 1 + 8 + _HELLO_REQ:
        chunk = conn.recv(1 + 8 + _HELLO_REQ - len(data))
        if not chunk:
            raise OSError("closed")
        data += chunk
    assert data[0] == _HELLO and struct.unpack("<Q", data[1:9])[0] == _HELLO_REQ


def test_stock_protocol_server_is_refused():
    def stock_hello(conn):
        _read_hello(conn)
        rsp = bytes([_STOCK_MAJOR, 0, 0, 0]) + bytes(24)
        conn.sendall(struct.pack("<Q", len(rsp)) + rsp)

    lis = _Listener(stock_hello)
    try:
        with pytest.raises(tg.RPCError, match=r"stock ggml RPC 7\.0\.0") as e:
            tg.rpc_connect(lis.endpoint)
        assert e.value.endpoint == lis.endpoint and lis.endpoint in str(e.value)
    finally:
        lis.close()


def test_toy_server_answers_with_its_own_version(server):
    # what a stock client sees: a major version other than its 7, which it refuses
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as s:
        s.sendall(bytes([_HELLO]) + struct.pack("<Q", _HELLO_REQ) + bytes(_HELLO_REQ))
        data = b""
        while len(data) < 8 + 28:
            chunk = s.recv(8 + 28 - len(data))
            assert chunk
            data += chunk
    assert struct.unpack("<Q", data[:8])[0] == 28
    assert data[8] == 100 + _STOCK_MAJOR + _TOY_OP_SETS


def test_silent_handshake_and_closed_port(monkeypatch):
    monkeypatch.setenv("TOY_RPC_TIMEOUT", "2")
    lis = _Listener(lambda conn: None)  # accepts, never answers
    try:
        t0 = time.monotonic()
        with pytest.raises(tg.RPCError, match="handshake failed") as e:
            tg.rpc_connect(lis.endpoint)
        assert 1.5 < time.monotonic() - t0 < 30
        assert "no answer within" in str(e.value)
    finally:
        lis.close()
    port = _free_port()  # nothing listens there now
    with pytest.raises(tg.RPCError, match=f"127.0.0.1:{port}: connect: Connection refused"):
        tg.rpc_connect(f"127.0.0.1:{port}")
    monkeypatch.setenv("TOY_RPC_TIMEOUT", "soon")
    with pytest.raises(tg.GGMLError, match="TOY_RPC_TIMEOUT"):
        tg.rpc_connect(f"127.0.0.1:{port}")


_FOREIGN_BUFFER = """
import numpy as np
import toy_ggml as tg
F32 = tg.GGMLType.F32
dev = tg.rpc_connect({endpoint!r})[0]
rt = tg.Runtime("cpu", extra_devices=[dev.name])
wctx = tg.Context()
w = wctx.tensor(F32, (4, 4), name="w")
wctx.allocate(rt, device=dev.name, weights=True)
w.set(np.eye(4, dtype=np.float32))
plain = tg.Runtime("cpu")  # a runtime without the remote device
ctx = tg.Context()
x = ctx.tensor(F32, (1, 4), name="x")
g = tg.Graph(ctx).build_forward(ctx.mul_mat(w, x))
try:
    plain.allocate(g)
    print("NO EXCEPTION")
except tg.GGMLError as e:
    print("RAISED", type(e).__name__, "|", e)
"""


def test_weight_on_a_device_the_runtime_lacks_is_an_error_not_an_abort(server):
    code = textwrap.dedent(_FOREIGN_BUFFER.format(endpoint=server.endpoint))
    env = dict(os.environ, GGML_NO_BACKTRACE="1")
    r = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env, cwd=_TESTS_DIR
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert "RAISED GGMLError" in r.stdout and "which no device of this runtime" in r.stdout, r.stdout


# Two graphs split between the CPU and the server, computed in turn on one runtime: ggml's
# scheduler points a node's source on another device at a copy in its own context, which the
# other graph's allocation frees; the Runtime must give the sources back before re-allocating
# (before the fix, the third compute aborted in ggml_backend_sched_split_graph).
_ALTERNATE = """
import json
import numpy as np
import toy_ggml as tg
F32 = tg.GGMLType.F32
rng = np.random.default_rng(5)
w1, w2, w3 = (rng.standard_normal((16, 16)).astype(np.float32) for _ in range(3))
xs = {{3: rng.standard_normal((3, 16)).astype(np.float32), 5: rng.standard_normal((5, 16)).astype(np.float32)}}

def build(rt, remote):
    wc, rc = tg.Context(), tg.Context()
    t1, t3 = wc.tensor(F32, (16, 16), name="w1"), wc.tensor(F32, (16, 16), name="w3")
    t2 = rc.tensor(F32, (16, 16), name="w2")
    wc.allocate(rt, weights=True)
    rc.allocate(rt, device=remote, weights=True)
    for t, w in ((t1, w1), (t2, w2), (t3, w3)):
        t.set(w)
    graphs = {{}}
    for n in xs:
        c = tg.Context()
        x = c.tensor(F32, (n, 16), name="x")
        # CPU -> server -> CPU: the last product reads the server's result
        y = c.mul_mat(t3, c.mul_mat(t2, c.mul_mat(t1, x)))
        graphs[n] = (c, x, y, tg.Graph(c).build_forward(y))
    return (wc, rc), graphs

def run(rt, graphs, order):
    out = []
    for n in order:
        c, x, y, g = graphs[n]
        rt.allocate(g)
        x.set(xs[n])
        rt.compute(g)
        out.append(y.numpy())
    return out

order = [3, 5, 3, 5, 3]
local = tg.Runtime("cpu")
keep, graphs = build(local, None)
want = run(local, graphs, order)
dev = tg.rpc_connect({endpoint!r})[0]
rt = tg.Runtime("cpu", extra_devices=[dev.name])
keep2, graphs2 = build(rt, dev.name)
got = run(rt, graphs2, order)
print("RESULT " + json.dumps({{"splits": rt.n_splits(), "equal": [bool(np.array_equal(a, b)) for a, b in zip(got, want)]}}))
"""


def test_graphs_split_in_turn_keep_their_sources(server):
    code = _ALTERNATE.format(endpoint=server.endpoint)
    env = dict(os.environ, GGML_NO_BACKTRACE="1")
    r = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env, cwd=_TESTS_DIR
    )
    assert r.returncode == 0, f"rc={r.returncode} (an abort is -6)\n{r.stderr[-3000:]}"
    line = [ln for ln in r.stdout.splitlines() if ln.startswith("RESULT ")][-1]
    res = json.loads(line[len("RESULT ") :])
    assert res["splits"] >= 3  # CPU, server, CPU
    assert res["equal"] == [True] * 5
