"""``toy serve`` against slow, half-open and too many connections, and its start-up errors.

Each test runs ``toy serve`` as a real process over a tiny generated model
(``toy_test_models.write_tiny_model``: loads in milliseconds) and talks to it
with raw sockets. References: ``toy_serve.conn``'s docstring (headers within
``--header-timeout``, a body within ``--body-timeout`` of its headers, else
408 ``request_timeout`` and the connection closes; a connection that sent
nothing is closed; beyond ``--max-connections`` a 503
``too_many_connections``; accept errors logged at most once every 5 s) and
``toy_serve.cli``'s (options, the runs dir, the model's header, ``--ctx`` and
the port are checked before the model loads; bad input exits 2 with an
``error:`` line; a server that never served leaves no run bundle).
"""

from __future__ import annotations

import json
import re
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

TIMEOUT = 1.0  # --header-timeout and --body-timeout of the guarded server


def _toy() -> str:
    exe = Path(sys.executable).parent / "toy"
    assert exe.is_file(), f"the toy command is not installed next to {sys.executable}"
    return str(exe)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    from toy_testsupport import toy_test_models

    path = tmp_path_factory.mktemp("tiny") / "tiny.gguf"
    return toy_test_models.write_tiny_model(path, extra_metadata={"tokenizer.ggml.merges": []})


class Proc:
    """``toy serve MODEL --port 0 ...``; stderr is read by a thread into ``err`` (and its size counted)."""

    def __init__(self, model: Path, runs: Path, *extra: str, preexec=None):
        cmd = [_toy(), "serve", str(model), "--port", "0", "--threads", "1", "--runs-dir", str(runs), *extra]
        self.proc = subprocess.Popen(
            cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, preexec_fn=preexec, text=True, errors="replace"
        )
        self.err: list[str] = []
        self.err_bytes = 0
        self.port: int | None = None
        self._got_port = threading.Event()
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        for line in self.proc.stderr:
            if len(self.err) < 20_000:  # a flood of tracebacks must not eat the test's memory
                self.err.append(line)
            self.err_bytes += len(line)
            m = re.search(r"Uvicorn running on http://127\.0\.0\.1:(\d+)", line)
            if m and self.port is None:
                self.port = int(m.group(1))
                self._got_port.set()

    def ready(self, timeout: float = 60) -> str:
        assert self._got_port.wait(timeout), "".join(self.err)
        url = f"http://127.0.0.1:{self.port}"
        deadline = time.monotonic() + timeout
        while httpx.get(url + "/health", timeout=10).status_code != 200:
            assert time.monotonic() < deadline, "the model did not load"
            time.sleep(0.05)
        return url

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.terminate()
        try:
            rc = self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            rc = self.proc.wait(10)
        self._thread.join(10)
        return rc


