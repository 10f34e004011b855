"""Shared helpers of the training-engine tests: hand-made packed batches and
the gradient comparison (registered by the root conftest.py as
``train_helpers``; pytest runs with ``--import-mode=importlib``)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass
class Batch:
    tokens: np.ndarray
    targets: np.ndarray
    loss_mask: np.ndarray
    pos: np.ndarray
    doc: np.ndarray


def packed_batch(rng, vocab: int, B: int, T: int, *, mask_some: bool = True) -> Batch:
    """Rows of documents separated by random boundaries: doc ids increment
    at a boundary, positions restart, the target crossing a boundary is
    masked, plus a few random masked targets."""
    tokens = rng.integers(0, vocab, (B, T)).astype(np.int32)
    targets = rng.integers(0, vocab, (B, T)).astype(np.int32)
    doc = np.zeros((B, T), np.int32)
    pos = np.zeros((B, T), np.int32)
    mask = np.ones((B, T), np.float32)
    for b in range(B):
        cuts = sorted(rng.choice(np.arange(2, T - 1), size=2, replace=False)) if T > 5 else []
        d, p = 0, 0
        for t in range(T):
            if t in cuts:
                d, p = d + 1, 0
                mask[b, t - 1] = 0.0  # the last token of a document predicts nothing
            doc[b, t], pos[b, t] = d, p
            p += 1
    if mask_some:
        mask[rng.random((B, T)) < 0.15] = 0.0
    return Batch(tokens, targets, mask, pos, doc)


def assert_grads_close(got, want):
    assert set(got) == set(want)
    for name in want:
        ref = np.asarray(want[name], np.float64)
        tol = 2e-4 * float(np.abs(ref).max()) + 1e-6
        err = float(np.abs(np.asarray(got[name]) - ref).max())
        assert err <= tol, f"{name}: max error {err:.3g} > {tol:.3g}"
