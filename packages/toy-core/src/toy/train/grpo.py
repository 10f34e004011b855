"""GRPO (Shao et al. 2024, DeepSeekMath): rollouts from toy's inference
engine, rewards, group-relative advantages, and the run over the shared
step loop (``toy.train.steploop``).

A step (``iterations`` = 1): take the next ``P`` prompts of the seeded
prompt order (``P = batch_size * grad_accum / group``), sample ``group``
completions of each from the current policy, score them
(``toy.train.rewards``), turn the rewards into advantages, and take one
optimizer step of ``toy.train.objectives.GRPOLoss`` over the ``P * group``
rows (``batch_size`` rows a micro-batch). With ``iterations`` = k the same
rollout batch is trained on for k optimizer steps (TRL's
``num_iterations``), its ``old_logps`` fixed at rollout time.

Rollouts (decisions):

- The sampler is toy's inference engine (``toy.engine.llm.LLMEngine``: a
  KV cache, prefill, batched decode) with ``exact_batching`` and an F32 K/V
  cache, built on the training runtime over the training model's own base
  tensors and the training engine's own parameter tensors: no copy of
  anything, no file. LoRA's A/B parameters are the engine's ``lora`` terms
  (``scale · B (A x)``, the training forward's product; the base stays
  quantized under QLoRA); a full fine-tune's trained weights replace the
  base's tensors of those names. Every rollout thus samples the values the
  optimizer has just written, and its logits equal the training forward's
  to float32 rounding (an F16 cache moved them by ~1e-4: a small off-policy
  error, avoided for the price of the cache's size).
- Reproducible and independent of batch composition: completion ``j`` of
  the prompt at data index ``i`` in rollout batch ``k`` is sampled with its
  own seed, ``SeedSequence([seed, k, i, j])`` (``rollout_seed``), by its own
  ``toy.engine.decoding.DecodeState``. Each sequence is prefilled alone in
  its cache slot (``exact_batching``: a token's logits do not depend on the
  chunking) and decoded with the others in one graph whose products are
  row-invariant (``LLMEngine.decode``), so a completion's tokens are the
  same whichever sequences share its steps and however many slots
  (``rollout_slots``) decode at once. Nothing of the sampling is stateful
  beyond the prompt order's cursor, which the checkpoint keeps.
- Sampling: ``temperature``, ``top_p``, ``top_k``, ``min_p`` as given (no
  repetition penalty), at most ``max_new_tokens`` tokens, ending at the
  model's end-of-generation tokens (``<|im_end|>``, EOS). The ending token
  is part of the completion's tokens (it carries loss: the model learns to
  stop), not of its text. A completion cut by ``max_new_tokens`` is
  "truncated"; ``mask_truncated`` takes its loss away (TRL's
  ``mask_truncated_completions``).
- The rows: prompt + completion, one sequence per row
  (``toy.train.prefdata.sequence_batch``), rows of one prompt consecutive
  (its group); ``old_logps`` are the training engine's per-token
  log-probabilities at rollout time (``TrainEngine.token_logps``, of the
  logits divided by the sampling temperature as TRL computes them: with one
  iteration the ratio is then exactly 1 at the step, as TRL's detached
  copy); ``ref_logps`` (only with ``beta`` > 0) the same under the
  starting parameters (``TrainEngine.swapped``: LoRA's initial adapters,
  whose B = 0 makes them the base; a full fine-tune's base weights, kept as
  one F32 copy in host memory).
- Advantages: ``toy.train.rewards.advantages`` (TRL's ``scale_rewards``,
  default "group": ``(r - mean_g) / (std_g + 1e-4)`` with the
  Bessel-corrected std, as ``torch.std`` and TRL's ``nanstd``).

The run bundle: the step event carries the objective's metrics (clip_ratio,
kl with beta > 0) and the rollout batch's: ``reward_mean``, ``reward_std``,
``reward/<name>/mean`` and ``/std``, ``completion_len_mean`` /
``_min`` / ``_max``, ``truncated_ratio``, ``frac_reward_zero_std``;
``rollouts.jsonl`` gets one record per completion when its batch is made
(step = the first optimizer step it trains, prompt, completion, rewards,
advantage, errors: ``rollout_record``); a reward's error is also a
``reward_error`` event. Evaluation (``eval_every``, at step 0 and at the
end): one greedy completion of each validation prompt, an ``eval`` event
named ``val_reward`` with the mean reward, each reward's mean, and
``accuracy`` (the share of completions whose summed reward is > 0).

Exact resume: the checkpoint state holds the prompt order's cursor and,
when a rollout batch is only partly trained (``iterations`` > 1), the
batch itself (its sequences, advantages, old and reference log-probs,
bit-exact through JSON floats); the sampling seeds are functions of the
run's seed and counters. So a resumed run trains on the same rows as one
that never stopped. ``rollouts.jsonl`` then repeats the records of the
rollout batches made again after the checkpoint (identical ones; a reader
takes the last record of a (rollout, row)).

One rank only (the objective's rule).
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

import toy_ggml
from toy.engine.decoding import DecodeState
from toy.engine.llm import LLMEngine
from toy.engine.sampling import SamplingParams
from toy.errors import BadInputError, DataError
from toy.gguf import GGUFFile, bind_tensors
from toy.runs import RunWriter, report, runs_dir
from toy.runs.folder import RunLock
from toy.train import checkpoint, recipes
from toy.train import data as D
from toy.train import distributed as dist
from toy.train.config import TrainConfig, to_dict
from toy.train.objectives import GRPOLoss
from toy.train.prefdata import PrefBatch, PrefExample, PromptData, load_pref, sequence_batch
from toy.train.rewards import RewardSet, Scores, advantages, reward_stats
from toy.train.stepgraph import TrainEngine
from toy.train.steploop import Hooks, StepRun, bundle_error

F32 = toy_ggml.GGMLType.F32
#: the name of the rollout records in a run bundle
ROLLOUTS = "rollouts.jsonl"
_SEED_TAG = 0x6772706F  # "grpo": keeps these seeds apart from the run's other seeded draws


def rollout_seed(seed: int, rollout: int, prompt: int, sample: int) -> int:
    """The sampling seed of completion ``sample`` of the prompt at data index
    ``prompt`` in rollout batch ``rollout`` (63 bits)."""
    state = np.random.SeedSequence([int(seed), _SEED_TAG, int(rollout), int(prompt), int(sample)])
    return int(state.generate_state(1, np.uint64)[0] >> np.uint64(1))


# -- the sampler ------------------------------------------------------------------


@dataclass
class Rollout:
    """One completion: ``tokens`` the generated ids (the ending token
    included), ``text`` (without it), ``finish`` "stop" or "length"."""

    prompt: int  # the prompt's index in the run's data
    sample: int
    prompt_ids: np.ndarray
    tokens: list[int]
    text: str
    finish: str
    seed: int

    @property
    def truncated(self) -> bool:
        return self.finish == "length"


class RolloutEngine:
    """Sampling from the policy being trained (module docstring): an
    ``LLMEngine`` over the base ``weights`` (name -> bound tensor) on
    ``runtime`` and the ``trained`` parameter tensors themselves (the
    training engine's ``params``, on the same runtime: read at every
    compute, never copied). ``lora``: {adapted weight name: (A param name,
    B param name)} and ``scale`` for a LoRA run; without it the trained
    tensors are whole weights that replace the base's (a full fine-tune)."""

    def __init__(
        self,
        model_cfg,
        weights: Mapping[str, toy_ggml.Tensor],
        runtime: toy_ggml.Runtime,
        tokenizer,
        trained: Mapping[str, toy_ggml.Tensor],
        *,
        n_ctx: int,
        n_slot: int,
        lora: Mapping[str, tuple[str, str]] | None = None,
        scale: float = 1.0,
    ):
        self.cfg, self.tokenizer = model_cfg, tokenizer
        base = dict(weights)
        terms = None
        if lora is not None:
            terms = {w: [(trained[a], trained[b], float(scale), None)] for w, (a, b) in lora.items()}
        else:
            base.update(trained)  # the trained weights replace the file's
        self.engine: LLMEngine | None = LLMEngine(
            model_cfg, base, runtime, n_ctx, n_slot, n_batch=512, kv_type="f32", exact_batching=True, lora=terms
        )

    def logits(self, ids: Sequence[int]) -> np.ndarray:
        """(len(ids), V) logits of every position (slot 0, emptied after)."""
        eng = self._eng
        eng.cache.truncate(0, 0)
        try:
            return eng.prefill(0, list(ids), all_logits=True)
        finally:
            eng.cache.truncate(0, 0)

    @property
    def _eng(self) -> LLMEngine:
        assert self.engine is not None
        return self.engine

    def generate(self, requests: Sequence[tuple[int, int, np.ndarray, SamplingParams]]) -> list[Rollout]:
        """One completion per request (prompt index, sample index, prompt ids,
        params with their seed), in request order. Sequences take the free
        slots in order; each is prefilled alone, then decoded with the others."""
        eng = self._eng
        n_vocab = self.cfg.n_vocab
        out: list[Rollout | None] = [None] * len(requests)
        pending = list(range(len(requests)))[::-1]
        active: dict[int, tuple[int, DecodeState, list[str]]] = {}
        free = list(range(eng.n_slot))[::-1]

        def advance(slot: int, logits: np.ndarray) -> None:
            i, st, text = active[slot]
            step = st.advance(logits)
            if step.text:
                text.append(step.text)
            if st.done:
                text.append(st.finish())
                p_i, s_i, ids, params = requests[i]
                assert params.seed is not None
                out[i] = Rollout(
                    p_i, s_i, ids, list(st.tokens), "".join(text), st.finish_reason or "length", params.seed
                )
                del active[slot]
                eng.cache.truncate(slot, 0)
                free.append(slot)

        while pending or active:
            while pending and free:
                i = pending.pop()
                slot = free.pop()
                _, _, ids, params = requests[i]
                eng.cache.truncate(slot, 0)
                st = DecodeState(params, self.tokenizer, n_vocab, [int(t) for t in ids], count_stop_token=True)
                active[slot] = (i, st, [])
                advance(slot, eng.prefill(slot, ids))
            if not active:
                continue
            slots = sorted(active)
            rows = eng.decode(slots, [active[s][1].tokens[-1] for s in slots])
            for s, row in zip(slots, rows, strict=True):
                advance(s, row)
        return [r for r in out if r is not None]

    def close(self) -> None:
        if self.engine is not None:
            self.engine.close()
            self.engine = None