def _wait_healthy(url: str, timeout: float, what: str) -> None:
    """Poll /health until it answers 200 (connection errors count as not yet), failing with ``what``."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            if httpx.get(url + "/health", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline, what
        time.sleep(0.1)


def _connect(port: int) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", port), timeout=10)
    s.settimeout(TIMEOUT + 4)
    return s


def _read_all(s: socket.socket) -> bytes:
    """Everything until the server closes (socket.timeout when it does not)."""
    out = b""
    while chunk := s.recv(65536):
        out += chunk
    return out


def _error(raw: bytes) -> tuple[int, dict]:
    head, _, body = raw.partition(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1])
    assert b"x-request-id:" in head.lower() and b"connection: close" in head.lower(), head
    err = json.loads(body)["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    return status, err


@pytest.fixture(scope="module")
def guarded(tiny, tmp_path_factory):
    """One server with 1 s header and body timeouts, shared by the timeout tests."""
    p = Proc(tiny, tmp_path_factory.mktemp("runs"), "--header-timeout", "1", "--body-timeout", "1")
    yield p
    p.stop()


@pytest.fixture(scope="module")
def capped(tiny, tmp_path_factory):
    p = Proc(tiny, tmp_path_factory.mktemp("runs"), "--max-connections", "8")
    yield p
    p.stop()


def test_an_idle_connection_is_closed(guarded):
    guarded.ready()
    t0 = time.monotonic()
    with _connect(guarded.port) as s:
        assert _read_all(s) == b""  # closed without an answer: it asked nothing
    assert time.monotonic() - t0 < TIMEOUT + 2


def test_trickled_headers_get_408(guarded):
    guarded.ready()
    t0 = time.monotonic()
    with _connect(guarded.port) as s:
        s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")
        try:
            for i in range(40):  # one header line every 0.1 s: never a complete head
                s.sendall(b"X-%d: y\r\n" % i)
                time.sleep(0.1)
        except OSError:  # closed by the server while we still write
            pass
        status, err = _error(_read_all(s))
    assert status == 408 and err["code"] == "request_timeout" and "headers" in err["message"], err
    assert time.monotonic() - t0 < TIMEOUT + 2


def test_a_kept_alive_connection_times_out_a_later_head(guarded):
    url = guarded.ready()
    with _connect(guarded.port) as s:
        s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        first = s.recv(65536)
        assert first.startswith(b"HTTP/1.1 200"), first
        s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")  # the next request's head, never finished
        status, err = _error(_read_all(s))
    assert status == 408 and err["code"] == "request_timeout", err
    assert httpx.get(url + "/health", timeout=10).status_code == 200


def test_a_short_body_gets_408(guarded):
    url = guarded.ready()
    body = b'{"prompt": "' + b"a" * 100
    t0 = time.monotonic()
    with _connect(guarded.port) as s:
        head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        s.sendall(head + b"Content-Length: %d\r\n\r\n" % (len(body) + 500) + body)  # 500 bytes short
        status, err = _error(_read_all(s))
    assert status == 408 and err["code"] == "request_timeout" and "body" in err["message"], err
    assert time.monotonic() - t0 < TIMEOUT + 2
    r = httpx.post(url + "/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 2}, timeout=30)
    assert r.status_code == 200, r.text  # the server goes on serving


def test_a_slow_but_steady_request_is_served(guarded):
    """The timeouts bound each phase, not the gaps: a whole request inside them is answered."""
    guarded.ready()
    with _connect(guarded.port) as s:
        body = json.dumps({"prompt": [1, 2, 3], "max_tokens": 2}).encode()
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nConnection: close\r\n")
        time.sleep(TIMEOUT / 2)
        s.sendall(b"Content-Length: %d\r\n\r\n" % len(body) + body[:5])
        time.sleep(TIMEOUT / 2)
        s.sendall(body[5:])
        raw = _read_all(s)
    assert raw.startswith(b"HTTP/1.1 200"), raw[:200]


def test_a_request_uvicorn_cannot_parse_gets_an_openai_error(guarded):
    """The guards stack on guard.py's protocol mixin: a malformed Content-Length is a JSON 400 too."""
    guarded.ready()
    with _connect(guarded.port) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: abc\r\n\r\n{}")
        status, err = _error(_read_all(s))
    assert status == 400 and err["code"] == "invalid_http_request", err


def test_connections_beyond_the_cap_get_503(capped):
    url = capped.ready()
    held = [_connect(capped.port) for _ in range(8)]
    try:
        time.sleep(0.3)  # the server has accepted them all
        with _connect(capped.port) as s:
            s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
            raw = _read_all(s)
        status, err = _error(raw)
        assert status == 503 and err["code"] == "too_many_connections", err
        assert b"retry-after: 1" in raw.lower()
    finally:
        for s in held:
            s.close()
    _wait_healthy(url, 10, "the server did not answer again once the connections closed")
    assert any("refused a connection with 503" in line for line in capped.err), "".join(capped.err[-20:])


@pytest.mark.skipif(sys.platform == "win32", reason="RLIMIT_NOFILE")
@pytest.mark.parametrize("extra", [(), ("--max-connections", "1000")], ids=["default-cap", "cap-above-limit"])
def test_out_of_descriptors_keeps_the_log_small_and_recovers(tiny, tmp_path, extra):
    """300 connections against a 256-descriptor limit: the log stays small (accept errors at most one line
    every 5 s), and the server answers again once they close. The default cap stays below the limit; with a
    cap above it accept() does fail with EMFILE."""
    import resource

    def low_limit() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (256, 256))

    p = Proc(tiny, tmp_path / "runs", *extra, preexec=low_limit)
    held: list[socket.socket] = []
    try:
        url = p.ready()
        for _ in range(300):
            try:
                s = socket.create_connection(("127.0.0.1", p.port), timeout=2)
                held.append(s)
            except OSError:  # the listen backlog is full: the server cannot keep up
                pass
        time.sleep(3)
        for s in held:
            s.close()
        held = []
        _wait_healthy(url, 15, "the server did not answer again")
        log_bytes = p.err_bytes
    finally:
        for s in held:
            s.close()
        rc = p.stop()
    accept_lines = [x for x in p.err if "cannot accept connections" in x or "accept()" in x]
    print(f"{extra or 'default cap'}: {log_bytes} bytes of log, {len(accept_lines)} accept lines")  # -s shows it
    assert log_bytes < 20_000, f"{log_bytes} bytes of log, {len(accept_lines)} accept lines"
    assert len(accept_lines) <= 3, accept_lines
    assert "Traceback" not in "".join(p.err)
    if extra:
        assert any("cannot accept connections" in x for x in accept_lines), "".join(p.err[-30:])
    assert rc == 0, "".join(p.err[-30:])


