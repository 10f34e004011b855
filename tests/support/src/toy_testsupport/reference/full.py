"""The full-sequence forward of any registered architecture, without a KV
cache: ``FullModel.logits(ids)`` runs the causal forward of one sequence
with a graph built once per sequence length. Used by tests as the engine's
counterpart (the inference engine is ``toy.engine.llm``); it runs on ggml,
unlike the NumPy references beside it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

import toy_ggml
from toy import models
from toy.models.common import causal_mask, forward_logits, padded_length


@dataclass
class _Step:
    """The graph for one sequence length: inputs in their own allocated
    context, ops in another (memory from the runtime's scheduler)."""

    inputs: toy_ggml.Context
    ops: toy_ggml.Context
    graph: toy_ggml.Graph
    tokens: toy_ggml.Tensor
    out: toy_ggml.Tensor


class FullModel:
    """A GGUF model of any registered architecture bound zero-copy on a Runtime; ``logits(ids)``
    runs the full causal forward with a graph built once per sequence length.

    ``kv_type``: the type K and V are rounded to before attention; F16 (the
    default) is what llama.cpp's default KV cache does, None keeps them F32.
    ``kv_pad``: the attention length is T rounded up to a multiple of it
    (zero, masked keys/values); 32 (the default) is llama.cpp's KV padding
    without flash attention. With both defaults our logits agree with
    llama.cpp's to float32 rounding; kv_pad=1 is the plain forward.

    Graphs are cached per sequence length (the ``max_graphs`` most recent
    lengths): a repeated length is token uploads plus one compute. Switching
    between cached graphs is safe: the Runtime re-allocates a graph whose
    scheduler memory went to another one.
    """

    def __init__(self, cfg, gf, weights, runtime: toy_ggml.Runtime, kv_type=toy_ggml.GGMLType.F16, kv_pad: int = 32):
        if kv_pad < 1:
            raise ValueError(f"kv_pad={kv_pad} must be >= 1")
        self.cfg, self.gguf, self.weights, self.runtime = cfg, gf, weights, runtime
        self.kv_type, self.kv_pad = kv_type, kv_pad
        self._steps: dict[int, _Step] = {}  # insertion order = least recently built first
        self.max_graphs = 8
        self.n_builds = 0

    @classmethod
    def load(
        cls,
        path: str | Path,
        runtime: toy_ggml.Runtime,
        kv_type=toy_ggml.GGMLType.F16,
        kv_pad: int = 32,
        repack: bool | str = False,
    ) -> FullModel:
        from toy.gguf import GGUFFile, bind_tensors

        gf = GGUFFile(path)
        try:
            cfg = models.config_from_gguf(gf)
            weights = bind_tensors(gf, runtime, repack=repack)
        except BaseException:
            gf.close()
            raise
        return cls(cfg, gf, weights, runtime, kv_type=kv_type, kv_pad=kv_pad)

    def _build(self, n: int) -> _Step:
        n_kv = padded_length(n, self.kv_pad)
        windows = models.of(self.cfg).windows(self.cfg)  # one causal mask per attention window
        cin = toy_ggml.Context(max_tensors=8 + len(windows))
        tokens = cin.tensor(toy_ggml.GGMLType.I32, (n,), name="tokens")
        pos = cin.tensor(toy_ggml.GGMLType.I32, (n,), name="pos")
        mask = {w: cin.tensor(toy_ggml.GGMLType.F32, (n, n_kv), name=f"mask.w{w}") for w in windows}
        cin.allocate(self.runtime)
        pos.set(np.arange(n, dtype=np.int32))
        for w, m in mask.items():
            m.set(causal_mask(n, n_kv, w))
        size = 80 * self.cfg.n_layer + 256
        ops = toy_ggml.Context(max_tensors=size)
        out = forward_logits(ops, self.cfg, self.weights, tokens, pos, mask, n, kv_type=self.kv_type)
        out.set_output()
        graph = toy_ggml.Graph(ops, size=max(2048, size)).build_forward(out)
        self.n_builds += 1
        return _Step(cin, ops, graph, tokens, out)

    def _drop_steps(self) -> None:
        for s in self._steps.values():
            s.ops.close()
            s.inputs.close()
        self._steps.clear()

    def logits(self, ids: Sequence[int] | np.ndarray) -> np.ndarray:
        """Logits (T, n_vocab) float32 for token ids (T,)."""
        ids = np.asarray(ids, dtype=np.int32).reshape(-1)
        n = len(ids)
        if n == 0:
            raise ValueError("logits: no tokens")
        if self.cfg.context_length and n > self.cfg.context_length:
            raise ValueError(f"logits: {n} tokens exceed the context length {self.cfg.context_length}")
        step = self._steps.get(n)
        if step is None:
            if len(self._steps) >= self.max_graphs:
                oldest = self._steps.pop(next(iter(self._steps)))
                oldest.ops.close()
                oldest.inputs.close()
            step = self._steps[n] = self._build(n)
        step.tokens.set(ids)
        self.runtime.compute(step.graph)
        return step.out.numpy()

    def close(self) -> None:
        self._drop_steps()
        self.weights.close()
        self.gguf.close()

    def __enter__(self) -> FullModel:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


__all__ = ["FullModel"]
