"""The logit lens: what each layer's residual stream would predict if the
model stopped there.

``residual_streams`` runs one text through a model in a single full-sequence
graph (``toy.models.common.forward_logits`` with a causal mask, no KV
cache) and reads the residual stream after every block (the architecture
forward's ``taps``) together with the model's own logits. ``lens`` puts
each layer's stream through the model's final norm, its head and its final
soft-cap (``arch.final_norm``, ``output_weight``, ``final_softcapped``) and
reports, per position, the layer's top tokens and KL(final ‖ layer).

Invariants and decisions:

- Layer ``i`` is the residual stream after block ``i`` (GGUF ``blk.i``),
  0-based; the token embeddings (before block 0) are not a layer here. The
  last layer's lens is the model's own output: ``lens`` checks it against
  the logits of the same graph and refuses an architecture whose taps do
  not end there.
- KL(final ‖ layer) = Σ_v p_final(v) (log p_final(v) − log p_layer(v)), in
  nats, float64 from the float32 logits: how much the final distribution
  loses when the layer's stands in for it; 0 at the last layer.
- Position ``t`` predicts token ``t + 1``: each position also carries the
  actual next token and the probability each layer gives it.
- K and V stay float32 in attention (the engine's cache rounds them to F16):
  the lens reads the model's exact float32 forward, so the last layer's
  logits may differ from ``toy eval logprobs``' in the fourth decimal.
- Text is tokenized like a prompt (``Model.prompt_ids``: BOS as the model
  adds it, control-token text parsed), as ``toy eval logprobs`` does. It
  must fit the model's context length. LoRA adapters loaded with the model
  (``toy.load(..., lora=...)``) apply to the forward; selectable adapters
  do not.
- The lens logits are computed per layer for the chosen positions only
  (one small graph: final norm and head over P rows), so memory is the
  model's (T, V) logits plus one (P, V) block, never layers × T × V.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

import toy_ggml
from toy import models
from toy.errors import BadInputError
from toy.eval.score import Scorable
from toy.eval.windows import log_softmax
from toy.models.common import causal_mask, final_softcapped, forward_logits, head_weight

F32, I32 = toy_ggml.GGMLType.F32, toy_ggml.GGMLType.I32


def text_ids(model: Scorable, text: str | Sequence[int], max_tokens: int | None = None) -> list[int]:
    """``text`` tokenized like a prompt (``Model.prompt_ids``), or ids as
    given; the first ``max_tokens`` of them when given."""
    if max_tokens is not None and max_tokens < 1:
        raise BadInputError(f"max_tokens={max_tokens} must be >= 1")
    if isinstance(text, str):
        ids = list(model.prompt_ids(text)) if hasattr(model, "prompt_ids") else list(model.tokenizer.encode(text))
    else:
        ids = [int(i) for i in text]
    return ids if max_tokens is None else ids[:max_tokens]


def context_limit(model: Scorable) -> int:
    """The most tokens the lens and CKA read in one window: the model's context length."""
    return int(model.engine.cfg.context_length or model.engine.n_ctx)


def _check_ids(model: Scorable, ids: Sequence[int]) -> None:
    cfg = model.engine.cfg
    if not ids:
        raise BadInputError("the text has no tokens", hint="give a non-empty --text or --file")
    limit = context_limit(model)
    if len(ids) > limit:
        raise BadInputError(
            f"{len(ids)} tokens exceed the model's {limit}-token context",
            hint="shorten the text (the lens and CKA read it in one window)",
        )
    bad = [i for i in ids if not 0 <= i < cfg.n_vocab]
    if bad:
        raise BadInputError(f"token id {bad[0]} is outside the model's vocabulary of {cfg.n_vocab}")


def _graph_size(model: Scorable) -> int:
    cfg, lora = model.engine.cfg, model.engine.lora or {}
    return int(96 * cfg.n_layer + 256 + 4 * sum(len(t) for t in lora.values()))


def residual_streams(
    model: Scorable, ids: Sequence[int], logits: bool = True
) -> tuple[list[np.ndarray], np.ndarray | None]:
    """The residual stream after each block, ``n_layer`` float32 arrays
    (T, d), and (``logits``) the model's own logits (T, V) float32, of
    ``ids`` run as one causal sequence (see the module docstring)."""
    _check_ids(model, ids)
    engine = model.engine
    cfg, runtime = engine.cfg, engine.runtime
    arch = models.language_model_of(cfg)
    n = len(ids)
    windows = arch.windows(cfg)
    cin = toy_ggml.Context(max_tensors=4 + len(windows))
    ops = None
    try:
        tokens = cin.tensor(I32, (n,), name="tokens")
        pos = cin.tensor(I32, (n,), name="pos")
        mask = {w: cin.tensor(F32, (n, n), name=f"mask.w{w}") for w in windows}
        cin.allocate(runtime)
        tokens.set(np.asarray(ids, np.int32))
        pos.set(np.arange(n, dtype=np.int32))
        for w, m in mask.items():
            m.set(causal_mask(n, n, w))
        size = _graph_size(model)
        ops = toy_ggml.Context(max_tensors=size)
        taps: list[Any] = []
        out = forward_logits(ops, cfg, engine.weights, tokens, pos, mask, n, taps=taps, lora=engine.lora)
        if len(taps) != cfg.n_layer:
            raise BadInputError(f"architecture {cfg.architecture!r} reported {len(taps)} of {cfg.n_layer} layers")
        for t in taps:
            t.set_output()
        if logits:
            out.set_output()
        graph = toy_ggml.Graph(ops, size=max(2048, 2 * size)).build_forward(*((out,) if logits else ()), *taps)
        runtime.compute(graph)
        streams = [np.array(t.numpy(), np.float32).reshape(n, -1) for t in taps]
        final = np.array(out.numpy(), np.float32) if logits else None
    finally:
        if ops is not None:
            ops.close()
        cin.close()
    return streams, final


