"""The bundled demo learns in one step: ``toy vit demo-data digits`` prints the
command to train on it, the guide (docs/guide/vit.md) runs that very
command, and a short run of it learns well above chance (10 %).

Issue 41: ``toy vit train digits --steps 150`` with the defaults (the
``vit-small32`` preset: RGB input, 4-pixel patches of one original pixel
each) stayed at chance, 10.8 % validation accuracy. The printed command uses
the ``digits`` preset (grey input, 8-pixel patches, width 128).
"""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import pytest

from toy_testsupport.cli_helpers import run

GUIDE = Path(__file__).resolve().parents[3] / "docs" / "guide" / "vit.md"


@pytest.fixture(autouse=True)
def _home(tmp_path, monkeypatch):
    monkeypatch.setenv("TOY_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("TOY_RUNS_DIR", raising=False)
    monkeypatch.chdir(tmp_path)


@pytest.mark.slow
def test_demo_data_prints_the_guides_command_and_it_learns(capsys):
    code, out, err = run(capsys, "vit", "demo-data", "digits")
    assert code == 0, err
    line = next(x for x in err.splitlines() if x.startswith("train a classifier on them: "))
    command = line.split(": ", 1)[1]
    assert command == "toy vit train digits --preset digits --steps 1000 --no-flip"
    assert f"$ {command}\n" in GUIDE.read_text()  # the guide runs it as printed
    args = shlex.split(command)
    assert args[:3] == ["toy", "vit", "train"]
    args[args.index("--steps") + 1] = "300"  # shorter; the full 1000 steps reach about 92 %
    code, out, err = run(capsys, *args[1:], "--threads", "1", "--json", "-q")
    assert code == 0, err
    res = json.loads(out)
    # measured: 45.95 % validation accuracy after these 300 steps (one thread, seed 0; 91.89 % after the
    # printed 1000 steps on two); vit-small32 with the defaults stays near chance (10 %) this long
    assert res["final_step"] == 300 and res["val_accuracy"] >= 0.30, res