# -- rollout batches --------------------------------------------------------------


@dataclass
class RolloutBatch:
    """A rollout batch as trained: ``key`` (its index: step // iterations),
    the micro-batches (``PrefBatch`` with advantages, old_logps and, with
    beta > 0, ref_logps) and the step metrics it adds."""

    key: int
    batches: list[PrefBatch]
    metrics: dict[str, float | None]

    def to_state(self) -> dict[str, Any]:
        """JSON-safe: what rebuilding it needs (sequences, masks, floats exactly)."""
        rows = []
        for b in self.batches:
            for r in range(b.tokens.shape[0]):
                m = int(np.count_nonzero(b.doc[r] == 0))
                keep = np.flatnonzero(b.loss_mask[r] > 0)
                rows.append(
                    {
                        "seq": [int(x) for x in b.tokens[r, :m]] + [int(b.targets[r, m - 1])],
                        "loss": [int(x) for x in keep],
                        "adv": float(b.advantages[r]) if b.advantages is not None else 0.0,
                        "old": [float(x) for x in b.old_logps[r, keep]] if b.old_logps is not None else None,
                        "ref": [float(x) for x in b.ref_logps[r, keep]] if b.ref_logps is not None else None,
                    }
                )
        return {
            "key": self.key,
            "rows": rows,
            "per_batch": int(self.batches[0].tokens.shape[0]),
            "metrics": self.metrics,
        }

    @classmethod
    def from_state(cls, st: Mapping[str, Any], context: int) -> RolloutBatch:
        rows, per = st["rows"], int(st["per_batch"])
        batches = []
        for a in range(0, len(rows), per):
            chunk = rows[a : a + per]
            seqs = []
            for row in chunk:
                seq = np.asarray(row["seq"], np.int32)
                loss = np.zeros(len(seq), bool)
                loss[np.asarray(row["loss"], np.int64) + 1] = True
                seqs.append((seq, loss))
            b = sequence_batch(seqs, context)
            b.advantages = np.array([row["adv"] for row in chunk], np.float32)
            for name in ("old", "ref"):
                if chunk[0][name] is None:
                    continue
                arr = np.zeros(b.tokens.shape, np.float32)
                for r, row in enumerate(chunk):
                    arr[r, np.asarray(row["loss"], np.int64)] = np.asarray(row[name], np.float32)
                setattr(b, "old_logps" if name == "old" else "ref_logps", arr)
            batches.append(b)
        return cls(int(st["key"]), batches, dict(st.get("metrics") or {}))


