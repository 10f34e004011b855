"""The ViT in toy's registry: its ``ARCH`` conforms to the ``Architecture``
Protocol (structurally) and is not a ``LanguageModel``; ``toy vit train
--preset``'s help names every preset and the default. That help stays
hand-written because ``toy --help`` imports ``toy_vit.cli`` and must not
import ``toy`` (toy-cli's test_cli_lazy), so this test keeps it in step."""

from __future__ import annotations

import re

import typer.main

from toy import models
from toy.models import Architecture, LanguageModel
from toy_vit import arch as vit_arch
from toy_vit.cli import app
from toy_vit.config import PRESETS
from toy_vit.trainconfig import ViTTrainConfig


def test_the_vit_is_a_registered_architecture_not_a_language_model():
    assert models.get("vit") is vit_arch.ARCH
    assert isinstance(vit_arch.ARCH, Architecture) and not isinstance(vit_arch.ARCH, LanguageModel)
    assert models.get("vit").presets is PRESETS


def test_preset_help_names_every_preset_and_the_default():
    train = typer.main.get_group(app).commands["train"]
    (opt,) = [p for p in train.params if "--preset" in getattr(p, "opts", ())]
    named = re.findall(r"vit-[\w-]+|\bdigits\b", opt.help)
    assert sorted(named) == sorted(PRESETS), opt.help
    assert f"{ViTTrainConfig().preset} (default)" in opt.help
