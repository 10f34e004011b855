"""``toy`` in a child process under an address-space limit and a timeout, with its peak RSS.

``run_limited(args, as_limit=..., timeout=...)`` runs ``toy ARGS`` (``toy_cli.main``) in a fresh
Python process whose ``RLIMIT_AS`` is ``as_limit`` bytes, so a runaway allocation fails there
instead of taking the machine, and kills it after ``timeout`` seconds (a hang fails the test
instead of blocking it). The child reports its own peak resident set (``VmHWM`` from
``/proc/self/status``, which exec resets; ``getrusage`` in the parent would count the forked
pytest process too) on its last stderr line, which ``Limited`` strips off again.
"""

from __future__ import annotations

import os
import resource
import subprocess
import sys
from dataclasses import dataclass

_PROBE = (
    "import atexit, sys\n"
    "def _peak():\n"
    "    for line in open('/proc/self/status'):\n"
    "        if line.startswith('VmHWM'):\n"
    "            print('peak-rss-kb', line.split()[1], file=sys.stderr, flush=True)\n"
    "atexit.register(_peak)\n"
    "from toy_cli.main import main\n"
    "sys.exit(main(sys.argv[1:]))\n"
)


@dataclass
class Limited:
    code: int  # exit status; None-like -1 when killed for the timeout
    out: str
    err: str  # without the probe's line
    peak_mb: float  # VmHWM at exit; 0 when the child died before reporting
    timed_out: bool


def run_limited(
    args, *, as_limit: int, timeout: float, env: dict | None = None, cwd=None, stdin=subprocess.DEVNULL
) -> Limited:
    """``toy ARGS`` in a child under ``RLIMIT_AS = as_limit`` bytes, killed after ``timeout`` seconds."""

    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (as_limit, as_limit))

    cmd = [sys.executable, "-c", _PROBE, *map(str, args)]
    full_env = {**os.environ, **(env or {})}
    try:
        p = subprocess.run(
            cmd, preexec_fn=limit, capture_output=True, text=True, timeout=timeout, env=full_env, cwd=cwd, stdin=stdin
        )
    except subprocess.TimeoutExpired as e:
        err = e.stderr.decode(errors="replace") if isinstance(e.stderr, bytes) else (e.stderr or "")
        return Limited(-1, "", err, 0.0, True)
    lines = p.stderr.splitlines()
    peak = 0.0
    if lines and lines[-1].startswith("peak-rss-kb "):
        peak = int(lines.pop().split()[1]) / 1024
    return Limited(p.returncode, p.stdout, "\n".join(lines), peak, False)
