"""The training step engine: loss, backward, clipping, AdamW, accumulation.

Architecture-generic: a ``TrainModel`` supplies its parameter list and the
graph from a batch to logits; the engine supplies everything else. For one
batch of B rows x T tokens (``N = B*T``):

    logits (N, V) = model.logits(ctx, params, inputs)        # rows without a target zeroed
    ce            = cross_entropy_loss(logits, labels)   # = sum(nll) / N
    loss          = ce * loss_scale                               # loss_scale = N / n_targets(step)

``n_targets(step)`` counts the target tokens of ALL micro-batches of the
optimizer step, so with gradient accumulation the summed micro-batch losses
(and gradients) are the mean NLL over every target token of the step, not a
mean of micro-batch means. Rows without a target (``loss_mask`` 0: padding,
the position after a document's end) get a zero one-hot row and are zeroed
before the head, so they add nothing to the loss or to any gradient.

The labels are the targets' ids (patch 0030: ``cross_entropy_loss`` with I32
labels, -1 for a row without a target) where every backend has toy's CPU ops
(``Runtime.toy_ops``), with the same loss and gradient bits as one-hot rows
and without uploading an (N, V) matrix each micro-batch; one-hot F32 rows
(smoothed ones with label smoothing) on a GPU, with label smoothing, and
with an objective (whose log-probs multiply the rows).

Graphs (built once, reused; a step is data uploads plus one compute each):

- ``single`` (no accumulation): forward, backward, clip, AdamW;
- ``first`` / ``middle``: forward, backward, gradients copied / added into
  persistent accumulators;
- ``last``: forward, backward, accumulator + gradient, clip, AdamW;
- ``eval``: forward and the summed NLL only.

Clipping scales every gradient by ``min(1, clip / (norm + 1e-6))`` where
``norm`` is the global L2 norm (reported as ``grad_norm``, before clipping).
AdamW is ggml's ``opt_step_adamw`` (PyTorch's decoupled weight decay), with
one hyper-parameter vector for decayed tensors and one for the rest. The
norm's sums of squares and the clipping go through patch 0017: ``sum_sqr``
(one threaded pass, no squared copy) and the step's ``scale`` (the factor
applied inside AdamW, no scaled copy of each gradient), each bit-identical
to the separate ops it replaces.

Inputs (``Feed``). What a batch uploads besides the labels is the model's
``feed`` (optional; default ``TokenFeed``: token ids, positions, the
block-causal mask and the keep column of a (B, T) token batch). A model
that is not a language model (the ViT of toy-vit) gives its own feed: its
input tensors, how a batch object fills them, and how many logits rows N
a (B, T) micro-batch has (a classifier: one row per image, T = 1). Every
batch object has ``targets`` and ``loss_mask`` (N values, any shape);
the engine builds the label rows from them.

Label smoothing (``label_smoothing`` = e, default 0): a kept row's label is
``(1 - e) * one_hot + e / V`` instead of the one-hot row, so the loss is
PyTorch's ``cross_entropy(..., label_smoothing=e)``. With e = 0 the labels
are exactly the one-hot rows.

Memory: parameters and the two AdamW moments live in one allocated
context on the runtime's device (3x the F32 model); activations and
gradients come from the runtime's scheduler, which reuses memory between
nodes; accumulators (only with accumulation) add 1x.

Several ranks (``world``, a ``toy.train.distributed.World`` of size N > 1):
a step takes ``accum * N`` micro-batches in the one-process order and this
rank computes the contiguous block ``[rank * accum, (rank + 1) * accum)``
into its accumulators (graphs ``first`` / ``middle``; the loss scale counts
the targets of all of them). Then ``World.reduce_owned`` sums the
accumulators in rank order for the tensors this rank owns, the ``dist_sq``
graph takes their ``sum_sqr``, every rank receives every tensor's sum of
squares and adds them in parameter order in float32 (the one-process
graph's additions), the clipping factor is computed in float32 as the
graph computes it, the ``dist_apply`` graph runs AdamW on the owned
tensors with that factor, and ``World.gather_owned`` brings every rank the
other ranks' updated tensors. AdamW moments exist only for owned tensors
(ZeRO-1); ``optimizer_state`` gathers them (a collective: every rank calls
it). With one micro-batch per rank the step is bit-identical to a
one-process step with ``accum = N``; with more, the fold is per rank, then
over ranks, so the bits are those of another (fixed) order.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

import toy_ggml
from toy import models
from toy.models.common import block_causal_mask, causal_mask
from toy.train.distributed import World, owners
from toy.train.objectives import Objective, target_logps, target_logps_from_ids
from toy.train.optim import OptimConfig, adamw_hparams

F32 = toy_ggml.GGMLType.F32
I32 = toy_ggml.GGMLType.I32


@dataclass(frozen=True)
class ParamSpec:
    name: str
    shape: tuple[int, ...]
    kind: str  # one of toy.models.KINDS: "matrix", "residual", "embedding", "position", "norm", …

    def decays(self, optim: OptimConfig) -> bool:
        """Whether AdamW's weight decay applies (matrices; token and position
        embeddings only with ``decay_embeddings``; never norm gains, norm
        shifts or biases)."""
        return self.kind in ("matrix", "residual") or (
            self.kind in ("embedding", "position") and optim.decay_embeddings
        )


class TrainModel(Protocol):
    """What an architecture gives the engine. ``n_vocab`` is the width of
    a logits row (the vocabulary; the class count of a classifier).
    Optional: ``feed``, the model's ``Feed`` (default ``TokenFeed()``);
    ``gemm`` (default False): the step graphs' F32 products run on toy's
    CPU GEMM (``toy_ggml.Context.mul_mat``'s ``gemm``, gradients included)
    where the runtime computes on the CPU (``Runtime.cpu_gemm``); the
    model's ``logits`` reads ``ctx.gemm`` to know."""

    n_vocab: int

    def param_specs(self) -> list[ParamSpec]: ...

    def logits(
        self, ctx: toy_ggml.Context, params: Mapping[str, toy_ggml.Tensor], inputs: Any, training: bool = True
    ) -> toy_ggml.Tensor:
        """Logits (N, V) of a batch; rows where ``inputs.keep`` is 0 must
        not reach any weight's gradient. ``inputs``: what the model's feed
        makes (``BatchInputs`` for ``TokenFeed``). ``training`` is False for the
        evaluation and sampling graphs (no dropout).

        Optional: ``before_compute(step, micro)``, called before each
        training micro-batch's compute (e.g. to draw dropout masks)."""
        ...


@dataclass
class BatchInputs:
    """The input tensors of a (B, T) batch graph (an allocated context)."""

    batch: int
    context: int
    tokens: toy_ggml.Tensor  # I32 (N,)
    pos: toy_ggml.Tensor  # I32 (N,)
    mask: toy_ggml.Tensor  # F32 (B, 1, T, T) additive attention mask
    keep: toy_ggml.Tensor  # F32 (N, 1): 1 where the row has a target
    # the masks of a model with sliding windows: window -> F32 (B, 1, T, T)
    window_masks: dict[int, toy_ggml.Tensor] = field(default_factory=dict)

    @property
    def masks(self):
        """What ``forward_batch`` takes: the mask, or ``{window: mask}``
        (window 0: ``mask``) for a model with sliding windows."""
        return {0: self.mask, **self.window_masks} if self.window_masks else self.mask


class Feed(Protocol):
    """The input side of a model's batch graph (see the module docstring)."""

    def rows(self, batch: int, context: int) -> int:
        """Logits rows N of a (batch, context) micro-batch."""
        ...

    def make(self, ctx: toy_ggml.Context, batch: int, context: int) -> Any:
        """The input tensors, created in ``ctx`` (allocated afterwards by
        the engine); the object is what ``TrainModel.logits`` gets."""
        ...

    def upload(self, inputs: Any, batch: Any) -> None:
        """Set the input tensors from a batch object."""
        ...


class TokenFeed:
    """The language models' feed: a ``toy.train.data.Batch`` of (B, T)
    token ids, positions and document ids. ``windows``: the sliding windows
    of the model's layers (``arch.windows(cfg)``), each a mask of its own."""

    def __init__(self, windows=()):
        self.windows = tuple(w for w in windows if w)

    @classmethod
    def for_config(cls, cfg) -> TokenFeed:
        return cls(models.language_model_of(cfg).windows(cfg))

    def rows(self, batch: int, context: int) -> int:
        return batch * context

    def make(self, ctx: toy_ggml.Context, batch: int, context: int) -> BatchInputs:
        if context < 2:
            raise ValueError(f"context={context} out of range (a token batch needs at least 2)")
        n = batch * context
        return BatchInputs(
            batch,
            context,
            ctx.tensor(I32, (n,), name="tokens"),
            ctx.tensor(I32, (n,), name="pos"),
            ctx.tensor(F32, (batch, 1, context, context), name="mask"),
            ctx.tensor(F32, (n, 1), name="keep"),
            {w: ctx.tensor(F32, (batch, 1, context, context), name=f"mask.w{w}") for w in self.windows},
        )

    def upload(self, inputs: BatchInputs, batch) -> None:
        B, T = inputs.batch, inputs.context
        tokens = np.asarray(batch.tokens, np.int32)
        if tokens.shape != (B, T):
            raise ValueError(f"batch of shape {tokens.shape}, the engine was built for ({B}, {T})")
        keep = np.asarray(batch.loss_mask, np.float32).reshape(-1)
        inputs.tokens.set(tokens.reshape(-1))
        inputs.pos.set(np.asarray(batch.pos, np.int32).reshape(-1))
        doc = np.asarray(batch.doc)
        inputs.mask.set(block_causal_mask(doc, block_causal=True))
        for w, t in inputs.window_masks.items():
            t.set(block_causal_mask(doc, block_causal=True, window=w))
        inputs.keep.set((keep > 0).astype(np.float32).reshape(-1, 1))


@dataclass
class StepResult:
    loss: float  # mean NLL over the step's target tokens
    grad_norm: float  # global L2 norm before clipping
    lr: float
    n_targets: int
    # several ranks: this rank's seconds communicating, bytes it sent, (slowest, fastest) rank's compute seconds
    comm_s: float = 0.0
    sent_bytes: int = 0
    rank_s: tuple[float, float] | None = None
    # an objective's metrics of the step (``toy.train.objectives``: rewards, margins, accuracy ...)
    metrics: dict[str, float] = field(default_factory=dict)


class _Graph:
    def __init__(self, ops: toy_ggml.Context, graph: toy_ggml.Graph, loss, loss_seed, norm=None):
        self.ops, self.graph, self.loss, self.loss_seed, self.norm = ops, graph, loss, loss_seed, norm
        self.grads: dict[str, toy_ggml.Tensor] = {}
        # outputs the diagnostics read (toy.train.diagnostics): per-tensor gradient sums of squares and the
        # parameters' sums of squares before the update (single/last), the residual stream after each block
        self.grad_sq: dict[str, toy_ggml.Tensor] = {}
        self.param_sq: dict[str, toy_ggml.Tensor] = {}
        self.taps: list[toy_ggml.Tensor] = []
        self.outputs: dict[str, toy_ggml.Tensor] = {}  # an objective's outputs (its metrics read them)


class TrainEngine:
    """Parameters, optimizer state and the step graphs of one model.

    ``batch`` x ``context`` is the micro-batch shape; ``accum`` micro-batches
    make one optimizer step. ``params`` (name -> F32 array of the spec's
    shape) are the starting values.
    """

    def __init__(
        self,
        model: TrainModel,
        params: Mapping[str, np.ndarray],
        runtime: toy_ggml.Runtime,
        optim: OptimConfig,
        *,
        batch: int,
        context: int,
        accum: int = 1,
        label_smoothing: float = 0.0,
        world: World | None = None,
        objective: Objective | None = None,
    ):
        if batch < 1 or context < 1 or accum < 1:
            raise ValueError(f"batch={batch}, context={context}, accum={accum} out of range")
        if not 0.0 <= label_smoothing < 1.0:
            raise ValueError(f"label_smoothing={label_smoothing} out of range [0, 1)")
        self.model, self.runtime, self.optim = model, runtime, optim.validate()
        self.batch, self.context, self.accum = batch, context, accum
        self.label_smoothing = float(label_smoothing)
        self.feed: Feed = getattr(model, "feed", None) or TokenFeed()
        self.objective = objective
        if objective is not None:
            if not isinstance(self.feed, TokenFeed):
                raise ValueError(f"the {objective.name} objective trains language models (a token feed)")
            if self.label_smoothing:
                raise ValueError(f"label smoothing does not apply to the {objective.name} objective")
            if world is not None and world.distributed:
                raise ValueError(f"the {objective.name} objective trains on one rank")
        self.specs = model.param_specs()
        self.n_vocab = model.n_vocab
        n = self.n_rows = self.feed.rows(batch, context)
        # the labels as target ids (patch 0030: no (N, V) one-hot matrix, the same loss and
        # gradient bits) where every backend has toy's CPU ops and nothing needs whole label rows
        # (label smoothing, an objective's log-probs); else one-hot (or smoothed) F32 rows
        self._label_ids = bool(runtime.toy_ops) and not self.label_smoothing and objective is None
        self._labels_host = np.zeros((0 if self._label_ids else n, self.n_vocab), np.float32)  # dense only
        self._label_cols = np.zeros(n, np.int64)
        self._labels_dense = False  # whether the host labels hold smoothed rows
        self._profile: list[tuple[str, str, float]] | None = None  # node times while profile_step runs
        # whether the model's logits take ``taps`` (the language models; not toy-vit's classifier)
        self.supports_taps = "taps" in inspect.signature(model.logits).parameters
        self._last: _Graph | None = None  # the graph that took the last optimizer step
        self.watch = False  # the step graphs keep what the diagnostics read (``watch_steps``)
        self.world = world if world is not None else World()
        dist = self.world.distributed
        # the owning rank of each parameter (several ranks: AdamW and its moments live on the owner only)
        self.owner = owners([int(np.prod(s.shape)) for s in self.specs], self.world.size)
        self.owned = [s.name for s, o in zip(self.specs, self.owner, strict=True) if o == self.world.rank]
        self._dist_sq: dict[str, float] = {}  # several ranks: every tensor's gradient sum of squares, last step
        # several ranks: host views of (accumulators, parameters); False: not host memory
        self._views: tuple[dict[str, np.ndarray], dict[str, np.ndarray]] | bool | None = None

        # parameters, moments, accumulators and inputs: one allocated context
        n_state = len(self.specs) * (4 if accum > 1 or dist else 3)
        self._state = toy_ggml.Context(max_tensors=n_state + 32)
        st = self._state
        self.params: dict[str, toy_ggml.Tensor] = {}
        self._m: dict[str, toy_ggml.Tensor] = {}
        self._v: dict[str, toy_ggml.Tensor] = {}
        self._acc: dict[str, toy_ggml.Tensor] = {}
        for s in self.specs:
            self.params[s.name] = st.tensor(F32, s.shape, name=s.name).set_param()
            if s.name in self.owned:
                self._m[s.name] = st.tensor(F32, s.shape, name=f"adam_m.{s.name}")
                self._v[s.name] = st.tensor(F32, s.shape, name=f"adam_v.{s.name}")
            if accum > 1 or dist:
                self._acc[s.name] = st.tensor(F32, s.shape, name=f"grad_acc.{s.name}")
        self.inputs = self.feed.make(st, batch, context)
        if self._label_ids:
            self._labels = st.tensor(I32, (n,), name="labels")  # the target, -1 without one
            self._label_rows = st.tensor(I32, (n, 1), name="label_rows")  # the target, 0 without one
        else:
            self._labels = st.tensor(F32, (n, self.n_vocab), name="labels")
        self._loss_scale = st.tensor(F32, (1,), name="loss_scale")
        self._hp = {True: st.tensor(F32, (7,), name="adamw_decay"), False: st.tensor(F32, (7,), name="adamw_no_decay")}
        self._clip = st.tensor(F32, (1,), name="clip")
        self._eps = st.tensor(F32, (1,), name="clip_eps")
        self._factor = st.tensor(F32, (1,), name="clip_factor")  # several ranks: computed on the host
        if objective is not None:
            objective.make(st, batch, context)
        st.allocate(runtime)
        missing = [s.name for s in self.specs if s.name not in params]
        if missing:
            raise ValueError(f"no starting value for {missing[0]!r}")
        for s in self.specs:
            a = np.asarray(params[s.name], np.float32)
            if a.shape != s.shape:
                raise ValueError(f"{s.name}: value of shape {a.shape}, expected {s.shape}")
            self.params[s.name].set(a)
            if s.name in self._m:
                self._m[s.name].set(np.zeros(s.shape, np.float32))
                self._v[s.name].set(np.zeros(s.shape, np.float32))
        self._clip.set(np.array([optim.grad_clip], np.float32))
        self._eps.set(np.array([1e-6], np.float32))
        self.step = 0  # optimizer steps taken
        self._graphs: dict[str, _Graph] = {}
        # one-row forward graphs for samples, by padded length: (inputs' context, inputs, ops, graph, logits)
        _Row = tuple[toy_ggml.Context, BatchInputs, toy_ggml.Context, toy_ggml.Graph, toy_ggml.Tensor]
        self._row: dict[int, _Row] | None = None  # inputs' context, inputs, ops context, graph, logits

    # ------------------------------------------------------------------ graphs

    def _ops_context(self, **kw) -> toy_ggml.Context:
        """A context for a graph's ops, with the model's product kernel (``gemm``)."""
        ops = toy_ggml.Context(**kw)
        ops.gemm = bool(getattr(self.model, "gemm", False)) and self.runtime.cpu_gemm
        ops.toy_ops = self.runtime.toy_ops  # SUM_SQR, OPT_STEP_ADAMW_SCALED only where every backend has them
        return ops

    def _graph_capacity(self) -> int:
        return 200 * len(self.specs) + 4096

    def _build_dist(self, kind: str) -> _Graph:
        """The graphs after a several-rank reduction (the module docstring):
        ``dist_sq`` (the owned accumulators' sums of squares) and
        ``dist_apply`` (AdamW on the owned tensors, the clipping factor an
        input)."""
        cap = self._graph_capacity()
        ops = self._ops_context(max_tensors=cap, graph_size=cap)
        g = toy_ggml.Graph(ops, size=cap)
        out = _Graph(ops, g, None, None)
        if kind == "dist_sq":
            out.grad_sq = {k: ops.sum_sqr(self._acc[k]).set_output() for k in self.owned}
            outs = list(out.grad_sq.values())
        else:
            factor = self._factor if self.optim.grad_clip > 0 else None
            by_name = {s.name: s for s in self.specs}
            outs = [
                ops.opt_step_adamw(
                    self.params[k],
                    self._acc[k],
                    self._m[k],
                    self._v[k],
                    self._hp[by_name[k].decays(self.optim)],
                    factor,
                )
                for k in self.owned
            ]
        if outs:
            g.build_forward(*outs)
        return out

    def _build(self, kind: str) -> _Graph:
        if kind.startswith("dist_"):
            return self._build_dist(kind)
        cap = self._graph_capacity()
        ops = self._ops_context(max_tensors=cap * 8, graph_size=cap * 8)
        # the residual stream after each block: read by activation statistics ("taps": the blocks only,
        # no head) and by the divergence diagnosis (single, last); kept as outputs (buffers not reused)
        watched = self.watch and kind in ("single", "last")
        taps: list[toy_ggml.Tensor] | None = [] if self.supports_taps and (kind == "taps" or watched) else None
        training = kind not in ("eval", "taps")
        if taps is None:
            logits = self.model.logits(ops, self.params, self.inputs, training=training)
        else:
            with_taps: Any = self.model.logits  # TrainModel.logits's optional ``taps`` (supports_taps)
            logits = with_taps(ops, self.params, self.inputs, training=training, taps=taps)
            taps = [t.set_output() for t in taps]
        if kind == "taps":
            assert taps  # a model with taps has blocks
            g = toy_ggml.Graph(ops, size=cap * 4).build_forward(*taps)
            out = _Graph(ops, g, taps[-1], None)
            out.taps = taps
            return out
        if kind == "logps" or (self.objective is not None and kind != "eval"):
            return self._build_objective(kind, ops, logits, taps, cap)
        ce = ops.cross_entropy_loss(logits, self._labels)
        if kind == "eval":
            loss = ops.mul(ce, self._loss_scale).set_output()
            g = toy_ggml.Graph(ops, size=cap * 4).build_forward(loss)
            return _Graph(ops, g, loss, None)
        loss = ops.mul(ce, self._loss_scale).set_loss().set_output()
        return self._build_backward(kind, ops, loss, taps, watched, cap)

    def _build_objective(self, kind: str, ops, logits, taps, cap: int) -> _Graph:
        """The graphs of an objective (``toy.train.objectives``): ``logps``
        (forward: the per-target log-probs), ``objective_eval`` (forward: the
        loss and the objective's outputs) and the training kinds."""
        inp = self.inputs
        scale = float(getattr(self.objective, "logit_scale", 1.0))
        if self._label_ids:  # "logps" of an engine without an objective
            lp = target_logps_from_ids(ops, logits, self._label_rows, inp.keep, inp.batch, inp.context, scale)
        else:
            lp = target_logps(ops, logits, self._labels, inp.keep, inp.batch, inp.context, scale)
        if kind == "logps":
            lp = lp.set_output()
            g = toy_ggml.Graph(ops, size=cap * 4).build_forward(lp)
            out = _Graph(ops, g, None, None)
            out.outputs = {"token_logps": lp}
            return out
        assert self.objective is not None
        loss, outputs = self.objective.loss(ops, lp)
        outputs = {k: v.set_output() for k, v in outputs.items()}
        if kind == "objective_eval":
            loss = loss.set_output()
            g = toy_ggml.Graph(ops, size=cap * 4).build_forward(loss, *outputs.values())
            out = _Graph(ops, g, loss, None)
            out.outputs = outputs
            return out
        loss = loss.set_loss().set_output()
        watched = self.watch and kind in ("single", "last")
        out = self._build_backward(kind, ops, loss, taps, watched, cap, outputs)
        out.outputs = outputs
        return out

    def _build_backward(self, kind: str, ops, loss, taps, watched: bool, cap: int, outputs=None) -> _Graph:
        """The training kinds' graph from the scalar loss: backward, then
        the gradients copied, accumulated or applied (the module docstring)."""
        g = toy_ggml.Graph(ops, size=cap * 8, grads=True)
        g.build_forward(loss, *(taps or []), *(outputs or {}).values())
        g.build_backward()
        seed = g.grad(loss)
        assert seed is not None  # build_backward gives the loss its gradient
        seed.set_input()
        grads = {}
        for s in self.specs:
            gr = g.grad(self.params[s.name])
            if gr is None:
                raise ValueError(f"parameter {s.name!r} gets no gradient from the loss")
            grads[s.name] = gr if gr.is_contiguous else ops.cont(gr)
        outs = []
        norm = None
        if kind == "probe":
            out = _Graph(ops, g, loss, seed)
            out.grads = {k: v.set_output() for k, v in grads.items()}
            g.build_forward(*out.grads.values())
            return out
        if kind in ("first", "middle"):
            for s in self.specs:
                acc = self._acc[s.name]
                src = grads[s.name] if kind == "first" else ops.add(acc, grads[s.name])
                outs.append(ops.cpy(src, acc))
        else:  # single, last: clip and step
            if kind == "last":
                grads = {k: ops.add(self._acc[k], v) for k, v in grads.items()}
            sq = None
            grad_sq, param_sq = {}, {}
            for s in self.specs:
                t = ops.sum_sqr(grads[s.name])  # sum(sqr(g)) bit for bit, one threaded pass (patch 0017)
                grad_sq[s.name] = t.set_output()  # per-tensor gradient norms for the diagnostics, at no extra cost
                sq = t if sq is None else ops.add(sq, t)
                if watched:
                    # the parameter before this step's update (these nodes come before the AdamW nodes): names
                    # a parameter that holds NaN/Inf when the step diverges (AdamW then spreads NaN to every
                    # tensor); a pass over the weights, so only while diagnostics watch the steps
                    param_sq[s.name] = ops.sum_sqr(self.params[s.name]).set_output()
                    param_sq[s.name].name = f"param_sumsq.{s.name}"
            assert sq is not None  # a model has parameters
            if param_sq:
                g.build_forward(*param_sq.values())
            norm = ops.sqrt(sq).set_output()
            outs.append(norm)
            factor = None
            if self.optim.grad_clip > 0:
                factor = ops.clamp(ops.div(self._clip, ops.add(norm, self._eps)), 0.0, 1.0)
            for s in self.specs:
                p = self.params[s.name]
                # the clipping factor is applied inside the step (AdamW on mul(g, factor) bit for bit)
                outs.append(
                    ops.opt_step_adamw(
                        p, grads[s.name], self._m[s.name], self._v[s.name], self._hp[s.decays(self.optim)], factor
                    )
                )
        g.build_forward(*outs)
        out = _Graph(ops, g, loss, seed, norm)
        if kind in ("single", "last"):
            out.grad_sq, out.param_sq, out.taps = grad_sq, param_sq, taps or []
        return out

    def _get(self, kind: str) -> _Graph:
        g = self._graphs.get(kind)
        if g is None:
            g = self._graphs[kind] = self._build(kind)
        return g

    # ------------------------------------------------------------------ data

    def _upload(self, batch, scale: float, smooth: bool = True) -> None:
        self.feed.upload(self.inputs, batch)  # checks the batch's shape
        if self.objective is not None:
            self.objective.upload(batch)
        self._upload_labels(batch, smooth)
        self._loss_scale.set(np.array([scale], np.float32))

    def _upload_labels(self, batch, smooth: bool = False) -> None:
        """The label rows of a batch: one-hot (zero without a target), or
        smoothed (``label_smoothing``, with ``smooth``)."""
        keep = np.asarray(batch.loss_mask, np.float32).reshape(-1)
        targets = np.asarray(batch.targets, np.int64).reshape(-1)
        n = self.n_rows
        if keep.shape != (n,) or targets.shape != (n,):
            raise ValueError(f"batch with {targets.size} targets, the engine was built for {n} rows")
        if ((targets < 0) | (targets >= self.n_vocab))[keep > 0].any():
            raise ValueError(f"a target is outside the vocabulary (the labels 0..{self.n_vocab - 1})")
        rows = np.arange(n)
        lab = self._labels_host
        cols = np.where(keep > 0, targets, 0)
        if self._label_ids:
            self._labels.set(np.where(keep > 0, targets, -1).astype(np.int32))
            self._label_rows.set(cols.astype(np.int32).reshape(n, 1))
            return
        e = self.label_smoothing if smooth else 0.0
        if e > 0.0:
            lab[:] = ((keep > 0) * (e / self.n_vocab)).astype(np.float32)[:, None]
            lab[rows, cols] += np.float32(1.0 - e) * (keep > 0)
        else:
            if self._labels_dense:
                lab[:] = 0.0  # the previous upload was smoothed: every entry was set
            else:
                lab[rows, self._label_cols] = 0.0  # clear the previous batch's ones
            lab[rows, cols] = keep > 0
        self._label_cols, self._labels_dense = cols, e > 0.0
        self._labels.set(lab)

    def _before(self, micro: int) -> None:
        hook = getattr(self.model, "before_compute", None)
        if hook is not None:
            hook(self.step, micro)

    def _run(self, g: _Graph) -> float:
        rt = self.runtime
        rt.allocate(g.graph)
        if g.loss_seed is not None:
            g.loss_seed.set(np.ones(g.loss_seed.shape, np.float32))
        if self._profile is None:
            rt.compute(g.graph)
        else:
            self._profile.extend(rt.compute(g.graph, profile=True))
        return float(g.loss.numpy().reshape(-1)[0]) if g.loss is not None else 0.0

    # ------------------------------------------------------------------ steps

    def train_step(self, micro_batches, lr: float) -> StepResult:
        """One optimizer step over ``accum`` micro-batches (objects with
        tokens, targets, loss_mask, pos, doc arrays of shape (B, T))."""
        micro_batches = list(micro_batches)
        if len(micro_batches) != self.accum * self.world.size:
            raise ValueError(
                f"{len(micro_batches)} micro-batches for an engine with accum={self.accum} on {self.world.size} rank(s)"
            )
        n_targets = int(sum(int(np.count_nonzero(np.asarray(b.loss_mask))) for b in micro_batches))
        if n_targets == 0:
            raise ValueError("the step's micro-batches have no target token")
        scale = self.n_rows / n_targets
        for d in (True, False):
            self._hp[d].set(np.array(adamw_hparams(self.optim, lr, self.step, d), np.float32))
        if self.world.distributed:
            return self._train_step_ranks(micro_batches, lr, scale, n_targets)
        if self.objective is not None:
            self.objective.begin_step(micro_batches)
        total = 0.0
        for i, b in enumerate(micro_batches):
            if self.accum == 1:
                kind = "single"
            else:
                kind = "first" if i == 0 else ("last" if i == self.accum - 1 else "middle")
            self._upload(b, scale)
            g = self._get(kind)
            self._before(i)
            total += self._run(g)
            self._collect(g, b)
        norm = float(g.norm.numpy().reshape(-1)[0])
        self._last = g
        self.step += 1
        metrics = self.objective.metrics() if self.objective is not None else {}
        return StepResult(loss=total, grad_norm=norm, lr=lr, n_targets=n_targets, metrics=metrics)

    def _train_step_ranks(self, micro_batches, lr: float, scale: float, n_targets: int) -> StepResult:
        """``train_step`` on several ranks (the module docstring)."""
        import time

        w, a = self.world, self.accum
        t0 = time.perf_counter()
        losses = []
        for i, b in enumerate(micro_batches[w.rank * a : (w.rank + 1) * a]):
            self._upload(b, scale)
            g = self._get("first" if i == 0 else "middle")
            self._before(i)
            losses.append(self._run(g))
        compute = time.perf_counter() - t0
        names = [s.name for s in self.specs]
        views = self._host_views()
        if views is not None:  # host memory: send from and sum into the accumulators themselves
            acc = [views[0][k] for k in names]
            sums = w.reduce_owned(acc, self.owner, into={i: acc[i] for i, o in enumerate(self.owner) if o == w.rank})
        else:
            sums = w.reduce_owned([self._acc[k].numpy() for k in names], self.owner)
            for i, arr in sums.items():
                self._acc[names[i]].set(arr)
        t1 = time.perf_counter()
        mine: dict[str, np.float32] = {}
        if self.owned:  # a rank may own nothing (fewer tensors than ranks)
            gsq = self._get("dist_sq")
            self._run(gsq)
            mine = {k: np.float32(t.numpy().reshape(-1)[0]) for k, t in gsq.grad_sq.items()}
        compute += time.perf_counter() - t1
        facts = w.allgather((losses, mine, compute), "summing the step's losses and gradient norms")
        every: dict[str, np.float32] = {}
        for _, m, _ in facts:
            every.update(m)
        self._dist_sq = {k: float(every[k]) for k in names}
        # the one-process graph's float32 arithmetic: sq = t0 + t1 + ..., norm = sqrt(sq),
        # factor = clamp(clip / (norm + eps), 0, 1)
        sq = np.float32(every[names[0]])
        for k in names[1:]:
            sq = np.float32(sq + every[k])
        norm = np.float32(np.sqrt(sq))
        if self.optim.grad_clip > 0:
            f = np.float32(np.float32(self.optim.grad_clip) / np.float32(norm + np.float32(1e-6)))
            self._factor.set(np.array([min(max(f, np.float32(0.0)), np.float32(1.0))], np.float32))
        t1 = time.perf_counter()
        if self.owned:
            self._run(self._get("dist_apply"))
        compute += time.perf_counter() - t1
        shapes = [s.shape for s in self.specs]
        if views is not None:  # straight from and into the parameters' memory
            par = views[1]
            others = {i: par[k] for i, k in enumerate(names) if self.owner[i] != w.rank}
            w.gather_owned({i: par[names[i]] for i in sums}, self.owner, shapes, into=others)
        else:
            mine_p = {i: self.params[names[i]].numpy() for i in sums}
            for i, arr in w.gather_owned(mine_p, self.owner, shapes).items():
                self.params[names[i]].set(arr)
        total = 0.0
        for ls, _, _ in facts:  # the micro-batches' losses in the one-process order
            for x in ls:
                total += x
        times = [c for _, _, c in facts]
        stats = w.take_stats()
        self._last = None
        self.step += 1
        return StepResult(
            loss=total,
            grad_norm=float(norm),
            lr=lr,
            n_targets=n_targets,
            comm_s=stats.seconds,
            sent_bytes=stats.sent,
            rank_s=(max(times), min(times)),
        )

    def _host_views(self) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]] | None:
        """Zero-copy views of the accumulators and parameters (None: they are
        not in host memory, e.g. on a GPU: then copies are exchanged)."""
        if self._views is None:
            try:
                self._views = (
                    {k: t.host_view() for k, t in self._acc.items()},
                    {k: t.host_view() for k, t in self.params.items()},
                )
            except (toy_ggml.GGMLError, TypeError):
                self._views = False
        return self._views if isinstance(self._views, tuple) else None

    def profile_step(self, micro_batches, lr: float) -> tuple[StepResult, list[tuple[str, str, float]]]:
        """``train_step`` (the step is taken, with the same arithmetic) with
        every graph node timed: (the step's result, ``(op, name, seconds)``
        of each node computed, in order, over all micro-batches). Nodes run
        one at a time (``Runtime.compute(profile=True)``), so the step is
        slower than an unprofiled one; ``profile_summary`` ranks the ops."""
        self._profile = []
        try:
            res = self.train_step(micro_batches, lr)
            return res, self._profile
        finally:
            self._profile = None

    def gradients(self, micro_batches) -> tuple[float, dict[str, np.ndarray]]:
        """(loss, gradient of every parameter) of one optimizer step's
        micro-batches, normalized as ``train_step`` does, without updating
        anything (for tests and diagnostics; float64 sums of the per-batch
        gradients)."""
        micro_batches = list(micro_batches)
        n_targets = int(sum(int(np.count_nonzero(np.asarray(b.loss_mask))) for b in micro_batches))
        if n_targets == 0:
            raise ValueError("the micro-batches have no target token")
        if self.objective is not None:
            self.objective.begin_step(micro_batches)
        g = self._graphs.get("probe")
        if g is None:
            g = self._build("probe")
            self._graphs["probe"] = g
        grads: dict[str, np.ndarray]
        total, grads = 0.0, {}
        for i, b in enumerate(micro_batches):
            self._upload(b, self.n_rows / n_targets)
            self._before(i)
            total += self._run(g)
            self._collect(g, b)
            for name, t in g.grads.items():
                grads[name] = grads.get(name, 0.0) + t.numpy().astype(np.float64)
        return total, grads

    # ------------------------------------------------------------------ diagnostics

    def watch_steps(self) -> None:
        """Make the step graphs keep what ``toy.train.diagnostics`` reads:
        each block's output of the last micro-batch (``step_taps``) and each
        parameter's sum of squares before the update
        (``param_sumsq_before``: one more pass over the weights per step,
        so it is off unless a run asks for diagnostics). Graphs built
        before are dropped and built again; the arithmetic is unchanged."""
        if self.watch:
            return
        if self.world.distributed:
            raise ValueError("training diagnostics are not available on several ranks")
        self.watch = True
        for kind in ("single", "last"):
            g = self._graphs.pop(kind, None)
            if g is not None:
                g.ops.close()
        self._last = None

    def grad_sumsq(self) -> dict[str, float]:
        """Per-tensor sum of squares of the last optimizer step's gradients
        (all micro-batches, before clipping): the terms of ``grad_norm``."""
        if self.world.distributed and self._dist_sq:
            return dict(self._dist_sq)
        g = self._last
        if g is None:
            raise RuntimeError("grad_sumsq: no step taken yet")
        return {k: float(t.numpy().reshape(-1)[0]) for k, t in g.grad_sq.items()}

    def param_sumsq_before(self) -> dict[str, float]:
        """Per-tensor sum of squares of the parameters as they were before
        the last optimizer step's update (non-finite: the tensor held NaN/Inf);
        empty unless ``watch_steps`` was called."""
        g = self._last
        if g is None:
            raise RuntimeError("param_sumsq_before: no step taken yet")
        return {k: float(t.numpy().reshape(-1)[0]) for k, t in g.param_sq.items()}

    def step_taps(self) -> list[np.ndarray]:
        """The residual stream after each block, (N, d) per block, of the
        last step's last micro-batch (empty when the model has no taps, or
        unless ``watch_steps`` was called)."""
        g = self._last
        return [t.numpy().reshape(self.n_rows, -1).copy() for t in g.taps] if g is not None else []

    def activations(self, batch) -> list[np.ndarray]:
        """The residual stream after each block, (N, d) per block, of
        ``batch`` under the current parameters (a forward graph of the
        blocks alone: no head, no dropout, nothing updated); empty when the
        model has no taps."""
        if not self.supports_taps:
            return []
        self._upload(batch, float(self.n_rows), smooth=False)
        g = self._get("taps")
        self._run(g)
        return [t.numpy().reshape(self.n_rows, -1).copy() for t in g.taps]

    def _collect(self, g: _Graph, batch) -> None:
        if self.objective is not None and g.outputs:
            self.objective.collect({k: t.numpy().copy() for k, t in g.outputs.items()}, batch)

    def token_logps(self, batch) -> np.ndarray:
        """(B, T) float32: the log-probability of each position's target
        under the current parameters, 0 where the batch's loss mask is 0
        (a forward graph; nothing updated; ``toy.train.objectives``). With
        an objective that has a ``logit_scale`` (GRPO's 1 / temperature) the
        logits are scaled first, as in its loss."""
        if not isinstance(self.feed, TokenFeed):
            raise TypeError("token_logps: the model is not a language model (its feed is not TokenFeed)")
        self.feed.upload(self.inputs, batch)
        self._upload_labels(batch)
        g = self._get("logps")
        self._run(g)
        return g.outputs["token_logps"].numpy().reshape(self.batch, self.context).copy()

    def sequence_logps(self, batch) -> np.ndarray:
        """(B,) float64: ``token_logps`` summed over each row (the
        sequence log-probability of each row's loss tokens)."""
        return self.token_logps(batch).astype(np.float64).sum(axis=1)

    def evaluate_objective(self, batch) -> tuple[float, dict[str, float]]:
        """(the objective's loss, its metrics) of one batch under the
        current parameters, nothing updated (validation)."""
        if self.objective is None:
            raise ValueError("evaluate_objective: the engine has no objective")
        self.objective.begin_step([batch])
        self._upload(batch, float(self.n_rows), smooth=False)
        g = self._get("objective_eval")
        loss = self._run(g)
        self._collect(g, batch)
        return loss, self.objective.metrics()

    @contextlib.contextmanager
    def swapped(self, values: Mapping[str, np.ndarray]) -> Iterator[None]:
        """Within the block the named parameters hold ``values`` (e.g. a
        reference policy's: LoRA adapters with B = 0); afterwards they are
        what they were, bit for bit."""
        unknown = sorted(set(values) - set(self.params))
        if unknown:
            raise KeyError(f"swapped: no parameter {unknown[0]!r}")
        saved = {k: self.params[k].numpy().copy() for k in values}
        try:
            for k, v in values.items():
                self.params[k].set(np.asarray(v, np.float32))
            yield
        finally:
            for k, v in saved.items():
                self.params[k].set(v)

    def eval_nll(self, batch) -> tuple[float, int]:
        """(sum of NLL over the batch's targets, number of targets) without
        touching the parameters (plain NLL: no label smoothing)."""
        n = int(np.count_nonzero(np.asarray(batch.loss_mask)))
        if n == 0:
            return 0.0, 0
        self._upload(batch, float(self.n_rows), smooth=False)
        return self._run(self._get("eval")), n

    def next_token_logits(self, ids, window: int | None = None) -> np.ndarray:
        """Logits (V,) after the token ids (the last ``context`` of them),
        from a one-row forward graph over the current parameters (for
        sample generations during training; no KV cache).

        The row is padded to ``window`` tokens (default: the smallest power
        of two >= len(ids), at least 16, at most ``context``), not to the
        whole context: a position only attends to the ones before it and an
        F32 product computes each row alone (toy's GEMM), so the padding's
        length does not change the logits (tested bit for bit against the
        whole window), and a sample of a few dozen tokens no longer costs a
        full-context forward per token. One graph is kept per window."""
        if not isinstance(self.feed, TokenFeed):
            raise TypeError("next_token_logits: the model is not a language model (its feed is not TokenFeed)")
        ids = np.asarray(ids, np.int32).reshape(-1)[-self.context :]
        if len(ids) == 0:
            raise ValueError("next_token_logits: no tokens")
        if window is None:
            window = min(self.context, max(16, 1 << (len(ids) - 1).bit_length()))
        T = int(window)
        if not len(ids) <= T <= self.context:
            raise ValueError(f"next_token_logits: window {T} must hold the {len(ids)} tokens and be <= {self.context}")
        if self._row is None:
            self._row = {}
        if T not in self._row:
            windows = self.feed.windows
            cin = toy_ggml.Context(max_tensors=8 + len(windows))
            inp = BatchInputs(
                1,
                T,
                cin.tensor(I32, (T,), name="row_tokens"),
                cin.tensor(I32, (T,), name="row_pos"),
                cin.tensor(F32, (1, 1, T, T), name="row_mask"),
                cin.tensor(F32, (T, 1), name="row_keep"),
                {w: cin.tensor(F32, (1, 1, T, T), name=f"row_mask.w{w}") for w in windows},
            )
            cin.allocate(self.runtime)
            inp.pos.set(np.arange(T, dtype=np.int32))
            inp.mask.set(causal_mask(T).reshape(1, 1, T, T))
            for w, t in inp.window_masks.items():
                t.set(causal_mask(T, window=w).reshape(1, 1, T, T))
            inp.keep.set(np.ones((T, 1), np.float32))
            cap = self._graph_capacity()
            ops = self._ops_context(max_tensors=cap * 2)
            out = self.model.logits(ops, self.params, inp, training=False).set_output()
            graph = toy_ggml.Graph(ops, size=cap * 2).build_forward(out)
            self._row[T] = (cin, inp, ops, graph, out)
        cin, inp, ops, graph, out = self._row[T]
        padded = np.zeros(T, np.int32)
        padded[: len(ids)] = ids
        inp.tokens.set(padded)
        self.runtime.compute(graph)
        return out.numpy()[len(ids) - 1].copy()

    # ------------------------------------------------------------------ state

    def param_values(self) -> dict[str, np.ndarray]:
        return {s.name: self.params[s.name].numpy().copy() for s in self.specs}

    def optimizer_state(self) -> dict[str, np.ndarray]:
        """The AdamW moments of every parameter. On several ranks a collective
        (every rank calls it): each owner's moments are gathered, and every
        rank gets the whole state."""
        out = {}
        if self.world.distributed:
            names = [s.name for s in self.specs]
            shapes = [s.shape for s in self.specs]
            for key, moments in (("adam_m", self._m), ("adam_v", self._v)):
                mine = {i: moments[names[i]].numpy() for i, o in enumerate(self.owner) if o == self.world.rank}
                every = {**{i: a.copy() for i, a in mine.items()}, **self.world.gather_owned(mine, self.owner, shapes)}
                for i, k in enumerate(names):
                    out[f"{key}.{k}"] = every[i]
            self.world.take_stats()  # checkpoint traffic is not a step's
            return {k: out[k] for s in self.specs for k in (f"adam_m.{s.name}", f"adam_v.{s.name}")}
        for s in self.specs:
            out[f"adam_m.{s.name}"] = self._m[s.name].numpy().copy()
            out[f"adam_v.{s.name}"] = self._v[s.name].numpy().copy()
        return out

    def optimizer_bytes(self) -> int:
        """Bytes of AdamW moments this rank holds (1/N of the model's two
        moments on N ranks, by whole tensors)."""
        return sum(self._m[k].nbytes + self._v[k].nbytes for k in self._m)

    def load_state(self, params: Mapping[str, np.ndarray], optimizer: Mapping[str, np.ndarray], step: int) -> None:
        for s in self.specs:
            self.params[s.name].set(np.asarray(params[s.name], np.float32))
            if s.name in self._m:  # several ranks: the owner's moments only
                self._m[s.name].set(np.asarray(optimizer[f"adam_m.{s.name}"], np.float32))
                self._v[s.name].set(np.asarray(optimizer[f"adam_v.{s.name}"], np.float32))
        self.step = int(step)

    def close(self) -> None:
        for g in self._graphs.values():
            g.ops.close()
        self._graphs.clear()
        for cin, _inp, ops, _graph, _out in (self._row or {}).values():
            ops.close()
            cin.close()
        self._row = None
        self._state.close()


def profile_summary(nodes, top: int = 12) -> list[dict]:
    """The ops of a profiled step (``TrainEngine.profile_step``'s node list)
    ranked by time: ``{"op", "nodes", "ms", "share"}`` for the ``top``
    costliest, ``share`` of the step's summed node time."""
    by_op: dict[str, list[float]] = {}
    for op, _name, sec in nodes:
        by_op.setdefault(op, []).append(sec)
    total = sum(sum(v) for v in by_op.values()) or 1.0
    ranked = sorted(by_op.items(), key=lambda kv: -sum(kv[1]))[:top]
    return [
        {"op": op, "nodes": len(v), "ms": round(1e3 * sum(v), 3), "share": round(sum(v) / total, 4)} for op, v in ranked
    ]


__all__ = [
    "BatchInputs",
    "Feed",
    "ParamSpec",
    "StepResult",
    "TokenFeed",
    "TrainEngine",
    "TrainModel",
    "profile_summary",
]
