"""Helpers for the tests of models split across hosts (``toy rpc-server``, ``--rpc``):
start a loopback rpc-server and wait for its ready line, stop a process group, and read a
pipe as it fills (``from toy_testsupport.rpc import start_rpc_server, stop, PipeReader``)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

TOY = [sys.executable, "-m", "toy_cli"]
SERVER_START = 60.0  # seconds a toy rpc-server may take to accept connections
READY = "toy rpc-server: serving CPU on 127.0.0.1"


def start_rpc_server(tmp_path: Path, port: int, *extra: str) -> subprocess.Popen:
    """``toy rpc-server`` on 127.0.0.1:port (one thread, its own process group), returned once its
    ready line is out; the test fails with the server's log when it does not come within
    ``SERVER_START`` seconds."""
    log = tmp_path / f"rpc-{port}.log"
    with open(log, "w") as f:
        p = subprocess.Popen(
            [*TOY, "rpc-server", "--port", str(port), "--threads", "1", *extra],
            stdout=f,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
    deadline = time.monotonic() + SERVER_START
    while READY not in log.read_text():
        if p.poll() is not None or time.monotonic() > deadline:
            stop(p)
            pytest.fail(f"toy rpc-server did not start: {log.read_text()[-2000:]}")
        time.sleep(0.1)
    return p


def stop(p: subprocess.Popen) -> None:
    """SIGKILL ``p``'s process group if it still runs, and reap it (bounded)."""
    if p.poll() is None:
        os.killpg(p.pid, signal.SIGKILL)
    p.wait(timeout=10)


class PipeReader(threading.Thread):
    """Collects a text pipe's characters as they come (the test waits on ``text`` with a bound)."""

    def __init__(self, pipe) -> None:
        super().__init__(daemon=True)
        self.pipe, self.text = pipe, ""

    def run(self) -> None:
        while True:
            chunk = self.pipe.read(1)
            if not chunk:
                return
            self.text += chunk


__all__ = ["READY", "SERVER_START", "TOY", "PipeReader", "start_rpc_server", "stop"]
