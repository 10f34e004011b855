"""Mirroring run events to TensorBoard and MLflow (``--report-to``, ``toy runs export``).

A *sink* takes toy's events (the dicts of ``events.jsonl``, schema "toy/v1") one at a time
and writes them where the tool reads them. Both sinks map an event the same way
(``scalars`` and ``texts``):

- ``step``: ``train/loss``, ``train/lr``, ``train/grad_norm`` and ``train/<unit>_per_s``
  (tokens or images per second) at the event's step;
- ``eval``: ``eval/<name>_loss`` and ``eval/<name>_ppl`` (``name`` is "val");
- a diagnostics event (kind ``diag_<what>``): each number ``key`` is
  ``diag/<what>/<key>``; a list of numbers is one scalar per entry,
  ``diag/<what>/<key>/layer_03`` (a key named ``layers`` or ``values`` drops its own name:
  ``diag/<what>/layer_03``); anything else is left out;
- ``sample``, ``note`` and ``checkpoint``: texts (``samples``, ``notes``, ``checkpoints``);
- ``run_start``: the config (TensorBoard: a text ``config``, the JSON; MLflow: params,
  ``optim.lr`` style keys, and tags ``toy.run_id``/``toy.recipe``);
- ``run_end``: TensorBoard: a text ``run_end``; MLflow: the run's status
  (completed: FINISHED, interrupted: KILLED, errored: FAILED).

Times are the run's own: ``started_at`` + ``t``, so exporting a finished run writes what
mirroring it live wrote. A non-finite value (written as null) is left out.

TensorBoard: ``tensorboardX``'s event writer (the ``tensorboard`` extra, ~0.1 s to import
without PyTorch), into ``<run folder>/tensorboard``, or ``<tensorboard_dir>/<run id>`` when
``report.tensorboard_dir`` is set (one folder of runs, as TensorBoard compares them).
A ``resume`` event (a resumed run repeats the steps after its checkpoint) is written as a
TensorBoard session restart at the first repeated step, so TensorBoard drops the old points
from there, as ``toy runs`` does.

MLflow: ``mlflow-skinny``'s tracking client (the ``mlflow`` extra). The default store is
``sqlite:///<runs folder>/mlflow.db`` with artifacts (the samples) in
``<runs folder>/mlartifacts`` (for any SQLite store, ``mlartifacts`` next to it, not
MLflow's ``./mlruns`` in the current folder). SQLite because MLflow 3 refuses a plain file
store unless ``MLFLOW_ALLOW_FILE_STORE=true`` (it is in maintenance mode) and recommends
SQLite instead, with no server. One MLflow run per toy run (tag ``toy.run_id``); a resumed
run goes on in the same MLflow run. Metrics are sent in batches (at most every 2 s, and at
each eval, sample and the end).

Errors: a missing library is ``ReportUnavailableError`` (a one-line message and the install
command, ``toy.extras``); a store that cannot be opened is ``ReportError``. Once a run is
going, a sink that fails is dropped by ``RunWriter`` (a warning and a ``note``); training
goes on.
"""

from __future__ import annotations

import datetime
import json
import logging
import math
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from toy.errors import BadInputError, ToyError
from toy.extras import install_command

log = logging.getLogger("toy.runs")

#: the backends, as ``report.to`` and ``toy runs export --to`` name them
BACKENDS = ("tensorboard", "mlflow")
_STATUS = {"completed": "FINISHED", "interrupted": "KILLED", "errored": "FAILED"}
_TEXT_KINDS = {"sample": "samples", "note": "notes", "checkpoint": "checkpoints"}


class ReportError(ToyError):
    """A TensorBoard folder or an MLflow store that cannot be used."""


class ReportUnavailableError(BadInputError):
    """The library a backend needs is not installed (an optional extra)."""


# -- mapping events


def _num(v: Any) -> float | None:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return None
    return float(v) if math.isfinite(v) else None