class _Head:
    """final norm → head → final soft-cap over P rows, one graph reused per layer."""

    def __init__(self, model: Scorable, rows: int):
        engine = model.engine
        self.runtime, cfg = engine.runtime, engine.cfg
        arch = models.language_model_of(cfg)
        self.cin = toy_ggml.Context(max_tensors=2)
        self.ops = toy_ggml.Context(max_tensors=64)
        try:
            self.x = self.cin.tensor(F32, (rows, cfg.d_model), name="lens.x")
            self.cin.allocate(self.runtime)
            h = arch.final_norm(self.ops, cfg, engine.weights, self.x)
            self.out = final_softcapped(
                self.ops, arch, cfg, self.ops.mul_mat(head_weight(engine.weights, arch.output_weight(cfg)), h)
            )
            self.out.set_output()
            self.graph = toy_ggml.Graph(self.ops, size=256).build_forward(self.out)
        except BaseException:
            self.close()
            raise

    def __call__(self, x: np.ndarray) -> np.ndarray:
        self.x.set(np.ascontiguousarray(x, np.float32))
        self.runtime.compute(self.graph)
        return np.array(self.out.numpy(), np.float32)

    def close(self) -> None:
        self.ops.close()
        self.cin.close()


@dataclass
class LensCell:
    """One layer at one position."""

    layer: int
    kl: float  # KL(final ‖ layer), nats
    next_prob: float | None  # the probability of the actual next token (None at the last position)
    top: list[tuple[int, str, float]] = field(default_factory=list)  # (id, text, probability)


@dataclass
class LensPosition:
    position: int
    id: int
    text: str
    next_id: int | None
    next_text: str | None
    layers: list[LensCell]
    final: list[tuple[int, str, float]]  # the model's own top tokens


@dataclass
class LensResult:
    n_tokens: int
    n_layer: int
    top_k: int
    positions: list[LensPosition]

    def to_dict(self) -> dict[str, Any]:
        def top(t: list[tuple[int, str, float]]) -> list[dict[str, Any]]:
            return [{"id": i, "text": s, "prob": p} for i, s, p in t]

        return {
            "n_tokens": self.n_tokens,
            "n_layer": self.n_layer,
            "top_k": self.top_k,
            "kl": "KL(final || layer), nats",
            "positions": [
                {
                    "position": p.position,
                    "id": p.id,
                    "text": p.text,
                    "next": None if p.next_id is None else {"id": p.next_id, "text": p.next_text},
                    "final": top(p.final),
                    "layers": [
                        {"layer": c.layer, "kl": c.kl, "next_prob": c.next_prob, "top": top(c.top)} for c in p.layers
                    ],
                }
                for p in self.positions
            ],
        }


def parse_positions(spec: str | None, n: int) -> list[int]:
    """``"0,3,5-7,-1"`` over n tokens -> sorted distinct positions (negative
    counts from the end); None or "all" -> every position."""
    if spec is None or spec.strip() in ("", "all"):
        return list(range(n))
    out: set[int] = set()

    def one(s: str) -> int:
        try:
            p = int(s)
        except ValueError:
            raise BadInputError(f"position {s!r} is not an integer", hint="e.g. --positions 0,3,5-7,-1") from None
        q = p + n if p < 0 else p
        if not 0 <= q < n:
            raise BadInputError(f"position {p} is outside the text's {n} tokens (0..{n - 1}, or -1 for the last)")
        return q

    for part in spec.split(","):
        part = part.strip()
        if not part:
            continue
        lo, sep, hi = part[1:].partition("-")  # a leading '-' is a sign, not a range
        if sep:
            a, b = one(part[0] + lo), one(hi)
            if a > b:
                raise BadInputError(f"range {part!r} runs backwards")
            out.update(range(a, b + 1))
        else:
            out.add(one(part))
    if not out:
        raise BadInputError(f"no positions in {spec!r}", hint="e.g. --positions 0,3,5-7,-1")
    return sorted(out)


