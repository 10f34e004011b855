"""`toy rpc-server` and `--rpc` on `toy infer` (over loopback; the namespace hosts are
test_rpc_netns.py's).

- `toy rpc-server` refuses a non-loopback address (a wildcard included) without
  ``--allow-remote``: exit 2, an ``error:`` line and a hint that names the SSH tunnel; a port
  already taken exits 1 naming it; with ``--allow-remote`` on loopback it serves (no warning: only a
  non-loopback address exposes anything).
- `--rpc` / `--tensor-split` that do not parse exit 2 naming the option; an endpoint where
  nothing listens exits 1 naming it, before anything is generated.
- SmolLM2 (model-marked) split between this machine and a `toy rpc-server` subprocess:
  `toy infer --json --greedy --logprobs` prints the one-host run's tokens, text and logprobs
  (the logits' log-softmax, so the logits agree too), and says where the layers went; the
  server killed while a long reply streams ends `toy infer` with exit 1 and one ``error:``
  line naming the endpoint, within a bounded time, the text so far on stdout.
- `toy serve --rpc`: a greedy completion is the library's one-host text (``exact_batching`` as
  the server loads it); with the rpc-server killed, the next request fails (500/503, an error
  body) within a bounded time while the server process lives on and /health still answers.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time

import pytest

from toy_testsupport.cli_helpers import assert_clean_error, run
from toy_testsupport.rpc import TOY, PipeReader, start_rpc_server, stop

KILL_BOUND = 60.0  # seconds `toy infer` may take to fail once its server is gone
PROMPT = "Write a long story about a lighthouse keeper."


@pytest.fixture(autouse=True)
def _cpu_one_thread(monkeypatch):
    monkeypatch.setenv("TOY_DEVICE", "cpu")
    monkeypatch.setenv("TOY_THREADS", "1")
    monkeypatch.setenv("TOY_RPC_TIMEOUT", "20")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---------------------------------------------------------------- rpc-server's refusals


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "10.1.2.3", "192.168.0.7"])
def test_rpc_server_refuses_a_non_loopback_address(capsys, host):
    code, out, err = run(capsys, "rpc-server", "--host", host, "--port", 50123)
    assert_clean_error(code, err, 2, f"--host {host} is not a loopback address", "no authentication", hint=True)
    assert "ssh -N -L 50123:127.0.0.1:50123" in err and "--allow-remote" in err
    assert out == ""


def test_rpc_server_refuses_bad_options(capsys):
    code, _, err = run(capsys, "rpc-server", "--host", "no-such-host.invalid")
    assert_clean_error(code, err, 2, "no-such-host.invalid")
    code, _, err = run(capsys, "rpc-server", "--port", 0)
    assert_clean_error(code, err, 2, "--port")
    code, _, err = run(capsys, "rpc-server", "--threads", 0)
    assert_clean_error(code, err, 2, "--threads")


def test_rpc_server_port_taken_exits_1(capsys):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        port = s.getsockname()[1]
        code, _, err = run(capsys, "rpc-server", "--port", port)
    assert_clean_error(code, err, 1, f"cannot listen on 127.0.0.1:{port}")


def test_rpc_server_serves_loopback_and_ends_on_sigterm(tmp_path):
    port = _free_port()
    p = start_rpc_server(tmp_path, port, "--allow-remote")
    try:
        log = (tmp_path / f"rpc-{port}.log").read_text()
        assert f"toy rpc-server: serving CPU on 127.0.0.1:{port} (1 threads)" in log
        assert "warning:" not in log  # loopback exposes nothing, --allow-remote or not
        p.send_signal(signal.SIGTERM)
        p.wait(timeout=20)
        assert p.returncode != 0
    finally:
        stop(p)


# ---------------------------------------------------------------- --rpc on toy infer


def test_infer_rpc_options_that_do_not_parse(capsys, tmp_path):
    model = tmp_path / "m.gguf"  # never read: the options fail first
    code, _, err = run(capsys, "infer", model, "hi", "--rpc", "localhost")
    assert_clean_error(code, err, 2, "'localhost' is not HOST:PORT", hint=True)
    code, _, err = run(capsys, "infer", model, "hi", "--rpc", "h:1", "--tensor-split", "1,x")
    assert_clean_error(code, err, 2, "tensor split 'x' is not a number")


@pytest.mark.model
def test_infer_unreachable_endpoint_exits_1_naming_it(capsys, smollm2_path):
    port = _free_port()
    code, out, err = run(capsys, "infer", smollm2_path, "hi", "-n", 2, "--rpc", f"127.0.0.1:{port}")
    assert_clean_error(code, err, 1, f"127.0.0.1:{port}", hint=True)
    assert out == ""


def _infer_json(capsys, path, *extra):
    code, out, err = run(
        capsys,
        "infer",
        path,
        PROMPT,
        "-n",
        24,
        "--greedy",
        "--ignore-eos",
        "--json",
        "--logprobs",
        3,
        "--seed",
        0,
        *extra,
    )
    assert code == 0, err
    return json.loads(out), err


@pytest.mark.model
@pytest.mark.slow
def test_infer_split_equals_one_host(capsys, smollm2_path, tmp_path):
    one, _ = _infer_json(capsys, smollm2_path, "-q")
    port = _free_port()
    p = start_rpc_server(tmp_path, port)
    try:
        two, err = _infer_json(capsys, smollm2_path, "--rpc", f"127.0.0.1:{port}", "--tensor-split", "1,1")
    finally:
        stop(p)
    assert f"layers 0-14 CPU, 15-29 RPC[127.0.0.1:{port}]" in err
    assert two.pop("placement") == {
        "devices": ["CPU", f"RPC[127.0.0.1:{port}]"],
        "layers": [
            {"first": 0, "last": 14, "device": "CPU"},
            {"first": 15, "last": 29, "device": f"RPC[127.0.0.1:{port}]"},
        ],
    }
    for d in (one, two):
        d.pop("timings")
    assert two["tokens"] == one["tokens"] and len(one["tokens"]) == 24
    assert two == one  # text, logprobs (every top-3 alternative's value) and the rest, exactly


@pytest.mark.model
@pytest.mark.slow
def test_server_killed_mid_reply_is_one_error_line(smollm2_path, tmp_path):
    port = _free_port()
    server = start_rpc_server(tmp_path, port)
    argv = [*TOY, "infer", str(smollm2_path), PROMPT, "--greedy", "--ignore-eos", "-n", "3000", "--ctx", "4096"]
    argv += ["--rpc", f"127.0.0.1:{port}"]
    client = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    out, err = PipeReader(client.stdout), PipeReader(client.stderr)
    out.start()
    err.start()
    try:
        deadline = time.monotonic() + 120
        while len(out.text.split()) < 3:  # a few words of the reply: generation is under way
            assert client.poll() is None and time.monotonic() < deadline, err.text
            time.sleep(0.05)
        stop(server)
        t0 = time.monotonic()
        client.wait(timeout=KILL_BOUND)
        took = time.monotonic() - t0
    finally:
        stop(server)
        if client.poll() is None:
            os.killpg(client.pid, signal.SIGKILL)
        client.wait(timeout=10)
    out.join(10)
    err.join(10)
    assert client.returncode == 1, err.text
    assert took < KILL_BOUND
    errors = [line for line in err.text.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and f"127.0.0.1:{port}" in errors[0], err.text
    assert "Traceback" not in err.text
    assert len(out.text.split()) >= 3  # the text so far stayed on stdout


# ---------------------------------------------------------------- --rpc on toy serve


def _post(url: str, body: dict, timeout: float = 120) -> tuple[int, dict]:
    import urllib.error
    import urllib.request

    req = urllib.request.Request(url, json.dumps(body).encode(), {"content-type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def _get(url: str, timeout: float = 10) -> tuple[int, dict]:
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


@pytest.mark.model
@pytest.mark.slow
def test_serve_split_answers_as_one_host_and_survives_a_lost_server(smollm2_path, tmp_path):
    import toy

    with toy.load(smollm2_path, device="cpu", threads=1, n_ctx=256, exact_batching=True) as m:  # the server's
        want = m.generate("The three primary colors are", temperature=0, max_tokens=16, ignore_eos=True).text
    rpc_port, port = _free_port(), _free_port()
    server = start_rpc_server(tmp_path, rpc_port)
    argv = [*TOY, "serve", str(smollm2_path), "--port", str(port), "--ctx", "256", "--parallel", "1"]
    argv += ["--runs-dir", str(tmp_path / "runs"), "--rpc", f"127.0.0.1:{rpc_port}"]
    with open(tmp_path / "serve.log", "w") as log:
        serve = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            assert serve.poll() is None and time.monotonic() < deadline, (tmp_path / "serve.log").read_text()
            try:
                if _get(f"{base}/health")[0] == 200:
                    break
            except OSError:
                pass
            time.sleep(0.2)
        body = {"prompt": "The three primary colors are", "max_tokens": 16, "temperature": 0, "ignore_eos": True}
        code, d = _post(f"{base}/v1/completions", body)
        assert code == 200 and d["choices"][0]["text"] == want
        assert f"layers 0-14 CPU, 15-29 RPC[127.0.0.1:{rpc_port}]" in (tmp_path / "serve.log").read_text()
        stop(server)
        t0 = time.monotonic()
        code, d = _post(f"{base}/v1/completions", body, timeout=KILL_BOUND)
        assert code == 500 and f"127.0.0.1:{rpc_port}" in d["error"]["message"], d  # that request fails, naming
        assert time.monotonic() - t0 < KILL_BOUND  # the host: no hang, no crash
        assert serve.poll() is None
        code, h = _get(f"{base}/health")  # the replica leaves a router's rotation, saying why
        assert code == 503 and h["status"] == "error" and f"127.0.0.1:{rpc_port}" in h["message"], h
        code, d = _post(f"{base}/v1/completions", body, timeout=KILL_BOUND)  # later requests: 503 with the reason
        assert code == 503 and f"127.0.0.1:{rpc_port}" in d["error"]["message"], d
    finally:
        stop(server)
        if serve.poll() is None:
            os.killpg(serve.pid, signal.SIGKILL)
        serve.wait(timeout=10)
