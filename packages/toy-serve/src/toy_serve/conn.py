"""The network side of ``toy serve``: the bound port, each connection's read
timeouts and the cap on connections, throttled accept errors, and the
shutdown sequence (drain, then end what is left).

- ``bind(host, port)`` binds and listens before anything is loaded, so a port
  in use or a host that does not resolve is a ``BadInputError`` (the CLI
  exits 2) naming ``host:port``, never a traceback after the model loaded.
- ``protocol_class(settings)`` is uvicorn's HTTP protocol (httptools when
  installed, else h11: uvicorn's "auto"; with ``guard.OpenAIErrors``, so a
  request uvicorn cannot parse gets an OpenAI-shaped 400) with three guards
  added, applied before the app sees anything:

  - request headers must be complete within ``header_timeout`` seconds of
    the connection (or of the first byte of a later request on a kept-alive
    connection); a connection that sent nothing is closed, one that sent a
    partial head gets 408 ``request_timeout`` and is closed;
  - a request body must be complete within ``body_timeout`` seconds of its
    headers, else 408 and the connection is closed (the app sees the client
    leave);
  - at most ``max_connections`` connections are open at once: the next one
    is answered 503 ``too_many_connections`` (``Retry-After: 1``) at once,
    without reading its request, and closed (after the client closes, or
    1 s). Idle kept-alive connections close after uvicorn's
    ``timeout_keep_alive`` (5 s).

  These answers come from outside the app, so they carry an ``x-request-id``
  but are not counted in ``/metrics`` or the run bundle; the closings are
  logged, at most one warning line per kind every ``LOG_EVERY_S`` with a count.
- ``ToyUvicorn`` is ``uvicorn.Server`` with two changes. At startup it
  installs an event-loop exception handler that logs "cannot accept
  connections" (EMFILE and friends) at most once every ``LOG_EVERY_S``, with a
  count, instead of a traceback per failed ``accept()`` (Python 3.11's
  selector loop retries up to ``backlog`` times per tick: ~1,000 tracebacks a
  second when descriptors run out; the restarts it schedules for each, still
  pending when the listening socket closes at shutdown, are dropped
  silently). Its ``shutdown`` replaces uvicorn's:

  1. stop accepting; close idle connections; ``/health`` and new requests
     answer 503 (``Server.status`` is "stopping");
  2. wait up to ``drain_timeout`` for the requests in flight (a second
     SIGTERM or Ctrl-C ends the wait at once);
  3. end what is left in the engine (``Server.abandon``): each such sequence
     ends with the error "the server is shutting down", so a stream gets an
     ``{"error": ...}`` chunk, ``data: [DONE]`` and a terminated body, and a
     non-stream request 503; they are counted in run_end's ``abandoned``;
  4. give the responses up to ``FLUSH_S`` to go out, then close the
     connections of clients that do not read and cancel what still runs;
  5. the app's lifespan shutdown (run_end, the model freed), even after a
     forced exit, so the run bundle is always closed.

Invariants: nothing here holds state across servers; timers belong to their
connection and are cancelled when it goes.
"""

from __future__ import annotations

import asyncio
import errno
import json
import logging
import os
import secrets
import socket
import time
from typing import TYPE_CHECKING, Any

import uvicorn

from toy.errors import BadInputError

log = logging.getLogger("toy_serve")
uv_log = logging.getLogger("uvicorn.error")

LOG_EVERY_S = 5.0  # at most one line per kind of connection trouble this often
FLUSH_S = 2.0  # how long ended streams get to send their last chunks at shutdown
LINGER_S = 1.0  # a refused connection is closed after this (or when the client closes)
BACKLOG = 2048  # uvicorn's default listen backlog


def bind(host: str, port: int, backlog: int = BACKLOG) -> socket.socket:
    """A listening TCP socket on ``host:port`` (an IPv4 address preferred for a name); ``BadInputError``
    naming ``host:port`` when the name does not resolve or the address cannot be bound."""
    shown = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    try:
        infos = socket.getaddrinfo(host, port, socket.AF_UNSPEC, socket.SOCK_STREAM, 0, socket.AI_PASSIVE)
    except (socket.gaierror, UnicodeError) as e:
        why = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
        raise BadInputError(f"cannot bind {shown}: {why.lower()}", hint="--host takes an address or a host name") from e
    family, _, proto, _, addr = next((i for i in infos if i[0] == socket.AF_INET), infos[0])
    sock = socket.socket(family, socket.SOCK_STREAM, proto)
    try:
        if os.name == "posix":  # as asyncio and uvicorn do: a port in TIME_WAIT can be bound again
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(addr)
        sock.listen(backlog)
    except OSError as e:
        sock.close()
        why = os.strerror(e.errno).lower() if e.errno else str(e)
        hint = (
            "another server uses this port: stop it or choose another --port" if e.errno == errno.EADDRINUSE else None
        )
        raise BadInputError(f"cannot bind {shown}: {why}", hint=hint) from e
    return sock


