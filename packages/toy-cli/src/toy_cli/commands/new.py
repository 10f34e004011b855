"""`toy new DIR`: write a project folder.

A project (``toy.project``): ``toy.toml`` (the defaults every command run
inside the folder reads: runs folder, default model, seed), ``data/`` with a
small text corpus (``sample.txt``: Python's documentation topics, about 60 KB,
from ``pydoc_data`` as ``toy train demo-corpus`` uses them) and a small chat
set (``chat.jsonl``: ``toy.train.demodata.write_demo_chat``), ``runs/``,
commented starter configs (``configs/from-scratch.toml``,
``configs/lora.toml``), a README and a ``.gitignore``. ``--lib`` adds a
library-composition project: a Python package ``src/<name>/`` that trains and
samples through toy's public API (a recipe, the registry, an engine), its
``pyproject.toml`` and ``tests/test_<name>.py`` (plain ``pytest``).

The templates are package data (``toy_cli/templates``); ``$name`` in them is
the project's name. The name is DIR's last part (``--name`` overrides it);
with ``--lib`` it must be a Python identifier (DIR ``my-lab`` gives
``my_lab``).

Decision on existing files: a folder with anything in it is refused (exit 2)
unless ``--force``; with ``--force`` toy writes only the files that are not
there yet and leaves every existing file as it is (listed as kept), so
``--force`` never deletes or overwrites user work.

Output: the files written, one a line, on stdout; what to run next on
stderr.
"""

from __future__ import annotations

import keyword
import re
import sys
from importlib import resources
from pathlib import Path
from string import Template
from typing import Annotated

import typer

from toy_cli.ui import bad_input, cli_errors

#: template (under toy_cli/templates) -> the path it is written to ($name: the project's name)
PROJECT_FILES = {
    "project/toy.toml": "toy.toml",
    "project/README.md": "README.md",
    "project/gitignore": ".gitignore",
    "project/configs/from-scratch.toml": "configs/from-scratch.toml",
    "project/configs/lora.toml": "configs/lora.toml",
}
LIB_FILES = {
    "lib/pyproject.toml": "pyproject.toml",
    "lib/package.py.tmpl": "src/$name/__init__.py",
    "lib/main.py.tmpl": "src/$name/__main__.py",
    "lib/test_package.py.tmpl": "tests/test_$name.py",
}
SAMPLE_CHARS = 60_000  # data/sample.txt: whole topics until at least this many characters
CHAT_EXAMPLES = 200  # data/chat.jsonl


def _name(folder: Path, given: str | None, lib: bool) -> str:
    name = given if given is not None else folder.resolve().name
    if lib:
        ident = given if given is not None else re.sub(r"[^0-9A-Za-z_]", "_", name).lower()
        if not ident.isidentifier() or keyword.iskeyword(ident):
            raise bad_input(
                f"{ident!r} is not a Python package name",
                "--lib needs a name that is a Python identifier: pass --name NAME (letters, digits, _)",
            )
        return ident
    if not name or name != name.strip() or any(c in name for c in '"\\\n'):
        raise bad_input(f"{name!r} cannot name a project", "pass --name NAME")
    return name


def _sample_text() -> str:
    from pydoc_data.topics import topics

    parts: list[str] = []
    size = 0
    for key in sorted(topics):
        parts.append(topics[key].strip() + "\n")
        size += len(parts[-1])
        if size >= SAMPLE_CHARS:
            break
    return "\n".join(parts)


def scaffold(
    folder: Path, *, lib: bool = False, name: str | None = None, force: bool = False
) -> list[tuple[Path, bool]]:
    """Write the project into ``folder``; returns (path, written) for every
    file of the scaffold (written False: it was there already, kept)."""
    if folder.exists() and not folder.is_dir():
        raise bad_input(f"{folder} is a file", "toy new DIR writes a project into a folder")
    if folder.is_dir() and any(folder.iterdir()) and not force:
        raise bad_input(
            f"{folder} is not empty",
            "pick a new folder, or add --force to add the missing files (existing files are kept as they are)",
        )
    project = _name(folder, name, lib)
    root = resources.files("toy_cli") / "templates"
    files: dict[str, str] = {}
    for src, dst in (PROJECT_FILES | (LIB_FILES if lib else {})).items():
        text = (root / src).read_text(encoding="utf-8")
        files[Template(dst).substitute(name=project)] = Template(text).safe_substitute(name=project)
    files["data/sample.txt"] = _sample_text()
    done: list[tuple[Path, bool]] = []
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "runs").mkdir(exist_ok=True)
    for rel, text in files.items():
        path = folder / rel
        if path.exists():
            done.append((path, False))
            continue
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
        done.append((path, True))
    chat = folder / "data" / "chat.jsonl"
    if chat.exists():
        done.append((chat, False))
    else:
        from toy.train.demodata import write_demo_chat

        write_demo_chat(chat, n=CHAT_EXAMPLES)
        done.append((chat, True))
    return done


def new(
    folder: Annotated[Path, typer.Argument(help="The project folder (created; it must be empty, else --force).")],
    lib: Annotated[
        bool,
        typer.Option(
            "--lib", help="Also write a Python package that trains and samples with toy's library API, with a test."
        ),
    ] = False,
    name: Annotated[
        str | None, typer.Option("--name", help="The project's name (default: the folder's; with --lib, as a package).")
    ] = None,
    force: Annotated[
        bool,
        typer.Option("--force", help="Write into a non-empty folder: add the missing files, keep every existing one."),
    ] = False,
) -> None:
    """Write a project: toy.toml (the defaults commands read inside it), data/, runs/, starter configs, a README."""
    with cli_errors():
        done = scaffold(folder, lib=lib, name=name, force=force)
    for path, written in done:
        typer.echo(f"{path}" if written else f"{path} (kept: it was there)")
    kept = sum(not w for _, w in done)
    step = f"cd {folder} && toy train from-scratch -c configs/from-scratch.toml"
    lines = [f"wrote a toy project in {folder}" + (f" ({kept} existing files kept)" if kept else ""), f"next: {step}"]
    if lib:
        lines.append(f"      cd {folder} && python -m pytest    (the package's own test)")
    print("\n".join(lines), file=sys.stderr)


def register(app: typer.Typer) -> None:
    app.command("new")(new)
