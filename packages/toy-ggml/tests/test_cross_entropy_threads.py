"""Toy patch 0022: CROSS_ENTROPY_LOSS adds its rows' sums up in an order that
does not depend on the thread count (two halves, as two threads did).

Expected values: the loss of 1 to 4 threads is the same float, bit for bit,
for row counts that split evenly, oddly, or leave threads without rows; NumPy
(float64) agrees within float32 rounding. That the two-halves order keeps the
bits two threads gave before the patch is what the pinned training curve
checks (packages/toy-core/tests/test_train_pinned.py, recorded with 2 threads
before it).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest

import toy_ggml as tg


def _eval_graph():
    # pytest imports test modules by path (--import-mode=importlib): load conftest's helper the same way
    spec = importlib.util.spec_from_file_location("_toy_ggml_conftest", Path(__file__).with_name("conftest.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.eval_graph


eval_graph = _eval_graph()


@pytest.fixture(scope="module")
def runtimes():
    rts = {n: tg.Runtime("cpu", threads=n) for n in (1, 2, 3, 4)}
    yield rts
    for r in rts.values():
        r.close()


@pytest.mark.parametrize("rows", [1, 2, 3, 7, 64, 129])
def test_loss_is_the_same_bits_for_every_thread_count(runtimes, rows):
    rng = np.random.default_rng(rows)
    vocab = 50
    logits = (rng.standard_normal((rows, vocab)) * 3).astype(np.float32)
    labels = np.zeros((rows, vocab), np.float32)
    labels[np.arange(rows), rng.integers(0, vocab, rows)] = 1.0
    got = {
        n: eval_graph(rt, lambda ctx, a, b: ctx.cross_entropy_loss(a, b), logits, labels) for n, rt in runtimes.items()
    }
    bits = {n: np.asarray(v, np.float32).tobytes() for n, v in got.items()}
    assert len(set(bits.values())) == 1, {n: float(np.asarray(v).reshape(-1)[0]) for n, v in got.items()}
    x = logits.astype(np.float64)
    logp = x - x.max(1, keepdims=True)
    logp -= np.log(np.exp(logp).sum(1, keepdims=True))
    want = -(logp * labels).sum() / rows
    np.testing.assert_allclose(float(np.asarray(got[1]).reshape(-1)[0]), want, rtol=1e-5)