def test_shutdown_does_not_wait_for_a_body_still_arriving(tiny, tmp_path):
    p = Proc(tiny, tmp_path / "runs", "--drain-timeout", "30")
    try:
        p.ready()
        with _connect(p.port) as s:
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{")
            time.sleep(0.3)
            p.proc.terminate()
            t0 = time.monotonic()
            status, err = _error(_read_all(s))
        rc = p.proc.wait(30)
        elapsed = time.monotonic() - t0
    finally:
        p.stop()
    assert status == 503 and err["message"] == "the server is shutting down", err
    assert rc == 0 and elapsed < 5, (rc, elapsed)


# ---------------------------------------------------------------------------------------------- start-up


def _serve(*args: str, timeout: float = 60) -> tuple[subprocess.CompletedProcess, float]:
    t0 = time.monotonic()
    p = subprocess.run([_toy(), "serve", *args], capture_output=True, text=True, timeout=timeout)
    return p, time.monotonic() - t0


def _clean_error(p: subprocess.CompletedProcess, *fragments: str) -> None:
    assert p.returncode == 2, (p.returncode, p.stderr)
    assert p.stderr.startswith("error: "), p.stderr
    assert "Traceback" not in p.stderr and "loading the model" not in p.stderr, p.stderr
    for f in fragments:
        assert f in p.stderr, p.stderr


@pytest.fixture
def busy_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen(1)
    yield s.getsockname()[1]
    s.close()


def test_a_port_in_use_is_an_error_before_loading(tiny, tmp_path, busy_port):
    runs = tmp_path / "runs"
    p, _ = _serve(str(tiny), "--port", str(busy_port), "--runs-dir", str(runs))
    _clean_error(p, f"error: cannot bind 127.0.0.1:{busy_port}: address already in use")
    assert not runs.exists() or not any(runs.iterdir()), list(runs.iterdir())  # it never served: no bundle


def test_an_unresolvable_host_is_an_error(tiny, tmp_path):
    runs = tmp_path / "runs"
    p, _ = _serve(str(tiny), "--host", "no-such-host.invalid", "--port", "0", "--runs-dir", str(runs))
    _clean_error(p, "error: cannot bind no-such-host.invalid:0: ")
    assert not runs.exists() or not any(runs.iterdir())


def test_a_garbage_model_exits_2_as_toy_infer_does(tmp_path):
    bad = tmp_path / "garbage.gguf"
    bad.write_bytes(b"this is not a GGUF file at all\n" * 64)
    infer = subprocess.run([_toy(), "infer", str(bad), "hi"], capture_output=True, text=True, timeout=60)
    assert infer.returncode == 2, infer.stderr
    runs = tmp_path / "runs"
    p, _ = _serve(str(bad), "--port", "0", "--runs-dir", str(runs))
    _clean_error(p)
    assert not runs.exists() or not any(runs.iterdir())


def test_ctx_beyond_the_model_is_checked_before_binding(tiny, tmp_path, busy_port):
    # the port is taken too: the --ctx error must come first, without touching the port or the weights
    p, _ = _serve(str(tiny), "--ctx", "1000000", "--port", str(busy_port), "--runs-dir", str(tmp_path / "r"))
    _clean_error(p, "--ctx 1000000", "context length 128")


def test_runs_dir_that_is_a_file_is_an_error_naming_it(tiny, tmp_path):
    f = tmp_path / "not-a-folder"
    f.write_text("x")
    p, _ = _serve(str(tiny), "--port", "0", "--runs-dir", str(f))
    _clean_error(p, str(f), "not a folder")
    below = f / "runs"
    p, _ = _serve(str(tiny), "--port", "0", "--runs-dir", str(below))
    _clean_error(p, str(below), "not a folder")


@pytest.mark.parametrize(
    "flag, value",
    [("--header-timeout", "0"), ("--body-timeout", "nan"), ("--max-connections", "0")],
)
def test_bad_connection_flags_exit_2(tiny, flag, value):
    p, _ = _serve(str(tiny), flag, value)
    _clean_error(p, flag.lstrip("-").replace("-", "_"))