class _Rows:
    """The prompt data as ``BatchStream`` sees it: a batch is its row indices."""

    def __init__(self, data: PromptData):
        self.data = data
        self.n_train = data.n_train

    def check_batch(self, batch_size: int) -> None:
        self.data.check_batch(batch_size)

    def batch(self, rows) -> np.ndarray:
        return np.asarray(rows, np.int64)


class _Stream:
    """What the step loop draws micro-batches from: the micro-batches of the
    current rollout batch, a new one made when the step moves past it."""

    def __init__(self, run: GRPORun, prompts: D.BatchStream, current: RolloutBatch | None):
        self.run, self.prompts, self.current = run, prompts, current
        self._i = 0

    def next(self) -> PrefBatch:
        key = self.run.engine.step // self.run.gc.iterations
        if self.current is None or self.current.key != key:
            self.current = self.run.make_rollouts(key, np.asarray(self.prompts.next()))
            self._i = 0
        b = self.current.batches[self._i % len(self.current.batches)]
        self._i += 1
        return b

    @property
    def epoch(self) -> float:
        return self.prompts.epoch

    def state(self) -> dict:
        return self.prompts.state()


class _Objective(GRPOLoss):
    """GRPOLoss whose step metrics also carry the rollout batch's."""

    extra: dict[str, float | None] = {}

    def metrics(self) -> dict[str, float]:
        return {**super().metrics(), **{k: v for k, v in self.extra.items() if v is not None}}


