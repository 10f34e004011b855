"""Run bundles: ``runs/<run_id>/`` with ``config.json`` and ``events.jsonl``.

Schema "toy/v1" (docs/concepts/architecture.md, "Runs"): one JSON object per line; every event
has ``kind`` and ``t`` (seconds since the run started); the first is
``run_start`` (schema, run_id, started_at, host, backend, git, config and
whatever the caller adds, e.g. model dims), the last ``run_end`` (reason:
completed | interrupted | errored, plus the caller's fields). Non-finite
floats are written as null. Lines are written whole and flushed, so a reader
sees at worst a torn last line (which readers skip).

The writer is thread-safe (the server logs from its worker thread and from
request handlers). ``run_end`` is written once; later events are refused.

Write failures (a full disk: ENOSPC, a file-size limit: EFBIG, an I/O
error). Each event is one ``write`` of whole lines on an unbuffered append
descriptor; a write cut short is truncated back to the last whole line, so
the file only ever holds whole lines and nothing half-written is retried.
What happens next is the writer's ``on_error`` policy:

- ``"raise"`` (train and eval runs, the default for every kind but
  "serve"): ``event``/``end`` raise the ``OSError`` (the trainer turns it
  into ``TrainingIOError``); ``end`` can be called again.
- ``"degrade"`` (serve runs: telemetry must never fail a request): the
  event is dropped and counted (``errors``), ``healthy`` turns False, the
  first failure is logged once (logger ``toy.runs``, a warning: stderr), and
  the next write is tried as usual. The first write that succeeds again is
  preceded by a ``note`` event saying how many events were lost
  (``lost``), and ``healthy`` is True again. ``end`` tries ``run_end`` the
  same way, never raises an ``OSError``, and closes the file.

The constructor itself (the folder, config.json) raises in both modes: a
bundle that cannot even be created is the caller's to report.
"""

from __future__ import annotations

import datetime
import json
import logging
import math
import os
import platform
import secrets
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

from toy.project import current as current_project

SCHEMA = "toy/v1"
ON_ERROR = ("raise", "degrade")

log = logging.getLogger("toy.runs")


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


def runs_dir(path: str | os.PathLike[str] | None = None) -> Path:
    """Where run bundles go: ``path``, else ``$TOY_RUNS_DIR``, else the runs
    folder of the project around the current folder (``toy.toml``'s
    ``runs``, see ``toy.project``), else ``./runs``. The environment wins
    over the project: it is the more specific choice, made for this shell."""
    if path or os.environ.get("TOY_RUNS_DIR"):
        return Path(path or os.environ["TOY_RUNS_DIR"])
    project = current_project()
    if project is not None and project.runs is not None:
        return project.runs
    return Path("runs")


