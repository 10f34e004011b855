"""Run bundles (``runs/<run_id>/``): writing events (``RunWriter``), and
reading them back: tolerant event reading, one-line run summaries with a
status, listing and resolving runs, loss/lr/validation curves, config
comparison and terminal sparklines (``toy.runs.reader``, used by
``toy runs``). Plotting lives in ``toy.runs.plot`` (needs matplotlib, not
imported here)."""

from toy.runs.reader import (
    Problem,
    Run,
    compare,
    list_runs,
    load_run,
    loss_curve,
    lr_curve,
    read_events,
    resolve_run,
    sparkline,
    val_curves,
)
from toy.runs.writer import SCHEMA, RunWriter, new_run_id, runs_dir

__all__ = [
    "SCHEMA",
    "Problem",
    "Run",
    "RunWriter",
    "compare",
    "list_runs",
    "load_run",
    "loss_curve",
    "lr_curve",
    "new_run_id",
    "read_events",
    "resolve_run",
    "runs_dir",
    "sparkline",
    "val_curves",
]
