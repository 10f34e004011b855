"""One side of a side-by-side benchmark: a child process driven line by line.

The parent writes one command per line to the child's stdin; the child
answers with one JSON object per stdout line (other lines are ignored) and
writes its logs to stderr, which goes to ``<logdir>/<name>.stderr`` and is
quoted when the child dies. A watchdog kills a child still running after
``timeout_s``. Used by ``test_bench_infer.py``, ``test_bench_train.py`` and
``test_bench_finetune.py`` (``alternate``: the timed rounds of the training ones)
(registered under this name by the root conftest.py).
"""

from __future__ import annotations

import json
import os
import subprocess
import threading
import time
from pathlib import Path


class Side:
    def __init__(self, name: str, argv: list[str], logdir: Path, *, timeout_s: float, env: dict | None = None):
        self.name = name
        self.log = open(logdir / f"{name}.stderr", "w+")  # closed in close()
        self.proc = subprocess.Popen(
            argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log, text=True, bufsize=1, env=env
        )
        self._watchdog = threading.Timer(timeout_s, self.proc.kill)
        self._watchdog.daemon = True
        self._watchdog.start()

    def read(self) -> dict:
        while True:
            line = self.proc.stdout.readline()
            if not line:
                self.proc.wait()
                self.log.seek(0)
                tail = self.log.read()[-4000:]
                raise RuntimeError(f"the {self.name} side exited (rc {self.proc.returncode}):\n{tail}")
            if line.startswith("{"):
                return json.loads(line)

    def ask(self, cmd: str) -> dict:
        self.proc.stdin.write(cmd + "\n")
        self.proc.stdin.flush()
        return self.read()

    def close(self) -> None:
        self._watchdog.cancel()
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        for f in (self.proc.stdin, self.proc.stdout):
            if f is not None:
                f.close()
        self.log.close()


def alternate(sides: dict[str, Side], per_round: list[int], settle_s: float, out: dict) -> dict:
    """The timed part of a side-by-side run: for each round, each side in
    turn runs ``steps n`` after a pause of ``settle_s``; then every side is
    asked ``done``. Fills ``out["runs"][name]`` (one answer per round),
    ``out["done"][name]``, ``loadavg_before``/``loadavg_after`` and
    ``timed_wall_s``; returns ``out``."""
    out.setdefault("runs", {})
    out.setdefault("done", {})
    out["loadavg_before"] = os.getloadavg()[0]
    t0 = time.perf_counter()
    for n in per_round:
        for name, side in sides.items():
            time.sleep(settle_s)
            out["runs"].setdefault(name, []).append(side.ask(f"steps {n}"))
    out["timed_wall_s"] = time.perf_counter() - t0
    out["loadavg_after"] = os.getloadavg()[0]
    for name, side in sides.items():
        out["done"][name] = side.ask("done")
    return out


__all__ = ["Side", "alternate"]
