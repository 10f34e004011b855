"""``toy serve --device`` on the device under test: a smoke test of the server as a user starts it.

The real command in a child process (``python -m toy_cli serve`` on SmolLM2-135M-Instruct Q4_1, one slot,
256-token context, port 0: the port the server bound is read from the line it prints first) until
/health answers 200; then one greedy completion and
one chat completion. Asserted: on a GPU, the device's free memory (as ggml reports it) dropped by at
least half the model file's size once the server was up (its weights went to the device, not to host
memory; half: an engine may keep the token embedding, read by row, in host memory); each answer is the library's on the same device (``toy.load`` with the
server's settings: ``exact_batching``, one slot; ``Model.generate`` of the prompt or the messages): same text, token
for token. Closeness to the CPU is test_gpu_inference.py's.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest

import toy
import toy_ggml

pytestmark = [pytest.mark.gpu, pytest.mark.model]

PROMPT = "The three primary colors are"
MESSAGES = [{"role": "user", "content": "Name a fruit that is yellow."}]
MAX_TOKENS = 16
N_CTX = 256
START_S = 180  # the server loads the model in the background; a CUDA context takes seconds to start


def _base_url(log_path, serve, deadline: float) -> str:
    """The URL the server prints when it starts ("toy serve: NAME on http://127.0.0.1:PORT/v1 ...")."""
    while True:
        m = re.search(r"on (http://127\.0\.0\.1:\d+)/v1", log_path.read_text())
        if m:
            return m.group(1)
        assert serve.poll() is None, f"toy serve exited:\n{log_path.read_text()}"
        assert time.monotonic() < deadline, f"toy serve printed no URL within {START_S} s:\n{log_path.read_text()}"
        time.sleep(0.1)


def _request(url: str, body: dict | None = None, timeout: float = 120) -> tuple[int, dict]:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data, {"content-type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def _free_memory(label: str) -> int:
    return next(d.memory_free for d in toy_ggml.devices() if d.name == label)


def test_serve_answers_on_the_device(smollm2_path, gpu_device, tmp_path):
    with toy.load(
        smollm2_path, device=gpu_device.name, n_ctx=N_CTX, n_slot=1, threads=2, exact_batching=True, fetch=False
    ) as m:
        want = m.generate(PROMPT, temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True).text
        want_chat = m.generate(MESSAGES, temperature=0, max_tokens=MAX_TOKENS).text
    free_before = None if gpu_device.is_cpu else _free_memory(gpu_device.label)
    argv = [sys.executable, "-m", "toy_cli", "serve", str(smollm2_path), "--device", gpu_device.name]
    argv += ["--port", "0", "--ctx", str(N_CTX), "--parallel", "1", "--threads", "2"]
    argv += ["--runs-dir", str(tmp_path / "runs")]
    log_path = tmp_path / "serve.log"
    with open(log_path, "w") as log:
        serve = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + START_S
        base = _base_url(log_path, serve, deadline)
        while True:
            assert serve.poll() is None, f"toy serve exited:\n{log_path.read_text()}"
            assert time.monotonic() < deadline, f"/health not 200 within {START_S} s:\n{log_path.read_text()}"
            try:
                if _request(f"{base}/health", timeout=5)[0] == 200:
                    break
            except OSError:
                pass
            time.sleep(0.2)
        if free_before is not None:
            used = free_before - _free_memory(gpu_device.label)
            assert used >= smollm2_path.stat().st_size // 2, f"the server took {used} bytes of {gpu_device.label}"
        body = {"prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}
        code, d = _request(f"{base}/v1/completions", body)
        assert code == 200 and d["choices"][0]["text"] == want, d
        body = {"messages": MESSAGES, "max_tokens": MAX_TOKENS, "temperature": 0}
        code, d = _request(f"{base}/v1/chat/completions", body)
        assert code == 200 and d["choices"][0]["message"]["content"] == want_chat, d
    finally:
        if serve.poll() is None:
            os.killpg(serve.pid, signal.SIGTERM)
            try:
                serve.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(serve.pid, signal.SIGKILL)
        serve.wait(timeout=10)
