"""One side of a side-by-side benchmark: a child process driven line by line.

The parent writes one command per line to the child's stdin; the child
answers with one JSON object per stdout line (other lines are ignored) and
writes its logs to stderr, which goes to ``<logdir>/<name>.stderr`` and is
quoted when the child dies. A watchdog kills a child still running after
``timeout_s``. Used by ``test_bench_infer.py``, ``test_bench_batch_decode.py``,
``test_bench_train.py`` and ``test_bench_finetune.py`` (``alternate``: the timed
rounds of the training ones); ``TEXT`` is the inference benchmarks' prompt
text. Imported as ``from toy_testsupport.bench_side import ...``, also by the
child scripts (``bench_infer_toy.py``, ``bench_batch_toy.py``), whose
``python -S`` runs get the package from ``tools/bench_native.py``'s PYTHONPATH.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

# An English text the inference benchmarks tokenize (with toy's tokenizer) into their prompts.
TEXT = (
    "The old lighthouse stood at the end of a narrow spit of land, where the river met the sea. "
    "For more than a hundred years its keepers had climbed the spiral stairs every evening to light the lamp, "
    "wind the clockwork that turned the lens, and write a few lines in the logbook about the weather, "
    "the ships that passed and the birds that rested on the gallery rail. "
    "When the light was automated, the last keeper moved to a cottage in the village, but she still walked "
    "out along the shore each morning to look at the tower and check that the paint was not peeling.\n\n"
    "Children from the school sometimes followed her and asked questions. Why was the tower painted in red "
    "and white bands? So that sailors could recognise it by day, she told them, because every lighthouse on "
    "the coast had its own pattern. Why did the light flash instead of shining steadily? For the same reason: "
    "each one had its own rhythm, two short flashes and a long pause here, three flashes farther north, "
    "so that a captain counting the seconds on a dark night would know exactly where he was.\n\n"
    "In winter the storms came in from the west. Waves broke over the rocks and threw spray as high as the "
    "lantern room, and the wind made the windows hum. The keeper remembered nights when the power failed and "
    "she had to light the backup lamp by hand, and one night when a fishing boat lost its engine and drifted "
    "towards the reef until the lifeboat crew reached it and towed it into the harbour just before dawn. "
    "She wrote all of it down, and the logbooks now fill a shelf in the small museum next to the church, "
    "where visitors can read about a century of weather, shipwrecks, rescues and ordinary quiet evenings.\n\n"
)


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


def peer_python() -> str | None:
    """The Python that runs a benchmark's llama.cpp side: ``$TOY_BENCH_LLAMA_PYTHON``,
    else this interpreter when it can import ``llama_cpp``, else None (no peer)."""
    env = os.environ.get("TOY_BENCH_LLAMA_PYTHON")
    if env:
        return env
    return sys.executable if importlib.util.find_spec("llama_cpp") is not None else None


def vm_hwm_bytes() -> int | None:
    """Peak resident set of this process (Linux ``VmHWM``), in bytes."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


__all__ = ["TEXT", "Side", "alternate", "peer_python", "vm_hwm_bytes"]
