"""Step traces: one training or decode step as a Chrome/Perfetto trace.

A trace is a JSON file of Chrome trace events (``{"traceEvents": [...]}``)
that ui.perfetto.dev and chrome://tracing open. It holds one complete ("X")
event per node of the step's ggml graph(s): the event's name is the node's op
(``MUL_MAT``, ``SOFT_MAX``, ``OPT_STEP_ADAMW``...), its ``args`` the node's
name, output shape and type, its duration the node's own wall time as ggml's
scheduler measured it (``toy_ggml.Runtime.compute(profile=True)``: every node
is computed alone and timed, no sampling). The nodes run one after another,
so the events are laid end to end in graph order; a graph's events start
where the previous graph's (an accumulation step's micro-batch) ended.

Tracks. Each event goes on one track (a Chrome "thread" of process 1):
``embed`` (token embedding), ``layer N`` (the nodes of transformer block N),
``head`` (final norm, output projection, loss), ``optimizer`` (the gradient
norm, clipping factor and anything else that mixes layers). A node's track:

1. A node that reads a weight directly (itself, or through views of it)
   belongs to that weight's group: ``blk.N.*`` is layer N; any other weight
   (``token_embd``, ``output_norm``, ``output``) belongs to the group of the
   first forward node reading it: ``embed`` when that node reads nothing else
   with a group (the embedding lookup), else ``head``.
2. Other forward nodes (before the first gradient node): the latest group
   among their sources (embed < layer 0 < ... < head); then a node whose
   consumers all lie in one other group moves there (a block's leading norm
   reads only the residual stream, but feeds that block).
3. Gradient nodes: ggml names the gradient of ``X`` ``"grad for X"``; it
   takes ``X``'s group. The unnamed helper nodes ggml emits while building a
   gradient come just before it in the graph and take its group.
4. After the last gradient (the optimizer part): a node whose grouped
   sources all share one group takes it (``SUM_SQR`` of a layer's gradient);
   one that mixes groups (the running sum of squares, ``SQRT``, ``CLAMP``)
   goes to ``optimizer``.

So every ``blk.N`` parameter's gradient and AdamW node land in layer N. The
graph's structure comes from ``toy_ggml.Tensor.sources`` and
``Tensor.view_source`` (ggml's ``src`` and ``view_src``); a list of nodes
without sources (``GraphNode`` made by hand) falls back to graph order for
rules 1 and 2 (a weight is seen right before the ops that read it).

Times: profiling runs one node at a time, so a traced step is slower than a
plain one (the pool of threads starts once per node); the shares are what a
trace is for. The arithmetic is the same: a traced training step gives the
same loss and weights, bit for bit.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

_BLK = re.compile(r"^blk\.(\d+)\.")
_GRAD = "grad for "
_VIEW_OPS = {"VIEW", "RESHAPE", "PERMUTE", "TRANSPOSE"}


@dataclass
class GraphNode:
    """One node of a graph: op (as the profile names it), name, shape, type, sources (addresses)."""

    op: str
    name: str
    shape: tuple[int, ...]
    dtype: str
    address: int
    sources: list[int] = field(default_factory=list)
    source_roots: list[str] = field(default_factory=list)  # per source: the tensor under its views
    root_name: str = ""  # a view's (or a weight's) underlying tensor's name


def graph_nodes(graph: Any) -> list[GraphNode]:
    """The graph's nodes in compute order, with their sources (ggml's
    ``src``, through ``toy_ggml.Tensor.sources``) and, for each source, the
    name of the tensor under its views (``Tensor.view_source``)."""
    out = []
    roots: dict[int, str] = {}
    for t in graph.nodes:
        try:
            dtype = t.dtype.name
        except AttributeError:
            dtype = str(t.dtype)
        n = GraphNode(t.op.split(":")[-1], t.name, tuple(int(d) for d in t.shape), dtype, t.address)
        n.root_name = t.name
        for src in t.sources:
            n.sources.append(src.address)
            n.source_roots.append(_root(src, roots))
        out.append(n)
    return out


def _root(t: Any, cache: dict[int, str]) -> str:
    """The name of the tensor under a chain of views (ggml's ``view_src``)."""
    if t.address in cache:
        return cache[t.address]
    seen = [t.address]
    while t.view_source is not None and len(seen) <= 64:
        t = t.view_source
        seen.append(t.address)
    for a in seen:
        cache[a] = t.name
    return str(t.name)


def _is_weight(name: str) -> bool:
    return bool(_BLK.match(name)) or name.endswith((".weight", ".bias"))


_ORDER_EMBED, _ORDER_HEAD = -1, 1 << 30


def _rank(group: str) -> int:
    if group == "embed":
        return _ORDER_EMBED
    if group.startswith("layer "):
        return int(group[6:])
    return _ORDER_HEAD


def node_groups(nodes: Sequence[GraphNode]) -> list[str]:
    """Each node's track (``embed``, ``layer N``, ``head``, ``optimizer``), by the rules of the module docstring."""
    n = len(nodes)
    groups: list[str | None] = [None] * n
    index = {nd.address: i for i, nd in enumerate(nodes)}
    have_sources = any(nd.sources for nd in nodes)
    names: dict[str, int] = {}
    for i, nd in enumerate(nodes):
        names[nd.name] = -1 if nd.name in names else i  # -1: not unique
    first_grad = next((i for i, nd in enumerate(nodes) if nd.name.startswith(_GRAD)), n)
    weight_group: dict[str, str] = {}

    def weights_read(nd: GraphNode) -> list[str]:
        return [name for name in nd.source_roots if _is_weight(name)]

    def src_groups(nd: GraphNode) -> list[str]:
        return [g for g in (groups[index[s]] for s in nd.sources if s in index) if g is not None]

    # forward part
    if have_sources:
        for i in range(first_grad):
            nd = nodes[i]
            if nd.op == "NONE":  # a parameter: placed below, with its first reader
                continue
            ws = weights_read(nd)
            blk = [int(m.group(1)) for m in (_BLK.match(w) for w in ws) if m]
            if blk:
                groups[i] = f"layer {max(blk)}"
                continue
            sg = src_groups(nd)
            if ws:
                g = "embed" if not sg else "head"
                for w in ws:
                    weight_group.setdefault(w, g)
                groups[i] = g
            elif sg:
                groups[i] = max(sg, key=_rank)
        # a node whose consumers all sit in one other group joins it
        consumers: dict[int, list[int]] = {}
        for i in range(first_grad):
            for s in nodes[i].sources:
                if s in index and index[s] < first_grad:
                    consumers.setdefault(index[s], []).append(i)
        moved = list(groups)
        for i in range(first_grad):
            cg = {groups[c] for c in consumers.get(i, [])}
            if len(cg) == 1 and None not in cg and groups[i] not in cg and not weights_read(nodes[i]):
                moved[i] = cg.pop()
        groups = moved
        for i in range(first_grad):
            if nodes[i].op == "NONE":
                m = _BLK.match(nodes[i].name)
                first = min(consumers.get(i, [first_grad]))
                groups[i] = (
                    f"layer {m.group(1)}"
                    if m
                    else weight_group.get(nodes[i].name, groups[first] if first < first_grad else None)
                )
            if groups[i] is None:
                groups[i] = "embed"
    else:  # graph order: the latest weight seen
        cur, seen_blk = "embed", False
        for i in range(first_grad):
            nd = nodes[i]
            if nd.op == "NONE" and _is_weight(nd.name):
                m = _BLK.match(nd.name)
                if m:
                    cur, seen_blk = f"layer {m.group(1)}", True
                else:
                    cur = "head" if seen_blk else "embed"
                    weight_group.setdefault(nd.name, cur)
            groups[i] = cur

    def group_of_name(name: str) -> str | None:
        m = _BLK.match(name)
        if m:
            return f"layer {m.group(1)}"
        if name in weight_group:
            return weight_group[name]
        j = names.get(name, -1)
        return groups[j] if j >= 0 else None

    # gradients: "grad for X" takes X's group; helpers take the next named gradient's
    last_grad = max((i for i, nd in enumerate(nodes) if nd.name.startswith(_GRAD)), default=-1)
    for i in range(first_grad, last_grad + 1):
        nd = nodes[i]
        ws = weights_read(nd) if have_sources else []
        layer = [m.group(1) for m in (_BLK.match(w) for w in ws) if m]
        if layer:
            groups[i] = f"layer {layer[0]}"
        elif nd.name.startswith(_GRAD):
            groups[i] = group_of_name(nd.name[len(_GRAD) :])
    pending: list[int] = []
    for i in range(first_grad, last_grad + 1):
        if groups[i] is None:
            pending.append(i)
        else:
            for j in pending:
                groups[j] = groups[i]
            pending = []
    for j in pending:
        groups[j] = "optimizer"

    # the optimizer part
    for i in range(last_grad + 1 if last_grad >= 0 else n, n):
        nd = nodes[i]
        ws = weights_read(nd)
        layer = [m.group(1) for m in (_BLK.match(w) for w in ws) if m]
        if layer:
            groups[i] = f"layer {layer[0]}"
            continue
        if ws and ws[0] in weight_group:
            groups[i] = weight_group[ws[0]]
            continue
        one = set(src_groups(nd))
        groups[i] = one.pop() if len(one) == 1 else "optimizer"
    return [g or "optimizer" for g in groups]


@dataclass
class Trace:
    """A traced step: per graph computed, its nodes and their seconds."""

    segments: list[tuple[list[GraphNode], list[tuple[str, str, float]]]]
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def n_nodes(self) -> int:
        return sum(len(recs) for _, recs in self.segments)

    @property
    def seconds(self) -> float:
        """The summed node time."""
        return sum(s for _, recs in self.segments for _, _, s in recs)

    def events(self) -> list[dict[str, Any]]:
        """Chrome trace events: the track names, then one "X" event per node."""
        evs: list[dict[str, Any]] = []
        rows = []
        for seg, (nodes, recs) in enumerate(self.segments):
            groups = node_groups(nodes) if len(nodes) == len(recs) else ["step"] * len(recs)
            for k, (op, name, sec) in enumerate(recs):
                nd = nodes[k] if len(nodes) == len(recs) else None
                rows.append((seg, k, op, name, sec, nd, groups[k]))
        tracks = sorted({r[6] for r in rows}, key=_rank)
        tid = {g: i + 1 for i, g in enumerate(tracks)}
        evs.append({"ph": "M", "name": "process_name", "pid": 1, "tid": 0, "args": {"name": "toy step"}})
        for g in tracks:
            evs.append({"ph": "M", "name": "thread_name", "pid": 1, "tid": tid[g], "args": {"name": g}})
            evs.append(
                {"ph": "M", "name": "thread_sort_index", "pid": 1, "tid": tid[g], "args": {"sort_index": tid[g]}}
            )
        t_us = 0.0
        for seg, k, op, name, sec, nd, g in rows:
            dur = sec * 1e6
            args: dict[str, Any] = {"node": name, "index": k}
            if len(self.segments) > 1:
                args["graph"] = seg
            if nd is not None:
                args["shape"] = list(nd.shape)
                args["type"] = nd.dtype
            evs.append({"ph": "X", "name": op, "cat": g, "pid": 1, "tid": tid[g], "ts": t_us, "dur": dur, "args": args})
            t_us += dur
        return evs

    def to_json(self) -> dict[str, Any]:
        return {"traceEvents": self.events(), "displayTimeUnit": "ms", "otherData": dict(self.meta)}

    def write(self, path: str | Path) -> Path:
        """Write the trace (Chrome trace JSON) to ``path``; returns it."""
        p = Path(path)
        if p.parent and not p.parent.is_dir():
            p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(json.dumps(self.to_json(), separators=(",", ":")) + "\n")
        return p

    def by_group(self) -> dict[str, float]:
        """Seconds per track."""
        out: dict[str, float] = {}
        for nodes, recs in self.segments:
            groups = node_groups(nodes) if len(nodes) == len(recs) else ["step"] * len(recs)
            for g, (_, _, s) in zip(groups, recs, strict=True):
                out[g] = out.get(g, 0.0) + s
        return out


def _step_kinds(accum: int) -> list[str]:
    if accum == 1:
        return ["single"]
    return ["first"] + ["middle"] * (accum - 2) + ["last"]


def trace_train_step(engine: Any, micro_batches: Sequence[Any], lr: float) -> tuple[Any, Trace]:
    """``engine.train_step`` (a ``TrainEngine``: same arithmetic, the step is
    taken) with every node timed: (the step's result, its Trace)."""
    t0 = time.perf_counter()
    res, recs = engine.profile_step(micro_batches, lr)
    wall = time.perf_counter() - t0
    segments = []
    at = 0
    for kind in _step_kinds(engine.accum):
        graph = engine._graphs[kind].graph
        nodes = graph_nodes(graph)
        segments.append((nodes, list(recs[at : at + len(nodes)])))
        at += len(nodes)
    if at != len(recs):  # not the graphs expected: keep every record, without shapes
        segments = [([], list(recs))]
    meta = {"what": "train step", "step": engine.step, "loss": res.loss, "step_wall_ms": round(wall * 1e3, 3)}
    return res, Trace(segments, meta)


def trace_run_step(run: Any, batches: Sequence[Any], lr: float) -> Any:
    """For ``StepRun``: the traced training step (``TrainConfig.trace``):
    takes the step, writes the trace file and a ``trace`` event."""
    res, tr = trace_train_step(run.engine, batches, lr)
    path = tr.write(Path(run.cfg.trace).expanduser())
    run.writer.event(
        "trace", step=run.engine.step, path=str(path), nodes=tr.n_nodes, node_ms=round(tr.seconds * 1e3, 3)
    )
    if getattr(run.hooks, "note", None):
        run.hooks.note(f"step {run.engine.step}: trace {path} ({tr.n_nodes} nodes)")
    return res


def trace_decode_step(engine: Any, step: Any) -> tuple[Any, Trace]:
    """Run ``step()`` (a callable that makes one engine decode step) with the
    engine's graph computes profiled: (its result, the Trace)."""
    engine._profile = []
    t0 = time.perf_counter()
    try:
        out = step()
        wall = time.perf_counter() - t0
        segs = [(graph_nodes(g), recs) for g, recs in engine._profile]
    finally:
        engine._profile = None
    return out, Trace(segs, {"what": "decode step", "step_wall_ms": round(wall * 1e3, 3)})


def trace_decode(model: Any, ids: Sequence[int]) -> Trace:
    """One decode step of a loaded model (``toy.load``'s, ``model.engine`` an
    ``LLMEngine``) traced: the tokens ``ids[:-1]`` are put in the KV cache
    (slot 0, emptied before and after), then the step that reads ``ids[-1]``
    and makes the next token's logits is computed node by node."""
    from toy.errors import BadInputError

    ids = [int(i) for i in ids]
    if not ids:
        raise BadInputError("trace_decode: no tokens", hint="give the prompt's token ids", field="ids")
    eng = model.engine
    eng.cache.clear(0)
    try:
        if len(ids) > 1:
            eng.prefill(0, ids[:-1])
        _, tr = trace_decode_step(eng, lambda: eng.decode([0], [ids[-1]]))
    finally:
        eng.cache.clear(0)
    tr.meta["position"] = len(ids) - 1
    return tr


def summary(tr: Trace) -> Mapping[str, float]:
    """Milliseconds per track, costliest first."""
    return dict(sorted(((g, round(s * 1e3, 3)) for g, s in tr.by_group().items()), key=lambda kv: -kv[1]))


__all__ = [
    "GraphNode",
    "Trace",
    "graph_nodes",
    "node_groups",
    "trace_decode_step",
    "trace_run_step",
    "trace_train_step",
]