# -- data ---------------------------------------------------------------------------


def example_dict(ex: PrefExample) -> dict[str, Any]:
    """The prompt line's JSON object, as the rewards get it."""
    return {"prompt": ex.raw_prompt, **ex.fields}


def prompt_data(cfg: TrainConfig, tokenizer, template) -> tuple[PromptData, dict[str, Any]]:
    """The GRPO run's prompts (``recipes.setup``'s data loader): the prompts
    JSONL, each prompt short enough to leave ``max_new_tokens``."""
    if not cfg.data.paths:
        raise BadInputError("no prompts: give a JSONL file of prompts (data.paths)")
    gc = cfg.grpo
    room = cfg.context + 1 - gc.max_new_tokens
    if room < 1:
        raise BadInputError(
            f"grpo.max_new_tokens={gc.max_new_tokens} leaves no room for a prompt in context={cfg.context}",
            hint="raise --context or lower --max-new-tokens",
        )
    examples, stats = load_pref(
        cfg.data.paths,
        tokenizer,
        template,
        format="prompts",
        max_length=cfg.context + 1,
        special_in_content=cfg.data.special_in_content,
    )
    for ex in examples:
        if len(ex.prompt) > room:
            raise DataError(
                f"{ex.source}:{ex.line}: the prompt has {len(ex.prompt)} tokens; with max_new_tokens "
                f"{gc.max_new_tokens} a row of context {cfg.context} holds at most {room}",
                hint="raise --context, lower --max-new-tokens, or shorten the prompt",
            )
    data = PromptData(examples, cfg.context, val_fraction=cfg.data.val_fraction, seed=cfg.seed)
    info = {
        **dataclasses.asdict(stats),
        "train_prompts": data.n_train,
        "val_prompts": data.n_val,
        "note": f"data: {stats.n_examples} prompts ({data.n_train} for training, {data.n_val} held out), "
        f"{stats.n_tokens:,} prompt tokens",
    }
    return data, info


