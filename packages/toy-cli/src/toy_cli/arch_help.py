"""Help texts of the architecture options (``--arch``, ``--preset``,
``--targets``), written from the model registry (``toy.models``) and the
from-scratch defaults (``toy.train.config.ModelShape``), so they name every
family toy trains and cannot go stale.

Invariant: the command modules call these at import time, so this module and
what it reads (``toy.models``, the family modules, ``toy.train.config``)
import neither numpy nor ggml: ``toy train --help`` stays within its start-up
budget (docs/concepts/architecture.md; test_cli_lazy checks the imports).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import fields

from toy import models
from toy.train.config import ModelShape


def _either(items: Iterable[str]) -> str:
    """``a``, ``a or b``, ``a, b or c``."""
    items = list(items)
    return items[0] if len(items) == 1 else f"{', '.join(items[:-1])} or {items[-1]}"


def _default_arch() -> str:
    return str(next(f.default for f in fields(ModelShape) if f.name == "arch"))


def arch_help() -> str:
    """``--arch``: the families, the default marked."""
    default = _default_arch()
    names = [f"{f} (default)" if f == default else f for f in models.families()]
    return f"Architecture family: {_either(names)}."


def preset_help() -> str:
    """``--preset``: each family's presets."""
    return "; ".join(f"{_either(arch.presets)} ({arch.family})" for arch in models.language_models()) + "."


def targets_help() -> str:
    """``--targets``: each family's LoRA target names and its default set."""
    per_family = (
        f"{arch.family} {','.join(arch.lora_names)} (default {','.join(arch.lora_default)})"
        for arch in models.language_models()
    )
    return f"Modules to adapt: {'; '.join(per_family)}."


__all__ = ["arch_help", "preset_help", "targets_help"]
