"""Fixtures of toy-vit's model tests.

``vit_ref`` (this folder's Hugging Face reference) is registered as a module
once, because test folders are not on ``sys.path`` (``--import-mode=importlib``).

``hf_vit(variant)``: a seeded random Hugging Face ViTForImageClassification of
``vit_ref.VARIANTS[variant]`` saved in a session temporary folder, converted
with ``toy_vit.convert.convert_hf``: ``(model, hf_folder, gguf_path)``, built
once per variant per session.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

if "vit_ref" not in sys.modules:
    _spec = importlib.util.spec_from_file_location("vit_ref", Path(__file__).with_name("vit_ref.py"))
    _mod = importlib.util.module_from_spec(_spec)
    sys.modules["vit_ref"] = _mod
    _spec.loader.exec_module(_mod)


@pytest.fixture(scope="session")
def hf_vit(tmp_path_factory):
    import vit_ref

    from toy_vit.convert import convert_hf

    made: dict[str, tuple] = {}

    def get(variant: str = "rgb32"):
        if variant not in made:
            d = tmp_path_factory.mktemp(f"hf-{variant}")
            model = vit_ref.make_hf_vit(d / "hf", variant)
            made[variant] = (model, d / "hf", convert_hf(d / "hf", d / f"{variant}.gguf"))
        return made[variant]

    return get