def _positions(positions: Sequence[int] | None, n: int) -> list[int]:
    """The chosen positions (negative: from the end), in the order given."""
    if positions is None:
        return list(range(n))
    pos = []
    for p in positions:
        q = int(p) + n if int(p) < 0 else int(p)
        if not 0 <= q < n:
            raise BadInputError(f"position {p} is outside the text's {n} tokens (0..{n - 1}, or -1 for the last)")
        pos.append(q)
    if not pos:
        raise BadInputError("no positions chosen")
    return pos


def lens_logits(
    model: Scorable, text: str | Sequence[int], positions: Sequence[int] | None = None, max_tokens: int | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """Every layer's lens logits at the chosen positions (default all),
    (n_layer, P, V) float32, and the model's own logits there, (P, V): the
    arrays ``lens`` summarizes (memory n_layer · P · V floats)."""
    ids = text_ids(model, text, max_tokens)
    streams, final = residual_streams(model, ids)
    assert final is not None
    _check_ids(model, ids)
    rows = np.asarray(_positions(positions, len(ids)), np.int64)
    head = _Head(model, len(rows))
    try:
        out = np.stack([head(s[rows]) for s in streams])
    finally:
        head.close()
    _check_last(model, out[-1], final[rows])
    return out, final[rows]


def _tops(lp: np.ndarray, k: int, decode: Callable[[int], str]) -> list[list[tuple[int, str, float]]]:
    """Each row's k most likely tokens (id, text, probability), most likely first."""
    if k <= 0:
        return [[] for _ in range(lp.shape[0])]
    best = np.argpartition(-lp, k - 1, axis=1)[:, :k]
    vals = np.take_along_axis(lp, best, axis=1)
    order = np.argsort(-vals, axis=1, kind="stable")
    best, probs = np.take_along_axis(best, order, axis=1), np.exp(np.take_along_axis(vals, order, axis=1))
    return [[(int(i), decode(int(i)), float(q)) for i, q in zip(b, pr)] for b, pr in zip(best, probs)]


def logit_lens(
    model: Scorable,
    text: str | Sequence[int],
    top_k: int = 5,
    positions: Sequence[int] | None = None,
    max_tokens: int | None = None,
) -> LensResult:
    """The logit lens of ``text`` (a str, tokenized like a prompt, or token
    ids): for each chosen position (default all; negative counts from the
    end) and each layer, the top
    ``top_k`` tokens with their probabilities, KL(final ‖ layer) and the
    probability of the actual next token. ``max_tokens``: read only the
    text's first tokens (positions count within them)."""
    if top_k < 0:
        raise BadInputError(f"top_k={top_k} must be >= 0")
    ids = text_ids(model, text, max_tokens)
    _check_ids(model, ids)
    n = len(ids)
    pos = _positions(positions, n)
    streams, final = residual_streams(model, ids)
    assert final is not None
    tok = model.tokenizer
    cache: dict[int, str] = {}

    def decode(i: int) -> str:
        if i not in cache:
            cache[i] = tok.decode([i])
        return cache[i]

    k = min(top_k, final.shape[1])
    rows = np.asarray(pos, np.int64)
    lp_final = log_softmax(final[rows])  # (P, V) float64
    p_final = np.exp(lp_final)
    nxt = [ids[p + 1] if p + 1 < n else None for p in pos]
    cells: list[list[LensCell]] = [[] for _ in pos]
    head = _Head(model, len(pos))
    try:
        for layer, s in enumerate(streams):
            logits = head(s[rows])
            if layer == len(streams) - 1:
                _check_last(model, logits, final[rows])
            lp = log_softmax(logits)
            kl = np.einsum("pv,pv->p", p_final, lp_final - lp)
            tops = _tops(lp, k, decode)
            for j in range(len(pos)):
                t = nxt[j]
                cells[j].append(
                    LensCell(layer, max(float(kl[j]), 0.0), None if t is None else float(np.exp(lp[j, t])), tops[j])
                )
    finally:
        head.close()
    finals = _tops(lp_final, k, decode)
    out = []
    for j, p in enumerate(pos):
        t = nxt[j]
        out.append(LensPosition(p, ids[p], decode(ids[p]), t, None if t is None else decode(t), cells[j], finals[j]))
    return LensResult(n, len(streams), k, out)


def _check_last(model: Scorable, lens_logits: np.ndarray, own: np.ndarray) -> None:
    """The last layer's lens must be the model's own output (else the
    architecture's taps do not end at the stream the head reads)."""
    scale = max(1.0, float(np.abs(own).max(initial=0.0)))
    err = float(np.abs(lens_logits - own).max(initial=0.0))
    if err > 1e-4 * scale:
        raise BadInputError(
            f"the last layer's lens differs from the model's logits by {err:.3g}: architecture "
            f"{model.engine.cfg.architecture!r} does not tap the stream its head reads",
            hint="the logit lens needs `taps` to end with the residual stream before the final norm",
        )


__all__ = [
    "LensCell",
    "LensPosition",
    "LensResult",
    "logit_lens",
    "lens_logits",
    "parse_positions",
    "residual_streams",
    "context_limit",
    "text_ids",
]
