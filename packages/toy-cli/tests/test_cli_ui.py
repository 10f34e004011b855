"""``toy_cli.ui``, the toolkit every ``toy`` command shares (plugins included).

Errors: the exit code and the ``error:``/``hint:`` lines come from the
exception's type (a ``BadInputError``, a malformed GGUF file's ``GGUFError``,
a plain ``ToyError``, a ``CLIError``), whether the error goes through
``cli_errors()`` or reaches ``main`` on its own. Options: the flags that
several commands share are declared once, in ``toy_cli.ui.options``, and the
commands of toy-cli, toy-serve and toy-vit all read that declaration.
Plugins reach toy-cli through its public toolkit only.
"""

from __future__ import annotations

import ast
import typing
from pathlib import Path

import pytest
import typer
import typer.main

import toy_serve.cli
import toy_vit.cli
from toy.errors import BadInputError, ToyError
from toy.gguf import GGUFError
from toy_cli import main as cli_main
from toy_cli import ui
from toy_cli.commands import eval as eval_cmds
from toy_cli.commands import infer as infer_cmds
from toy_cli.commands import train as train_cmds
from toy_testsupport.cli_helpers import assert_clean_error, run

PACKAGES = Path(__file__).resolve().parents[2]

# -- errors ------------------------------------------------------------------------

ERRORS = [
    (BadInputError("--top-k -3 must be >= 0", hint="0 turns it off"), 2),
    (GGUFError("bad.gguf: not a GGUF file (magic b'nope')", hint="pass a .gguf model"), 2),
    (ToyError("the download was cut off", hint="try again"), 1),
    (ui.CLIError("runs: not a folder", "pass the folder that holds the run folders", 2), 2),
    (ui.CLIError("could not write out.gguf", "free some space"), 1),
]
IDS = ["bad-input", "gguf", "toy-error", "cli-error-2", "cli-error-1"]


def _raise(exc: Exception) -> None:
    raise exc


@pytest.mark.parametrize(("exc", "code"), ERRORS, ids=IDS)
def test_cli_errors_keeps_message_and_hint_and_reads_the_code_from_the_type(exc, code):
    with pytest.raises(ui.CLIError) as ei, ui.cli_errors():
        _raise(exc)
    err = ei.value
    assert (str(err), err.hint, err.code, err.exit_code) == (str(exc), exc.hint, code, code)
    if not isinstance(exc, ui.CLIError):
        assert err.__cause__ is exc  # --verbose shows the library's traceback


@pytest.mark.parametrize(("exc", "code"), ERRORS, ids=IDS)
def test_an_error_that_ends_a_command_prints_error_and_hint(exc, code, capsys):
    assert ui.handle_error(exc) == code
    out = capsys.readouterr()
    assert out.out == ""
    assert out.err == f"error: {exc}\nhint: {exc.hint}\n"


def test_the_code_does_not_depend_on_the_text(capsys):
    """The same words exit 2 as a BadInputError and 1 as a plain ToyError."""
    text = "bad.gguf: not a GGUF file"
    assert ui.handle_error(BadInputError(text)) == 2
    assert ui.handle_error(ToyError(text)) == 1
    assert capsys.readouterr().err == f"error: {text}\nerror: {text}\n"


def test_as_cli_error_leaves_other_exceptions_alone():
    assert ui.as_cli_error(RuntimeError("boom")) is None
    e = ui.bad_input("--n must be at least 1", "for example --n 10")
    assert ui.as_cli_error(e) is e and e.code == 2


@pytest.mark.parametrize(("exc", "code"), ERRORS, ids=IDS)
def test_main_reports_errors_raised_by_a_command(exc, code, capsys, monkeypatch):
    """Through ``toy``: a command that raises (here ``toy devices``) ends with
    the error's lines and exit code, no traceback; ``--verbose`` adds it."""
    import toy_ggml

    monkeypatch.setitem(ui.errors._state, "verbose", False)  # put back after the --verbose run
    monkeypatch.setattr(toy_ggml, "devices", lambda: _raise(exc))
    code_, out, err = run(capsys, "devices")
    assert out == ""
    assert_clean_error(code_, err, code, f"error: {exc}", f"hint: {exc.hint}")
    code_, _, err = run(capsys, "--verbose", "devices")
    assert code_ == code and "Traceback" in err and err.rstrip().endswith(f"hint: {exc.hint}")


def test_a_malformed_gguf_file_exits_2_end_to_end(capsys, tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"nope" + bytes(60))
    code, out, err = run(capsys, "describe", bad)
    assert out == ""
    assert_clean_error(code, err, 2, str(bad))


def test_a_missing_plugin_is_bad_input(capsys, monkeypatch):
    monkeypatch.setattr(cli_main, "OPTIONAL", {**cli_main.OPTIONAL, "frobnicate": "toy-frobnicate"})
    code, _, err = run(capsys, "frobnicate", "--anything")
    assert_clean_error(code, err, 2, "'toy frobnicate' is not installed", "hint: pip install toy-frobnicate")


def test_parse_lora_options(tmp_path):
    adapter = tmp_path / "a.gguf"
    adapter.write_bytes(b"")  # only its existence is checked here
    assert ui.parse_lora_options([str(adapter), f"{adapter}:0.5"]) == [(str(adapter), 1.0), (str(adapter), 0.5)]
    assert ui.parse_lora_options(None) == []
    with pytest.raises(ui.CLIError) as ei:
        ui.parse_lora_options([str(tmp_path / "missing.gguf")])
    assert ei.value.code == 2 and "no such file" in str(ei.value) and "--lora" in ei.value.hint


