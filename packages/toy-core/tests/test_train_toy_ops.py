"""A training step built without toy's own ops (``Runtime.toy_ops`` False, as on a GPU: the step's gradient norm
and AdamW are the standard ops ``sum(sqr(g))`` and ``opt_step_adamw(mul(g, factor))`` instead of patch 0017's
SUM_SQR and OPT_STEP_ADAMW_SCALED) gives the run of the toy ops bit for bit on the CPU: the same step losses and
gradient norms, the same checkpoint. Reference: the same run with the toy ops, in this process (patch 0017 defines
its ops as those standard ops computed in one pass; toy-ggml's test_toy_ops_switch.py checks both against NumPy).
"""

from __future__ import annotations

import numpy as np

import toy_ggml
from toy.gguf import GGUFFile
from toy.train.config import defaults, override
from toy.train.lmrun import train
from toy_testsupport.train_helpers import TINY_SCRATCH, events

WORDS = ("alpha", "beta", "gamma", "delta", "river", "stone", "cloud", "maple")


class _NoToyOps(toy_ggml.Runtime):
    """A CPU runtime that answers toy_ops as a GPU's does."""

    @property
    def toy_ops(self) -> bool:
        return False


def _run(tmp_path, name: str):
    rng = np.random.default_rng(0)
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n".join(" ".join(rng.choice(WORDS, size=10)) + "." for _ in range(200)))
    values = {**TINY_SCRATCH, "data.paths": [str(corpus)], "steps": 3, "optim.grad_clip": 0.5}
    res = train(override(defaults(), **values, out=str(tmp_path / name)))
    steps = [(e["step"], e["loss"], e.get("grad_norm")) for e in events(res.run_dir) if e["kind"] == "step"]
    gf = GGUFFile(res.checkpoint)
    return steps, {name: bytes(gf.tensor_bytes(name)) for name in gf.tensors}


def test_a_step_without_toy_ops_gives_the_same_bits(tmp_path, monkeypatch):
    want_steps, want = _run(tmp_path, "toy")
    monkeypatch.setattr(toy_ggml, "Runtime", _NoToyOps)
    got_steps, got = _run(tmp_path, "std")
    assert len(want_steps) == 3 and all(s[2] is not None for s in want_steps)
    assert got_steps == want_steps
    assert got.keys() == want.keys()
    for k in want:
        assert got[k] == want[k], k


def test_the_step_graph_has_no_toy_ops_when_the_runtime_lacks_them(tmp_path, monkeypatch):
    seen: set[str] = set()

    class _Watch(_NoToyOps):
        def compute(self, graph, profile=False):
            seen.update(t.op for t in graph.nodes)
            return super().compute(graph, profile)

    monkeypatch.setattr(toy_ggml, "Runtime", _Watch)
    _run(tmp_path, "watch")
    assert "OPT_STEP_ADAMW" in seen and "SUM" in seen
    assert not seen & {"SUM_SQR", "OPT_STEP_ADAMW_SCALED"}
