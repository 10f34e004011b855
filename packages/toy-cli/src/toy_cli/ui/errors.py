"""Errors on the command line: an ``error:`` line, an optional ``hint:`` line, an exit code.

toy's conventions (docs/concepts/architecture.md, "Conventions"): bad input
exits 2, other failures exit 1, each reported on stderr as ``error: MESSAGE``
and, when there is one, ``hint: HINT``, with no traceback unless ``--verbose``.

Invariants:

- The exit code comes from the exception's type, never from its text: a
  ``CLIError`` carries the code it was raised with, a ``toy.errors.ToyError``
  its class's ``exit_code`` (``BadInputError`` and its subclasses, a
  malformed GGUF file included, 2; the others 1).
- Importing this module imports neither ``toy`` nor ``toy_ggml`` (``toy
  --help`` stays fast): ``toy.errors`` is imported when a command enters
  ``cli_errors()`` or an error is classified.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager

BAD_INPUT = 2  # the exit code of input the user can fix
FAILURE = 1  # the exit code of everything else that went wrong

# set by the root command's --verbose on every run (a process may run several commands: tests do)
_state = {"verbose": False}


class CLIError(Exception):
    """An error the CLI reports as ``error: MESSAGE`` (and ``hint: HINT``),
    then exits with ``code`` (1 unless given; 2 for bad input, see
    ``bad_input``)."""

    def __init__(self, message: str, hint: str | None = None, code: int = FAILURE):
        super().__init__(message)
        self.hint = hint
        self.code = code

    @property
    def exit_code(self) -> int:
        """The exit code, under the name ``toy.errors.ToyError`` uses."""
        return self.code


def bad_input(message: str, hint: str | None = None) -> CLIError:
    """A ``CLIError`` for input the user can fix (exit 2)."""
    return CLIError(message, hint, BAD_INPUT)


def as_cli_error(exc: BaseException) -> CLIError | None:
    """``exc`` as the CLI reports it: a ``CLIError`` as it is, a toy error as
    a ``CLIError`` with its message, hint and exit code (caused by it); None
    for anything else."""
    if isinstance(exc, CLIError):
        return exc
    from toy.errors import ToyError

    if not isinstance(exc, ToyError):
        return None
    err = CLIError(str(exc), exc.hint, exc.exit_code)
    err.__cause__ = exc
    return err


@contextmanager
def cli_errors() -> Iterator[None]:
    """Turn the toy errors raised inside the block into ``CLIError`` with
    their exit code (other exceptions pass through)."""
    from toy.errors import ToyError

    try:
        yield
    except ToyError as e:
        raise CLIError(str(e), e.hint, e.exit_code) from e


def set_verbose(verbose: bool) -> None:
    """``--verbose``: ``report`` prints the traceback before the error line."""
    _state["verbose"] = verbose


def report(exc: BaseException, message: str, hint: str | None = None) -> None:
    """Print ``error: MESSAGE`` and ``hint: HINT`` on stderr (with ``--verbose``,
    ``exc``'s traceback first), in one write. On an MPI rank other than 0
    (``mpiexec -n N toy train``) each line starts with ``rank R: ``: every
    rank may report the same refusal, and the lines must not interleave."""
    if _state["verbose"]:
        import traceback

        traceback.print_exception(exc)
    from toy.train.distributed import launched_rank

    rank = launched_rank()
    lead = f"rank {rank}: " if rank else ""
    text = f"{lead}error: {message}\n" + (f"{lead}hint: {hint}\n" if hint else "")
    sys.stderr.write(text)
    sys.stderr.flush()


def handle_error(exc: Exception) -> int:
    """Report an exception that ended a command and return the exit code:
    the last line of defence of ``toy_cli.main.main``.

    A ``CLIError`` or toy error: its message, hint and exit code. A click
    usage error (typer carries its own copy of click, so click's exceptions
    are recognized by shape: ``format_message`` and ``exit_code``): its
    message, ``hint: see --help`` and exit 2. Anything else: its message,
    exit 2 for ``ValueError``, ``TypeError`` and ``FileNotFoundError`` (a
    bad argument that reached Python), else 1."""
    if isinstance(exc, CLIError):
        report(exc, str(exc), exc.hint)
        return exc.code
    if hasattr(exc, "format_message") and hasattr(exc, "exit_code"):
        code = int(exc.exit_code) if exc.exit_code else FAILURE
        if exc.format_message():  # empty: a group's no_args_is_help, whose help is already on the screen
            report(exc, exc.format_message(), "see --help" if code == BAD_INPUT else None)
        return code
    if type(exc).__name__ == "Exit" and hasattr(exc, "exit_code"):
        return int(exc.exit_code)
    if type(exc).__name__ == "Abort":
        print("error: aborted", file=sys.stderr)
        return FAILURE
    err = as_cli_error(exc)  # a toy error raised outside cli_errors()
    if err is not None:
        report(exc, str(exc) or type(exc).__name__, err.hint)
        return err.code
    code = BAD_INPUT if isinstance(exc, (ValueError, TypeError, FileNotFoundError)) else FAILURE
    report(exc, str(exc) or type(exc).__name__, getattr(exc, "hint", None))
    return code