def test_progress_without_a_terminal_is_one_line_per_label_on_stderr(capsys):
    with ui.Progress() as bar:
        for i in range(3):
            bar.update("downloading", i, 3, bytes_=True)
            bar.update("checking", i, 3)
    out = capsys.readouterr()
    assert out.out == ""
    assert out.err == "downloading…\nchecking…\n"


# -- shared options --------------------------------------------------------------------


def _walk(app: typer.Typer, prefix: str):
    """(command path, callback) of every command and group callback of ``app``."""
    if app.registered_callback is not None:
        yield prefix, app.registered_callback.callback
    for c in app.registered_commands:
        yield f"{prefix} {c.name or c.callback.__name__}".strip(), c.callback
    for g in app.registered_groups:
        yield from _walk(g.typer_instance, f"{prefix} {g.name}".strip())


def _commands() -> dict[str, typing.Callable]:
    """Every command of toy-cli, toy-serve and toy-vit: path -> function."""
    found = dict(_walk(cli_main.app, ""))  # the root callback and `devices`
    for module in sorted({entry.module for entry in cli_main.COMMANDS.values()}):
        sub = typer.Typer()
        __import__(module, fromlist=["register"]).register(sub)
        found.update(_walk(sub, ""))
    found["serve"] = toy_serve.cli.serve
    found.update(_walk(toy_vit.cli.app, "vit"))
    found.pop("", None)
    return found


def _options(fn) -> dict[str, typer.models.OptionInfo]:
    """The typer options of a command: its first flag -> the OptionInfo object in its signature."""
    out = {}
    for hint in typing.get_type_hints(fn, include_extras=True).values():
        for info in getattr(hint, "__metadata__", ()):
            if isinstance(info, typer.models.OptionInfo):
                # in Annotated[...], typer.Option's first argument is the first flag, not a default
                out[info.default] = info
    return out


def _info(alias) -> typer.models.OptionInfo:
    (info,) = alias.__metadata__
    return info


def test_the_shared_options_are_declared_once_in_toy_cli_ui():
    cmds = _commands()
    assert {"infer", "chat", "eval perplexity", "serve", "train lora", "vit train", "vit classify"} <= set(cmds)
    device = {name: _options(fn).get("--device") for name, fn in cmds.items()}
    # commands that load a model: one declaration, toy-cli's, toy-serve's and toy-vit's alike
    for name in ("infer", "chat", "eval perplexity", "eval lmc", "serve", "vit eval", "vit classify"):
        assert device[name] is _info(ui.Device), name
    # training runs (their device defaults to the CPU): another one, shared by toy train and toy vit train
    for name in ("train from-scratch", "train lora", "train full", "train warm-start", "vit train"):
        assert device[name] is _info(ui.TrainDevice), name
    assert _info(ui.Device) is not _info(ui.TrainDevice)


# flag -> the toolkit declarations a command may use for it; a command that declares the flag
# itself must be listed in OWN with the reason
SHARED = {
    "--device": (ui.Device, ui.TrainDevice),
    "--threads": (ui.Threads, ui.TrainThreads),
    "--ctx": (ui.Ctx,),
    "--batch": (ui.Batch,),
    "--runs-dir": (ui.RunsDir,),
}
OWN = {
    ("merge", "--threads"): "no -t: merge's -t is --type",
    ("rpc-server", "--threads"): "a fixed count: the server computes for remote clients, never adapts to the load",
}


def test_no_command_declares_a_shared_flag_again():
    seen = set()
    for name, fn in _commands().items():
        for flag, info in _options(fn).items():
            if flag not in SHARED or (name, flag) in OWN:
                continue
            seen.add(flag)
            assert any(info is _info(alias) for alias in SHARED[flag]), f"`toy {name}` declares {flag} itself"
    assert seen == set(SHARED)


def test_typer_builds_the_same_option_everywhere():
    """What users see: `--device` of toy infer, toy serve and toy vit
    classify has the same flags and help (and -t is --threads)."""

    def option(cmd, flag):
        return next(p for p in cmd.params if flag in p.opts)

    app = typer.Typer()
    app.command("infer")(infer_cmds.infer)
    app.command("serve")(toy_serve.cli.serve)
    cmds = typer.main.get_group(app).commands
    cmds = [cmds["infer"], cmds["serve"], typer.main.get_group(toy_vit.cli.app).commands["classify"]]
    for flag in ("--device", "--threads"):
        shown = {(tuple(option(c, flag).opts), option(c, flag).help) for c in cmds}
        assert len(shown) == 1, shown
    assert option(cmds[0], "--threads").opts == ["--threads", "-t"]


def test_run_training_is_toy_clis_public_api():
    assert train_cmds.run_training is ui.run_training
    assert eval_cmds.Progress is ui.Progress
    assert toy_vit.cli.run_training is ui.run_training


@pytest.mark.parametrize("path", ["toy-serve/src/toy_serve/cli.py", "toy-vit/src/toy_vit/cli.py"])
def test_plugins_use_public_names_of_toy_cli_ui_only(path):
    """No private name of toy-cli crosses into the distributions that plug into it."""
    tree = ast.parse((PACKAGES / path).read_text(encoding="utf-8"))
    imports = [
        (node.module, alias.name)
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("toy_cli")
        for alias in node.names
    ]
    assert imports, path
    for module, name in imports:
        assert module == "toy_cli.ui" and not name.startswith("_"), (module, name)
        assert name in ui.__all__, name
