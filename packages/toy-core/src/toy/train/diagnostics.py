"""Training diagnostics: what happens inside a run, every K steps.

Opt-in (``TrainConfig.diagnostics``: ``kinds`` of ``DIAGNOSTICS`` or "all",
``every`` K). Each kind writes one event per diagnostics step (the steps
that are multiples of K) into ``events.jsonl``:

- ``grads`` -> ``diag_grads``: the L2 norm of each tensor's gradient (the
  step's summed micro-batches, before clipping), aggregated per block
  (``layers``: block i's tensors together), per parameter kind (``kinds``:
  matrix, residual, embedding, norm, ...) and for the tensors outside the
  blocks (``other``: by name); ``total`` is the step's ``grad_norm``;
  ``tensors`` (every tensor by name) only while the model has at most
  ``TENSORS_MAX`` tensors, to keep event lines short (figures are
  written to 6 significant digits). The per-tensor sums of
  squares are the terms the step's global norm already computes (outputs of
  the step graph), so this kind costs a few scalar reads.
- ``updates`` -> ``diag_updates``: ||theta_after - theta_before|| / ||theta_before||
  of this step's optimizer update, aggregated the same way (norms of the
  group's tensors together). Costs one host copy of the parameters before
  the step and one after.
- ``drift`` -> ``diag_drift``: ||theta - theta0|| / ||theta0||, theta0 the run's
  starting weights (``reference``: "initial" for a from-scratch run, "base"
  for a full fine-tune or warm start, "resumed" when a run that started
  elsewhere was resumed and its start is not at hand), per block, kind and
  other tensor, and ``total``. Costs one host copy of the parameters.
- ``activations`` -> ``diag_activations``: ``mean``, ``rms`` and ``max_abs``
  of the residual stream after each block (lists, block order) over the kept
  rows of a fixed probe batch (the first validation batch), under the
  current weights, without dropout. Costs one forward pass. A model whose
  graph gives no per-block residual stream (toy-vit's classifier) skips
  it with a ``note``.
- ``nonfinite``: every step (not only every K), a gradient that holds NaN
  or Inf stops the run (``TrainingDivergedError``) even while the loss is
  still finite, naming the tensor.

LoRA runs: the parameters are the adapters (``<W>.lora_a``, ``<W>.lora_b``);
``updates`` and ``drift`` are ratios of the adapter tensors themselves, per
block with A and B together (B starts at zero, so a per-tensor drift of B
would be a division by zero; A's norm keeps the block's ratio finite). They
say how fast the adapters move, not how far the adapted weight W + s*B*A is
from W.

Divergence: when the loss (or, with ``nonfinite``, the gradient norm)
becomes non-finite, ``diagnose`` finds where before the run stops, and a
``diag_nonfinite`` event records it: first a parameter that held NaN/Inf
before the step, else the first block (forward order) whose residual output
is non-finite on the step's last micro-batch, else the tensor whose
gradient is non-finite, the deepest one in forward order (backward runs
from the loss down, so that is where the NaN began). The first two need
what a run with diagnostics keeps (``TrainEngine.watch_steps``: each
parameter's sum of squares computed in the step graph before the update,
since AdamW then spreads NaN to every tensor, and the block outputs): one
more pass over the weights per step, which a run without ``--diagnostics``
does not pay. Without diagnostics the diagnosis names the gradient only,
and the message says to run with ``--diagnostics nonfinite``.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from typing import Any

import numpy as np

from toy.train.config import DIAGNOSTICS

#: the event kind each diagnostic writes
EVENT_KINDS = {
    "grads": "diag_grads",
    "updates": "diag_updates",
    "drift": "diag_drift",
    "activations": "diag_activations",
    "nonfinite": "diag_nonfinite",
}
#: ``diag_grads`` lists every tensor's norm while the model has at most this many tensors
TENSORS_MAX = 64

_BLOCK = re.compile(r"^blk\.(\d+)\.")


def resolve_kinds(kinds) -> list[str]:
    """The diagnostics named (``"all"``: every one), in ``DIAGNOSTICS`` order."""
    asked = set(kinds or ())
    if "all" in asked:
        return list(DIAGNOSTICS)
    unknown = asked - set(DIAGNOSTICS)
    if unknown:
        raise ValueError(f"unknown diagnostics {sorted(unknown)}: each is one of {', '.join(DIAGNOSTICS)} (or all)")
    return [k for k in DIAGNOSTICS if k in asked]


def block_of(name: str) -> int | None:
    """The block index of a tensor name (``blk.<i>.``), None outside the blocks."""
    m = _BLOCK.match(name)
    return int(m.group(1)) if m else None


def where(name: str) -> str:
    """How a message names a tensor's place: "block i" or "outside the blocks"."""
    b = block_of(name)
    return f"block {b}" if b is not None else "outside the blocks"


