"""CLI tests: exit codes, error:/hint: lines, --json output.

The CLI is driven through ``toy_cli.main.main`` (what the console script
calls), capturing stdout/stderr, plus one real subprocess run of the installed
``toy`` script.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import toy_ggml
from toy_testsupport.cli_helpers import run


def test_version(capsys):
    code, out, _ = run(capsys, "--version")
    assert code == 0
    assert out.startswith("toy 0.1.0")
    assert toy_ggml.GGML_VERSION in out


def test_devices_text(capsys):
    code, out, err = run(capsys, "devices")
    assert code == 0
    assert "CPU" in out
    assert "backend" in err


def test_devices_json(capsys):
    code, out, _ = run(capsys, "devices", "--json")
    assert code == 0
    data = json.loads(out)
    names = [d["name"] for d in data["devices"]]
    assert names == [d.name for d in toy_ggml.devices()]
    assert data["build"]["backend"] == toy_ggml.build_config.BACKEND
    assert data["build"]["patches"] == list(toy_ggml.build_config.PATCHES)


def test_unknown_command_is_bad_input(capsys):
    code, _, err = run(capsys, "no-such-command")
    assert code == 2
    assert err.startswith("error:")


def test_unknown_option_is_bad_input(capsys):
    code, _, err = run(capsys, "devices", "--nope")
    assert code == 2
    assert "error:" in err and "hint:" in err


def test_missing_optional_package_gives_hint(capsys, monkeypatch):
    import importlib.metadata as md

    real = md.entry_points

    def without_vit(**kw):  # as if toy-vit were not installed (the dev venv has it)
        eps = real(**kw)
        return [ep for ep in eps if ep.name != "vit"] if kw.get("group") == "toy.commands" else eps

    monkeypatch.setattr(md, "entry_points", without_vit)
    code, _, err = run(capsys, "vit")
    assert code == 2
    assert "error: 'toy vit' is not installed" in err
    # the dev environment is an editable install: `just setup` installs toy-vit (toy.extras; each way of
    # installing is tests/tools/test_extras.py's, and the hints are run in tests/tools/test_install_e2e.py)
    assert err.rstrip().split("\n")[-1].startswith("hint: ") and err.rstrip().endswith("just setup")


def test_console_script_runs():
    exe = shutil.which("toy", path=str(__import__("pathlib").Path(sys.executable).parent))
    assert exe, "the toy console script is not installed next to this Python"
    proc = subprocess.run([exe, "--version"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("toy ")