def scalars(ev: dict[str, Any]) -> list[tuple[str, float]]:
    """The scalars ``(tag, value)`` of one event (see the module docstring)."""
    kind = ev.get("kind")
    out: list[tuple[str, float]] = []
    if kind == "step":
        for key in ("loss", "lr", "grad_norm", *sorted(k for k in ev if k.endswith("_per_s"))):
            if (v := _num(ev.get(key))) is not None:
                out.append((f"train/{key}", v))
    elif kind == "eval":
        name = ev.get("name") if isinstance(ev.get("name"), str) else "val"
        for key in ("loss", "ppl"):
            if (v := _num(ev.get(key))) is not None:
                out.append((f"eval/{name}_{key}", v))
    elif isinstance(kind, str) and kind.startswith("diag_"):
        what = kind[len("diag_") :]
        for key, val in ev.items():
            if key in ("kind", "t", "step"):
                continue
            if (v := _num(val)) is not None:
                out.append((f"diag/{what}/{key}", v))
            elif isinstance(val, list) and val and all(isinstance(x, (int, float)) or x is None for x in val):
                base = f"diag/{what}" if key in ("layers", "values") else f"diag/{what}/{key}"
                for i, x in enumerate(val):
                    if (v := _num(x)) is not None:
                        out.append((f"{base}/layer_{i:02d}", v))
    return out


def texts(ev: dict[str, Any]) -> list[tuple[str, str]]:
    """The texts ``(tag, text)`` of one event."""
    kind = ev.get("kind")
    if kind == "sample":
        return [("samples", f"{ev.get('prompt') or ''}{ev.get('text') or ''}")]
    if kind == "note" and isinstance(ev.get("text"), str):
        return [("notes", ev["text"])]
    if kind == "checkpoint":
        return [("checkpoints", json.dumps({k: v for k, v in ev.items() if k not in ("kind", "t")}))]
    return []


def _flat(d: dict[str, Any], prefix: str = "") -> dict[str, str]:
    out: dict[str, str] = {}
    for k, v in d.items():
        if isinstance(v, dict) and v:
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v if isinstance(v, str) else json.dumps(v)
    return out


def _start_time(start: dict[str, Any]) -> float:
    """The run's start as a Unix time (``started_at``, else now)."""
    try:
        return datetime.datetime.fromisoformat(str(start["started_at"])).timestamp()
    except (KeyError, ValueError):
        return time.time()


class _Sink:
    """What both backends share: the step of the latest event, the wall time of an event."""

    name = "report"

    def __init__(self, start: dict[str, Any]):
        self.start = start
        self.t0 = _start_time(start)
        self.step = 0
        self.closed = False

    def wall(self, ev: dict[str, Any]) -> float:
        t = ev.get("t")
        return self.t0 + (float(t) if isinstance(t, (int, float)) else 0.0)

    def __call__(self, ev: dict[str, Any]) -> None:
        if self.closed:
            return
        if isinstance(ev.get("step"), int):
            self.step = ev["step"]
        kind = ev.get("kind")
        if kind == "run_start":
            return  # given to the constructor
        if kind == "resume" and isinstance(ev.get("from_step"), int):
            self.step = ev["from_step"]
            self.resume(ev)
        self.write(ev, scalars(ev), texts(ev))
        if kind == "run_end":
            self.end(ev)
            self.close()

    def resume(self, ev: dict[str, Any]) -> None: ...
    def write(self, ev: dict[str, Any], sc: list[tuple[str, float]], tx: list[tuple[str, str]]) -> None: ...
    def end(self, ev: dict[str, Any]) -> None: ...
    def close(self) -> None:
        self.closed = True


# -- TensorBoard


def _tensorboardx() -> Any:
    try:
        import tensorboardX  # lazy: an optional extra (toy-cli[tensorboard])
    except ImportError as e:
        raise ReportUnavailableError(
            f"writing TensorBoard events needs tensorboardX ({e})", hint=install_command("tensorboard")
        ) from e
    return tensorboardX


