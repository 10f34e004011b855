"""How a training command runs: progress, stop signals, errors and the summary.

``run_training(fn, quiet, as_json)`` is what ``toy train`` does around a
run, public so that other distributions' training commands behave the same
(``toy vit train``): ``fn(hooks)`` is the run (``toy.train.lmrun.train``,
``resume`` or a plugin's own) and returns its ``RunResult``.

Invariants:

- Progress (step, loss, lr, the step unit's rate: tok/s, or img/s for an
  image classifier's run, ETA) goes to stderr: a rich bar on a terminal, one
  line every few seconds otherwise; nothing with ``quiet``.
- On stdout at the end: the run folder's path, or with ``as_json`` a JSON
  summary (a classifier run adds its final ``val_accuracy`` and
  ``val_top5``).
- The first Ctrl-C (SIGINT) or SIGTERM asks the run to stop after the
  current step (it saves a checkpoint and ends "interrupted"); the command
  then exits 130 after SIGINT, 0 after SIGTERM. A second Ctrl-C raises
  ``KeyboardInterrupt`` at once.
"""

from __future__ import annotations

import json
import signal
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

import typer

from toy_cli.ui.errors import cli_errors
from toy_cli.ui.progress import start_bar

if TYPE_CHECKING:
    from rich.progress import Progress as RichProgress
    from rich.progress import TaskID

_UNITS = {"tokens": "tok", "images": "img"}  # short names of the step units in progress lines


@contextmanager
def stop_signals() -> Iterator[dict]:
    """Yield a dict whose "signal" is set by the first SIGINT/SIGTERM; a
    second SIGINT raises KeyboardInterrupt."""
    state: dict = {"signal": None}

    def handler(signum, _frame):
        if state["signal"] is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt
        state["signal"] = signum
        print("\nstopping after this step (saving a checkpoint)...", file=sys.stderr)

    old = {s: signal.signal(s, handler) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield state
    finally:
        for s, h in old.items():
            signal.signal(s, h)


class TrainingProgress:
    """A training run's progress on stderr: the ``progress``, ``note`` and
    ``phase`` hooks of ``toy.train.lmrun.Hooks``."""

    def __init__(self, quiet: bool):
        self.quiet = quiet
        self.tty = sys.stderr.isatty()
        self.bar: RichProgress | None = None
        self.task: TaskID | None = None
        self.phases: dict[str, TaskID] = {}
        self.last_line = 0.0
        self.first: tuple[float, int] | None = None  # (time, step) of the first step seen

    def _ensure(self):
        if self.bar is None and self.tty and not self.quiet:
            from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeRemainingColumn

            self.bar = start_bar(
                TextColumn("[bold]{task.description}"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("{task.fields[info]}"),
                TimeRemainingColumn(),
                transient=False,
            )
        return self.bar

    def phase(self, label: str, done: int, total: int) -> None:
        """A preparation phase (tokenizing, caching, ...): a bar of its own on a terminal."""
        bar = self._ensure()
        if bar is None:
            return
        if label not in self.phases:
            self.phases[label] = bar.add_task(label, total=total or None, info="")
        bar.update(self.phases[label], completed=done, total=total or None)

    def note(self, text: str) -> None:
        if self.quiet:
            return
        bar = self._ensure()
        if bar is not None:
            bar.console.print(text)
        else:
            print(text, file=sys.stderr)

    def progress(self, ev: dict) -> None:
        """A step event: the bar on a terminal, else a line every 5 s (and at the last step)."""
        if self.quiet:
            return
        # a step event counts its task's unit: tokens (tokens_per_s), images (images_per_s), ...
        unit = next((k[: -len("_per_s")] for k in ev if k.endswith("_per_s")), None)
        rate = f" {ev[f'{unit}_per_s']:,.0f} {_UNITS.get(unit, unit)}/s" if unit else ""
        info = f"loss {ev['loss']:.4f} lr {ev['lr']:.2e}{rate}"
        bar = self._ensure()
        if bar is not None:
            if self.task is None:
                self.task = bar.add_task("train", total=ev["total"], info=info)
            bar.update(self.task, completed=ev["step"], info=info)
            return
        now = time.monotonic()
        if self.first is None:
            self.first = (now, ev["step"])
        if now - self.last_line >= 5 or ev["step"] == ev["total"]:
            self.last_line = now
            t0, s0 = self.first
            eta = ""
            if ev["step"] > s0:  # from this process's own pace (a resumed run starts later)
                left = (ev["total"] - ev["step"]) * (now - t0) / (ev["step"] - s0)
                eta = f" eta {int(left // 60)}:{int(left % 60):02d}"
            print(f"step {ev['step']}/{ev['total']} {info}{eta}", file=sys.stderr)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.stop()
            self.bar = None


def _val_metrics(result) -> dict:
    """``val_accuracy`` / ``val_top5`` of a classifier run: its last "val"
    eval event, when it is at the final step (read from the end of
    events.jsonl); {} for a language-model run or when there is none."""
    if result.val_loss is None:
        return {}
    try:
        with open(Path(result.run_dir) / "events.jsonl", "rb") as f:
            f.seek(0, 2)
            f.seek(max(0, f.tell() - 65536))
            lines = f.read().splitlines()
    except OSError:
        return {}
    for line in reversed(lines):
        try:
            ev = json.loads(line)
        except ValueError:
            continue
        if isinstance(ev, dict) and ev.get("kind") == "eval" and ev.get("name") == "val":
            if ev.get("step") != result.final_step:
                return {}
            return {f"val_{k}": ev[k] for k in ("accuracy", "top5") if isinstance(ev.get(k), (int, float))}
    return {}


def _finish(result, as_json: bool, sig, quiet: bool = False) -> None:
    metrics = _val_metrics(result)
    if as_json:
        typer.echo(
            json.dumps(
                {
                    "run_id": result.run_id,
                    "run_dir": str(result.run_dir),
                    "reason": result.reason,
                    "final_step": result.final_step,
                    "final_loss": result.final_loss,
                    "val_loss": result.val_loss,
                    **metrics,
                    "checkpoint": str(result.checkpoint) if result.checkpoint else None,
                }
            )
        )
    else:
        typer.echo(str(result.run_dir))
        if not quiet:
            loss = f"{result.final_loss:.4f}" if result.final_loss is not None else "-"
            acc = metrics.get("val_accuracy")
            print(
                f"{result.reason} at step {result.final_step}: loss {loss}"
                + (f", validation loss {result.val_loss:.4f}" if result.val_loss is not None else "")
                + (f", validation accuracy {100 * acc:.2f}%" if acc is not None else "")
                + (f"; checkpoint {result.checkpoint}" if result.checkpoint else ""),
                file=sys.stderr,
            )
    if result.reason == "interrupted" and sig == signal.SIGINT:
        raise typer.Exit(130)


def run_training(fn: Callable, quiet: bool, as_json: bool) -> None:
    """Run ``fn(hooks)`` (a training run returning its ``RunResult``) with the
    progress display, the stop signals and toy's errors as CLI errors, then
    print the summary as ``toy train`` does (see the module docstring)."""
    from toy.train.lmrun import Hooks

    bar = TrainingProgress(quiet)
    with cli_errors(), stop_signals() as st:
        hooks = Hooks(
            progress=bar.progress, note=bar.note, should_stop=lambda: st["signal"] is not None, phase=bar.phase
        )
        try:
            result = fn(hooks)
        finally:
            bar.close()
    _finish(result, as_json, st["signal"], quiet)
