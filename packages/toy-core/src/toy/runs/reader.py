"""Reading run bundles: events, one-line summaries, curves, comparisons.

A run bundle is ``<root>/<run_id>/`` with ``config.json`` and ``events.jsonl``
(schema "toy/v1", docs/concepts/architecture.md, "Runs"). This module only reads; it never
prints. ``toy runs`` (toy-cli) is its user.

Tolerance (``read_events``):

- a last line without a trailing newline that does not parse is a write cut
  short by a crash: skipped silently;
- any other line that is not JSON, not an object, or has no string ``kind``
  becomes a ``Problem`` (1-based line number, reason) and reading goes on;
  a bad line directly followed by a ``resume`` event is the torn last line of
  an earlier session (``RunWriter.reopen`` ends it with a newline) and is
  skipped silently too;
- unknown kinds and keys are kept in the events but never used; a value of
  the wrong type (a string where a number belongs) counts as missing;
  ``NaN``/``Infinity`` literals read as ``None``, like the writer's nulls.

Summaries (``Run``): the status is the ``reason`` of the last ``run_end`` that
comes after the last ``resume``. Without one, a folder with a lock file (a
training run: new or resumed, it holds ``toy.runs.folder``'s lock while it
runs) is "running" while a process holds that lock; another run is "running"
when its ``run_start`` names this host and a ``pid`` that is alive. Else it
is "unfinished" (killed, or running on another machine). Decisions: eval and
serve runs take no lock, so for them a recycled pid can make a dead run look
"running"; on Windows liveness is not probed.
Curves follow the resume rule of the training reference: a ``resume`` with
``from_step`` k drops the points after step k, so a repeated step means its
later occurrence. For eval runs ``best_val`` is the headline: the loss of the
first ``eval`` event that has one.
"""

from __future__ import annotations

import json
import math
import os
import platform
import statistics
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from toy.errors import BadInputError
from toy.runs.folder import LOCK_NAME, lock_holder
from toy.runs.writer import runs_dir

KINDS = ("train", "serve", "eval")
STATUSES = ("completed", "interrupted", "errored", "running", "unfinished")
# sort key -> (value of a Run, descending); runs without the value go last
SORTS: dict[str, tuple[Any, bool]] = {
    "started": (lambda r: r.started_at or "", True),
    "id": (lambda r: r.id, False),
    "loss": (lambda r: r.final_loss, False),
    "val": (lambda r: r.best_val, False),
    "steps": (lambda r: r.steps, True),
    "tokens_per_s": (lambda r: r.tokens_per_s, True),
    "wall": (lambda r: r.wall_s, True),
}
FIGURES = ("kind", "model", "status", "steps", "final_loss", "best_val", "tokens_per_s", "wall_s")
SPARKS = "▁▂▃▄▅▆▇█"


@dataclass
class Problem:
    """A line (or file) of a bundle that could not be used."""

    line: int | None  # 1-based; None for a whole-file problem
    reason: str
    file: str = "events.jsonl"

    def __str__(self) -> str:
        return f"{self.file} line {self.line}: {self.reason}" if self.line else f"{self.file}: {self.reason}"


def _num(v: Any) -> float | None:
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) else None


def _int(v: Any) -> int | None:
    return v if isinstance(v, int) and not isinstance(v, bool) else None


def read_events(path: str | os.PathLike[str]) -> tuple[list[dict[str, Any]], list[Problem]]:
    """All events of an events.jsonl, in order, and the lines that were bad."""
    raw = Path(path).read_bytes()
    lines = raw.split(b"\n")
    torn = lines.pop()  # b"" when the file ends with a newline
    events: list[dict[str, Any]] = []
    problems: list[Problem] = []
    pending: Problem | None = None  # a bad line, forgiven if a resume follows
    for no, line in enumerate([*lines, torn], start=1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line, parse_constant=lambda _: None)
            reason = None if isinstance(rec, dict) else f"not an object ({type(rec).__name__})"
        except ValueError as e:  # also UnicodeDecodeError
            rec, reason = None, f"bad JSON: {e}"
        if reason is None and not isinstance(rec.get("kind"), str):
            reason = "no kind"
        if reason is not None:
            if no == len(lines) + 1:  # the unterminated last line
                continue
            if pending is not None:
                problems.append(pending)
            pending = Problem(no, reason)
            continue
        if pending is not None and rec["kind"] != "resume":
            problems.append(pending)
        pending = None
        events.append(rec)
    if pending is not None:
        problems.append(pending)
    return events, problems


