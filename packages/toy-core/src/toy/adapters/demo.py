"""A seeded random LoRA adapter for any model: an example file for ``--lora``,
``toy merge`` and ``toy serve --lora`` (``toy train demo-adapter`` writes one).

It is not trained: its A and B matrices are ``std · N(0, 1)`` draws, so it
changes what a model generates without teaching it anything. The draws come
from one ``numpy.random.default_rng(seed)`` stream in a fixed order (every
layer in order; within a layer, the targets in the order given; A (rank, in)
then B (out, rank)), float32. With the defaults and SmolLM2-135M-Instruct
Q4_1 the file is byte for byte the adapter toy's llama.cpp LoRA parity test
records (``packages/toy-core/tests/fixtures/lora_llamacpp.json``).
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from toy.adapters.file import save_adapter
from toy.errors import BadInputError

DEMO_SEED = 20251130
DEMO_RANK = 8
DEMO_ALPHA = 16.0
DEMO_TARGETS = ("q", "v")
DEMO_STD = 0.07


def random_adapter(
    base: str | os.PathLike,
    out: str | os.PathLike,
    *,
    seed: int = DEMO_SEED,
    rank: int = DEMO_RANK,
    alpha: float = DEMO_ALPHA,
    targets: Sequence[str] = DEMO_TARGETS,
    std: float = DEMO_STD,
    base_name: str | None = None,
) -> Path:
    """Write a seeded random adapter for the GGUF model ``base`` to ``out``
    (atomically); returns the path. ``toy.lora.base`` records ``base_name``
    (default: the base file's name), so the bytes do not depend on the folder
    the model is in."""
    from toy import models
    from toy.gguf import GGUFFile

    if rank < 1:
        raise BadInputError(f"rank={rank} must be >= 1", field="rank")
    if not (math.isfinite(std) and std > 0):
        raise BadInputError(f"std={std} must be a positive number", field="std")
    if not 0 <= seed < 2**63:
        raise BadInputError(f"seed={seed} must be in [0, 2**63)", field="seed")
    base = Path(base)
    with GGUFFile(base) as gf:
        cfg = models.config_from_gguf(gf)
        shapes = {n: tuple(i.shape) for n, i in gf.tensors.items()}
    spec = models.language_model_of(cfg).lora_targets(cfg)
    targets = list(targets)
    unknown = [t for t in targets if t not in spec]
    if not targets or unknown:
        raise BadInputError(
            f"targets {','.join(unknown) or '(none)'}: not a target of {cfg.architecture} models",
            hint=f"choose among {','.join(spec)}",
            field="targets",
        )
    rng = np.random.default_rng(seed)
    pairs = {}
    for i in range(cfg.n_layer):
        for t in targets:
            name = f"blk.{i}.{spec[t].stem}.weight"
            n_out, n_in = shapes[name]
            a = (rng.standard_normal((rank, n_in)) * std).astype(np.float32)
            b = (rng.standard_normal((n_out, rank)) * std).astype(np.float32)
            pairs[name] = (a, b)
    return save_adapter(
        out,
        architecture=cfg.architecture,
        pairs=pairs,
        alpha=alpha,
        rank=rank,
        targets=targets,
        base=base_name or base.name,
    )
