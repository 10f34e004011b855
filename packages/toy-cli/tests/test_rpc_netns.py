"""SmolLM2 split across two hosts: `toy rpc-server` in one network namespace, `toy infer --rpc`
in another (``toy_testsupport.netns``: each namespace has its own address on a bridge, so the
layers' activations cross a real TCP link, as between machines). Needs root (CI is root);
elsewhere the tests skip and say why.

- `toy rpc-server --host <its address> --allow-remote` on host 1 warns on stderr what it
  exposes; `toy infer --rpc ADDR:PORT` on host 0 prints the tokens, text and logprobs of the
  one-host run (the reference, run on host 0 too);
- the server SIGKILLed while a long reply streams: `toy infer` exits 1 with one ``error:`` line
  naming the server's endpoint, within a bounded time;
- `toy rpc-server --host <its address>` without ``--allow-remote``: exit 2, nothing served.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from toy_testsupport.netns import Hosts, hosts_fixture
from toy_testsupport.rpc import PipeReader

TOY = [sys.executable, "-m", "toy_cli"]
ENV = {"TOY_DEVICE": "cpu", "TOY_THREADS": "1", "TOY_RPC_TIMEOUT": "20"}
PORT = 50052
SERVER_START = 60.0  # seconds a toy rpc-server may take to accept connections
KILL_BOUND = 60.0  # seconds `toy infer` may take to fail once its server is gone
RUN_BOUND = 240.0  # seconds one `toy infer` may take
PROMPT = "Write a long story about a lighthouse keeper."


hosts2 = hosts_fixture(2, mpi=False)


def _server(h: Hosts, tmp_path, *extra: str) -> tuple[subprocess.Popen, str]:
    """`toy rpc-server` on host 1's address (one thread), once ready: (the process, its log)."""
    log = tmp_path / "rpc-server.log"
    argv = [*TOY, "rpc-server", "--host", h.addresses[1], "--port", str(PORT), "--threads", "1", *extra]
    with open(log, "w") as f:
        p = h.popen(1, argv, env=ENV, stdout=f, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + SERVER_START
    while f"serving CPU on {h.addresses[1]}:{PORT}" not in log.read_text():
        if p.poll() is not None or time.monotonic() > deadline:
            pytest.fail(f"toy rpc-server did not start on host 1: {log.read_text()[-2000:]}")
        time.sleep(0.1)
    return p, log.read_text()


def _infer_json(h: Hosts, model, *extra: str) -> dict:
    argv = [
        *TOY,
        "infer",
        str(model),
        PROMPT,
        "-n",
        "24",
        "--greedy",
        "--ignore-eos",
        "--json",
        "--logprobs",
        "3",
        "--seed",
        "0",
    ]
    r = h.run(0, [*argv, *extra], env=ENV, timeout=RUN_BOUND)
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)
    d.pop("timings")
    return d


@pytest.mark.model
@pytest.mark.slow
def test_split_across_hosts_equals_one_host(hosts2, smollm2_path, tmp_path):
    h = hosts2
    one = _infer_json(h, smollm2_path)
    server, log = _server(h, tmp_path, "--allow-remote")
    assert "warning:" in log and "no authentication" in log  # what --allow-remote exposes, said once
    endpoint = f"{h.addresses[1]}:{PORT}"
    two = _infer_json(h, smollm2_path, "--rpc", endpoint, "--tensor-split", "1,1")
    assert [b["device"] for b in two.pop("placement")["layers"]] == ["CPU", f"RPC[{endpoint}]"]
    assert two["tokens"] == one["tokens"] and len(one["tokens"]) == 24
    assert two == one  # text and every logprob, exactly
    assert server.poll() is None  # the server outlives its client


@pytest.mark.model
@pytest.mark.slow
def test_server_killed_mid_generation_is_a_clean_error(hosts2, smollm2_path, tmp_path):
    h = hosts2
    server, _ = _server(h, tmp_path, "--allow-remote")
    endpoint = f"{h.addresses[1]}:{PORT}"
    argv = [*TOY, "infer", str(smollm2_path), PROMPT, "--greedy", "--ignore-eos", "-n", "3000", "--ctx", "4096"]
    client = h.popen(0, [*argv, "--rpc", endpoint], env=ENV)
    out, err = PipeReader(client.stdout), PipeReader(client.stderr)
    out.start()
    err.start()
    try:
        deadline = time.monotonic() + RUN_BOUND
        while len(out.text.split()) < 3:  # a few words of the reply: generation is under way
            assert client.poll() is None and time.monotonic() < deadline, err.text
            time.sleep(0.05)
        os.killpg(server.pid, signal.SIGKILL)
        t0 = time.monotonic()
        client.wait(timeout=KILL_BOUND)
        took = time.monotonic() - t0
    finally:
        for p in (server, client):
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
            p.wait(timeout=10)
    out.join(10)
    err.join(10)
    assert client.returncode == 1, err.text
    assert took < KILL_BOUND
    errors = [line for line in err.text.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and endpoint in errors[0], err.text
    assert "Traceback" not in err.text


def test_non_loopback_without_allow_remote_exits_2(hosts2):
    h = hosts2
    r = h.run(1, [*TOY, "rpc-server", "--host", h.addresses[1], "--port", str(PORT)], env=ENV, timeout=60)
    assert r.returncode == 2, r.stderr
    assert f"error: --host {h.addresses[1]} is not a loopback address" in r.stderr
    assert "hint: " in r.stderr and "ssh -N -L" in r.stderr
    assert "serving CPU" not in r.stderr + r.stdout