@dataclass
class Run:
    """A run bundle's summary; ``events`` and ``config`` hold the detail."""

    id: str
    dir: Path
    kind: str  # train | serve | eval | unknown
    model: str  # short display string
    started_at: str | None
    steps: int | None
    final_loss: float | None
    best_val: float | None
    tokens_per_s: float | None
    status: str  # one of STATUSES
    wall_s: float | None
    n_events: int
    problems: list[Problem] = field(default_factory=list)
    config: dict[str, Any] = field(default_factory=dict, repr=False)
    start: dict[str, Any] = field(default_factory=dict, repr=False)  # the run_start event
    events: list[dict[str, Any]] = field(default_factory=list, repr=False)

    def of(self, kind: str) -> list[dict[str, Any]]:
        return [e for e in self.events if e["kind"] == kind]

    def to_dict(self) -> dict[str, Any]:
        d = {k: getattr(self, k) for k in ("id", "kind", "model", "started_at", "steps", "final_loss", "best_val")}
        d.update(tokens_per_s=self.tokens_per_s, status=self.status, wall_s=self.wall_s, dir=str(self.dir))
        d.update(n_events=self.n_events, problems=[asdict(p) for p in self.problems])
        return d


def _running(d: Path, start: dict[str, Any]) -> bool:
    """A run folder with a lock file (training) is running while its lock is held; else ask its pid."""
    if (d / LOCK_NAME).exists():
        return lock_holder(d) is not None
    return _alive(start)


def _alive(start: dict[str, Any]) -> bool:
    pid, host = _int(start.get("pid")), start.get("host")
    if pid is None or pid <= 0 or os.name == "nt":  # os.kill(pid, 0) is not a probe on Windows
        return False
    if not isinstance(host, dict) or host.get("name") != platform.node():
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    except OSError:
        return False
    return True


def _fmt_params(n: int) -> str:
    if n >= 1e9:
        return f"{n / 1e9:.2f}B"
    if n >= 1e5:
        return f"{n / 1e6:.2f}M"
    return f"{n / 1e3:.1f}K" if n >= 1e3 else str(n)


def _file(v: Any) -> str | None:
    """A model's file name from a path string or an info dict with "path"."""
    v = v.get("path") if isinstance(v, dict) else v
    return Path(v).name if isinstance(v, str) and v else None


def _model(kind: str, start: dict[str, Any], config: dict[str, Any]) -> str:
    if kind == "train":
        parts = [start["recipe"]] if isinstance(start.get("recipe"), str) else []
        if _int(start.get("n_params")):
            parts.append(_fmt_params(start["n_params"]))
        tok = start.get("tokenizer")
        if not parts and isinstance(tok, str):
            parts.append(_file(tok.removeprefix("model:")) or tok)
        return " ".join(parts) or "-"
    # serve and eval: run_start's model info (a dict with "path", or a path), else the config's
    a = _file(start.get("model")) or _file(config.get("model"))
    b = _file(start.get("model_b")) or _file(config.get("model_b"))
    alias = start["model"].get("alias") if isinstance(start.get("model"), dict) else None
    label = f"{a} vs {b}" if a and b else a or (str(alias) if alias else "-")
    command = config.get("command") if kind == "eval" else None
    return f"{command}: {label}" if isinstance(command, str) and command else label