def _num(x: float) -> float | None:
    """A figure as written: 6 significant digits (short event lines), None for NaN/Inf."""
    return float(f"{x:.6g}") if math.isfinite(x) else None


class _Groups:
    """Sums over tensors by block, by kind and (outside the blocks) by name."""

    def __init__(self, specs):
        self.specs = list(specs)
        blocks = [b for b in (block_of(s.name) for s in self.specs) if b is not None]
        self.n_blocks = max(blocks) + 1 if blocks else 0

    def sums(self, values: Mapping[str, float]) -> tuple[list[float], dict[str, float], dict[str, float]]:
        layers = [0.0] * self.n_blocks
        kinds: dict[str, float] = {}
        other: dict[str, float] = {}
        for s in self.specs:
            v = float(values[s.name])
            b = block_of(s.name)
            if b is None:
                other[s.name] = other.get(s.name, 0.0) + v
            else:
                layers[b] += v
            kinds[s.kind] = kinds.get(s.kind, 0.0) + v
        return layers, kinds, other

    def norms(self, sumsq: Mapping[str, float]) -> dict[str, Any]:
        """Square roots of grouped sums of squares."""
        layers, kinds, other = self.sums(sumsq)

        def root(v: float) -> float | None:
            return _num(math.sqrt(v)) if math.isfinite(v) else None

        return {
            "layers": [root(v) for v in layers],
            "kinds": {k: root(v) for k, v in kinds.items()},
            "other": {k: root(v) for k, v in other.items()},
        }

    def ratios(self, num_sq: Mapping[str, float], den_sq: Mapping[str, float]) -> dict[str, Any]:
        """sqrt(sum num) / sqrt(sum den) per group (None where the denominator is 0)."""
        n_layers, n_kinds, n_other = self.sums(num_sq)
        d_layers, d_kinds, d_other = self.sums(den_sq)

        def r(n: float, d: float) -> float | None:
            return _num(math.sqrt(n) / math.sqrt(d)) if d > 0 else None

        return {
            "layers": [r(n, d) for n, d in zip(n_layers, d_layers)],
            "kinds": {k: r(n_kinds[k], d_kinds[k]) for k in n_kinds},
            "other": {k: r(n_other[k], d_other[k]) for k in n_other},
        }


def _sq(a: np.ndarray) -> float:
    """Sum of squares (a BLAS dot in the array's own float32: ~1e-6 relative, and no float64 copy)."""
    a = np.ascontiguousarray(a).reshape(-1)
    return float(np.dot(a, a))


def activation_stats(taps: list[np.ndarray], keep: np.ndarray | None = None) -> dict[str, list[float | None]]:
    """``mean``, ``rms`` and ``max_abs`` of each block's residual stream
    (N, d) over the rows where ``keep`` (N,) is set (all rows: None)."""
    out: dict[str, list[float | None]] = {"mean": [], "rms": [], "max_abs": []}
    for t in taps:
        x = np.asarray(t, np.float64)
        if keep is not None:
            x = x[np.asarray(keep).reshape(-1) > 0]
        out["mean"].append(_num(float(x.mean())) if x.size else None)
        out["rms"].append(_num(float(np.sqrt(np.mean(x * x)))) if x.size else None)
        out["max_abs"].append(_num(float(np.abs(x).max())) if x.size else None)
    return out


def diagnose(engine) -> tuple[str, dict[str, Any]]:
    """Where the last step's non-finite value began (see the module doc):
    (a phrase for the error message, the ``diag_nonfinite`` fields)."""
    specs = engine.specs
    before = engine.param_sumsq_before()  # empty (as step_taps) unless the run watched its steps
    for s in specs:
        if not math.isfinite(before.get(s.name, 0.0)):
            return (
                f"parameter {s.name} ({where(s.name)}) held NaN/Inf before the step",
                {"source": "parameter", "tensor": s.name, "block": block_of(s.name)},
            )
    for i, t in enumerate(engine.step_taps()):
        if not np.isfinite(t).all():
            return (
                f"the residual stream after block {i} became non-finite (the first block that did; "
                f"its parameters were finite)",
                {"source": "activation", "tensor": None, "block": i},
            )
    grads = engine.grad_sumsq()
    bad = [s.name for s in specs if not math.isfinite(grads[s.name])]
    if bad:
        deepest = max(bad, key=lambda n: (block_of(n) if block_of(n) is not None else -1, specs_index(specs, n)))
        return (
            f"the gradient of {deepest} ({where(deepest)}) became non-finite "
            f"({len(bad)} of {len(specs)} tensors' gradients are; backward reached that one first)"
            + ("" if engine.watch else "; run with --diagnostics nonfinite to check the weights and blocks too"),
            {"source": "gradient", "tensor": deepest, "block": block_of(deepest), "tensors_nonfinite": len(bad)},
        )
    if not engine.watch:
        return (
            "no gradient was non-finite (run with --diagnostics nonfinite to see which parameter or block "
            "the NaN/Inf began in)",
            {"source": None, "tensor": None, "block": None},
        )
    return (
        "no parameter, block output or gradient was non-finite (the loss itself overflowed)",
        {"source": "loss", "tensor": None, "block": None},
    )


