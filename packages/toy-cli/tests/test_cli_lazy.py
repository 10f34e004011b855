"""The root group imports a command's module only when that command runs
(``toy_cli.lazy``): what a fresh ``toy`` process imports, and that ``toy
--help`` lists the same thing from the table as from the commands themselves.
"""

from __future__ import annotations

import inspect
import subprocess
import sys

import pytest
import typer.main

from toy_cli import main as cli_main
from toy_testsupport.cli_helpers import run

HEAVY = {"numpy", "toy", "toy_ggml", "tokenizers", "jinja2", "huggingface_hub"}
COMMAND_MODULES = sorted({entry.module for entry in cli_main.COMMANDS.values()})


def fresh_imports(*args: str) -> tuple[set[str], str]:
    """(modules imported, stdout) of ``toy ARGS`` in a fresh interpreter."""
    probe = (
        "import sys; from toy_cli.main import main; "
        f"rc = main({list(args)!r}); "
        "print('PROBE', rc, ' '.join(sorted(sys.modules)), file=sys.stderr)"
    )
    proc = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    line = next(ln for ln in proc.stderr.splitlines() if ln.startswith("PROBE"))
    _, rc, *mods = line.split()
    assert rc == "0", proc.stderr
    return set(mods), proc.stdout


def test_help_imports_no_command_module_and_nothing_heavy():
    mods, out = fresh_imports("--help")
    assert not mods & set(COMMAND_MODULES), sorted(mods & set(COMMAND_MODULES))
    assert not {m.split(".")[0] for m in mods} & HEAVY
    for name in cli_main.COMMANDS:
        assert name in out


@pytest.mark.parametrize(
    ("command", "module"),
    [("describe", "toy_cli.commands.models"), ("runs", "toy_cli.commands.runs"), ("chat", "toy_cli.commands.infer")],
)
def test_a_command_imports_its_own_module_only(command, module):
    mods, out = fresh_imports(command, "--help")
    # the helpers the command modules share are toy_cli.ui's, so no command module imports another
    assert {m for m in COMMAND_MODULES if m in mods} == {module}
    assert "toy_cli.ui" in mods
    assert "Usage:" in out


def test_the_table_matches_the_commands():
    """Each built-in's help line in ``COMMANDS`` is the first paragraph of the
    command's own help, and its group flag is right; every command a module
    registers is in the table."""
    for module in COMMAND_MODULES:
        sub = typer.Typer()
        __import__(module, fromlist=["register"]).register(sub)
        for name, cmd in typer.main.get_group(sub).commands.items():
            entry = cli_main.COMMANDS.get(name)
            assert entry is not None and entry.module == module, name
            assert entry.help == inspect.cleandoc(cmd.help or "").split("\n\n")[0], name
            assert entry.group == isinstance(cmd, typer.core.TyperGroup), name


def test_help_lists_the_same_as_the_real_commands(capsys, monkeypatch):
    code, stubbed, _ = run(capsys, "--help")
    assert code == 0
    monkeypatch.setattr(cli_main._Root, "stubs", False)
    code, real, _ = run(capsys, "--help")
    assert code == 0
    assert stubbed == real
    names = [ln.split()[1] for ln in real.splitlines() if ln.startswith("│ ") and len(ln.split()) > 2]
    order = [n for n in names if n in cli_main.COMMANDS or n in ("devices", "serve", "vit")]
    # typer's order with everything registered up front: commands, then groups
    assert order.index("merge") < order.index("serve") < order.index("train") < order.index("data")


def test_unknown_command_still_suggests_a_built_in(capsys):
    code, _, err = run(capsys, "descrbe")
    assert code == 2
    assert "Did you mean 'describe'" in err
