"""Stop signals sent to a training command in a child process, as a terminal or a launcher sends them.

``double_sigint(cmd, cwd, env)`` starts ``cmd`` (a ``toy train``/``toy vit train`` command line that
writes its run under ``cwd/runs``), waits until the run has recorded ``after_steps`` steps, then sends
two SIGINTs 1 ms apart -- what coreutils ``timeout -s INT`` does (the process, then its group) -- and
returns ``(returncode, stdout, stderr, run_dir)``. Every wait is bounded; the child is killed if it
outlives them. ``signals_at`` delivers signals in this process at the moment a given function is called.
"""

from __future__ import annotations

import json
import signal
import subprocess
import time
from pathlib import Path


def step_events(run_dir: Path) -> int:
    path = run_dir / "events.jsonl"
    if not path.is_file():
        return 0
    lines = [x for x in path.read_text().splitlines() if x.strip()]
    return sum(json.loads(x).get("kind") == "step" for x in lines if x.endswith("}"))


def double_sigint(
    cmd: list[str], cwd: Path, env: dict[str, str], *, after_steps: int = 3, timeout: float = 120
) -> tuple[int, str, str, Path]:
    p = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            dirs = list((cwd / "runs").glob("train-*")) if (cwd / "runs").exists() else []
            if dirs and step_events(dirs[0]) >= after_steps:
                break
            assert p.poll() is None, p.communicate()
            time.sleep(0.1)
        else:
            raise AssertionError(f"no {after_steps} steps within {timeout} s")
        p.send_signal(signal.SIGINT)
        time.sleep(0.001)  # (sent back to back, the two are often handled as one)
        p.send_signal(signal.SIGINT)
        out, err = p.communicate(timeout=timeout)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    return p.returncode, out, err, cwd / out.strip()


def signals_at(monkeypatch, obj, name: str, n: int, sig=signal.SIGINT) -> list[int]:
    """Replace ``obj.name`` (pytest's ``monkeypatch``) by a wrapper that, on its first call, delivers
    ``n`` signals to this process (``signal.raise_signal``: the handler runs before the call returns)
    and then calls the original; returns the list of calls."""
    orig = getattr(obj, name)
    calls: list[int] = []

    def wrapper(*a, **k):
        calls.append(1)
        if len(calls) == 1:
            for _ in range(n):
                signal.raise_signal(sig)
        return orig(*a, **k)

    monkeypatch.setattr(obj, name, wrapper)
    return calls