def specs_index(specs, name: str) -> int:
    return next(i for i, s in enumerate(specs) if s.name == name)


class Diagnostics:
    """The diagnostics of one run. ``kinds`` (resolved by ``resolve_kinds``),
    ``every`` K; ``reference`` (name -> array): theta0 for ``drift``
    (``reference_label`` says what it is); ``probe``: the batch of
    ``activations`` (a ``toy.train.data.Batch``; None: skipped with a note).
    ``after_step`` gives the events to write."""

    def __init__(
        self,
        kinds,
        every: int,
        engine,
        *,
        reference: Mapping[str, np.ndarray] | None = None,
        reference_label: str = "initial",
        probe=None,
    ):
        if every < 1:
            raise ValueError(f"every={every} must be >= 1")
        self.kinds = resolve_kinds(kinds)
        self.every = int(every)
        engine.watch_steps()  # the step graphs keep the weights' sums of squares and the block outputs
        self.groups = _Groups(engine.specs)
        self.specs = list(engine.specs)
        self.reference_label = reference_label
        self._ref = None
        self._ref_sq: dict[str, float] = {}
        if "drift" in self.kinds and reference is not None:
            self._ref = {s.name: np.asarray(reference[s.name], np.float32) for s in self.specs}
            self._ref_sq = {k: _sq(v) for k, v in self._ref.items()}
        self.probe = probe
        self._before: dict[str, np.ndarray] | None = None
        self.skipped: list[str] = []  # notes for what could not be done (written once by the caller)
        if "activations" in self.kinds and not engine.supports_taps:
            self.skipped.append(
                "diagnostics: activations skipped: this model's graph gives no per-block residual stream"
            )
        elif "activations" in self.kinds and probe is None:
            self.skipped.append("diagnostics: activations skipped: no probe batch (the run has no batches)")
        if "drift" in self.kinds and self._ref is None:
            self.skipped.append("diagnostics: drift skipped: the run's starting weights are not at hand")

    @property
    def stops_on_grads(self) -> bool:
        """Whether a non-finite gradient stops the run while the loss is finite (``nonfinite``)."""
        return "nonfinite" in self.kinds

    def due(self, step: int) -> bool:
        """Whether step ``step`` (1-based, the step just taken) is a diagnostics step."""
        return step % self.every == 0

    def before_step(self, engine) -> None:
        """Called before each optimizer step (keeps the parameters for ``updates``)."""
        self._before = engine.param_values() if "updates" in self.kinds and self.due(engine.step + 1) else None

    def after_step(self, engine) -> list[tuple[str, dict[str, Any]]]:
        """The events of the step just taken ((kind, fields) pairs; none between diagnostics steps)."""
        step = engine.step
        if not self.due(step):
            return []
        events: list[tuple[str, dict[str, Any]]] = []
        values: dict[str, np.ndarray] | None = None
        if "grads" in self.kinds:
            sq = engine.grad_sumsq()
            f: dict[str, Any] = {"step": step, **self.groups.norms(sq), "total": _num(math.sqrt(sum(sq.values())))}
            if len(self.specs) <= TENSORS_MAX:
                f["tensors"] = {k: _num(math.sqrt(v)) for k, v in sq.items()}
            events.append((EVENT_KINDS["grads"], f))
        if "updates" in self.kinds and self._before is not None:
            values = engine.param_values()
            before = self._before
            d_sq = {k: _sq(np.subtract(values[k], before[k], out=before[k])) for k in values}
            p_sq = engine.param_sumsq_before()  # computed by the step graph
            events.append((EVENT_KINDS["updates"], {"step": step, **self.groups.ratios(d_sq, p_sq)}))
            self._before = None
        if "drift" in self.kinds and self._ref is not None:
            values = values if values is not None else engine.param_values()
            ref = self._ref
            d_sq = {k: _sq(values[k] - ref[k]) for k in ref}
            total = math.sqrt(sum(d_sq.values())) / math.sqrt(sum(self._ref_sq.values()) or 1.0)
            fields = {"step": step, "reference": self.reference_label, **self.groups.ratios(d_sq, self._ref_sq)}
            events.append((EVENT_KINDS["drift"], {**fields, "total": _num(total)}))
        if "activations" in self.kinds and self.probe is not None and engine.supports_taps:
            taps = engine.activations(self.probe)
            stats = activation_stats(taps, np.asarray(self.probe.loss_mask).reshape(-1))
            events.append((EVENT_KINDS["activations"], {"step": step, **stats}))
        return events


__all__ = [
    "EVENT_KINDS",
    "TENSORS_MAX",
    "Diagnostics",
    "activation_stats",
    "block_of",
    "diagnose",
    "resolve_kinds",
]
