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


def seeded_adapter(base_path, out_path, *, seed: int, rank: int, alpha: float, targets, std: float, base_name: str):
    """A LoRA adapter for the GGUF model ``base_path`` (any architecture):
    for every layer in order and every target in ``targets``' order (the
    weight the registry's ``lora_targets`` names), A (rank, in) then B (out,
    rank), entries ``std · N(0, 1)`` from one ``np.random.default_rng(seed)``
    stream, float32; written with ``save_adapter`` (``toy.lora.base`` =
    ``base_name``, fixed so the bytes do not depend on where the model is).
    The llama.cpp adapter fixtures are recorded on such files."""
    from toy import models
    from toy.gguf import GGUFFile
    from toy.train.adapter import save_adapter

    with GGUFFile(base_path) as gf:
        cfg = models.config_from_gguf(gf)
        shapes = {n: tuple(i.shape) for n, i in gf.tensors.items()}
    spec = models.of(cfg).lora_targets(cfg)
    rng = np.random.default_rng(seed)
    pairs = {}
    for i in range(cfg.n_layer):
        for t in targets:
            name = f"blk.{i}.{spec[t].stem}.weight"
            out, inn = shapes[name]
            a = (rng.standard_normal((rank, inn)) * std).astype(np.float32)
            b = (rng.standard_normal((out, rank)) * std).astype(np.float32)
            pairs[name] = (a, b)
    return save_adapter(
        out_path, architecture=cfg.architecture, pairs=pairs, alpha=alpha, rank=rank, targets=list(targets),
        base=base_name,
    )  # fmt: skip


def python_docs_corpus(root, n_small: int) -> dict:
    """The bundled Python-docs corpus written under ``root`` (``all``), its first ``n_small`` files copied to
    ``small``, and a token cache folder: ``{"all", "small", "cache"}`` paths (for the recipe tests)."""
    from toy.train.corpus import write_python_docs

    paths = write_python_docs(root / "all")
    small = root / "small"
    small.mkdir()
    for p in paths[:n_small]:
        (small / p.name).write_text(p.read_text())
    return {"all": root / "all", "small": small, "cache": root / "cache"}
