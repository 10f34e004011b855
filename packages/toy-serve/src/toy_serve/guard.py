"""The guard middleware (pure ASGI): request id, API key, body limit, the
JSON body's well-formedness, 500s for escaped exceptions, request metrics and
the run bundle's ``request`` event; and ``OpenAIErrors``, the HTTP protocol
mixin that answers an unparsable request in OpenAI's error shape.

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
- The JSON body of the POST routes is checked here, before FastAPI parses it
  (only when FastAPI would read it as JSON: no Content-Type, or
  ``application/json``/``*+json``). Each of these answers 400
  ``invalid_json`` (param null): a body that is not UTF-8 (a UTF-8 BOM is
  allowed), a syntax error (the position, as FastAPI words it), nesting
  deeper than ``MAX_DEPTH`` (64) levels, an integer of more than Python's
  4300 digits. A string holding a lone surrogate (``"\\ud800"`` with no low
  half: not Unicode text) answers 400 ``invalid_value`` with ``param`` the
  field's dotted path (``messages.0.content``), wherever it is in the body;
  when a key holds it, the path shows it escaped (``logit_bias.\\ud800``),
  as every error body does with a lone surrogate it would quote
  (``error_response``), so the answer can be encoded.
  The cost is a second parse of the body (FastAPI parses it again): about
  4 ms per MB of text, 26 ms per MB of token ids, within ``max_body_bytes``;
  the walk over the parsed value runs only when the body has a surrogate
  escape or more than ``MAX_DEPTH`` brackets (35 ms for 850 KB of chat in
  4,000 messages, which the chat template and tokenizer then take far
  longer over).
- A request uvicorn cannot parse (a malformed ``Content-Length``, request
  line or header) never reaches the app: uvicorn answers it itself, in plain
  text. ``OpenAIErrors`` (mixed into uvicorn's protocol class) makes that
  answer a JSON 400 ``invalid_http_request`` with an ``x-request-id``,
  ``Connection: close``. It is not counted in ``/metrics``.
"""

from __future__ import annotations

import hmac
import json
import re
import secrets
import time
from collections.abc import Callable, MutableMapping
from typing import Any

from fastapi.responses import JSONResponse

from toy_serve.schemas import APIError, validation_error
from toy_serve.server import DEFAULT_PARAM, ENDPOINTS, LOGGED, OPEN_PATHS, Server, internal, log

NOTE_EVERY_S = 60.0  # at most one run-bundle note about refused (401) requests this often
MAX_DEPTH = 64  # nesting levels of a JSON body (a chat request with content parts needs 5)
JSON_PATHS = frozenset(DEFAULT_PARAM)  # the POST routes whose body FastAPI parses as JSON
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")  # the only way a lone surrogate gets into valid UTF-8 JSON
_LONE_SURROGATE = re.compile("[\ud800-\udfff]")  # after json.loads, a valid pair is one character


def _escape_surrogates(text: str) -> str:
    """``text`` with each lone surrogate written as its JSON escape (``\\ud800``): UTF-8 cannot encode it."""
    return _LONE_SURROGATE.sub(lambda m: f"\\u{ord(m.group()):04x}", text)


