"""`toy runs`: list, show, compare, plot and export run bundles (``runs/<run_id>/``).

Conventions (docs/concepts/architecture.md): tables and ``--json`` documents on
stdout; warnings on stderr. A malformed events line is a warning naming the
run and the line (``warning: run ID: events.jsonl line N: reason``) and never
stops a command; a RUN that cannot be found or is ambiguous is bad input
(exit 2, with a hint). RUN is a bundle folder, a run id or a unique id prefix
in the runs folder (``--runs-dir``, else $TOY_RUNS_DIR, else ./runs).

The reading is ``toy.runs.reader`` (imported inside the commands so
``toy --help`` stays fast); plotting is ``toy.runs.plot`` and needs the
``plot`` extra (matplotlib); exporting is ``toy.runs.report`` and needs the
``tensorboard`` or ``mlflow`` extra.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated, Any

import typer

from toy_cli.ui import AsJson, CLIError, RunsDir, cli_errors

runs_app = typer.Typer(
    help="Read run bundles (runs/<run_id>/): list, show, compare, plot and export them.", no_args_is_help=True
)

RunArgs = Annotated[list[str], typer.Argument(metavar="RUN...", help="Run folders, ids or unique id prefixes.")]
# run_start "model" keys `show` prints (train: the dims; serve: the served file)
SHOW_KEYS = ("path", "alias", "n_vocab", "d_model", "n_layer", "n_head", "n_head_kv", "d_ff", "context_length", "n_ctx")
STATUS_STYLE = {"completed": "green", "interrupted": "yellow", "errored": "red", "running": "cyan"}


def _root(runs_dir: Path | None) -> Path:
    from toy.runs.writer import runs_dir as default_root

    if runs_dir is not None and not runs_dir.is_dir():
        raise CLIError(f"{runs_dir}: not a folder", "pass the folder that holds the run folders", 2)
    return default_root(runs_dir)


def _warn(runs) -> None:
    for r in runs:
        for p in r.problems:
            typer.echo(f"warning: run {r.id}: {p}", err=True)


def _load(args: list[str], runs_dir: Path | None) -> list:
    from toy.runs.reader import load_run, resolve_run

    root = _root(runs_dir)
    with cli_errors():
        runs = [load_run(resolve_run(a, root)) for a in args]
    _warn(runs)
    return runs


def _num(v: Any, spec: str = ".4f") -> str:
    if v is None:
        return "-"
    if isinstance(v, float) and spec == "speed":
        return f"{v:,.0f}"
    return format(v, spec) if isinstance(v, float) else str(v)


def _dur(s: float | None) -> str:
    if s is None:
        return "-"
    if s < 60:
        return f"{s:.1f}s"
    m, sec = divmod(int(s), 60)
    return f"{m // 60}:{m % 60:02d}:{sec:02d}" if m >= 60 else f"{m}:{sec:02d}"


def _value(v: Any) -> str:
    return v if isinstance(v, str) else json.dumps(v, ensure_ascii=False)


def _short(v: Any) -> str:
    return f"{v:.6g}" if isinstance(v, float) else _value(v)


def _table(columns: list[tuple[str, dict]], rows: list[list[Any]]) -> None:
    """A rich table on stdout in the style of `toy list` (cells are data, never markup)."""
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    table = Table(box=None, pad_edge=False, header_style="bold")
    for name, kw in columns:
        table.add_column(name, **kw)
    for row in rows:
        table.add_row(*(c if isinstance(c, Text) else Text(str(c)) for c in row))
    Console(width=None if sys.stdout.isatty() else 160, soft_wrap=False).print(table)


def _status(status: str):
    from rich.text import Text

    return Text(status, style=STATUS_STYLE.get(status, "dim"))


# -- toy runs list


@runs_app.command("list")
def list_cmd(
    kind: Annotated[str | None, typer.Option("--kind", help="Only this kind: train, serve or eval.")] = None,
    status: Annotated[
        str | None,
        typer.Option("--status", help="Only this status: completed, interrupted, errored, running, unfinished."),
    ] = None,
    sort: Annotated[
        str, typer.Option("--sort", help="started (newest first), id, loss, val, steps, tokens_per_s, wall.")
    ] = "started",
    limit: Annotated[int | None, typer.Option("--limit", "-n", min=1, help="Show at most this many.")] = None,
    as_json: AsJson = False,
    runs_dir: RunsDir = None,
) -> None:
    """List the runs: id, kind, model, steps, final loss, best validation loss, tokens/s, status."""
    from toy.runs.reader import list_runs

    root = _root(runs_dir)
    with cli_errors():
        runs = list_runs(root, kind=kind, status=status, sort=sort)
    runs = runs[:limit] if limit else runs
    _warn(runs)
    if as_json:
        typer.echo(json.dumps([r.to_dict() for r in runs], indent=2, ensure_ascii=False))
        return
    if not runs:
        typer.echo(f"no runs in {root}" + (" matching the filters" if kind or status else ""), err=True)
        if not root.is_dir():
            typer.echo("hint: --runs-dir or $TOY_RUNS_DIR name the runs folder", err=True)
        return
    columns = [("ID", {"overflow": "fold"}), ("KIND", {}), ("MODEL", {"overflow": "fold"})]
    columns += [(c, {"justify": "right"}) for c in ("STEPS", "LOSS", "BEST VAL", "TOK/S")] + [("STATUS", {})]
    rows = [
        [r.id, r.kind, r.model, _num(r.steps), _num(r.final_loss), _num(r.best_val), _num(r.tokens_per_s, "speed")]
        + [_status(r.status)]
        for r in runs
    ]
    _table(columns, rows)


# -- toy runs show


def _requests(run) -> dict | None:
    import statistics

    reqs = run.of("request")
    if not reqs:
        return None

    def median(key: str) -> float | None:
        vals = [e[key] for e in reqs if isinstance(e.get(key), (int, float)) and not isinstance(e.get(key), bool)]
        return statistics.median(vals) if vals else None

    ok = sum(1 for e in reqs if isinstance(e.get("status"), int) and e["status"] < 400)
    done = sum(e["completion_tokens"] for e in reqs if isinstance(e.get("completion_tokens"), int))
    return {"count": len(reqs), "ok": ok, "failed": len(reqs) - ok, "completion_tokens": done,
            "median_ttft_s": median("ttft_s"), "median_tok_s": median("tok_s")}  # fmt: skip


#: step metrics shown as curves: a preference run's (``toy.train.objectives``: the share of pairs the policy
#: prefers as the data does, and the mean reward margin) and a GRPO run's mean reward of its rollouts
STEP_CURVES = ("accuracy", "margin", "reward_mean")


def _spark_line(label: str, pts: list, spec: str) -> str:
    from toy.runs.reader import sparkline

    vals = [(s, v) for s, v in pts if v is not None]
    if not vals:
        return f"{label:<10} (no values)"
    lo = min(vals, key=lambda p: p[1])
    figs = f"first {vals[0][1]:{spec}} @{vals[0][0]}, last {vals[-1][1]:{spec}} @{vals[-1][0]}"
    figs += f", min {lo[1]:{spec}} @{lo[0]}"
    return f"{label:<10} {sparkline([v for _, v in pts], min(60, len(pts)))}  {figs}"


def _clip(text: Any) -> str:
    """Sample text on one line: JSON-escaped (newlines as \\n), at most 160 characters."""
    return json.dumps("" if text is None else str(text), ensure_ascii=False)[:160]


#: the diagnostics event kinds (toy.train.diagnostics), in the order `show` lists them
DIAG_KINDS = ("diag_grads", "diag_updates", "diag_drift", "diag_activations", "diag_nonfinite")


def _diagnostics(run) -> dict[str, dict]:
    """The last event of each diagnostics kind the run wrote."""
    out = {}
    for kind in DIAG_KINDS:
        evs = run.of(kind)
        if evs:
            out[kind] = evs[-1]
    return out


def _per_block(vals: Any, spec: str) -> str:
    """A per-block list on one line: the values, or their range and the largest block past 8 blocks."""
    if not isinstance(vals, list) or not vals:
        return "-"
    nums = [v for v in vals if isinstance(v, (int, float))]
    if len(vals) <= 8 or not nums:
        return " ".join(_num(v, spec) for v in vals)
    top = max(range(len(vals)), key=lambda i: vals[i] if isinstance(vals[i], (int, float)) else float("-inf"))
    return f"{_num(min(nums), spec)} .. {_num(max(nums), spec)} (largest: block {top})"


def _diag_lines(diag: dict[str, dict]) -> list[str]:
    lines = ["", "diagnostics (last of each kind; per block in block order)"]
    for kind, e in diag.items():
        name, at = kind.removeprefix("diag_"), f"@{e.get('step')}"
        if kind == "diag_grads":
            kinds = ", ".join(f"{k} {_num(v, '.3g')}" for k, v in (e.get("kinds") or {}).items())
            lines.append(f"  {name:<11} {at:>6}  norm total {_num(e.get('total'), '.3g')}; blocks ")
            lines[-1] += f"{_per_block(e.get('layers'), '.3g')}; by kind {kinds}"
        elif kind in ("diag_updates", "diag_drift"):
            extra = f" from {e.get('reference')}, total {_num(e.get('total'), '.3g')};" if kind == "diag_drift" else ""
            lines.append(f"  {name:<11} {at:>6} {extra} ratio per block {_per_block(e.get('layers'), '.3g')}")
        elif kind == "diag_activations":
            lines.append(f"  {name:<11} {at:>6}  rms {_per_block(e.get('rms'), '.3g')}")
            lines.append(f"  {'':<11} {'':>6}  max|x| {_per_block(e.get('max_abs'), '.3g')}")
        else:
            lines.append(f"  {name:<11} {at:>6}  {e.get('source')}: {e.get('tensor') or '-'} (block {e.get('block')})")
    return lines


def _show_text(r, curves: dict, samples: list, checkpoints: list, requests: dict | None) -> None:
    from toy.runs.reader import flatten

    s = r.start
    host = s.get("host", {}).get("name") if isinstance(s.get("host"), dict) else None
    lines = [f"{'run':<10} {r.id}", f"{'folder':<10} {r.dir}", f"{'kind':<10} {r.kind} ({r.model})"]
    at = f" at step {r.steps}" if r.steps is not None else ""
    lines.append(f"{'status':<10} {r.status}{at}")
    on = f" on {host}" if host else ""
    lines.append(f"{'started':<10} {r.started_at or '-'}{on}, wall {_dur(r.wall_s)}")
    lines.append(f"{'events':<10} {r.n_events}" + (f", {len(r.problems)} bad line(s)" if r.problems else ""))
    for key in ("model", "model_b", "data"):
        if isinstance(s.get(key), dict):
            pairs = [(k, v) for k, v in s[key].items() if k in SHOW_KEYS or key == "data"]
            lines.append(f"{key:<10} " + ", ".join(f"{k} {_short(v)}" for k, v in pairs))
    flat = {k: v for k, v in flatten(r.config).items() if v is not None}
    if flat:
        lines += ["", "config"] + [f"  {k} = {_short(v)}" for k, v in flat.items()]
    if curves["loss"]:
        lines += ["", _spark_line("loss", curves["loss"], ".4f"), _spark_line("lr", curves["lr"], ".3g")]
    for name, pts in curves["val"].items():
        lines.append(_spark_line(name, pts, ".4f"))
    for key in STEP_CURVES:  # a preference run's step metrics (toy.train.prefrun), GRPO's (toy.train.grpo)
        pts = [(e["step"], e[key]) for e in r.of("step") if isinstance(e.get(key), (int, float))]
        if pts:
            lines.append(_spark_line("reward" if key == "reward_mean" else key, pts, ".4f"))
    # GRPO's evaluations: the held-out prompts' mean reward (no loss)
    pts = [(e["step"], e["reward"]) for e in r.of("eval") if isinstance(e.get("reward"), (int, float))]
    if pts:
        lines.append(_spark_line("val reward", pts, ".4f"))
    typer.echo("\n".join(lines))
    evals = r.of("eval")
    if evals:
        typer.echo("\nevals")
        std = {"kind", "t", "step", "name", "loss", "ppl", "tokens"}
        rows = []
        for e in evals:
            extra = ", ".join(
                f"{k}={_num(v, '.4g') if isinstance(v, float) else _value(v)}" for k, v in e.items() if k not in std
            )
            name = _value(e.get("name", "-"))
            rows.append(
                [_num(e.get("step")), name, _num(e.get("loss")), _num(e.get("ppl"), ".2f"), _num(e.get("tokens"))]
            )
            rows[-1].append(extra)
        cols = [("STEP", {"justify": "right"}), ("NAME", {}), ("LOSS", {"justify": "right"})]
        cols += [("PPL", {"justify": "right"}), ("TOKENS", {"justify": "right"}), ("EXTRA", {"overflow": "fold"})]
        _table(cols, rows)
    out: list[str] = []
    if samples:
        out += ["", f"samples (last {len(samples)})"]
        for e in samples:
            out.append(f"  step {_num(e.get('step'))}: {_clip(e.get('prompt'))} -> {_clip(e.get('text'))}")
    if checkpoints:
        out += ["", "checkpoints"]
        for e in checkpoints:
            path = str(e.get("path", "?"))
            gone = "" if (r.dir / path).exists() else "  (no longer on disk)"
            out.append(f"  step {_num(e.get('step'))}  {path}{gone}")
    diag = _diagnostics(r)
    if diag:
        out += _diag_lines(diag)
    if requests:
        out += ["", "requests"]
        out.append(f"  {requests['count']} ({requests['ok']} ok, {requests['failed']} failed), ")
        out[-1] += f"median ttft {_num(requests['median_ttft_s'], '.3f')} s, "
        out[-1] += f"median {_num(requests['median_tok_s'], 'speed')} tok/s"
    if r.problems:
        out += ["", "problems"] + [f"  {p}" for p in r.problems]
    if out:
        typer.echo("\n".join(out))


@runs_app.command("show")
def show(
    run: Annotated[str, typer.Argument(metavar="RUN", help="A run folder, id or unique id prefix.")],
    samples: Annotated[int, typer.Option("--samples", min=0, help="Show the last this many samples.")] = 3,
    rollouts: Annotated[
        bool, typer.Option("--rollouts", help="A GRPO run: show a step's rollouts (rollouts.jsonl) instead.")
    ] = False,
    step: Annotated[
        int | None, typer.Option("--step", min=1, help="With --rollouts: this step's (default: the last).")
    ] = None,
    as_json: AsJson = False,
    runs_dir: RunsDir = None,
) -> None:
    """Show one run: summary, config, loss sparkline, evals, samples, checkpoints, problems."""
    if rollouts or step is not None:
        _show_rollouts(run, step, as_json, runs_dir)
        return
    from toy.runs.reader import loss_curve, lr_curve, val_curves

    (r,) = _load([run], runs_dir)
    curves = {"loss": loss_curve(r), "lr": lr_curve(r), "val": val_curves(r)}
    picked = r.of("sample")[-samples:] if samples else []
    checkpoints, requests = r.of("checkpoint"), _requests(r)
    if as_json:
        doc = {"run": r.to_dict(), "config": r.config, "start": {k: v for k, v in r.start.items() if k != "config"}}
        doc["curves"] = {"loss": curves["loss"], "lr": curves["lr"], "val": curves["val"]}
        doc.update(evals=r.of("eval"), samples=picked, checkpoints=checkpoints, requests=requests)
        doc["notes"] = r.of("note")
        doc["diagnostics"] = _diagnostics(r)
        typer.echo(json.dumps(doc, indent=2, ensure_ascii=False))
        return
    _show_text(r, curves, picked, checkpoints, requests)


# -- toy runs compare


@runs_app.command("compare")
def compare_cmd(runs: RunArgs, as_json: AsJson = False, runs_dir: RunsDir = None) -> None:
    """Compare runs: the config keys that differ, then the figures side by side with deltas against the first."""
    from toy.runs.reader import compare

    if len(runs) < 2:
        raise CLIError("compare needs two or more runs", "toy runs compare RUN_A RUN_B [RUN...]", 2)
    loaded = _load(runs, runs_dir)
    c = compare(loaded)
    if as_json:
        typer.echo(json.dumps(c, indent=2, ensure_ascii=False))
        return
    run_cols = [(rid, {"overflow": "fold"}) for rid in c["runs"]]
    if c["config"]:
        typer.echo(f"config differences ({len(c['config'])})")
        rows = [
            [d["key"], *(_value(v) if p else "(absent)" for v, p in zip(d["values"], d["present"]))]
            for d in c["config"]
        ]
        _table([("KEY", {})] + run_cols, rows)
    else:
        typer.echo("config: identical")
    typer.echo("\nfigures (delta against the first run)")
    rows = []
    for f in c["figures"]:
        spec = {"tokens_per_s": "speed", "wall_s": ".1f", "steps": "d"}.get(f["name"], ".4f")
        cells = []
        for i, (v, d) in enumerate(zip(f["values"], f["deltas"])):
            cell = _num(v, spec) if not isinstance(v, str) else v
            if i and d is not None:
                cell += f" ({'+' if d >= 0 else '-'}{_num(abs(d), spec)})"
            cells.append(cell)
        rows.append([f["name"], *cells])
    _table([("FIGURE", {})] + [(rid, {"justify": "right", "overflow": "fold"}) for rid in c["runs"]], rows)


# -- toy runs plot


@runs_app.command("plot")
def plot_cmd(
    runs: RunArgs,
    out: Annotated[Path, typer.Option("--out", "-o", help="The image to write (.png, .svg or .pdf).")],
    title: Annotated[str | None, typer.Option("--title", help="The figure's title.")] = None,
    log_loss: Annotated[bool, typer.Option("--log", help="Logarithmic loss axis.")] = False,
    diagnostics: Annotated[
        bool,
        typer.Option(
            "--diagnostics",
            help="Plot one run's training diagnostics (gradient norms, update ratios, drift, activation RMS "
            "per block) instead of its loss.",
        ),
    ] = False,
    as_json: AsJson = False,
    runs_dir: RunsDir = None,
) -> None:
    """Plot loss (training lines, validation markers) and learning rate of runs to an image (needs matplotlib: the plot extra)."""
    if diagnostics and len(runs) != 1:
        raise CLIError("--diagnostics plots one run", "toy runs plot RUN --diagnostics -o diag.png", 2)
    loaded = _load(runs, runs_dir)
    with cli_errors():
        from toy.runs.plot import plot_diagnostics, plot_runs

        if diagnostics:
            info = plot_diagnostics(loaded[0], out, title=title)
            info["skipped"] = []
        else:
            info = plot_runs(loaded, out, title=title, log_loss=log_loss)
    for rid in info["skipped"]:
        typer.echo(f"note: run {rid} has no step or eval events: not drawn", err=True)
    typer.echo(json.dumps(info, indent=2) if as_json else str(out))


# -- toy runs export


@runs_app.command("export")
def export_cmd(
    runs: RunArgs,
    to: Annotated[str, typer.Option("--to", metavar="LIST", help="tensorboard, mlflow or both (comma-separated).")],
    tensorboard_dir: Annotated[
        Path | None,
        typer.Option("--tensorboard-dir", help="Write each run to DIR/<run id> (default: <run folder>/tensorboard)."),
    ] = None,
    mlflow_uri: Annotated[
        str | None,
        typer.Option("--mlflow-uri", help="The MLflow tracking URI (default: sqlite:///<runs folder>/mlflow.db)."),
    ] = None,
    experiment: Annotated[str, typer.Option("--experiment", help="The MLflow experiment.")] = "toy",
    replace: Annotated[
        bool, typer.Option("--replace", help="Write a run again that was exported (or mirrored) before.")
    ] = False,
    as_json: AsJson = False,
    runs_dir: RunsDir = None,
) -> None:
    """Write finished (or running) runs to TensorBoard event files or MLflow, as --report-to does live (needs the tensorboard or mlflow extra)."""
    backends = [b.strip() for b in to.split(",") if b.strip()]
    if not backends or len(set(backends)) != len(backends) or any(b not in ("tensorboard", "mlflow") for b in backends):
        raise CLIError(f"--to {to!r}: tensorboard, mlflow or both, once each", "e.g. --to tensorboard,mlflow", 2)
    loaded = _load(runs, runs_dir)
    done = []
    with cli_errors():
        from toy.runs.report import check_available, export_run

        check_available(backends)
        for r in loaded:
            done.append(
                export_run(
                    r.dir,
                    backends,
                    tensorboard_dir=tensorboard_dir,
                    mlflow_uri=mlflow_uri,
                    mlflow_experiment=experiment,
                    replace=replace,
                )
            )
    if as_json:
        typer.echo(json.dumps(done, indent=2))
        return
    for d in done:
        where = ", ".join(f"{b} {d[b]}" for b in backends)
        typer.echo(f"{d['run']}: {d['events']} events -> {where}")


# -- toy runs show --rollouts (GRPO)


def _show_rollouts(run: str, step: int | None, as_json: bool, runs_dir: Path | None) -> None:
    """The completions a GRPO run sampled for one optimizer step (``toy.train.grpo``'s ``rollouts.jsonl``):
    prompt, completion, rewards, advantage, how it ended, and any reward's error; by default the last step
    that made rollouts. A rollout batch trained for several steps (``grpo.iterations``) is shown under the
    first."""
    from toy.runs.reader import resolve_run

    with cli_errors():
        folder = resolve_run(run, _root(runs_dir))
    from toy.train.grpo import ROLLOUTS, read_rollouts  # imports the engine: only for this view

    recs = read_rollouts(folder)
    if not recs:
        raise CLIError(f"{folder}: no {ROLLOUTS} (rollouts are written by GRPO runs)", None, 2)
    steps = sorted({r["step"] for r in recs if isinstance(r.get("step"), int)})
    # a step without rollouts of its own trained on the latest batch made before it (grpo.iterations > 1)
    pick = steps[-1] if step is None else max((s for s in steps if s <= step), default=None)
    shown = sorted((r for r in recs if r.get("step") == pick), key=lambda r: r.get("row", 0))
    if not shown:
        raise CLIError(f"{folder}: no rollouts at step {step}", f"steps with rollouts: {_ranges(steps)}", 2)
    if as_json:
        typer.echo(json.dumps({"run": folder.name, "step": pick, "rollouts": shown}, indent=2, ensure_ascii=False))
        return
    rewards = [x for x in (r.get("reward") for r in shown) if isinstance(x, (int, float))]
    mean = f", mean reward {_num(sum(rewards) / len(rewards))}" if rewards else ""
    made = f"step {pick}" if step in (None, pick) else f"step {step} (rollouts made for step {pick})"
    typer.echo(f"run {folder.name}: {made}, {len(shown)} completions (rollout {shown[0].get('rollout')}){mean}")
    prompt = None
    for r in shown:
        if r.get("prompt_index") != prompt:
            prompt = r.get("prompt_index")
            typer.echo(f"\nprompt {_clip(r.get('prompt'))} ({r.get('source')}:{r.get('line')})")
        per = ", ".join(
            f"{k}={_num(v, '.3g') if isinstance(v, (int, float)) else 'none'}" for k, v in r["rewards"].items()
        )
        typer.echo(
            f"  [{r.get('sample')}] reward {_num(r.get('reward'), '.3g')} (adv {_num(r.get('advantage'), '+.3f')}; {per})"
            f" {r.get('tokens')} tokens, {r.get('finish')}: {_clip(r.get('completion'))}"
        )
        for e in r.get("errors") or ():
            typer.echo(f"      error in {e.get('reward')}: {e.get('error')}")


def _ranges(steps: list[int]) -> str:
    """[1, 3, 5, 7] -> "1, 3, 5, 7"; long lists shortened to the first and last few."""
    text = [str(s) for s in steps]
    return ", ".join(text if len(text) <= 8 else [*text[:3], "...", *text[-3:]])


def register(app: typer.Typer) -> None:
    app.add_typer(runs_app, name="runs")