def load_run(path: str | os.PathLike[str]) -> Run:
    """Read one bundle folder; a missing or bad file is a Problem, not an error."""
    d = Path(path)
    problems: list[Problem] = []
    events: list[dict[str, Any]] = []
    if (d / "events.jsonl").is_file():
        events, problems = read_events(d / "events.jsonl")
    else:
        problems.append(Problem(None, "missing"))
    config: Any = None
    if (d / "config.json").is_file():
        try:
            config = json.loads((d / "config.json").read_bytes(), parse_constant=lambda _: None)
        except ValueError as e:
            problems.append(Problem(None, f"bad JSON: {e}", "config.json"))
    start = events[0] if events and events[0]["kind"] == "run_start" else {}
    if events and not start:
        problems.append(Problem(None, f"the first event is {events[0]['kind']!r}, not run_start"))
    if not isinstance(config, dict):
        config = start.get("config") if isinstance(start.get("config"), dict) else {}
    kind = start.get("run_kind")
    if kind not in KINDS:
        kind = next((k for k in KINDS if d.name.startswith(k + "-")), "unknown")
    end: dict[str, Any] | None = None
    for ev in events:
        if ev["kind"] == "run_end":
            end = ev
        elif ev["kind"] == "resume":
            end = None
    status = end.get("reason") if end else None
    if status not in ("completed", "interrupted", "errored"):
        status = "running" if end is None and _running(d, start) else "unfinished"
    run = Run(
        id=d.name, dir=d, kind=kind, model=_model(kind, start, config), started_at=start.get("started_at"),
        steps=None, final_loss=None, best_val=None, tokens_per_s=None, status=status, wall_s=None,
        n_events=len(events), problems=problems, config=config, start=start, events=events,
    )  # fmt: skip
    losses = loss_curve(run)
    run.steps = losses[-1][0] if losses else _int((end or {}).get("final_step"))
    run.final_loss = _num((end or {}).get("final_loss")) if end else None
    if run.final_loss is None and losses:
        run.final_loss = losses[-1][1]
    if kind == "eval":
        run.best_val = next((v for e in run.of("eval") if (v := _num(e.get("loss"))) is not None), None)
    else:
        run.best_val = min((v for _, v in val_curves(run).get("val", []) if v is not None), default=None)
    speeds = [_num(e.get("tokens_per_s")) for e in run.of("step")]
    if not any(s is not None for s in speeds):
        speeds = [_num(e.get("tok_s", e.get("tokens_per_s"))) for e in run.of("request")]
    known = [s for s in speeds if s is not None]
    run.tokens_per_s = statistics.median(known) if known else None
    run.wall_s = max((t for t in (_num(e.get("t")) for e in events) if t is not None), default=None)
    return run


def _bundles(root: Path) -> list[Path]:
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if (p / "events.jsonl").is_file() or (p / "config.json").is_file())


def list_runs(
    root: str | os.PathLike[str] | None = None,
    kind: str | None = None,
    status: str | None = None,
    sort: str = "started",
) -> list[Run]:
    """The runs under ``root`` (default ``runs_dir()``), filtered and sorted
    (see SORTS: newest, lowest loss, most steps first; missing values last).
    A missing root holds no runs."""
    if kind is not None and kind not in (*KINDS, "unknown"):
        raise BadInputError(f"unknown run kind {kind!r}", hint=f"one of: {', '.join(KINDS)}, unknown")
    if status is not None and status not in STATUSES:
        raise BadInputError(f"unknown status {status!r}", hint=f"one of: {', '.join(STATUSES)}")
    if sort not in SORTS:
        raise BadInputError(f"unknown sort key {sort!r}", hint=f"one of: {', '.join(SORTS)}")
    runs = [load_run(p) for p in _bundles(runs_dir(root))]
    runs = [r for r in runs if (kind is None or r.kind == kind) and (status is None or r.status == status)]
    key, desc = SORTS[sort]
    have = sorted((r for r in runs if key(r) is not None), key=lambda r: (key(r), r.id), reverse=desc)
    return have + [r for r in runs if key(r) is None]


def resolve_run(arg: str | os.PathLike[str], root: str | os.PathLike[str] | None = None) -> Path:
    """A RUN argument -> its folder: a path to a bundle (or its events.jsonl),
    else a full run id or a unique id prefix under ``root``."""
    p = Path(arg)
    if p.name == "events.jsonl" and p.is_file():
        p = p.parent
    if (p / "events.jsonl").is_file() or (p / "config.json").is_file():
        return p
    base = runs_dir(root)
    names = [b.name for b in _bundles(base)]
    if str(arg) in names:
        return base / str(arg)
    found = [n for n in names if n.startswith(str(arg))]
    if len(found) == 1:
        return base / found[0]
    if found:
        raise BadInputError(
            f"run {str(arg)!r} is ambiguous in {base}: matches {', '.join(found)}", hint="give more of the run id"
        )
    seen = ", ".join(names[-5:]) if names else "none"
    raise BadInputError(
        f"no run {str(arg)!r} in {base} (runs there: {seen})",
        hint="`toy runs list` shows the runs; pass a run folder, an id or a unique id prefix "
        "(--runs-dir or $TOY_RUNS_DIR choose the runs folder)",
    )


