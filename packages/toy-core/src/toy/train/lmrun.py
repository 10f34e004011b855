"""Language-model training runs: ``train`` and ``resume`` (tokenizer, data,
model, events, checkpoints) over the shared step loop of ``toy.train.steploop``.

``train(cfg, hooks)`` starts a run (from scratch or a recipe); ``resume(run_dir,
hooks)`` continues one from its latest checkpoint, handing a run of another
distribution's task (toy-vit) to that task. Both write the run bundle (schema
"toy/v1", see docs/concepts/architecture.md) through ``toy.runs.RunWriter``:

- ``run_start``: config, model dims and parameter count, data statistics
  (tokens, windows, the unigram baseline in nats/token), tokenizer source;
- ``step`` after every optimizer step: step, loss (mean NLL of the step's
  target tokens), lr, tokens (seen so far), tokens_per_s, grad_norm (before
  clipping), wall_us, epoch;
- ``eval`` every ``eval_every`` steps and at the end: name "val", loss, ppl
  (fine-tuning recipes also at step 0: the base model's loss, the baseline);
- ``sample`` at ``sample_every`` (default: with each checkpoint): a greedy
  continuation of the sample prompt;
- ``checkpoint`` when one is written; ``resume`` when a run is continued
  (appended to the same events file, after the earlier ``run_end``: a
  reader takes the last ``run_end`` as the run's status, and a step number
  seen twice means the later one);
- ``run_end``: reason completed | interrupted | errored, final_step, final_loss.

Stopping: ``hooks.should_stop()`` is polled before every step (so a stop
asked for while the corpus is being tokenized ends the run at step 0); when
it says yes the run saves a checkpoint (none at step 0: nothing was
trained; ``toy.train.steploop``), writes ``run_end`` with reason
"interrupted" and returns. The step-0 evaluation of a fine-tune polls it
between batches too. A non-finite loss stops the run with
``TrainingDivergedError`` (after ``run_end`` "errored"); the last checkpoint
stays the previous good one.

Exactness: a run's randomness is its seed (initial weights, data order) and
the state saved with every checkpoint (parameters, AdamW moments, step, data
cursor, RNG state), so resuming gives the same losses, bit for bit, as a run
that never stopped, on the same device and thread count.

Document separators: ``<|endoftext|>`` when the tokenizer has it, else its
end-of-sequence token.

The run folder (decisions):

- Lock: a run holds ``toy.runs.folder.RunLock`` on its folder from the moment
  the folder exists (a new run) or before its checkpoint is read (a resume)
  until ``run_end`` is written, so a second ``resume`` of a running run
  fails at once with ``RunInUseError`` ("run <id> is in use by pid N", exit
  2) instead of interleaving a second copy of the run into events.jsonl.
- Orphans: with the lock held, ``resume`` deletes the temporary files a
  killed writer left in ``checkpoints/`` (``checkpoint.remove_orphans``) and
  says how many in a ``note`` event.
- Integrity: ``resume`` takes the newest checkpoint whose checksums verify
  (``checkpoint.load_resumable``). A damaged newer one is renamed to
  ``*.damaged``, ``latest`` re-pointed, and a ``note`` event plus a
  ``warning:`` log line say which file was damaged and which step the run
  goes on from (the steps after it are trained again; a reader takes the
  later of a step seen twice). With no intact checkpoint left the resume
  fails with ``DamagedCheckpointError`` naming the file. A checkpoint
  without checksums (an older toy) resumes unverified, with a ``note``.
- Validity: before the engine is built, the checkpoint is checked against
  the parameters the run trains (``checkpoint.check_state``: shapes, F32,
  finite moments, counters, the RNG state) and its recorded config
  validated; a wrong state is ``CheckpointStateError`` (exit 2), no fallback.
- Writable outputs: ``train`` checks the runs folder (``out``) is a folder
  it can write into (``check_output_dir``) before the tokenizer is trained
  or the corpus read. An ``OSError`` during the run (a full disk while
  writing a checkpoint or events) ends it with ``TrainingIOError``: the
  message names the file (or the run folder) and the last good checkpoint,
  the hint the command that resumes from it.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Callable
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any

import numpy as np

import toy_ggml
from toy import store
from toy.errors import BadInputError, ToyError
from toy.gguf import GGUFFile
from toy.runs import RunWriter, report, runs_dir
from toy.runs.folder import RunLock, check_output_dir
from toy.tokenizer import Tokenizer
from toy.train import checkpoint, recipes
from toy.train import data as D
from toy.train import distributed as dist
from toy.train.bpe import METADATA_TYPES, train_bpe
from toy.train.config import PREF_RECIPES, TrainConfig, from_dict, to_dict, validate
from toy.train.diagnostics import Diagnostics
from toy.train.model import ArchTrain, init_params, model_config
from toy.train.stepgraph import TrainEngine
from toy.train.steploop import (
    Hooks,
    RunResult,
    StepRun,
    TrainingDivergedError,
    TrainingIOError,
    bundle_error,
    open_for_resume,
    rank_hooks,
)


def _runtime(cfg: TrainConfig, world: dist.World) -> toy_ggml.Runtime:
    """The run's Runtime: ``cfg.threads`` as given, else the physical cores,
    as many of them per step as the machine's load leaves room for (no bit of
    a step depends on the thread count: toy patch 0022). Several ranks on one
    host share its cores (unless the launcher bound each to its own)."""
    n, adaptive = dist.rank_threads(cfg.threads, world)
    device = toy_ggml.device_name(cfg.device or os.environ.get("TOY_DEVICE") or "cpu")  # "cuda": the first CUDA device
    return toy_ggml.Runtime(device, threads=n, adaptive=adaptive)


def _tokenizer(cfg: TrainConfig, hooks: Hooks) -> tuple[dict[str, Any], str]:
    """(tokenizer.* metadata, description of where it came from)."""
    source = cfg.tokenizer.model or (cfg.base if cfg.recipe == "warm-start" else None)
    if source:
        path = store.resolve_or_fetch(source)
        with GGUFFile(path) as gf:
            meta = checkpoint.tokenizer_metadata_of(gf)
        if "tokenizer.ggml.tokens" not in meta:
            raise ToyError(f"{path}: has no tokenizer to take")
        return meta, f"model:{path}"
    if hooks.note:
        hooks.note(f"training a {cfg.tokenizer.vocab_size}-token byte-level BPE tokenizer on the corpus")
    on_phase = hooks.phase
    prog = (lambda d, t: on_phase("training tokenizer", d, t)) if on_phase else None
    meta = train_bpe(cfg.data.paths, cfg.tokenizer.vocab_size, progress=prog)
    # llama.cpp reads the special token ids as UINT32 only
    meta = {k: (v, METADATA_TYPES[k]) if k in METADATA_TYPES else v for k, v in meta.items()}
    return meta, "trained-bpe"


def _plain(meta: dict[str, Any]) -> dict[str, Any]:
    return {k: (v[0] if isinstance(v, tuple) else v) for k, v in meta.items()}


def _doc_separator(tok) -> int:
    i = tok.token_to_id("<|endoftext|>")
    if i is not None:
        return i
    eos = tok.vocab.special.get("eos")
    if eos is None:
        raise ToyError("the tokenizer has neither <|endoftext|> nor an end-of-sequence token")
    return int(eos)


def _check_ranks(cfg: TrainConfig, world: dist.World) -> tuple[dict[str, Any], str | None]:
    """Before anything is set up on several ranks: what one rank cannot do,
    the same inputs on every rank, and their CPU variants (the facts
    ``run_start`` records, and a warning to log when they differ)."""
    if cfg.diagnostics.kinds or cfg.trace:
        raise BadInputError(
            "training diagnostics and step traces are one-process tools",
            hint="run them without --ranks (the steps are the same bits)",
        )
    models = [m for m in (cfg.base, cfg.tokenizer.model) if m and Path(m).is_file()]  # names resolve alike
    paths = [*cfg.data.paths, *models]
    dist.check_inputs(world, to_dict(cfg), paths)
    return dist.world_facts(world, cfg.mixed_cpus)


class _Run(StepRun):
    def __init__(
        self,
        cfg: TrainConfig,
        hooks: Hooks,
        resume_from: Path | None = None,
        ckpt: checkpoint.Resumable | None = None,
        lock=None,
        notes: list[str] | None = None,
        world: dist.World | None = None,
    ):
        self.cfg, self.hooks = cfg, hooks
        self.lock = lock  # a resume takes it before reading the checkpoint
        self.world = world = world or dist.World()
        notes = list(notes or [])
        world_info: dict[str, Any] = {}  # what run_start (or resume) records of several ranks
        if world.distributed:
            world_info, warning = _check_ranks(cfg, world)
            if warning:
                notes.append(warning)
        self.runtime = _runtime(cfg, world)
        self.setup = None
        st = ckpt.state if ckpt else {}
        try:
            if cfg.recipe in ("lora", "full"):
                make = recipes.setup_lora if cfg.recipe == "lora" else recipes.setup_full
                s = self.setup = make(cfg, self.runtime, st if ckpt else None)
                self.tok_meta, self.tokenizer, tok_source = s.tok_meta, s.tokenizer, s.tok_source
                self.data, data_info, self.model_cfg = s.data, s.data_info, s.model_cfg
                train_model, params, extra_start = s.train_model, s.params, s.start
            else:
                train_model, params, data_info, tok_source, extra_start = self._text_setup(cfg, hooks, ckpt)
            self.data.check_batch(cfg.batch_size)
            self.rng = np.random.default_rng(cfg.seed)
            if ckpt:  # a state that checksums pass may still not be this run's (edited, copied)
                checkpoint.check_state(ckpt, train_model.param_specs(), counters=("tokens_seen",))
                checkpoint.restore_rng(ckpt, self.rng)
            self.engine = TrainEngine(
                train_model,
                ckpt.params if ckpt else params,
                self.runtime,
                cfg.optim,
                batch=cfg.batch_size,
                context=cfg.context,
                accum=cfg.grad_accum,
                world=world,
            )
        except BaseException:
            if self.setup is not None:
                self.setup.close()
            self.runtime.close()
            raise
        if ckpt:
            self.engine.load_state(ckpt.params, ckpt.optimizer, ckpt.step)
        self.stream = D.BatchStream(self.data, cfg.batch_size, cfg.seed, state=st.get("data"))
        self.seen = int(st.get("tokens_seen", 0))  # tokens
        self.val = D.validation_batches(self.data, cfg.batch_size, cfg.eval_batches or None) if self.data.n_val else []
        self.diagnostics = self._diagnostics(cfg, params, ckpt)
        self.n_params = int(sum(int(np.prod(s.shape)) for s in self.engine.specs))
        self.tok_source = tok_source
        world_start: dict[str, Any] = {"world": world_info} if world_info else {}
        try:
            if not world.is_root:
                pass  # rank 0 writes the run: below, this rank learns its folder
            elif ckpt:
                assert resume_from is not None  # a checkpoint comes with the run folder it resumes
                self.writer = RunWriter.reopen(resume_from)
                report.attach(self.writer, cfg.report, resume=True)  # TensorBoard/MLflow: toy.runs.report
                self.writer.event(
                    "resume",
                    from_step=ckpt.step,
                    checkpoint=ckpt.model_path.name,
                    **({"world": world_info} if world_info else {}),
                )
            else:
                self.writer = RunWriter(
                    "train",
                    to_dict(cfg),
                    root=cfg.out,
                    recipe=cfg.recipe,
                    **{"model": dataclasses.asdict(self.model_cfg), **extra_start},
                    n_params=self.n_params,
                    data=data_info,
                    tokenizer=tok_source,
                    **world_start,
                )
                self.lock = RunLock(self.writer.dir)
                report.attach(self.writer, cfg.report)
            self.share_run_folder()
            self.notes([*notes, *(self.setup.notes if self.setup else [])])
        except BaseException as e:
            self.engine.close()
            if self.setup is not None:
                self.setup.close()
            self.runtime.close()
            if self.lock is not None:
                self.lock.release()
            if world.distributed and world.is_root and not hasattr(self, "writer"):
                self.share_run_folder()  # the other ranks wait for the run folder: there is none
            if isinstance(e, OSError):  # config.json or events.jsonl (the runs folder was checked writable)
                raise bundle_error(e, ckpt is not None, e.filename or (resume_from or runs_dir(cfg.out))) from e
            raise
        self.init_counters(ckpt)
        self.per_step = cfg.batch_size * cfg.context * cfg.grad_accum * world.size
        self.eval_at_start = self.setup is not None
        self.keep_step0 = ckpt is None and tok_source == "trained-bpe"  # a stop at step 0 keeps the tokenizer

    def _text_setup(self, cfg: TrainConfig, hooks: Hooks, ckpt):
        """Tokenizer, token cache and packed windows of a text corpus, and the
        model's starting values: from-scratch and warm-start runs."""
        if ckpt is not None:
            tok_meta, tok_source = ckpt.tokenizer_metadata, ckpt.state.get("tokenizer_source", "checkpoint")
        else:
            if not cfg.data.paths:
                raise BadInputError("no training data: give files or folders (data.paths)")
            tok_meta, tok_source = _tokenizer(cfg, hooks)
        self.tok_meta = tok_meta
        self.tokenizer = Tokenizer.from_gguf(_plain(tok_meta))
        eos = _doc_separator(self.tokenizer)
        cache_dir = Path(cfg.data.cache_dir) if cfg.data.cache_dir else store.toy_home() / "cache" / "tokens"
        on_phase = hooks.phase
        prog = (lambda d, t: on_phase("tokenizing corpus", d, t)) if on_phase else None
        self.cache = D.TokenCache.build(cfg.data.paths, self.tokenizer, eos_id=eos, cache_dir=cache_dir, progress=prog)
        self.data = D.PackedData(
            self.cache, cfg.context, val_fraction=cfg.data.val_fraction, block_causal=cfg.data.block_causal
        )
        self.model_cfg = model_config(cfg.model, self.tokenizer.vocab_size, cfg.context)
        extra: dict[str, Any] = {}
        if ckpt is not None:
            params = ckpt.params
        elif cfg.recipe == "warm-start":
            assert cfg.base is not None  # validate(): every recipe but from-scratch has a base
            donor = store.resolve_or_fetch(cfg.base)
            with GGUFFile(donor) as gf:
                params, facts = recipes.warm_start_params(cfg, self.model_cfg, gf, cfg.seed)
            extra["warm_start"] = {"donor": str(donor), **facts}
        else:
            params = init_params(self.model_cfg, cfg.seed)
        info = {
            "tokens": self.cache.n_tokens,
            "documents": self.cache.n_docs,
            "train_windows": self.data.n_train,
            "val_windows": self.data.n_val,
            "unigram_nats": D.unigram_entropy(self.cache.tokens, self.tokenizer.vocab_size),
        }
        return ArchTrain(self.model_cfg), params, info, tok_source, extra

    def _diagnostics(self, cfg: TrainConfig, start, ckpt) -> Diagnostics | None:
        """The run's ``toy.train.diagnostics`` (None: none asked for). Drift's
        reference is the run's starting weights: a from-scratch run's seeded
        initial weights (made again on a resume), a full fine-tune's base
        weights, a LoRA run's initial adapters, a warm start's warm-started
        weights (on a resume: the resumed checkpoint's, labelled "resumed").
        The probe batch of ``activations`` is the first validation batch
        (no validation split: the first training batch of the seed's order)."""
        d = cfg.diagnostics
        if not d.kinds:
            return None
        label = {"full": "base", "lora": "initial adapters"}.get(cfg.recipe, "initial")
        ref = start
        # a resumed text run: its checkpoint holds where the run is, not where it began
        if ckpt is not None and self.setup is None:
            if cfg.recipe == "from-scratch":
                ref = init_params(self.model_cfg, cfg.seed)
            else:
                label = "resumed"
        probe = self.val[0] if self.val else self.stream_peek()
        return Diagnostics(d.kinds, d.every, self.engine, reference=ref, reference_label=label, probe=probe)

    # -------------------------------------------------------------- pieces

    def evaluate(self) -> float | None:
        if not self.val:
            return None
        tot, n = 0.0, 0
        for i, b in enumerate(self.val):
            s, k = self.engine.eval_nll(b)
            tot += s
            n += k
            self.eval_progress(i + 1, len(self.val))  # the step-0 evaluation's progress and stop
        loss = tot / max(1, n)
        self.last_val = loss
        step = self.engine.step
        self.writer.event("eval", step=step, name="val", loss=loss, ppl=math.exp(min(loss, 700.0)), tokens=n)
        if self.hooks.note:
            self.hooks.note(f"step {step}: validation loss {loss:.4f} (ppl {math.exp(min(loss, 700.0)):.2f})")
        return loss

    def sample(self) -> None:
        cfg = self.cfg
        if cfg.sample_tokens == 0:
            return
        if cfg.sample_prompt:
            ids = self.tokenizer.encode(cfg.sample_prompt, add_special=False)
        else:
            first = self.val[0] if self.val else self.stream_peek()
            ids = [int(x) for x in first.tokens[0][: min(8, cfg.context // 2)]]
        prompt = self.tokenizer.decode(ids)
        out: list[int] = []
        for _ in range(cfg.sample_tokens):
            if len(ids) + len(out) >= cfg.context:
                break
            nxt = int(np.argmax(self.engine.next_token_logits(ids + out)))
            out.append(nxt)
        self.writer.event("sample", step=self.engine.step, prompt=prompt, text=self.tokenizer.decode(out), greedy=True)

    def stream_peek(self):
        return D.BatchStream(self.data, self.cfg.batch_size, self.cfg.seed).next()

    def state(self) -> dict[str, Any]:
        return {
            "config": to_dict(self.cfg),
            "data": self.stream.state(),
            "rng": self.rng.bit_generator.state,
            "tokens_seen": self.seen,
            "tokenizer_source": self.tok_source,
            "ranks": self.world.size,
            "global_micro_batches": self.cfg.grad_accum * self.world.size,
            **(self.setup.state if self.setup else {}),
        }

    def checkpoint_kwargs(self) -> dict[str, Any]:
        return {
            "cfg": self.model_cfg,
            "tokenizer_metadata": self.tok_meta,
            "write_model": self.setup.write_model if self.setup else None,
        }

    def close(self) -> None:
        self.engine.close()
        if self.setup is not None:
            self.setup.close()
        self.runtime.close()


def train(cfg: TrainConfig, hooks: Hooks | None = None) -> RunResult:
    """Train a llama-family model from scratch as ``cfg`` says. Data paths
    are recorded absolute, so ``resume`` works from any folder."""
    world = dist.World.from_env()  # first: a rank that fails after this ends every rank (the CLI aborts MPI)
    cfg = validate(cfg)
    if world.is_root:  # rank 0 alone writes the run folder
        check_output_dir(runs_dir(cfg.out), "runs folder (out)")  # before the tokenizer is trained
    report.check_available(cfg.report.to)  # a missing extra stops the run before its folder exists
    data = dataclasses.replace(cfg.data, paths=[str(Path(p).expanduser().absolute()) for p in cfg.data.paths])
    run = _run_class(cfg.recipe)
    return run(dataclasses.replace(cfg, data=data), rank_hooks(hooks or Hooks(), world), world=world).run()


def _run_class(recipe: str) -> Callable[..., StepRun]:
    """The run of a recipe: the preference recipes' (``toy.train.prefrun``),
    GRPO's (``toy.train.grpo``), else ``_Run``; each takes ``_Run``'s arguments.
    Imported here, not at the top: both modules build on this one."""
    if recipe in PREF_RECIPES:
        from toy.train.prefrun import PrefRun

        return PrefRun
    if recipe == "grpo":
        from toy.train.grpo import GRPORun

        return GRPORun
    return _Run


def resume(run_dir: str | Path, hooks: Hooks | None = None, *, steps: int | None = None) -> RunResult:
    """Continue the run in ``run_dir`` from its latest checkpoint, with the
    config it recorded (``steps`` may raise the total: the schedule then
    stretches, so the curve is no longer the uninterrupted one)."""
    world = dist.World.from_env()
    hooks = rank_hooks(hooks or Hooks(), world)
    lock, ck, notes = open_for_resume(run_dir, world)  # RunInUseError while another process runs it
    try:
        task = ck.state.get("task")
        if task is not None:  # a run of another distribution's task (toy-vit's classifier)
            resume_task = _task(task, Path(run_dir))
        else:
            try:
                cfg = from_dict(ck.state.get("config"))  # not an object: ConfigError
            except BadInputError as e:
                raise checkpoint.config_error(ck, e) from None
            if steps is not None:
                cfg = dataclasses.replace(cfg, steps=steps)
            accum, note = dist.regroup(world, cfg.grad_accum, ck.state)  # another number of ranks
            cfg = dataclasses.replace(cfg, grad_accum=accum)
            notes = [*notes, *([note] if note else [])]
            if ck.step >= cfg.steps:
                raise checkpoint.CheckpointError(
                    f"{run_dir}: already at step {ck.step} of {cfg.steps}",
                    hint="pass --steps N with a larger N to go on",
                )
            make = _run_class(cfg.recipe)
            run = make(cfg, hooks, resume_from=Path(run_dir), ckpt=ck, lock=lock, notes=notes, world=world)
    except BaseException:
        if lock is not None:
            lock.release()
        raise
    if task is not None:
        return resume_task(Path(run_dir), hooks, lock=lock, ckpt=ck, notes=notes, steps=steps, world=world)
    return run.run()


def _task(name: str, run_dir: Path):
    """The resume function of a training task another distribution
    registers in the ``toy.train_tasks`` entry-point group (``vit``:
    toy-vit). It takes over the lock: ``f(run_dir, hooks, *, lock, ckpt,
    notes, steps)``."""
    for ep in entry_points(group="toy.train_tasks"):
        if ep.name == name:
            return ep.load()
    raise checkpoint.CheckpointError(
        f"{run_dir}: a {name!r} training run, and no installed package trains {name!r} runs",
        hint=f"install the package that does (toy-{name})",
    )


__all__ = ["Hooks", "RunResult", "TrainingDivergedError", "TrainingIOError", "resume", "train"]
