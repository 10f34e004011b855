"""Plotting runs to an image file: loss curves and learning rates.

``plot_runs(runs, out_path)`` draws one figure with two axes, one above the
other, sharing the step axis:

- loss: each run's training loss as a line, and each of its evaluation series
  (``eval`` events by name, "val" for training runs) as markers joined by a
  line in the same colour, labelled ``<run id>`` and ``<run id> <name>``;
- learning rate: one line per run that has ``lr`` in its step events.

Invariants: matplotlib is imported inside the functions (``import toy.runs``
never pays for it, and a missing matplotlib is a ``PlotUnavailableError``
with an install hint, not an ImportError). The figure is a bare
``matplotlib.figure.Figure`` drawn by the Agg canvas: pyplot and its global
state (current figure, interactive backend) are never touched, so plotting
from a server thread or a test is safe. The returned dict says what was
drawn (curve counts per axis, runs skipped for having no curves); the file
format follows the suffix (.png, .svg or .pdf).

Missing values (non-finite losses were written as null) are gaps in a line.

``plot_diagnostics(run, out_path)`` draws one run's training diagnostics
(``toy.train.diagnostics``'s ``diag_*`` events), one axis per kind the run
wrote, each with one line per block over the steps: gradient norm
(``diag_grads``), update ratio (``diag_updates``), drift from the starting
weights (``diag_drift``), all on log axes, and the residual stream's RMS
(``diag_activations``); a ``diag_nonfinite`` event is a vertical line on
every axis. Blocks are coloured along one colour map (block 0 lightest),
so a figure of a deep model stays readable; past 12 blocks the legend lists
the first, middle and last.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from toy.errors import BadInputError, PlotUnavailableError  # PlotUnavailableError: toy_vit raises it too
from toy.extras import install_command
from toy.runs.reader import Run, loss_curve, lr_curve, val_curves

FORMATS = (".png", ".svg", ".pdf")


def install_hint() -> str:
    """The command that brings matplotlib, for how toy was installed (toy.extras)."""
    return install_command("plot")


def _matplotlib() -> Any:
    try:
        import matplotlib  # lazy: an optional extra (toy-cli[plot]), ~0.9 s
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as e:
        raise PlotUnavailableError(f"plotting runs needs matplotlib ({e})", hint=install_hint()) from e
    return matplotlib, Figure, FigureCanvasAgg


def _xy(points: list[tuple[int, float | None]]) -> tuple[list[int], list[float]]:
    # None -> NaN: matplotlib leaves a gap there
    return [s for s, _ in points], [float("nan") if v is None else v for _, v in points]


def build_figure(
    runs: list[Run], *, title: str | None = None, log_loss: bool = False, size: tuple[float, float] = (9.0, 6.0)
) -> tuple[Any, dict[str, Any]]:
    """The figure for ``runs`` and a dict of what is on it:
    ``{"runs": [ids drawn], "skipped": [ids without curves],
    "loss_axis": {"train": n, "eval": m}, "lr_axis": k}``."""
    _, Figure, FigureCanvasAgg = _matplotlib()
    fig = Figure(figsize=size, layout="constrained")
    FigureCanvasAgg(fig)  # attaches itself to the figure
    ax_loss, ax_lr = fig.subplots(2, 1, sharex=True, height_ratios=[3, 1])
    info: dict[str, Any] = {"runs": [], "skipped": [], "loss_axis": {"train": 0, "eval": 0}, "lr_axis": 0}
    for i, run in enumerate(runs):
        color = f"C{i % 10}"
        train, lr, evals = loss_curve(run), lr_curve(run), val_curves(run)
        if not train and not evals and not lr:
            info["skipped"].append(run.id)
            continue
        info["runs"].append(run.id)
        if train:
            ax_loss.plot(*_xy(train), color=color, linewidth=1.2, label=run.id)
            info["loss_axis"]["train"] += 1
        for j, (name, pts) in enumerate(evals.items()):
            style = ("o-", "s--", "^:", "D-.")[j % 4]
            ax_loss.plot(*_xy(pts), style, color=color, markersize=4, linewidth=1, label=f"{run.id} {name}")
            info["loss_axis"]["eval"] += 1
        if lr and any(v is not None for _, v in lr):
            ax_lr.plot(*_xy(lr), color=color, linewidth=1.2, label=run.id)
            info["lr_axis"] += 1
    if not info["runs"]:
        raise BadInputError(
            f"nothing to plot: no step or eval events in {', '.join(r.id for r in runs)}",
            hint="plot training runs (or eval runs with stepped eval events)",
        )
    ax_loss.set_ylabel("loss (nats/token)")
    if log_loss:
        ax_loss.set_yscale("log")
    ax_loss.grid(True, alpha=0.3)
    ax_loss.legend(fontsize="small", loc="upper right")
    ax_lr.set_ylabel("learning rate")
    ax_lr.set_xlabel("step")
    ax_lr.grid(True, alpha=0.3)
    ax_lr.ticklabel_format(axis="y", style="sci", scilimits=(-2, 3))
    if info["lr_axis"] == 0:
        ax_lr.text(0.5, 0.5, "no learning rate recorded", ha="center", va="center", transform=ax_lr.transAxes)
    fig.suptitle(title or ("run " + runs[0].id if len(runs) == 1 else f"{len(info['runs'])} runs"))
    return fig, info


#: the diagnostics axes: (event kind, field, axis label, log scale)
DIAG_AXES = (
    ("diag_grads", "layers", "gradient norm", True),
    ("diag_updates", "layers", "update / weight", True),
    ("diag_drift", "layers", "drift from start", True),
    ("diag_activations", "rms", "activation RMS", False),
)


def build_diagnostics_figure(
    run: Run, *, title: str | None = None, size: tuple[float, float] = (9.0, 8.0)
) -> tuple[Any, dict[str, Any]]:
    """The diagnostics figure of ``run`` and a dict of what is on it:
    ``{"axes": [event kinds drawn], "blocks": n, "nonfinite": [steps]}``."""
    matplotlib, Figure, FigureCanvasAgg = _matplotlib()
    present = [a for a in DIAG_AXES if run.of(a[0])]
    if not present:
        raise BadInputError(
            f"nothing to plot: run {run.id} has no diagnostics events",
            hint="train with --diagnostics all (or a list: grads,updates,drift,activations)",
        )
    fig = Figure(figsize=size, layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(len(present), 1, sharex=True, squeeze=False)[:, 0]
    bad = [e.get("step") for e in run.of("diag_nonfinite") if isinstance(e.get("step"), int)]
    cmap = matplotlib.colormaps["viridis"]
    n_blocks = 0
    for ax, (kind, key, label, log) in zip(axes, present):
        evs = [e for e in run.of(kind) if isinstance(e.get("step"), int) and isinstance(e.get(key), list)]
        n = max((len(e[key]) for e in evs), default=0)
        n_blocks = max(n_blocks, n)
        shown = set(range(n)) if n <= 12 else {0, n // 2, n - 1}
        for b in range(n):
            pts = [(e["step"], e[key][b] if b < len(e[key]) else None) for e in evs]
            color = cmap(0.9 - 0.8 * b / max(1, n - 1))
            ax.plot(*_xy(pts), color=color, linewidth=1.2, marker="." if len(pts) < 30 else None,
                    label=f"block {b}" if b in shown else None)  # fmt: skip
        for s in bad:
            ax.axvline(s, color="red", linestyle="--", linewidth=1)
        ax.set_ylabel(label)
        if log:
            ax.set_yscale("log")
        ax.grid(True, alpha=0.3)
    axes[0].legend(fontsize="small", loc="best", ncol=2 if n_blocks > 6 else 1)
    axes[-1].set_xlabel("step")
    fig.suptitle(title or f"run {run.id}: diagnostics")
    return fig, {"axes": [a[0] for a in present], "blocks": n_blocks, "nonfinite": bad}


def _save(fig: Any, out_path: str | os.PathLike[str], size: tuple[float, float], dpi: int) -> dict[str, Any]:
    out = Path(out_path)
    fmt = out.suffix.lower()
    # write beside the target, then rename: a reader never sees half an image
    tmp = out.with_name(f".{out.name}.tmp{os.getpid()}")
    try:
        fig.savefig(tmp, format=fmt[1:], dpi=dpi)
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
    info: dict[str, Any] = {"path": str(out), "format": fmt[1:]}
    if fmt == ".png":
        info["pixels"] = [round(size[0] * dpi), round(size[1] * dpi)]
    return info


def _check_out(out: Path) -> None:
    if out.suffix.lower() not in FORMATS:
        raise BadInputError(f"{out}: unknown image type {out.suffix or '(none)'!r}", hint="name a .png, .svg or .pdf")
    if not out.parent.is_dir():
        raise BadInputError(f"{out.parent}: no such folder", hint="create it first or write elsewhere")


def plot_diagnostics(
    run: Run,
    out_path: str | os.PathLike[str],
    *,
    title: str | None = None,
    size: tuple[float, float] = (9.0, 8.0),
    dpi: int = 100,
) -> dict[str, Any]:
    """Draw ``run``'s diagnostics (see the module doc) into ``out_path``;
    returns ``build_diagnostics_figure``'s dict plus ``path``, ``format``
    and ``pixels`` (raster output)."""
    _check_out(Path(out_path))
    fig, info = build_diagnostics_figure(run, title=title, size=size)
    info.update(_save(fig, out_path, size, dpi))
    return info


def plot_runs(
    runs: list[Run],
    out_path: str | os.PathLike[str],
    *,
    title: str | None = None,
    log_loss: bool = False,
    size: tuple[float, float] = (9.0, 6.0),
    dpi: int = 100,
) -> dict[str, Any]:
    """Draw ``runs`` (see the module doc) into ``out_path``; returns
    ``build_figure``'s dict plus ``path``, ``format`` and ``pixels``
    ([width, height] for raster output)."""
    out = Path(out_path)
    fmt = out.suffix.lower()
    if fmt not in FORMATS:
        raise BadInputError(f"{out}: unknown image type {out.suffix or '(none)'!r}", hint="name a .png, .svg or .pdf")
    if not out.parent.is_dir():
        raise BadInputError(f"{out.parent}: no such folder", hint="create it first or write elsewhere")
    if not runs:
        raise BadInputError("no runs to plot", hint="name one or more runs")
    fig, info = build_figure(runs, title=title, log_loss=log_loss, size=size)
    return {**info, **_save(fig, out, size, dpi)}


__all__ = [
    "DIAG_AXES",
    "FORMATS",
    "PlotUnavailableError",
    "build_diagnostics_figure",
    "build_figure",
    "install_hint",
    "plot_diagnostics",
    "plot_runs",
]
