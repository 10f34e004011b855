"""The root group of ``toy``: subcommands are imported when they run.

``toy describe`` imports ``toy_cli.commands.models`` and builds the click
commands of that module only. ``toy --help`` imports no command module: its
list shows each built-in command's one-paragraph help from the table in
``toy_cli.main`` (a test checks that table against the commands' own help).
An unknown name builds every command, for the "Did you mean" line. Plugins
from the ``toy.commands`` entry-point group are looked up only for the list or
for a name that is not built in.

The list keeps the order typer gives when everything is registered up front:
commands before groups, and within each, the ones registered on the app
itself, then the built-in table in order, then the plugins.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import NamedTuple

import typer
import typer.main
from typer.core import TyperCommand, TyperGroup

Register = Callable[[typer.Typer], None]


class Lazy(NamedTuple):
    """A built-in subcommand: the module whose ``register(app)`` adds it, the
    first paragraph of its help (what ``toy --help`` lists) and whether it is
    a group."""

    module: str
    help: str
    group: bool = False


class LazyGroup(TyperGroup):
    """``TyperGroup`` whose built-in subcommands come from modules imported on
    demand. Subclasses set ``lazy`` (name -> ``Lazy``) and ``plugins`` (a
    ``register``-like staticmethod that adds the plugin commands, or None).
    ``stubs = False`` makes the help list build the real commands."""

    lazy: dict[str, Lazy] = {}
    plugins: Register | None = None
    stubs = True

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._rank = dict.fromkeys(self.commands, 0)  # registered on the app itself
        self._done: set[str] = set()  # modules (and "plugins") already added
        self._listing = False

    def _add(self, key: str, register: Register, rank: int) -> None:
        if key in self._done:
            return
        self._done.add(key)
        sub = typer.Typer()
        register(sub)
        for name, cmd in typer.main.get_group(sub).commands.items():
            self.commands.setdefault(name, cmd)
            self._rank.setdefault(name, rank)

    def _add_module(self, module: str) -> None:
        self._add(module, lambda app: importlib.import_module(module).register(app), 1)

    def _add_plugins(self) -> None:
        if self.plugins is not None:
            self._add("plugins", self.plugins, 2)

    def _add_all(self) -> None:
        for entry in self.lazy.values():
            self._add_module(entry.module)
        self._add_plugins()

    def _order(self, names: list[str]) -> list[str]:
        table = list(self.lazy)

        def key(item: tuple[int, str]):
            pos, name = item
            cmd = self.commands.get(name)
            group = isinstance(cmd, TyperGroup) if cmd is not None else self.lazy[name].group
            rank = 1 if name in self.lazy else self._rank.get(name, 2)
            return (group, rank, table.index(name) if name in self.lazy else pos)

        return [name for _, name in sorted(enumerate(names), key=key)]

    def format_help(self, ctx, formatter) -> None:
        self._listing = self.stubs
        try:
            return super().format_help(ctx, formatter)
        finally:
            self._listing = False

    def list_commands(self, ctx) -> list[str]:
        if self._listing:
            self._add_plugins()
            return self._order(list(self.commands) + [n for n in self.lazy if n not in self.commands])
        self._add_all()
        return self._order(list(self.commands))

    def get_command(self, ctx, cmd_name: str):
        if cmd_name in self.commands:
            return self.commands[cmd_name]
        entry = self.lazy.get(cmd_name)
        if entry is not None and self._listing:
            return TyperCommand(cmd_name, help=entry.help)  # read for its help line only
        if entry is not None:
            self._add_module(entry.module)
        else:
            self._add_all()
        return self.commands.get(cmd_name)