def _encodable(value: Any) -> Any:
    if isinstance(value, str):
        return _escape_surrogates(value)
    if isinstance(value, dict):
        return {_encodable(k): _encodable(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_encodable(v) for v in value]
    return value


def error_response(err: APIError) -> JSONResponse:
    """``err`` as OpenAI's error JSON. Its strings may quote the request (a key, a value): a lone surrogate
    in them is escaped, so the answer can always be encoded (else the error itself would be a 500)."""
    return JSONResponse(_encodable(err.body()), status_code=err.status, headers=err.headers)


def _path_part(part: Any, limit: int = 64) -> str:
    """One step of a field path as an error names it: lone surrogates escaped, at most ``limit`` characters."""
    text = _escape_surrogates(str(part))
    return text if len(text) <= limit else text[:limit] + "…"


class Guard:
    """Request id, auth, body limit, 500s, metrics and the run-bundle request event (see the module doc)."""

    noted_at: float | None

    def __init__(self, app: Any, server: Server):
        self.app, self.srv = app, server
        self.refused, self.noted_at = 0, None  # 401s not yet in a note; when the last note was written

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        t0, rid = time.perf_counter(), secrets.token_hex(12)
        path = scope["path"]
        endpoint = path if path in ENDPOINTS else "other"
        stats: dict[str, Any] = {}
        cleanup: list[Callable[[], None]] = []
        scope["toy.request_id"], scope["toy.stats"], scope["toy.cleanup"] = rid, stats, cleanup
        status = [0]

        async def send_(msg: MutableMapping[str, Any]) -> None:
            if msg["type"] == "http.response.start":
                status[0] = msg["status"]
                msg = {**msg, "headers": [*msg.get("headers", []), (b"x-request-id", rid.encode())]}
            await send(msg)

        try:
            early = self._auth(scope)
            if early is None:
                body, early = await self._body(scope, receive)
            if early is None and path in JSON_PATHS and scope.get("method") == "POST" and _is_json(scope):
                early = check_json(body)
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


def _is_json(scope: dict) -> bool:
    """Whether FastAPI reads this body as JSON (no Content-Type, application/json or application/*+json)."""
    ctype = dict(scope["headers"]).get(b"content-type")
    if ctype is None:
        return True
    mime = ctype.split(b";", 1)[0].strip().lower()
    return mime == b"application/json" or (mime.startswith(b"application/") and mime.endswith(b"+json"))


def check_json(body: bytes) -> APIError | None:
    """None when ``body`` is well-formed JSON (or empty: FastAPI reports a missing body), else the 400
    (see the module docstring)."""
    if not body:
        return None
    try:
        text = body.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        return APIError(400, f"the request body is not valid UTF-8 (at byte {e.start})", code="invalid_json")
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        return validation_error([{"type": "json_invalid", "loc": ("body", e.pos)}])
    except RecursionError:
        return _too_deep()
    except ValueError:  # int() refuses more than sys.get_int_max_str_digits() digits
        return APIError(400, "the request body holds an integer of more than 4300 digits", code="invalid_json")
    if _SURROGATE_ESCAPE.search(body) or body.count(b"[") + body.count(b"{") > MAX_DEPTH:
        return _walk(value)
    return None


def _too_deep() -> APIError:
    return APIError(400, f"the request body is nested more than {MAX_DEPTH} levels deep", code="invalid_json")


def _walk(value: Any) -> APIError | None:
    """The first lone surrogate (in a key or a string) or nesting deeper than ``MAX_DEPTH``, if any."""
    todo: list[tuple[Any, tuple, int]] = [(value, (), 0)]
    while todo:
        v, path, depth = todo.pop()
        if isinstance(v, str):
            if _LONE_SURROGATE.search(v):
                where = ".".join(map(_path_part, path)) or None  # a key may hold the surrogate: escaped
                msg = f"{where or 'the request body'}: the string holds a lone surrogate (not valid Unicode text)"
                return APIError(400, msg, param=where, code="invalid_value")
        elif isinstance(v, (dict, list)):
            if depth >= MAX_DEPTH:
                return _too_deep()
            items = v.items() if isinstance(v, dict) else enumerate(v)
            for k, x in reversed(list(items)):  # reversed: the first offending field is found first
                todo.append((x, (*path, k), depth + 1))
                if isinstance(k, str):
                    todo.append((k, (*path, k), depth + 1))
    return None


def _send_400(self: Any, msg: str) -> None:
    """uvicorn's answer to a request it cannot parse, in OpenAI's error shape (``OpenAIErrors``)."""
    err = APIError(400, f"invalid HTTP request: {_WHY}", code="invalid_http_request")
    body = json.dumps(err.body()).encode()
    head = [b"HTTP/1.1 400 Bad Request"]
    head += [name + b": " + value for name, value in getattr(self.server_state, "default_headers", [])]
    head += [b"content-type: application/json", b"content-length: " + str(len(body)).encode()]
    head += [b"x-request-id: " + secrets.token_hex(12).encode(), b"connection: close", b"", b""]
    self.transport.write(b"\r\n".join(head) + body)
    self.transport.close()


_WHY = "a malformed request line, header or Content-Length (uvicorn could not parse it)"


class OpenAIErrors:
    """Mixin for uvicorn's HTTP protocol classes (h11, httptools: both call ``send_400_response``
    for a request they cannot parse): the 400 is OpenAI-shaped JSON instead of plain text.
    Use as ``type("P", (OpenAIErrors, AutoHTTPProtocol), {})`` (leftmost of uvicorn's class)."""

    send_400_response = _send_400


def http_protocol(base: type | None = None) -> type:
    """``base`` (default: uvicorn's "auto" choice, httptools when installed, else h11) with ``OpenAIErrors``."""
    if base is None:
        from uvicorn.protocols.http.auto import AutoHTTPProtocol

        base = AutoHTTPProtocol
    return type(f"OpenAIErrors{base.__name__}", (OpenAIErrors, base), {})


def _replay(body: bytes, receive: Any) -> Any:
    sent = False

    async def recv() -> dict:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return recv
