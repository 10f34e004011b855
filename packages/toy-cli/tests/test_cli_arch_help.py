"""`toy train`'s architecture options are documented from the registry: the
``--arch``, ``--preset`` and ``--targets`` help texts name every family, its
presets and its LoRA targets (so they cannot go stale when a family is
added), and rendering them keeps ``toy train --help`` free of numpy and
ggml."""

from __future__ import annotations

import subprocess
import sys

import pytest

from toy import models
from toy.train.config import ModelShape
from toy_testsupport.cli_helpers import run


def _option_line(capsys, monkeypatch, option: str, *command: str) -> str:
    """The help line of ``option`` in ``toy COMMAND --help``, on a terminal
    wide enough that rich does not wrap it."""
    monkeypatch.setenv("COLUMNS", "1000")
    code, out, _ = run(capsys, *command, "--help")
    assert code == 0
    lines = [ln for ln in out.splitlines() if f" {option} " in ln]
    assert len(lines) == 1, out
    return " ".join(lines[0].split())


@pytest.mark.parametrize("command", ["from-scratch", "warm-start"])
def test_arch_and_preset_help_list_every_family(capsys, monkeypatch, command):
    arch = _option_line(capsys, monkeypatch, "--arch", "train", command)
    for family in models.families():
        assert family in arch, arch
    assert f"{ModelShape().arch} (default)" in arch
    preset = _option_line(capsys, monkeypatch, "--preset", "train", command)
    for a in models.language_models():
        assert f"({a.family})" in preset, preset
        for name in a.presets:
            assert name in preset, preset
    assert "gemma" in arch and "(gemma)" in preset  # the family the hand-written texts had left out


def test_targets_help_lists_each_familys_lora_targets(capsys, monkeypatch):
    targets = _option_line(capsys, monkeypatch, "--targets", "train", "lora")
    for a in models.language_models():
        assert f"{a.family} {','.join(a.lora_names)} (default {','.join(a.lora_default)})" in targets, targets
    assert "router" in targets  # the llama family's MoE target


def test_train_help_imports_neither_numpy_nor_ggml():
    probe = (
        "import sys; from toy_cli.main import main; rc = main(['train', 'from-scratch', '--help']); "
        "print('PROBE', rc, ' '.join(sorted({m.split('.')[0] for m in sys.modules})), file=sys.stderr)"
    )
    proc = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    line = next(ln for ln in proc.stderr.splitlines() if ln.startswith("PROBE"))
    _, rc, *top = line.split()
    assert rc == "0", proc.stderr
    assert "toy" in top  # the help texts did read the registry
    assert not {"numpy", "toy_ggml"} & set(top), top