class TensorBoardSink(_Sink):
    """Writes a run's events as a TensorBoard event file in ``logdir``."""

    name = "tensorboard"

    def __init__(self, start: dict[str, Any], logdir: str | Path):
        super().__init__(start)
        tbx = _tensorboardx()
        self.logdir = Path(logdir)
        try:
            self.w = tbx.SummaryWriter(logdir=str(self.logdir), flush_secs=2)
        except OSError as e:
            raise ReportError(f"cannot write TensorBoard events to {self.logdir}: {e.strerror or e}") from e
        if start.get("kind") == "run_start":
            cfg = json.dumps(start.get("config") or {}, indent=2, sort_keys=True)
            self.w.add_text("config", f"```\n{cfg}\n```", 0, walltime=self.wall(start))

    def resume(self, ev: dict[str, Any]) -> None:
        from tensorboardX.proto.event_pb2 import Event, SessionLog

        # TensorBoard drops the points at or after a restart's step that came before it
        event = Event(
            step=ev["from_step"] + 1, wall_time=self.wall(ev), session_log=SessionLog(status=SessionLog.START)
        )
        self.w._get_file_writer().add_event(event)

    def write(self, ev: dict[str, Any], sc: list[tuple[str, float]], tx: list[tuple[str, str]]) -> None:
        wall = self.wall(ev)
        for tag, v in sc:
            self.w.add_scalar(tag, v, self.step, walltime=wall)
        for tag, text in tx:
            self.w.add_text(tag, text, self.step, walltime=wall)

    def end(self, ev: dict[str, Any]) -> None:
        self.w.add_text("run_end", str(ev.get("reason")), self.step, walltime=self.wall(ev))

    def close(self) -> None:
        if not self.closed:
            self.w.close()
        super().close()


# -- MLflow


def _mlflow() -> Any:
    try:
        from mlflow.tracking import MlflowClient  # lazy: an optional extra (toy-cli[mlflow]), ~0.8 s

        for name in ("mlflow.store.db.utils", "alembic"):  # "Creating initial MLflow database tables..."
            if logging.getLogger(name).level == logging.NOTSET:
                logging.getLogger(name).setLevel(logging.WARNING)
    except ImportError as e:
        raise ReportUnavailableError(f"logging to MLflow needs mlflow ({e})", hint=install_command("mlflow")) from e
    return MlflowClient


def default_mlflow_uri(runs_root: str | Path) -> str:
    """``sqlite:///<runs folder>/mlflow.db`` (absolute)."""
    return f"sqlite:///{Path(runs_root).absolute() / 'mlflow.db'}"