class Throttle:
    """Warnings of one kind at most once every ``every`` seconds; the next line counts the ones skipped."""

    def __init__(self, every: float = LOG_EVERY_S, logger: logging.Logger = log):
        self.every, self.logger = every, logger
        self.last: dict[str, float] = {}
        self.skipped: dict[str, int] = {}

    def warn(self, kind: str, message: str) -> bool:
        now = time.monotonic()
        if now - self.last.get(kind, -1e18) < self.every:
            self.skipped[kind] = self.skipped.get(kind, 0) + 1
            return False
        n = self.skipped.pop(kind, 0)
        self.last[kind] = now
        more = f" (and {n} more since the last such line)" if n else ""
        self.logger.warning("%s%s", message, more)
        return True


def _raw_response(status: int, reason: str, message: str, code: str | None, extra: tuple[str, ...] = ()) -> bytes:
    """A whole HTTP/1.1 error response in OpenAI's error shape, written past the app (connection: close)."""
    kind = "server_error" if status >= 500 else "invalid_request_error"
    body = json.dumps({"error": {"message": message, "type": kind, "param": None, "code": code}}).encode()
    head = [f"HTTP/1.1 {status} {reason}", "content-type: application/json", f"content-length: {len(body)}"]
    head += [*extra, f"x-request-id: {secrets.token_hex(12)}", "connection: close", "", ""]
    return "\r\n".join(head).encode("latin-1") + body


if TYPE_CHECKING:  # for mypy: what _Guarded is mixed into (uvicorn's attributes, super()'s methods)
    from uvicorn.protocols.http.h11_impl import H11Protocol as _ProtocolBase
else:
    _ProtocolBase = object


