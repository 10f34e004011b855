"""toy's error classes. Library code raises; it never prints or exits (the
CLI turns these into ``error:`` lines and exit codes, the server into
OpenAI-shaped error bodies).

Invariants:

- Every error toy raises on purpose is a ``ToyError``; ``hint`` (optional)
  says what the user can do about it, and the class's ``exit_code`` is the
  CLI's exit status for it (1; 2 for bad input).
- A ``BadInputError`` is the caller's to fix: the CLI exits 2, the server
  answers 400. Its ``field`` (optional) names the offending input in the
  raising API's own terms: a keyword argument, a dataclass field or a config
  key (``temperature``, ``logit_bias``, ``n_ctx``), dotted for nested keys
  and list items (``model.head_dim``, ``messages.0.content``, ``stop.1``),
  as the server's ``param`` spells a path. ``prompt`` names the model's
  input (text, token ids or chat messages) at the APIs that take one (the
  engine's ``prefill`` says ``ids``). None when no single input is at
  fault. A front end translates ``field`` into its own vocabulary (the
  server into the request's ``param``, a CLI into an option name); the
  message stays readable on its own and is never parsed for the field.
- The error classes shared by several packages live here, so that every
  package imports them from the bottom layer (no package reaches up into
  ``toy.train`` or ``toy.runs`` for an error class); the modules that raise
  them re-export them under their old names.
"""


class ToyError(Exception):
    """Base of every error toy raises on purpose. ``hint`` (optional) says
    what the user can do about it."""

    exit_code = 1

    def __init__(self, message: str, hint: str | None = None):
        super().__init__(message)
        self.hint = hint


class BadInputError(ToyError):
    """An argument or input the caller can fix (a value out of range, an
    unknown option, an empty prompt): the CLI exits 2, the server answers 400.
    ``field`` names the offending input (see the module docstring), or None."""

    exit_code = 2

    def __init__(self, message: str, hint: str | None = None, field: str | None = None):
        super().__init__(message, hint)
        self.field = field


class ConfigError(BadInputError):
    """A configuration file or value is invalid; the message names the key
    (and ``field`` carries it, dotted: ``model.head_dim``)."""


class DataError(BadInputError):
    """Input data or a data setting is unusable: a corpus, an image, a folder
    of them, their cache."""


class PlotUnavailableError(BadInputError):
    """Plotting needs matplotlib, which is an optional extra (the hint says
    which package's extra to install)."""


__all__ = ["BadInputError", "ConfigError", "DataError", "PlotUnavailableError", "ToyError"]
