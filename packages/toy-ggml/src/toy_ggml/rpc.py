"""Remote devices: ggml's RPC backend, as toy builds and patches it.

A ``toy rpc-server`` on another host serves its CPU over TCP; this process
connects to it (``rpc_connect("HOST:PORT")``), gets its devices (``RPC0``...)
and gives them to a Runtime as ``extra_devices``. The scheduler then runs
every op on the device holding that op's weights (``Context.allocate(runtime,
device=..., weights=True)``), so a model's layers can live on several hosts.
The remote host runs the same toy-patched CPU kernels, so a graph gives the
same bits as on one host.

Toy's protocol differs from stock ggml's (toy numbers its ops differently;
patch 0023): a stock llama.cpp ``rpc-server`` is refused at the handshake.
A lost or silent server is an ``RPCError`` (never an abort or a hang): the
connect and every exchange wait at most ``TOY_RPC_TIMEOUT`` seconds (default
120; a remote compute must finish within it too).

There is no authentication or encryption: whoever reaches a server's port can
run graphs and read and write its buffers. Serve on loopback or a private
network (an SSH tunnel across others).
"""

from __future__ import annotations

import ipaddress
import os
import signal
import socket
import threading
from collections.abc import Callable

from toy_ggml import _core
from toy_ggml.devices import Device
from toy_ggml.errors import GGMLError

TIMEOUT_ENV = "TOY_RPC_TIMEOUT"
DEFAULT_TIMEOUT = 120.0


def rpc_available() -> bool:
    """Whether this build carries the RPC backend (libggml-rpc.so)."""
    return bool(_core.rpc_available())


def rpc_timeout() -> float:
    """Seconds a connect or exchange with a server may take (TOY_RPC_TIMEOUT)."""
    env = os.environ.get(TIMEOUT_ENV)
    if not env:
        return DEFAULT_TIMEOUT
    try:
        value = float(env)
    except ValueError:
        value = 0.0
    if not value > 0 or value == float("inf"):
        raise GGMLError(f"{TIMEOUT_ENV}={env!r} is not a positive number of seconds")
    return value


def parse_endpoint(endpoint: str) -> tuple[str, int]:
    """``"HOST:PORT"`` -> (host, port); ValueError naming what is wrong."""
    host, sep, port_s = endpoint.strip().rpartition(":")
    if not sep or not host or not port_s.isdigit():
        raise ValueError(f"RPC endpoint {endpoint!r} is not HOST:PORT")
    port = int(port_s)
    if not 1 <= port <= 65535:
        raise ValueError(f"RPC endpoint {endpoint!r}: port {port} is not in 1..65535")
    if host.startswith("[") or ":" in host:
        raise ValueError(f"RPC endpoint {endpoint!r}: IPv6 is not supported; use an IPv4 address or a name")
    return host, port


def rpc_connect(endpoint: str) -> list[Device]:
    """Connect to the toy rpc-server at ``endpoint`` ("HOST:PORT") and return
    its devices (``kind`` "rpc", ``description`` the endpoint, memory as the
    server reports it). Their names go to ``Runtime(extra_devices=...)``.

    Raises ValueError for a malformed endpoint and RPCError (a GGMLError)
    when the server cannot be reached, does not answer within the timeout,
    or speaks another protocol (a stock llama.cpp rpc-server)."""
    host, port = parse_endpoint(endpoint)
    rpc_timeout()  # a bad TOY_RPC_TIMEOUT is an error here, not a silent default
    if not rpc_available():
        raise GGMLError("this toy_ggml build has no RPC backend (libggml-rpc.so); rebuild toy-ggml")
    return [Device(*row) for row in _core.rpc_connect_raw(f"{host}:{port}")]


def _ipv4(host: str) -> str:
    try:
        return str(ipaddress.IPv4Address(host))
    except ValueError:
        pass
    try:
        return socket.gethostbyname(host)
    except OSError as e:
        raise ValueError(f"cannot resolve {host!r} to an IPv4 address: {e}") from None


def rpc_serve(
    host: str,
    port: int,
    threads: int,
    cache_dir: str | None = None,
    on_ready: Callable[[], None] | None = None,
) -> None:
    """Serve this process's CPU to RPC clients on ``host:port`` until the
    process ends; never returns normally. One client at a time (the next
    waits until it disconnects). ``threads``: CPU threads per graph.
    ``cache_dir``: where large weight tensors are cached by hash, so that a
    client loading the same model again skips sending them (created if
    missing). ``on_ready()`` is called once the server listens.

    The GIL is released while serving. In the main thread SIGINT and SIGTERM
    get their default actions first (they end the process at once; Python's
    KeyboardInterrupt could not interrupt the server). Raises GGMLError when
    it cannot listen (address in use, not an address of this host)."""
    if not 1 <= port <= 65535:
        raise ValueError(f"port {port} is not in 1..65535")
    if threads < 1:
        raise ValueError(f"threads={threads} must be >= 1")
    addr = _ipv4(host)
    if cache_dir is not None:
        os.makedirs(cache_dir, exist_ok=True)
    if not rpc_available():
        raise GGMLError("this toy_ggml build has no RPC backend (libggml-rpc.so); rebuild toy-ggml")
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
    _core.rpc_serve_raw(f"{addr}:{port}", threads, cache_dir, on_ready)