class MlflowSink(_Sink):
    """Logs a run's events to one MLflow run (tag ``toy.run_id``) in ``experiment``;
    ``resume`` finds the MLflow run a earlier session made and goes on in it."""

    name = "mlflow"
    FLUSH_S = 2.0

    def __init__(
        self,
        start: dict[str, Any],
        uri: str,
        experiment: str = "toy",
        *,
        artifacts: str | Path | None = None,
        resume: bool = False,
        replace: bool = False,
    ):
        super().__init__(start)
        client_cls = _mlflow()
        from mlflow.exceptions import MlflowException

        self.uri = uri
        self._pending: list[Any] = []
        self._last_flush = time.monotonic()
        rid = str(start.get("run_id"))
        try:
            self.client = client_cls(tracking_uri=uri)
            exp = self.client.get_experiment_by_name(experiment)
            if exp is None:
                loc = Path(artifacts).absolute().as_uri() if artifacts is not None else None
                exp_id = self.client.create_experiment(experiment, artifact_location=loc)
            else:
                exp_id = exp.experiment_id
            found = self.client.search_runs([exp_id], filter_string=f"tags.`toy.run_id` = '{rid}'")
            if found and not resume:
                if not replace:
                    raise ReportError(
                        f"MLflow ({uri}, experiment {experiment!r}) already has run {rid}",
                        hint="delete it there first, or pick another experiment",
                    )
                for r in found:
                    self.client.delete_run(r.info.run_id)
                found = []
            if found:
                self.run_id = found[0].info.run_id
                self.client.update_run(self.run_id, status="RUNNING")
            else:
                cfg: dict[str, Any] = start["config"] if isinstance(start.get("config"), dict) else {}
                tags = {"toy.run_id": rid, "toy.run_kind": str(start.get("run_kind", "train"))}
                if isinstance(cfg.get("recipe"), str):
                    tags["toy.recipe"] = cfg["recipe"]
                run = self.client.create_run(exp_id, start_time=int(self.t0 * 1000), tags=tags, run_name=rid)
                self.run_id = run.info.run_id
                self._params(cfg)
        except MlflowException as e:
            raise ReportError(f"MLflow ({uri}): {e.message}", hint="check report.mlflow_uri") from e

    def _params(self, cfg: dict[str, Any]) -> None:
        from mlflow.entities import Param

        params = [Param(k, v[:6000]) for k, v in sorted(_flat(cfg).items())]
        for i in range(0, len(params), 100):  # MLflow takes at most 100 params a batch
            self.client.log_batch(self.run_id, params=params[i : i + 100])

    def write(self, ev: dict[str, Any], sc: list[tuple[str, float]], tx: list[tuple[str, str]]) -> None:
        from mlflow.entities import Metric

        ms = int(round(self.wall(ev) * 1000))
        self._pending += [Metric(tag, v, ms, self.step) for tag, v in sc]
        for tag, text in tx:
            self.client.log_text(self.run_id, text, f"{tag}/step_{self.step:06d}_{ms}.txt")
        now = time.monotonic()
        if ev.get("kind") in ("eval", "sample", "run_end") or now - self._last_flush >= self.FLUSH_S:
            self.flush()

    def flush(self) -> None:
        pending, self._pending = self._pending, []
        for i in range(0, len(pending), 1000):  # MLflow takes at most 1000 metrics a batch
            self.client.log_batch(self.run_id, metrics=pending[i : i + 1000])
        self._last_flush = time.monotonic()

    def end(self, ev: dict[str, Any]) -> None:
        self.flush()
        status = _STATUS.get(str(ev.get("reason")), "FINISHED")
        self.client.set_terminated(self.run_id, status, end_time=int(round(self.wall(ev) * 1000)))

    def close(self) -> None:
        if not self.closed:
            self.flush()
        super().close()


# -- opening sinks for a run


def _first(path: Path) -> dict[str, Any]:
    with open(path / "events.jsonl", encoding="utf-8") as f:
        rec = json.loads(f.readline())
    if not isinstance(rec, dict) or rec.get("kind") != "run_start":
        raise ReportError(f"{path / 'events.jsonl'}: does not start with run_start")
    return rec


def _artifacts(uri: str) -> Path | None:
    """Where a new experiment keeps its artifacts: next to a local SQLite store
    (``<its folder>/mlartifacts``; MLflow's own default is ``./mlruns`` in the current
    folder); a server decides for itself (None)."""
    if uri.startswith("sqlite:///"):
        return Path(uri[len("sqlite:///") :]).parent / "mlartifacts"
    return None


def _tb_dir(run_dir: Path, tensorboard_dir: str | Path | None) -> Path:
    return Path(tensorboard_dir) / run_dir.name if tensorboard_dir else run_dir / "tensorboard"


def open_sinks(
    run_dir: str | Path,
    to: Iterable[str],
    *,
    tensorboard_dir: str | Path | None = None,
    mlflow_uri: str | None = None,
    mlflow_experiment: str = "toy",
    resume: bool = False,
    replace: bool = False,
) -> list[_Sink]:
    """A sink per backend in ``to`` for the run in ``run_dir`` (its ``run_start`` read from
    events.jsonl). TensorBoard: ``<tensorboard_dir>/<run id>``, else ``<run_dir>/tensorboard``;
    MLflow: ``mlflow_uri``, else ``default_mlflow_uri(<runs folder>)``."""
    run_dir = Path(run_dir)
    start = _first(run_dir)
    sinks: list[_Sink] = []
    try:
        for name in sorted(to, key=lambda n: n != "mlflow"):  # MLflow first: it can refuse (a run there)
            if name == "tensorboard":
                sinks.append(TensorBoardSink(start, _tb_dir(run_dir, tensorboard_dir)))
            elif name == "mlflow":
                uri = mlflow_uri or default_mlflow_uri(run_dir.parent)
                arts = _artifacts(uri)
                sinks.append(MlflowSink(start, uri, mlflow_experiment, artifacts=arts, resume=resume, replace=replace))
            else:
                raise BadInputError(f"unknown report backend {name!r}", hint=f"one of {', '.join(BACKENDS)}")
    except BaseException:
        for s in sinks:
            s.close()
        raise
    return sinks


