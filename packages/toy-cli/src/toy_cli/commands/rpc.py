"""`toy rpc-server`: serve this machine's CPU as a remote ggml device.

Another machine's ``toy infer|chat|serve|eval --rpc HOST:PORT`` then puts a
block of a model's layers here (``toy.engine.split``); this process holds
their weights and K/V and computes their part of every forward with toy's
own CPU kernels, so the split model gives the one-host bits.

Security, the reason for the defaults: ggml's RPC protocol has no
authentication and no encryption. Whoever reaches the port can allocate
memory here, read and write every buffer the server holds (another user's
weights and K/V included) and run graphs on this machine. So the server binds
loopback (127.0.0.1) unless told otherwise; a non-loopback address (a
wildcard such as 0.0.0.0 included) is refused (exit 2) without
``--allow-remote``, and with it a warning on stderr says what is exposed.
The way to use a remote server without exposing it: keep it on loopback and
reach it through an SSH tunnel (``ssh -N -L 50052:127.0.0.1:50052 gpu-box``,
then ``--rpc 127.0.0.1:50052`` here), or bind an address of a private
network only trusted machines can reach.

Output: one ready line on stderr once the port listens ("toy rpc-server:
serving CPU on HOST:PORT (N threads)"); ggml's own log lines (clients
connecting and leaving) go to stdout. One client at a time: the next waits
until the first disconnects. SIGINT and SIGTERM end the server at once (a
client computing then gets an error naming this host). A port already taken
exits 1 before anything is served. The transport is IPv4 only.
"""

from __future__ import annotations

import ipaddress
import socket
import sys
from pathlib import Path
from typing import Annotated

import typer

from toy_cli.ui import CLIError, bad_input


def _addresses(host: str) -> list[str]:
    """The addresses ``host`` (an address or a name) stands for; [] when it cannot be resolved."""
    try:
        return [str(ipaddress.ip_address(host))]
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)
    except OSError:
        return []
    return sorted({str(info[4][0]) for info in infos})


def is_loopback(host: str) -> bool:
    """Whether binding ``host`` exposes the server to this machine only: every address it
    resolves to is a loopback one (127.0.0.0/8, ::1). A wildcard (0.0.0.0, ::) is not."""
    addrs = _addresses(host)
    return bool(addrs) and all(ipaddress.ip_address(a.split("%")[0]).is_loopback for a in addrs)


def _check_free(host: str, port: int) -> None:
    """Exit 1 when ``host:port`` cannot be bound (taken, or not an address of this machine)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_STREAM) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind((host, port))
    except OSError as e:
        raise CLIError(
            f"cannot listen on {host}:{port}: {e.strerror or e}",
            "pick another --port, or stop what listens there" if e.errno == 98 else None,
        ) from None


def rpc_server(
    host: Annotated[
        str, typer.Option("--host", help="The address to listen on (non-loopback needs --allow-remote).")
    ] = "127.0.0.1",
    port: Annotated[int, typer.Option("--port", "-p", min=1, max=65535, help="The TCP port.")] = 50052,
    threads: Annotated[
        int | None,
        typer.Option(
            "--threads", "-t", min=1, help="CPU threads for the graphs it computes (default: TOY_THREADS, else cores)."
        ),
    ] = None,
    allow_remote: Annotated[
        bool,
        typer.Option(
            "--allow-remote",
            help="Listen on a non-loopback address. The protocol has no authentication: anyone who reaches the "
            "port can run graphs and read and write memory buffers in this process.",
        ),
    ] = False,
    cache_dir: Annotated[
        Path | None,
        typer.Option("--cache-dir", help="Keep tensors clients send in this folder, so a reconnect sends less."),
    ] = None,
) -> None:
    """Serve this machine's CPU as a remote ggml device for --rpc HOST:PORT (loopback unless --allow-remote)."""
    host = host.strip()
    if not host:
        raise bad_input("--host is empty", "give an address, e.g. 127.0.0.1")
    if not _addresses(host):
        raise bad_input(f"--host {host!r} is not an address or a name this machine resolves")
    if not is_loopback(host) and not allow_remote:
        raise bad_input(
            f"--host {host} is not a loopback address: the RPC protocol has no authentication, anyone who "
            "reaches the port could use this machine",
            f"keep the default and reach it through an SSH tunnel (ssh -N -L {port}:127.0.0.1:{port} THIS-HOST, "
            f"then --rpc 127.0.0.1:{port} there), or add --allow-remote on a private network you trust",
        )
    import toy_ggml

    if not toy_ggml.rpc_available():
        raise CLIError(
            "this build of toy-ggml has no RPC backend", "rebuild toy-ggml with ggml's RPC backend (its default)"
        )
    if cache_dir is not None:
        try:
            cache_dir.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise bad_input(f"--cache-dir {cache_dir}: {e.strerror or e}") from None
    n = threads if threads is not None else toy_ggml.default_threads()
    _check_free(host, port)
    if not is_loopback(host):
        typer.echo(
            f"warning: serving on {host}:{port} with no authentication and no encryption: anyone who reaches "
            "this port can run graphs on this machine and read and write the memory buffers of this process "
            "(the weights and KV cache of every client). Use it on a private network you trust only.",
            err=True,
        )
    cache = str(cache_dir) if cache_dir is not None else None

    def ready() -> None:
        typer.echo(f"toy rpc-server: serving CPU on {host}:{port} ({n} threads)", err=True)
        sys.stderr.flush()

    try:  # SIGINT and SIGTERM end the process from here on (the server runs in C, the GIL released)
        toy_ggml.rpc_serve(host, port, n, cache, on_ready=ready)
    except ValueError as e:  # an address that is not IPv4 (ggml's RPC transport has no IPv6)
        raise bad_input(f"--host {host}: {e}") from None
    except toy_ggml.GGMLError as e:
        raise CLIError(f"cannot serve on {host}:{port}: {e}") from None
    raise CLIError(f"the RPC server on {host}:{port} stopped")


def register(app: typer.Typer) -> None:
    app.command("rpc-server")(rpc_server)
