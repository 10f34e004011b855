"""Progress on stderr: a rich bar on a terminal, plain lines otherwise.

Invariants: progress never goes to stdout (that is the data's); when stderr
is not a terminal there is no bar and no cursor movement, so logs and pipes
stay readable; rich is imported when the first bar starts, not at import;
``NO_COLOR`` is honoured by rich.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any

import typer

if TYPE_CHECKING:
    from rich.progress import Progress as RichProgress


def start_bar(*columns: Any, transient: bool) -> RichProgress:
    """A started ``rich.progress.Progress`` with these columns on stderr (the
    caller stops it)."""
    from rich.console import Console
    from rich.progress import Progress as RichProgress

    bar = RichProgress(*columns, console=Console(stderr=True), transient=transient)
    bar.start()
    return bar


class Progress:
    """Labelled tasks (download, extract, quantize, ...) with their counts: on
    a terminal a transient rich bar per label, otherwise one ``LABEL…`` line
    when a label first shows. A context manager: leaving it removes the bar."""

    def __init__(self) -> None:
        self._bar: RichProgress | None = None
        self._tasks: dict[str, Any] = {}  # label -> rich's TaskID on a terminal (else only the label matters)
        self._tty = sys.stderr.isatty()

    def update(self, label: str, done: int | None, total: int | None, *, bytes_: bool = False) -> None:
        """``done`` of ``total`` (None: unknown) for ``label``; ``bytes_``
        counts in bytes (the bar's first label decides its counter)."""
        if not self._tty:
            if label not in self._tasks:
                self._tasks[label] = 0
                typer.echo(f"{label}…", err=True)
            return
        if self._bar is None:
            from rich.progress import (
                BarColumn,
                DownloadColumn,
                MofNCompleteColumn,
                SpinnerColumn,
                TextColumn,
                TimeElapsedColumn,
            )

            counter = DownloadColumn() if bytes_ else MofNCompleteColumn()
            self._bar = start_bar(
                SpinnerColumn(),
                TextColumn("{task.description}"),
                BarColumn(),
                counter,
                TimeElapsedColumn(),
                transient=True,
            )
        if label not in self._tasks:
            self._tasks[label] = self._bar.add_task(label, total=total)
        self._bar.update(self._tasks[label], completed=done or 0, total=total)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()
            self._bar = None

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