def check_available(to: Iterable[str]) -> None:
    """Raise ``ReportUnavailableError`` now (before a run starts) when a backend's library is missing."""
    for name in to:
        if name == "tensorboard":
            _tensorboardx()
        elif name == "mlflow":
            _mlflow()


def attach(writer: Any, report: Any, *, resume: bool = False) -> list[_Sink]:
    """Mirror ``writer``'s run (a ``RunWriter``) to the backends of ``report`` (a
    ``toy.train.config.ReportConfig``) from now on; returns the sinks (none when
    ``report.to`` is empty). A backend that cannot be opened (an MLflow server that
    does not answer, a folder that cannot be written, a library missing on resume) is
    left out like a sink that fails later: a warning and a ``note``; the run goes on."""
    sinks: list[_Sink] = []
    for name in report.to:
        try:
            (sink,) = open_sinks(
                writer.dir,
                [name],
                tensorboard_dir=report.tensorboard_dir,
                mlflow_uri=report.mlflow_uri,
                mlflow_experiment=report.mlflow_experiment,
                resume=resume,
            )
        except Exception as e:  # noqa: BLE001 - the run matters more than its mirror
            msg = e.args[0] if isinstance(e, ToyError) and e.args else f"{type(e).__name__}: {e}"
            text = f"{name}: not mirroring this run ({msg})"
            log.warning("run %s: %s", writer.run_id, text)
            writer.event("note", text=text)
            continue
        writer.add_listener(sink, sink.name)
        sinks.append(sink)
    return sinks


def export_run(
    run_dir: str | Path,
    to: Iterable[str],
    *,
    tensorboard_dir: str | Path | None = None,
    mlflow_uri: str | None = None,
    mlflow_experiment: str = "toy",
    replace: bool = False,
) -> dict[str, Any]:
    """Write a run's events (finished or not) to the backends in ``to``, as mirroring
    it live does. Returns ``{"run": id, "events": n, "tensorboard": dir, "mlflow": uri}``
    (the backends written)."""
    from toy.runs.reader import read_events

    run_dir = Path(run_dir)
    tb = _tb_dir(run_dir, tensorboard_dir)
    if "tensorboard" in to and tb.is_dir() and any(tb.glob("events.out.tfevents.*")):
        if not replace:
            raise ReportError(
                f"{tb} already holds TensorBoard events of this run",
                hint="pass --replace to write them again, or --tensorboard-dir for another folder",
            )
        for f in tb.glob("events.out.tfevents.*"):
            f.unlink()
    sinks = open_sinks(
        run_dir,
        to,
        tensorboard_dir=tensorboard_dir,
        mlflow_uri=mlflow_uri,
        mlflow_experiment=mlflow_experiment,
        replace=replace,
    )
    events, _problems = read_events(run_dir / "events.jsonl")
    try:
        for ev in events[1:]:
            for s in sinks:
                s(ev)
    finally:
        for s in sinks:
            s.close()
    out: dict[str, Any] = {"run": run_dir.name, "events": len(events)}
    for s in sinks:
        out[s.name] = str(s.logdir) if isinstance(s, TensorBoardSink) else getattr(s, "uri", None)
    return out


__all__ = [
    "BACKENDS",
    "MlflowSink",
    "ReportError",
    "ReportUnavailableError",
    "TensorBoardSink",
    "attach",
    "check_available",
    "default_mlflow_uri",
    "export_run",
    "open_sinks",
    "scalars",
    "texts",
]
