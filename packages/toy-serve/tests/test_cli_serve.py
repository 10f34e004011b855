"""``toy serve`` as a real process: graceful shutdown on SIGTERM.

Reference: cli.py's docstring ("SIGTERM: uvicorn stops accepting
connections and waits up to --drain-timeout seconds for in-flight requests,
then the app's shutdown drains the engine and writes run_end; the exit code
is 0") and app.py's (each model request logs one ``request`` event in the
run bundle). The stream in flight when SIGTERM arrives must finish normally:
its tokens all arrive, the last chunk has a finish_reason and ``data:
[DONE]`` ends it.

When the drain timeout runs out, or a second SIGTERM/Ctrl-C ends the wait
(``toy_serve.conn``'s shutdown sequence and docs/guide/serving.md,
"Shutdown"), what still runs is ended by the server: a stream with an
``{"error": ...}`` chunk ("the server is shutting down"), ``data: [DONE]``
and a properly terminated body, a non-stream request with 503; run_end's
``abandoned`` counts those sequences and the log holds no traceback.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

pytestmark = [pytest.mark.model, pytest.mark.slow]

DRAIN_S = 30
MAX_TOKENS = 48


def _toy() -> str:
    exe = Path(sys.executable).parent / "toy"
    assert exe.is_file(), f"the toy command is not installed next to {sys.executable}"
    return str(exe)


class Served:
    """``toy serve`` on a free port (``--port 0``; the port is read from uvicorn's log on stderr); both
    output streams are drained by threads into ``out`` and ``err``."""

    def __init__(self, model: Path, runs: Path, *extra: str, drain: float = DRAIN_S, env: dict | None = None):
        cmd = [_toy(), "serve", str(model), "--port", "0", "--threads", "1", "--ctx", "512"]
        cmd += ["--runs-dir", str(runs), "--drain-timeout", str(drain), *extra]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        self.out: list[str] = []
        self.err: list[str] = []
        self.port: int | None = None
        self._got_port = threading.Event()
        self._threads = [
            threading.Thread(target=self._read, args=(self.proc.stdout, self.out), daemon=True),
            threading.Thread(target=self._read, args=(self.proc.stderr, self.err), daemon=True),
        ]
        for t in self._threads:
            t.start()

    def _read(self, stream, into: list[str]) -> None:
        for line in stream:
            into.append(line)
            m = re.search(r"Uvicorn running on http://127\.0\.0\.1:(\d+)", line)
            if m and self.port is None:
                self.port = int(m.group(1))
                self._got_port.set()

    def wait_ready(self, timeout: float = 60) -> str:
        assert self._got_port.wait(timeout), "".join(self.err)
        url = f"http://127.0.0.1:{self.port}"
        deadline = time.monotonic() + timeout
        while True:
            r = httpx.get(url + "/health", timeout=10)
            if r.status_code == 200:
                assert r.json() == {"status": "ok"}
                return url
            assert r.status_code == 503 and r.json()["status"] == "loading", r.text
            assert time.monotonic() < deadline, "the model did not load"
            time.sleep(0.1)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        for t in self._threads:
            t.join(10)


@pytest.mark.skipif(sys.platform == "win32", reason="SIGTERM")
def test_sigterm_drains_the_stream_and_exits_0(smollm2_path, tmp_path):
    runs = tmp_path / "runs"
    served = Served(smollm2_path, runs)
    try:
        url = served.wait_ready()
        with httpx.Client(base_url=url, timeout=60) as h:
            body = {"prompt": "Once upon a time", "max_tokens": MAX_TOKENS, "temperature": 0, "stream": True}
            body.update(ignore_eos=True, stream_options={"include_usage": True})
            events, n_before = [], 0
            with h.stream("POST", "/v1/completions", json=body) as resp:
                assert resp.status_code == 200
                lines = resp.iter_lines()
                for line in lines:
                    if line:
                        events.append(line)
                        if len(events) == 3:
                            break
                n_before = len(events)
                served.proc.send_signal(signal.SIGTERM)
                t_term = time.monotonic()
                for line in lines:
                    if line:
                        events.append(line)
            # no new connections while draining / after the end
            with pytest.raises(httpx.TransportError):
                httpx.get(url + "/health", timeout=5)
        rc = served.proc.wait(timeout=DRAIN_S + 15)
        elapsed = time.monotonic() - t_term
    finally:
        served.close()
    assert rc == 0, "".join(served.err)
    assert elapsed < DRAIN_S, elapsed

    # the stream was cut by nothing: all its tokens, a finish_reason, the usage chunk, [DONE]
    assert n_before == 3 and len(events) > n_before
    assert events[-1] == "data: [DONE]"
    chunks = [json.loads(e[len("data: ") :]) for e in events[:-1]]
    assert all("error" not in c for c in chunks), chunks
    text_chunks = [c for c in chunks if c["choices"]]
    assert text_chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == MAX_TOKENS

    # the run bundle
    bundles = sorted(runs.glob("serve-*"))
    assert len(bundles) == 1, bundles
    lines = (bundles[0] / "events.jsonl").read_text().splitlines()
    recs = [json.loads(x) for x in lines]
    assert recs[0]["kind"] == "run_start"
    assert recs[-1]["kind"] == "run_end" and recs[-1]["reason"] == "completed"
    reqs = [r for r in recs if r["kind"] == "request"]
    assert len(reqs) == 1
    assert reqs[0]["endpoint"] == "/v1/completions" and reqs[0]["status"] == 200
    assert reqs[0]["completion_tokens"] == MAX_TOKENS and reqs[0]["finish_reason"] == "length"
    assert recs[-1].get("abandoned", 0) == 0
    config = json.loads((bundles[0] / "config.json").read_text())
    assert config["ctx"] == 512 and config["threads"] == 1


def test_stdout_stays_empty(smollm2_path, tmp_path):
    served = Served(smollm2_path, tmp_path / "runs")
    try:
        url = served.wait_ready()
        assert httpx.get(url + "/v1/models", timeout=10).status_code == 200
        served.proc.send_signal(signal.SIGTERM)
        assert served.proc.wait(timeout=DRAIN_S + 15) == 0
    finally:
        served.close()
    assert any("Uvicorn running on" in line for line in served.err)  # the logs do go somewhere
    assert "".join(served.out) == ""


def test_limit_flags_reach_the_server(smollm2_path, tmp_path):
    """--max-body-bytes, --max-batch and --prefill-chunk are the server's settings (config.json) and act."""
    runs = tmp_path / "runs"
    served = Served(smollm2_path, runs, "--max-body-bytes", "2048", "--max-batch", "2", "--prefill-chunk", "16")
    try:
        url = served.wait_ready()
        with httpx.Client(base_url=url, timeout=60) as h:
            big = h.post("/v1/completions", json={"prompt": "x" * 3000, "max_tokens": 1})
            assert big.status_code == 413, big.text
            three = h.post("/v1/completions", json={"prompt": ["a", "b", "c"], "max_tokens": 1})
            assert three.status_code == 400 and three.json()["error"]["param"] == "prompt", three.text
            two = h.post("/v1/completions", json={"prompt": ["a", "b"], "max_tokens": 1, "temperature": 0})
            assert two.status_code == 200 and len(two.json()["choices"]) == 2
        served.proc.send_signal(signal.SIGTERM)
        assert served.proc.wait(timeout=DRAIN_S + 15) == 0
    finally:
        served.close()
    (bundle,) = runs.glob("serve-*")
    config = json.loads((bundle / "config.json").read_text())
    assert (config["max_body_bytes"], config["max_batch"], config["prefill_chunk"]) == (2048, 2, 16)


def test_bad_limit_flags_exit_2(smollm2_path, tmp_path):
    for flag, value in (("--prefill-chunk", "0"), ("--max-body-bytes", "10"), ("--max-batch", "0")):
        p = subprocess.run(
            [_toy(), "serve", str(smollm2_path), flag, value], capture_output=True, text=True, timeout=60
        )
        assert p.returncode == 2, (flag, p.stderr)
        assert p.stderr.startswith("error: ") and flag.lstrip("-").replace("-", "_") in p.stderr, p.stderr


LONG = 440  # tokens: far longer than the drain (SmolLM2 on one thread)


def _long(stream: bool) -> dict:
    body = {"prompt": "Once upon a time", "max_tokens": LONG, "temperature": 0, "stream": stream}
    return {**body, "ignore_eos": True}


def _lines(lines, into: list[str], n: int | None = None) -> None:
    """Non-empty SSE lines from ``lines`` into ``into``: ``n`` of them, or all until the body ends."""
    for line in lines:
        if line:
            into.append(line)
            if n is not None and len(into) >= n:
                return


def _bundle(runs: Path) -> list[dict]:
    (bundle,) = runs.glob("serve-*")
    return [json.loads(x) for x in (bundle / "events.jsonl").read_text().splitlines()]


def _sequences(h: httpx.Client) -> float:
    """Sequences the engine holds (running and queued), from /metrics."""
    text = h.get("/metrics").text
    found = re.findall(r"^toy_(?:active_sequences|queue_depth) (\S+)$", text, re.M)
    return sum(float(x) for x in found)


def _ended_by_shutdown(events: list[str]) -> None:
    assert events[-1] == "data: [DONE]", events[-3:]
    last = json.loads(events[-2][len("data: ") :])
    assert set(last) == {"error"}, last
    assert last["error"]["message"] == "the server is shutting down" and last["error"]["type"] == "server_error"
    assert all("error" not in json.loads(e[len("data: ") :]) for e in events[:-2])


@pytest.mark.skipif(sys.platform == "win32", reason="SIGTERM")
def test_the_drain_timeout_ends_requests_with_an_error(smollm2_path, tmp_path):
    runs = tmp_path / "runs"
    served = Served(smollm2_path, runs, drain=1)
    plain: dict = {}
    try:
        url = served.wait_ready()

        def non_stream() -> None:
            plain["r"] = httpx.post(url + "/v1/completions", json=_long(False), timeout=60)

        events: list[str] = []
        with httpx.Client(base_url=url, timeout=60) as h, h.stream("POST", "/v1/completions", json=_long(True)) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            _lines(lines, events, 3)
            t = threading.Thread(target=non_stream)
            t.start()
            deadline = time.monotonic() + 30
            while _sequences(h) < 2:  # the second request is in the engine
                assert time.monotonic() < deadline, "the second request did not start"
                time.sleep(0.05)
            served.proc.send_signal(signal.SIGTERM)
            t_term = time.monotonic()
            _lines(lines, events)  # a chunked body cut short would raise httpx.RemoteProtocolError here
        t.join(30)
        rc = served.proc.wait(timeout=30)
        elapsed = time.monotonic() - t_term
    finally:
        served.close()
    err = "".join(served.err)
    assert rc == 0, err
    assert elapsed < 1 + 8, elapsed
    assert len(events) < LONG  # cut short, by the server
    _ended_by_shutdown(events)
    r = plain["r"]
    assert r.status_code == 503 and r.headers["retry-after"] == "1", r.text
    assert r.json()["error"]["message"] == "the server is shutting down"
    assert "Traceback" not in err and "CancelledError" not in err, err

    recs = _bundle(runs)
    assert recs[-1]["kind"] == "run_end" and recs[-1]["reason"] == "completed"
    assert recs[-1]["abandoned"] == 2 and recs[-1]["requests"] == 2, recs[-1]
    reqs = sorted((x["status"], x["finish_reason"]) for x in recs if x["kind"] == "request")
    assert reqs == [(200, "error"), (503, "error")], reqs


@pytest.mark.skipif(sys.platform == "win32", reason="SIGINT")
def test_a_second_ctrl_c_ends_the_drain_at_once(smollm2_path, tmp_path):
    runs = tmp_path / "runs"
    served = Served(smollm2_path, runs, drain=60)
    try:
        url = served.wait_ready()
        events: list[str] = []
        with httpx.Client(base_url=url, timeout=60) as h, h.stream("POST", "/v1/completions", json=_long(True)) as r:
            lines = r.iter_lines()
            _lines(lines, events, 3)
            served.proc.send_signal(signal.SIGINT)
            _lines(lines, events, 8)  # draining: the stream goes on
            served.proc.send_signal(signal.SIGINT)
            t_again = time.monotonic()
            _lines(lines, events)
        rc = served.proc.wait(timeout=30)
        elapsed = time.monotonic() - t_again
    finally:
        served.close()
    err = "".join(served.err)
    assert rc == 0, err
    assert elapsed < 8, elapsed
    assert 8 < len(events) < LONG
    _ended_by_shutdown(events)
    assert "Traceback" not in err and "CancelledError" not in err, err
    recs = _bundle(runs)
    assert recs[-1]["kind"] == "run_end" and recs[-1]["abandoned"] == 1, recs[-1]
    assert [(x["status"], x["finish_reason"]) for x in recs if x["kind"] == "request"] == [(200, "error")]


SLOW_LOAD = """\
import time
import toy

_load = toy.load


def _slow(*args, **kwargs):
    time.sleep(float(__import__("os").environ["TOY_TEST_LOAD_DELAY"]))
    return _load(*args, **kwargs)


toy.load = _slow
"""


def test_stopped_while_loading_leaves_no_run_bundle(smollm2_path, tmp_path):
    """A server stopped before its model loaded never served: exit 0 and no run bundle.

    SmolLM2 loads in a fraction of a second, so the load could end between the /health check and the
    signal; a ``sitecustomize`` on the child's PYTHONPATH makes ``toy.load`` wait 3 s first (the test's
    own hook: the server's code is unchanged), so the signal surely arrives while loading."""
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(SLOW_LOAD)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(hook), os.environ.get("PYTHONPATH")])))
    env["TOY_TEST_LOAD_DELAY"] = "3"
    runs = tmp_path / "runs"
    served = Served(smollm2_path, runs, env=env)
    try:
        assert served._got_port.wait(60), "".join(served.err)
        r = httpx.get(f"http://127.0.0.1:{served.port}/health", timeout=10)
        assert r.status_code == 503 and r.json()["status"] == "loading", r.text  # still loading
        served.proc.send_signal(signal.SIGTERM)
        rc = served.proc.wait(timeout=60)
    finally:
        served.close()
    assert rc == 0, "".join(served.err)
    assert not runs.exists() or not any(runs.iterdir()), list(runs.iterdir())
