"""The guard middleware (pure ASGI): request id, API key, body limit, 500s for
escaped exceptions, request metrics and the run bundle's ``request`` event.

Decisions (hardening):

- Telemetry never reaches a request: counting the request and writing its
  event run after the response, and anything they raise is logged, not
  re-raised (the run writer of a serve run already degrades instead of
  raising on a full disk; see ``toy.runs.writer``).
- A request refused for its API key (401) writes no ``request`` event: a
  client without the key must not be able to grow the run bundle. It is
  counted in ``toy_requests_total{status="401"}``, and at most one ``note``
  event every ``NOTE_EVERY_S`` (60 s) says how many were refused since the
  previous one (``unauthorized``: the count); the first 401 writes one at
  once. The run_end ``requests`` figure counts ``request`` events only.
"""

from __future__ import annotations

import hmac
import secrets
import time
from typing import Any

from fastapi.responses import JSONResponse

from toy_serve.schemas import APIError
from toy_serve.server import ENDPOINTS, LOGGED, OPEN_PATHS, Server, internal, log

NOTE_EVERY_S = 60.0  # at most one run-bundle note about refused (401) requests this often


def error_response(err: APIError) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status, headers=err.headers)


class Guard:
    """Request id, auth, body limit, 500s, metrics and the run-bundle request event (see the module doc)."""

    def __init__(self, app: Any, server: Server):
        self.app, self.srv = app, server
        self.refused, self.noted_at = 0, None  # 401s not yet in a note; when the last note was written

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        t0, rid = time.perf_counter(), secrets.token_hex(12)
        path = scope["path"]
        endpoint = path if path in ENDPOINTS else "other"
        scope["toy.request_id"], scope["toy.stats"], scope["toy.cleanup"] = rid, (stats := {}), (cleanup := [])
        status = [0]

        async def send_(msg: dict) -> None:
            if msg["type"] == "http.response.start":
                status[0] = msg["status"]
                msg = {**msg, "headers": [*msg.get("headers", []), (b"x-request-id", rid.encode())]}
            await send(msg)

        try:
            early = self._auth(scope)
            if early is None:
                body, early = await self._body(scope, receive)
            if early is not None:
                await error_response(early)(scope, receive, send_)
            else:
                await self.app(scope, _replay(body, receive), send_)
        except Exception:
            log.exception("request %s %s failed", rid, path)
            if not status[0]:
                await error_response(internal("internal server error", rid))(scope, receive, send_)
        finally:
            for cancel in cleanup:  # jobs of a stream that never started (client gone at once) stop here
                cancel()
            self._account(path, endpoint, rid, status[0] or 500, stats, time.perf_counter() - t0)

    def _account(self, path: str, endpoint: str, rid: str, status: int, stats: dict, duration: float) -> None:
        """Metrics and the run bundle, after the response: nothing here may fail the request."""
        try:
            self.srv.metrics.request(endpoint, status, duration)
            if status == 401:
                self._note_refused()
            elif path in LOGGED:
                self.srv.log_request(rid, endpoint, status, stats, duration)
        except Exception:  # noqa: BLE001 - telemetry must never reach a request (module docstring)
            log.exception("request %s: recording it failed", rid)

    def _note_refused(self) -> None:
        """Count a 401; write the ``note`` when none was written in the last ``NOTE_EVERY_S``."""
        self.refused += 1
        now, writer = time.monotonic(), self.srv.writer
        if writer is None or (self.noted_at is not None and now - self.noted_at < NOTE_EVERY_S):
            return
        text = f"refused {self.refused} request(s) without a valid API key (401) since the last such note"
        try:
            writer.event("note", text=text, unauthorized=self.refused)
        except RuntimeError:  # the run has ended (a late request during shutdown)
            return
        self.noted_at, self.refused = now, 0

    def _auth(self, scope: dict) -> APIError | None:
        key = self.srv.settings.api_key
        if key is None or scope["path"] in OPEN_PATHS:
            return None
        given = dict(scope["headers"]).get(b"authorization", b"")
        scheme, _, token = given.partition(b" ")
        if scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), key.encode()):
            return None
        msg = "invalid or missing API key (send 'Authorization: Bearer <key>')"
        return APIError(401, msg, code="invalid_api_key", headers={"www-authenticate": "Bearer"})

    async def _body(self, scope: dict, receive: Any) -> tuple[bytes, APIError | None]:
        limit = self.srv.settings.max_body_bytes
        too_big = APIError(413, f"the request body is larger than {limit} bytes", code="request_too_large")
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None:
            if not length.isdigit():
                return b"", APIError(400, "invalid Content-Length header")
            if int(length) > limit:
                return b"", too_big
        chunks, size = [], 0
        while True:
            msg = await receive()
            if msg["type"] != "http.request":
                break  # the client left: the app sees the disconnect on its next receive
            chunks.append(msg.get("body", b""))
            size += len(chunks[-1])
            if size > limit:
                return b"", too_big
            if not msg.get("more_body"):
                break
        return b"".join(chunks), None


def _replay(body: bytes, receive: Any) -> Any:
    sent = False

    async def recv() -> dict:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return recv