def _series(run: Run, kind: str, key: str, name: str | None = None) -> list[tuple[int, float | None]]:
    pts: dict[int, float | None] = {}
    for e in run.events:
        if e["kind"] == "resume" and _int(e.get("from_step")) is not None:
            pts = {s: v for s, v in pts.items() if s <= e["from_step"]}
        elif e["kind"] == kind and _int(e.get("step")) is not None and (name is None or e.get("name") == name):
            pts[e["step"]] = _num(e.get(key))  # a repeated step: the later value
    return sorted(pts.items())


def loss_curve(run: Run) -> list[tuple[int, float | None]]:
    """(step, training loss) pairs; None where the loss was not finite."""
    return _series(run, "step", "loss")


def lr_curve(run: Run) -> list[tuple[int, float | None]]:
    return _series(run, "step", "lr")


def val_curves(run: Run) -> dict[str, list[tuple[int, float | None]]]:
    """eval name -> (step, loss) pairs (eval events that carry a step; an
    evaluation without any loss, as GRPO's ``val_reward``, has no curve)."""
    names = dict.fromkeys(e["name"] for e in run.of("eval") if isinstance(e.get("name"), str))
    curves = {n: _series(run, "eval", "loss", n) for n in names}
    return {n: c for n, c in curves.items() if any(v is not None for _, v in c)}


def flatten(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """{"optim": {"lr": 1}} -> {"optim.lr": 1}; lists and empty dicts are leaves."""
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, dict) and v:
            out.update(flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def compare(runs: list[Run]) -> dict[str, Any]:
    """Config keys whose values differ (``present`` marks runs lacking a key)
    and FIGURES side by side, with deltas against the first run for numbers."""
    flat = [flatten(r.config) for r in runs]
    keys = sorted(set().union(*flat)) if flat else []
    diffs = []
    for k in keys:
        present = [k in f for f in flat]
        values = [f.get(k) for f in flat]
        canon = {json.dumps(v, sort_keys=True) if p else "\0missing" for v, p in zip(values, present)}
        if len(canon) > 1:
            diffs.append({"key": k, "values": values, "present": present})
    figures = []
    for name in FIGURES:
        values = [getattr(r, name) for r in runs]
        base: Any = values[0] if values else None
        numeric = isinstance(base, (int, float)) and not isinstance(base, bool)
        deltas = [v - base if numeric and isinstance(v, (int, float)) else None for v in values]
        figures.append({"name": name, "values": values, "deltas": deltas})
    return {"runs": [r.id for r in runs], "config": diffs, "figures": figures}


def sparkline(values: list[float | None], width: int | None = None) -> str:
    """A one-line chart of ``values`` in block characters, ``width`` long
    (default one per value): each character is the mean of its slice of the
    values (a shorter series repeats values). Missing or non-finite values
    are spaces; a constant series is a flat mid-height line."""
    vals = [_num(v) for v in values]
    n = len(vals)
    if n == 0 or width == 0:
        return ""
    width = width or n
    cells: list[float | None] = []
    for i in range(width):
        lo = i * n // width
        chunk = [v for v in vals[lo : max((i + 1) * n // width, lo + 1)] if v is not None]
        cells.append(sum(chunk) / len(chunk) if chunk else None)
    finite = [c for c in cells if c is not None]
    if not finite:
        return " " * width
    low, high = min(finite), max(finite)
    if high == low:
        return "".join(" " if c is None else SPARKS[3] for c in cells)
    return "".join(" " if c is None else SPARKS[round((c - low) / (high - low) * 7)] for c in cells)


__all__ = [
    "FIGURES", "KINDS", "SORTS", "STATUSES", "Problem", "Run", "compare", "flatten", "list_runs", "load_run",
    "loss_curve", "lr_curve", "read_events", "resolve_run", "sparkline", "val_curves",
]  # fmt: skip