class RunWriter:
    """Creates ``<root>/<run_id>/`` and appends events to its events.jsonl."""

    def __init__(
        self,
        kind: str,
        config: dict[str, Any],
        root: str | os.PathLike[str] | None = None,
        *,
        on_error: str | None = None,
        **start: Any,
    ):
        self.kind = kind
        self.run_id = new_run_id(kind)
        self.dir = runs_dir(root) / self.run_id
        self.dir.mkdir(parents=True, exist_ok=False)
        (self.dir / "config.json").write_text(json.dumps(_clean(config), indent=2, sort_keys=True) + "\n")
        self._t0 = time.monotonic()
        self._open(self.dir / "events.jsonl", on_error or ("degrade" if kind == "serve" else "raise"))
        import toy_ggml  # lazy: ~0.3 s that reading runs (toy runs) does without

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
    def reopen(cls, run_dir: str | os.PathLike[str], *, on_error: str | None = None) -> RunWriter:
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
        self._open(path, on_error or ("degrade" if self.kind == "serve" else "raise"))
        if raw and not raw.endswith(b"\n"):
            with self._lock:
                self._write_lines(b"\n")
        return self

    def _open(self, path: Path, on_error: str) -> None:
        if on_error not in ON_ERROR:
            raise ValueError(f"on_error {on_error!r} is not one of {ON_ERROR}")
        self.on_error = on_error
        self._lock = threading.Lock()
        self._f = open(path, "ab", buffering=0)  # unbuffered: one write per event, nothing held back
        self._size = self._f.seek(0, os.SEEK_END)  # bytes of whole lines in the file
        self.ended = False
        self.errors = 0  # events lost to write errors ("degrade")
        self.healthy = True  # the last write succeeded
        self.last_error: str | None = None
        self._lost = 0  # events lost since the last write that succeeded
        self._listeners: list[tuple[Any, str]] = []  # (fn, name): add_listener

    def _raw_write(self, data: bytes | memoryview) -> int:
        """One ``write`` on the events file (tests replace it to inject failures)."""
        return self._f.write(data)

    def _write_lines(self, data: bytes) -> None:
        """Append ``data`` (whole lines) or nothing: a write cut short is truncated back (lock held)."""
        view = memoryview(data)
        try:
            while view:
                n = self._raw_write(view)
                if not n:
                    raise OSError(f"short write on {self._f.name}")
                view = view[n:]
        except OSError:
            try:
                self._f.truncate(self._size)
            except OSError:
                pass
            raise
        self._size += len(data)

    def _line(self, kind: str, fields: dict[str, Any]) -> bytes:
        rec = {"kind": kind, "t": round(time.monotonic() - self._t0, 6), **fields}
        return (json.dumps(_clean(rec), ensure_ascii=False, allow_nan=False) + "\n").encode("utf-8")

    def event(self, kind: str, **fields: Any) -> bool:
        """Append one event (``kind`` and ``t`` first). Returns whether it was written: False only
        when ``on_error`` is "degrade" and the write failed (see the module docstring). The
        listeners (``add_listener``) see each event that was written, after it was."""
        line = self._line(kind, fields)
        with self._lock:
            if self.ended:
                raise RuntimeError(f"run {self.run_id} has ended")
            ok = self._append(line)
        if ok and self._listeners:
            self._tell(json.loads(line))
        return ok

    def add_listener(self, fn: Any, name: str = "listener") -> None:
        """Call ``fn(event)`` (the event as written: a dict) after each event is written, in
        the writing thread (``toy.runs.report`` mirrors runs to TensorBoard and MLflow this way).
        A listener that raises is dropped: the first failure is a warning (logger ``toy.runs``)
        and a ``note`` event naming it; the run goes on."""
        self._listeners.append((fn, name))

    def _tell(self, rec: dict[str, Any]) -> None:
        failed = []
        for fn, name in list(self._listeners):
            try:
                fn(rec)
            except Exception as e:  # noqa: BLE001 - a mirror must never stop the run
                self._listeners.remove((fn, name))
                failed.append(f"{name}: stopped mirroring this run ({type(e).__name__}: {e})")
        for text in failed:  # after every listener has seen the event
            log.warning("run %s: %s", self.run_id, text)
            if not self.ended and rec.get("kind") != "run_end":
                self.event("note", text=text)

    def _append(self, line: bytes) -> bool:
        if self._lost:  # back after a failure: say what is missing first, in the same write
            lost = f"telemetry: {self._lost} event(s) could not be written ({self.last_error})"
            line = self._line("note", {"text": lost, "lost": self._lost}) + line
        try:
            self._write_lines(line)
        except OSError as e:
            if self.on_error == "raise":
                raise
            self.errors += 1
            self._lost += 1
            self.last_error = f"{type(e).__name__}: {e.strerror or e}"
            if self.errors == 1:  # logged once; /metrics (the server) or end() tell the rest
                log.warning(
                    "run %s: cannot write %s (%s); events are dropped and counted until a write succeeds",
                    self.run_id,
                    self._f.name,
                    self.last_error,
                )
            self.healthy = False
            return False
        self._lost, self.healthy = 0, True
        return True

    def end(self, reason: str = "completed", **fields: Any) -> None:
        """Write ``run_end`` (once) and close the file. With ``on_error`` "degrade" a failed
        ``run_end`` is counted like any event, and the file is closed all the same."""
        if reason not in ("completed", "interrupted", "errored"):
            raise ValueError(f"run_end reason {reason!r}")
        with self._lock:
            if self.ended:
                return
        self.event("run_end", reason=reason, **fields)
        with self._lock:
            self.ended = True
            self._f.close()
        if self.errors:
            log.warning("run %s: %d event(s) could not be written to %s", self.run_id, self.errors, self._f.name)


__all__ = ["ON_ERROR", "SCHEMA", "RunWriter", "new_run_id", "runs_dir"]