# -- the run ------------------------------------------------------------------------


class GRPORun(StepRun):
    """A GRPO run (``lmrun.train``/``resume`` hand a ``grpo`` recipe here)."""

    unit = "completions"
    eval_at_start = True

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
        from toy.train.lmrun import _runtime

        self.cfg, self.hooks, self.lock = cfg, hooks, lock
        self.world = world = world or dist.World()
        if world.distributed:
            raise BadInputError("GRPO trains on one rank", hint="run it without --ranks")
        if cfg.diagnostics.kinds or getattr(cfg, "trace", None):
            raise BadInputError(
                "training diagnostics and step traces are not available for GRPO runs",
                hint="run without --diagnostics / --trace",
            )
        self.gc = gc = cfg.grpo.validate() if hasattr(cfg.grpo, "validate") else cfg.grpo
        rows = cfg.batch_size * cfg.grad_accum
        if rows % gc.group:
            raise BadInputError(
                f"a step's {rows} rows (batch_size {cfg.batch_size} x grad_accum {cfg.grad_accum}) are not whole "
                f"groups of {gc.group} completions",
                hint="make batch_size * grad_accum a multiple of grpo.group",
            )
        self.n_prompts = rows // gc.group
        self.rewards = RewardSet(gc.rewards, gc.reward_weights)  # before anything heavy: a bad reward fails fast
        self.runtime = _runtime(cfg, world)
        self.setup = None
        self.rollout = None
        st = ckpt.state if ckpt else {}
        notes = list(notes or [])
        try:
            s = self.setup = recipes.setup(cfg, self.runtime, st if ckpt else None, data=prompt_data)
            self.tok_meta, self.tokenizer, self.model_cfg = s.tok_meta, s.tokenizer, s.model_cfg
            self.data: PromptData = s.data
            self.rewards.check_examples(
                [example_dict(e) for e in self.data.examples], [f"{e.source}:{e.line}" for e in self.data.examples]
            )
            self.data.check_batch(self.n_prompts)
            if ckpt:
                checkpoint.check_state(ckpt, s.train_model.param_specs(), counters=("completions_seen",))
            self.objective = _Objective(
                beta=gc.beta,
                epsilon=gc.epsilon,
                epsilon_high=gc.epsilon_high,
                loss_type=gc.loss_type,
                max_completion_length=gc.max_new_tokens,
                temperature=gc.temperature,  # TRL: the loss's log-probs are of logits / temperature
            )
            self.engine = TrainEngine(
                s.train_model,
                ckpt.params if ckpt else s.params,
                self.runtime,
                cfg.optim,
                batch=cfg.batch_size,
                context=cfg.context,
                accum=cfg.grad_accum,
                objective=self.objective,
            )
            self.reference = s.params  # the starting values: LoRA's initial adapters (B = 0), the base weights
            self.sampler = self._sampler(cfg, s)
        except BaseException:
            self._close_partial()
            raise
        if ckpt:
            self.engine.load_state(ckpt.params, ckpt.optimizer, ckpt.step)
        prompts = D.BatchStream(_Rows(self.data), self.n_prompts, cfg.seed, state=st.get("data"))  # type: ignore[arg-type]
        current = RolloutBatch.from_state(st["rollout"], cfg.context) if st.get("rollout") else None
        if current is not None:  # a partly trained rollout batch: its metrics go on with it
            self.objective.extra = current.metrics
        self.stream = _Stream(self, prompts, current)
        self.seen = int(st.get("completions_seen", 0))
        self.n_params = int(sum(int(np.prod(p.shape)) for p in self.engine.specs))
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
                    n_params=self.n_params,
                    data={k: v for k, v in s.data_info.items() if k != "note"},
                    tokenizer=s.tok_source,
                    objective=self.objective.describe(),
                    rewards=[{"label": r.label, "spec": r.spec, "weight": r.weight} for r in self.rewards.rewards],
                    rollout={
                        "engine": "toy.engine.llm",
                        "slots": self.sampler.engine.n_slot if self.sampler.engine else 0,
                    },
                )
                self.lock = RunLock(self.writer.dir)
                report.attach(self.writer, cfg.report)
            self.notes([*notes, *s.notes])
        except BaseException as e:
            self._close_partial()
            if self.lock is not None:
                self.lock.release()
            if isinstance(e, OSError):
                raise bundle_error(e, ckpt is not None, e.filename or (resume_from or runs_dir(cfg.out))) from e
            raise
        self.init_counters(ckpt)
        self.per_step = rows
        self.val_prompts = list(range(self.data.n_train, self.data.n_windows))
        if cfg.eval_batches:
            self.val_prompts = self.val_prompts[: cfg.eval_batches * self.n_prompts]

    # -------------------------------------------------------------- set-up pieces

    def _sampler(self, cfg: TrainConfig, s) -> RolloutEngine:
        """The rollout engine over the training model's base tensors and the
        training engine's parameter tensors (module docstring)."""
        gc = self.gc
        slots = gc.rollout_slots or min(cfg.batch_size * cfg.grad_accum, 32)
        n_ctx = cfg.context + 1
        if self.model_cfg.context_length:
            n_ctx = min(n_ctx, self.model_cfg.context_length)
        trained = self.engine.params
        lora_settings = getattr(s.train_model, "settings", None)
        if lora_settings is not None:  # LoraTrain
            pairs = {
                n.removesuffix(".lora_a"): (n, n.removesuffix(".lora_a") + ".lora_b")
                for n in trained
                if n.endswith(".lora_a")
            }
            return RolloutEngine(
                self.model_cfg, s.train_model.base, self.runtime, self.tokenizer, trained,
                n_ctx=n_ctx, n_slot=slots, lora=pairs, scale=lora_settings.scale,
            )  # fmt: skip
        gf = GGUFFile(s.start["base"]["path"])  # a full fine-tune: the file's tensors for what is not trained
        s.closers.append(gf.close)
        bound = bind_tensors(gf, self.runtime)
        s.closers.append(bound.close)
        return RolloutEngine(
            self.model_cfg, bound.tensors, self.runtime, self.tokenizer, trained, n_ctx=n_ctx, n_slot=slots
        )

    def _close_partial(self) -> None:
        for name in ("sampler", "engine"):
            obj = getattr(self, name, None)
            if obj is not None:
                obj.close()
        if self.setup is not None:
            self.setup.close()
        if getattr(self, "runtime", None) is not None:
            self.runtime.close()

    def params(self, temperature: float | None = None, seed: int = 0) -> SamplingParams:
        gc = self.gc
        if temperature == 0:
            return SamplingParams.greedy(max_tokens=gc.max_new_tokens, seed=seed)
        return SamplingParams(
            temperature=gc.temperature,
            top_k=gc.top_k,
            top_p=gc.top_p,
            min_p=gc.min_p,
            seed=seed,
            max_tokens=gc.max_new_tokens,
        ).validate()

    # -------------------------------------------------------------- rollouts

    def make_rollouts(self, key: int, prompt_rows: np.ndarray) -> RolloutBatch:
        """Rollout batch ``key`` for the prompts at data indices ``prompt_rows``:
        sample, score, write the records, build the micro-batches."""
        cfg, gc, eng = self.cfg, self.gc, self.engine
        t0 = time.perf_counter()
        exs = self.data.prompts(prompt_rows)
        requests = [
            (int(i), j, ex.prompt, self.params(seed=rollout_seed(cfg.seed, key, int(i), j)))
            for i, ex in zip(prompt_rows, exs, strict=True)
            for j in range(gc.group)
        ]
        rolls = self.sampler.generate(requests)
        t_gen = time.perf_counter() - t0
        by_row = [exs[k // gc.group] for k in range(len(rolls))]
        texts = [self.tokenizer.decode(r.prompt_ids) for r in rolls]
        scores = self.rewards.score([r.text for r in rolls], [example_dict(e) for e in by_row], texts)
        adv = advantages(scores.total, gc.group, gc.scale_rewards)
        step = eng.step + 1  # the first step that trains on it
        self._write_rollouts(key, step, rolls, by_row, texts, scores, adv)
        # rows: prompt + completion; loss on the completion (none on a truncated one with mask_truncated)
        masked = [gc.mask_truncated and r.truncated for r in rolls]
        if all(masked):
            masked = [False] * len(rolls)
            self.writer.event("note", step=step, text="every completion was truncated: mask_truncated ignored")
        seqs = []
        for r, m in zip(rolls, masked, strict=True):
            comp = np.asarray(r.tokens, np.int32)
            seq = np.concatenate([r.prompt_ids, comp])
            loss = np.concatenate([np.zeros(len(r.prompt_ids), bool), np.full(len(comp), not m)])
            seqs.append((seq, loss))
        B = cfg.batch_size
        batches = []
        for a in range(0, len(seqs), B):
            b = sequence_batch(seqs[a : a + B], cfg.context)
            b.advantages = adv[a : a + B].copy()
            b.old_logps = eng.token_logps(b)
            if gc.beta > 0:
                with eng.swapped(self.reference):
                    b.ref_logps = eng.token_logps(b)
            batches.append(b)
        lengths = np.array([len(r.tokens) for r in rolls])
        std_g = np.array(
            [np.std(g[~np.isnan(g)]) if (~np.isnan(g)).sum() else np.nan for g in scores.total.reshape(-1, gc.group)]
        )
        metrics: dict[str, float | None] = {
            **reward_stats(scores, self.rewards.labels),
            "completion_len_mean": float(lengths.mean()),
            "completion_len_min": float(lengths.min()),
            "completion_len_max": float(lengths.max()),
            "truncated_ratio": float(np.mean([r.truncated for r in rolls])),
            "frac_reward_zero_std": float(np.mean(np.isclose(np.nan_to_num(std_g), 0.0))),
            "rollout_s": t_gen,
            "rollout_tokens_per_s": float(lengths.sum() / t_gen) if t_gen > 0 else None,
        }
        self.objective.extra = metrics
        return RolloutBatch(key, batches, metrics)

    def _write_rollouts(self, key, step, rolls, exs, prompts, scores: Scores, adv) -> None:
        labels = self.rewards.labels
        lines = []
        for k, r in enumerate(rolls):
            ex = exs[k]
            rec = rollout_record(key, step, r, ex, prompts[k], labels, scores, k, float(adv[k]))
            lines.append(json.dumps(rec, ensure_ascii=False))
            for err in scores.errors[k]:
                self.writer.event(
                    "reward_error", step=step, reward=err["reward"], source=ex.source, line=ex.line,
                    sample=r.sample, error=err["error"],
                )  # fmt: skip
        path = self.writer.dir / ROLLOUTS
        with open(path, "a", encoding="utf-8") as f:
            f.write("\n".join(lines) + "\n")
            f.flush()

    # -------------------------------------------------------------- the loop's part

    def evaluate(self) -> float | None:
        """Greedy completions of the validation prompts: their mean reward."""
        if not self.val_prompts:
            return None
        n_slot = self.sampler._eng.n_slot
        per: list[np.ndarray] = []
        totals: list[np.ndarray] = []
        done = 0
        for a in range(0, len(self.val_prompts), n_slot):
            rows = self.val_prompts[a : a + n_slot]
            exs = self.data.prompts(rows)
            rolls = self.sampler.generate([(i, 0, ex.prompt, self.params(0)) for i, ex in zip(rows, exs, strict=True)])
            texts = [self.tokenizer.decode(r.prompt_ids) for r in rolls]
            sc = self.rewards.score([r.text for r in rolls], [example_dict(e) for e in exs], texts)
            per.append(sc.per_reward)
            totals.append(sc.total)
            done += len(rows)
            self.eval_progress(done, len(self.val_prompts))
        total = np.concatenate(totals)
        per_r = np.concatenate(per)
        scored = total[~np.isnan(total)]
        mean = float(scored.mean()) if len(scored) else None
        fields: dict[str, Any] = {f"reward/{lab}": _nanmean(per_r[:, k]) for k, lab in enumerate(self.rewards.labels)}
        step = self.engine.step
        acc = float(np.mean(np.nan_to_num(total) > 0))
        self.writer.event("eval", step=step, name="val_reward", reward=mean, accuracy=acc, prompts=len(total), **fields)
        if self.hooks.note:
            self.hooks.note(
                f"step {step}: validation reward {mean if mean is None else round(mean, 4)}, accuracy {acc:.3f}"
            )
        return mean

    def state(self) -> dict[str, Any]:
        cur = self.stream.current
        partly = cur is not None and (self.engine.step % self.gc.iterations) != 0
        return {
            "config": to_dict(self.cfg),
            "data": self.stream.state(),
            "completions_seen": self.seen,
            "tokenizer_source": self.setup.tok_source if self.setup else None,
            "ranks": 1,
            "global_micro_batches": self.cfg.grad_accum,
            "rollout": cur.to_state() if partly and cur is not None else None,
            **(self.setup.state if self.setup else {}),
        }

    def checkpoint_kwargs(self) -> dict[str, Any]:
        assert self.setup is not None
        return {"cfg": self.model_cfg, "tokenizer_metadata": self.tok_meta, "write_model": self.setup.write_model}

    def close(self) -> None:
        self.sampler.close()
        self.engine.close()
        if self.setup is not None:
            self.setup.close()
        self.runtime.close()


def _nanmean(x: np.ndarray) -> float | None:
    x = x[~np.isnan(x)]
    return float(x.mean()) if len(x) else None


def rollout_record(
    key: int, step: int, r: Rollout, ex: PrefExample, prompt: str, labels, scores: Scores, k: int, adv: float
) -> dict[str, Any]:
    """One line of ``rollouts.jsonl``."""
    per = scores.per_reward[k]
    total = scores.total[k]
    return {
        "step": step,
        "rollout": key,
        "row": k,
        "prompt_index": r.prompt,
        "sample": r.sample,
        "source": ex.source,
        "line": ex.line,
        "prompt": prompt,
        "completion": r.text,
        "tokens": len(r.tokens),
        "finish": r.finish,
        "seed": r.seed,
        "rewards": {lab: (None if math.isnan(v) else float(v)) for lab, v in zip(labels, per, strict=True)},
        "reward": None if math.isnan(total) else float(total),
        "advantage": adv,
        "errors": scores.errors[k],
    }


def read_rollouts(run_dir: str | Path, step: int | None = None) -> list[dict[str, Any]]:
    """The records of ``rollouts.jsonl`` (the last of a repeated (rollout,
    row): a resumed run writes them again), of one ``step`` when given; a
    torn last line is skipped."""
    path = Path(run_dir) / ROLLOUTS
    if not path.is_file():
        return []
    recs: dict[tuple, dict[str, Any]] = {}
    with open(path, encoding="utf-8") as f:
        for line in f:
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                continue
            if not isinstance(rec, dict):
                continue
            recs[(rec.get("rollout"), rec.get("row"))] = rec
    out = list(recs.values())
    if step is not None:
        out = [r for r in out if r.get("step") == step]
    return out


__all__ = [
    "ROLLOUTS",
    "GRPORun",
    "Rollout",
    "RolloutBatch",
    "RolloutEngine",
    "example_dict",
    "prompt_data",
    "read_rollouts",
    "rollout_record",
    "rollout_seed",
]
