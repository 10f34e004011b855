"""Run bundles: ``runs/<run_id>/`` with ``config.json`` and ``events.jsonl``.

Schema "toy/v1" (DESIGN.md section 5): one JSON object per line; every event
has ``kind`` and ``t`` (seconds since the run started); the first is
``run_start`` (schema, run_id, started_at, host, backend, git, config and
whatever the caller adds, e.g. model dims), the last ``run_end`` (reason:
completed | interrupted | errored, plus the caller's fields). Non-finite
floats are written as null. Lines are written whole and flushed, so a reader
sees at worst a torn last line (which readers skip).

The writer is thread-safe (the server logs from its worker thread and from
request handlers). ``run_end`` is written once; later events are refused.
"""

from __future__ import annotations

import datetime
import json
import math
import os
import platform
import secrets
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

SCHEMA = "toy/v1"


def _clean(v: Any) -> Any:
    if isinstance(v, float):
        return v if math.isfinite(v) else None
    if isinstance(v, dict):
        return {str(k): _clean(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_clean(x) for x in v]
    if isinstance(v, Path):
        return str(v)
    if hasattr(v, "item") and callable(v.item):  # NumPy scalars
        return _clean(v.item())
    return v


def _git() -> dict[str, Any] | None:
    """The commit of the toy checkout this runs from, if it is one."""
    here = Path(__file__).resolve().parent
    try:
        sha = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=here, capture_output=True, text=True, timeout=5, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=here,
            capture_output=True,
            text=True,
            timeout=5,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return {"commit": sha, "dirty": bool(dirty)}


def new_run_id(kind: str) -> str:
    """``<kind>-YYYYmmdd-HHMMSS-<4 hex>`` (sortable by start time)."""
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    return f"{kind}-{stamp}-{secrets.token_hex(2)}"


def runs_dir(path: str | os.PathLike | None = None) -> Path:
    """Where run bundles go: ``path``, else ``$TOY_RUNS_DIR``, else ``./runs``."""
    return Path(path or os.environ.get("TOY_RUNS_DIR") or "runs")


class RunWriter:
    """Creates ``<root>/<run_id>/`` and appends events to its events.jsonl."""

    def __init__(self, kind: str, config: dict[str, Any], root: str | os.PathLike | None = None, **start: Any):
        self.kind = kind
        self.run_id = new_run_id(kind)
        self.dir = runs_dir(root) / self.run_id
        self.dir.mkdir(parents=True, exist_ok=False)
        (self.dir / "config.json").write_text(json.dumps(_clean(config), indent=2, sort_keys=True) + "\n")
        self._t0 = time.monotonic()
        self._lock = threading.Lock()
        self._f = open(self.dir / "events.jsonl", "a", encoding="utf-8")
        self.ended = False
        import toy_ggml

        self.event(
            "run_start",
            schema=SCHEMA,
            run_id=self.run_id,
            run_kind=kind,
            started_at=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            host={"name": platform.node(), "python": platform.python_version(), "machine": platform.machine()},
            pid=os.getpid(),
            backend={"ggml": toy_ggml.GGML_VERSION, "build": toy_ggml.build_config.BACKEND},
            git=_git(),
            config=config,
            **start,
        )

    @classmethod
    def reopen(cls, run_dir: str | os.PathLike) -> RunWriter:
        """Append to an existing run (a resumed training run): ``t`` goes on
        from the last event's time; a torn last line is completed with a
        newline first so it stays one (skipped) line. The caller writes a
        ``resume`` event."""
        self = cls.__new__(cls)
        self.dir = Path(run_dir)
        path = self.dir / "events.jsonl"
        if not path.is_file():
            raise FileNotFoundError(f"{path}: no events file to append to")
        last_t, first = 0.0, None
        raw = path.read_bytes()
        for line in raw.splitlines():
            try:
                rec = json.loads(line)
            except ValueError:
                continue
            if isinstance(rec, dict):
                first = first or rec
                if isinstance(rec.get("t"), (int, float)):
                    last_t = float(rec["t"])
        if first is None or first.get("kind") != "run_start":
            raise ValueError(f"{path}: does not start with run_start")
        self.run_id = str(first.get("run_id"))
        self.kind = str(first.get("run_kind", "train"))
        self._t0 = time.monotonic() - last_t
        self._lock = threading.Lock()
        self._f = open(path, "a", encoding="utf-8")
        if raw and not raw.endswith(b"\n"):
            self._f.write("\n")
        self.ended = False
        return self

    def event(self, kind: str, **fields: Any) -> None:
        """Append one event (``kind`` and ``t`` first)."""
        rec = {"kind": kind, "t": round(time.monotonic() - self._t0, 6), **fields}
        line = json.dumps(_clean(rec), ensure_ascii=False, allow_nan=False)
        with self._lock:
            if self.ended:
                raise RuntimeError(f"run {self.run_id} has ended")
            self._f.write(line + "\n")
            self._f.flush()

    def end(self, reason: str = "completed", **fields: Any) -> None:
        """Write ``run_end`` (once) and close the file."""
        if reason not in ("completed", "interrupted", "errored"):
            raise ValueError(f"run_end reason {reason!r}")
        with self._lock:
            if self.ended:
                return
        self.event("run_end", reason=reason, **fields)
        with self._lock:
            self.ended = True
            self._f.close()


__all__ = ["SCHEMA", "RunWriter", "new_run_id", "runs_dir"]
