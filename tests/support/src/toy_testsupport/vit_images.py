"""Tiny image folders for toy-vit's tests: one subfolder per class of random RGB PNGs.

``write_folder(root, classes, per_class, size, seed)`` draws each image from one
``numpy.random.default_rng(seed)`` stream, ``N(60 + 60 k, 40)`` for class ``k`` clipped to
0..255, so the classes differ in brightness (a model can learn them in a few steps).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np


def write_folder(root: Path, classes=("a", "b", "c"), per_class: int = 8, size: int = 16, seed: int = 0) -> Path:
    """Random RGB PNGs with a different brightness per class; returns ``root``."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    for k, c in enumerate(classes):
        (root / c).mkdir(parents=True, exist_ok=True)
        for i in range(per_class):
            a = rng.normal(60 + 60 * k, 40, (size, size, 3)).clip(0, 255).astype(np.uint8)
            Image.fromarray(a).save(root / c / f"{i:02d}.png")
    return root
