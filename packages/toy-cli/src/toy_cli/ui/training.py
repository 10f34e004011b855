"""How a training command runs: progress, stop signals, errors and the summary.

``run_training(fn, quiet, as_json)`` is what ``toy train`` does around a
run, public so that other distributions' training commands behave the same
(``toy vit train``): ``fn(hooks)`` is the run (``toy.train.lmrun.train``,
``resume`` or a plugin's own) and returns its ``RunResult``.

Invariants:

- Progress (step, loss, a GRPO run's mean reward, lr, the step unit's rate:
  tok/s, or img/s for an image classifier's run, ETA) goes to stderr: a rich bar on a terminal, one
  line every few seconds otherwise; nothing with ``quiet``. The ETA counts
  the evaluations still to come (``evals_left`` times the last one's
  ``eval_s``). Set-up phases (tokenizing, decoding images) and the step-0
  evaluation get a bar of their own on a terminal; otherwise the step-0
  evaluation prints a line when it starts, every few seconds and when it
  ends, and the other phases a line every few seconds once they have run
  for 5 s.
- On stdout at the end: the run folder's path, or with ``as_json`` a JSON
  summary (a classifier run adds its final ``val_accuracy`` and
  ``val_top5``).
- The first Ctrl-C (SIGINT) or SIGTERM asks the run to stop after the
  current step (it saves a checkpoint and ends "interrupted"); the command
  then exits 130 after SIGINT, 0 after SIGTERM. A stop before the first
  step saves nothing (nothing was trained) and says so. A second signal
  during the stop is ignored with a line (it must not lose the checkpoint
  being written: ``timeout -s INT`` delivers its signal twice, to the
  process and to its group); a third aborts at once (``KeyboardInterrupt``):
  an ``error:`` line says at which step, which checkpoint is left (a
  checkpoint being written is removed, so ``latest`` stays complete) and
  how to go on, and the command exits 130.
- One of several MPI ranks other than rank 0 (``mpiexec -n N toy train``,
  ``--ranks N``) prints no progress, stop lines or summary: rank 0 speaks
  for the run. A rank that fails (an error, or the abort of a third signal)
  prints its ``error:`` lines, then ends every rank at once with
  ``MPI_Abort`` and its exit code: an ordinary exit would leave the others
  waiting for it until their communication timeout (hydra ends the other
  ranks only when one dies of a signal), and MPI's finalization would wait
  for them too. The stops that every rank agrees on (the step after a
  signal, the end) exit normally. An error of MPI itself (a peer died)
  waits ``MPI_FAILURE_WAIT`` seconds first: when the peer died of a signal,
  hydra ends every rank and says so, and ``toy train --ranks`` then names
  the lost rank rather than this one's MPI error.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

import typer

from toy_cli.ui.errors import cli_errors, handle_error
from toy_cli.ui.progress import start_bar

if TYPE_CHECKING:
    from rich.progress import Progress as RichProgress
    from rich.progress import TaskID

_UNITS = {"tokens": "tok", "images": "img"}  # short names of the step units in progress lines
ABORT_RELAY_WAIT = 0.5  # seconds between a rank's last error line and its MPI_Abort (``_abort_ranks``)
MPI_FAILURE_WAIT = 2.0  # seconds a rank whose MPI call failed waits for the launcher to end it, before MPI_Abort


@contextmanager
def stop_signals(quiet: bool = False) -> Iterator[dict]:
    """Yield a dict whose "signal" is set by the first SIGINT/SIGTERM (and
    "count" counts them); the second is ignored with a line, the third
    raises KeyboardInterrupt (the module docstring). ``quiet``: without the
    lines."""
    state: dict = {"signal": None, "count": 0}

    def handler(signum, _frame):
        state["count"] += 1
        if state["count"] == 1:
            state["signal"] = signum
            if not quiet:
                print("\nstopping after this step (saving a checkpoint)...", file=sys.stderr)
        elif state["count"] == 2 and not quiet:
            print(
                "\nstopping: finishing the step and writing its checkpoint; press Ctrl-C again to abort without it",
                file=sys.stderr,
            )
        else:
            raise KeyboardInterrupt

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
        self.step_s: list[float] = []  # this process's step times (a resumed run starts later)
        self.phase_times: dict[str, tuple[float, float | None]] = {}  # label -> (start, last line printed)

    def _ensure(self):
        if self.bar is None and self.tty and not self.quiet:
            from rich.progress import BarColumn, MofNCompleteColumn, TextColumn

            self.bar = start_bar(
                TextColumn("[bold]{task.description}"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("{task.fields[info]}"),
                TextColumn("{task.fields[eta]}"),
                transient=False,
            )
        return self.bar

    def phase(self, label: str, done: int, total: int) -> None:
        """A preparation phase (tokenizing, caching, ...) or the step-0
        evaluation: a bar of its own on a terminal, else lines (the module docstring)."""
        if self.quiet:
            return
        from toy.train.steploop import EVAL_AT_START  # lazy: toy --help does not load toy.train

        now = time.monotonic()
        start, last = self.phase_times.setdefault(label, (now, None))
        left = (now - start) / done * (total - done) if done and total else None
        bar = self._ensure()
        if bar is not None:
            if label not in self.phases:
                self.phases[label] = bar.add_task(label, total=total or None, info="", eta="")
            bar.update(self.phases[label], completed=done, total=total or None, eta=_eta(left))
            return
        is_eval = label == EVAL_AT_START
        if last is None:
            due = is_eval or now - start >= 5
        else:
            due = now - last >= 5 or done == total
        if due:
            self.phase_times[label] = (start, now)
            unit = " batches" if is_eval else ""
            print(f"{label}: {done}/{total}{unit}{_eta(left, ' eta ')}", file=sys.stderr)

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
        if isinstance(ev.get("reward_mean"), (int, float)):  # GRPO: its surrogate loss is ~0; the reward is the figure
            info = f"loss {ev['loss']:.4f} reward {ev['reward_mean']:.3f} lr {ev['lr']:.2e}{rate}"
        if "wall_us" in ev:
            self.step_s.append(ev["wall_us"] / 1e6)
        left = None
        if len(self.step_s) > 1:  # the first step also builds the graphs
            pace = sum(self.step_s[1:]) / (len(self.step_s) - 1)
            left = (ev["total"] - ev["step"]) * pace + (ev.get("eval_s") or 0.0) * (ev.get("evals_left") or 0)
        bar = self._ensure()
        if bar is not None:
            if self.task is None:
                self.task = bar.add_task("train", total=ev["total"], info=info, eta="")
            bar.update(self.task, completed=ev["step"], info=info, eta=_eta(left))
            return
        now = time.monotonic()
        if now - self.last_line >= 5 or ev["step"] == ev["total"]:
            self.last_line = now
            print(f"step {ev['step']}/{ev['total']} {info}{_eta(left, ' eta ')}", file=sys.stderr)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.stop()
            self.bar = None


def _eta(seconds: float | None, prefix: str = "") -> str:
    """``prefix`` and m:ss (h:mm:ss from an hour), or "" when unknown."""
    if seconds is None:
        return ""
    s = int(seconds + 0.5)
    text = f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}" if s >= 3600 else f"{s // 60}:{s % 60:02d}"
    return prefix + text


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


def _summary(result, as_json: bool, quiet: bool, command: str) -> None:
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
        if not quiet and result.reason == "interrupted" and result.checkpoint is None:
            print(
                "interrupted before the first step: nothing was trained, nothing needs resuming "
                "(run the command again to start over)",
                file=sys.stderr,
            )
        elif not quiet:
            loss = f"{result.final_loss:.4f}" if result.final_loss is not None else "-"
            acc = metrics.get("val_accuracy")
            print(
                f"{result.reason} at step {result.final_step}: loss {loss}"
                + (f", validation loss {result.val_loss:.4f}" if result.val_loss is not None else "")
                + (f", validation accuracy {100 * acc:.2f}%" if acc is not None else "")
                + (f"; checkpoint {result.checkpoint}" if result.checkpoint else ""),
                file=sys.stderr,
            )
            if result.reason == "interrupted":
                print(f"resume: {command} --resume {result.run_dir}", file=sys.stderr)


def _finish(result, as_json: bool, sig, quiet: bool = False, command: str = "toy train", silent: bool = False) -> None:
    """The summary (``silent``: none, the exit code only)."""
    if not silent:
        _summary(result, as_json, quiet, command)
    if result.reason == "interrupted" and sig == signal.SIGINT:
        raise typer.Exit(130)


def _report_abort(e: KeyboardInterrupt, command: str) -> None:
    """The ``error:``/``hint:`` lines of a run aborted by a third signal."""
    from toy.train.steploop import TrainingAborted  # lazy: toy --help does not load toy.train

    if not isinstance(e, TrainingAborted):  # during set-up: no run folder yet
        print("error: aborted before the first step: nothing was trained, nothing needs resuming", file=sys.stderr)
        return
    if e.checkpoint is not None:
        print(f"error: aborted at step {e.step} without saving it; the last checkpoint is {e.checkpoint}",
              file=sys.stderr)  # fmt: skip
        print(f"hint: go on from it: {command} --resume {e.run_dir}", file=sys.stderr)
    else:
        print(f"error: aborted at step {e.step}, before the run's first checkpoint: nothing to resume",
              file=sys.stderr)  # fmt: skip
        print(f"hint: run the command again to start over ({e.run_dir} can be deleted)", file=sys.stderr)


def run_training(
    fn: Callable, quiet: bool, as_json: bool, command: str = "toy train", ranks: int | None = None
) -> None:
    """Run ``fn(hooks)`` (a training run returning its ``RunResult``) with the
    progress display, the stop signals and toy's errors as CLI errors, then
    print the summary as ``toy train`` does (see the module docstring);
    ``command`` is what the hints name to resume (``toy vit train``).
    ``ranks``: a ``--ranks N`` flag's value; N > 1 runs this command line as
    N MPI ranks instead (``toy_cli.ranks``) and ends the command with their
    exit code."""
    if ranks is not None:
        from toy_cli.ranks import run_ranks

        run_ranks(ranks, command)
    from toy.train.distributed import launched_rank, launched_size
    from toy.train.lmrun import Hooks

    several = launched_size() > 1
    follower = launched_rank() > 0  # rank 0 speaks for the run (the module docstring)
    quiet = quiet or follower
    bar = TrainingProgress(quiet)
    try:
        with cli_errors(), stop_signals(follower) as st:
            hooks = Hooks(
                progress=bar.progress, note=bar.note, should_stop=lambda: st["signal"] is not None, phase=bar.phase
            )
            try:
                result = fn(hooks)
            except KeyboardInterrupt as e:  # a third signal (or one before the handlers were installed)
                bar.close()
                if not follower:
                    _report_abort(e, command)
                if several:
                    _abort_ranks(130)
                raise typer.Exit(130) from None
            finally:
                bar.close()
    except Exception as e:
        mpi = sys.modules.get("mpi4py.MPI")
        if several and mpi is not None and not isinstance(e, (typer.Exit, SystemExit)):
            if isinstance(e, mpi.Exception):  # MPI itself failed: most often a peer died of a signal; hydra
                time.sleep(MPI_FAILURE_WAIT)  # then ends this rank too and names the dead one (toy_cli.ranks)
            _abort_ranks(handle_error(e))  # the error's lines, then every rank ends
        raise
    _finish(result, as_json, st["signal"], quiet, command, silent=follower)


def _abort_ranks(code: int) -> None:
    """End every rank of this MPI run now with ``code`` (``MPI_Abort``), after
    flushing what this one printed; nothing when MPI was never loaded (the
    failure came before the ranks met: each ends on its own)."""
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is None:
        return
    sys.stdout.flush()
    sys.stderr.flush()
    # the launcher relays a rank's output through pipes and stops relaying once the job aborts: give it a
    # moment to pass on the lines just written (measured: without it they were lost in 1 run of 8)
    time.sleep(ABORT_RELAY_WAIT)
    mpi.COMM_WORLD.Abort(code)
    os._exit(code)  # MPICH's MPI_Abort may return once it has told the launcher: nothing more to run or print
