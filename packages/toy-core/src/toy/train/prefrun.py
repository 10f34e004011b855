"""Preference-tuning runs: DPO, ORPO and KTO on a GGUF base, as LoRA (QLoRA
on a quantized base) or a full fine-tune.

A preference run is a language-model run (``toy.train.lmrun``: the same run
bundle, events, checkpoints, stopping and exact resume) whose data is
preference pairs or labelled examples (``toy.train.prefdata``) and whose
loss is an objective built into the step graph (``toy.train.objectives``:
``DPOLoss``, ``ORPOLoss``, ``KTOLoss``; hyper-parameters from the config's
``[pref]`` table). The base, the adapters or trainable copy, and the
checkpoint files are the lora and full recipes' (``toy.train.recipes``,
picked by ``adapter``): an adapter checkpoint loads in llama.cpp.

Rows. ``batch_size`` counts pairs (dpo, orpo) or examples (kto), as TRL's
``per_device_train_batch_size``; a DPO micro-batch of P pairs is 2P rows of
``context`` positions, chosen first (``prefdata``). ORPO's NLL covers the
whole chosen sequence, prompt included, as TRL's: ``orpo_batch`` gives the
chosen rows a loss mask on every target and keeps the completion mask for
the odds ratio.

The reference (decisions). DPO and KTO compare the policy with a frozen
reference: the starting parameters (a LoRA run's adapters start with B = 0,
so its starting policy is the base; a full fine-tune starts from the base's
weights). There is no second copy of the model: before the first step the
run computes, with the engine's own forward on the starting parameters, the
sequence log-probability of every training and validation row (KTO: and of
every row's KL sequence, its prompt followed by another example's
completion, ``UnpairedData.kl_batch``) and caches them in the run folder as
``reference_logps.npz``, with the base's sha256 and a digest of the rows'
tokens and masks. Batches carry their rows' cached values (``ref_logps``).
A resume reuses the file and refuses one whose base or data digest differs
from the run's (it would not continue the same run); a missing file is
computed again (the same values: the engine starts from the starting
parameters before the checkpoint is loaded) and said in a note. The pass
reports through ``hooks.phase`` ("reference log-probabilities") and polls
``should_stop`` between batches: a stop there ends the run at step 0, with
nothing cached. ORPO has no reference and computes nothing.

KTO's KL estimate. Before each micro-batch (``next()`` of the run's
stream, right before the step) the run computes the policy's log-prob of
the micro-batch's KL sequences on the current parameters and sets
``batch.kl = max(0, mean(policy - reference))`` (TRL's z0, a constant of
the step: no gradient flows through it). Evaluation does the same per
validation batch.

Events (besides ``lmrun``'s): ``run_start`` records ``objective`` (its name
and hyper-parameters), ``adapter`` and ``reference`` (the cache file, rows,
seconds; null for ORPO); each ``step`` event adds the objective's metrics
of the step (DPO: rewards_chosen, rewards_rejected, margin, accuracy,
logps_chosen, logps_rejected; ORPO: nll, log_odds_ratio, ...; KTO: kl,
rewards ...); ``eval`` (name "val") gives the validation loss and the same
metrics over the validation examples (step 0: the starting policy: DPO's
loss is then log 2 and its accuracy 0 or a tie).

Validation batches have the engine's row count: the last one is filled up
with copies of its own first example whose loss mask is zeroed (padding:
the objectives leave out a pair or example without a loss token); each
batch's metrics are weighted by its real examples.

One process only: the objectives train on one rank (``--ranks`` is
refused with a clear error).
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import time
from pathlib import Path
from typing import Any, cast

import numpy as np

from toy.errors import BadInputError, ConfigError
from toy.runs import RunWriter, report, runs_dir
from toy.runs.folder import RunLock
from toy.train import checkpoint, recipes
from toy.train import data as D
from toy.train import distributed as dist
from toy.train.config import TrainConfig, to_dict
from toy.train.lmrun import _Run, _runtime
from toy.train.stepgraph import TrainEngine
from toy.train.steploop import Hooks, bundle_error

#: the data format of each preference recipe (``toy.train.prefdata``)
FORMATS = {"dpo": "pairs", "orpo": "pairs", "kto": "unpaired"}
#: the cache of reference log-probabilities in the run folder
REFERENCE_FILE = "reference_logps.npz"
#: the ``hooks.phase`` label of the reference pass
REFERENCE_PHASE = "reference log-probabilities"


def objective_of(cfg: TrainConfig):
    """The recipe's objective with the config's ``[pref]`` values."""
    from toy.train import objectives as O

    p = cfg.pref
    try:
        if cfg.recipe == "dpo":
            return O.DPOLoss(beta=p.beta, loss_type=p.loss_type, label_smoothing=p.label_smoothing)
        if cfg.recipe == "orpo":
            return O.ORPOLoss(lam=p.orpo_lambda)
        if cfg.recipe == "kto":
            return O.KTOLoss(beta=p.beta, desirable_weight=p.desirable_weight, undesirable_weight=p.undesirable_weight)
    except ValueError as e:
        raise ConfigError(f"pref: {e}") from None
    raise ConfigError(f"recipe {cfg.recipe!r} is not a preference recipe (dpo, orpo, kto)")


def pref_data(cfg: TrainConfig, tokenizer, template) -> tuple[Any, dict[str, Any]]:
    """The run's preference data (``recipes.DataLoader``): the JSONL files of
    ``data.paths`` in the recipe's format, the split, and run_start's "data"."""
    from toy.train import prefdata as P

    if not cfg.data.paths:
        raise BadInputError("no training data: give JSONL files (data.paths)")
    fmt = FORMATS[cfg.recipe]
    max_length = cfg.data.max_length or cfg.context + 1
    examples, stats = P.load_pref(
        cfg.data.paths,
        tokenizer,
        template,
        format=fmt,
        max_length=max_length,
        overflow=cfg.data.overflow,
        special_in_content=cfg.data.special_in_content,
    )
    kw: dict[str, Any] = {"kl_group": cfg.batch_size} if fmt == "unpaired" else {}
    data = P.DATA_CLASSES[fmt](examples, cfg.context, val_fraction=cfg.data.val_fraction, seed=cfg.seed, **kw)
    info: dict[str, Any] = {
        "format": fmt,
        "examples": stats.n_examples,
        "styles": dict(stats.styles),
        "tokens": stats.n_tokens,
        "loss_tokens": stats.n_loss,
        "lengths": stats.lengths,
        "max_length": max_length,
        "truncated": stats.truncated,
        "dropped": stats.dropped,
        "train_examples": data.n_train,
        "val_examples": data.n_val,
    }
    what = "pairs" if fmt == "pairs" else "examples"
    labels = f" ({stats.n_desirable} desirable, {stats.n_undesirable} undesirable)" if fmt == "unpaired" else ""
    if fmt == "unpaired":
        info.update(desirable=stats.n_desirable, undesirable=stats.n_undesirable)
    styles = ", ".join(f"{k} {n}" for k, n in info["styles"].items())
    info["note"] = (
        f"data: {stats.n_examples} {what} used{labels} ({styles}), {stats.n_loss:,} of {stats.n_tokens:,} tokens "
        f"carry loss; longer than {max_length} tokens: {stats.truncated} truncated, {stats.dropped} dropped; "
        f"{data.n_train} training {what}, {data.n_val} validation {what}"
    )
    return data, info


def orpo_batch(b):
    """ORPO's masks on a pair batch (module docstring): ``completion_mask``
    the completions' targets (the batch's loss mask), ``loss_mask`` of the
    chosen rows every target of the sequence (TRL's NLL over prompt and
    response); the rejected rows keep their completion mask."""
    P = b.tokens.shape[0] // 2
    completion = np.asarray(b.loss_mask, np.float32).copy()
    loss = completion.copy()
    loss[:P] = (np.asarray(b.doc)[:P] == 0).astype(np.float32)
    loss[:P] *= np.asarray(b.loss_mask)[:P].any(axis=1, keepdims=True)  # a padding pair stays without loss
    b.loss_mask = loss
    b.completion_mask = completion
    return b


def _pad(rows: list[int], n: int) -> list[int]:
    """``rows`` filled up to ``n`` with copies of its first row."""
    return rows + [rows[0]] * (n - len(rows))


class _RefData:
    """The run's data with the reference attached: ``batch(rows)`` sets the
    rows' cached ``ref_logps`` (and ORPO's masks) and remembers the rows
    (``last_rows``: the KL batch of a KTO micro-batch is built from them).
    ``BatchStream`` uses it as its data."""

    def __init__(self, data, ref: np.ndarray | None, orpo: bool):
        self.data, self.ref, self.orpo = data, ref, orpo
        self.n_windows, self.n_val = data.n_windows, data.n_val
        self.rows_per_item = data.rows_per_item
        self.last_rows: list[int] = []

    @property
    def n_train(self) -> int:
        return self.data.n_train

    def check_batch(self, batch_size: int) -> None:
        self.data.check_batch(batch_size)

    def batch(self, rows) -> Any:
        rows = [int(i) for i in rows]
        b = self.data.batch(rows)
        if self.ref is not None:
            # (rows, rows_per_item) -> the batch's row order: side 0 of every row, then side 1
            b.ref_logps = np.ascontiguousarray(self.ref[rows].T.reshape(-1), np.float32)
        if self.orpo:
            b = orpo_batch(b)
        self.last_rows = rows
        return b


class _KLStream:
    """A KTO run's batch stream: each micro-batch gets its KL estimate from
    the current parameters when it is drawn (right before its step)."""

    def __init__(self, stream: D.BatchStream, run: PrefRun):
        self.stream, self.run = stream, run

    def next(self):
        b: Any = self.stream.next()
        b.kl = self.run.kl_estimate(self.run.rdata.last_rows)
        return b

    def state(self) -> dict:
        return self.stream.state()

    @property
    def epoch(self) -> float:
        return self.stream.epoch


class PrefRun(_Run):
    """A dpo, orpo or kto run (the module docstring); the constructor is
    ``lmrun._Run``'s, which ``lmrun.train`` and ``lmrun.resume`` call."""

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
        self.lock = lock
        self.world = world = world or dist.World()
        if world.distributed:
            raise BadInputError(
                f"{cfg.recipe} runs train in one process: the preference objectives do not run on several ranks",
                hint="run it without --ranks",
            )
        notes = list(notes or [])
        self.runtime = _runtime(cfg, world)
        self.setup = None
        st = ckpt.state if ckpt else {}
        self.objective = objective = objective_of(cfg)
        try:
            s = self.setup = recipes.setup(cfg, self.runtime, st if ckpt else None)
            self.tok_meta, self.tokenizer, tok_source = s.tok_meta, s.tokenizer, s.tok_source
            self.data, data_info, self.model_cfg = s.data, s.data_info, s.model_cfg
            self.data.check_batch(cfg.batch_size)
            self.rows = cfg.batch_size * self.data.rows_per_item  # the engine's rows
            self.rng = np.random.default_rng(cfg.seed)
            if ckpt:
                checkpoint.check_state(ckpt, s.train_model.param_specs(), counters=("tokens_seen",))
                checkpoint.restore_rng(ckpt, self.rng)
            self.engine = TrainEngine(
                s.train_model,
                s.params,  # the starting parameters: the reference pass runs on them, then a checkpoint loads
                self.runtime,
                cfg.optim,
                batch=self.rows,
                context=cfg.context,
                accum=cfg.grad_accum,
                objective=objective,
            )
        except BaseException:
            if self.setup is not None:
                self.setup.close()
            self.runtime.close()
            raise
        try:
            self.base_sha = str(s.state.get("base_sha256", ""))
            self.ref, self.ref_kl, ref_info, ref_note = self._reference(resume_from)
            if ref_note:
                notes.append(ref_note)
            if ckpt:
                self.engine.load_state(ckpt.params, ckpt.optimizer, ckpt.step)
            self.rdata = _RefData(self.data, self.ref, orpo=cfg.recipe == "orpo")
            stream = D.BatchStream(cast(Any, self.rdata), cfg.batch_size, cfg.seed, state=st.get("data"))
            self.stream = _KLStream(stream, self) if self.ref_kl is not None else stream
            self.val_sets = self._validation()
            self.val = [b for b, _ in self.val_sets]
            self.diagnostics = self._diagnostics(cfg, s.params, ckpt)
        except BaseException:
            self.close()
            raise
        self.seen = int(st.get("tokens_seen", 0))
        self.n_params = int(sum(int(np.prod(sp.shape)) for sp in self.engine.specs))
        self.tok_source = tok_source
        try:
            if ckpt:
                assert resume_from is not None
                self.writer = RunWriter.reopen(resume_from)
                report.attach(self.writer, cfg.report, resume=True)
                self.writer.event("resume", from_step=ckpt.step, checkpoint=ckpt.model_path.name)
            else:
                self.writer = RunWriter(
                    "train",
                    to_dict(cfg),
                    root=cfg.out,
                    recipe=cfg.recipe,
                    **{"model": dataclasses.asdict(self.model_cfg), **s.start},
                    adapter=cfg.adapter,
                    objective=objective.describe(),
                    reference=ref_info,
                    n_params=self.n_params,
                    data={k: v for k, v in data_info.items() if k != "note"},  # the note is an event of its own
                    tokenizer=tok_source,
                )
                self.lock = RunLock(self.writer.dir)
                report.attach(self.writer, cfg.report)
            if self.ref is not None and not (self.writer.dir / REFERENCE_FILE).is_file():
                self._save_reference(self.writer.dir / REFERENCE_FILE)
            self.notes([*notes, *s.notes])
        except BaseException as e:
            self.close()
            if self.lock is not None:
                self.lock.release()
            if isinstance(e, OSError):
                raise bundle_error(e, ckpt is not None, e.filename or (resume_from or runs_dir(cfg.out))) from e
            raise
        self.init_counters(ckpt)
        self.per_step = self.rows * cfg.context * cfg.grad_accum
        self.eval_at_start = not self._stopped
        self.keep_step0 = False

    # -------------------------------------------------------------- the reference

    def _chunks(self, rows: range) -> list[list[int]]:
        P = self.cfg.batch_size
        idx = list(rows)
        return [idx[i : i + P] for i in range(0, len(idx), P)]

    def _digest(self) -> str:
        """sha256 of every row the reference covers (tokens, targets, masks,
        KTO's KL rows too) as the pass batches them, with the run's shape."""
        h = hashlib.sha256(f"{self.cfg.recipe} {self.cfg.context} {self.cfg.batch_size}".encode())
        for chunk in self._chunks(range(self.data.n_windows)):
            rows = _pad(chunk, self.cfg.batch_size)
            batches = [self.data.batch(rows)] + ([self.data.kl_batch(rows)] if self.cfg.recipe == "kto" else [])
            for b in batches:
                for a in (b.tokens, b.targets, b.loss_mask):
                    h.update(np.ascontiguousarray(a).tobytes())
        return h.hexdigest()

    def _reference(self, run_dir: Path | None):
        """(ref (n, rows_per_item), KTO's KL ref (n, 1) or None, run_start's
        "reference", a note or None): loaded from the run folder (a resume)
        or computed on the engine's starting parameters (module docstring)."""
        self._stopped = False
        if self.cfg.recipe not in ("dpo", "kto"):
            return None, None, None, None
        digest = self._digest()
        path = run_dir / REFERENCE_FILE if run_dir is not None else None
        note = None
        if path is not None and path.is_file():
            try:
                with np.load(path, allow_pickle=False) as z:
                    arrays = {k: z[k] for k in z.files}
            except (OSError, ValueError) as e:
                raise checkpoint.CheckpointError(
                    f"{path}: cannot read the cached reference log-probabilities: {e}",
                    hint=f"delete {path.name}: the resume computes it again",
                ) from None
            sha, dig = str(arrays.get("base_sha256", "")), str(arrays.get("data_digest", ""))
            if sha != self.base_sha or dig != digest:
                what = "base model" if sha != self.base_sha else "training data (or its tokenization)"
                raise BadInputError(
                    f"{path}: the cached reference log-probabilities are for another {what} than this run's",
                    hint="resume with the base and data files the run was started with",
                )
            self.digest = digest
            kl = arrays.get("kl")
            return arrays["ref"], kl, {"file": REFERENCE_FILE, "rows": int(arrays["ref"].size)}, None
        if path is not None:
            note = f"{REFERENCE_FILE} was missing: the reference log-probabilities were computed again"
        t0 = time.perf_counter()
        ref, kl = self._compute_reference()
        self.digest = digest
        if ref is None:  # a stop was asked for during the pass
            return None, None, None, note
        info = {"file": REFERENCE_FILE, "rows": int(ref.size), "seconds": round(time.perf_counter() - t0, 3)}
        return ref, kl, info, note

    def _compute_reference(self) -> tuple[np.ndarray | None, np.ndarray | None]:
        eng, data, P = self.engine, self.data, self.cfg.batch_size
        r = data.rows_per_item
        chunks = self._chunks(range(data.n_windows))
        kto = self.cfg.recipe == "kto"
        ref = np.zeros((data.n_windows, r), np.float64)
        kl = np.zeros((data.n_windows, 1), np.float64) if kto else None
        phase, stop = self.hooks.phase, self.hooks.should_stop
        for i, chunk in enumerate(chunks):
            if stop is not None and stop():
                self._stopped = True
                self.hooks = dataclasses.replace(self.hooks, should_stop=lambda: True)  # the loop stops at step 0
                return None, None
            rows = _pad(chunk, P)
            lp = np.asarray(eng.sequence_logps(data.batch(rows)), np.float64)
            ref[chunk] = lp.reshape(r, P).T[: len(chunk)]
            if kl is not None:
                kl[chunk, 0] = np.asarray(eng.sequence_logps(data.kl_batch(rows)), np.float64)[: len(chunk)]
            if phase:
                phase(REFERENCE_PHASE, i + 1, len(chunks))
        return ref, kl

    def _save_reference(self, path: Path) -> None:
        arrays: dict[str, Any] = {
            "ref": self.ref,
            "base_sha256": np.array(self.base_sha),
            "data_digest": np.array(self.digest),
        }
        if self.ref_kl is not None:
            arrays["kl"] = self.ref_kl
        tmp = path.with_name(path.name + ".tmp")
        with open(tmp, "wb") as f:
            np.savez(f, **arrays)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)

    def kl_estimate(self, rows: list[int]) -> float:
        """KTO's z0 for the data rows ``rows`` on the current parameters:
        max(0, mean(policy KL log-prob - reference KL log-prob))."""
        assert self.ref_kl is not None
        rows = list(rows)
        lp = np.asarray(self.engine.sequence_logps(self.data.kl_batch(_pad(rows, self.cfg.batch_size))), np.float64)
        return float(max(0.0, np.mean(lp[: len(rows)] - self.ref_kl[rows, 0])))

    # -------------------------------------------------------------- evaluation

    def _validation(self) -> list[tuple[Any, list[int]]]:
        """(batch, its real rows) of every validation chunk (``eval_batches``
        at most): the last filled up with loss-free copies (module docstring)."""
        data, P = self.data, self.cfg.batch_size
        out: list[tuple[Any, list[int]]] = []
        for chunk in self._chunks(range(data.n_train, data.n_windows)):
            if self.cfg.eval_batches and len(out) >= self.cfg.eval_batches:
                break
            b = self.rdata.batch(_pad(chunk, P))
            k = len(chunk)
            if k < P:
                pad = [q * P + j for q in range(data.rows_per_item) for j in range(k, P)]
                for name in ("loss_mask", "completion_mask"):
                    a = getattr(b, name, None)
                    if a is not None:
                        a[pad] = 0.0
                if b.ref_logps is not None:
                    b.ref_logps[pad] = 0.0
            out.append((b, chunk))
        return out

    def evaluate(self) -> float | None:
        if not self.val_sets:
            return None
        tot, n = 0.0, 0
        sums: dict[str, float] = {}
        for i, (b, rows) in enumerate(self.val_sets):
            if self.ref_kl is not None:
                b.kl = self.kl_estimate(rows)
            loss, metrics = self.engine.evaluate_objective(b)
            k = len(rows)
            tot += float(loss) * k
            n += k
            for key, v in metrics.items():
                sums[key] = sums.get(key, 0.0) + float(v) * k
            self.eval_progress(i + 1, len(self.val_sets))
        loss = tot / max(1, n)
        self.last_val = loss
        mean = {k: v / max(1, n) for k, v in sums.items()}
        step = self.engine.step
        self.writer.event("eval", step=step, name="val", loss=loss, examples=n, **mean)
        if self.hooks.note:
            acc = f", preference accuracy {mean['accuracy']:.1%}" if "accuracy" in mean else ""
            margin = f", margin {mean['margin']:.4f}" if "margin" in mean else ""
            self.hooks.note(f"step {step}: validation loss {loss:.4f}{acc}{margin}")
        return loss

    def sample(self) -> None:
        """A greedy completion of the first validation prompt (or
        ``sample_prompt``)."""
        cfg = self.cfg
        if cfg.sample_tokens == 0:
            return
        if cfg.sample_prompt:
            ids = self.tokenizer.encode(cfg.sample_prompt, add_special=False)
        else:
            first = self.data.batch([self.data.n_train if self.data.n_val else 0])
            mask = np.asarray(first.loss_mask[0])
            j = int(np.argmax(mask > 0)) if mask.any() else min(8, cfg.context // 2) - 1
            ids = [int(x) for x in first.tokens[0][: j + 1]]  # the prompt: up to the first completion target
        prompt = self.tokenizer.decode(ids)
        out: list[int] = []
        eos = self.tokenizer.eos_id
        for _ in range(cfg.sample_tokens):
            if len(ids) + len(out) >= cfg.context:
                break
            nxt = int(np.argmax(self.engine.next_token_logits(ids + out)))
            out.append(nxt)
            if nxt == eos:
                break
        self.writer.event("sample", step=self.engine.step, prompt=prompt, text=self.tokenizer.decode(out), greedy=True)

    def stream_peek(self):
        return D.BatchStream(cast(Any, self.rdata), self.cfg.batch_size, self.cfg.seed).next()

    def _diagnostics(self, cfg: TrainConfig, start, ckpt):
        if not cfg.diagnostics.kinds:
            return None
        from toy.train.diagnostics import Diagnostics

        label = "base" if cfg.adapter == "full" else "initial adapters"
        probe = self.val[0] if self.val else self.stream_peek()
        return Diagnostics(
            cfg.diagnostics.kinds,
            cfg.diagnostics.every,
            self.engine,
            reference=start,
            reference_label=label,
            probe=probe,
        )

    def state(self) -> dict[str, Any]:
        return {**super().state(), "reference_digest": getattr(self, "digest", None)}


__all__ = ["FORMATS", "REFERENCE_FILE", "PrefRun", "objective_of", "orpo_batch", "pref_data"]