class _Guarded(_ProtocolBase):
    """The timeouts and the cap (see the module docstring), mixed into uvicorn's protocol class.

    State per connection: ``_phase`` is "head" (waiting for request headers), "body" (for the body),
    "app" (the app has the request) or None (idle after a response: uvicorn's keep-alive timer runs);
    ``_timer`` is the one timer armed; ``_seen`` the request cycle last accounted for."""

    header_timeout: float = 10.0
    body_timeout: float = 30.0
    max_connections: int = 1000
    throttle: Throttle

    def connection_made(self, transport: Any) -> None:
        super().connection_made(transport)
        self._timer: asyncio.TimerHandle | None = None
        self._seen: Any = None
        self._bytes = 0
        self._refused = len(self.connections) > self.max_connections
        if self._refused:
            msg = f"the server has too many open connections ({self.max_connections}); try again"
            transport.write(
                _raw_response(503, "Service Unavailable", msg, code="too_many_connections", extra=("retry-after: 1",))
            )
            if transport.can_write_eof():
                transport.write_eof()  # the client reads the 503, then EOF; what it sent is read and dropped
            self._timer = self.loop.call_later(LINGER_S, transport.close)
            self.throttle.warn("cap", f"refused a connection with 503: {self.max_connections} are open")
            return
        self._phase: str | None = "head"
        self._arm(self.header_timeout)

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel()
        super().connection_lost(exc)

    def eof_received(self) -> Any:
        if getattr(self, "_refused", False):
            return None  # the transport closes itself
        return super().eof_received()

    def data_received(self, data: bytes) -> None:
        if self._refused:
            return
        if self._phase is None:  # the first byte of another request on a kept-alive connection
            self._phase, self._bytes = "head", 0
            self._arm(self.header_timeout)
        if self._phase == "head":
            self._bytes += len(data)
        super().data_received(data)
        self._track()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._track()
        if self._phase == "app" and self.cycle is self._seen:
            self._phase = None  # idle: uvicorn's keep-alive timer takes over

    def shutdown(self) -> None:
        """uvicorn's graceful close (idle connections now, busy ones after their response), except that a
        request whose body is still arriving is not waited for: it gets 503 "the server is shutting down"."""
        cycle = self.cycle
        if getattr(self, "_phase", None) == "body" and cycle is not None and not cycle.response_started:
            self._cancel()
            msg = "the server is shutting down"
            self.transport.write(_raw_response(503, "Service Unavailable", msg, code=None, extra=("retry-after: 1",)))
            self.transport.close()
            return
        super().shutdown()

    def _track(self) -> None:
        cycle = self.cycle
        if cycle is None:
            return
        if cycle is not self._seen:  # a new request's headers are complete
            self._seen, self._bytes = cycle, 0
            self._cancel()
            self._phase = "body" if cycle.more_body else "app"
            if cycle.more_body:
                self._arm(self.body_timeout)
        elif self._phase == "body" and not cycle.more_body:
            self._cancel()
            self._phase = "app"

    def _arm(self, seconds: float) -> None:
        self._cancel()
        self._timer = self.loop.call_later(seconds, self._expire)

    def _cancel(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _expire(self) -> None:
        self._timer = None
        if self.transport.is_closing():
            return
        if self._phase == "head":
            what, limit, answer = "request headers", self.header_timeout, self._bytes > 0
        else:
            cycle = self.cycle
            what, limit = "a request body", self.body_timeout
            answer = cycle is not None and not cycle.response_started
        if answer:
            msg = f"{what} did not arrive within {limit:g} s"
            self.transport.write(_raw_response(408, "Request Timeout", msg, code="request_timeout"))
        peer = f"{self.client[0]}:{self.client[1]}" if self.client else "a client"
        self.throttle.warn(
            self._phase or "idle", f"closed the connection of {peer}: {what} not complete in {limit:g} s"
        )
        self.transport.close()


def protocol_class(settings: Any, base: type | None = None, throttle: Throttle | None = None) -> type:
    """``base`` with ``settings``' timeouts and connection cap. The default base is ``guard.http_protocol()``:
    uvicorn's "auto" class (httptools when installed, else h11) whose answer to a request it cannot parse
    is an OpenAI-shaped 400 (``guard.OpenAIErrors``)."""
    if base is None:
        from toy_serve.guard import http_protocol

        base = http_protocol()
    attrs = {
        "header_timeout": settings.header_timeout,
        "body_timeout": settings.body_timeout,
        "max_connections": settings.connection_limit,
        "throttle": throttle or Throttle(),
    }
    return type(f"Toy{base.__name__}", (_Guarded, base), attrs)


class ToyUvicorn(uvicorn.Server):
    """uvicorn's server with throttled accept errors and toy's shutdown sequence (module docstring).
    ``srv`` is the app's ``toy_serve.server.Server``; ``sockets`` were bound by ``bind``."""

    def __init__(self, config: uvicorn.Config, srv: Any):
        super().__init__(config)
        self.srv = srv
        self.accept_errors = Throttle(logger=uv_log)

    def _exception(self, loop: asyncio.AbstractEventLoop, context: dict) -> None:
        if str(context.get("message", "")).startswith("socket.accept() out of system resource"):
            exc = context.get("exception")
            open_ = len(self.server_state.connections)
            self.accept_errors.warn("accept", f"cannot accept connections: {exc} ({open_} open)")
            return
        callback = getattr(context.get("handle"), "_callback", None)
        if getattr(callback, "__name__", "") == "_start_serving" and self.should_exit:
            # the loop schedules one accept restart per failed accept(); those still pending when the
            # listening socket has closed (shutdown) fail on its closed descriptor: nothing to report
            log.debug("an accept restart after shutdown: %s", context.get("exception"))
            return
        loop.default_exception_handler(context)

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        asyncio.get_running_loop().set_exception_handler(self._exception)
        await super().startup(sockets=sockets)
        if sockets and self.started:  # uvicorn logs its "running on" line only for sockets it bound itself
            host, port = sockets[0].getsockname()[:2]
            fmt = "http://[%s]:%d" if ":" in host else "http://%s:%d"
            uv_log.info("Uvicorn running on " + fmt + " (Press CTRL+C to quit)", host, port)

    def handle_exit(self, sig: int, frame: Any) -> None:
        again = self.should_exit
        if self.srv.status == "loading":
            # at once, not at uvicorn's next tick (shutdown() sets it too): a load that ends in between must
            # not start serving, so a server stopped while loading leaves no run bundle
            self.srv.status = "stopping"
        super().handle_exit(sig, frame)
        if again:  # a second SIGTERM forces the exit too (uvicorn: only a second SIGINT)
            self.force_exit = True

    def _running(self) -> int:
        worker = self.srv.worker
        return max(len(self.server_state.tasks), worker.busy() if worker is not None else 0)

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        uv_log.info("Shutting down")
        self.srv.status = "stopping"
        for server in self.servers:
            server.close()
        for sock in sockets or []:
            sock.close()
        for connection in list(self.server_state.connections):
            connection.shutdown()  # idle ones close now; busy ones close after their response
        await asyncio.sleep(0.1)  # as uvicorn does: let the closings run before counting what is left
        drain = self.srv.settings.drain_timeout
        if self._running():
            uv_log.info(
                "Waiting up to %g s for %d request(s) in flight (Ctrl-C again to end them now)", drain, self._running()
            )
        deadline = time.monotonic() + drain
        while self._running() and time.monotonic() < deadline and not self.force_exit:
            await asyncio.sleep(0.05)
        ended = await self.srv.abandon()
        if ended:
            why = "forced exit" if self.force_exit else f"the drain timeout ({drain:g} s) ran out"
            uv_log.warning("%s: %d sequence(s) ended with 'the server is shutting down'", why, ended)
        await self._wait(lambda: self.server_state.tasks, FLUSH_S)
        stuck = [c for c in self.server_state.connections if not c.transport.is_closing()]
        for connection in stuck:  # clients that do not read their response
            connection.transport.close()
        await self._wait(lambda: self.server_state.tasks, 1.0)
        if self.server_state.tasks:
            uv_log.warning("cancelling %d request(s) that did not end", len(self.server_state.tasks))
            for task in list(self.server_state.tasks):
                task.cancel()
            await self._wait(lambda: self.server_state.tasks, 1.0)
        await self.lifespan.shutdown()

    async def _wait(self, pending: Any, seconds: float) -> None:
        deadline = time.monotonic() + seconds
        while pending() and time.monotonic() < deadline:
            await asyncio.sleep(0.02)


__all__ = ["FLUSH_S", "LOG_EVERY_S", "Throttle", "ToyUvicorn", "bind", "protocol_class"]
