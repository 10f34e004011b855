"""The step loop every training task shares: steps, events, evals,
checkpoints, stopping, errors, and reopening a run to resume it.

A task (the language-model runs of ``toy.train.lmrun``; toy-vit's image
classifier) subclasses ``StepRun`` and sets up, in its ``__init__``:

- ``cfg``: an object with ``steps``, ``grad_accum``, ``eval_every``,
  ``save_every``, ``sample_every`` (0: with each checkpoint),
  ``keep_checkpoints`` and ``optim`` (``toy.train.optim.OptimConfig``);
- ``hooks`` (``Hooks``), ``runtime``, ``engine`` (``TrainEngine``),
  ``stream`` (``next()`` a micro-batch, ``epoch``, ``state()``), ``writer``
  (``toy.runs.RunWriter``), ``lock`` (``RunLock`` or None), ``ckpt_dir``,
  ``last_ckpt`` and ``saved_step`` (``init_counters``);
- ``unit`` (what a step's ``per_step`` counts: "tokens", "images") and
  ``per_step``; the step events carry ``<unit>`` (seen so far) and
  ``<unit>_per_s``;

and implements ``evaluate()``, ``sample()``, ``state()`` (what resuming
needs besides weights and moments: config, data cursor, RNG, counters) and
``checkpoint_kwargs()`` (the ``toy.train.checkpoint.save`` arguments that
say how the model file is written). ``close()`` frees what it set up
(the engine, the runtime, and anything more it overrides).

``run()`` is the loop (its contract is ``toy.train.lmrun``'s docstring:
stop polling, divergence, the final eval and checkpoint, ``run_end`` with
completed | interrupted | errored, an OSError as ``TrainingIOError`` naming
the file and the last good checkpoint).

Stopping and aborting (decisions):

- A stop asked for before the first step (during set-up or the step-0
  evaluation) ends the run "interrupted" at step 0 without a checkpoint:
  nothing was trained, so there is nothing to resume (a step-0 checkpoint
  would be the starting point again). ``open_for_resume`` then says so.
  The exception is a task whose set-up made something that costs time to
  make again (``keep_step0``: a from-scratch run's trained tokenizer): it
  writes a step-0 checkpoint, which ``--resume`` starts from.
- The step-0 evaluation reports its batches through ``hooks.phase`` (label
  ``EVAL_AT_START``) and polls ``should_stop`` between them: a task's
  ``evaluate()`` calls ``eval_progress(done, total)`` after each batch.
- A ``KeyboardInterrupt`` (the CLI raises it on a third signal, or a
  library caller's Ctrl-C) ends the run at once: ``run_end`` "interrupted"
  and ``TrainingAborted`` (a ``KeyboardInterrupt``) carrying the run folder,
  the step reached and the last checkpoint, if any. A checkpoint being
  written is removed (``checkpoint.save``: temporary files renamed into
  place), so ``latest`` names the previous complete one.
- Progress events carry ``eval_s`` (the last evaluation's seconds) and
  ``evals_left`` (evaluations still to come, the final one included), so a
  display can count evaluations in its ETA.

Several ranks (``world``, ``toy.train.distributed``): every rank runs
this loop on the same data (a step draws ``grad_accum * ranks``
micro-batches; the engine computes this rank's block), evaluates and
samples the same way; rank 0 alone writes (the task gives the other ranks
a ``RankWriter``). A stop asked for on any rank (a signal reaches every
rank through ``mpiexec``) is agreed on after each step, so every rank
stops after the same one; a checkpoint gathers the optimizer moments from
their owners and rank 0 writes it (its success or error is sent to every
rank). Step events add ``comm_s`` (rank 0's seconds communicating),
``sent_bytes``, and ``rank_s_max`` / ``rank_s_min`` (the slowest and
fastest rank's compute seconds).

``open_for_resume(run_dir)`` takes a run's lock, removes orphaned
temporary files, finds the newest intact checkpoint (setting damaged ones
aside) and returns them with the notes to record; a task's ``resume``
builds its run from that.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from toy.errors import ToyError
from toy.runs.folder import RunLock
from toy.runs.reader import read_events
from toy.train import checkpoint
from toy.train.distributed import CommTimeoutError, RankWriter, World, announce
from toy.train.optim import lr_at

if TYPE_CHECKING:
    import toy_ggml
    from toy.runs import RunWriter
    from toy.train.diagnostics import Diagnostics
    from toy.train.stepgraph import TrainEngine


class TrainingDivergedError(ToyError):
    """The loss became NaN or infinite."""


class TrainingIOError(ToyError):
    """A file of the run could not be written (a full disk, a removed
    folder): the message names it and the last good checkpoint."""


def bundle_error(e: OSError, reopening: bool, where) -> TrainingIOError:
    """The error of a run whose bundle (``config.json``, ``events.jsonl``)
    could not be created or reopened: the run did not start."""
    return TrainingIOError(
        f"could not {'reopen' if reopening else 'create'} the run bundle ({where}): {e.strerror or e}; "
        "the run did not start",
        hint="free some space (or fix the folder) and try again",
    )


class TrainingAborted(KeyboardInterrupt):
    """A run ended at once by a ``KeyboardInterrupt``: ``run_dir``, ``step``
    (the steps done) and ``checkpoint`` (the last complete one, or None)."""

    def __init__(self, run_dir: Path, step: int, checkpoint: Path | None):
        super().__init__(f"aborted at step {step}")
        self.run_dir, self.step, self.checkpoint = run_dir, step, checkpoint


class _StopDuringEval(Exception):
    """should_stop() said yes during the step-0 evaluation."""


#: the ``hooks.phase`` label of the evaluation before the first step
EVAL_AT_START = "evaluating the validation set before training"


@dataclass
class Hooks:
    """Callbacks of a run (all optional). ``progress(info)`` after every step
    with the step event's fields plus ``total``; ``note(text)`` for log
    lines (tokenizer training, token cache, checkpoints, evals);
    ``should_stop()`` polled after every step; ``phase(label, done, total)``
    for the long set-up work (tokenizer training, tokenizing the corpus)."""

    progress: Callable[[dict[str, Any]], None] | None = None
    note: Callable[[str], None] | None = None
    should_stop: Callable[[], bool] | None = None
    phase: Callable[[str, int, int], None] | None = None


@dataclass
class RunResult:
    run_id: str
    run_dir: Path
    reason: str
    final_step: int
    final_loss: float | None
    val_loss: float | None
    checkpoint: Path | None


class StepRun:
    unit = "tokens"
    per_step = 0
    eval_at_start = False  # fine-tunes: the base model's validation loss at step 0
    keep_step0 = False  # set-up made something worth keeping (a trained tokenizer): a stop at step 0 still saves
    # what the loop reads, set by the task's __init__
    cfg: Any  # the task's training config (steps, grad_accum, keep_checkpoints, optim, ...)
    hooks: Hooks
    lock: RunLock | None
    runtime: toy_ggml.Runtime
    engine: TrainEngine
    stream: Any  # the batch stream: next() and epoch
    seen: int  # units (``unit``) trained on so far
    writer: RunWriter
    diagnostics: Diagnostics | None = None  # toy.train.diagnostics (set by a task that has any)
    world: World = World()  # the ranks (a task sets its own; this one is the one-process world)

    def init_counters(self, ckpt: checkpoint.Resumable | None) -> None:
        self.ckpt_dir = self.writer.dir / "checkpoints"
        self.last_loss: float | None = None
        self.last_val: float | None = None
        self.last_ckpt: Path | None = ckpt.model_path if ckpt else None
        self.saved_step = ckpt.step if ckpt else -1
        self._eval_label: str | None = None  # set while the step-0 evaluation runs
        self._eval_s: float | None = None  # the last evaluation's seconds

    def eval_progress(self, done: int, total: int) -> None:
        """Called by ``evaluate()`` after each batch: the step-0 evaluation's
        progress (``hooks.phase``) and a stop asked for during it."""
        if self._eval_label is None:
            return
        if self.hooks.phase:
            self.hooks.phase(self._eval_label, done, total)
        if self._stop_asked():
            raise _StopDuringEval

    def _stop_asked(self) -> bool:
        """Whether a stop was asked for (on any rank: the ranks agree)."""
        asked = bool(self.hooks.should_stop and self.hooks.should_stop())
        return self.world.any(asked) if self.world.distributed else asked

    def _timed_eval(self) -> None:
        t0 = time.perf_counter()
        self.evaluate()
        self._eval_s = time.perf_counter() - t0

    def _evals_left(self, step: int) -> int:
        """Evaluations after ``step``: every ``eval_every`` before the last step, then the final one."""
        every, total = self.cfg.eval_every, self.cfg.steps
        between = (total - 1) // every - step // every if every and step < total else 0
        return max(0, between) + 1

    # -------------------------------------------------------------- the task's part

    def evaluate(self) -> float | None:
        raise NotImplementedError

    def sample(self) -> None:
        pass

    def state(self) -> dict[str, Any]:
        raise NotImplementedError

    def checkpoint_kwargs(self) -> dict[str, Any]:
        raise NotImplementedError

    def close(self) -> None:
        self.engine.close()
        self.runtime.close()

    def notes(self, texts) -> None:
        """Each text as a ``note`` event of the run, and shown (``hooks.note``)."""
        for text in texts:
            self.writer.event("note", text=text)
            if self.hooks.note:
                self.hooks.note(text)

    def share_run_folder(self) -> None:
        """Several ranks, once rank 0 has made (or reopened) the run folder,
        or failed to (no ``writer``): every other rank gets a ``RankWriter``
        of the same folder, and rank 0 records the ranks' pids
        (``announce``). Called by every rank; a task calls it after its
        writer is set up, and rank 0 also when that failed."""
        world = self.world
        if not world.distributed:
            return
        writer = getattr(self, "writer", None)
        said = world.bcast(
            (str(writer.dir), writer.run_id) if world.is_root and writer is not None else None,
            what="waiting for rank 0 to open the run folder",
        )
        if said is None:
            if world.is_root:
                return  # rank 0 failed: its own error is the one it reports
            raise TrainingIOError("rank 0 could not open the run folder; it reports why")
        if not world.is_root:
            self.writer = RankWriter(*said)  # type: ignore[assignment]
        announce(world, self.writer.dir)

    # -------------------------------------------------------------- checkpoints

    def save(self) -> None:
        step = self.engine.step
        if step == self.saved_step:
            return
        optimizer = self.engine.optimizer_state()  # several ranks: a collective (the moments' owners)
        world = self.world
        path: Path | None = None
        failed: BaseException | None = None
        if world.is_root:
            try:
                path = checkpoint.save(  # CheckpointWriteError: run() adds the last good checkpoint
                    self.ckpt_dir,
                    step=step,
                    params=self.engine.param_values(),
                    optimizer=optimizer,
                    state=self.state(),
                    run_id=self.writer.run_id,
                    keep=self.cfg.keep_checkpoints,
                    **self.checkpoint_kwargs(),
                )
            except BaseException as e:
                failed = e
        if world.distributed:  # rank 0's outcome, to every rank
            said = world.bcast(
                str(path) if failed is None else f"!{failed}", what=f"waiting for rank 0 to write checkpoint {step}"
            )
            if failed is None and said.startswith("!"):
                raise checkpoint.CheckpointWriteError(
                    f"rank 0 could not write the checkpoint of step {step}: {said[1:]}", self.ckpt_dir, step
                )
            path = Path(said) if failed is None else None
        if failed is not None:
            raise failed
        assert path is not None
        self.saved_step = step
        self.last_ckpt = path
        self.writer.event("checkpoint", step=step, path=str(path.relative_to(self.writer.dir)))
        if self.hooks.note:
            self.hooks.note(f"step {step}: checkpoint {path}")

    def _io_error(self, e: BaseException) -> TrainingIOError | None:
        """An OSError (or a failed checkpoint write) as the error to report:
        what could not be written, and what is left to resume from."""
        if isinstance(e, checkpoint.CheckpointWriteError):
            what = str(e)
        elif isinstance(e, OSError) and not isinstance(e, (BlockingIOError, InterruptedError)):
            where = e.filename if e.filename else f"the run's files in {self.writer.dir}"
            what = f"could not write {where}: {e.strerror or e}"
        else:
            return None
        return self._with_checkpoint(TrainingIOError, what, "free some space (or fix the folder)")

    def _lost_rank(self, e: BaseException) -> CommTimeoutError | None:
        """A rank that stopped answering, as the error to report: which one,
        and the last good checkpoint to resume from."""
        if not isinstance(e, CommTimeoutError):
            return None
        return self._with_checkpoint(CommTimeoutError, str(e), "once every rank can run again")

    def _with_checkpoint(self, cls, what: str, fix: str):
        """``cls(what + where the run can go on from)``, with a hint that
        says to ``fix`` it, then resume (or start again: no checkpoint yet)."""
        if self.last_ckpt is not None and self.saved_step >= 0:
            return cls(
                f"{what}; the last good checkpoint is step_{self.saved_step} ({self.last_ckpt})",
                hint=f"{fix}, then go on from it: toy train --resume {self.writer.dir}",
            )
        return cls(
            f"{what}; no checkpoint had been written yet, so there is nothing to resume",
            hint=f"{fix}, then start the run again",
        )

    def _diverged(self, loss: float, grad_norm: float) -> TrainingDivergedError:
        """The error for a step whose loss (or gradient) became non-finite,
        saying where it began (``toy.train.diagnostics.diagnose``), after a
        ``diag_nonfinite`` event that records it."""
        from toy.train.diagnostics import EVENT_KINDS, diagnose

        step = self.engine.step
        what = f"the loss became {loss}" if not math.isfinite(loss) else f"the gradient norm became {grad_norm}"
        try:
            found, fields = diagnose(self.engine)
        except Exception as e:  # noqa: BLE001 - the divergence is the error to report
            found, fields = f"(could not say where: {e})", {"source": None}
        self.writer.event(EVENT_KINDS["nonfinite"], step=step, loss=loss, grad_norm=grad_norm, **fields)
        return TrainingDivergedError(
            f"{what} at step {step}: {found}",
            hint="lower the learning rate (optim.lr) or keep gradient clipping on; "
            "a parameter that held NaN/Inf came with the starting weights or an earlier step",
        )

    # -------------------------------------------------------------- loop

    def run(self) -> RunResult:
        try:
            return self._run()
        finally:  # after run_end: the lock covers every write of the run
            if self.lock is not None:
                self.lock.release()

    def _run(self) -> RunResult:
        cfg, eng, hooks = self.cfg, self.engine, self.hooks
        reason = "completed"
        per_step = self.per_step
        sample_every = cfg.sample_every or cfg.save_every
        diag = self.diagnostics
        try:
            self.notes(diag.skipped if diag is not None and eng.step < cfg.steps else ())
            if self.eval_at_start and eng.step == 0 and cfg.eval_every:
                self._eval_label = EVAL_AT_START
                try:
                    self._timed_eval()
                except _StopDuringEval:
                    reason = "interrupted"
                finally:
                    self._eval_label = None
            while eng.step < cfg.steps and reason == "completed":
                if self._stop_asked():
                    reason = "interrupted"  # also before the first step (e.g. during tokenizing)
                    break
                t0 = time.perf_counter()
                batches = [self.stream.next() for _ in range(cfg.grad_accum * self.world.size)]
                lr = lr_at(cfg.optim, eng.step, cfg.steps)
                if diag is not None:
                    diag.before_step(eng)
                # toy.trace: the same step, every node timed (toy-vit's config has no ``trace``)
                if getattr(cfg, "trace", None) and eng.step + 1 == cfg.trace_step:
                    from toy.trace import trace_run_step

                    r = trace_run_step(self, batches, lr)
                else:
                    r = eng.train_step(batches, lr)
                dt = time.perf_counter() - t0
                self.seen += per_step
                stop_on_grads = diag is not None and diag.stops_on_grads
                if not math.isfinite(r.loss) or (stop_on_grads and not math.isfinite(r.grad_norm)):
                    raise self._diverged(r.loss, r.grad_norm)
                self.last_loss = r.loss
                ev = {
                    "step": eng.step,
                    "loss": r.loss,
                    "lr": lr,
                    self.unit: self.seen,
                    f"{self.unit}_per_s": per_step / dt,
                    "grad_norm": r.grad_norm,
                    "wall_us": int(dt * 1e6),
                    "epoch": self.stream.epoch,
                }
                ev.update(r.metrics)  # an objective's metrics of the step (toy.train.objectives); else none
                if r.rank_s is not None:  # several ranks
                    ev.update(comm_s=r.comm_s, sent_bytes=r.sent_bytes, rank_s_max=r.rank_s[0], rank_s_min=r.rank_s[1])
                self.writer.event("step", **ev)
                for kind, fields in diag.after_step(eng) if diag is not None else ():
                    self.writer.event(kind, **fields)
                if hooks.progress:
                    extra = {"eval_s": self._eval_s, "evals_left": self._evals_left(eng.step)}
                    hooks.progress({**ev, "total": cfg.steps, **extra})
                last = eng.step == cfg.steps
                if (cfg.eval_every and eng.step % cfg.eval_every == 0) and not last:
                    self._timed_eval()
                if sample_every and eng.step % sample_every == 0 and not last:
                    self.sample()
                if cfg.save_every and eng.step % cfg.save_every == 0 and not last:
                    self.save()
            if reason == "completed":
                self.evaluate()
                self.sample()
            if eng.step > 0 or self.keep_step0:  # a stop before the first step: no checkpoint (the docstring)
                self.save()
        except BaseException as e:
            io = self._io_error(e) or self._lost_rank(e)
            try:
                self.writer.end(
                    "interrupted" if isinstance(e, KeyboardInterrupt) else "errored",
                    final_step=eng.step,
                    final_loss=self.last_loss,
                    error=f"{type(e).__name__}: {io or e}",
                )
            except Exception:  # noqa: BLE001 - a full disk fails this too; the first error is the one to report
                pass
            if io is not None:
                raise io from e
            if isinstance(e, KeyboardInterrupt) and not isinstance(e, TrainingAborted):
                raise TrainingAborted(self.writer.dir, eng.step, self.last_ckpt) from e
            raise
        finally:
            self.close()
        try:
            self.writer.end(reason, final_step=eng.step, final_loss=self.last_loss, val_loss=self.last_val)
        except OSError as e:
            raise TrainingIOError(
                f"the run reached step {eng.step} and wrote its checkpoint {self.last_ckpt}, but could not "
                f"finish {self.writer.dir / 'events.jsonl'}: {e.strerror or e}"
            ) from e
        return RunResult(
            self.writer.run_id, self.writer.dir, reason, eng.step, self.last_loss, self.last_val, self.last_ckpt
        )


def rank_hooks(hooks: Hooks, world: World) -> Hooks:
    """A run's hooks on this rank: rank 0 reports; the other ranks only
    listen for a stop."""
    return hooks if world.is_root else Hooks(should_stop=hooks.should_stop)


def open_for_resume(run_dir: str | Path, world: World | None = None):
    """(lock, checkpoint, notes) of the run in ``run_dir``: its lock held
    (``RunInUseError`` while another process runs it), orphaned temporary
    files removed, damaged newer checkpoints set aside, the newest intact
    one loaded. The caller releases the lock if it does not go on.

    Several ranks (``world``): rank 0 does the above; the others then load
    the checkpoint rank 0 chose (the run folder must be at the same path on
    every host), with no lock and no notes of their own."""
    if world is None or not world.distributed:
        return _open_for_resume(Path(run_dir))
    lock = ck = None
    failed: BaseException | None = None
    if world.is_root:
        try:
            lock, ck, notes = _open_for_resume(Path(run_dir))
        except BaseException as e:
            failed = e
    said = world.bcast(ck.step if ck is not None else f"{failed}", what="waiting for rank 0 to open the run")
    if failed is not None:
        raise failed
    if isinstance(said, str):
        raise checkpoint.CheckpointError(f"rank 0 could not open {run_dir} to resume it: {said}")
    try:
        if not world.is_root:
            ck, notes = checkpoint.load_resumable(Path(run_dir) / "checkpoints"), []
        assert ck is not None
        world.check_same("checkpoint step", ck.step)
    except BaseException:
        if lock is not None:
            lock.release()
        raise
    return lock, ck, notes


def _open_for_resume(run_dir: Path):
    if not run_dir.is_dir():
        raise checkpoint.CheckpointError(f"{run_dir}: no such run folder")
    if (run_dir / "events.jsonl").is_file() and not any((run_dir / "checkpoints").glob("step_*")):
        nothing = _nothing_to_resume(run_dir)  # (damaged checkpoints set aside still match step_*)
        if nothing is not None:
            raise nothing
    if not (run_dir / "checkpoints").is_dir():  # checked before the lock file is made in it
        raise checkpoint.CheckpointError(f"{run_dir}: not a training run (it has no checkpoints folder)")
    lock = RunLock(run_dir)
    try:
        ckdir = run_dir / "checkpoints"
        notes = []
        orphans = checkpoint.remove_orphans(ckdir)
        if orphans:
            names = ", ".join(p.name for p in orphans)
            notes.append(f"removed {len(orphans)} temporary file(s) an interrupted write left behind: {names}")
        ck = checkpoint.load_resumable(ckdir)
        for step, err in ck.damaged:
            checkpoint.set_aside(ckdir, step)
            notes.append(f"warning: {err}; set aside as step_{step}*.damaged, resuming from step_{ck.step}")
        if ck.damaged:
            checkpoint.point_latest(ckdir, ck.step)
        if not ck.verified:
            notes.append(f"checkpoint step_{ck.step} has no checksums (an older toy wrote it): not verified")
    except BaseException:
        lock.release()
        raise
    return lock, ck, notes


def _nothing_to_resume(run_dir: Path) -> checkpoint.CheckpointError | None:
    """The error for a training run's folder with events but no checkpoint:
    what its events say happened, and how to start again (None: the events
    are not a training run's)."""
    try:
        events = read_events(run_dir / "events.jsonl")[0]
    except (OSError, ValueError, ToyError):
        return None
    if not events or events[0].get("kind") != "run_start" or events[0].get("run_kind") != "train":
        return None
    end = next((e for e in reversed(events) if e.get("kind") == "run_end"), None)
    steps = [e.get("step") for e in events if e.get("kind") == "step"]
    reached = max((s for s in steps if isinstance(s, int)), default=0)
    if end is None:
        what = "it has no checkpoint yet (still running, or killed before its first checkpoint)"
    elif reached == 0:
        what = f"it stopped before its first step ({end.get('reason', 'interrupted')}): nothing was trained"
    else:
        what = f"it stopped at step {reached} before its first checkpoint ({end.get('reason', 'interrupted')})"
    return checkpoint.CheckpointError(
        f"{run_dir}: nothing to resume: {what}",
        hint=f"start it again with the command that started it (its settings: {run_dir / 'config.json'}); "
        f"this folder can then be deleted",
    )


__all__ = [
    "EVAL_AT_START",
    "Hooks",
    "RunResult",
    "StepRun",
    "TrainingAborted",
    "TrainingDivergedError",
    "TrainingIOError",
    "bundle_error",
    "open_for_resume",
    "rank_hooks",
]
